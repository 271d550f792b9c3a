// safetensors encoding and decoding, checkpoint round trip and rejection of damaged checkpoints,
// the optimizer's schedule and clipping; PyTorch reads the files we write.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <cstring>
#include <map>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "grad_check.h"
#include "model/checkpoint.h"
#include "model/model.h"
#include "model/optimizer.h"
#include "model/safetensors.h"

namespace fs = std::filesystem;
using namespace moe;

namespace {

fs::path temp_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("moe_ckpt_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

ModelConfig tiny_config() {
  ModelConfig c;
  c.seq_len = 8;
  c.d_model = 16;
  c.n_layers = 2;
  c.n_heads = 2;
  c.d_ffn = 32;
  c.n_experts = 4;
  c.top_k = 2;
  return c;
}

// One optimizer step on a fixed batch so parameters and moments are all non-trivial.
void train_one_step(Model& m, AdamW& opt) {
  std::vector<int32_t> tok(2 * 8), tgt(2 * 8);
  for (size_t i = 0; i < tok.size(); ++i) tok[i] = (i * 37) % 256, tgt[i] = (i * 11 + 3) % 256;
  m.zero_grad();
  m.forward(tok.data(), tgt.data(), 2);
  m.backward();
  opt.clip_grad_norm(1.0f);
  opt.step(1e-3f);
}

TEST(Safetensors, RoundTripIsExact) {
  std::vector<float> a(6), b(4);
  moe::testing::fill_normal(a.data(), a.size(), 1);
  moe::testing::fill_normal(b.data(), b.size(), 2);
  std::string bytes;
  ASSERT_TRUE(encode_safetensors({{"a", {2, 3}, a.data()}, {"b.weight", {4}, b.data()}, {"empty", {0, 3}, nullptr}},
                                 {{"format", "moe"}}, &bytes));
  uint64_t hl;
  std::memcpy(&hl, bytes.data(), 8);
  EXPECT_EQ(hl % 8, 0u) << "header must be padded to 8 bytes";
  std::map<std::string, LoadedTensor> t;
  std::map<std::string, std::string> meta;
  ASSERT_TRUE(decode_safetensors(bytes, "x", &t, &meta));
  ASSERT_EQ(t.size(), 3u);
  EXPECT_EQ(t["a"].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(std::memcmp(t["a"].data.data(), a.data(), a.size() * 4), 0);
  EXPECT_EQ(std::memcmp(t["b.weight"].data.data(), b.data(), b.size() * 4), 0);
  EXPECT_TRUE(t["empty"].data.empty());
  EXPECT_EQ(meta["format"], "moe");
  EXPECT_FALSE(encode_safetensors({{"a", {1}, a.data()}, {"a", {1}, a.data()}}, {}, &bytes)) << "duplicate name";
}

TEST(Safetensors, EveryDamageIsAnErrorNamingTheProblem) {
  std::vector<float> a(6, 1.5f);
  std::string good;
  ASSERT_TRUE(encode_safetensors({{"w", {2, 3}, a.data()}}, {}, &good));
  auto expect_error = [](const std::string& bytes, const std::string& needle) {
    std::map<std::string, LoadedTensor> t;
    Status s = decode_safetensors(bytes, "f.safetensors", &t, nullptr);
    EXPECT_FALSE(s) << "accepted damaged file expecting '" << needle << "'";
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("f.safetensors"), std::string::npos) << s.message();
  };
  expect_error(good.substr(0, 5), "too short");
  expect_error(good.substr(0, good.size() - 4), "truncated");
  std::string huge = good;
  uint64_t big = 1ull << 40;
  std::memcpy(huge.data(), &big, 8);
  expect_error(huge, "header length");
  auto with_header = [&](const std::string& h) {
    std::string padded = h + std::string((8 - h.size() % 8) % 8, ' ');
    uint64_t hl = padded.size();
    std::string out(reinterpret_cast<const char*>(&hl), 8);
    return out + padded + std::string(24, '\0');
  };
  expect_error(with_header("{\"w\": "), "not valid JSON");
  expect_error(with_header(R"({"w":{"dtype":"F16","shape":[2,3],"data_offsets":[0,12]}})"), "dtype F16");
  expect_error(with_header(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})"), "bytes");
  expect_error(with_header(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,48]}})"), "outside");
  expect_error(with_header(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"v":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})"),
               "overlap");
  expect_error(with_header(R"({"w":{"dtype":"F32","shape":[2]}})"), "malformed");
}

TEST(Checkpoint, RoundTripRestoresWeightsMomentsAndState) {
  fs::path dir = temp_dir("roundtrip");
  Model a(tiny_config(), 2);
  a.init(7);
  AdamW oa(a.params(), AdamWConfig{});
  train_one_step(a, oa);
  train_one_step(a, oa);
  ASSERT_TRUE(save_checkpoint((dir / "ck").string(), a.params(), oa, {{"step", 2}, {"note", "x"}}));
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_EQ(e.path().filename(), "ck") << "left behind: " << e.path();

  Model b(tiny_config(), 2);
  b.init(99);  // different weights, to be overwritten
  AdamW ob(b.params(), AdamWConfig{});
  nlohmann::json state;
  ASSERT_TRUE(load_checkpoint((dir / "ck").string(), b.params(), &ob, &state));
  EXPECT_EQ(state["step"], 2);
  EXPECT_EQ(state["note"], "x");
  EXPECT_EQ(ob.steps(), 2);
  for (size_t i = 0; i < a.params().size(); ++i) {
    const Param* p = a.params()[i];
    const Param* q = b.params()[i];
    EXPECT_EQ(std::memcmp(p->value.data(), q->value.data(), p->value.numel() * 4), 0) << p->name;
    EXPECT_EQ(std::memcmp(oa.m(i).data(), ob.m(i).data(), p->value.numel() * 4), 0) << p->name << ".m";
    EXPECT_EQ(std::memcmp(oa.v(i).data(), ob.v(i).data(), p->value.numel() * 4), 0) << p->name << ".v";
  }
  // Overwriting an existing checkpoint replaces it whole.
  train_one_step(a, oa);
  ASSERT_TRUE(save_checkpoint((dir / "ck").string(), a.params(), oa, {{"step", 3}}));
  ASSERT_TRUE(load_checkpoint((dir / "ck").string(), b.params(), &ob, &state));
  EXPECT_EQ(state["step"], 3);
  EXPECT_FALSE(state.contains("note"));
  fs::remove_all(dir);
}

TEST(Checkpoint, DamagedOrMismatchedIsRejectedAndLoadsNothing) {
  fs::path dir = temp_dir("damaged");
  Model a(tiny_config(), 2);
  a.init(7);
  AdamW oa(a.params(), AdamWConfig{});
  train_one_step(a, oa);
  const std::string ck = (dir / "ck").string();
  ASSERT_TRUE(save_checkpoint(ck, a.params(), oa, {{"step", 1}}));

  Model b(tiny_config(), 2);
  b.init(99);
  AdamW ob(b.params(), AdamWConfig{});
  const float before = b.params()[0]->value[0];
  auto expect_rejected = [&](const std::string& needle) {
    Status s = load_checkpoint(ck, b.params(), &ob, nullptr);
    EXPECT_FALSE(s) << "expected rejection with '" << needle << "'";
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
    EXPECT_EQ(b.params()[0]->value[0], before) << "a rejected checkpoint modified the model";
  };
  auto rewrite = [&](const std::string& file, const std::function<void(std::string&)>& edit) {
    std::string bytes;
    ASSERT_TRUE(read_file(ck + "/" + file, &bytes));
    edit(bytes);
    std::ofstream(ck + "/" + file, std::ios::binary) << bytes;
  };

  // Another shape: a model with 8 experts.
  ModelConfig wide = tiny_config();
  wide.n_experts = 8;
  Model c(wide, 2);
  Status s = load_checkpoint(ck, c.params(), nullptr, nullptr);
  EXPECT_FALSE(s);
  EXPECT_NE(s.message().find("blocks.0.moe.router.weight has shape [4,16], the model expects [8,16]"),
            std::string::npos)
      << s.message();

  std::string original;
  ASSERT_TRUE(read_file(ck + "/model.safetensors", &original));
  rewrite("model.safetensors", [](std::string& b) { b[b.size() - 5] ^= 0x20; });
  expect_rejected("checksum");
  rewrite("model.safetensors", [&](std::string& b) { b = original.substr(0, original.size() / 2); });
  expect_rejected("model.safetensors has");
  rewrite("model.safetensors", [&](std::string& b) { b = original; });
  ASSERT_TRUE(load_checkpoint(ck, b.params(), &ob, nullptr)) << "restored file must load again";
  b.init(99);
  fs::remove(ck + "/optimizer.safetensors");
  expect_rejected("optimizer.safetensors");
  fs::remove_all(dir);
}

TEST(Optimizer, ScheduleAndClipping) {
  // warmup 10 of 110 steps from 1e-3 to 1e-4
  EXPECT_FLOAT_EQ(lr_at(0, 110, 10, 1e-3f, 1e-4f), 1e-4f);
  EXPECT_FLOAT_EQ(lr_at(9, 110, 10, 1e-3f, 1e-4f), 1e-3f);
  EXPECT_FLOAT_EQ(lr_at(10, 110, 10, 1e-3f, 1e-4f), 1e-3f);
  EXPECT_NEAR(lr_at(60, 110, 10, 1e-3f, 1e-4f), 5.5e-4f, 1e-9);  // half way: the mean
  EXPECT_FLOAT_EQ(lr_at(110, 110, 10, 1e-3f, 1e-4f), 1e-4f);
  EXPECT_FLOAT_EQ(lr_at(5, 10, 0, 1e-3f, 0.0f), 5e-4f);

  Param p("w", {4});
  for (int i = 0; i < 4; ++i) p.grad[i] = 3.0f;  // norm 6
  AdamW opt({&p}, AdamWConfig{});
  EXPECT_DOUBLE_EQ(opt.clip_grad_norm(INFINITY), 6.0);
  EXPECT_FLOAT_EQ(p.grad[0], 3.0f) << "an infinite max norm only measures";
  EXPECT_DOUBLE_EQ(opt.clip_grad_norm(1.5f), 6.0);
  EXPECT_FLOAT_EQ(p.grad[0], 0.75f);
  // Weight decay applies only where decay is set: a norm weight with zero gradient stays put.
  Param norm("n", {2}, /*wd=*/false);
  norm.value[0] = norm.value[1] = 1.0f;
  AdamW o2({&norm}, AdamWConfig{});
  o2.step(1e-2f);
  EXPECT_EQ(norm.value[0], 1.0f);
}

// The weights file is readable by PyTorch with nothing but the format's definition.
TEST(Checkpoint, PyTorchReadsTheWeights) {
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "/usr/bin/python3 cannot import torch (scripts/setup.sh --test installs it)";
  fs::path dir = temp_dir("torch");
  Model a(tiny_config(), 2);
  a.init(5);
  AdamW oa(a.params(), AdamWConfig{});
  ASSERT_TRUE(save_checkpoint((dir / "ck").string(), a.params(), oa, {{"step", 0}}));
  std::string cmd = "/usr/bin/python3 " + std::string(MOE_TEST_DIR) + "/load_safetensors.py " +
                    (dir / "ck" / "model.safetensors").string() + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::map<std::string, std::string> lines;
  char buf[4096];
  std::string meta;
  while (fgets(buf, sizeof buf, pipe)) {
    std::string line(buf);
    if (line.rfind("metadata", 0) == 0) meta = line;
    else lines[line.substr(0, line.find(' '))] = line;
  }
  ASSERT_EQ(pclose(pipe), 0) << "the PyTorch reader failed";
  EXPECT_NE(meta.find("\"format\": \"moe\""), std::string::npos) << meta;
  ASSERT_EQ(lines.size(), a.params().size());
  for (const Param* p : a.params()) {
    ASSERT_TRUE(lines.count(p->name)) << p->name;
    std::istringstream in(lines[p->name]);
    std::string name, shape;
    double sum, first;
    in >> name >> shape >> sum >> first;
    std::string want = "[";
    for (size_t i = 0; i < p->value.shape().size(); ++i) {
      if (i) want += ',';
      want += std::to_string(p->value.dim(i));
    }
    EXPECT_EQ(shape, want + "]") << p->name;
    double ours = 0;
    for (size_t i = 0; i < p->value.numel(); ++i) ours += p->value[i];
    EXPECT_NEAR(sum, ours, 1e-6 * (1 + std::fabs(ours))) << p->name;
    EXPECT_EQ(static_cast<float>(first), p->value[0]) << p->name;
  }
  fs::remove_all(dir);
}

}  // namespace
