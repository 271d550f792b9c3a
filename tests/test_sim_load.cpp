// The simulator's loads and cost filling (src/sim/load.h): synthetic loads' shapes, recorded loads'
// replay, the formulas of fill_ep_costs, and the "same numbers" claim against a real 2-rank run's
// metrics and trace.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "graph/ep_builder.h"
#include "sim/load.h"
#include "util/shell.h"

namespace moe::sim {
namespace {

namespace fs = std::filesystem;

Load make(const std::string& text, const ModelConfig& cfg, int ranks, int64_t tokens) {
  LoadSpec spec;
  Status s = LoadSpec::parse(text, &spec);
  EXPECT_TRUE(s) << s.message();
  Load l;
  s = Load::make(spec, cfg, ranks, tokens, &l);
  EXPECT_TRUE(s) << s.message();
  return l;
}

int64_t expert_total(const std::vector<int64_t>& t, int ranks, int64_t E, int64_t e) {
  int64_t n = 0;
  for (int r = 0; r < ranks; ++r) n += t[r * E + e];
  return n;
}

TEST(SimLoad, SyntheticLoadsHaveTheirShapes) {
  ModelConfig cfg;  // 4 blocks, 8 experts, top-2
  const int R = 4;
  const int64_t N = 100, E = cfg.n_experts, K = cfg.top_k;
  const StepLoad uni = make("uniform", cfg, R, N).step(0);
  ASSERT_EQ(uni.size(), 4u);
  for (int r = 0; r < R; ++r) {
    int64_t sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += uni[0][r * E + e];
    EXPECT_EQ(sum, N * K);
  }
  for (int64_t e = 0; e < E; ++e) EXPECT_EQ(expert_total(uni[0], R, E, e), R * N * K / E);  // 4 * 200 / 8

  const Load zipf = make("zipf:1.5", cfg, R, N);
  const StepLoad z = zipf.step(3);
  EXPECT_EQ(z, zipf.step(0));  // no drift
  for (size_t l = 0; l < z.size(); ++l) {
    int64_t sum = 0, prev = N + 1;
    for (int64_t j = 0; j < E; ++j) {
      const int64_t c = z[l][(l + j) % E];  // popularity order of block l
      EXPECT_LE(c, N);                      // a token picks an expert once
      EXPECT_LE(c, prev);
      prev = c;
      sum += c;
    }
    EXPECT_EQ(sum, N * K);
    EXPECT_EQ(z[l][l % E], N);  // 1/(1+j)^1.5 gives the hottest expert more than N: capped
  }

  const Load drift = make("zipf-drift:1.5,0.5", cfg, R, N);
  auto hottest = [&](const StepLoad& s, int layer) {
    return std::max_element(s[layer].begin(), s[layer].begin() + E) - s[layer].begin();
  };
  EXPECT_EQ(hottest(drift.step(0), 1), 1);
  EXPECT_EQ(hottest(drift.step(1), 1), 1);  // floor(0.5)
  EXPECT_EQ(hottest(drift.step(2), 1), 2);
  EXPECT_EQ(hottest(drift.step(17), 1), (1 + 8) % E);

  cfg.capacity_factor = 1.0;  // capacity ceil(1.0 * 400 * 2 / 8) = 100 per expert, kept in rank order
  const StepLoad capped = make("zipf:1.5", cfg, R, N).step(0);
  EXPECT_EQ(expert_total(capped[0], R, E, 0), 100);
  EXPECT_EQ(capped[0][0 * E + 0], N);
  EXPECT_EQ(capped[0][1 * E + 0], 0);
}

TEST(SimLoad, ParseErrorsNameTheProblem) {
  LoadSpec s;
  EXPECT_FALSE(LoadSpec::parse("zipf:x", &s));
  EXPECT_FALSE(LoadSpec::parse("zipf:-1", &s));
  EXPECT_FALSE(LoadSpec::parse("zipf-drift:1,0", &s));
  EXPECT_FALSE(LoadSpec::parse("", &s));
  ASSERT_TRUE(LoadSpec::parse("zipf-drift:1.2", &s));
  EXPECT_EQ(s.rate, 1.0);
  ModelConfig cfg;
  ASSERT_TRUE(LoadSpec::parse("/nonexistent/run.jsonl", &s));
  Load l;
  Status st = Load::make(s, cfg, 2, 10, &l);
  EXPECT_FALSE(st);
  EXPECT_NE(st.message().find("/nonexistent/run.jsonl"), std::string::npos);
}

TEST(SimLoad, RecordedLoadsReplayCycleAndSpreadEvenly) {
  ModelConfig cfg;
  cfg.n_layers = 2;
  cfg.n_experts = 4;
  const fs::path path = fs::temp_directory_path() / ("moe_sim_load_" + std::to_string(::getpid()) + ".jsonl");
  {
    std::ofstream out(path);
    out << R"({"step":1,"loss":1,"tokens_per_expert":[[5,0,2,1],[1,1,1,1]]})" << "\n";
    out << R"({"val_loss":1})" << "\n";
    out << R"({"step":2,"loss":1,"tokens_per_expert":[[0,0,0,8],[4,0,0,0]]})" << "\n";
  }
  const Load l = make(path.string(), cfg, 2, 4);
  EXPECT_EQ(l.recorded_steps(), 2);
  const StepLoad s0 = l.step(0), s1 = l.step(1), s2 = l.step(2);
  EXPECT_EQ(s0, s2);  // cycles
  // 5 over 2 ranks: 3 and 2; 1: 1 and 0.
  EXPECT_EQ(s0[0], (std::vector<int64_t>{3, 0, 1, 1, 2, 0, 1, 0}));
  EXPECT_EQ(s1[1], (std::vector<int64_t>{2, 0, 0, 0, 2, 0, 0, 0}));
  cfg.n_experts = 8;
  LoadSpec spec;
  ASSERT_TRUE(LoadSpec::parse(path.string(), &spec));
  Load bad;
  Status st = Load::make(spec, cfg, 2, 4, &bad);
  EXPECT_FALSE(st);
  EXPECT_NE(st.message().find("experts"), std::string::npos) << st.message();
  fs::remove(path);
}

TEST(SimLoad, FillEpCostsUsesTheRuntimesFormulas) {
  ModelConfig cfg;
  cfg.n_layers = 1;
  cfg.n_experts = 4;
  cfg.d_model = 16;
  cfg.n_heads = 2;
  cfg.d_ffn = 32;
  cfg.seq_len = 8;
  graph::EpStepOptions opt;
  opt.world = 2;
  opt.ep_size = 2;
  opt.batch = 1;  // N = 8 tokens, 16 assignments per rank
  const graph::EpStep step = graph::build_ep_step(cfg, opt);
  // rank 0 routes {6, 2, 5, 3}, rank 1 {1, 1, 10, 4}; rank 0 owns experts 0-1, rank 1 experts 2-3.
  const StepLoad load = {{6, 2, 5, 3, 1, 1, 10, 4}};
  graph::StepGraph g = step.graph;
  fill_ep_costs(cfg, opt, load, 1, &g);
  const int64_t row = 4 * 16;
  for (const graph::Op& op : g.ops) {
    switch (op.kind) {
      case graph::OpKind::dispatch_a2a:
      case graph::OpKind::combine_a2a_bwd:
        EXPECT_EQ(op.cost.peer_bytes, (std::vector<int64_t>{2 * row, 14 * row}));
        EXPECT_EQ(op.cost.bytes, 16 * row);
        break;
      case graph::OpKind::combine_a2a:
      case graph::OpKind::dispatch_a2a_bwd:  // rows received: 8 from rank 0, 14 from itself
        EXPECT_EQ(op.cost.peer_bytes, (std::vector<int64_t>{8 * row, 14 * row}));
        EXPECT_EQ(op.cost.bytes, 22 * row);
        break;
      case graph::OpKind::expert_fwd: EXPECT_DOUBLE_EQ(op.cost.flops, 1.0 * 2 * 2 * 22 * 16 * 32); break;
      case graph::OpKind::expert_bwd: EXPECT_DOUBLE_EQ(op.cost.flops, 2.0 * 2 * 2 * 22 * 16 * 32); break;
      case graph::OpKind::gate_sync: EXPECT_EQ(op.cost.bytes, 8 * 2 * 4); break;
      default: break;
    }
  }
  // DeepSpeed's padded exchange: every (rank, expert) pair moves the largest count, 10 slots; each
  // rank sends 2 experts x 10 to each rank and its 2 experts compute 2 ranks x 2 x 10 rows.
  opt.padded_exchange = true;
  g = graph::build_ep_step(cfg, opt).graph;
  fill_ep_costs(cfg, opt, load, 1, &g);
  for (const graph::Op& op : g.ops) {
    if (op.kind == graph::OpKind::dispatch_a2a || op.kind == graph::OpKind::combine_a2a) {
      EXPECT_EQ(op.cost.peer_bytes, (std::vector<int64_t>{20 * row, 20 * row})) << g.op_name(op);
    }
    if (op.kind == graph::OpKind::expert_fwd) {
      EXPECT_DOUBLE_EQ(op.cost.flops, 1.0 * 2 * 2 * 40 * 16 * 32);
    }
  }
}

// Each source rank's counts, where a line records them for the simulated ranks, are replayed as they
// are; for another rank count the global counts are split evenly; malformed ones are an error.
TEST(SimLoad, RecordedSourceCountsReplayAsRecorded) {
  ModelConfig cfg;
  cfg.n_layers = 2;
  cfg.n_experts = 4;
  const fs::path path = fs::temp_directory_path() / ("moe_sim_src_" + std::to_string(::getpid()) + ".jsonl");
  auto write = [&](const std::string& source) {
    std::ofstream out(path);
    out << R"({"step":1,"tokens_per_expert":[[5,0,2,1],[1,1,1,1]],"tokens_per_source":)" << source << "}\n";
  };
  write("[[[5,0,0,1],[0,0,2,0]],[[1,1,0,0],[0,0,1,1]]]");
  const Load l = make(path.string(), cfg, 2, 4);
  EXPECT_EQ(l.step(0)[0], (std::vector<int64_t>{5, 0, 0, 1, 0, 0, 2, 0}));  // not the even 3, 0, 1, 1, 2, 0, 1, 0
  EXPECT_EQ(l.step(0)[1], (std::vector<int64_t>{1, 1, 0, 0, 0, 0, 1, 1}));
  const Load four = make(path.string(), cfg, 4, 4);  // recorded on 2 ranks: spread evenly over 4
  EXPECT_EQ(four.step(0)[0], (std::vector<int64_t>{2, 0, 1, 1, 1, 0, 1, 0, 1, 0, 0, 0, 1, 0, 0, 0}));
  write("[]");  // one rank's run records none
  EXPECT_EQ(make(path.string(), cfg, 2, 4).step(0)[0], (std::vector<int64_t>{3, 0, 1, 1, 2, 0, 1, 0}));
  LoadSpec spec;
  ASSERT_TRUE(LoadSpec::parse(path.string(), &spec));
  for (const char* bad : {"[[[5,0,0,1],[0,0,2,0]]]", "[[[5,0,0],[0,0,2,0]],[[1,1,0,0],[0,0,1,1]]]",
                          "[[[5,0,0,-1],[0,0,2,0]],[[1,1,0,0],[0,0,1,1]]]", "[[[5,0,0,1.5],[0,0,2,0]],[[1,1,0,0],[0,0,1,1]]]",
                          "[[[5,0,0,1],[0,0,2,0]],[[1,1,0,0]]]", "7"}) {
    write(bad);
    Load l2;
    const Status st = Load::make(spec, cfg, 2, 4, &l2);
    EXPECT_FALSE(st) << bad;
    EXPECT_NE(st.message().find("tokens_per_source"), std::string::npos) << st.message();
  }
  fs::remove(path);
}

// A real `moe train --ranks 2` run: the sizes the sim fills from the run's recorded load against the
// bytes the runtime recorded in its trace, step by step and layer by layer. The metrics hold each
// source rank's counts (tokens_per_source), so every exchange's bytes agree exactly on every rank.
TEST(SimLoad, RecordedLoadGivesTheRealRunsExchangeBytes) {
  const fs::path dir = fs::temp_directory_path() / ("moe_sim_real_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path metrics = dir / "m.jsonl", trace = dir / "t.json";
  const std::string cmd =
      std::string(moe::kMpirunEnv) + "timeout -k 5 120 " MOE_BIN " train --ranks 2 --data " MOE_TEST_DIR "/../docs/model.md "
      "--seq-len 16 --d-model 16 --layers 2 --heads 2 --d-ffn 32 --experts 4 --top-k 2 --batch-size 8 "
      "--router-skew 1.0 --steps 3 --trace-steps 3 --eval-batches 1 --threads 1 --metrics " +
      metrics.string() + " --trace " + trace.string();
  const ShellResult run = run_shell(cmd);
  ASSERT_EQ(run.exit_code, 0) << run.output;

  ModelConfig cfg;
  cfg.seq_len = 16, cfg.d_model = 16, cfg.n_layers = 2, cfg.n_heads = 2, cfg.d_ffn = 32, cfg.n_experts = 4;
  cfg.top_k = 2;
  graph::EpStepOptions opt;
  opt.world = 2;
  opt.ep_size = 2;
  opt.batch = 4;  // 8 sequences over 2 ranks
  const graph::EpStep step = graph::build_ep_step(cfg, opt);
  const Load load = make(metrics.string(), cfg, 2, opt.batch * cfg.seq_len);
  ASSERT_EQ(load.recorded_steps(), 3);

  // (step, layer, kind, rank) -> bytes from the real trace
  std::map<std::tuple<int, int, std::string, int>, int64_t> real;
  std::ifstream in(trace);
  const nlohmann::json j = nlohmann::json::parse(in);
  for (const auto& e : j.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    const auto& a = e.at("args");
    real[{a.at("step").get<int>(), a.at("layer").get<int>(), a.at("kind").get<std::string>(), e.at("pid").get<int>()}] =
        a.at("bytes").get<int64_t>();
  }
  int compared = 0;
  for (int s = 0; s < 3; ++s) {
    const StepLoad l = load.step(s);
    std::vector<graph::StepGraph> g(2, step.graph);
    for (int r = 0; r < 2; ++r) fill_ep_costs(cfg, opt, l, r, &g[r]);
    for (const graph::Op& op : g[0].ops) {
      const std::string kind = graph::op_kind_name(op.kind);
      if (kind != "dispatch_a2a" && kind != "combine_a2a" && kind != "combine_a2a_bwd" && kind != "dispatch_a2a_bwd")
        continue;
      const int64_t r0 = real.at({s + 1, op.layer, kind, 0}), r1 = real.at({s + 1, op.layer, kind, 1});
      const int64_t s0 = g[0].ops[op.id].cost.bytes, s1 = g[1].ops[op.id].cost.bytes;
      EXPECT_EQ(s0, r0) << "step " << s + 1 << " L" << op.layer << " " << kind;
      EXPECT_EQ(s1, r1) << "step " << s + 1 << " L" << op.layer << " " << kind;
      ++compared;
    }
  }
  EXPECT_EQ(compared, 3 * 2 * 4);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moe::sim
