// moe bench ep-training: see bench.h.
//
// Runs `moe train` on the default corpus and model three ways, in rounds (--repeats, at most 3) that
// interleave them so the machine's drifts hit all alike, each run `steps` steps with metrics (the runtime's per-step timeline, the same spans --trace shows):
//   1 process     all of the global batch in one process, `threads` OpenMP threads (the reference)
//   2 ranks EP    mpirun -n 2, threads/2 each: experts divided, alltoallv dispatch/combine on the
//                 all-to-all lane, gradient allreduce in micro-ops on the allreduce lane under backward
//   2 ranks, no micro-ops  the same with whole-bucket allreduces (--allreduce-micro-kb 0)
//   ..., skew 1.5 1 process and 2 ranks EP with a skewed router (--router-skew 1.5): uneven experts,
//                 so one rank's experts get more rows: the straggler effect the papers attack
// Columns (medians over every round's steps after its first `warmup`; times are the mean over ranks
// of that step):
//   step ms      wall time of forward + backward + gradient sums + optimizer
//   tok/s        global batch tokens / step time
//   vs 1 proc    1-process step time (same router) / this step time (> 1: faster than one process)
//   compute ms   time the compute stream ran ops
//   exposed ms   step graph time the compute stream waited on communication (and its share of the
//                step graph time, compute + exposed)
//   allreduce ms gradient allreduce time on its lane; hidden: the part that ran while compute ran
//   ranks max/mean  expert rows of the busiest rank over the mean, worst MoE layer (the straggler)
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench.h"
#include "bench/report.h"
#include "util/shell.h"

namespace moe::bench {
namespace {

// Per-step samples of one configuration, pooled over rounds.
struct Samples {
  std::vector<double> step, compute, exposed, allreduce, hidden, imbalance;
};

struct Row {
  std::string name;
  bool ok = false;
  double step_ms = 0, compute_ms = 0, exposed_ms = 0, allreduce_ms = 0, hidden_ms = 0, rank_imbalance = 1;
};

// One `moe train` run; appends its steps to *out. False if it failed.
bool run(int ranks, int threads, const std::string& extra, int steps, int warmup, Samples* out) {
  const std::string metrics = std::filesystem::temp_directory_path() / ("moe_bench_ep_" + std::to_string(getpid()) +
                                                                        ".jsonl");
  std::string cmd = "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 ";
  if (ranks > 1) cmd += "mpirun -n " + std::to_string(ranks) + " ";
  cmd += self_exe("moe") + " train --steps " + std::to_string(steps) + " --log-every " + std::to_string(steps) +
         " --eval-batches 1 --threads " + std::to_string(threads) + " --metrics " + metrics + " " + extra +
         " > /dev/null 2>&1";
  int st = std::system(cmd.c_str());
  if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
    std::fprintf(stderr, "bench ep-training: '%s' failed (exit %d)\n", cmd.c_str(), WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    return false;
  }
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.contains("step_ms") || j["step"].get<int>() <= warmup) continue;
    out->step.push_back(j["step_ms"]);
    out->compute.push_back(j["compute_ms"]);
    out->exposed.push_back(j["exposed_comm_ms"]);
    out->allreduce.push_back(j["allreduce_ms"]);
    out->hidden.push_back(j["allreduce_hidden_ms"]);
    double worst = 1;
    for (const auto& r : j["rank_imbalance"]) worst = std::max(worst, r.get<double>());
    out->imbalance.push_back(worst);
  }
  std::filesystem::remove(metrics);
  return true;
}

}  // namespace

int ep_training(const BenchOptions& opt) {
  if (!default_corpus_ready("ep-training")) return 1;
  const int steps = 40, warmup = 5, threads = std::max(2, opt.threads);
  const int rounds = std::clamp(opt.repeats, 1, 3);
  const int64_t tokens = 16 * 128;  // the default global batch
  Report report("ep-training",
                "expert-parallel training on 2 MPI ranks against 1 process on the same global batch, default model "
                "and corpus, " + std::to_string(rounds) + " rounds x " + std::to_string(steps) + " steps (medians after " +
                    std::to_string(warmup) + " each), " + std::to_string(threads) + " cores in all",
                opt);
  struct Config {
    std::string name;
    int ranks;
    std::string extra;
  };
  const std::vector<Config> configs{{"1 process", 1, ""},
                                    {"2 ranks EP", 2, ""},
                                    {"2 ranks EP, no micro-ops", 2, "--allreduce-micro-kb 0"},
                                    {"1 process, skew 1.5", 1, "--router-skew 1.5"},
                                    {"2 ranks EP, skew 1.5", 2, "--router-skew 1.5"}};
  std::vector<Samples> samples(configs.size());
  std::vector<bool> ok(configs.size(), true);
  for (int r = 0; r < rounds; ++r)
    for (size_t c = 0; c < configs.size(); ++c)
      if (ok[c]) ok[c] = run(configs[c].ranks, threads / configs[c].ranks, configs[c].extra, steps, warmup, &samples[c]);
  std::vector<Row> rows;
  for (size_t c = 0; c < configs.size(); ++c) {
    Row row;
    row.name = configs[c].name;
    const Samples& s = samples[c];
    row.ok = ok[c] && !s.step.empty();
    row.step_ms = median(s.step);
    row.compute_ms = median(s.compute);
    row.exposed_ms = median(s.exposed);
    row.allreduce_ms = median(s.allreduce);
    row.hidden_ms = median(s.hidden);
    row.rank_imbalance = median(s.imbalance);
    rows.push_back(row);
  }
  report.table("runs, interleaved rounds",
               {{"run", ""}, {"step", "ms", 1}, {"tokens/s", "1/s", 0}, {"1-process step / step", "x"},
                {"compute", "ms", 1}, {"exposed comm", "ms", 1}, {"exposed / (compute + exposed)", "%", 0},
                {"allreduce", "ms", 1}, {"allreduce hidden", "%", 0}, {"ranks max / mean", "x"}});
  // Each row against the 1-process run of the same router (rows 0 and 3).
  auto ref_of = [&](const Row& r) {
    const Row& ref = r.name.find("skew") != std::string::npos ? rows[3] : rows[0];
    return ref.ok ? ref.step_ms : 0.0;
  };
  const double nan = std::nan("");
  int failed = 0;
  for (const Row& r : rows) {
    if (!r.ok) {
      report.row({r.name + " (failed)", nan, nan, nan, nan, nan, nan, nan, nan, nan});
      ++failed;
      continue;
    }
    const double graph_ms = r.compute_ms + r.exposed_ms;
    report.row({r.name, r.step_ms, tokens / (r.step_ms / 1e3), ref_of(r) > 0 ? ref_of(r) / r.step_ms : nan,
                r.compute_ms, r.exposed_ms, graph_ms > 0 ? 100 * r.exposed_ms / graph_ms : nan,
                r.allreduce_ms > 0 ? r.allreduce_ms : nan, r.allreduce_ms > 0 ? 100 * r.hidden_ms / r.allreduce_ms : nan,
                r.rank_imbalance});
  }
  return report.finish(failed ? 1 : 0);
}

}  // namespace moe::bench
