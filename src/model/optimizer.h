// AdamW (decoupled weight decay, as torch.optim.AdamW), global-norm gradient clipping, and the
// learning-rate schedule of `moe train`.
#pragma once

#include <cstdint>
#include <vector>

#include "tensor/tensor.h"

namespace moe {

struct AdamWConfig {
  float lr = 3e-3f;
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
  float weight_decay = 0.1f;   // applied only to params with decay == true (matrices, not norms)
  float grad_clip = 1.0f;      // informational here; the trainer passes it to clip_grad_norm
};

// Thread safety: none. The params are borrowed and must outlive the optimizer.
class AdamW {
 public:
  AdamW(std::vector<Param*> params, const AdamWConfig& cfg);

  // Scales every gradient by min(1, max_norm / norm) and returns the global L2 norm before
  // clipping (summed in double in parameter order: deterministic). max_norm = +inf only measures.
  double clip_grad_norm(float max_norm);
  // One AdamW step at learning rate lr over every parameter; steps() increases by one.
  void step(float lr);

  int64_t steps() const { return t_; }
  void set_steps(int64_t t) { t_ = t; }
  const std::vector<Param*>& params() const { return params_; }
  const AdamWConfig& config() const { return cfg_; }
  // First and second moments of params()[i], same shape as the parameter.
  Tensor& m(size_t i) { return m_[i]; }
  Tensor& v(size_t i) { return v_[i]; }
  const Tensor& m(size_t i) const { return m_[i]; }
  const Tensor& v(size_t i) const { return v_[i]; }

 private:
  std::vector<Param*> params_;
  AdamWConfig cfg_;
  std::vector<Tensor> m_, v_;
  int64_t t_ = 0;
};

// Learning rate at 0-based step `step` of a run of total_steps: linear warmup over the first
// `warmup` steps (lr_max * (step + 1) / warmup), then cosine decay from lr_max at step = warmup to
// lr_min at step = total_steps. A pure function of its arguments, so a resumed run follows the
// same schedule.
float lr_at(int64_t step, int64_t total_steps, int64_t warmup, float lr_max, float lr_min);

}  // namespace moe
