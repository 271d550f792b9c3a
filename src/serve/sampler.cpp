#include "serve/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "model/data.h"

namespace moe::serve {

Status SamplingParams::validate() const {
  if (!(temperature >= 0) || !std::isfinite(temperature))
    return Status::error("temperature (" + std::to_string(temperature) + ") must be >= 0 (0: greedy)");
  if (top_k < 0) return Status::error("top_k (" + std::to_string(top_k) + ") must be >= 0 (0: all tokens)");
  if (!(top_p > 0 && top_p <= 1)) return Status::error("top_p (" + std::to_string(top_p) + ") must be in (0, 1]");
  return Status::ok();
}

Sampler::Sampler(const SamplingParams& p, uint64_t stream) : p_(p), rng_(splitmix64(p.seed ^ splitmix64(stream))) {}

int32_t Sampler::next(const float* logits, int64_t V) {
  if (p_.temperature == 0) return static_cast<int32_t>(std::max_element(logits, logits + V) - logits);
  // Tokens by descending logit (ties to the lower id), so top-k and top-p cut a prefix.
  order_.resize(V);
  std::iota(order_.begin(), order_.end(), 0);
  std::stable_sort(order_.begin(), order_.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  int64_t keep = p_.top_k > 0 ? std::min<int64_t>(p_.top_k, V) : V;
  prob_.resize(keep);
  const double mx = logits[order_[0]];
  double sum = 0;
  for (int64_t i = 0; i < keep; ++i) sum += prob_[i] = std::exp((logits[order_[i]] - mx) / p_.temperature);
  if (p_.top_p < 1) {
    double mass = 0;
    int64_t i = 0;
    while (i < keep && mass < p_.top_p * sum) mass += prob_[i++];
    keep = std::max<int64_t>(i, 1);
    sum = std::accumulate(prob_.begin(), prob_.begin() + keep, 0.0);
  }
  const double u = static_cast<double>(rng_() >> 11) * 0x1.0p-53 * sum;
  double cdf = 0;
  for (int64_t i = 0; i < keep; ++i) {
    cdf += prob_[i];
    if (u < cdf) return order_[i];
  }
  return order_[keep - 1];
}

}  // namespace moe::serve
