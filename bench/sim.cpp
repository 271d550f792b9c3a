// moe bench sim and moe bench sim-fidelity: see bench.h.
//
// sim: the wall time to simulate one training step of a 12-layer, 64-expert GPT-MoE (T 1024, C 768,
// F 3072, 12 heads, top-2, GELU, dropless; 4 sequences per rank; load zipf:1.0; EP with ep groups of
// gcd(64, GPUs); gradient allreduce micro-ops of 4 MiB) on H100 HGX nodes (presets.cpp), contention
// modeled (max-min sharing of every link). Flows are aggregated above 64 GPUs (collectives.h); the
// 32-GPU row is also run with aggregation, to show what it changes. The reference is the goal
// (<= 50 ms at 32 GPUs, <= 5 s at 4096; interpolated log-linearly in between), printed per row with
// wall / goal. Wall times are the median of `repeats` runs (one run above 256 GPUs).
//
// sim-fidelity: calibrate on one real run on this machine (moe train --ranks 2, the model below, EP),
// then predict other configurations and measure them for real in the same run: rank count 4, a larger
// batch, more experts. Predicted vs measured step time is the graph's wall time (compute + exposed
// communication, mean over ranks; the optimizer, which neither graph holds, is left out of both) over
// the steps after the first; error = predicted / measured - 1. Four ranks on this machine share its
// cores: the prediction runs the calibrated device slowed by ranks * threads / cores when that exceeds
// 1 (the cores are measured with hardware_concurrency), the only correction applied.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench.h"
#include "sim/calibrate.h"
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

namespace {

struct Measured {
  double graph_ms = 0;  // compute + exposed comm, mean over ranks, median over steps after the first
  double step_ms = 0;   // the runtime's step_ms (optimizer and metrics included), same steps
  bool ok = false;
};

// Trains `args` on `ranks` ranks with metrics (and a trace when given); returns the medians.
Measured train(int ranks, const std::string& args, const std::string& metrics, const std::string& trace) {
  Measured m;
  std::string cmd = "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 "
                    "OMP_NUM_THREADS=1 mpirun -n " +
                    std::to_string(ranks) + " " + self_exe() + " train " + args + " --metrics " + metrics +
                    (trace.empty() ? "" : " --trace " + trace) + " > /dev/null 2>&1";
  const int st = std::system(cmd.c_str());
  if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
    std::fprintf(stderr, "bench sim-fidelity: '%s' failed\n", cmd.c_str());
    return m;
  }
  std::ifstream in(metrics);
  std::vector<double> graph, step;
  std::string line;
  for (int n = 0; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (!j.contains("step_ms")) continue;
    if (n++ == 0) continue;  // the first step warms up
    graph.push_back(j.at("compute_ms").get<double>() + j.at("exposed_comm_ms").get<double>());
    step.push_back(j.at("step_ms").get<double>());
  }
  m.graph_ms = median(graph);
  m.step_ms = median(step);
  m.ok = !graph.empty();
  return m;
}

std::string model_flags(const ModelConfig& m) {
  return "--seq-len " + std::to_string(m.seq_len) + " --d-model " + std::to_string(m.d_model) + " --layers " +
         std::to_string(m.n_layers) + " --heads " + std::to_string(m.n_heads) + " --d-ffn " + std::to_string(m.d_ffn) +
         " --experts " + std::to_string(m.n_experts) + " --top-k " + std::to_string(m.top_k);
}

}  // namespace

int sim_fidelity(const BenchOptions& opt) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("moe_bench_sim_fidelity_" + std::to_string(getpid()));
  fs::create_directories(dir);
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const int threads = 1;
  const int steps = 6;
  const std::string common = "--steps " + std::to_string(steps) + " --log-every " + std::to_string(steps) +
                             " --eval-batches 1 --threads " + std::to_string(threads) + " --trace-steps " +
                             std::to_string(steps) + " ";
  ModelConfig base;  // the default model: T 128, C 128, L 4, F 256, E 8, top-2
  const int64_t base_batch = 16;
  std::printf("moe bench sim-fidelity: calibrate on moe train --ranks 2 (default model, batch %lld, %d thread per "
              "rank, %u cores),\npredict other configurations, measure them for real in the same run\n\n",
              (long long)base_batch, threads, cores);
  const std::string cal_metrics = (dir / "metrics.jsonl").string(), cal_trace = (dir / "trace.json").string();
  const Measured cal_run = train(2, common + model_flags(base) + " --batch-size " + std::to_string(base_batch),
                                 cal_metrics, cal_trace);
  if (!cal_run.ok) return 1;
  sim::CalibrationResult cal;
  if (Status s = sim::calibrate(dir.string(), base, &cal); !s) {
    std::fprintf(stderr, "bench sim-fidelity: %s\n", s.message().c_str());
    return 1;
  }
  std::fputs(sim::describe(cal).c_str(), stdout);

  struct Case {
    std::string name;
    int ranks;
    int64_t batch;
    int64_t experts;
  };
  const std::vector<Case> cases = {{"calibration run (2 ranks)", 2, base_batch, 8},
                                   {"4 ranks", 4, base_batch, 8},
                                   {"batch x2 (2 ranks)", 2, 2 * base_batch, 8},
                                   {"16 experts (2 ranks)", 2, base_batch, 16}};
  std::printf("\n%-28s %14s %14s %9s %16s\n", "configuration", "predicted ms", "measured ms", "error", "measured step ms");
  int i = 0;
  for (const Case& c : cases) {
    ModelConfig m = base;
    m.n_experts = c.experts;
    const std::string metrics = (dir / ("case" + std::to_string(i++) + ".jsonl")).string();
    const Measured meas = train(c.ranks, common + model_flags(m) + " --batch-size " + std::to_string(c.batch), metrics, "");
    if (!meas.ok) return 1;
    sim::SimRunConfig cfg;
    cfg.cluster = cal.cluster;
    // Ranks beyond the cores share them: each runs proportionally slower (see the header comment).
    const double share = static_cast<double>(c.ranks * threads) / cores;
    if (share > 1) cfg.cluster.node.device.peak_flops /= share, cfg.cluster.node.device.mem_bandwidth /= share;
    cfg.model = m;
    cfg.ranks = c.ranks;
    cfg.batch = c.batch;
    cfg.steps = steps - 1;
    cfg.allreduce_micro_bytes = 256 << 10;  // moe train's default
    // The measured run's own load, replayed.
    cfg.load.kind = sim::LoadSpec::Kind::recorded;
    cfg.load.file = metrics;
    sim::SimRunResult res;
    if (Status s = sim::simulate(cfg, &res); !s) {
      std::fprintf(stderr, "bench sim-fidelity: %s\n", s.message().c_str());
      return 1;
    }
    std::vector<double> pred;
    for (size_t k = 1; k < res.steps.size(); ++k) pred.push_back(res.steps[k].mean.compute_ms + res.steps[k].mean.exposed_comm_ms);
    if (pred.empty()) pred.push_back(res.steps[0].mean.compute_ms + res.steps[0].mean.exposed_comm_ms);
    const double p = median(pred);
    std::printf("%-28s %14.2f %14.2f %+8.1f%% %16.2f\n", c.name.c_str(), p, meas.graph_ms, 100 * (p / meas.graph_ms - 1),
                meas.step_ms);
    std::fflush(stdout);
  }
  std::printf("\npredicted / measured: the step graph's wall time (compute + exposed comm, mean over ranks), median\n"
              "over steps 2..%d; measured step ms adds the optimizer and metrics (not in either graph)\n",
              steps);
  (void)opt;
  fs::remove_all(dir);
  return 0;
}

}  // namespace moe::bench
