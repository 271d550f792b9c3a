// moe bench sim: see bench.h (moe bench sim-fidelity is in bench/sim_fidelity.cpp).
//
// sim: the wall time to simulate one training step of a 12-layer, 64-expert GPT-MoE (T 1024, C 768,
// F 3072, 12 heads, top-2, GELU, dropless; 4 sequences per rank; load zipf:1.0; EP with ep groups of
// gcd(64, GPUs); gradient allreduce micro-ops of 4 MiB) on H100 HGX nodes (presets.cpp), contention
// modeled (max-min sharing of every link). Flows are aggregated above 64 GPUs (collectives.h); the
// 32-GPU row is also run with aggregation, to show what it changes. The reference is the goal
// (<= 50 ms at 32 GPUs, <= 5 s at 4096; interpolated log-linearly in between), printed per row with
// wall / goal. Wall times are the median of `repeats` runs (one run above 256 GPUs).

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "bench/bench.h"
#include "sim/simulate.h"

namespace moe::bench {
namespace {

ModelConfig gpt_moe_12() {
  ModelConfig m;
  m.seq_len = 1024;
  m.d_model = 768;
  m.n_layers = 12;
  m.n_heads = 12;
  m.d_ffn = 3072;
  m.n_experts = 64;
  m.top_k = 2;
  return m;
}

// The goal at `gpus`: 50 ms at 32, 5 s at 4096, log-linear between.
double goal_ms(int gpus) {
  const double t = std::log(gpus / 32.0) / std::log(4096 / 32.0);
  return 50 * std::pow(5000 / 50.0, std::clamp(t, 0.0, 1.0));
}

}  // namespace

int sim_speed(const BenchOptions& opt) {
  std::printf("moe bench sim: one training step of a 12-layer 64-expert GPT-MoE (C 768, F 3072, T 1024, top-2,\n"
              "4 sequences per rank, zipf:1.0 load, EP, allreduce micro-ops 4 MiB) on h100x8-hgx nodes\n\n");
  std::printf("%6s %6s %4s %10s %10s %12s %10s %10s %8s\n", "GPUs", "nodes", "ep", "flows", "aggregate",
              "step (ms)", "wall (ms)", "goal (ms)", "wall/goal");
  struct Row {
    int gpus;
    sim::SimRunConfig::Aggregate agg;
  };
  const Row rows[] = {{32, sim::SimRunConfig::Aggregate::off},
                      {32, sim::SimRunConfig::Aggregate::on},
                      {256, sim::SimRunConfig::Aggregate::on},
                      {1024, sim::SimRunConfig::Aggregate::on},
                      {4096, sim::SimRunConfig::Aggregate::on}};
  for (const Row& row : rows) {
    sim::SimRunConfig cfg;
    if (Status s = sim::preset_cluster("h100x8-hgx", row.gpus / 8, &cfg.cluster); !s) {
      std::fprintf(stderr, "bench sim: %s\n", s.message().c_str());
      return 1;
    }
    cfg.model = gpt_moe_12();
    cfg.load.kind = sim::LoadSpec::Kind::zipf;
    cfg.load.s = 1.0;
    cfg.steps = 1;
    cfg.batch = 4LL * row.gpus;
    cfg.allreduce_micro_bytes = 4 << 20;
    cfg.aggregate = row.agg;
    const int repeats = row.gpus > 256 ? 1 : opt.repeats;
    std::vector<double> wall;
    sim::SimRunResult res;
    for (int i = 0; i < repeats; ++i) {
      if (Status s = sim::simulate(cfg, &res); !s) {
        std::fprintf(stderr, "bench sim: %s\n", s.message().c_str());
        return 1;
      }
      wall.push_back(res.wall_s * 1e3);
    }
    const double w = median(wall), g = goal_ms(row.gpus);
    std::printf("%6d %6d %4d %10lld %10s %12.3f %10.1f %10.0f %8.2f\n", row.gpus, row.gpus / 8, res.ep_size,
                (long long)res.steps[0].flows, res.aggregated ? "yes" : "no", res.steps[0].step_ms, w, g, w / g);
    std::fflush(stdout);
  }
  std::printf("\nwall: host time to set up and simulate the step (median of %d runs; 1 run above 256 GPUs) on this\n"
              "machine, shared with other jobs; step: the simulated step time\n",
              opt.repeats);
  return 0;
}

}  // namespace moe::bench
