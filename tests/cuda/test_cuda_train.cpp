// `moe train --device cuda` against the CPU: cuda::GpuModel + cuda::GpuAdamW and moe::Model + moe::AdamW
// from the same initial weights on the same batches, for every block type (GELU / SwiGLU experts,
// LayerNorm / RMSNorm, dense blocks, capacity dropping, router bias, top-1); a checkpoint written from
// the GPU resuming on the CPU and on the GPU; and the command line's --device checks.
//
// Tolerances (cuda/ops.h's f32 policy, |gpu - cpu| <= 1e-4 * max(1, |cpu|), where it applies):
//  - losses (cross-entropy, aux, z), gradient norms, the final weights: 1e-4 * max(1, |cpu|). The
//    test's AdamW uses eps = 1e-6 instead of 1e-8: Adam's first step moves a weight by lr * g / (|g| +
//    eps), which for |g| below eps-scale rounding noise flips with g's sign (a 2 lr jump from a 1e-9
//    difference); with eps = 1e-6 the update is smooth (at most lr * dg / eps, about 1e-5 here), so the
//    weights compare at f32 tolerance and a wrong update (lr = 1e-3 per step) still shows 10x over it.
//  - the first step's gradients: 1e-4 of the tensor's largest |g| (reduction-order noise scales with
//    the terms summed, not with an element that happens to cancel to ~0).
//  - the expert loads (tokens per expert, dropped): exactly equal (same layout code on the host).
//  - GPU -> checkpoint -> GPU: bit-identical losses (the kernels are deterministic, cuda/ops.h).
// Without a GPU every test that needs one skips, saying why; the command-line checks run anyway.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cuda/device.h"
#include "cuda/gpu_model.h"
#include "cuda/gpu_optimizer.h"
#include "model/checkpoint.h"
#include "model/model.h"
#include "model/optimizer.h"
#include "util/shell.h"

namespace moe::cuda {
namespace {

namespace fs = std::filesystem;

struct Variant {
  std::string name;
  ModelConfig cfg;
};

ModelConfig small() {
  ModelConfig c;
  c.seq_len = 16;
  c.d_model = 32;
  c.n_layers = 2;
  c.n_heads = 2;
  c.d_ffn = 64;
  c.n_experts = 4;
  c.top_k = 2;
  return c;
}

std::vector<Variant> variants() {
  std::vector<Variant> v;
  v.push_back({"GeluLayerNormDropless", small()});
  ModelConfig s = small();
  s.n_layers = 3;
  s.activation = "swiglu";
  s.norm = "rmsnorm";
  s.dense_every_other = true;  // blocks 0, 2 MoE; block 1 a dense SwiGLU FFN
  s.capacity_factor = 1.0;     // drops assignments
  s.router_skew = 1.0;         // router bias
  s.z_loss_weight = 0.01;
  v.push_back({"SwigluRmsNormDenseCapacitySkew", s});
  ModelConfig t = small();
  t.top_k = 1;  // Switch: gate weight = probability (no renormalization)
  t.capacity_factor = 1.25;
  t.aux_loss_weight = 0.1;
  v.push_back({"Top1Capacity", t});
  return v;
}

AdamWConfig test_adamw() {
  AdamWConfig a;
  a.lr = 1e-3f;
  a.eps = 1e-6f;  // see the top of the file
  return a;
}

constexpr int64_t kBatch = 2;

// Tokens and targets of step `step`: bytes from a fixed generator, the same for both devices.
void batch(int64_t step, const ModelConfig& cfg, std::vector<int32_t>* tokens, std::vector<int32_t>* targets) {
  std::mt19937 rng(static_cast<uint32_t>(1000 + step));
  std::uniform_int_distribution<int32_t> byte(0, static_cast<int32_t>(cfg.vocab_size) - 1);
  tokens->resize(static_cast<size_t>(kBatch * cfg.seq_len));
  targets->resize(tokens->size());
  for (size_t i = 0; i < tokens->size(); ++i) (*tokens)[i] = byte(rng), (*targets)[i] = byte(rng);
}

double rel(double gpu, double cpu) { return std::fabs(gpu - cpu) / std::max(1.0, std::fabs(cpu)); }

// Max |gpu - cpu| / max(1, |cpu|) over every parameter (or, with per_tensor_scale, over each tensor
// |gpu - cpu| / max |cpu| of that tensor); prints the worst tensor.
void expect_params_close(const char* what, const moe::Model& gpu, const moe::Model& cpu, bool grads, double tol,
                         bool per_tensor_scale) {
  const std::vector<Param*> g = gpu.params(), c = cpu.params();
  ASSERT_EQ(g.size(), c.size());
  double worst = 0;
  std::string worst_name;
  for (size_t i = 0; i < g.size(); ++i) {
    const Tensor& a = grads ? g[i]->grad : g[i]->value;
    const Tensor& b = grads ? c[i]->grad : c[i]->value;
    ASSERT_EQ(a.numel(), b.numel()) << c[i]->name;
    double scale = 0;
    if (per_tensor_scale)
      for (size_t j = 0; j < b.numel(); ++j) scale = std::max(scale, std::fabs(double(b[j])));
    size_t bad = 0;
    for (size_t j = 0; j < a.numel(); ++j) {
      if (!std::isfinite(a[j])) {
        ++bad;
        continue;
      }
      const double d = std::fabs(double(a[j]) - b[j]) /
                       (per_tensor_scale ? std::max(scale, 1e-30) : std::max(1.0, std::fabs(double(b[j]))));
      if (d > worst) worst = d, worst_name = c[i]->name;
      if (d > tol) ++bad;
    }
    EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << a.numel() << " values of " << c[i]->name
                       << " differ by more than " << tol;
  }
  std::printf("  %-8s max diff %.3e (%s)\n", what, worst, worst_name.c_str());
}

class CudaTrain : public ::testing::TestWithParam<Variant> {
 protected:
  void SetUp() override {
    if (device_count() == 0) GTEST_SKIP() << device_summary();
    ASSERT_TRUE(Context::create(0, &ctx_).is_ok());
    dir_ = fs::temp_directory_path() / ("moe_cuda_train_" + std::to_string(::getpid()) + "_" + GetParam().name);
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }

  // One training step of the CPU pair; returns the loss.
  double cpu_step(moe::Model& m, AdamW& opt, int64_t step, double* norm = nullptr) {
    std::vector<int32_t> tokens, targets;
    batch(step, m.config(), &tokens, &targets);
    m.zero_grad();
    const double loss = m.forward(tokens.data(), targets.data(), kBatch);
    m.backward();
    const double n = opt.clip_grad_norm(1.0f);
    if (norm) *norm = n;
    opt.step(opt.config().lr);
    return loss;
  }
  // The same on the GPU pair.
  double gpu_step(GpuModel& m, GpuAdamW& opt, int64_t step, double* norm = nullptr) {
    std::vector<int32_t> tokens, targets;
    batch(step, m.config(), &tokens, &targets);
    double loss = NAN, n = NAN;
    EXPECT_TRUE(m.zero_grad().is_ok());
    const Status f = m.forward(tokens.data(), targets.data(), kBatch, &loss);
    EXPECT_TRUE(f.is_ok()) << f.message();
    const Status b = m.backward();
    EXPECT_TRUE(b.is_ok()) << b.message();
    EXPECT_TRUE(opt.clip_grad_norm(1.0f, &n).is_ok());
    EXPECT_TRUE(opt.step(opt.config().lr).is_ok());
    EXPECT_TRUE(ctx_->synchronize().is_ok());
    if (norm) *norm = n;
    return loss;
  }

  std::unique_ptr<Context> ctx_;
  fs::path dir_;
};

TEST_P(CudaTrain, ThreeStepsMatchTheCpuModelAndOptimizer) {
  const ModelConfig cfg = GetParam().cfg;
  moe::Model cpu(cfg, kBatch);
  cpu.init(7);
  AdamW cpu_opt(cpu.params(), test_adamw());
  std::unique_ptr<GpuModel> gpu;
  ASSERT_TRUE(GpuModel::create(*ctx_, cfg, kBatch, &gpu).is_ok());
  ASSERT_TRUE(gpu->load_weights(cpu).is_ok());
  EXPECT_EQ(gpu->num_params(), cpu.num_params());
  std::unique_ptr<GpuAdamW> gpu_opt;
  ASSERT_TRUE(GpuAdamW::create(*ctx_, *gpu, test_adamw(), &gpu_opt).is_ok());

  moe::Model check(cfg, kBatch);  // receives the GPU's gradients and weights
  int64_t dropped = 0;
  for (int64_t step = 0; step < 3; ++step) {
    std::vector<int32_t> tokens, targets;
    batch(step, cfg, &tokens, &targets);
    // Forward and backward on both, then compare before the optimizers run.
    cpu.zero_grad();
    const double cl = cpu.forward(tokens.data(), targets.data(), kBatch);
    cpu.backward();
    double gl = NAN;
    ASSERT_TRUE(gpu->zero_grad().is_ok());
    ASSERT_TRUE(gpu->forward(tokens.data(), targets.data(), kBatch, &gl).is_ok());
    ASSERT_TRUE(gpu->backward().is_ok());
    std::printf("  step %lld: loss cpu %.6f gpu %.6f  aux %.6f / %.6f  z %.6f / %.6f\n", (long long)step + 1, cl, gl,
                cpu.aux_loss(), gpu->aux_loss(), cpu.z_loss(), gpu->z_loss());
    EXPECT_LE(rel(gl, cl), 1e-4) << "step " << step + 1;
    EXPECT_LE(rel(gpu->aux_loss(), cpu.aux_loss()), 1e-4);
    EXPECT_LE(rel(gpu->z_loss(), cpu.z_loss()), 1e-4);
    EXPECT_LE(rel(gpu->moe_loss(), cpu.moe_loss()), 1e-4);
    const std::vector<LayerLoad> gload = gpu->load_stats(), cload = cpu.load_stats();
    ASSERT_EQ(gload.size(), cload.size());
    for (size_t i = 0; i < gload.size(); ++i) {
      EXPECT_EQ(gload[i].layer, cload[i].layer);
      EXPECT_EQ(gload[i].tokens_per_expert, cload[i].tokens_per_expert) << "MoE layer " << cload[i].layer;
      EXPECT_EQ(gload[i].dropped, cload[i].dropped) << "MoE layer " << cload[i].layer;
      dropped += cload[i].dropped;
    }
    if (step == 0) {
      ASSERT_TRUE(gpu->store_gradients(&check).is_ok());
      expect_params_close("grads", check, cpu, true, 1e-4, true);
    }
    double cn = cpu_opt.clip_grad_norm(1.0f), gn = NAN;
    ASSERT_TRUE(gpu_opt->clip_grad_norm(1.0f, &gn).is_ok());
    EXPECT_LE(rel(gn, cn), 1e-4) << "gradient norm, step " << step + 1;
    cpu_opt.step(test_adamw().lr);
    ASSERT_TRUE(gpu_opt->step(test_adamw().lr).is_ok());
  }
  if (cfg.capacity_factor > 0) {
    EXPECT_GT(dropped, 0) << "the capacity variant should drop assignments";
  }
  std::printf("  dropped assignments over 3 steps: %lld\n", (long long)dropped);
  ASSERT_TRUE(ctx_->synchronize().is_ok());
  ASSERT_TRUE(gpu->store_weights(&check).is_ok());
  expect_params_close("weights", check, cpu, false, 1e-4, false);
  // The moments came through the same steps: compare them like gradients (per-tensor scale).
  AdamW moments(check.params(), test_adamw());
  ASSERT_TRUE(gpu_opt->store_state(&moments).is_ok());
  EXPECT_EQ(moments.steps(), 3);
  double worst = 0;
  for (size_t i = 0; i < cpu.params().size(); ++i)
    for (const auto& [a, b] : {std::pair{&moments.m(i), &cpu_opt.m(i)}, {&moments.v(i), &cpu_opt.v(i)}}) {
      double scale = 1e-30, d = 0;
      for (size_t j = 0; j < b->numel(); ++j) scale = std::max(scale, std::fabs(double((*b)[j])));
      for (size_t j = 0; j < b->numel(); ++j) d = std::max(d, std::fabs(double((*a)[j]) - (*b)[j]) / scale);
      EXPECT_LE(d, 1e-4) << cpu.params()[i]->name;
      worst = std::max(worst, d);
    }
  std::printf("  moments  max diff %.3e (of each tensor's largest)\n", worst);
}

TEST_P(CudaTrain, CheckpointFromTheGpuResumesOnTheCpuAndOnTheGpu) {
  const ModelConfig cfg = GetParam().cfg;
  moe::Model host(cfg, kBatch);
  host.init(11);
  AdamW host_opt(host.params(), test_adamw());
  std::unique_ptr<GpuModel> gpu;
  ASSERT_TRUE(GpuModel::create(*ctx_, cfg, kBatch, &gpu).is_ok());
  ASSERT_TRUE(gpu->load_weights(host).is_ok());
  std::unique_ptr<GpuAdamW> gpu_opt;
  ASSERT_TRUE(GpuAdamW::create(*ctx_, *gpu, test_adamw(), &gpu_opt).is_ok());
  for (int64_t step = 0; step < 2; ++step) gpu_step(*gpu, *gpu_opt, step);
  // GPU -> host -> the CPU checkpoint writer.
  ASSERT_TRUE(gpu->store_weights(&host).is_ok());
  ASSERT_TRUE(gpu_opt->store_state(&host_opt).is_ok());
  const std::string ck = (dir_ / "ck").string();
  ASSERT_TRUE(save_checkpoint(ck, host.params(), host_opt, {{"step", 2}}).is_ok());
  // The run that never stopped: steps 3 and 4 on the GPU.
  const double g3 = gpu_step(*gpu, *gpu_opt, 2), g4 = gpu_step(*gpu, *gpu_opt, 3);

  // Resumed on the CPU (from other initial weights: the checkpoint must overwrite them all).
  moe::Model cpu(cfg, kBatch);
  cpu.init(99);
  AdamW cpu_opt(cpu.params(), test_adamw());
  nlohmann::json state;
  ASSERT_TRUE(load_checkpoint(ck, cpu.params(), &cpu_opt, &state).is_ok());
  EXPECT_EQ(cpu_opt.steps(), 2);
  const double c3 = cpu_step(cpu, cpu_opt, 2), c4 = cpu_step(cpu, cpu_opt, 3);
  std::printf("  steps 3, 4: gpu %.6f %.6f  resumed on cpu %.6f %.6f\n", g3, g4, c3, c4);
  EXPECT_LE(rel(c3, g3), 1e-4);
  EXPECT_LE(rel(c4, g4), 1e-4) << "step 4 depends on the moments and the step count of the checkpoint";

  // Resumed on a fresh GPU model (the CPU checkpoint reader, then host -> device): the same bits.
  moe::Model host2(cfg, kBatch);
  AdamW host2_opt(host2.params(), test_adamw());
  ASSERT_TRUE(load_checkpoint(ck, host2.params(), &host2_opt, &state).is_ok());
  std::unique_ptr<GpuModel> gpu2;
  ASSERT_TRUE(GpuModel::create(*ctx_, cfg, kBatch, &gpu2).is_ok());
  ASSERT_TRUE(gpu2->load_weights(host2).is_ok());
  std::unique_ptr<GpuAdamW> gpu2_opt;
  ASSERT_TRUE(GpuAdamW::create(*ctx_, *gpu2, test_adamw(), &gpu2_opt).is_ok());
  ASSERT_TRUE(gpu2_opt->load_state(host2_opt).is_ok());
  EXPECT_EQ(gpu2_opt->steps(), 2);
  const double r3 = gpu_step(*gpu2, *gpu2_opt, 2), r4 = gpu_step(*gpu2, *gpu2_opt, 3);
  EXPECT_EQ(r3, g3) << "GPU resume is not bit-exact";
  EXPECT_EQ(r4, g4) << "GPU resume is not bit-exact";
}

TEST_P(CudaTrain, LoadRejectsAHostModelOfAnotherConfig) {
  ModelConfig other = GetParam().cfg;
  other.n_experts *= 2;
  moe::Model host(other, kBatch);
  std::unique_ptr<GpuModel> gpu;
  ASSERT_TRUE(GpuModel::create(*ctx_, GetParam().cfg, kBatch, &gpu).is_ok());
  const Status s = gpu->load_weights(host);
  EXPECT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("moe.router.weight"), std::string::npos) << s.message();
}

INSTANTIATE_TEST_SUITE_P(Blocks, CudaTrain, ::testing::ValuesIn(variants()),
                         [](const ::testing::TestParamInfo<Variant>& i) { return i.param.name; });

// ---- the command line (runs with or without a GPU) -----------------------------------------------

std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

class CudaTrainCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("moe_cuda_cli_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    const std::string text = read_file(fs::path(MOE_TEST_DIR) / ".." / "docs" / "model.md");
    std::ofstream(dir_ / "corpus.txt", std::ios::binary) << text << text;
  }
  void TearDown() override { fs::remove_all(dir_); }

  ShellResult run(const std::string& args) { return run_shell(std::string(MOE_BIN) + " train " + tiny() + args); }
  std::string tiny() const {
    return "--data " + (dir_ / "corpus.txt").string() +
           " --seq-len 16 --d-model 16 --layers 2 --heads 2 --d-ffn 32 --experts 4 --top-k 2 --batch-size 4 "
           "--log-every 1 --eval-batches 2 --threads 1 ";
  }
  // Losses of the step lines of a metrics file, by step.
  std::vector<double> losses(const fs::path& metrics) {
    std::vector<double> out;
    std::ifstream in(metrics);
    std::string line;
    while (std::getline(in, line)) {
      const nlohmann::json j = nlohmann::json::parse(line);
      if (j.contains("loss")) {
        out.resize(std::max<size_t>(out.size(), j["step"].get<size_t>()));
        out[j["step"].get<size_t>() - 1] = j["loss"].get<double>();
      }
    }
    return out;
  }

  fs::path dir_;
};

TEST_F(CudaTrainCli, RejectsStrategiesAndRanksOtherThanOne) {
  ShellResult r = run("--steps 2 --device cuda --strategy hecate");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("strategy must be ep"), std::string::npos) << r.output;
  r = run("--steps 2 --device cuda --ranks 2");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("one rank"), std::string::npos) << r.output;
  r = run("--steps 2 --device tpu");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("not one of cpu, cuda"), std::string::npos) << r.output;
}

TEST_F(CudaTrainCli, SaysSoWithoutAGpu) {
  if (device_count() > 0) GTEST_SKIP() << "a GPU is present: " << device_summary();
  const fs::path metrics = dir_ / "m.jsonl";
  const ShellResult r = run("--steps 2 --device cuda --metrics " + metrics.string());
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("no CUDA device"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("step "), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(metrics));
}

// A run that starts on the GPU, stops with a checkpoint and resumes on the CPU follows the run that
// stays on the GPU (to f32 tolerance: the devices sum in different orders).
TEST_F(CudaTrainCli, MovesFromTheGpuToTheCpuThroughACheckpoint) {
  if (device_count() == 0) GTEST_SKIP() << device_summary();
  const std::string ck = (dir_ / "ck").string();
  ShellResult full = run("--steps 4 --device cuda --metrics " + (dir_ / "full.jsonl").string());
  ASSERT_EQ(full.exit_code, 0) << full.output;
  EXPECT_NE(full.output.find("device: cuda"), std::string::npos) << full.output;
  EXPECT_NE(full.output.find("validation loss"), std::string::npos) << full.output;
  ShellResult part = run("--steps 4 --stop-at-step 2 --device cuda --checkpoint-dir " + ck + " --metrics " +
                         (dir_ / "moved.jsonl").string());
  ASSERT_EQ(part.exit_code, 0) << part.output;
  ShellResult rest = run("--steps 4 --device cpu --resume " + ck + " --metrics " + (dir_ / "moved.jsonl").string());
  ASSERT_EQ(rest.exit_code, 0) << rest.output;
  const std::vector<double> a = losses(dir_ / "full.jsonl"), b = losses(dir_ / "moved.jsonl");
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    std::printf("  step %zu: gpu %.6f  gpu, then cpu from step 3: %.6f\n", i + 1, a[i], b[i]);
    EXPECT_LE(rel(b[i], a[i]), 1e-4) << "step " << i + 1;
  }
}

}  // namespace
}  // namespace moe::cuda
