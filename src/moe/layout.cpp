#include "moe/layout.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace moe {

void routing_reserve(Routing& r, int64_t max_tokens, int64_t K, int64_t E) {
  const size_t nk = static_cast<size_t>(max_tokens * K);
  r.expert.reserve(nk);
  r.prob.reserve(nk);
  r.weight.reserve(nk);
  r.row_token.reserve(nk);
  r.row_assignment.reserve(nk);
  r.expert_offset.reserve(static_cast<size_t>(E + 1));
  r.tokens_per_expert.reserve(static_cast<size_t>(E));
}

int64_t expert_capacity(float capacity_factor, int64_t N, int64_t K, int64_t E) {
  if (!(capacity_factor > 0.0f)) return -1;
  return static_cast<int64_t>(std::ceil(static_cast<double>(capacity_factor) * static_cast<double>(N * K) /
                                        static_cast<double>(E)));
}

void layout_build(Routing& r, int64_t capacity, int64_t* scratch, const int64_t* prior) {
  const int64_t N = r.N, K = r.K, E = r.E;
  const int64_t NK = N * K;
  if (static_cast<int64_t>(r.expert.size()) != NK || static_cast<int64_t>(r.weight.size()) != NK)
    throw std::logic_error("layout_build: REQUIRES r.expert and r.weight of size N*K");
  int64_t* quota = scratch;           // [E*K] first count[e,k], then what expert e keeps of rank k
  int64_t* cursor = scratch + E * K;  // [E] next free row of expert e
  // 1. count[e,k] = tokens whose k-th choice is e (kept in `quota`).
  std::fill(quota, quota + E * K, 0);
  const int32_t* ex = r.expert.data();
  for (int64_t a = 0; a < NK; ++a) {
    const int32_t e = ex[a];
    if (e < 0 || e >= E) throw std::logic_error("layout_build: expert index out of range");
    ++quota[e * K + a % K];
  }
  // 2. Global order is k-major: expert e's capacity goes to its first choices, then its second
  //    choices, ...; within choice rank k the kept ones are the first quota[e,k] tokens in token
  //    order. So quota[e,k] = min(count[e,k], capacity left after ranks < k).
  const int64_t cap = capacity < 0 ? std::numeric_limits<int64_t>::max() : capacity;
  r.tokens_per_expert.resize(E);
  r.expert_offset.resize(E + 1);
  r.expert_offset[0] = 0;
  for (int64_t e = 0; e < E; ++e) {
    int64_t left = cap, t = 0;
    for (int64_t k = 0; k < K; ++k) {
      int64_t& q = quota[e * K + k];
      if (prior) left = cap == std::numeric_limits<int64_t>::max() ? cap : std::max<int64_t>(0, cap - prior[e * K + k]);
      q = std::min(q, left);
      left -= q;
      t += q;
    }
    r.tokens_per_expert[e] = t;
    r.expert_offset[e + 1] = r.expert_offset[e] + t;
    cursor[e] = r.expert_offset[e];
  }
  const int64_t kept = r.expert_offset[E];
  r.dropped = NK - kept;
  r.row_token.resize(kept);
  r.row_assignment.resize(kept);
  // 3. Placement, one pass in token order (so each expert's rows come out in increasing token
  //    order); quota[e,k] counts down: positive means the next such assignment is kept.
  float* w = r.weight.data();
  int32_t* rt = r.row_token.data();
  int32_t* ra = r.row_assignment.data();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t a = n * K + k;
      const int32_t e = ex[a];
      int64_t& q = quota[e * K + k];
      if (q > 0) {
        --q;
        const int64_t row = cursor[e]++;
        rt[row] = static_cast<int32_t>(n);
        ra[row] = static_cast<int32_t>(a);
      } else {
        w[a] = 0.0f;
      }
    }
}

}  // namespace moe
