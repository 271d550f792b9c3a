// safetensors encoding and decoding, checkpoint round trip and rejection of damaged checkpoints,
// the optimizer's schedule and clipping; PyTorch reads the files we write.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <cstring>
#include <map>
#include <memory>
#include <numbers>
#include <set>
#include <stdexcept>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "grad_check.h"
#include "model/checkpoint.h"
#include "model/data.h"
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

// ---- more of the format: the exact byte layout, every rule the reader enforces -------------------

// The bytes of a file whose header is `h` (padded to 8) followed by `data`.
std::string file_with_header(const std::string& h, const std::string& data) {
  std::string padded = h + std::string((8 - h.size() % 8) % 8, ' ');
  uint64_t hl = padded.size();
  return std::string(reinterpret_cast<const char*>(&hl), 8) + padded + data;
}

TEST(Safetensors, ByteLayoutIsTheStandardOne) {
  const float a[3] = {1.0f, -2.5f, 3.25f}, b[2] = {0.5f, 1e-30f};
  std::string bytes;
  ASSERT_TRUE(encode_safetensors({{"b", {2}, b}, {"a", {1, 3}, a}}, {{"k", "v"}}, &bytes));
  uint64_t hl;
  std::memcpy(&hl, bytes.data(), 8);  // little-endian u64 (this machine is little-endian)
  ASSERT_EQ(hl % 8, 0u);
  ASSERT_EQ(bytes.size(), 8 + hl + 20);
  const std::string header = bytes.substr(8, hl);
  const size_t json_end = header.find_last_not_of(' ') + 1;
  EXPECT_EQ(header[json_end - 1], '}');
  EXPECT_LT(hl - json_end, 8u) << "padding is spaces, at most 7";
  nlohmann::json h = nlohmann::json::parse(header);
  // Data in the order given: b first, then a.
  EXPECT_EQ(h["b"], nlohmann::json::parse(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})"));
  EXPECT_EQ(h["a"], nlohmann::json::parse(R"({"dtype":"F32","shape":[1,3],"data_offsets":[8,20]})"));
  EXPECT_EQ(h["__metadata__"], nlohmann::json::parse(R"({"k":"v"})"));
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + hl, b, 8), 0);
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + hl + 8, a, 12), 0);

  // Decoding and encoding again (same order) gives the same bytes.
  std::map<std::string, LoadedTensor> t;
  std::map<std::string, std::string> meta;
  ASSERT_TRUE(decode_safetensors(bytes, "x", &t, &meta));
  std::string again;
  ASSERT_TRUE(encode_safetensors({{"b", t["b"].shape, t["b"].data.data()}, {"a", t["a"].shape, t["a"].data.data()}},
                                 meta, &again));
  EXPECT_TRUE(again == bytes);
  // No metadata: no "__metadata__" key.
  ASSERT_TRUE(encode_safetensors({{"a", {3}, a}}, {}, &bytes));
  EXPECT_EQ(bytes.find("__metadata__"), std::string::npos);
}

TEST(Safetensors, EncodeRejectsWhatTheFormatCannotHold) {
  const float x[2] = {1, 2};
  std::string bytes;
  EXPECT_FALSE(encode_safetensors({{"__metadata__", {2}, x}}, {}, &bytes));
  EXPECT_FALSE(encode_safetensors({{"", {2}, x}}, {}, &bytes));
  EXPECT_FALSE(encode_safetensors({{"w", {-1, 2}, x}}, {}, &bytes));
  EXPECT_FALSE(encode_safetensors({{"w", {2}, nullptr}}, {}, &bytes));
  Status s = encode_safetensors({{"w\xff", {2}, x}}, {}, &bytes);
  EXPECT_FALSE(s);
  EXPECT_NE(s.message().find("UTF-8"), std::string::npos) << s.message();
  EXPECT_FALSE(encode_safetensors({{"w", {2}, x}}, {{"k", "\xc3"}}, &bytes));
}

TEST(Safetensors, MoreDamageCases) {
  auto expect_error = [](const std::string& bytes, const std::string& needle) {
    std::map<std::string, LoadedTensor> t{{"keep", {}}};
    std::map<std::string, std::string> meta{{"keep", "1"}};
    Status s = decode_safetensors(bytes, "g.safetensors", &t, &meta);
    EXPECT_FALSE(s) << "accepted a damaged file expecting '" << needle << "'";
    EXPECT_EQ(s.message().rfind("g.safetensors: ", 0), 0u) << s.message();
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
    EXPECT_TRUE(t.size() == 1 && t.count("keep") && meta.size() == 1) << "outputs changed on error";
  };
  const std::string d8(8, '\0'), d12(12, '\0');
  expect_error("", "too short");
  expect_error(file_with_header("[1,2]", ""), "not a JSON object");
  expect_error(file_with_header("", ""), "not valid JSON");
  expect_error(file_with_header(R"({"w":[1]})", d8), "malformed");
  expect_error(file_with_header(R"({"w":{"dtype":7,"shape":[2],"data_offsets":[0,8]}})", d8), "dtype");
  expect_error(file_with_header(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", d8), "non-negative");
  expect_error(file_with_header(R"({"w":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", d8), "non-negative");
  expect_error(file_with_header(R"({"w":{"dtype":"F32","shape":"2","data_offsets":[0,8]}})", d8), "shape");
  expect_error(file_with_header(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", d8), "outside");
  expect_error(file_with_header(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})", d8), "data_offsets");
  expect_error(file_with_header(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", d8), "data_offsets");
  // prod(shape) * 4 overflows 64 bits but wraps to the byte count: still caught.
  expect_error(file_with_header(R"({"w":{"dtype":"F32","shape":[4611686018427387904,1],"data_offsets":[0,0]}})", ""),
               "bytes");
  // Ranges must tile the data: a gap, bytes after the last tensor.
  expect_error(file_with_header(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", d8), "no tensor");
  expect_error(file_with_header(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", d12), "no tensor");
  expect_error(file_with_header(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"k":1}})", d8),
               "__metadata__");
  expect_error(file_with_header(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":[]})", d8),
               "__metadata__");
  expect_error(file_with_header("{\"w\xff\":{}}", d8), "not valid JSON");
  // A deeply nested header is an error, not a stack overflow.
  expect_error(file_with_header(std::string(100000, '[') + std::string(100000, ']'), ""), "not a JSON object");

  // Every truncation of a good file, and every flipped header byte, is handled without a crash.
  std::vector<float> w(6, 0.25f);
  std::string good;
  ASSERT_TRUE(encode_safetensors({{"w", {2, 3}, w.data()}, {"v", {3}, w.data()}}, {{"format", "moe"}}, &good));
  std::map<std::string, LoadedTensor> t;
  for (size_t n = 0; n < good.size(); ++n)
    EXPECT_FALSE(decode_safetensors(good.substr(0, n), "p", &t, nullptr)) << "prefix of " << n << " bytes accepted";
  uint64_t hl;
  std::memcpy(&hl, good.data(), 8);
  for (size_t i = 0; i < 8 + hl; ++i)
    for (unsigned char bit : {0x01, 0x20, 0x80}) {
      std::string bad = good;
      bad[i] = static_cast<char>(bad[i] ^ bit);
      std::map<std::string, std::string> meta;
      Status s = decode_safetensors(bad, "p", &t, &meta);  // may be accepted (e.g. a renamed key)
      if (s) {
        size_t total = 0;
        for (const auto& [name, x] : t) total += x.data.size();
        EXPECT_EQ(total, 9u) << "byte " << i << ": accepted with a different amount of data";
      }
    }
}

TEST(Safetensors, FilesAreWrittenAtomically) {
  fs::path dir = temp_dir("files");
  const std::string path = (dir / "w.safetensors").string();
  const float x[4] = {1, 2, 3, 4}, y[2] = {5, 6};
  ASSERT_TRUE(save_safetensors(path, {{"x", {2, 2}, x}}, {{"step", "1"}}));
  ASSERT_TRUE(save_safetensors(path, {{"y", {2}, y}}, {{"step", "2"}}));  // replaces the first
  std::map<std::string, LoadedTensor> t;
  std::map<std::string, std::string> meta;
  ASSERT_TRUE(load_safetensors(path, &t, &meta));
  ASSERT_EQ(t.size(), 1u);
  EXPECT_EQ(t["y"].data, (std::vector<float>{5, 6}));
  EXPECT_EQ(meta["step"], "2");
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_EQ(e.path().filename(), "w.safetensors") << "left behind: " << e.path();

  Status s = save_safetensors((dir / "nope" / "w.safetensors").string(), {{"y", {2}, y}}, {});
  EXPECT_FALSE(s);
  EXPECT_NE(s.message().find("nope"), std::string::npos) << s.message();
  s = load_safetensors((dir / "missing.safetensors").string(), &t, &meta);
  EXPECT_FALSE(s);
  EXPECT_NE(s.message().find("missing.safetensors"), std::string::npos) << s.message();
  std::string bytes;
  s = read_file(dir.string(), &bytes);
  EXPECT_FALSE(s) << "a folder is not a file";
  EXPECT_NE(s.message().find("not a regular file"), std::string::npos) << s.message();
  fs::remove_all(dir);
}

// ---- checkpoints: the layout, replacement rules, exact resume, every rejection -------------------

TEST(Checkpoint, LayoutStateAndModelConfig) {
  fs::path dir = temp_dir("layout");
  Model a(tiny_config(), 2);
  a.init(3);
  AdamW oa(a.params(), AdamWConfig{});
  train_one_step(a, oa);
  nlohmann::json state{{"step", 1}, {"data_position", 1}, {"config", {{"model", tiny_config().to_json()}}}};
  const std::string ck = (dir / "ck").string();
  ASSERT_TRUE(save_checkpoint(ck + "/", a.params(), oa, state)) << "a trailing slash names the same folder";
  std::set<std::string> files;
  for (const auto& e : fs::directory_iterator(ck)) files.insert(e.path().filename().string());
  EXPECT_EQ(files, (std::set<std::string>{"model.safetensors", "optimizer.safetensors", "state.json"}));
  for (const auto& e : fs::directory_iterator(dir)) EXPECT_EQ(e.path().filename(), "ck") << e.path();

  // state.json: the caller's keys, the optimizer step, each file's size and FNV-1a 64.
  std::string text, model_bytes;
  ASSERT_TRUE(read_file(ck + "/state.json", &text));
  ASSERT_TRUE(read_file(ck + "/model.safetensors", &model_bytes));
  nlohmann::json st = nlohmann::json::parse(text);
  EXPECT_EQ(st["data_position"], 1);
  EXPECT_EQ(st["optimizer_step"], 1);
  EXPECT_EQ(st["files"]["model.safetensors"]["bytes"], model_bytes.size());
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", (unsigned long long)fnv1a64(model_bytes.data(), model_bytes.size()));
  EXPECT_EQ(st["files"]["model.safetensors"]["fnv1a64"], hex);

  // model.safetensors: every parameter, and the model config as JSON in the metadata.
  std::map<std::string, LoadedTensor> w;
  std::map<std::string, std::string> meta;
  ASSERT_TRUE(decode_safetensors(model_bytes, "model", &w, &meta));
  EXPECT_EQ(w.size(), a.params().size());
  ModelConfig back;
  ASSERT_TRUE(ModelConfig::from_json(nlohmann::json::parse(meta.at("model_config")), &back));
  EXPECT_TRUE(back == tiny_config());
  // optimizer.safetensors: <name>.m and <name>.v, metadata step.
  std::map<std::string, LoadedTensor> mv;
  ASSERT_TRUE(load_safetensors(ck + "/optimizer.safetensors", &mv, &meta));
  EXPECT_EQ(mv.size(), 2 * a.params().size());
  EXPECT_TRUE(mv.count("blocks.1.moe.w2.m") && mv.count("wte.weight.v"));
  EXPECT_EQ(meta["step"], "1");
  fs::remove_all(dir);
}

TEST(Checkpoint, ResumeContinuesExactly) {
  fs::path dir = temp_dir("resume");
  Model a(tiny_config(), 2);
  a.init(11);
  AdamW oa(a.params(), AdamWConfig{});
  train_one_step(a, oa);
  train_one_step(a, oa);
  ASSERT_TRUE(save_checkpoint((dir / "ck").string(), a.params(), oa, {{"step", 2}}));
  Model b(tiny_config(), 2);
  AdamW ob(b.params(), AdamWConfig{});
  ASSERT_TRUE(load_checkpoint((dir / "ck").string(), b.params(), &ob, nullptr));
  train_one_step(a, oa);
  train_one_step(b, ob);
  for (size_t i = 0; i < a.params().size(); ++i) {
    const Param* p = a.params()[i];
    EXPECT_EQ(std::memcmp(p->value.data(), b.params()[i]->value.data(), p->value.numel() * 4), 0) << p->name;
  }
  fs::remove_all(dir);
}

TEST(Checkpoint, NeverReplacesAFolderThatIsNotACheckpoint) {
  fs::path dir = temp_dir("foreign");
  Model a(tiny_config(), 2);
  AdamW oa(a.params(), AdamWConfig{});
  std::ofstream(dir / "notes.txt") << "precious";
  Status s = save_checkpoint(dir.string(), a.params(), oa, {{"step", 0}});
  EXPECT_FALSE(s);
  EXPECT_NE(s.message().find("notes.txt"), std::string::npos) << s.message();
  EXPECT_TRUE(fs::exists(dir / "notes.txt"));
  for (const auto& e : fs::directory_iterator(dir.parent_path()))
    EXPECT_EQ(e.path().filename().string().find(dir.filename().string() + ".tmp"), std::string::npos) << e.path();
  // Its parent is a file: an error, nothing written.
  s = save_checkpoint((dir / "notes.txt" / "ck").string(), a.params(), oa, {{"step", 0}});
  EXPECT_FALSE(s);
  EXPECT_FALSE(save_checkpoint((dir / "ck").string(), a.params(), oa, nlohmann::json::array()))
      << "state must be an object";
  // Built over other parameters: a programming error.
  Model other(tiny_config(), 2);
  EXPECT_THROW(save_checkpoint((dir / "ck").string(), other.params(), oa, {}), std::logic_error);
  fs::remove_all(dir);
}

TEST(Checkpoint, EveryRejectionNamesTheProblemAndLoadsNothing) {
  fs::path dir = temp_dir("reject");
  Model a(tiny_config(), 2);
  a.init(7);
  AdamW oa(a.params(), AdamWConfig{});
  train_one_step(a, oa);
  const std::string ck = (dir / "ck").string();
  ASSERT_TRUE(save_checkpoint(ck, a.params(), oa, {{"step", 1}}));

  Model b(tiny_config(), 2);
  b.init(99);
  AdamW ob(b.params(), AdamWConfig{});
  std::vector<std::vector<float>> before;
  for (const Param* p : b.params()) before.emplace_back(p->value.data(), p->value.data() + p->value.numel());
  auto expect_rejected = [&](const std::string& needle, const std::string& what) {
    Status s = load_checkpoint(ck, b.params(), &ob, nullptr);
    EXPECT_FALSE(s) << what << ": expected rejection with '" << needle << "'";
    EXPECT_NE(s.message().find(needle), std::string::npos) << what << ": " << s.message();
    EXPECT_EQ(s.message().rfind("checkpoint " + ck, 0), 0u) << s.message();
    for (size_t i = 0; i < b.params().size(); ++i)
      EXPECT_EQ(std::memcmp(before[i].data(), b.params()[i]->value.data(), before[i].size() * 4), 0)
          << what << ": a rejected checkpoint modified " << b.params()[i]->name;
    EXPECT_EQ(ob.steps(), 0) << what;
    for (size_t i = 0; i < b.params().size(); ++i) EXPECT_EQ(ob.m(i)[0], 0.0f) << what;
  };
  auto with_file = [&](const std::string& file, const std::function<void(std::string&)>& edit,
                       const std::string& needle) {
    std::string original, bytes;
    ASSERT_TRUE(read_file(ck + "/" + file, &original));
    bytes = original;
    edit(bytes);
    std::ofstream(ck + "/" + file, std::ios::binary | std::ios::trunc) << bytes;
    expect_rejected(needle, file + " edited");
    std::ofstream(ck + "/" + file, std::ios::binary | std::ios::trunc) << original;
  };
  // A flipped byte anywhere in either file, one bit, a truncation, an appended byte.
  with_file("optimizer.safetensors", [](std::string& x) { x[x.size() / 2] ^= 1; }, "optimizer.safetensors fails its checksum");
  with_file("model.safetensors", [](std::string& x) { x[20] ^= 4; }, "model.safetensors fails its checksum");
  with_file("model.safetensors", [](std::string& x) { x.resize(x.size() - 1); }, "truncated");
  with_file("model.safetensors", [](std::string& x) { x += '\0'; }, "model.safetensors has");
  with_file("state.json", [](std::string& x) { x = x.substr(0, x.size() / 2); }, "state.json is not valid JSON");
  with_file("state.json", [](std::string& x) { x = "[]"; }, "not a JSON object");
  with_file("state.json", [](std::string& x) { x = R"({"step": 1})"; }, "lacks the size and checksum");
  with_file("state.json",
            [](std::string& x) {
              auto j = nlohmann::json::parse(x);
              j["optimizer_step"] = 5;
              x = j.dump();
            },
            "optimizer.safetensors is at step 1");
  ASSERT_TRUE(load_checkpoint(ck, b.params(), &ob, nullptr)) << "the restored files load";
  EXPECT_EQ(ob.steps(), 1);
  b.init(99);
  ob = AdamW(b.params(), AdamWConfig{});  // back to zero moments and step 0

  // Folder or file missing.
  Status s = load_checkpoint((dir / "nope").string(), b.params(), &ob, nullptr);
  EXPECT_NE(s.message().find("no such directory"), std::string::npos) << s.message();
  fs::rename(ck + "/state.json", ck + "/state.json.x");
  expect_rejected("state.json", "state.json missing");
  fs::rename(ck + "/state.json.x", ck + "/state.json");

  // A model with one block fewer: the checkpoint has tensors it lacks.
  ModelConfig one = tiny_config();
  one.n_layers = 1;
  Model c(one, 2);
  s = load_checkpoint(ck, c.params(), nullptr, nullptr);
  EXPECT_NE(s.message().find("has tensor blocks.1."), std::string::npos) << s.message();
  // A model with one more: a tensor is missing.
  ModelConfig three = tiny_config();
  three.n_layers = 3;
  Model d(three, 2);
  s = load_checkpoint(ck, d.params(), nullptr, nullptr);
  EXPECT_NE(s.message().find("tensor blocks.2.norm1.weight is missing"), std::string::npos) << s.message();
  // The exact shape message.
  ModelConfig wide = tiny_config();
  wide.d_ffn = 64;
  Model e(wide, 2);
  s = load_checkpoint(ck, e.params(), nullptr, nullptr);
  EXPECT_EQ(s.message(), "checkpoint " + ck + ": tensor blocks.0.moe.w1 has shape [4,32,16], the model expects [4,64,16]");

  // Weights only: the optimizer file is not needed.
  fs::remove(ck + "/optimizer.safetensors");
  EXPECT_TRUE(load_checkpoint(ck, b.params(), nullptr, nullptr));
  EXPECT_EQ(std::memcmp(a.params()[0]->value.data(), b.params()[0]->value.data(), a.params()[0]->value.numel() * 4), 0);
  Model other(tiny_config(), 2);
  EXPECT_THROW(load_checkpoint(ck, other.params(), &ob, nullptr), std::logic_error);
  fs::remove_all(dir);
}

// ---- the optimizer against closed forms ---------------------------------------------------------

TEST(Optimizer, AdamWMatchesTheClosedForm) {
  // PyTorch AdamW: p *= 1 - lr*wd; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
  //                p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)
  Param w("w", {3}), n("n", {2}, /*wd=*/false);
  const double w0[3] = {0.5, -1.0, 2.0}, n0[2] = {1.0, -0.25};
  const double gw[2][3] = {{0.1, -0.2, 0.3}, {-0.05, 0.4, 0.0}}, gn[2][2] = {{1.0, -2.0}, {0.5, 0.5}};
  for (int i = 0; i < 3; ++i) w.value[i] = static_cast<float>(w0[i]);
  for (int i = 0; i < 2; ++i) n.value[i] = static_cast<float>(n0[i]);
  AdamWConfig cfg;
  cfg.weight_decay = 0.1f;
  AdamW opt({&w, &n}, cfg);
  const double lrs[2] = {1e-2, 5e-3};
  double pw[3], pn[2], mw[3] = {0}, vw[3] = {0}, mn[2] = {0}, vn[2] = {0};
  std::copy(w0, w0 + 3, pw);
  std::copy(n0, n0 + 2, pn);
  const double b1 = cfg.beta1, b2 = cfg.beta2, eps = cfg.eps, wd = cfg.weight_decay;
  auto ref = [&](double* p, double* m, double* v, const double* g, int k, double lr, double decay, int t) {
    for (int i = 0; i < k; ++i) {
      p[i] *= 1 - lr * decay;
      m[i] = b1 * m[i] + (1 - b1) * g[i];
      v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
      p[i] -= lr * (m[i] / (1 - std::pow(b1, t))) / (std::sqrt(v[i] / (1 - std::pow(b2, t))) + eps);
    }
  };
  for (int t = 1; t <= 2; ++t) {
    for (int i = 0; i < 3; ++i) w.grad[i] = static_cast<float>(gw[t - 1][i]);
    for (int i = 0; i < 2; ++i) n.grad[i] = static_cast<float>(gn[t - 1][i]);
    opt.step(static_cast<float>(lrs[t - 1]));
    ref(pw, mw, vw, gw[t - 1], 3, lrs[t - 1], wd, t);
    ref(pn, mn, vn, gn[t - 1], 2, lrs[t - 1], 0.0, t);
    EXPECT_EQ(opt.steps(), t);
    for (int i = 0; i < 3; ++i) {
      EXPECT_NEAR(w.value[i], pw[i], 1e-6) << "w[" << i << "] step " << t;
      EXPECT_NEAR(opt.m(0)[i], mw[i], 1e-7);
      EXPECT_NEAR(opt.v(0)[i], vw[i], 1e-8);
    }
    for (int i = 0; i < 2; ++i) EXPECT_NEAR(n.value[i], pn[i], 1e-6) << "n[" << i << "] step " << t;
  }
}

TEST(Optimizer, ClipGradNormOverSeveralParams) {
  Param a("a", {2}), b("b", {1, 1});
  a.grad[0] = 3, a.grad[1] = 4, b.grad[0] = 12;  // global norm 13
  AdamW opt({&a, &b}, AdamWConfig{});
  EXPECT_DOUBLE_EQ(opt.clip_grad_norm(0.0f), 13.0) << "max_norm 0 only measures";
  EXPECT_EQ(a.grad[0], 3.0f);
  EXPECT_DOUBLE_EQ(opt.clip_grad_norm(20.0f), 13.0) << "below the limit: unchanged";
  EXPECT_EQ(b.grad[0], 12.0f);
  EXPECT_DOUBLE_EQ(opt.clip_grad_norm(6.5f), 13.0);
  EXPECT_FLOAT_EQ(a.grad[0], 1.5f);
  EXPECT_FLOAT_EQ(a.grad[1], 2.0f);
  EXPECT_FLOAT_EQ(b.grad[0], 6.0f);
  EXPECT_NEAR(opt.clip_grad_norm(INFINITY), 6.5, 1e-6);
  b.grad[0] = NAN;
  EXPECT_TRUE(std::isnan(opt.clip_grad_norm(1.0f)));
  EXPECT_FLOAT_EQ(a.grad[0], 1.5f) << "a non-finite norm scales nothing";
}

TEST(Optimizer, ScheduleShape) {
  const int64_t total = 1000, warmup = 100;
  const float hi = 3e-3f, lo = 3e-4f;
  EXPECT_FLOAT_EQ(lr_at(0, total, warmup, hi, lo), hi / 100);
  EXPECT_FLOAT_EQ(lr_at(49, total, warmup, hi, lo), hi / 2);
  EXPECT_FLOAT_EQ(lr_at(99, total, warmup, hi, lo), hi);
  EXPECT_FLOAT_EQ(lr_at(100, total, warmup, hi, lo), hi);
  EXPECT_FLOAT_EQ(lr_at(999, total, warmup, hi, lo), lo + (hi - lo) * 0.5f * (1 + std::cos(std::numbers::pi * 899 / 900)));
  EXPECT_FLOAT_EQ(lr_at(1000, total, warmup, hi, lo), lo);
  EXPECT_FLOAT_EQ(lr_at(5000, total, warmup, hi, lo), lo) << "past the end: the floor";
  float prev = hi;
  for (int64_t s = warmup; s <= total; ++s) {
    float lr = lr_at(s, total, warmup, hi, lo);
    EXPECT_LE(lr, prev) << "step " << s;
    EXPECT_GE(lr, lo) << "step " << s;
    prev = lr;
  }
  EXPECT_FLOAT_EQ(lr_at(0, total, 0, hi, lo), hi) << "no warmup";
}

// PyTorch reads our file and writes it back (negated) with its own writer; we read that exactly.
TEST(Checkpoint, PyTorchWritesAFileWeRead) {
  if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "/usr/bin/python3 cannot import torch (scripts/setup.sh --test installs it)";
  fs::path dir = temp_dir("torch_back");
  Model a(tiny_config(), 2);
  a.init(5);
  AdamW oa(a.params(), AdamWConfig{});
  ASSERT_TRUE(save_checkpoint((dir / "ck").string(), a.params(), oa, {{"step", 0}}));
  const fs::path back = dir / "back.safetensors";
  std::string cmd = "/usr/bin/python3 " + std::string(MOE_TEST_DIR) + "/load_safetensors.py " +
                    (dir / "ck" / "model.safetensors").string() + " --write-back " + back.string() +
                    " > /dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::map<std::string, LoadedTensor> t;
  std::map<std::string, std::string> meta;
  ASSERT_TRUE(load_safetensors(back.string(), &t, &meta));
  EXPECT_EQ(meta["written_by"], "load_safetensors.py");
  EXPECT_EQ(meta["format"], "moe");
  ASSERT_EQ(t.size(), a.params().size());
  for (const Param* p : a.params()) {
    ASSERT_TRUE(t.count(p->name)) << p->name;
    EXPECT_EQ(t[p->name].shape, p->value.shape()) << p->name;
    std::vector<float> neg(p->value.numel());
    for (size_t i = 0; i < neg.size(); ++i) neg[i] = -p->value[i];
    EXPECT_EQ(std::memcmp(t[p->name].data.data(), neg.data(), neg.size() * 4), 0) << p->name;
  }
  fs::remove_all(dir);
}

}  // namespace

// A checkpoint written in parts (model/checkpoint.h, "Written by several ranks"), here by one process
// playing two ranks: replicated r [3] on part 0, sharded w [4,2] as rows [0,2) and [2,4). It loads
// whole into an unsharded model, names a missing part, and refuses parts that do not tile the rows.
TEST(Checkpoint, PartsWrittenByOwnersJoinIntoTheWholeModel) {
  fs::path dir = temp_dir("parts");
  auto make = [](const std::string& name, std::vector<int64_t> shape, int64_t first, int64_t full, float base) {
    auto p = std::make_unique<Param>(name, shape);
    for (size_t i = 0; i < p->value.numel(); ++i) p->value[i] = base + static_cast<float>(i);
    p->shard_begin = first;
    p->full_dim0 = full;
    return p;
  };
  auto r = make("r", {3}, 0, 0, 100);
  auto w0 = make("w", {2, 2}, 0, 4, 0);  // rows 0, 1: values 0..3
  auto w1 = make("w", {2, 2}, 2, 4, 4);  // rows 2, 3: values 4..7
  AdamW rank0({r.get(), w0.get()}, AdamWConfig{}), rank1({w1.get()}, AdamWConfig{});
  for (AdamW* o : {&rank0, &rank1}) {
    o->set_steps(7);
    for (size_t i = 0; i < o->params().size(); ++i) {
      for (size_t j = 0; j < o->m(i).numel(); ++j) {
        o->m(i)[j] = static_cast<float>(i) + 0.5f;
        o->v(i)[j] = static_cast<float>(i) + 0.25f;
      }
    }
  }
  const std::string ck = (dir / "ck").string(), staging = checkpoint_staging_dir(ck, 42);
  auto write = [&](bool with_part1) {
    ASSERT_TRUE(begin_checkpoint(ck, staging));
    ASSERT_TRUE(write_checkpoint_part(staging, 0, 2, rank0, true, {{"step", 7}}));
    if (with_part1) {
      ASSERT_TRUE(write_checkpoint_part(staging, 1, 2, rank1, false, {{"step", 7}}));
    }
  };
  write(false);
  Status missing = finish_checkpoint(ck, staging, 2, rank0, {{"step", 7}});
  EXPECT_FALSE(missing);
  EXPECT_NE(missing.message().find("part 1 is missing"), std::string::npos) << missing.message();
  EXPECT_FALSE(fs::exists(ck)) << "a checkpoint without all its parts must not appear";
  abandon_checkpoint(staging);
  EXPECT_FALSE(fs::exists(staging));

  write(true);
  ASSERT_TRUE(finish_checkpoint(ck, staging, 2, rank0, {{"step", 7}}));
  EXPECT_TRUE(fs::exists(dir / "ck" / "model-1-of-2.safetensors"));
  std::map<std::string, LoadedTensor> whole;
  ASSERT_TRUE(read_checkpoint_weights(ck, &whole));
  ASSERT_EQ(whole.at("w").shape, (std::vector<int64_t>{4, 2}));
  for (int i = 0; i < 8; ++i) EXPECT_EQ(whole.at("w").data[i], static_cast<float>(i));
  EXPECT_EQ(whole.at("r").data[2], 102.0f);

  // Loads into one process's unsharded parameters: weights, moments (both parts' rows) and step.
  Param r_full("r", {3}), w_full("w", {4, 2});
  AdamW full({&r_full, &w_full}, AdamWConfig{});
  nlohmann::json state;
  ASSERT_TRUE(load_checkpoint(ck, {&r_full, &w_full}, &full, &state));
  EXPECT_EQ(state.at("step"), 7);
  EXPECT_EQ(full.steps(), 7);
  EXPECT_EQ(w_full.value[7], 7.0f);
  EXPECT_EQ(full.m(1)[0], 1.5f);  // rank 0's moment of w (its param 1)
  EXPECT_EQ(full.m(1)[7], 0.5f);  // rank 1's moment of w (its param 0)

  // Rows that do not tile [0, 4): part 1 claiming rows [1, 3) is rejected, naming the tensor.
  w1->shard_begin = 1;
  write(true);
  ASSERT_TRUE(finish_checkpoint(ck, staging, 2, rank0, {{"step", 8}}));
  Status bad = read_checkpoint_weights(ck, &whole);
  EXPECT_FALSE(bad);
  EXPECT_NE(bad.message().find("tensor w do not cover its 4 rows exactly once"), std::string::npos) << bad.message();
  fs::remove_all(dir);
}

// After re-sharding, a rank owns arbitrary experts: part 0 holds rows {3, 0} of w [4,2] in that order
// (listed in its "rows" metadata), part 1 rows {1, 2}; part 0 also has none of a second sharded tensor
// u (an empty shard writes no piece). They join into the whole tensors; listing a row twice is an error.
TEST(Checkpoint, PartsWithListedRowsJoinByRowIndex) {
  fs::path dir = temp_dir("listed");
  auto make = [](const std::string& name, std::vector<int64_t> shape, std::vector<int64_t> rows, int64_t full,
                 std::vector<float> values) {
    auto p = std::make_unique<Param>(name, shape);
    for (size_t i = 0; i < values.size(); ++i) p->value[i] = values[i];
    p->shard_rows = std::move(rows);
    p->full_dim0 = full;
    return p;
  };
  auto w0 = make("w", {2, 2}, {3, 0}, 4, {6, 7, 0, 1});  // row 3 = {6, 7}, row 0 = {0, 1}
  auto w1 = make("w", {2, 2}, {1, 2}, 4, {2, 3, 4, 5});
  auto u0 = make("u", {0, 2}, {}, 2, {});
  auto u1 = make("u", {2, 2}, {0, 1}, 2, {10, 11, 12, 13});
  AdamW rank0({w0.get(), u0.get()}, AdamWConfig{}), rank1({w1.get(), u1.get()}, AdamWConfig{});
  for (size_t j = 0; j < 4; ++j) rank0.m(0)[j] = 100.0f + static_cast<float>(j);
  const std::string ck = (dir / "ck").string(), staging = checkpoint_staging_dir(ck, 43);
  auto write = [&] {
    ASSERT_TRUE(begin_checkpoint(ck, staging));
    ASSERT_TRUE(write_checkpoint_part(staging, 0, 2, rank0, true, {{"step", 1}}));
    ASSERT_TRUE(write_checkpoint_part(staging, 1, 2, rank1, false, {{"step", 1}}));
    ASSERT_TRUE(finish_checkpoint(ck, staging, 2, rank0, {{"step", 1}}));
  };
  write();
  std::map<std::string, LoadedTensor> whole;
  ASSERT_TRUE(read_checkpoint_weights(ck, &whole));
  ASSERT_EQ(whole.at("w").shape, (std::vector<int64_t>{4, 2}));
  for (int i = 0; i < 8; ++i) EXPECT_EQ(whole.at("w").data[i], static_cast<float>(i)) << i;
  ASSERT_EQ(whole.at("u").shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(whole.at("u").data[3], 13.0f);
  // Moments follow their rows: part 0's first moment of w was {100, 101} for row 3, {102, 103} for row 0.
  Param w_full("w", {4, 2}), u_full("u", {2, 2});
  AdamW full({&w_full, &u_full}, AdamWConfig{});
  nlohmann::json state;
  ASSERT_TRUE(load_checkpoint(ck, {&w_full, &u_full}, &full, &state));
  EXPECT_EQ(full.m(0)[6], 100.0f);
  EXPECT_EQ(full.m(0)[0], 102.0f);

  w1->shard_rows = {1, 3};  // row 3 twice, row 2 never
  write();
  Status bad = read_checkpoint_weights(ck, &whole);
  EXPECT_FALSE(bad);
  EXPECT_NE(bad.message().find("tensor w do not cover its 4 rows exactly once (row 3)"), std::string::npos)
      << bad.message();
  fs::remove_all(dir);
}
