// moe bench strategies: see bench.h.
//
// Real MPI ranks (mpirun -n 2, --threads per rank as given / 2) train the default model on the default
// corpus with a skewed router (--router-skew 1.5, identical for every strategy), once per strategy,
// in rounds that interleave the strategies so the machine's drifts hit all alike. The reference is
// EP with the router unskewed (its imbalance is printed: a trained router is not perfectly uniform).
// The baselines run at two settings of their knob each (SmartMoE's re-planning interval, FlexMoE's
// reserved slots), so each is judged at its better one, as the Hecate paper tuned them.
// Columns (medians over every round's steps after its first `warmup`):
//   step ms       wall time of the step (rank 0)
//   moe ms        the MoE layers' time, busiest rank: gate_fwd .. combine_fwd and combine_bwd ..
//                 gate_bwd of every MoE block, waits for the exchanges included
//   vs ref        moe ms / the reference's moe ms (the goal for hecate: <= 1.15)
//   expert ms     expert GEMM time (expert_fwd + expert_bwd), busiest rank / mean over ranks
//   ranks m/m     expert rows of the busiest rank over the mean, worst MoE layer
//   sparse MB     bytes the sparse collectives moved per step (sent + received, all ranks)
//   replicas      extra expert replicas per step, all layers
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench.h"
#include "util/shell.h"

namespace moe::bench {
namespace {

struct Samples {
  std::vector<double> step, moe, expert_max, expert_mean, imbalance, sparse_mb, replicas;
};

bool run(int ranks, int threads, const std::string& extra, int steps, int warmup, Samples* out) {
  const std::string metrics =
      std::filesystem::temp_directory_path() / ("moe_bench_strategies_" + std::to_string(getpid()) + ".jsonl");
  std::string cmd = "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 ";
  cmd += "mpirun -n " + std::to_string(ranks) + " " + self_exe("moe") + " train --steps " + std::to_string(steps) +
         " --log-every " + std::to_string(steps) + " --eval-batches 1 --threads " + std::to_string(threads) +
         " --metrics " + metrics + " " + extra + " > /dev/null 2>&1";
  int st = std::system(cmd.c_str());
  if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
    std::fprintf(stderr, "bench strategies: '%s' failed (exit %d)\n", cmd.c_str(), WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    return false;
  }
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.contains("step_ms") || j["step"].get<int>() <= warmup) continue;
    std::vector<double> moe = j["moe_ms_per_rank"], expert = j["expert_ms_per_rank"];
    out->step.push_back(j["step_ms"]);
    out->moe.push_back(*std::max_element(moe.begin(), moe.end()));
    out->expert_max.push_back(*std::max_element(expert.begin(), expert.end()));
    out->expert_mean.push_back(std::accumulate(expert.begin(), expert.end(), 0.0) / expert.size());
    double worst = 1;
    for (const auto& r : j["rank_imbalance"]) worst = std::max(worst, r.get<double>());
    out->imbalance.push_back(worst);
    out->sparse_mb.push_back(j["sparse_bytes"].get<double>() / 1e6);
    out->replicas.push_back(j["replicas"].get<double>());
  }
  std::filesystem::remove(metrics);
  return true;
}

}  // namespace

int strategies(const BenchOptions& opt) {
  const int steps = 30, warmup = 6, ranks = 2, threads = std::max(1, opt.threads / ranks);
  const int rounds = std::clamp(opt.repeats, 1, 3);
  std::printf("# moe bench strategies: default model and corpus, %d MPI ranks x %d thread(s), router skew 1.5, "
              "%d rounds x %d steps (medians after %d each)\n",
              ranks, threads, rounds, steps, warmup);
  struct Config {
    std::string name, extra;
  };
  const std::string skew = "--router-skew 1.5 ";
  const std::vector<Config> configs{{"ep, unskewed (reference)", "--strategy ep"},
                                    {"ep", skew + "--strategy ep"},
                                    {"hecate", skew + "--strategy hecate"},
                                    {"hecate --rematerialize", skew + "--strategy hecate --rematerialize"},
                                    {"fastermoe", skew + "--strategy fastermoe"},
                                    {"smartmoe --reshard-every 5", skew + "--strategy smartmoe --reshard-every 5"},
                                    {"smartmoe --reshard-every 20", skew + "--strategy smartmoe --reshard-every 20"},
                                    {"flexmoe", skew + "--strategy flexmoe"},
                                    {"flexmoe --replica-slots 2", skew + "--strategy flexmoe --replica-slots 2"},
                                    {"deepspeed", skew + "--strategy deepspeed"}};
  std::vector<Samples> samples(configs.size());
  std::vector<bool> ok(configs.size(), true);
  for (int r = 0; r < rounds; ++r)
    for (size_t c = 0; c < configs.size(); ++c)
      if (ok[c]) ok[c] = run(ranks, threads, configs[c].extra, steps, warmup, &samples[c]);
  std::printf("%-26s %8s %8s %7s %16s %9s %10s %9s\n", "strategy", "step ms", "moe ms", "vs ref", "expert ms max/mean",
              "ranks m/m", "sparse MB", "replicas");
  const double ref = ok[0] ? median(samples[0].moe) : 0;
  int failed = 0;
  for (size_t c = 0; c < configs.size(); ++c) {
    const Samples& s = samples[c];
    if (!ok[c] || s.step.empty()) {
      std::printf("%-26s %8s\n", configs[c].name.c_str(), "failed");
      ++failed;
      continue;
    }
    const double moe = median(s.moe);
    char expert[32];
    std::snprintf(expert, sizeof expert, "%.1f / %.1f", median(s.expert_max), median(s.expert_mean));
    std::printf("%-26s %8.1f %8.1f %7.2f %16s %9.2f %10.2f %9.0f\n", configs[c].name.c_str(), median(s.step), moe,
                ref > 0 ? moe / ref : 0, expert, median(s.imbalance), median(s.sparse_mb), median(s.replicas));
  }
  return failed ? 1 : 0;
}

}  // namespace moe::bench
