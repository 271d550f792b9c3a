// ModelConfig validation and JSON; Model: whole-model gradient check, init determinism, loss at init.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "model/config.h"

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
  json j = c.to_json();
  EXPECT_EQ(j.size(), 15u);
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
