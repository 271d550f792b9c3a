// A strategy defined here, through strategy/strategy.h's public interface only, registered with
// strategy::add, and run by both the trainer and the simulator: what docs/strategies.md promises a
// new strategy needs (one class, one registration line, its tests).
//
// The toy strategy "mirror-hot" keeps EP's owners and, before every step, gathers the predicted
// hottest expert of each layer onto every rank (its tokens then stay on their own rank). It moves
// weights and tokens differently from ep and must train the same model (invariant 1).
//
// The trainer runs it in a child: this test binary under mpirun -n 2 with MOE_TOY_CHILD set, each rank
// registering the strategy and calling run_training in-process; the parent compares its losses with
// `moe train --strategy ep` on the same flags.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "progress_losses.h"
#include "plan/load_predictor.h"
#include "runtime/trainer.h"
#include "sim/cluster.h"
#include "sim/simulate.h"
#include "strategy/strategy.h"
#include "util/shell.h"

namespace {

namespace fs = std::filesystem;
namespace strategy = moe::strategy;

class MirrorHot : public strategy::Strategy {
 public:
  explicit MirrorHot(const strategy::Setup& s)
      : predictor_(strategy::moe_layer_count(s.model), static_cast<int>(s.model.n_experts), 3) {}
  const char* name() const override { return "mirror-hot"; }
  void configure(moe::graph::EpStepOptions* opt) const override { opt->gather_before_gate = true; }
  std::optional<moe::plan::LayerPlacement> before_step(int layer, const moe::plan::LayerPlacement& owners) override {
    moe::plan::LayerPlacement p = owners;
    if (predictor_.steps_observed() == 0) return p;  // nothing seen yet
    const std::vector<double> load = predictor_.predict(layer);
    const int hot = static_cast<int>(std::max_element(load.begin(), load.end()) - load.begin());
    p.replicas[hot].clear();
    for (int r = 0; r < owners.n_ranks; ++r) p.replicas[hot].push_back(r);
    return p;
  }
  void observe(const std::vector<std::vector<int64_t>>& loads, const strategy::StepTimes& times) override {
    (void)times;
    if (!loads.empty()) predictor_.observe(loads);
  }
  int replica_slots() const override { return 1; }

 private:
  moe::plan::LoadPredictor predictor_;
};

void register_mirror_hot() {
  if (strategy::find("mirror-hot")) return;
  moe::Status s = strategy::add({"mirror-hot", "test: the predicted hottest expert of each layer on every rank",
                                 [](const strategy::Setup& setup) -> std::unique_ptr<strategy::Strategy> {
                                   return std::make_unique<MirrorHot>(setup);
                                 }});
  ASSERT_TRUE(s) << s.message();
}

const char* const kFlags[] = {"--seq-len", "16", "--d-model", "16", "--layers", "2", "--heads", "2", "--d-ffn", "32",
                              "--experts", "4", "--batch-size", "8", "--steps", "6", "--log-every", "1",
                              "--eval-batches", "2", "--threads", "1", "--lr", "1e-2", "--router-skew", "1.5"};

// The child: one rank of `mpirun -n 2 <this binary>`, training with the toy strategy in-process.
TEST(ToyStrategyChild, TrainsOnOneRank) {
  const char* metrics = std::getenv("MOE_TOY_CHILD");
  if (!metrics) GTEST_SKIP() << "runs under the parent test (MOE_TOY_CHILD)";
  register_mirror_hot();
  moe::TrainConfig cfg;
  cfg.data = std::string(MOE_TEST_DIR) + "/../docs/model.md";
  cfg.model.seq_len = 16, cfg.model.d_model = 16, cfg.model.n_layers = 2, cfg.model.n_heads = 2;
  cfg.model.d_ffn = 32, cfg.model.n_experts = 4, cfg.model.router_skew = 1.5;
  cfg.batch_size = 8, cfg.steps = 6, cfg.log_every = 1, cfg.eval_batches = 2, cfg.threads = 1, cfg.lr = 1e-2;
  cfg.strategy = "mirror-hot";
  cfg.metrics = metrics;
  ASSERT_TRUE(cfg.validate()) << cfg.validate().message();
  moe::Status s = moe::run_training(cfg);
  ASSERT_TRUE(s) << s.message();
}

TEST(ToyStrategy, TheTrainerRunsItAndItTrainsEpsModel) {
  const fs::path dir = fs::temp_directory_path() / ("moe_toy_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string env = "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
                          "OMPI_MCA_rmaps_base_oversubscribe=1 ";
  const std::string mpirun = std::string(MOE_MPIEXEC) + " -n 2 ";
  std::string flags = "--data " + std::string(MOE_TEST_DIR) + "/../docs/model.md";
  for (const char* f : kFlags) flags += std::string(" ") + f;
  const moe::ShellResult ep = moe::run_shell(env + "timeout -k 5 240 " + mpirun + MOE_BIN + " train " + flags);
  ASSERT_EQ(ep.exit_code, 0) << ep.output;
  const fs::path metrics = dir / "toy.jsonl";
  const moe::ShellResult toy =
      moe::run_shell(env + "MOE_TOY_CHILD=" + metrics.string() + " timeout -k 5 240 " + mpirun + moe::self_exe("") +
                     " --gtest_filter=ToyStrategyChild.TrainsOnOneRank");
  ASSERT_EQ(toy.exit_code, 0) << toy.output;
  EXPECT_NE(toy.output.find("strategy: mirror-hot"), std::string::npos) << toy.output;
  const std::vector<double> a = progress_losses(ep.output), b = progress_losses(toy.output);
  ASSERT_EQ(a.size(), 6u) << ep.output;
  ASSERT_EQ(b.size(), a.size()) << toy.output;
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(a[i], b[i], 2e-4) << "step " << i + 1;
    worst = std::max(worst, std::fabs(a[i] - b[i]));
  }
  std::printf("  mirror-hot vs ep: %zu steps, max |loss diff| %.2e (final %.4f vs %.4f)\n", a.size(), worst, b.back(),
              a.back());
  // It really moved weights: after the first step the hot expert is on every rank.
  int64_t replicas = 0, sparse = 0;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (!j.contains("replicas")) continue;
    replicas += j["replicas"].get<int64_t>();
    sparse += j["sparse_bytes"].get<int64_t>();
  }
  EXPECT_GT(replicas, 0);
  EXPECT_GT(sparse, 0);
  fs::remove_all(dir);
}

TEST(ToyStrategy, TheSimulatorRunsIt) {
  register_mirror_hot();
  moe::sim::SimRunConfig cfg;
  ASSERT_TRUE(moe::sim::preset_cluster("p4d.24xlarge", 1, &cfg.cluster));
  cfg.model.n_experts = 8;
  cfg.strategy = "mirror-hot";
  ASSERT_TRUE(moe::sim::LoadSpec::parse("zipf:1.2", &cfg.load));
  cfg.steps = 3;
  cfg.ranks = 8;
  cfg.ep_size = 8;
  cfg.batch = 16;
  moe::sim::SimRunResult res;
  moe::Status s = moe::sim::simulate(cfg, &res);
  ASSERT_TRUE(s) << s.message();
  ASSERT_EQ(res.steps.size(), 3u);
  EXPECT_EQ(res.steps[0].placement.replicas, 0) << "nothing predicted before the first step";
  // From the second step: one expert per MoE layer on all 8 ranks (7 extra replicas each).
  EXPECT_EQ(res.steps[1].placement.replicas, 7 * static_cast<int64_t>(res.steps[1].tokens_per_expert.size()));
  EXPECT_GT(res.steps[1].sparse_bytes, 0);
}

}  // namespace
