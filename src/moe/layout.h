// Layout phase: where each (token, choice) assignment goes. A counting sort of the N*K assignments
// into expert-contiguous rows (stable: rows of one expert are in increasing token order), with
// capacity dropping in the GLOBAL order of moe_layer.h: all first choices in token order, then all
// second choices, ... So which assignments are dropped depends only on the batch, never on how ranks
// split it (invariant 1, docs/architecture.md). O(N*K + E*K), no allocation once routing_reserve has run.
#pragma once

#include <cstdint>

#include "moe/moe_layer.h"

namespace moe {

// Reserves every Routing vector for up to max_tokens tokens, so later steps never allocate.
void routing_reserve(Routing& r, int64_t max_tokens, int64_t K, int64_t E);

// Per-expert capacity for capacity_factor cf: ceil(double(cf) * N * K / E); -1 (= unlimited) when
// cf <= 0. The one definition every caller (single process, distributed runtime) must use.
int64_t expert_capacity(float capacity_factor, int64_t N, int64_t K, int64_t E);

// Size of layout_build's scratch: E*K + E counters.
inline int64_t layout_scratch_size(int64_t E, int64_t K) { return E * K + E; }

// Builds the layout from r.expert (and r.weight):
//   - r.tokens_per_expert[e] = kept assignments of expert e; r.dropped = N*K - sum of them;
//   - r.expert_offset[E+1] = exclusive prefix sum of tokens_per_expert (r.rows() = R);
//   - r.row_token[R], r.row_assignment[R]: for expert e, rows [off[e], off[e+1]) are its kept
//     assignments in increasing token order; row_assignment = n*K + k, row_token = n;
//   - r.weight[a] = 0 for every dropped assignment a (kept weights untouched).
// capacity < 0: dropless. capacity >= 0: expert e keeps the first `capacity` assignments that chose
// it in the global order (k ascending, then n ascending).
// REQUIRES: r.N, r.K, r.E set; r.expert and r.weight of size N*K with 0 <= expert < E and the K
// experts of one token distinct (true for top-k); scratch of layout_scratch_size(E, K) entries.
//
// When these N tokens are one rank's share of a global batch (expert parallelism), `prior` [E*K]
// gives, for each (expert e, choice k), how many assignments to e come before this rank's choice-k
// assignments in the global order (all choices < k of every rank, plus choice k of lower ranks);
// then this rank keeps exactly the assignments the single-process layout of the whole batch keeps.
// prior = null: these N tokens are the whole batch.
void layout_build(Routing& r, int64_t capacity, int64_t* scratch, const int64_t* prior = nullptr);

}  // namespace moe
