// The MoE layer on one GPU, built from cuda/ops.h: router (linear, softmax, top-k, renormalized gate
// weights), permute to expert-contiguous rows, the experts' two grouped GEMMs around GELU, and the
// gate-scaled un-permute; backward through all of it. Dropless (no capacity), no auxiliary losses:
// the expert-parallel, capacity and loss logic stay in moe/moe_layer.h; this is the compute a GPU
// rank runs between its all-to-alls, and what `moe bench cuda` times.
//
// Math, per token n (letters: tensor/tensor.h):
//   probs[n,:] = softmax(x[n] wg^T);  (e_k, p_k) = top-k;  g_k = p_k / sum_j p_j (K > 1)
//   y[n] = sum_k g_k * w2[e_k] gelu(w1[e_k] x[n])
// Weights (device, storage type dt): wg [E,C], w1 [E,F,C], w2 [E,C,F]; gradients the same shapes,
// ACCUMULATED by backward (zero them per step).
//
// The layout (expert counts and each assignment's row) is built on the host from the top-k indices:
// forward synchronizes the stream once for it, as the EP path must (the counts size the all-to-all).
// Thread safety: none; one thread drives a layer and its Context.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "cuda/device.h"

namespace moe::cuda {

struct MoeShape {
  int64_t C = 0, F = 0, E = 0, K = 0;
  bool renormalize = true;
};

class MoeLayer {
 public:
  // Allocates weights, gradients and every activation for up to max_tokens tokens. Weights start at
  // zero: set them with the device pointers below. REQUIRES: 1 <= K <= min(E, 16), dims > 0.
  static Status create(Context& ctx, DType dt, const MoeShape& shape, int64_t max_tokens,
                       std::unique_ptr<MoeLayer>* out);

  // y[N,C] = layer(x[N,C]); saves what backward needs. REQUIRES: N <= max_tokens.
  Status forward(void* y, const void* x, int64_t N);
  // dx[N,C] += d/dx, weight gradients += d/dW, for the x of the last forward.
  Status backward(void* dx, const void* dy);

  void* wg() { return wg_.get(); }
  void* w1() { return w1_.get(); }
  void* w2() { return w2_.get(); }
  void* dwg() { return dwg_.get(); }
  void* dw1() { return dw1_.get(); }
  void* dw2() { return dw2_.get(); }
  // Rows each expert received in the last forward (host), and the FLOPs of one forward+backward
  // over them (router and experts: 2 per multiply-add, backward twice the forward).
  const std::vector<int64_t>& expert_offsets() const { return off_; }
  double flops_forward_backward() const;

 private:
  MoeLayer(Context& ctx, DType dt, const MoeShape& s, int64_t max_tokens) : ctx_(ctx), dt_(dt), s_(s), max_n_(max_tokens) {}
  Status allocate();

  Context& ctx_;
  DType dt_;
  MoeShape s_;
  int64_t max_n_, n_ = 0, rows_ = 0;
  const void* x_ = nullptr;  // the last forward's input (caller-owned; must live until backward)
  DeviceBuffer wg_, w1_, w2_, dwg_, dw1_, dw2_;
  DeviceBuffer logits_, probs_, top_values_, top_index_, gate_, token_rows_, row_token_, ones_;
  DeviceBuffer xp_, h_, act_, out_rows_;                        // [R,C] [R,F] [R,F] [R,C]
  DeviceBuffer d_out_rows_, dact_, dh_, dxp_, dgate_, dprobs_, dlogits_;
  std::vector<int32_t> host_index_, host_token_rows_, host_row_token_;
  std::vector<int64_t> off_;
};

}  // namespace moe::cuda
