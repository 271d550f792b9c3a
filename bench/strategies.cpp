// moe bench strategies: see bench.h.
//
// Real MPI ranks (mpirun -n 2, --threads per rank as given / 2) train the default model on the default
// corpus with a skewed router (--router-skew 1.5, identical for every strategy), once per strategy,
// in rounds that interleave the strategies so the machine's drifts hit all alike. The reference is
// EP with the router unskewed (its imbalance is printed: a trained router is not perfectly uniform).
// The baselines run at two settings of their knob each (SmartMoE's re-planning interval, FlexMoE's
// reserved slots), so each is judged at its better one, as the Hecate paper tuned them.
// Columns (medians over every round's steps after its first `warmup`):
//   step ms       wall time of the step (rank 0) plus the run's re-sharding between steps (reshard_ms:
//                 SmartMoE's swaps, FlexMoE's moves, Hecate's Alg. 2) summed over its measured steps and spread
//                 over them
//   moe ms        the MoE layers' time, busiest rank: gate_fwd .. combine_fwd and combine_bwd ..
//                 gate_bwd of every MoE block, waits for the exchanges included
//   moe / reference moe   moe ms over the reference's
//   expert ms     expert GEMM time (expert_fwd + expert_bwd), busiest rank / mean over ranks
//   ranks m/m     expert rows of the busiest rank over the mean, worst MoE layer
//   sparse MB     bytes the sparse collectives moved per step (sent + received, all ranks)
//   replicas      extra expert replicas per step, all layers
// --report FILE: the last round's metrics file of every configuration drawn on one moe report page.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench.h"
#include "bench/report.h"
#include "util/shell.h"
#include "util/str_cat.h"

namespace moe::bench {
namespace {

struct Samples {
  std::vector<double> step, moe, expert_max, expert_mean, imbalance, sparse_mb, replicas;
};

// One run writing `metrics` (kept: the caller's scratch directory removes it).
bool run(int ranks, int threads, const std::string& extra, int steps, int warmup, const std::string& metrics,
         Samples* out) {
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
  const size_t first_step = out->step.size();
  double reshard_ms = 0;
  for (std::string line; std::getline(in, line);) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.contains("step_ms") || j["step"].get<int>() <= warmup) continue;
    std::vector<double> moe = j["moe_ms_per_rank"], expert = j["expert_ms_per_rank"];
    out->step.push_back(j["step_ms"]);
    reshard_ms += j.value("reshard_ms", 0.0);
    out->moe.push_back(*std::max_element(moe.begin(), moe.end()));
    out->expert_max.push_back(*std::max_element(expert.begin(), expert.end()));
    out->expert_mean.push_back(std::accumulate(expert.begin(), expert.end(), 0.0) / expert.size());
    double worst = 1;
    for (const auto& r : j["rank_imbalance"]) worst = std::max(worst, r.get<double>());
    out->imbalance.push_back(worst);
    out->sparse_mb.push_back(j["sparse_bytes"].get<double>() / 1e6);
    out->replicas.push_back(j["replicas"].get<double>());
  }
  const size_t measured = out->step.size() - first_step;
  for (size_t i = first_step; i < out->step.size(); ++i) out->step[i] += reshard_ms / static_cast<double>(measured);
  return true;
}

}  // namespace

int strategies(const BenchOptions& opt) {
  if (!default_corpus_ready("strategies")) return 1;
  const int steps = 30, warmup = 6, ranks = 2, threads = std::max(1, opt.threads / ranks);
  const int rounds = std::clamp(opt.repeats, 1, 3);
  Report report("strategies",
                "every training strategy on " + std::to_string(ranks) + " MPI ranks x " + std::to_string(threads) +
                    " thread(s), default model and corpus, router skew 1.5, " + std::to_string(rounds) + " rounds x " +
                    std::to_string(steps) + " steps (medians after " + std::to_string(warmup) + " each)",
                opt);
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
  const ScratchDir scratch("moe_bench_strategies_");
  std::vector<std::string> metrics, labels;  // per configuration: the last round's file
  for (size_t c = 0; c < configs.size(); ++c) {
    metrics.push_back((scratch.path() / str_cat("c", c, ".jsonl")).string());
    labels.push_back(configs[c].name);
  }
  for (int r = 0; r < rounds; ++r)
    for (size_t c = 0; c < configs.size(); ++c)
      if (ok[c]) ok[c] = run(ranks, threads, configs[c].extra, steps, warmup, metrics[c], &samples[c]);
  if (!opt.html.empty()) {
    std::vector<std::string> done, done_labels;
    for (size_t c = 0; c < configs.size(); ++c)
      if (ok[c]) done.push_back(metrics[c]), done_labels.push_back(labels[c]);
    write_html_report(opt.html,
                      str_cat("moe bench strategies: ", ranks, " ranks, router skew 1.5, round ", rounds, " of ", rounds),
                      done, done_labels);
  }
  report.table("strategies, interleaved rounds",
               {{"strategy", ""}, {"step", "ms", 1}, {"moe", "ms", 1}, {"moe / reference moe", "x"},
                {"expert max", "ms", 1}, {"expert mean", "ms", 1}, {"ranks max / mean", "x"}, {"sparse", "MB"},
                {"replicas", "", 0}});
  const double ref = ok[0] ? median(samples[0].moe) : 0;
  const double nan = std::nan("");
  int failed = 0;
  for (size_t c = 0; c < configs.size(); ++c) {
    const Samples& s = samples[c];
    if (!ok[c] || s.step.empty()) {
      report.row({configs[c].name + " (failed)", nan, nan, nan, nan, nan, nan, nan, nan});
      ++failed;
      continue;
    }
    const double moe = median(s.moe);
    report.row({configs[c].name, median(s.step), moe, ref > 0 ? moe / ref : nan, median(s.expert_max),
                median(s.expert_mean), median(s.imbalance), median(s.sparse_mb), median(s.replicas)});
  }
  report.note("reference: ep with the router unskewed (the first row); moe = the MoE layers' time on the busiest "
              "rank, waits for the exchanges included; expert = expert GEMM time per rank; ranks max / mean = expert "
              "rows of the busiest rank over the mean, worst MoE layer; sparse = bytes the sparse collectives moved "
              "per step, all ranks");
  return report.finish(failed ? 1 : 0);
}

}  // namespace moe::bench
