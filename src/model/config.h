// ModelConfig: the hyper-parameters of the model of docs/model.md, validation and JSON I/O.
//
// The defaults are a small model that trains in a few minutes on 2 CPU cores:
// T=128, C=128, L=4, NH=4, F=256, E=8, K=2 (about 2.4 M parameters).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "moe/moe_layer.h"
#include "util/status.h"

namespace moe {

struct ModelConfig {
  int64_t vocab_size = 256;       // V; byte-level tokenizer, so it must be 256
  int64_t seq_len = 128;          // T (also the number of learned positions, wpe rows)
  int64_t d_model = 128;          // C
  int64_t n_layers = 4;           // L
  int64_t n_heads = 4;            // NH; d_model % n_heads == 0
  int64_t d_ffn = 256;            // F (hidden size of each expert and of dense FFN blocks)
  int64_t n_experts = 8;          // E
  int64_t top_k = 2;              // K, 1 <= K <= E
  std::string activation = "gelu";    // "gelu" | "swiglu"
  std::string norm = "layernorm";     // "layernorm" | "rmsnorm"
  bool dense_every_other = false; // blocks with odd index use a dense FFN instead of the MoE layer
  bool renormalize = true;        // K > 1: gate weights renormalized over the chosen K
  double capacity_factor = 0.0;   // 0 = dropless; else expert capacity ceil(cf * N * K / E)
  double aux_loss_weight = 0.01;  // load-balancing loss weight (Switch)
  double z_loss_weight = 0.001;   // router z-loss weight (ST-MoE)
  // Router skew s >= 0: a fixed Zipf-shaped bias on the router logits, -s * ln(1 + rank) where rank is
  // the expert's place in block l's popularity order (expert (l + j) mod E has rank j), so expert
  // (l mod E) draws the most tokens. 0 = none. Reproducible imbalance, the same for every strategy.
  double router_skew = 0.0;
  // Router skew drift R >= 0 (experts per step): the popularity order turns as training goes, the hot
  // expert of block l at step s being (l + floor(R * s)) mod E (the simulator's zipf-drift load), so the
  // load moves between steps as a trained gate's does (Hecate's paper, Fig. 3). 0 = a fixed order.
  // Matters only with router_skew > 0.
  double router_skew_drift = 0.0;

  // Checks every field and the combinations (d_model % n_heads, top_k <= n_experts, ...). The
  // message names the field and its value, e.g. "config: top_k (3) > n_experts (2)".
  Status validate() const;

  // Whether block l uses the MoE layer (else the dense FFN).
  bool is_moe_layer(int64_t l) const { return !(dense_every_other && (l % 2 == 1)); }
  int64_t head_size() const { return d_model / n_heads; }
  // The MoE layer configuration of MoE block l at step 0 (the router bias depends on l; a drifting one
  // is turned per step by Model::set_router_step). REQUIRES: validate() ok.
  MoeConfig moe_config(int64_t l = 0) const;
  // Block l's router bias at training step `step` (0-based): [E], or empty without router_skew.
  // REQUIRES: validate() ok.
  std::vector<float> router_bias(int64_t l, int64_t step = 0) const;
  // Whether the router bias changes with the step (router_skew > 0 and router_skew_drift > 0).
  bool router_bias_drifts() const { return router_skew > 0 && router_skew_drift > 0; }
  Activation activation_kind() const { return activation == "swiglu" ? Activation::swiglu : Activation::gelu; }
  bool use_rmsnorm() const { return norm == "rmsnorm"; }

  // Every field, under its C++ name.
  nlohmann::json to_json() const;
  // Reads a config from a JSON object into *out. Keys absent from `j` keep the values *out already
  // has (the defaults for a fresh ModelConfig), so JSON can be layered over a base. Unknown keys, values
  // of the wrong type (e.g. a string or a float for an integer field) and configs that fail
  // validate() are reported as an error Status naming the key; no exception escapes. On error *out
  // is left unchanged.
  static Status from_json(const nlohmann::json& j, ModelConfig* out);

  bool operator==(const ModelConfig&) const = default;
};

}  // namespace moe
