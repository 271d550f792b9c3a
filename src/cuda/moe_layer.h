// The MoE layer on one GPU, built from cuda/ops.h: the CPU layer's single-process math (moe/moe_layer.h)
// op for op: router (linear, optional constant bias, softmax, top-k, gate weights), the aux and z
// losses, expert-contiguous layout with optional capacity dropping, permute, the experts' grouped GEMMs
// around GELU or SwiGLU, and the gate-scaled un-permute; backward through all of it, the losses'
// gradients included. No expert parallelism: this is the compute a GPU rank runs between its
// all-to-alls, what `moe bench cuda` times, and the MoE block of cuda::GpuModel (gpu_model.h).
//
// Math, per token n (letters: tensor/tensor.h):
//   probs[n,:] = softmax(x[n] wg^T + bias);  (e_k, p_k) = top-k;  g_k = p_k / sum_j p_j (K > 1, renormalize)
//   y[n] = sum_k g_k * w2[e_k] act(x[n])    act = gelu(w1 x)  or  silu(w1 x) * (w3 x)  (SwiGLU)
//   aux = E sum_e f_e P_e;  z = mean_n lse_n^2  (moe/router.h; their gradients weighted by MoeShape)
//   capacity_factor > 0: expert e keeps its first moe::expert_capacity(cf, N, K, E) assignments in the
//   global order of moe/layout.h (the host runs that very layout code), a dropped one contributes 0.
// Weights (device): the experts' w1 [E,F,C], w2 [E,C,F], w3 [E,F,C] (SwiGLU) in the storage type dt;
// the router's wg [E,C] in f32 whatever dt. Gradients the same shapes and types, ACCUMULATED by
// backward (zero them per step).
//
// The router runs in f32 whatever dt: its logits, probabilities, their gradients and wg. Rounded to
// bf16, the probabilities of experts closer than one bf16 step (2^-9 near 0.25) would tie, and top-k
// would then always pick the lower index, a load bias no training would want; the aux and z losses
// read them too. Under bf16, x is widened for the router, and in backward dx, which holds the
// experts' share rounded to bf16 by the combine, is widened, gets the router's share added in f32,
// and is rounded again.
// The router is a [N,C] x [C,E] GEMM, a small part of the layer's FLOPs, so f32 costs little there.
//
// The layout (expert counts and each assignment's row) is built on the host from the top-k indices:
// forward synchronizes the stream once for it, as the EP path must (the counts size the all-to-all),
// and reads the losses' statistics back with it.
// Thread safety: none; one thread drives a layer and its Context.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "cuda/device.h"
#include "moe/moe_layer.h"

namespace moe::cuda {

struct MoeShape {
  int64_t C = 0, F = 0, E = 0, K = 0;
  bool renormalize = true;
  bool swiglu = false;            // experts silu(w1 x) * (w3 x) instead of gelu(w1 x)
  float capacity_factor = 0.0f;   // 0: dropless
  float aux_loss_weight = 0.0f;   // weights of the losses' gradients in backward (the losses are
  float z_loss_weight = 0.0f;     // computed either way: aux_loss(), z_loss())
  std::vector<float> router_bias = {};  // [E] constant added to every token's logits, or empty for none
};
// The shape of the CPU layer's configuration (moe/moe_layer.h), its losses, capacity and bias included.
MoeShape moe_shape(const moe::MoeConfig& c);

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

  const MoeShape& shape() const { return s_; }
  float* wg() { return wg_.as<float>(); }  // f32 whatever dt (the router: above)
  void* w1() { return w1_.get(); }
  void* w2() { return w2_.get(); }
  void* w3() { return w3_.get(); }  // null unless SwiGLU
  float* dwg() { return dwg_.as<float>(); }
  void* dw1() { return dw1_.get(); }
  void* dw2() { return dw2_.get(); }
  void* dw3() { return dw3_.get(); }  // null unless SwiGLU
  // Rows each expert received in the last forward (host: its kept assignments), and the FLOPs of one
  // forward+backward over them (router and experts: 2 per multiply-add, backward twice the forward).
  const std::vector<int64_t>& expert_offsets() const { return routing_.expert_offset; }
  double flops_forward_backward() const;
  // The last forward's routing on the host (moe::Routing's layout fields: expert, expert_offset,
  // row_token, row_assignment, tokens_per_expert, dropped; prob and weight are not kept here).
  const moe::Routing& routing() const { return routing_; }
  // The last forward's unweighted losses, and aux_loss_weight * aux + z_loss_weight * z.
  float aux_loss() const { return aux_loss_; }
  float z_loss() const { return z_loss_; }
  float weighted_loss() const { return s_.aux_loss_weight * aux_loss_ + s_.z_loss_weight * z_loss_; }

 private:
  MoeLayer(Context& ctx, DType dt, const MoeShape& s, int64_t max_tokens) : ctx_(ctx), dt_(dt), s_(s), max_n_(max_tokens) {}
  Status allocate();

  Context& ctx_;
  DType dt_;
  MoeShape s_;
  int64_t max_n_, n_ = 0, rows_ = 0;
  // The last forward's input as the router reads it, f32: x itself under f32 (caller-owned; must live
  // until backward), else x32_.
  const float* x_ = nullptr;
  DeviceBuffer wg_, dwg_;                                       // [E,C] f32
  DeviceBuffer w1_, w2_, w3_, dw1_, dw2_, dw3_;                 // dt; w3_, dw3_: SwiGLU only
  DeviceBuffer x32_, dx32_;                                     // [N,C] f32 each, dt != f32 only (x, dx widened)
  DeviceBuffer logits_, probs_;                                 // [N,E] f32
  DeviceBuffer top_values_, top_index_, gate_, token_rows_, row_token_, ones_;  // [N,K]x4 [R] [N*K]
  DeviceBuffer bias_, lse_, prob_sum_, load_frac_;              // [E] f32, [N] f32, [E] f64, [E] f32
  DeviceBuffer xp_, h_, h3_, act_, out_rows_;                   // [R,C] [R,F] [R,F] [R,F] [R,C] (h3_: SwiGLU)
  DeviceBuffer d_out_rows_, dact_, dh_, dh3_, dxp_, dgate_;     // [R,C] [R,F]x3 [R,C] (dt), [N,K] f32
  DeviceBuffer dprobs_, dlogits_;                               // [N,E] f32
  moe::Routing routing_;                                        // host layout of the last forward
  std::vector<int64_t> layout_scratch_;
  std::vector<int32_t> host_token_rows_;                        // [N*K] row of each assignment, -1 if dropped
  std::vector<float> host_lse_, host_load_frac_;                // [N], [E]
  std::vector<double> host_prob_sum_;                           // [E]
  float aux_loss_ = 0, z_loss_ = 0;
};

}  // namespace moe::cuda
