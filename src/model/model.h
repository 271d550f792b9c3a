// Model: the GPT-style MoE transformer of docs/model.md with explicit forward and backward (llm.c
// style). Activations are preallocated for max_batch x seq_len at construction; a step allocates
// nothing.
//
// Parameter order of params() (fixed; checkpoints and the optimizer may rely on it):
//   wte.weight, wpe.weight,
//   for l in 0..L:  blocks.{l}.norm1.weight, [blocks.{l}.norm1.bias],
//                   blocks.{l}.attn.qkv.weight, blocks.{l}.attn.proj.weight,
//                   blocks.{l}.norm2.weight, [blocks.{l}.norm2.bias],
//                   MoE block:   MoeLayer::params() of prefix "blocks.{l}.moe." (router.weight, w1, w2, [w3])
//                   dense block: blocks.{l}.mlp.w1, blocks.{l}.mlp.w2, [blocks.{l}.mlp.w3]
//   norm_f.weight, [norm_f.bias]
// ([...] present only for LayerNorm (biases) or SwiGLU (w3).)
//
// Initialization: param_seed(seed, name) = splitmix64(fnv1a64(name) ^ splitmix64(seed)) seeds a
// std::mt19937_64 for each tensor; its values in row-major order are std * z with z standard normal
// by Box-Muller on two 53-bit uniforms (our own transform, so identical across standard libraries);
// std per docs/model.md (0.02, or 0.02/sqrt(2L) for attn.proj, moe.w2, mlp.w2); norm weights 1,
// biases 0. So a value depends only on (seed, name, position, std): a 2-layer and a 3-layer model
// share wte and block 0's qkv; their proj/w2 differ only by the factor sqrt(3/2).
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"
#include "moe/moe_layer.h"
#include "tensor/tensor.h"

namespace moe {

// Epsilon of every LayerNorm / RMSNorm of the model (docs/model.md).
inline constexpr float kNormEps = 1e-5f;

// The generator seed of parameter `name` under model seed `seed` (see above).
uint64_t param_seed(uint64_t seed, const std::string& name);

// Load statistics of one MoE block from the last forward().
struct LayerLoad {
  int64_t layer = 0;                        // block index l
  std::vector<int64_t> tokens_per_expert;   // [E] assignments kept per expert
  int64_t dropped = 0;                      // assignments dropped by capacity
  float aux_loss = 0, z_loss = 0;           // unweighted
};

// Thread safety: none. Kernels inside are multi-threaded (OpenMP).
class Model {
 public:
  // REQUIRES: cfg.validate() is ok (else throws std::invalid_argument with its message), max_batch >= 1.
  Model(const ModelConfig& cfg, int64_t max_batch);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return cfg_; }
  int64_t max_batch() const { return max_batch_; }
  // Every parameter, in the order documented above.
  std::vector<Param*> params() const { return params_; }
  int64_t num_params() const;
  // The MoE layer of block l, or null for a dense block.
  MoeLayer* moe_layer(int64_t l) const;
  // Sets every MoE block's router bias to the config's at training step `step` (ModelConfig::router_bias):
  // a no-op unless the skew drifts. The trainer calls it before each step, the server once with the
  // checkpoint's last step.
  void set_router_step(int64_t step);

  // Sets every parameter from (seed, name) as documented above. Gradients are left untouched.
  void init(uint64_t seed);

  // Runs the model on tokens [B,T] (T = seq_len, or the given T <= seq_len) and keeps the
  // activations for backward(). With targets [B,T] returns the mean cross-entropy; with null
  // targets returns NaN (inference: only logits). REQUIRES: 1 <= B <= max_batch, every token and
  // target in [0, V). Tokens and targets are copied; the caller's buffers may change afterwards.
  double forward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T = 0);
  // Accumulates d(total_loss())/d(param) into every param's grad (call zero_grad() first each
  // step). REQUIRES: the last forward() had targets.
  void backward();
  void zero_grad();

  int64_t batch() const { return B_; }  // B and T of the last forward
  int64_t seq() const { return T_; }
  const float* logits() const { return logits_.data(); }   // [B,T,V] of the last forward
  double cross_entropy() const { return loss_; }          // mean CE of the last forward (NaN without targets)
  double aux_loss() const;   // sum over MoE blocks of the unweighted aux loss
  double z_loss() const;     // sum over MoE blocks of the unweighted z loss
  double moe_loss() const;   // sum over MoE blocks of aux_loss_weight * aux + z_loss_weight * z
  double total_loss() const { return loss_ + moe_loss(); }  // what backward() differentiates
  // Per MoE block, in block order.
  std::vector<LayerLoad> load_stats() const;

  // The phases of forward() and backward(), for the runtime (one StepGraph op each, see
  // src/graph/step_builder.h). forward() is begin_step, embed_forward, for each block l attn_forward(l)
  // then ffn_forward(l), and head_forward; backward() is head_backward, for each block from the last
  // ffn_backward(l) then attn_backward(l), and embed_backward. An expert-parallel MoE block may
  // instead run moe_gate_forward(l), the MoE layer's ep_* phases, moe_combine_forward(l, ex) (and
  // moe_combine_backward(l, ex), ep_* phases, moe_gate_backward(l, ex) in backward), ex the step's
  // TokenExchange of that layer (MoeLayer::ep_dispatch planned it). Phases share scratch
  // buffers, so they run one at a time, in that order. REQUIRES as forward()/backward().
  void begin_step(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T = 0);
  void embed_forward();
  void attn_forward(int64_t l);
  void ffn_forward(int64_t l);
  void moe_gate_forward(int64_t l);
  void moe_combine_forward(int64_t l, const TokenExchange& ex);
  double head_forward();  // the mean cross-entropy (NaN without targets)
  void head_backward();
  void ffn_backward(int64_t l);
  void moe_combine_backward(int64_t l, const TokenExchange& ex);
  void moe_gate_backward(int64_t l, const TokenExchange& ex);
  void attn_backward(int64_t l);
  void embed_backward();
  // Parameters by where backward finishes their gradients: block l's (after attn_backward(l), its
  // MoE parameters included), the embeddings' (after embed_backward; wte is tied to the head) and
  // the final norm's (after head_backward).
  std::vector<Param*> block_params(int64_t l) const;
  std::vector<Param*> embedding_params() const;
  std::vector<Param*> head_params() const;
  int64_t n_blocks() const { return static_cast<int64_t>(blocks_.size()); }

  // Data + expert parallelism: this model instance holds rank r's share of each global batch.
  // Every MoE layer runs expert-parallel over `ep` with the batch spread over `batch`
  // (MoeLayer::set_expert_parallel), and the
  // cross-entropy gradient is scaled by ce_grad_scale (this rank's share of the global mean: its
  // tokens / the global batch's), so that summing every gradient over ranks gives the gradient of
  // the whole batch's loss. Defaults: no group, scale 1 (one process, the whole batch).
  void set_expert_parallel(comm::Communicator* ep, comm::Communicator* batch = nullptr);
  void set_ce_grad_scale(float s) { ce_grad_scale_ = s; }
  // Placement strategies: every MoE layer may hold expert replicas (MoeLayer::enable_placements),
  // accounted together in replica_memory(). REQUIRES: set_expert_parallel(ep, batch) with ep and batch of the same ranks.
  void enable_placements(const plan::Nodes& nodes, comm::Communicator* gather);
  ReplicaMemory& replica_memory() { return replica_memory_; }

 private:
  struct Block;
  Param* add_param(const std::string& name, std::vector<int64_t> shape, bool decay);
  void norm_forward(float* out, float* mean, float* rstd, const float* inp, const Param* w, const Param* b,
                    int64_t N) const;
  const float* block_input(int64_t l) const;  // the embedding (l = 0) or block l-1's output; l = L: the head's input
  void norm_backward(float* dinp, Param* w, Param* b, const float* dout, const float* inp, const float* mean,
                     const float* rstd, int64_t N) const;

  ModelConfig cfg_;
  int64_t max_batch_;
  ReplicaMemory replica_memory_;
  std::vector<std::unique_ptr<Param>> owned_;  // parameters created here (not the MoE layers')
  std::vector<Param*> params_;                 // all parameters, documented order
  Param* wte_ = nullptr;    // [V,C]
  Param* wpe_ = nullptr;    // [T,C]
  Param* normf_w_ = nullptr;  // [C]
  Param* normf_b_ = nullptr;  // [C] (LayerNorm only)
  std::vector<std::unique_ptr<Block>> blocks_;

  // ---- activations of the last forward, sized for N = max_batch * seq_len ----
  int64_t B_ = 0, T_ = 0;
  bool have_targets_ = false;
  double loss_ = std::nan("");
  float ce_grad_scale_ = 1.0f;
  std::vector<int32_t> tokens_;   // [B,T]
  std::vector<int32_t> targets_;  // [B,T]
  Tensor encoded_;   // [B,T,C] embedding output = input of block 0
  Tensor lnf_;       // [B,T,C] norm_f output
  Tensor lnf_mean_;  // [B,T]   (LayerNorm only)
  Tensor lnf_rstd_;  // [B,T]
  Tensor logits_;    // [B,T,V]
  Tensor probs_;     // [B,T,V] softmax of logits (with targets)
  // ---- scratch shared by all blocks ----
  Tensor preatt_;    // [B,NH,T,T] attention forward scratch
  Tensor tmp_;       // [B,T,C] attention projection / FFN output before the residual add
  // ---- backward scratch, shared by all blocks ----
  Tensor dlogits_;   // [B,T,V]
  Tensor dres_;      // [B,T,C] gradient of the residual stream at the current point
  Tensor dln_;       // [B,T,C] gradient of a norm output (norm_f, ln2, ln1 in turn)
  Tensor datty_;     // [B,T,C] gradient of the attention output (before proj)
  Tensor dqkv_;      // [B,T,3C]
  Tensor datt_;      // [B,NH,T,T]
  Tensor dpreatt_;   // [B,NH,T,T]
  Tensor dh1_;       // [B,T,F] dense FFN: gradient of w1 output
  Tensor dh3_;       // [B,T,F] dense FFN: gradient of w3 output (SwiGLU)
  Tensor dact_;      // [B,T,F] dense FFN: gradient of the activation
};

}  // namespace moe
