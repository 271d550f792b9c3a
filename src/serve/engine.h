// Start here for src/serve: inference on a trained model, in one process or over expert-parallel ranks.
//
//   engine.*   InferenceEngine: one forward over a ragged set of rows (sequence slot, position,
//              token) with a KV cache, so the prefill of new prompts and the decode steps of running
//              sequences share one pass (continuous batching)
//   sampler.*  the next token from a row's logits: greedy, temperature, top-k, top-p, seeded per
//              request so the choice does not depend on which rank or batch ran it
//   generate.* `moe generate`: one prompt, its continuation streamed to stdout
//
// Dimension letters: C d_model, NH heads, HS = C / NH, F d_ffn, V vocabulary, T seq_len (the context:
// the model has T learned positions), S slots (sequences the KV cache holds), N rows of one forward.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "model/model.h"
#include "tensor/tensor.h"

namespace moe::serve {

// One token of one sequence to run through the model.
struct Row {
  int32_t slot = 0;     // the sequence's KV-cache slot, in [0, S)
  int32_t pos = 0;      // its position, in [0, T)
  int32_t token = 0;    // in [0, V)
  bool logits = false;  // return this row's next-token logits
};

// Thread safety: none (one thread drives it; the kernels inside use OpenMP).
class InferenceEngine {
 public:
  // model: the weights, loaded; expert-parallel already when the ranks share the experts
  // (Model::set_expert_parallel with ep == batch, every rank holding an engine). Not owned; it must
  // outlive the engine, and its training activations are not used. slots: sequences held at once.
  // max_rows: the most rows of one forward(). REQUIRES: slots >= 1, 1 <= max_rows <=
  // model.max_batch() * T (what the MoE layers were sized for).
  InferenceEngine(Model& model, int64_t slots, int64_t max_rows);
  ~InferenceEngine();
  InferenceEngine(const InferenceEngine&) = delete;
  InferenceEngine& operator=(const InferenceEngine&) = delete;

  const ModelConfig& config() const { return cfg_; }
  int64_t slots() const { return slots_; }
  int64_t max_rows() const { return max_rows_; }

  // Runs `rows` through the model. First every row's key and value go into its slot's cache at its
  // position (layer by layer), then each row attends to positions 0..pos of its slot: so a prompt
  // prefilled in one call attends causally within itself, and a decode row sees everything cached
  // before. The positions 0..pos-1 of a row's slot must hold that sequence's tokens (written by this
  // or earlier calls since the slot was last reused). logits: [n, V] for the n rows with
  // Row::logits, in row order (null when n == 0).
  // Expert parallel: collective over the MoE layers' group; every rank calls it the same number of
  // times, each with its own rows (none is fine). REQUIRES: rows.size() <= max_rows, fields in range
  // (std::logic_error). Collective failures throw std::runtime_error naming the rank.
  void forward(std::span<const Row> rows, float* logits);

  // Assignments this rank's rows sent to each expert, per block ([L][E]; zeros for a dense block),
  // since the last call (then reset).
  std::vector<std::vector<int64_t>> take_expert_loads();

 private:
  struct Block;  // one transformer block's weights (pointers into the model)
  void attention(int64_t l, std::span<const Row> rows);

  Model& model_;
  ModelConfig cfg_;
  int64_t slots_, max_rows_;
  std::vector<Block> blocks_;
  const Param *wte_, *wpe_, *normf_w_, *normf_b_;
  // KV cache, per block: k_[l], v_[l] [S,T,C] (head h at columns [h*HS, (h+1)*HS)).
  std::vector<Tensor> k_, v_;
  // Scratch for N <= max_rows rows.
  Tensor x_;      // [N,C] residual stream
  Tensor ln_;     // [N,C] a norm's output
  Tensor norm_mean_, norm_rstd_;  // [N]
  Tensor qkv_;    // [N,3C]
  Tensor atty_;   // [N,C] attention output before proj
  Tensor tmp_;    // [N,C] proj / FFN output before the residual add
  Tensor h1_, h3_, act_;  // [N,F] dense FFN blocks
  Tensor att_;    // [N,NH,T] attention probabilities
  Tensor last_;   // [n,C] norm_f input of the logit rows
  std::vector<std::vector<int64_t>> loads_;  // [L][E]
};

}  // namespace moe::serve
