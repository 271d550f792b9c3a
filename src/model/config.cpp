#include "model/config.h"

#include <cmath>
#include <limits>
#include <sstream>
#include <variant>

#include <nlohmann/json.hpp>

namespace moe {

namespace {

// Upper bounds keep every derived size (E*F*C, B*NH*T*T, ...) far from int64 / int32 overflow
// and catch typos (an extra zero) before a huge allocation.
constexpr int64_t kMaxSeqLen = 1 << 16;
constexpr int64_t kMaxDim = 1 << 16;     // d_model, n_heads
constexpr int64_t kMaxFfn = 1 << 20;     // d_ffn
constexpr int64_t kMaxLayers = 1024;
constexpr int64_t kMaxExperts = 1 << 16;

Status int_range(const char* field, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi) {
    std::ostringstream s;
    s << "config: " << field << " (" << v << ") must be in [" << lo << ", " << hi << "]";
    return Status::error(s.str());
  }
  return Status::ok();
}

Status nonneg_finite(const char* field, double v) {
  if (!std::isfinite(v) || v < 0) {
    std::ostringstream s;
    s << "config: " << field << " (" << v << ") must be a finite number >= 0";
    return Status::error(s.str());
  }
  return Status::ok();
}

// One settable field: its JSON key and where it lives in ModelConfig.
using FieldPtr = std::variant<int64_t ModelConfig::*, double ModelConfig::*, bool ModelConfig::*,
                              std::string ModelConfig::*>;
struct Field {
  const char* key;
  FieldPtr ptr;
};

const Field kFields[] = {
    {"vocab_size", &ModelConfig::vocab_size},
    {"seq_len", &ModelConfig::seq_len},
    {"d_model", &ModelConfig::d_model},
    {"n_layers", &ModelConfig::n_layers},
    {"n_heads", &ModelConfig::n_heads},
    {"d_ffn", &ModelConfig::d_ffn},
    {"n_experts", &ModelConfig::n_experts},
    {"top_k", &ModelConfig::top_k},
    {"activation", &ModelConfig::activation},
    {"norm", &ModelConfig::norm},
    {"dense_every_other", &ModelConfig::dense_every_other},
    {"renormalize", &ModelConfig::renormalize},
    {"capacity_factor", &ModelConfig::capacity_factor},
    {"aux_loss_weight", &ModelConfig::aux_loss_weight},
    {"z_loss_weight", &ModelConfig::z_loss_weight},
    {"router_skew", &ModelConfig::router_skew},
    {"router_skew_drift", &ModelConfig::router_skew_drift},
};

const char* type_name(const nlohmann::json& v) { return v.type_name(); }
// "string \"2\"", "number 2.5", "null": the type and the offending value.
std::string describe(const nlohmann::json& v) {
  return v.is_null() ? std::string("null") : std::string(v.type_name()) + " " + v.dump();
}

}  // namespace

Status ModelConfig::validate() const {
  Status s;
  if (vocab_size != 256) {
    return Status::error("config: vocab_size (" + std::to_string(vocab_size) +
                         ") must be 256 (the tokenizer is byte-level)");
  }
  if (!(s = int_range("seq_len", seq_len, 1, kMaxSeqLen))) return s;
  if (!(s = int_range("d_model", d_model, 1, kMaxDim))) return s;
  if (!(s = int_range("n_layers", n_layers, 1, kMaxLayers))) return s;
  if (!(s = int_range("n_heads", n_heads, 1, kMaxDim))) return s;
  if (d_model % n_heads != 0) {
    return Status::error("config: d_model (" + std::to_string(d_model) + ") is not divisible by n_heads (" +
                         std::to_string(n_heads) + ")");
  }
  if (!(s = int_range("d_ffn", d_ffn, 1, kMaxFfn))) return s;
  if (!(s = int_range("n_experts", n_experts, 1, kMaxExperts))) return s;
  if (top_k < 1) return Status::error("config: top_k (" + std::to_string(top_k) + ") must be >= 1");
  if (top_k > n_experts) {
    return Status::error("config: top_k (" + std::to_string(top_k) + ") > n_experts (" +
                         std::to_string(n_experts) + ")");
  }
  if (activation != "gelu" && activation != "swiglu") {
    return Status::error("config: activation (\"" + activation + "\") must be \"gelu\" or \"swiglu\"");
  }
  if (norm != "layernorm" && norm != "rmsnorm") {
    return Status::error("config: norm (\"" + norm + "\") must be \"layernorm\" or \"rmsnorm\"");
  }
  if (!(s = nonneg_finite("capacity_factor", capacity_factor))) return s;
  if (!(s = nonneg_finite("aux_loss_weight", aux_loss_weight))) return s;
  if (!(s = nonneg_finite("z_loss_weight", z_loss_weight))) return s;
  if (!(s = nonneg_finite("router_skew", router_skew))) return s;
  if (!(s = nonneg_finite("router_skew_drift", router_skew_drift))) return s;
  return Status::ok();
}

std::vector<float> ModelConfig::router_bias(int64_t l, int64_t step) const {
  std::vector<float> bias;
  if (router_skew <= 0) return bias;
  // The hot expert of block l at step s is (l + turn) mod E; floor as the simulator's zipf-drift does.
  const auto turn = static_cast<int64_t>(std::floor(router_skew_drift * static_cast<double>(step)));
  bias.resize(n_experts);
  for (int64_t e = 0; e < n_experts; ++e) {
    const int64_t rank = (((e - l - turn) % n_experts) + n_experts) % n_experts;
    bias[e] = static_cast<float>(-router_skew * std::log1p(static_cast<double>(rank)));
  }
  return bias;
}

MoeConfig ModelConfig::moe_config(int64_t l) const {
  MoeConfig m;
  m.d_model = d_model;
  m.d_ffn = d_ffn;
  m.n_experts = n_experts;
  m.top_k = top_k;
  m.activation = activation_kind();
  m.renormalize = renormalize;
  m.capacity_factor = static_cast<float>(capacity_factor);
  m.aux_loss_weight = static_cast<float>(aux_loss_weight);
  m.z_loss_weight = static_cast<float>(z_loss_weight);
  m.router_bias = router_bias(l);
  return m;
}

nlohmann::json ModelConfig::to_json() const {
  nlohmann::json j = nlohmann::json::object();
  for (const Field& f : kFields) {
    std::visit([&](auto p) { j[f.key] = this->*p; }, f.ptr);
  }
  return j;
}

Status ModelConfig::from_json(const nlohmann::json& j, ModelConfig* out) {
  if (!j.is_object()) {
    return Status::error(std::string("config: expected a JSON object, got ") + type_name(j));
  }
  ModelConfig c = *out;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    const nlohmann::json& v = it.value();
    const Field* field = nullptr;
    for (const Field& f : kFields)
      if (key == f.key) field = &f;
    if (!field) {
      std::string known;
      for (const Field& f : kFields) known += std::string(known.empty() ? "" : ", ") + f.key;
      return Status::error("config: unknown key \"" + key + "\" (known keys: " + known + ")");
    }
    Status s;
    std::visit(
        [&](auto p) {
          using T = std::remove_reference_t<decltype(c.*p)>;
          if constexpr (std::is_same_v<T, int64_t>) {
            if (!v.is_number_integer()) {
              s = Status::error("config: " + key + " must be an integer, got " + describe(v));
            } else if (v.is_number_unsigned() &&
                       v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
              s = Status::error("config: " + key + " (" + v.dump() + ") is out of range");
            } else {
              c.*p = v.get<int64_t>();
            }
          } else if constexpr (std::is_same_v<T, double>) {
            if (!v.is_number()) {
              s = Status::error("config: " + key + " must be a number, got " + describe(v));
            } else {
              c.*p = v.get<double>();
            }
          } else if constexpr (std::is_same_v<T, bool>) {
            if (!v.is_boolean()) {
              s = Status::error("config: " + key + " must be true or false, got " + describe(v));
            } else {
              c.*p = v.get<bool>();
            }
          } else {
            if (!v.is_string()) {
              s = Status::error("config: " + key + " must be a string, got " + describe(v));
            } else {
              c.*p = v.get<std::string>();
            }
          }
        },
        field->ptr);
    if (!s) return s;
  }
  if (Status s = c.validate(); !s) return s;
  *out = c;
  return Status::ok();
}

}  // namespace moe
