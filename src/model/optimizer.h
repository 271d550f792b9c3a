// AdamW (decoupled weight decay, as torch.optim.AdamW), global-norm gradient clipping, and the
// learning-rate schedule of `moe train`.
#pragma once

#include <cstdint>
#include <functional>
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

  // Scales every gradient by max_norm / norm when norm > max_norm and returns the global L2 norm
  // before clipping: squares summed in double, parameter by parameter in order, so the result does
  // not depend on the thread count. max_norm <= 0 or +inf only measures. A non-finite norm
  // (NaN/Inf gradients) is returned and nothing is scaled.
  //
  // Sharded params (Param::sharded) hold only this rank's rows: their squares are summed apart and
  // passed through `sum_over_ranks` (e.g. an allreduce) before joining the replicated params' sum,
  // so every rank gets the norm of the whole model. Null: one process holds everything.
  double clip_grad_norm(float max_norm, const std::function<double(double)>& sum_over_ranks = nullptr);
  // One AdamW step (ops.h adamw_update, PyTorch semantics) at learning rate lr over every
  // parameter, weight decay only where Param::decay; steps() increases by one first (t >= 1).
  void step(float lr);

  // Steps taken (Adam's t; bias correction uses it). set_steps restores it from a checkpoint.
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

// Learning rate at 0-based step `step` of a run of total_steps:
//   step <  warmup:   lr_max * (step + 1) / warmup        (linear; the last warmup step is lr_max)
//   step >= warmup:   lr_min + (lr_max - lr_min) * (1 + cos(pi * p)) / 2,
//                     p = min(1, (step - warmup) / max(1, total_steps - warmup))
// so step = warmup gives lr_max and step >= total_steps gives lr_min. warmup = 0: no warmup.
// A pure function of its arguments, so a resumed run follows the same schedule.
float lr_at(int64_t step, int64_t total_steps, int64_t warmup, float lr_max, float lr_min);

}  // namespace moe
