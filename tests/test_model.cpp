// ModelConfig validation and JSON; Model: whole-model gradient check, init determinism, loss at init.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "grad_check.h"
#include "model/config.h"
#include "model/model.h"

using moe::ModelConfig;
using moe::Status;
using json = nlohmann::json;

namespace {

void expect_error(const Status& s, const std::string& needle) {
  ASSERT_FALSE(s) << "expected an error containing: " << needle;
  EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
  std::printf("  error: %s\n", s.message().c_str());
}

}  // namespace

// ---- ModelConfig ----------------------------------------------------------------------------------

TEST(ModelConfig, DefaultsAreValid) {
  ModelConfig c;
  Status s = c.validate();
  EXPECT_TRUE(s) << s.message();
  EXPECT_EQ(c.vocab_size, 256);
  EXPECT_EQ(c.head_size(), 32);
  moe::MoeConfig m = c.moe_config();
  EXPECT_EQ(m.d_model, 128);
  EXPECT_EQ(m.n_experts, 8);
  EXPECT_EQ(m.top_k, 2);
  EXPECT_EQ(m.activation, moe::Activation::gelu);
}

TEST(ModelConfig, ValidateNamesFieldAndValue) {
  auto check = [](auto mutate, const std::string& needle) {
    ModelConfig c;
    mutate(c);
    expect_error(c.validate(), needle);
  };
  check([](ModelConfig& c) { c.vocab_size = 512; }, "vocab_size (512)");
  check([](ModelConfig& c) { c.seq_len = 0; }, "seq_len (0)");
  check([](ModelConfig& c) { c.seq_len = -5; }, "seq_len (-5)");
  check([](ModelConfig& c) { c.d_model = 0; }, "d_model (0)");
  check([](ModelConfig& c) { c.n_layers = 0; }, "n_layers (0)");
  check([](ModelConfig& c) { c.n_heads = 0; }, "n_heads (0)");
  check([](ModelConfig& c) { c.n_heads = 3; }, "d_model (128) is not divisible by n_heads (3)");
  check([](ModelConfig& c) { c.d_ffn = 0; }, "d_ffn (0)");
  check([](ModelConfig& c) { c.n_experts = 0; }, "n_experts (0)");
  check([](ModelConfig& c) { c.top_k = 0; }, "top_k (0)");
  check([](ModelConfig& c) { c.top_k = 9; }, "top_k (9) > n_experts (8)");
  check([](ModelConfig& c) { c.activation = "relu"; }, "activation (\"relu\")");
  check([](ModelConfig& c) { c.norm = "batchnorm"; }, "norm (\"batchnorm\")");
  check([](ModelConfig& c) { c.capacity_factor = -1; }, "capacity_factor (-1)");
  check([](ModelConfig& c) { c.capacity_factor = NAN; }, "capacity_factor (nan)");
  check([](ModelConfig& c) { c.aux_loss_weight = -0.5; }, "aux_loss_weight (-0.5)");
  check([](ModelConfig& c) { c.router_skew_drift = -0.25; }, "router_skew_drift (-0.25)");
  check([](ModelConfig& c) { c.z_loss_weight = INFINITY; }, "z_loss_weight (inf)");
  check([](ModelConfig& c) { c.d_ffn = int64_t(1) << 40; }, "d_ffn (1099511627776)");
}

TEST(ModelConfig, JsonRoundTrip) {
  ModelConfig c;
  c.seq_len = 64;
  c.activation = "swiglu";
  c.norm = "rmsnorm";
  c.dense_every_other = true;
  c.capacity_factor = 1.25;
  c.router_skew = 0.5;
  c.router_skew_drift = 0.25;
  json j = c.to_json();
  EXPECT_EQ(j.size(), 17u);
  EXPECT_EQ(j["activation"], "swiglu");
  ModelConfig d;
  Status s = ModelConfig::from_json(j, &d);
  ASSERT_TRUE(s) << s.message();
  EXPECT_EQ(c, d);
  // Through text as well.
  ModelConfig e;
  ASSERT_TRUE(ModelConfig::from_json(json::parse(j.dump()), &e));
  EXPECT_EQ(c, e);
}

TEST(ModelConfig, JsonPartialKeepsDefaults) {
  ModelConfig c;
  ASSERT_TRUE(ModelConfig::from_json(json::parse(R"({"n_layers": 2, "aux_loss_weight": 0})"), &c));
  EXPECT_EQ(c.n_layers, 2);
  EXPECT_EQ(c.aux_loss_weight, 0.0);  // an integer is accepted for a float field
  EXPECT_EQ(c.d_model, 128);
}

TEST(ModelConfig, JsonErrors) {
  auto err = [](const std::string& text, const std::string& needle) {
    ModelConfig c;
    c.n_layers = 3;
    expect_error(ModelConfig::from_json(json::parse(text), &c), needle);
    EXPECT_EQ(c.n_layers, 3);  // unchanged on error
  };
  err(R"([1, 2])", "expected a JSON object, got array");
  err(R"({"n_layer": 2})", "unknown key \"n_layer\"");
  err(R"({"n_layers": "2"})", "n_layers must be an integer, got string \"2\"");
  err(R"({"n_layers": 2.5})", "n_layers must be an integer, got number 2.5");
  err(R"({"n_layers": true})", "n_layers must be an integer, got boolean");
  err(R"({"n_layers": 18446744073709551615})", "n_layers (18446744073709551615) is out of range");
  err(R"({"capacity_factor": "1.0"})", "capacity_factor must be a number, got string");
  err(R"({"dense_every_other": 1})", "dense_every_other must be true or false, got number");
  err(R"({"activation": 3})", "activation must be a string, got number");
  err(R"({"activation": null})", "activation must be a string, got null");
  err(R"({"top_k": 9})", "top_k (9) > n_experts (8)");  // validated after parsing
}

// ---- Model ----------------------------------------------------------------------------------------

using moe::Model;
using moe::LayerLoad;
using moe::Param;

namespace {

// The tiny model of the gradient checks: V=256, T=8, C=16, L=2, NH=2, F=32, E=4, K=2.
ModelConfig tiny(const std::string& activation, const std::string& norm, bool dense_every_other = false) {
  ModelConfig c;
  c.seq_len = 8;
  c.d_model = 16;
  c.n_layers = 2;
  c.n_heads = 2;
  c.d_ffn = 32;
  c.n_experts = 4;
  c.top_k = 2;
  c.activation = activation;
  c.norm = norm;
  c.dense_every_other = dense_every_other;
  c.aux_loss_weight = 0.1;  // larger than the default so the aux/z gradients are visible in the check
  c.z_loss_weight = 0.01;
  return c;
}

std::vector<int32_t> random_tokens(int64_t n, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(g() % 256);
  return t;
}

// Replaces the init with O(1)-scale activations (std 1/sqrt(fan_in) for matrices, embeddings std 1,
// norm weights 1 + N(0, 0.1), biases N(0, 0.1)) so that every gradient is well above float noise
// in the finite-difference check; at the real init most entries are near zero and a wrong
// gradient would hide under the check's absolute floor.
void randomize_for_grad_check(Model& m, uint64_t seed) {
  uint64_t s = seed;
  for (Param* p : m.params()) {
    const auto& shape = p->value.shape();
    float* v = p->value.data();
    const size_t n = p->value.numel();
    if (shape.size() == 1) {
      moe::testing::fill_normal(v, n, ++s, 0.1f);
      if (p->name.find(".weight") != std::string::npos)
        for (size_t i = 0; i < n; ++i) v[i] += 1.0f;
    } else {
      float std = p->name == "wte.weight" || p->name == "wpe.weight" ? 0.5f : 1.0f / std::sqrt(float(shape.back()));
      moe::testing::fill_normal(v, n, ++s, std);
    }
  }
}

// Every MoE layer's routing: per token the SET of chosen experts, each with whether it was kept
// (capacity). The order of the top-k list does not matter to the output, so two near-equal top
// choices swapping places is not a change. Used to detect the finite-difference probes that cross
// a routing boundary, where top-k or capacity make the loss jump (not differentiable).
std::vector<std::vector<int32_t>> routing_signature(const Model& m) {
  std::vector<std::vector<int32_t>> sig;
  for (int64_t l = 0; l < m.config().n_layers; ++l) {
    const moe::MoeLayer* layer = m.moe_layer(l);
    if (!layer) continue;
    const moe::Routing& r = layer->routing();
    std::vector<int32_t> s;
    std::vector<int32_t> tok(r.K);
    for (int64_t n = 0; n < r.N; ++n) {
      for (int64_t k = 0; k < r.K; ++k)
        tok[k] = 2 * r.expert[n * r.K + k] + (r.weight[n * r.K + k] != 0.0f ? 1 : 0);
      std::sort(tok.begin(), tok.end());
      s.insert(s.end(), tok.begin(), tok.end());
    }
    sig.push_back(std::move(s));
  }
  return sig;
}

struct GradCase {
  std::string name;
  ModelConfig cfg;
};

void PrintTo(const GradCase& c, std::ostream* os) { *os << c.name; }

class ModelGradCheck : public ::testing::TestWithParam<GradCase> {};

}  // namespace

// Finite differences of the total loss (CE + weighted aux/z) against backward(), for a strided
// sample of entries of EVERY parameter.
TEST_P(ModelGradCheck, WholeModel) {
  const ModelConfig cfg = GetParam().cfg;
  const int64_t B = 2, T = cfg.seq_len;
  Model m(cfg, B);
  m.init(1234);
  randomize_for_grad_check(m, 99);
  const std::vector<int32_t> tokens = random_tokens(B * T, 1), targets = random_tokens(B * T, 2);

  m.zero_grad();
  const double ce = m.forward(tokens.data(), targets.data(), B);
  m.backward();
  ASSERT_TRUE(std::isfinite(ce));
  ASSERT_TRUE(moe::testing::all_finite(m.logits(), B * T * cfg.vocab_size)) << "logits not finite";
  const auto base_routing = routing_signature(m);
  std::printf("  %s: CE %.5f  aux %.5f  z %.5f  total %.5f\n", GetParam().name.c_str(), ce, m.aux_loss(),
              m.z_loss(), m.total_loss());

  std::map<const Param*, std::vector<float>> analytic;
  for (Param* p : m.params()) {
    ASSERT_TRUE(moe::testing::all_finite(p->grad.data(), p->grad.numel())) << p->name << " grad not finite";
    analytic[p].assign(p->grad.data(), p->grad.data() + p->grad.numel());
  }

  int64_t routing_changes = 0;
  auto loss = [&]() {
    m.forward(tokens.data(), targets.data(), B);
    if (routing_signature(m) != base_routing) ++routing_changes;
    return m.total_loss();
  };

  // Central differences in float32. With eps 1e-2 the observed error is ~1e-5 (truncation
  // ~eps^2 times the third derivative, rounding ~1e-7/eps). A probe whose +-eps step changes the
  // routing measures a jump, not a derivative: it is retried with eps 1e-3 and, if the routing
  // still changes, skipped (and counted). Each entry goes through check_gradient on that single
  // entry, with the stride check_gradient itself would use for max_checks entries.
  const size_t max_checks = 12;
  const double floor = 1e-2, tol_rel = 1e-2;
  double worst_rel = 0, worst_abs = 0;
  std::string worst_name;
  size_t checked = 0, skipped = 0, retried = 0;
  for (Param* p : m.params()) {
    const std::vector<float>& a = analytic[p];
    double max_grad = 0;
    for (float g : a) max_grad = std::max(max_grad, double(std::fabs(g)));
    moe::testing::GradCheckResult r;
    const size_t n = a.size(), stride = n <= max_checks ? 1 : n / max_checks;
    for (size_t i = 0; i < n; i += stride) {
      bool done = false;
      for (float eps : {1e-2f, 1e-3f}) {
        const int64_t before = routing_changes;
        moe::testing::GradCheckResult one =
            moe::testing::check_gradient(loss, p->value.data() + i, a.data() + i, 1, eps, 1, floor);
        if (routing_changes != before) {
          ++retried;
          continue;
        }
        r.max_abs_err = std::max(r.max_abs_err, one.max_abs_err);
        r.max_rel_err = std::max(r.max_rel_err, one.max_rel_err);
        r.finite = r.finite && one.finite;
        ++r.checked;
        done = true;
        break;
      }
      if (!done) ++skipped;
    }
    std::printf("    %-26s checked %3zu  max|grad| %.3e  max abs err %.3e  max rel err %.3e\n", p->name.c_str(),
                r.checked, max_grad, r.max_abs_err, r.max_rel_err);
    EXPECT_TRUE(r.finite) << p->name;
    EXPECT_LT(r.max_rel_err, tol_rel) << p->name;
    EXPECT_GE(r.checked, 8u) << p->name;
    EXPECT_GT(max_grad, 1e-3) << p->name << ": gradient (nearly) zero, the check would be vacuous";
    if (r.max_rel_err > worst_rel) {
      worst_rel = r.max_rel_err;
      worst_name = p->name;
    }
    worst_abs = std::max(worst_abs, r.max_abs_err);
    checked += r.checked;
  }
  std::printf("  %s: %zu entries of %zu tensors, max abs err %.3e, max rel err %.3e (%s), tolerance %.0e; "
              "probes across a routing change: %zu retried with eps 1e-3, %zu skipped\n",
              GetParam().name.c_str(), checked, m.params().size(), worst_abs, worst_rel, worst_name.c_str(), tol_rel,
              retried, skipped);
  EXPECT_LE(skipped * 50, checked) << "more than 2% of the probes cross a routing boundary";
  if (cfg.capacity_factor > 0) {
    m.forward(tokens.data(), targets.data(), B);
    int64_t dropped = 0;
    for (const auto& s : m.load_stats()) dropped += s.dropped;
    std::printf("  %s: %lld assignments dropped by capacity\n", GetParam().name.c_str(), (long long)dropped);
    EXPECT_GT(dropped, 0) << "the capacity case should exercise dropping";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Configs, ModelGradCheck,
    ::testing::Values(GradCase{"gelu_layernorm", tiny("gelu", "layernorm")},
                      GradCase{"swiglu_rmsnorm", tiny("swiglu", "rmsnorm")},
                      GradCase{"gelu_rmsnorm_dense_every_other", tiny("gelu", "rmsnorm", true)},
                      GradCase{"swiglu_layernorm_dense_every_other", tiny("swiglu", "layernorm", true)},
                      GradCase{"gelu_layernorm_capacity1_norenorm",
                               [] {
                                 ModelConfig c = tiny("gelu", "layernorm");
                                 c.capacity_factor = 1.0;
                                 c.renormalize = false;
                                 return c;
                               }()}),
    [](const ::testing::TestParamInfo<GradCase>& i) { return i.param.name; });

TEST(Model, ParamNamesShapesAndOrder) {
  Model m(tiny("swiglu", "layernorm", true), 1);
  std::vector<std::string> names;
  for (const Param* p : m.params()) names.push_back(p->name);
  const std::vector<std::string> want = {
      "wte.weight", "wpe.weight",
      "blocks.0.norm1.weight", "blocks.0.norm1.bias", "blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight",
      "blocks.0.norm2.weight", "blocks.0.norm2.bias",
      // the MoE layer's own order (its params()) is checked as a set below
  };
  ASSERT_GE(names.size(), want.size());
  EXPECT_TRUE(std::equal(want.begin(), want.end(), names.begin()));
  std::vector<std::string> moe0(names.begin() + 8, names.begin() + 12);
  std::sort(moe0.begin(), moe0.end());
  EXPECT_EQ(moe0, (std::vector<std::string>{"blocks.0.moe.router.weight", "blocks.0.moe.w1", "blocks.0.moe.w2",
                                            "blocks.0.moe.w3"}));
  const std::vector<std::string> tail = {
      "blocks.1.norm1.weight", "blocks.1.norm1.bias", "blocks.1.attn.qkv.weight", "blocks.1.attn.proj.weight",
      "blocks.1.norm2.weight", "blocks.1.norm2.bias", "blocks.1.mlp.w1", "blocks.1.mlp.w2", "blocks.1.mlp.w3",
      "norm_f.weight", "norm_f.bias"};
  ASSERT_EQ(names.size(), 12 + tail.size());
  EXPECT_TRUE(std::equal(tail.begin(), tail.end(), names.begin() + 12));

  std::map<std::string, std::vector<int64_t>> shape;
  std::map<std::string, bool> decay;
  for (const Param* p : m.params()) {
    shape[p->name] = p->value.shape();
    decay[p->name] = p->decay;
    EXPECT_EQ(p->grad.shape(), p->value.shape()) << p->name;
  }
  using S = std::vector<int64_t>;
  EXPECT_EQ(shape["wte.weight"], (S{256, 16}));
  EXPECT_EQ(shape["wpe.weight"], (S{8, 16}));
  EXPECT_EQ(shape["blocks.0.attn.qkv.weight"], (S{48, 16}));
  EXPECT_EQ(shape["blocks.0.attn.proj.weight"], (S{16, 16}));
  EXPECT_EQ(shape["blocks.0.moe.router.weight"], (S{4, 16}));
  EXPECT_EQ(shape["blocks.0.moe.w1"], (S{4, 32, 16}));
  EXPECT_EQ(shape["blocks.0.moe.w2"], (S{4, 16, 32}));
  EXPECT_EQ(shape["blocks.0.moe.w3"], (S{4, 32, 16}));
  EXPECT_EQ(shape["blocks.1.mlp.w1"], (S{32, 16}));
  EXPECT_EQ(shape["blocks.1.mlp.w2"], (S{16, 32}));
  EXPECT_EQ(shape["blocks.1.mlp.w3"], (S{32, 16}));
  EXPECT_EQ(shape["norm_f.weight"], (S{16}));
  for (const auto& [name, d] : decay) EXPECT_EQ(d, shape[name].size() >= 2) << name;

  // RMSNorm has no biases; GELU no w3.
  Model r(tiny("gelu", "rmsnorm"), 1);
  for (const Param* p : r.params()) {
    EXPECT_EQ(p->name.find(".bias"), std::string::npos) << p->name;
    EXPECT_EQ(p->name.find("w3"), std::string::npos) << p->name;
  }
  EXPECT_EQ(m.moe_layer(1), nullptr);
  EXPECT_NE(m.moe_layer(0), nullptr);
}

TEST(Model, DefaultConfigSize) {
  Model m(ModelConfig{}, 1);
  std::printf("  default config: %lld parameters\n", (long long)m.num_params());
  EXPECT_GT(m.num_params(), 2'000'000);
  EXPECT_LT(m.num_params(), 3'000'000);
}

TEST(Model, InitDependsOnlyOnSeedAndName) {
  ModelConfig c2 = tiny("swiglu", "layernorm"), c3 = c2;
  c3.n_layers = 3;
  Model a(c2, 2), b(c2, 5), other(c2, 2), three(c3, 1);
  a.init(7);
  b.init(7);  // different max_batch: same weights
  other.init(8);
  three.init(7);

  std::map<std::string, const Param*> by_name3;
  for (const Param* p : three.params()) by_name3[p->name] = p;
  auto pa = a.params(), pb = b.params(), po = other.params();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    const Param& x = *pa[i];
    const size_t n = x.value.numel();
    EXPECT_EQ(0, std::memcmp(x.value.data(), pb[i]->value.data(), n * sizeof(float))) << x.name;
    const bool is_normal = x.value.shape().size() >= 2;
    if (is_normal) {
      EXPECT_NE(0, std::memcmp(x.value.data(), po[i]->value.data(), n * sizeof(float))) << x.name << " seed ignored";
    }
    // Block 0 and the embeddings exist in the 3-layer model too: same values, except that
    // proj/w2 are drawn with std 0.02/sqrt(2L), i.e. scaled by sqrt(4/6).
    if (x.name.rfind("blocks.0.", 0) == 0 || x.name.rfind("w", 0) == 0) {
      const Param& y = *by_name3.at(x.name);
      const bool scaled = x.name.find("proj") != std::string::npos || x.name.find("w2") != std::string::npos;
      const double f = scaled ? std::sqrt(4.0 / 6.0) : 1.0;
      double max_err = 0;
      for (size_t k = 0; k < n; ++k) max_err = std::max(max_err, std::fabs(y.value[k] - f * x.value[k]));
      EXPECT_LT(max_err, 1e-7) << x.name;
    }
  }
  // Two tensors of the same model never share a stream.
  EXPECT_NE(moe::param_seed(7, "blocks.0.moe.w1"), moe::param_seed(7, "blocks.0.moe.w3"));
  EXPECT_NE(moe::param_seed(7, "wte.weight"), moe::param_seed(8, "wte.weight"));
}

TEST(Model, InitValuesPerContract) {
  ModelConfig c;  // the default model: enough values per tensor for the statistics
  Model m(c, 1);
  m.init(0);
  for (const Param* p : m.params()) {
    const size_t n = p->value.numel();
    double mean = 0, sq = 0;
    for (size_t i = 0; i < n; ++i) {
      mean += p->value[i];
      sq += double(p->value[i]) * p->value[i];
    }
    mean /= n;
    const double std = std::sqrt(sq / n - mean * mean);
    if (p->name.find(".bias") != std::string::npos) {
      EXPECT_EQ(sq, 0.0) << p->name;
    } else if (p->value.shape().size() == 1) {
      EXPECT_EQ(mean, 1.0) << p->name;
      EXPECT_EQ(std, 0.0) << p->name;
    } else {
      const bool scaled = p->name.find("proj") != std::string::npos || p->name.find("w2") != std::string::npos;
      const double want = scaled ? 0.02 / std::sqrt(2.0 * c.n_layers) : 0.02;
      EXPECT_NEAR(std, want, want * 5.0 / std::sqrt(double(n)) + want * 0.01) << p->name;
      EXPECT_NEAR(mean, 0.0, want * 5.0 / std::sqrt(double(n))) << p->name;
    }
  }
}

TEST(Model, LossAtInitIsLn256) {
  for (const ModelConfig& c : {ModelConfig{}, tiny("gelu", "layernorm"), tiny("swiglu", "rmsnorm", true)}) {
    const int64_t B = 4;
    Model m(c, B);
    m.init(42);
    auto tok = random_tokens(B * c.seq_len, 3), tgt = random_tokens(B * c.seq_len, 4);
    const double loss = m.forward(tok.data(), tgt.data(), B);
    std::printf("  T=%lld C=%lld L=%lld %s/%s: loss at init %.4f (ln 256 = %.4f), aux %.4f z %.5f\n",
                (long long)c.seq_len, (long long)c.d_model, (long long)c.n_layers, c.activation.c_str(),
                c.norm.c_str(), loss, std::log(256.0), m.aux_loss(), m.z_loss());
    EXPECT_NEAR(loss, std::log(256.0), 0.1);
    EXPECT_EQ(loss, m.cross_entropy());
    EXPECT_NEAR(m.total_loss(), loss + m.moe_loss(), 1e-12);
  }
}

TEST(Model, ForwardWithoutTargetsGivesLogitsOnly) {
  const ModelConfig c = tiny("gelu", "layernorm");
  const int64_t B = 2, N = B * c.seq_len;
  Model m(c, B);
  m.init(1);
  auto tok = random_tokens(N, 5), tgt = random_tokens(N, 6);
  m.forward(tok.data(), tgt.data(), B);
  std::vector<float> with(m.logits(), m.logits() + N * 256);
  EXPECT_TRUE(std::isnan(m.forward(tok.data(), nullptr, B)));
  EXPECT_TRUE(std::isnan(m.cross_entropy()));
  EXPECT_EQ(0, std::memcmp(with.data(), m.logits(), with.size() * sizeof(float)));
  EXPECT_THROW(m.backward(), std::logic_error);
}

TEST(Model, RowsAndPrefixesAreIndependent) {
  // Dropless routing is per token and attention is causal, so row 0 of a B=2 batch equals a B=1
  // batch of that row, and the first 4 positions equal a T=4 forward.
  const ModelConfig c = tiny("swiglu", "rmsnorm");
  const int64_t T = c.seq_len;
  Model m(c, 2);
  m.init(3);
  auto tok = random_tokens(2 * T, 7);
  m.forward(tok.data(), nullptr, 2);
  std::vector<float> full(m.logits(), m.logits() + 2 * T * 256);
  m.forward(tok.data(), nullptr, 1);
  double err = 0;
  for (int64_t i = 0; i < T * 256; ++i) err = std::max(err, double(std::fabs(full[i] - m.logits()[i])));
  EXPECT_LT(err, 1e-5);
  m.forward(tok.data() + T, nullptr, 1, 4);  // row 1, first 4 positions
  EXPECT_EQ(m.seq(), 4);
  err = 0;
  for (int64_t t = 0; t < 4; ++t)
    for (int64_t v = 0; v < 256; ++v)
      err = std::max(err, double(std::fabs(full[(T + t) * 256 + v] - m.logits()[t * 256 + v])));
  EXPECT_LT(err, 1e-5);
}

TEST(Model, ZeroGradAndAccumulation) {
  const ModelConfig c = tiny("gelu", "layernorm", true);
  const int64_t B = 2, N = B * c.seq_len;
  Model m(c, B);
  m.init(1);
  auto tok = random_tokens(N, 8), tgt = random_tokens(N, 9);
  m.zero_grad();
  m.forward(tok.data(), tgt.data(), B);
  m.backward();
  std::vector<std::vector<float>> once;
  for (const Param* p : m.params()) once.emplace_back(p->grad.data(), p->grad.data() + p->grad.numel());
  m.forward(tok.data(), tgt.data(), B);
  m.backward();  // accumulates: twice the gradient
  auto ps = m.params();
  for (size_t i = 0; i < ps.size(); ++i)
    for (size_t k = 0; k < once[i].size(); ++k)
      ASSERT_NEAR(ps[i]->grad[k], 2 * once[i][k], 1e-5 + 1e-5 * std::fabs(once[i][k])) << ps[i]->name;
  m.zero_grad();
  for (const Param* p : m.params())
    for (size_t k = 0; k < p->grad.numel(); ++k) ASSERT_EQ(p->grad[k], 0.0f) << p->name;
}

TEST(Model, LoadStatistics) {
  ModelConfig c = tiny("gelu", "layernorm", true);
  c.n_layers = 3;  // MoE blocks 0 and 2, dense block 1
  const int64_t B = 2, N = B * c.seq_len;
  Model m(c, B);
  m.init(1);
  auto tok = random_tokens(N, 10);
  m.forward(tok.data(), nullptr, B);
  auto stats = m.load_stats();
  ASSERT_EQ(stats.size(), 2u);
  EXPECT_EQ(stats[0].layer, 0);
  EXPECT_EQ(stats[1].layer, 2);
  double aux = 0;
  for (const auto& s : stats) {
    ASSERT_EQ(s.tokens_per_expert.size(), 4u);
    int64_t sum = 0;
    for (int64_t k : s.tokens_per_expert) sum += k;
    EXPECT_EQ(sum, N * c.top_k);  // dropless
    EXPECT_EQ(s.dropped, 0);
    aux += s.aux_loss;
  }
  EXPECT_NEAR(aux, m.aux_loss(), 1e-6);
}

// A drifting router skew turns each block's popularity order by floor(R * step) experts: with a skew so
// strong that the bias outweighs the logits, every token's top-1 is the hot expert (l + floor(R s)) mod E.
TEST(Model, DriftingRouterSkewMovesTheHotExpertWithTheStep) {
  ModelConfig c = tiny("gelu", "layernorm", true);
  c.n_layers = 3;  // MoE blocks 0 and 2
  c.top_k = 1;
  c.router_skew = 40;
  c.router_skew_drift = 0.5;
  const int64_t B = 2, N = B * c.seq_len, E = c.n_experts;
  Model m(c, B);
  m.init(1);
  auto tok = random_tokens(N, 10);
  for (int64_t step : {0, 1, 2, 3, 7, 6, 0}) {
    m.set_router_step(step);
    m.forward(tok.data(), nullptr, B);
    for (const LayerLoad& s : m.load_stats()) {
      const int64_t hot = (s.layer + step / 2) % E;
      EXPECT_EQ(s.tokens_per_expert[hot], N) << "step " << step << ", block " << s.layer;
      EXPECT_EQ(c.router_bias(s.layer, step)[hot], 0.0f);
    }
  }
  // Without drift the order stays at step 0's whatever the step.
  c.router_skew_drift = 0;
  Model fixed(c, B);
  fixed.init(1);
  fixed.set_router_step(7);
  fixed.forward(tok.data(), nullptr, B);
  for (const LayerLoad& s : fixed.load_stats()) EXPECT_EQ(s.tokens_per_expert[s.layer % E], N);
}

TEST(Model, SgdStepsReduceLoss) {
  const ModelConfig c = tiny("swiglu", "layernorm", true);
  const int64_t B = 4, N = B * c.seq_len;
  Model m(c, B);
  m.init(5);
  std::vector<int32_t> tok(N), tgt(N);
  for (int64_t i = 0; i < N; ++i) {  // a learnable pattern: next byte = byte + 1
    tok[i] = static_cast<int32_t>((i * 7) % 250);
    tgt[i] = tok[i] + 1;
  }
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    m.zero_grad();
    m.forward(tok.data(), tgt.data(), B);
    if (step == 0) first = m.total_loss();
    last = m.total_loss();
    m.backward();
    for (Param* p : m.params())
      for (size_t k = 0; k < p->value.numel(); ++k) p->value[k] -= 0.5f * p->grad[k];
  }
  std::printf("  SGD on a fixed batch: total loss %.4f -> %.4f\n", first, last);
  EXPECT_LT(last, first - 0.5);
}

TEST(Model, RejectsBadConstructionAndInputs) {
  ModelConfig bad = tiny("gelu", "layernorm");
  bad.top_k = 5;
  EXPECT_THROW(Model(bad, 1), std::invalid_argument);
  EXPECT_THROW(Model(tiny("gelu", "layernorm"), 0), std::invalid_argument);
  Model m(tiny("gelu", "layernorm"), 2);
  auto tok = random_tokens(3 * 8, 1);
  EXPECT_THROW(m.forward(tok.data(), nullptr, 3), std::logic_error);     // B > max_batch
  EXPECT_THROW(m.forward(tok.data(), nullptr, 1, 9), std::logic_error);  // T > seq_len
  tok[5] = 256;
  EXPECT_THROW(m.forward(tok.data(), nullptr, 1), std::logic_error);
}
