#include "moe/router.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "tensor/ops.h"

namespace moe {

void router_forward(float* logits, float* probs, Routing& r, const float* x, const float* weight, int64_t N,
                    int64_t C, int64_t E, int64_t K, bool renormalize, const float* bias) {
  if (K < 1 || K > E) throw std::logic_error("router_forward: REQUIRES 1 <= K <= E");
  r.N = N;
  r.K = K;
  r.E = E;
  r.expert.resize(N * K);
  r.prob.resize(N * K);
  r.weight.resize(N * K);
  if (N == 0) return;
  linear_forward(logits, x, weight, N, C, E);
  // One loop over all rows: add_inplace per row opened a parallel region per token (2,048 a layer),
  // which cost ~1.7 ms a layer, more than the rest of the gate.
  if (bias) {
#pragma omp parallel for schedule(static) if (N * E > 16384)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t e = 0; e < E; ++e) logits[n * E + e] += bias[e];
  }
  softmax_forward(probs, logits, N, E);
  topk_forward(r.prob.data(), r.expert.data(), probs, N, E, K);
  const bool renorm = gate_renormalized(K, renormalize);
  const float* p = r.prob.data();
  float* w = r.weight.data();
#pragma omp parallel for schedule(static) if (N * K > 4096)
  for (int64_t n = 0; n < N; ++n) {
    const float* pn = p + n * K;
    float* wn = w + n * K;
    if (renorm) {
      float s = 0;
      for (int64_t k = 0; k < K; ++k) s += pn[k];
      const float inv = 1.0f / s;
      for (int64_t k = 0; k < K; ++k) wn[k] = pn[k] * inv;
    } else {
      for (int64_t k = 0; k < K; ++k) wn[k] = pn[k];
    }
  }
}

RouterLosses router_loss_forward(float* lse, float* load_frac, float* mean_prob, const float* logits,
                                 const float* probs, const Routing& r, int64_t N, int64_t E) {
  RouterLosses out;
  for (int64_t e = 0; e < E; ++e) load_frac[e] = 0, mean_prob[e] = 0;
  if (N == 0) return out;
  const int64_t K = r.K;
  // f_e: share of the N*K choices (before dropping) that picked e.
  for (int64_t a = 0; a < N * K; ++a) load_frac[r.expert[a]] += 1.0f;
  const float inv_nk = 1.0f / static_cast<float>(N * K);
  for (int64_t e = 0; e < E; ++e) load_frac[e] *= inv_nk;
  // lse per row (parallel, per-row deterministic), then the serial reductions.
#pragma omp parallel for schedule(static) if (N * E > 16384)
  for (int64_t n = 0; n < N; ++n) {
    const float* l = logits + n * E;
    float m = l[0];
    for (int64_t e = 1; e < E; ++e) m = std::max(m, l[e]);
    double s = 0;
    for (int64_t e = 0; e < E; ++e) s += std::exp(static_cast<double>(l[e]) - m);
    lse[n] = static_cast<float>(m + std::log(s));
  }
  double z = 0;
  for (int64_t n = 0; n < N; ++n) z += static_cast<double>(lse[n]) * lse[n];
  double aux = 0;
  for (int64_t e = 0; e < E; ++e) {
    double pe = 0;
    for (int64_t n = 0; n < N; ++n) pe += probs[n * E + e];
    pe /= static_cast<double>(N);
    mean_prob[e] = static_cast<float>(pe);
    aux += static_cast<double>(load_frac[e]) * pe;
  }
  out.aux = static_cast<float>(static_cast<double>(E) * aux);
  out.z = static_cast<float>(z / static_cast<double>(N));
  return out;
}

void router_backward(float* dx, float* dweight, float* dprobs, float* dlogits, const float* dgate,
                     const Routing& r, const float* probs, const float* lse, const float* load_frac,
                     const float* x, const float* weight, int64_t N, int64_t C, int64_t E, bool renormalize,
                     float aux_loss_weight, float z_loss_weight, int64_t loss_tokens) {
  if (N == 0) return;
  const int64_t K = r.K;
  const bool renorm = gate_renormalized(K, renormalize);
  const float n_mean = static_cast<float>(loss_tokens > 0 ? loss_tokens : N);
  // d aux / d probs[n,e] = E * f_e / N (f_e is treated as a constant: Switch Transformer).
  const float aux_scale = aux_loss_weight * static_cast<float>(E) / n_mean;
  const float z_scale = z_loss_weight * 2.0f / n_mean;
#pragma omp parallel for schedule(static) if (N * E > 16384)
  for (int64_t n = 0; n < N; ++n) {
    float* dp = dprobs + n * E;
    for (int64_t e = 0; e < E; ++e) dp[e] = aux_scale * load_frac[e];
    if (dgate) {
      const float* g = dgate + n * K;
      const float* p = r.prob.data() + n * K;
      const int32_t* ex = r.expert.data() + n * K;
      if (renorm) {
        // w_k = p_k / S  =>  dL/dp_j = (g_j - sum_k g_k w_k) / S   (S over all K choices)
        float s = 0;
        for (int64_t k = 0; k < K; ++k) s += p[k];
        const float inv = 1.0f / s;
        float gw = 0;
        for (int64_t k = 0; k < K; ++k) gw += g[k] * p[k] * inv;
        for (int64_t k = 0; k < K; ++k) dp[ex[k]] += (g[k] - gw) * inv;
      } else {
        for (int64_t k = 0; k < K; ++k) dp[ex[k]] += g[k];
      }
    }
  }
  // dlogits = softmax_backward(dprobs) + z term; d z / d logits[n,e] = 2 lse_n probs[n,e] / N.
  std::memset(dlogits, 0, static_cast<size_t>(N * E) * sizeof(float));
  softmax_backward(dlogits, dprobs, probs, N, E);
#pragma omp parallel for schedule(static) if (N * E > 16384)
  for (int64_t n = 0; n < N; ++n) {
    const float zl = z_scale * lse[n];
    for (int64_t e = 0; e < E; ++e) dlogits[n * E + e] += zl * probs[n * E + e];
  }
  linear_backward(dx, dweight, dlogits, x, weight, N, C, E);
}

}  // namespace moe
