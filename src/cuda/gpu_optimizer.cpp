// AdamW on the GPU (gpu_optimizer.h): model/optimizer.cpp's steps on cuda/ops.h kernels.
#include "cuda/gpu_optimizer.h"

#include <algorithm>
#include <cmath>

#include "cuda/ops.h"
#include "util/str_cat.h"

namespace moe::cuda {

Status GpuAdamW::create(Context& ctx, const GpuModel& model, const AdamWConfig& cfg, std::unique_ptr<GpuAdamW>* out) {
  std::unique_ptr<GpuAdamW> o(new GpuAdamW(ctx, model, cfg));
  const std::vector<DeviceParam>& ps = model.params();
  o->m_.resize(ps.size());
  o->v_.resize(ps.size());
  for (size_t i = 0; i < ps.size(); ++i)
    for (DeviceBuffer* b : {&o->m_[i], &o->v_[i]}) {
      if (Status s = b->allocate(static_cast<size_t>(std::max<int64_t>(1, ps[i].numel)) * sizeof(float)); !s) return s;
      if (Status s = fill_zero(ctx, b->get(), static_cast<int64_t>(b->bytes())); !s) return s;
    }
  if (Status s = o->squares_.allocate(std::max<size_t>(1, ps.size()) * sizeof(double)); !s) return s;
  o->host_squares_.resize(ps.size());
  if (Status s = ctx.synchronize(); !s) return s;
  *out = std::move(o);
  return Status::ok();
}

Status GpuAdamW::clip_grad_norm(float max_norm, double* norm) {
  const std::vector<DeviceParam>& ps = model_.params();
  for (size_t i = 0; i < ps.size(); ++i)
    if (Status s = sum_squares(ctx_, DType::f32, squares_.as<double>() + i, ps[i].grad, ps[i].numel); !s) return s;
  if (Status s = copy_to_host(ctx_, host_squares_.data(), squares_.get(), host_squares_.size() * sizeof(double)); !s)
    return s;
  // Parameter by parameter, in order (AdamW::clip_grad_norm; nothing is sharded on one GPU).
  double ss = 0;
  for (double x : host_squares_) ss += x;
  *norm = std::sqrt(ss);
  if (max_norm > 0 && std::isfinite(max_norm) && std::isfinite(*norm) && *norm > max_norm) {
    const float scale = static_cast<float>(max_norm / *norm);
    for (const DeviceParam& p : ps)
      if (Status s = scale_inplace(ctx_, DType::f32, p.grad, scale, p.numel); !s) return s;
  }
  return Status::ok();
}

Status GpuAdamW::step(float lr) {
  ++t_;
  const std::vector<DeviceParam>& ps = model_.params();
  for (size_t i = 0; i < ps.size(); ++i) {
    const DeviceParam& p = ps[i];
    // On the f32 masters and gradients whatever the model's dtype. Under bf16 the copy the forward
    // reads is then rounded from the new master: adamw_update's fused param_out cannot write it, as
    // that kernel reads the gradient in param_out's dtype and the gradients are f32.
    if (Status s = adamw_update(ctx_, DType::f32, p.value, nullptr, p.grad, m_[i].as<float>(), v_[i].as<float>(),
                                p.numel, lr, cfg_.beta1, cfg_.beta2, cfg_.eps, p.decay ? cfg_.weight_decay : 0.0f, t_);
        !s)
      return s;
    if (Status s = refresh_weight_copy(ctx_, p); !s) return s;
  }
  return Status::ok();
}

Status GpuAdamW::check_host(const AdamW& host) const {
  const std::vector<DeviceParam>& ps = model_.params();
  if (host.params().size() != ps.size())
    return Status::error(str_cat("cuda AdamW: the host optimizer has ", host.params().size(), " parameters, the GPU's ",
                                 ps.size()));
  for (size_t i = 0; i < ps.size(); ++i) {
    const Param& hp = *host.params()[i];
    if (hp.name != ps[i].name || static_cast<int64_t>(host.m(i).numel()) != ps[i].numel ||
        static_cast<int64_t>(host.v(i).numel()) != ps[i].numel)
      return Status::error(str_cat("cuda AdamW: host parameter ", i, " (", hp.name, ", ", host.m(i).numel(),
                                   " values) does not match the GPU's ", ps[i].name, " (", ps[i].numel, ")"));
  }
  return Status::ok();
}

Status GpuAdamW::load_state(const AdamW& host) {
  if (Status s = check_host(host); !s) return s;
  const std::vector<DeviceParam>& ps = model_.params();
  for (size_t i = 0; i < ps.size(); ++i) {
    const size_t bytes = static_cast<size_t>(ps[i].numel) * sizeof(float);
    if (Status s = copy_to_device(ctx_, m_[i].get(), host.m(i).data(), bytes); !s) return s;
    if (Status s = copy_to_device(ctx_, v_[i].get(), host.v(i).data(), bytes); !s) return s;
  }
  t_ = host.steps();
  return Status::ok();
}

Status GpuAdamW::store_state(AdamW* host) const {
  if (Status s = check_host(*host); !s) return s;
  const std::vector<DeviceParam>& ps = model_.params();
  for (size_t i = 0; i < ps.size(); ++i) {
    const size_t bytes = static_cast<size_t>(ps[i].numel) * sizeof(float);
    if (Status s = copy_to_host(ctx_, host->m(i).data(), m_[i].get(), bytes); !s) return s;
    if (Status s = copy_to_host(ctx_, host->v(i).data(), v_[i].get(), bytes); !s) return s;
  }
  host->set_steps(t_);
  return Status::ok();
}

}  // namespace moe::cuda
