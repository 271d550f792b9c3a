// AdamW on the GPU for cuda::GpuModel: model/optimizer.h's AdamW (PyTorch semantics, decoupled weight
// decay on the parameters with decay, global-norm clipping with the squares summed in double,
// parameter by parameter in order), with f32 moments on the device. It reads and updates the model's
// f32 gradients and master weights whatever the model's dtype; under bf16, step() also refreshes the
// weights' bf16 copies (gpu_model.h). Its state moves to and from a CPU moe::AdamW (load_state /
// store_state), so a checkpoint's optimizer.safetensors is the same file whichever device wrote it,
// and a run resumes on either.
// Thread safety: none (the model's Context).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "cuda/gpu_model.h"
#include "model/optimizer.h"

namespace moe::cuda {

class GpuAdamW {
 public:
  // Zero moments for every model.params()[i], step 0. The model must outlive the optimizer.
  static Status create(Context& ctx, const GpuModel& model, const AdamWConfig& cfg, std::unique_ptr<GpuAdamW>* out);

  // As AdamW::clip_grad_norm on one process: *norm = the global L2 norm of the gradients before
  // clipping; when max_norm > 0 is finite, the norm finite and above it, every gradient is scaled by
  // max_norm / norm. Waits for the GPU (the norm is read back).
  Status clip_grad_norm(float max_norm, double* norm);
  // One AdamW step at learning rate lr (steps() increases by one first). Queued.
  Status step(float lr);

  int64_t steps() const { return t_; }
  const AdamWConfig& config() const { return cfg_; }
  // Moments and step from / to a CPU optimizer built over a moe::Model of the same config (its
  // params() in the GPU model's order; names and sizes are checked). Synchronous.
  Status load_state(const AdamW& host);
  Status store_state(AdamW* host) const;

 private:
  GpuAdamW(Context& ctx, const GpuModel& model, const AdamWConfig& cfg) : ctx_(ctx), model_(model), cfg_(cfg) {}
  Status check_host(const AdamW& host) const;

  Context& ctx_;
  const GpuModel& model_;
  AdamWConfig cfg_;
  std::vector<DeviceBuffer> m_, v_;  // [numel] f32 per parameter
  DeviceBuffer squares_;             // [P] f64: each parameter's sum of squared gradients
  std::vector<double> host_squares_;
  int64_t t_ = 0;
};

}  // namespace moe::cuda
