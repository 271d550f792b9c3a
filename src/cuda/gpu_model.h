// The model of model/model.h on one GPU: the same parameters in the same order under the same names,
// the same forward and backward op for op (llm.c style: <layer>_forward / <layer>_backward), built
// from cuda/ops.h and cuda::MoeLayer. One rank, no expert parallelism: every block type the CPU model
// has (MoE blocks with GELU or SwiGLU experts, router bias, aux and z losses, capacity dropping;
// dense blocks; LayerNorm or RMSNorm), the tied LM head and the cross-entropy. `moe train --device
// cuda` trains it (cuda/train.h); GpuAdamW (gpu_optimizer.h) updates it.
//
// Storage: the model's DType (create()), arithmetic f32 throughout, TF32 off unless the Context says
// otherwise. Either way every parameter has an f32 master weight and an f32 gradient: what AdamW
// (gpu_optimizer.h) updates, what the gradient norm sums, and what load_weights / store_weights
// move to and from a CPU moe::Model, which is how checkpoints are read and written: the very files of
// a CPU run, whatever dtype trained them.
//  - f32: the masters are the weights the kernels read, and the gradients what they accumulate
//    into; activations f32. It computes what the CPU model computes up to the order of float sums
//    (tolerance policy: cuda/ops.h).
//  - bf16 (mixed precision): forward and backward read bf16 copies of the weights (value_dt below),
//    cast from the masters by load_weights and after every AdamW step. Activations and their
//    gradients are bf16, except what the kernels keep in f32 (ops.h): norm statistics, the
//    cross-entropy's probabilities and losses, gate weights; and the MoE router, f32 whatever the
//    dtype (moe_layer.h: bf16 probabilities tie), whose weight is its own master. Parameter
//    gradients: backward() zeroes a bf16 gradient per parameter, the bf16 kernels accumulate into
//    it, and backward()'s end adds each, widened, into the f32 gradient; the embedding's kernel and
//    the router write theirs in f32 directly (backward() says why).
//
// Gradients ACCUMULATE in backward(), as on the CPU: zero_grad() each step.
// Thread safety: none; one thread drives a model and its Context.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cuda/device.h"
#include "cuda/moe_layer.h"
#include "model/config.h"
#include "model/model.h"

namespace moe::cuda {

// One parameter on the device: its f32 master weight and gradient, and the copies of both the
// kernels use, in `dt`.
struct DeviceParam {
  std::string name;        // as in moe::Model::params() (docs/model.md)
  std::vector<int64_t> shape;
  int64_t numel = 0;
  bool decay = true;       // AdamW weight decay applies (moe::Param::decay)
  float* value = nullptr;  // [numel] f32 master weight
  float* grad = nullptr;   // [numel] f32, accumulated by backward()
  // Storage of value_dt and grad_dt: the model's dtype, except f32 for the MoE router's weight.
  DType dt = DType::f32;
  // [numel] in dt: the weight forward and backward read. dt f32: value itself; bf16: a copy of value
  // rounded, refreshed by refresh_weight_copy() whenever value changes.
  void* value_dt = nullptr;
  // [numel] in dt: what backward's kernels accumulate into. dt f32: grad itself; bf16: zeroed at the
  // start of each backward() and added into grad at its end; null for wpe.weight, whose only
  // gradient (the embedding's) is written into grad in f32.
  void* grad_dt = nullptr;
};

// value_dt = value rounded to p.dt, for a bf16 parameter whose master just changed (load_weights,
// GpuAdamW::step); nothing for an f32 one, whose value_dt is value. Queued on ctx's stream.
Status refresh_weight_copy(Context& ctx, const DeviceParam& p);

class GpuModel {
 public:
  // Allocates parameters (zero) and every activation for max_batch x cfg.seq_len tokens, stored in dt
  // (the header comment). Errors: an invalid config, top_k > 16 (the GPU top-k's limit), out of
  // device memory.
  static Status create(Context& ctx, const ModelConfig& cfg, int64_t max_batch, DType dt,
                       std::unique_ptr<GpuModel>* out);
  ~GpuModel();
  GpuModel(const GpuModel&) = delete;
  GpuModel& operator=(const GpuModel&) = delete;

  const ModelConfig& config() const { return cfg_; }
  int64_t max_batch() const { return max_batch_; }
  DType dtype() const { return dt_; }
  // Every parameter, in moe::Model::params() order.
  const std::vector<DeviceParam>& params() const { return params_; }
  int64_t num_params() const;

  // Weights from / to a CPU model of the same config: every parameter's name, shape and decay flag
  // must match (an error Status names the first that does not). Synchronous. They are the f32
  // masters; load_weights refreshes the bf16 copies too.
  Status load_weights(const moe::Model& host);
  Status store_weights(moe::Model* host) const;
  // The f32 gradients (accumulated since zero_grad()) into host's Param::grad (tests compare them).
  // Synchronous.
  Status store_gradients(moe::Model* host) const;

  Status zero_grad();
  // Runs the model on host tokens and targets [B,T] (T = seq_len) and keeps the activations for
  // backward(); *loss = the mean cross-entropy (read back: the call waits for the GPU). REQUIRES
  // 1 <= B <= max_batch, tokens and targets in [0, V) (else an error Status).
  Status forward(const int32_t* tokens, const int32_t* targets, int64_t B, double* loss);
  // Accumulates d(total_loss)/d(param) into every params()[i].grad (queued; a later read waits).
  Status backward();

  double cross_entropy() const { return loss_; }  // of the last forward
  double aux_loss() const;   // sum over MoE blocks of the unweighted aux loss
  double z_loss() const;     // sum over MoE blocks of the unweighted z loss
  double moe_loss() const;   // sum over MoE blocks of aux_loss_weight * aux + z_loss_weight * z
  // Per MoE block, in block order (as moe::Model::load_stats).
  std::vector<LayerLoad> load_stats() const;
  // The MoE layer of block l, or null for a dense block (as moe::Model::moe_layer; REQUIRES 0 <= l < L).
  const MoeLayer* moe_layer(int64_t l) const;

 private:
  struct Block;
  GpuModel(Context& ctx, const ModelConfig& cfg, int64_t max_batch, DType dt);
  Status allocate();
  Status allocate_param_storage();
  // A parameter whose value_dt and grad_dt are buffers of the MoE layer (of type dt) when given, else
  // allocated by allocate_param_storage().
  int add_param(const std::string& name, std::vector<int64_t> shape, bool decay, DType dt, void* value_dt = nullptr,
                void* grad_dt = nullptr);
  void* w(int i) const { return params_[i].value_dt; }
  void* g(int i) const { return params_[i].grad_dt; }
  const void* block_input(int64_t l) const;  // the embedding (l = 0) or block l-1's output; l = L: the head's input

  // The phases, as moe::Model's.
  Status encoder_forward();
  Status attention_block_forward(Block& b, const void* x);
  Status ffn_forward(Block& b);
  Status head_forward(double* loss);
  Status head_backward();
  Status ffn_backward(Block& b);
  Status attention_block_backward(Block& b, const void* x);
  Status encoder_backward();
  Status norm_forward(void* out, float* mean, float* rstd, const void* inp, int w, int b, int64_t N);
  Status norm_backward(void* dinp, int w, int b, const void* dout, const void* inp, const float* mean,
                       const float* rstd, int64_t N);
  // Mixed precision's gradient bookends around backward(): zero the bf16 gradients, then add them
  // into the f32 ones. Nothing under f32.
  Status zero_low_precision_grads();
  Status widen_low_precision_grads();

  Context& ctx_;
  ModelConfig cfg_;
  int64_t max_batch_;
  DType dt_;  // storage of the weights' copies, activations and their gradients (the header comment)
  std::vector<DeviceParam> params_;
  // Parameter storage the model allocates (the rest is the MoE layers'): f32 masters and gradients,
  // and under bf16 the copies outside the MoE layers.
  std::vector<DeviceBuffer> owned_;
  int wte_ = -1, wpe_ = -1, normf_w_ = -1, normf_b_ = -1;  // params_ indices (-1: absent)
  std::vector<std::unique_ptr<Block>> blocks_;

  // ---- activations of the last forward, sized for N = max_batch * seq_len (shapes beside each; in
  // dt unless marked f32) ----
  int64_t B_ = 0, T_ = 0;
  double loss_ = 0;
  DeviceBuffer tokens_, targets_;   // [B,T] int32
  std::vector<int32_t> host_tokens_;  // [B,T]: this step's tokens, for the embedding backward
  DeviceBuffer encoded_;            // [B,T,C] embedding output = input of block 0
  DeviceBuffer lnf_;                // [B,T,C] norm_f output
  DeviceBuffer lnf_mean_, lnf_rstd_;  // [B,T] f32 (mean: LayerNorm only)
  DeviceBuffer logits_;             // [B,T,V]
  DeviceBuffer probs_;              // [B,T,V] f32 softmax of the logits
  DeviceBuffer losses_;             // [B,T] f32 per-token cross-entropy
  std::vector<float> host_losses_;  // [B*T]
  // ---- scratch shared by all blocks ----
  DeviceBuffer preatt_;             // [B,NH,T,T] attention forward scratch
  DeviceBuffer attn_scratch_;       // [8,B,T,C] attention's head-major q, k, v, ... (forward 4, backward 8)
  DeviceBuffer tmp_;                // [B,T,C] attention projection / FFN output before the residual add
  // ---- backward scratch, shared by all blocks ----
  DeviceBuffer dlogits_;            // [B,T,V]
  DeviceBuffer dres_;               // [B,T,C] gradient of the residual stream at the current point
  DeviceBuffer dln_;                // [B,T,C] gradient of a norm output (norm_f, ln2, ln1 in turn)
  DeviceBuffer datty_;              // [B,T,C] gradient of the attention output (before proj)
  DeviceBuffer dqkv_;               // [B,T,3C]
  DeviceBuffer datt_, dpreatt_;     // [B,NH,T,T]
  DeviceBuffer dh1_, dh3_, dact_;   // [B,T,F] dense FFN (dh3_: SwiGLU)
  DeviceBuffer widen_;              // [largest bf16 grad_dt's numel] f32, bf16 only: one gradient widened
};

}  // namespace moe::cuda
