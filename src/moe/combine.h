// Dispatch and combine phases: move token rows into expert order and back.
//   dispatch: xp[r] = x[row_token[r]]                                    (permute, N -> R rows)
//   combine:  y[n]  = sum over rows r of token n of weight[row_assignment[r]] * outp[r]
//             (rows of one token summed in increasing r, i.e. by expert index: deterministic and
//              independent of thread count; tokens with every assignment dropped get y = 0)
// In a distributed step the all-to-all sits between dispatch and the experts, and between the
// experts and combine; the row order defined by layout.h is the contract on both sides.
#pragma once

#include <cstdint>

#include "moe/moe_layer.h"

namespace moe {

// xp = x permuted into expert order (OVERWRITES the R = r.rows() rows of xp).
void dispatch_forward(float* xp /*[R,C]*/, const float* x /*[N,C]*/, const Routing& r, int64_t C);
// dx[row_token[r]] += dxp[r]  (ACCUMULATES, ops.h convention).
void dispatch_backward(float* dx /*[N,C]*/, const float* dxp /*[R,C]*/, const Routing& r, int64_t C);

// y = weighted sum of expert outputs per token (OVERWRITES all N rows of y).
// row_weight is scratch [R] (overwritten with weight[row_assignment[r]]).
void combine_forward(float* y /*[N,C]*/, float* row_weight /*[R]*/, const float* outp /*[R,C]*/, const Routing& r,
                     int64_t C);
// Given dy = d(loss)/dy: doutp[r] = weight[a] * dy[n] (OVERWRITES), and
// dgate[a] = dot(dy[n], outp[r]) for kept assignments, 0 for dropped ones (OVERWRITES all N*K),
// where r is a row, a = row_assignment[r], n = row_token[r]. dgate may be null (skipped).
void combine_backward(float* doutp /*[R,C]*/, float* dgate /*[N*K] or null*/, const float* dy /*[N,C]*/,
                      const float* outp /*[R,C]*/, const Routing& r, int64_t C);

}  // namespace moe
