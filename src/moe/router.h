// Router (gate) phase: logits -> softmax -> top-k -> gate weights, plus the aux and z losses.
//
// Math (normative text: moe_layer.h):
//   logits[N,E] = x @ weight^T;  probs = softmax(logits);  (expert, prob)[N,K] = top-k of probs
//   gate weight  = prob                      if K == 1 or !renormalize
//                = prob / sum_k prob         if K > 1 and renormalize (over all K choices, BEFORE
//                                            capacity dropping; layout then zeroes dropped ones)
//   aux = E * sum_e f_e * P_e,  f_e = (# of the N*K choices that picked e) / (N*K),
//                               P_e = mean_n probs[n,e];   gradient through P_e only.
//   z   = mean_n lse_n^2,       lse_n = logsumexp(logits[n,:]).
//
// Batch statistics: f_e, P_e and the means are over the N tokens passed in. A distributed caller
// that wants the global-batch losses must reduce `load_frac`/`mean_prob` (and N) across ranks itself.
// No function here allocates, provided the Routing vectors were reserved (routing_reserve, layout.h).
#pragma once

#include <cstdint>

#include "moe/moe_layer.h"

namespace moe {

// True when gate weights are prob / sum_k prob.
inline bool gate_renormalized(int64_t K, bool renormalize) { return K > 1 && renormalize; }

// Gate forward. Sets r.N, r.K, r.E and resizes r.expert, r.prob, r.weight to N*K, then fills them:
// r.expert[n*K+k] / r.prob[n*K+k] = k-th largest prob of token n (descending; ties -> lower expert),
// r.weight = gate weight (no dropping yet). Other Routing fields are left to the layout phase.
// REQUIRES: 1 <= K <= E; N >= 0.
// bias [E] (null: none) is added to every row of logits: a constant (no gradient), e.g. the router
// skew of MoeConfig.
void router_forward(float* logits /*[N,E]*/, float* probs /*[N,E]*/, Routing& r, const float* x /*[N,C]*/,
                    const float* weight /*[E,C]*/, int64_t N, int64_t C, int64_t E, int64_t K, bool renormalize,
                    const float* bias /*[E] or null*/ = nullptr);

struct RouterLosses {
  float aux = 0;  // unweighted load-balancing loss
  float z = 0;    // unweighted router z-loss
};

// Aux and z losses of the routing just computed by router_forward. Saves what backward needs:
// lse[n] (logsumexp of logits row n) and load_frac[e] = f_e; mean_prob[e] = P_e (statistic only).
// Accumulates in double, serially in a fixed order: results do not depend on thread count.
// REQUIRES: r.expert filled by router_forward for these N tokens (before or after layout; layout
// never changes r.expert).
RouterLosses router_loss_forward(float* lse /*[N]*/, float* load_frac /*[E]*/, float* mean_prob /*[E]*/,
                                 const float* logits /*[N,E]*/, const float* probs /*[N,E]*/, const Routing& r,
                                 int64_t N, int64_t E);

// Gate backward, including the weighted aux and z terms.
//   dgate [N*K]: d(loss)/d(gate weight) of each assignment (combine_backward; 0 for dropped ones);
//                null = no gate-weight gradient (only the aux/z terms flow).
// ACCUMULATES into dx and dweight (null = skip). dprobs and dlogits are scratch (overwritten).
// loss_tokens: the token count the aux and z means run over (0 = N; a distributed caller passes the
// global batch's, and load_frac must then hold the global f_e).
// REQUIRES: router_forward + router_loss_forward on the same x, and r.weight as left by layout
// (dropped assignments may be zeroed; their dgate must then be 0, which combine_backward ensures).
void router_backward(float* dx /*[N,C] or null*/, float* dweight /*[E,C] or null*/, float* dprobs /*[N,E]*/,
                     float* dlogits /*[N,E]*/, const float* dgate /*[N*K] or null*/, const Routing& r,
                     const float* probs /*[N,E]*/, const float* lse /*[N]*/, const float* load_frac /*[E]*/,
                     const float* x /*[N,C]*/, const float* weight /*[E,C]*/, int64_t N, int64_t C, int64_t E,
                     bool renormalize, float aux_loss_weight, float z_loss_weight, int64_t loss_tokens = 0);

}  // namespace moe
