#include "model/optimizer.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "tensor/ops.h"

namespace moe {

AdamW::AdamW(std::vector<Param*> params, const AdamWConfig& cfg) : params_(std::move(params)), cfg_(cfg) {
  m_.reserve(params_.size());
  v_.reserve(params_.size());
  for (Param* p : params_) {
    m_.emplace_back(p->value.shape());  // zero-initialized
    v_.emplace_back(p->value.shape());
  }
}

double AdamW::clip_grad_norm(float max_norm, const std::function<double(double)>& sum_over_ranks) {
  double ss = 0, sharded = 0;
  for (Param* p : params_) {
    const float* g = p->grad.data();
    double local = 0;
    for (size_t i = 0; i < p->grad.numel(); ++i) local += static_cast<double>(g[i]) * g[i];
    (p->sharded() ? sharded : ss) += local;
  }
  if (sum_over_ranks) sharded = sum_over_ranks(sharded);
  const double norm = std::sqrt(ss + sharded);
  if (max_norm > 0 && std::isfinite(max_norm) && std::isfinite(norm) && norm > max_norm) {
    const float s = static_cast<float>(max_norm / norm);
    for (Param* p : params_) scale_inplace(p->grad.data(), s, static_cast<int64_t>(p->grad.numel()));
  }
  return norm;
}

void AdamW::step(float lr) {
  ++t_;
  for (size_t i = 0; i < params_.size(); ++i) {
    Param* p = params_[i];
    adamw_update(p->value.data(), p->grad.data(), m_[i].data(), v_[i].data(), static_cast<int64_t>(p->value.numel()),
                 lr, cfg_.beta1, cfg_.beta2, cfg_.eps, p->decay ? cfg_.weight_decay : 0.0f, t_);
  }
}

float lr_at(int64_t step, int64_t total_steps, int64_t warmup, float lr_max, float lr_min) {
  if (step < warmup) return lr_max * static_cast<float>(step + 1) / static_cast<float>(warmup);
  const double span = static_cast<double>(std::max<int64_t>(1, total_steps - warmup));
  const double progress = std::min(1.0, static_cast<double>(step - warmup) / span);
  return static_cast<float>(lr_min + 0.5 * (lr_max - lr_min) * (1.0 + std::cos(std::numbers::pi * progress)));
}

}  // namespace moe
