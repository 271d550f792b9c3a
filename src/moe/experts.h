// Experts phase: the FFN of every expert over its contiguous rows, as ONE GEMM chain per expert
// (no per-token loops). Needs no router: only a row buffer and per-expert row offsets, so a
// distributed runtime can run it on the rows an all-to-all delivered to its local experts.
//
//   rows [off[e], off[e+1]) of xp belong to expert e (0 <= e < E; E = the experts in the weight
//   buffers passed, e.g. a rank's local experts), and for those rows
//   GELU:   h1 = xp @ w1[e]^T;                 act = gelu(h1);           out = act @ w2[e]^T
//   SwiGLU: h1 = xp @ w1[e]^T; h3 = xp @ w3[e]^T; act = silu(h1) * h3;  out = act @ w2[e]^T
// Weights: w1 [E,F,C], w2 [E,C,F], w3 [E,F,C] (PyTorch Linear layout per expert).
// Only rows [off[0], off[E]) of the row buffers are read or written.
// Threads: where the experts' rows split evenly over OpenMP's threads (within 3%) and the GEMM kernel
// is oneDNN, each thread runs whole experts, every GEMM of an expert on its thread; else the experts
// run in turn with each GEMM on all threads (experts.cpp says why). Either way the results do not
// depend on which thread runs an expert; with one expert per thread, they equal a 1-thread run's.
#pragma once

#include <cstdint>
#include <vector>

#include "moe/moe_layer.h"
#include "tensor/ops.h"

namespace moe {

struct ExpertShape {
  int64_t E = 0, C = 0, F = 0;
  Activation activation = Activation::gelu;
};

// Forward. OVERWRITES out, h1, act (and h3 for SwiGLU), which backward needs unchanged.
// h3 and w3 may be null for GELU. REQUIRES: off non-decreasing; buffers hold off[E] rows.
void experts_forward(float* out /*[R,C]*/, float* h1 /*[R,F]*/, float* h3 /*[R,F] or null*/, float* act /*[R,F]*/,
                     const float* xp /*[R,C]*/, const int64_t* off /*[E+1]*/, const float* w1, const float* w2,
                     const float* w3, const ExpertShape& s);

// Backward. dxp is OVERWRITTEN (the row buffer is per step, like the forward output);
// dw1, dw2, dw3 ACCUMULATE (ops.h convention; null = skip). dact, dh1 and dh3 are
// scratch [R,F], overwritten (GELU uses only dact; dh3 may be null for GELU). REQUIRES: experts_forward with the same xp/off/weights just before
// and its h1, h3, act unchanged.
void experts_backward(float* dxp /*[R,C]*/, float* dw1 /*[E,F,C]*/, float* dw2 /*[E,C,F]*/,
                      float* dw3 /*[E,F,C] or null*/, float* dact /*[R,F]*/, float* dh1 /*[R,F]*/,
                      float* dh3 /*[R,F] or null*/, const float* dout /*[R,C]*/, const float* xp /*[R,C]*/,
                      const float* h1, const float* h3, const float* act, const int64_t* off /*[E+1]*/,
                      const float* w1, const float* w2, const float* w3, const ExpertShape& s);

// Which experts each of OpenMP's threads runs (largest first, each to the least-loaded thread), where
// experts_forward / experts_backward run one expert per thread; empty where they run the experts in
// turn, each GEMM on all threads (fewer than 2 threads, fewer experts than threads, rows more than 3%
// from even, or a GEMM kernel other than oneDNN). Experts without rows are in no list.
std::vector<std::vector<int64_t>> experts_thread_plan(const int64_t* off /*[E+1]*/, int64_t E);

// The six GEMMs one GELU expert runs per step on `rows` rows (forward 2, backward 4), as
// experts_forward / experts_backward call them: what the GEMM kernel is chosen and benchmarked on.
std::vector<GemmShape> expert_gemm_shapes(int64_t rows, int64_t C, int64_t F);

}  // namespace moe
