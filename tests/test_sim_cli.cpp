// `moe sim` end to end (src/cli/sim_command.cpp): the report, metrics and trace files, bad input, and
// --calibrate on a real 2-rank run whose cluster file `moe sim --cluster FILE` then loads.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "sim/calibrate.h"
#include "sim/cluster.h"
#include "util/shell.h"
#include "util/str_cat.h"

namespace {

namespace fs = std::filesystem;
using moe::run_shell;
using moe::ShellResult;

ShellResult run(const std::string& cmd) {
  return run_shell(std::string(moe::kMpirunEnv) + "timeout -k 5 120 " + cmd);
}

class SimCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("moe_sim_cli_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(SimCli, ReportsMetricsAndTrace) {
  const fs::path metrics = dir_ / "m.jsonl", trace = dir_ / "t.json";
  const ShellResult r = run(std::string(MOE_BIN) + " sim --cluster p4d.24xlarge --nodes 2 --load zipf-drift:1.2,1 --steps 4 " +
                       "--metrics " + metrics.string() + " --trace " + trace.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* line : {"cluster   p4d.24xlarge: 2 node(s) x 8 A100-SXM4-40GB", "strategy  ep: 16 ranks, ep groups of 8",
                           "step time (ms)", "critical path", "all-to-all", "most utilised links", "nic"})
    EXPECT_NE(r.output.find(line), std::string::npos) << line << "\n" << r.output;
  std::ifstream in(metrics);
  int lines = 0;
  for (std::string line; std::getline(in, line); ++lines) {
    const nlohmann::json j = nlohmann::json::parse(line);
    EXPECT_GT(j.at("step_ms").get<double>(), 0);
    // compute + exposed communication is the mean rank's wall: positive and at most the step (the
    // slowest rank's).
    const double wall = j.at("compute_ms").get<double>() + j.at("exposed_comm_ms").get<double>();
    EXPECT_GT(wall, 0);
    EXPECT_LE(wall, j.at("step_ms").get<double>() * (1 + 1e-9));
    EXPECT_EQ(j.at("tokens_per_expert").size(), 4u);  // MoE layers of the default model
  }
  EXPECT_EQ(lines, 4);
  std::ifstream t(trace);
  const nlohmann::json tj = nlohmann::json::parse(t);
  // Every rank runs one graph per step: 16 ranks x 4 steps, each with the same ops.
  std::map<std::pair<int, int>, int> ops_of;  // (rank, step) -> events
  for (const auto& e : tj.at("traceEvents"))
    if (e.at("ph") == "X") ++ops_of[{e.at("pid").get<int>(), e.at("args").at("step").get<int>()}];
  ASSERT_EQ(ops_of.size(), 16u * 4u);
  for (const auto& [key, n] : ops_of) {
    EXPECT_EQ(n, ops_of.begin()->second) << "rank " << key.first << " step " << key.second;
    EXPECT_EQ(key.second >= 1 && key.second <= 4, true) << key.second;
  }
  EXPECT_GT(ops_of.begin()->second, 4 * 10) << "4 blocks of attention, gate, exchanges, experts, combine";
}

// A cluster file keeps its own node count unless --nodes says another; a preset has 1 unless told.
TEST_F(SimCli, AClusterFileKeepsItsNodesUnlessTold) {
  moe::sim::ClusterSpec two;
  ASSERT_TRUE(moe::sim::preset_cluster("p4d.24xlarge", 2, &two));
  const fs::path file = dir_ / "two.json";
  ASSERT_TRUE(moe::sim::write_cluster_file(file.string(), two));
  for (const auto& [flags, says] : std::vector<std::pair<std::string, std::string>>{
           {"--cluster " + file.string(), ": 2 node(s) x 8"},
           {"--cluster " + file.string() + " --nodes 3", ": 3 node(s) x 8"},
           {"--cluster p4d.24xlarge", ": 1 node(s) x 8"},
           {"--cluster p4d.24xlarge --nodes 2", ": 2 node(s) x 8"}}) {
    const ShellResult r = run(std::string(MOE_BIN) + " sim " + flags + " --steps 1");
    ASSERT_EQ(r.exit_code, 0) << flags << "\n" << r.output;
    EXPECT_NE(r.output.find(says), std::string::npos) << flags << "\n" << r.output;
  }
}

TEST_F(SimCli, BadInputGetsOneClearErrorAndExit2) {
  const std::string moe = MOE_BIN;
  struct Case {
    std::string args, message;
  };
  const std::vector<Case> cases = {
      {"sim", "--cluster PRESET|FILE is required"},
      {"sim --cluster nowhere", "unknown preset"},
      {"sim --cluster /nonexistent.json", "cannot be opened"},
      {"sim --cluster p4d.24xlarge --batch 12", "batch (12) must be a positive multiple of the ranks (8)"},
      {"sim --cluster p4d.24xlarge --ep-size 3", "ep-size (3) must divide"},
      {"sim --cluster p4d.24xlarge --load zipf:abc", "Zipf exponent"},
      {"sim --cluster p4d.24xlarge --load /nonexistent.jsonl", "cannot read /nonexistent.jsonl"},
      {"sim --cluster p4d.24xlarge --strategy lina", "strategy \"lina\" is not known (known: deepspeed, ep, fastermoe, flexmoe, hecate, smartmoe)"},
      {"sim --cluster p4d.24xlarge --steps 0", "steps (0) must be >= 1"},
      {"sim --cluster p4d.24xlarge --model /nonexistent.json", "model config /nonexistent.json"},
      {"sim --calibrate /nonexistent", "--calibrate needs --out"},
  };
  for (const Case& c : cases) {
    const ShellResult r = run(moe + " " + c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.message), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_EQ(r.output.find("step time"), std::string::npos) << c.args;
  }
}

TEST_F(SimCli, CalibratesOnARealRunAndTheClusterFileLoads) {
  const std::string model = "--seq-len 32 --d-model 32 --layers 2 --heads 2 --d-ffn 64 --experts 4 --top-k 2";
  ShellResult r = run(std::string(MOE_BIN) + " train --ranks 2 --data " MOE_TEST_DIR "/../docs/model.md " + model +
                 " --batch-size 8 --steps 4 --trace-steps 4 --eval-batches 1 --threads 1 --metrics " +
                 (dir_ / "metrics.jsonl").string() + " --trace " + (dir_ / "trace.json").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const fs::path model_file = dir_ / "model.json", cluster = dir_ / "cluster.json";
  std::ofstream(model_file) << R"({"seq_len": 32, "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ffn": 64, "n_experts": 4, "top_k": 2})";
  r = run(std::string(MOE_BIN) + " sim --calibrate " + dir_.string() + " --model " + model_file.string() + " --out " +
          cluster.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("calibration of a 2-rank run, batch 8 sequences"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("compute ops ("), std::string::npos) << r.output;
  r = run(std::string(MOE_BIN) + " sim --cluster " + cluster.string() + " --ranks 2 --batch 8 --steps 2 --model " +
          model_file.string() + " --load " + (dir_ / "metrics.jsonl").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(moe::str_cat("cluster   calibrated: 1 node(s) x ", moe::sim::kCalibratedNodeDevices,
                                       " calibrated (pcie)")),
            std::string::npos)
      << r.output;
  // The file records the CPU machine the ranks shared (--cpu-cores), so the executor shares its cores.
  {
    std::ifstream in(cluster);
    const nlohmann::json j = nlohmann::json::parse(in);
    EXPECT_GE(j.value("cpu_cores", 0), 1) << j.dump();
  }
  // Two runs of the one configuration (the same run twice here) fit together; a bad --cpu-cores is refused.
  r = run(std::string(MOE_BIN) + " sim --calibrate " + dir_.string() + " " + dir_.string() + " --cpu-cores 2 --model " +
          model_file.string() + " --out " + (dir_ / "two.json").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("calibration of 2 runs of 2 ranks, batch 8 sequences"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("on 2 shared cores"), std::string::npos) << r.output;
  r = run(std::string(MOE_BIN) + " sim --calibrate " + dir_.string() + " --cpu-cores -5 --model " + model_file.string() +
          " --out " + (dir_ / "bad.json").string());
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_FALSE(fs::exists(dir_ / "bad.json"));
  // A calibration against the wrong model is an error saying what differs.
  std::ofstream(dir_ / "other.json") << R"({"seq_len": 32, "d_model": 32, "n_layers": 3, "n_heads": 2, "d_ffn": 64, "n_experts": 4, "top_k": 2})";
  r = run(std::string(MOE_BIN) + " sim --calibrate " + dir_.string() + " --model " + (dir_ / "other.json").string() +
          " --out " + (dir_ / "x.json").string());
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("the run has 2 MoE layers of 4 experts, the model given (--model) 3 of 4"), std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(dir_ / "x.json"));
}

TEST(SimCalibrate, FitLineRecoversALine) {
  const moe::sim::LinearFit f = moe::sim::fit_line({1, 2, 3, 4}, {3, 5, 7, 9});
  EXPECT_NEAR(f.intercept, 1, 1e-12);
  EXPECT_NEAR(f.slope, 2, 1e-12);
  EXPECT_NEAR(f.rms, 0, 1e-12);
  EXPECT_EQ(f.n, 4);
}

}  // namespace
