// The model of model/model.h on one GPU: the same parameters in the same order under the same names,
// the same forward and backward op for op (llm.c style: <layer>_forward / <layer>_backward), built
// from cuda/ops.h and cuda::MoeLayer. One rank, no expert parallelism: every block type the CPU model
// has (MoE blocks with GELU or SwiGLU experts, router bias, aux and z losses, capacity dropping;
// dense blocks; LayerNorm or RMSNorm), the tied LM head and the cross-entropy. `moe train --device
// cuda` trains it (cuda/train.h); GpuAdamW (gpu_optimizer.h) updates it.
//
// Storage: f32 (weights, gradients, activations), arithmetic f32, TF32 off unless the Context says
// otherwise; so it computes what the CPU model computes up to the order of float sums (tolerance
// policy: cuda/ops.h). The weights come from and go back to a CPU moe::Model (load_weights /
// store_weights), which is how checkpoints are read and written: the very files of a CPU run.
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

// One parameter on the device, f32.
struct DeviceParam {
  std::string name;        // as in moe::Model::params() (docs/model.md)
  std::vector<int64_t> shape;
  int64_t numel = 0;
  bool decay = true;       // AdamW weight decay applies (moe::Param::decay)
  float* value = nullptr;  // [numel]
  float* grad = nullptr;   // [numel], accumulated by backward()
};

class GpuModel {
 public:
  // Allocates parameters (zero) and every activation for max_batch x cfg.seq_len tokens.
  // Errors: an invalid config, top_k > 16 (the GPU top-k's limit), out of device memory.
  static Status create(Context& ctx, const ModelConfig& cfg, int64_t max_batch, std::unique_ptr<GpuModel>* out);
  ~GpuModel();
  GpuModel(const GpuModel&) = delete;
  GpuModel& operator=(const GpuModel&) = delete;

  const ModelConfig& config() const { return cfg_; }
  int64_t max_batch() const { return max_batch_; }
  // Every parameter, in moe::Model::params() order.
  const std::vector<DeviceParam>& params() const { return params_; }
  int64_t num_params() const;

  // Weights from / to a CPU model of the same config: every parameter's name, shape and decay flag
  // must match (an error Status names the first that does not). Synchronous.
  Status load_weights(const moe::Model& host);
  Status store_weights(moe::Model* host) const;
  // The gradients of the last backward() into host's Param::grad (tests compare them). Synchronous.
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

 private:
  struct Block;
  GpuModel(Context& ctx, const ModelConfig& cfg, int64_t max_batch);
  Status allocate();
  int add_param(const std::string& name, std::vector<int64_t> shape, bool decay, float* value = nullptr,
                float* grad = nullptr);
  float* w(int i) const { return params_[i].value; }
  float* g(int i) const { return params_[i].grad; }
  const float* block_input(int64_t l) const;  // the embedding (l = 0) or block l-1's output; l = L: the head's input

  // The phases, as moe::Model's.
  Status encoder_forward();
  Status attention_block_forward(Block& b, const float* x);
  Status ffn_forward(Block& b);
  Status head_forward(double* loss);
  Status head_backward();
  Status ffn_backward(Block& b);
  Status attention_block_backward(Block& b, const float* x);
  Status encoder_backward();
  Status norm_forward(float* out, float* mean, float* rstd, const float* inp, int w, int b, int64_t N);
  Status norm_backward(float* dinp, int w, int b, const float* dout, const float* inp, const float* mean,
                       const float* rstd, int64_t N);

  Context& ctx_;
  ModelConfig cfg_;
  int64_t max_batch_;
  std::vector<DeviceParam> params_;
  std::vector<DeviceBuffer> owned_;  // values and gradients of the parameters outside the MoE layers
  int wte_ = -1, wpe_ = -1, normf_w_ = -1, normf_b_ = -1;  // params_ indices (-1: absent)
  std::vector<std::unique_ptr<Block>> blocks_;

  // ---- activations of the last forward, sized for N = max_batch * seq_len (shapes beside each) ----
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
};

}  // namespace moe::cuda
