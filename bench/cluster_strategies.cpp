// moe bench cluster-strategies: see bench.h.
//
// Every training strategy across emulated hosts (scripts/cluster.sh: NICs capped by tc; root), where
// the project's promise lives: the router sends tokens unevenly across nodes. Per configuration
// (2 hosts x 1 rank and 2 hosts x 2 ranks; NIC 1 Gbit/s and 10 Gbit/s; router skew 0, 1.5, and 1.5 whose
// popularity order turns by an expert every 4 steps, --router-skew-drift 0.25: a load that moves between
// steps as a trained gate's does, Hecate's paper's Fig. 3, the rate bench sim-strategies' load has) the
// strategies run `moe train` (default model and corpus, --threads 1, the cost model each run measures
// at start-up) in --repeats rounds (default 2) that interleave them, each round starting one strategy
// further on, so the machine's drifts weigh on all alike. Columns, medians over the rounds of each
// run's median over its steps after the warm-up:
//   step ms      the runtime's step_ms (rank 0): the step's wall time, optimizer included, plus the
//                re-sharding between steps (reshard_ms: SmartMoE's swaps, Hecate's Alg. 2, FlexMoE's
//                moves of shards and moments) spread over the steps: its sum over the measured steps
//                over their count, since a median of steps would leave out a cost paid every 5th step
//   vs ep        step ms / ep's step ms in the same configuration (below 1: faster than ep)
//   vs ep rounds the same ratio round by round (each run against ep's run of its own round, minutes
//                apart, so a slow spell of the machine weighs on both): the median (a spell that slows
//                every run of one round moves it less than the ratio of medians), lowest and highest,
//                and in how many rounds the strategy was faster than ep (all n: the sign test's p = 2^-n)
//   rounds fastest  in how many rounds the strategy's run was the fastest of all strategies' runs
//                (a claim of "faster than every baseline" needs it in most rounds, not the medians alone)
//   exposed ms   communication the compute stream waited for (mean over ranks)
//   sparse MB    bytes the sparse collectives moved per step (gathers of replicas, their gradients;
//                sent + received, all ranks)
//   ranks m/m    expert rows of the busiest rank over the mean, worst MoE layer
//   t            Hecate's overlap degree (Alg. 1), from the measured inter-node bandwidth
//   sim ms       the simulator's prediction of the same run: calibrated (sim/calibrate.h) on local 2-rank
//                ep runs made in the same rounds, one at the start of each round of the configuration,
//                so that the calibration meets the machine's spells as the runs it predicts do (this
//                machine's speed moves by up to 1.7x within seconds: docs/cpus.md); the hosts joined by
//                one NIC each at the configured cap (or what an exchange alone reached across them,
//                bench transfer-cpu, where lower), each run's own recorded loads replayed, the same
//                strategy object starting from the link figure the run measured at start-up
//   sim err      predicted / measured step graph time (compute + exposed communication, which the
//                simulator models; the optimizer is in neither) - 1
//   fastest err  the same for the strategy's fastest round, predicted from the configuration's fastest
//                calibration run alone: the simulator models a machine without other load, which only
//                adds time, and this machine's runs fall into spells up to 1.7x apart (docs/cpus.md),
//                so the medians mix spells while the fastest runs on both sides are the least disturbed
//                (as bench sim-fidelity's fastest-run column)
// --only TEXT: only the configurations whose name (2x1-1gbit-skew1.5, 2x2-10gbit-skew0, ...) contains
// TEXT, e.g. more rounds of one of them in the same time.
// --keep DIR: every run's metrics, the calibration runs' metrics and traces, each configuration's
// calibrated cluster (NAME.cluster.json) and runs.tsv (which file is which run, its measured and
// predicted step graph ms) copied to DIR, so the predictions can be made again (`moe sim --cluster
// NAME.cluster.json --load FILE.jsonl`) with another simulator model without running the cluster again.
// --report FILE: per configuration, the last round's metrics of every strategy drawn on one moe report
// page, FILE's name with the configuration inserted before its extension (report-2x1-1gbit-skew1.5.html).
// All hosts of the emulation share this machine's cores; with 2 ranks per host, 4 ranks take turns on
// them, and the table's header says how many cores there are.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench.h"
#include "bench/report.h"
#include "bench/emulated_cluster.h"
#include "sim/calibrate.h"
#include "sim/simulate.h"
#include "util/shell.h"
#include "util/str_cat.h"

namespace moe::bench {
namespace {

constexpr const char* kCluster = "moestrat";
constexpr int kSteps = 12, kWarmup = 3;

struct Run {
  bool ok = false;
  double step_ms = 0, graph_ms = 0, exposed_ms = 0, sparse_mb = 0, rank_imbalance = 0, t = 0;
  std::string metrics;  // the run's metrics file (kept for the simulator's replay)
  double link_gbs = 0;  // the link figure the run's planners started from (its cost model measured at start-up)
};

Run train(const std::string& launch, const std::string& args, const std::string& metrics, const std::string& trace) {
  Run run;
  std::filesystem::remove(metrics);
  std::string cmd = str_cat(launch, " ", self_exe("moe"), " train --steps ", kSteps, " --log-every ", kSteps,
                            " --eval-batches 1 --threads 1 --metrics ", metrics, " ", args);
  if (!trace.empty()) cmd += str_cat(" --trace ", trace, " --trace-steps ", kSteps);
  const ShellResult r = run_shell(cmd);
  if (r.exit_code != 0) {
    std::fprintf(stderr, "bench cluster-strategies: '%s' failed (exit %d):\n%s", cmd.c_str(), r.exit_code,
                 r.output.c_str());
    return run;
  }
  std::vector<double> step, graph, exposed, sparse, ranks, t;
  double reshard_ms = 0;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && run.link_gbs == 0 && j.contains("cost_model"))
      run.link_gbs = j["cost_model"].value("network_gbs", 0.0);
    if (j.is_discarded() || !j.contains("step_ms") || j["step"].get<int>() <= kWarmup) continue;
    step.push_back(j["step_ms"]);
    reshard_ms += j.value("reshard_ms", 0.0);
    graph.push_back(j["compute_ms"].get<double>() + j["exposed_comm_ms"].get<double>());
    exposed.push_back(j["exposed_comm_ms"]);
    sparse.push_back(j["sparse_bytes"].get<double>() / 1e6);
    double worst = 1;
    for (const auto& x : j["rank_imbalance"]) worst = std::max(worst, x.get<double>());
    ranks.push_back(worst);
    t.push_back(j["overlap_degree"]);
  }
  run.ok = !step.empty();
  run.step_ms = median(step) + (step.empty() ? 0 : reshard_ms / static_cast<double>(step.size()));
  run.graph_ms = median(graph), run.exposed_ms = median(exposed);
  run.sparse_mb = median(sparse), run.rank_imbalance = median(ranks), run.t = median(t);
  run.metrics = metrics;
  return run;
}

// The simulator's graph time of a run of `strategy` replaying its recorded load (after the warm-up,
// the same steps as Run::graph_ms), its planners starting from the link figure the run's did (the
// measured inputs it decided on: the modeled cluster's own figure is a device's share of the NIC, where
// the runs' ping-pongs read the whole NIC on 2 x 2 until 2026-11-29, and FlexMoE then placed replicas
// in the runs and none in their predictions; docs/sim.md).
Status predict(const sim::ClusterSpec& cluster, const std::string& strategy, int reshard_every, int ranks,
               const Run& run, double* ms) {
  sim::SimRunConfig cfg;
  cfg.cluster = cluster;
  cfg.model = ModelConfig{};
  cfg.strategy = strategy;
  cfg.placement.reshard_every = reshard_every;
  cfg.placement.measured_link_gbs = run.link_gbs;
  cfg.ranks = ranks;
  cfg.ep_size = ranks;
  cfg.batch = 16;
  cfg.steps = kSteps;
  cfg.allreduce_micro_bytes = 256 << 10;  // moe train's default
  return simulated_graph_ms(cfg, run.metrics, kWarmup, ms);
}

}  // namespace

int cluster_strategies(const BenchOptions& opt) {
  namespace fs = std::filesystem;
  const ScratchDir scratch("moe_bench_cluster_strategies_");
  const fs::path& dir = scratch.path();
  const int rounds = std::max(1, opt.repeats);  // --repeats (moe bench defaults it to 2 here)
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const std::vector<std::string> strategies = {"ep",         "hecate",  "fastermoe", "smartmoe --reshard-every 5",
                                               "flexmoe",    "deepspeed"};
  struct Config {
    int ranks_per_host;
    const char* nic;
    double nic_bits;
    double skew;
    double drift;  // --router-skew-drift: experts per step
    std::string name() const {
      return str_cat("2x", ranks_per_host, "-", nic, "-skew", skew, drift > 0 ? str_cat("-drift", drift) : "");
    }
    std::string workload() const {
      return str_cat("router skew ", skew, drift > 0 ? str_cat(" drifting ", drift, " experts a step") : "");
    }
  };
  std::vector<Config> configs;
  for (int rph : {1, 2})
    for (auto [nic, bits] : {std::pair{"1gbit", 1e9}, std::pair{"10gbit", 1e10}})
      for (auto [skew, drift] : {std::pair{1.5, 0.0}, std::pair{1.5, 0.25}, std::pair{0.0, 0.0}}) {
        const Config cf{rph, nic, bits, skew, drift};
        if (cf.name().find(opt.only) != std::string::npos) configs.push_back(cf);
      }
  if (configs.empty()) {
    std::fprintf(stderr,
                 "moe bench cluster-strategies: no configuration's name contains '%s' (names: 2x1-1gbit-skew1.5, "
                 "2x1-1gbit-skew1.5-drift0.25, 2x1-1gbit-skew0, ..., 2x2-10gbit-skew0)\n",
                 opt.only.c_str());
    return 2;
  }

  if (!default_corpus_ready("cluster-strategies")) return 1;

  Report report("cluster-strategies",
                str_cat("every strategy on an emulated cluster: moe train, default model and corpus, --threads 1, ",
                        kSteps, " steps (medians after ", kWarmup, "), ", rounds,
                        " interleaved rounds; 2 emulated hosts sharing this machine's ", cores, " cores"),
                opt);

  // The simulator's calibration runs: local 2-rank ep runs (traced) on this machine.
  const std::string local = "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -n 2 --bind-to none";
  std::vector<std::vector<std::string>> cal_runs(configs.size());  // "METRICS,TRACE" per round that ran
  std::vector<std::vector<double>> cal_step(configs.size());        // their step ms, in the same order
  // Per configuration, measured before its rounds at its cap (bench transfer-cpu): the compute threads'
  // worth of a host's cores one transfer between hosts takes and its slowdown beside compute, the
  // simulator's cluster's figures.
  std::vector<EmulatedCluster::TransferCpu> transfer_cpu(configs.size());

  EmulatedCluster cluster(kCluster, configs[0].nic);
  if (!cluster.up()) {
    std::fprintf(stderr, "moe bench cluster-strategies: %s\n", cluster.why().c_str());
    return report.finish(1);
  }
  // runs[c][s]: every round's run of strategy s in configuration c.
  std::vector<std::vector<std::vector<Run>>> runs(
      configs.size(), std::vector<std::vector<Run>>(strategies.size(), std::vector<Run>(static_cast<size_t>(rounds))));
  int failed = 0;
  for (size_t c = 0; c < configs.size(); ++c) {
    const Config& cf = configs[c];
    if (!cluster.shape(cf.nic)) return report.finish(1);
    if (Status st = cluster.measure_transfer_cpu(3, &transfer_cpu[c]); !st) {
      std::fprintf(stderr, "bench cluster-strategies: %s: %s; the simulator counts a transfer as 1 thread, not slowed\n",
                   cf.name().c_str(), st.message().c_str());
    }
    const std::string launch = cluster.command(str_cat("run --ranks-per-node ", cf.ranks_per_host, " --"));
    for (int r = 0; r < rounds; ++r) {
      const fs::path cal = dir / str_cat("cal_c", c, "_r", r);
      if (const Run cal_run = train(local, "", cal.string() + ".jsonl", cal.string() + ".trace.json"); cal_run.ok) {
        cal_runs[c].push_back(cal.string() + ".jsonl," + cal.string() + ".trace.json");
        cal_step[c].push_back(cal_run.step_ms);
      } else {
        ++failed;
      }
      // Each round starts one strategy further on, so none always runs right after the calibration
      // run or after the same strategy (as bench serve's rounds).
      for (size_t i = 0; i < strategies.size(); ++i) {
        const size_t s = (i + static_cast<size_t>(r)) % strategies.size();
        const std::string file = (dir / str_cat("c", c, "_s", s, "_r", r, ".jsonl")).string();
        const std::string workload = str_cat("--router-skew ", cf.skew, " --router-skew-drift ", cf.drift);
        Run run = train(launch, str_cat(workload, " --strategy ", strategies[s]), file, "");
        failed += run.ok ? 0 : 1;
        runs[c][s][static_cast<size_t>(r)] = std::move(run);
      }
    }
    std::fprintf(stderr, "bench cluster-strategies: configuration %zu of %zu done\n", c + 1, configs.size());
  }

  // --keep: one line per run that ran (configuration, strategy, round, metrics file, measured step and
  // step graph ms, predicted step graph ms or "-").
  std::ostringstream kept_runs;
  kept_runs << "configuration\tstrategy\tround\tmetrics\tstep_ms\tgraph_ms\tsim_graph_ms\n";
  for (size_t c = 0; c < configs.size(); ++c) {
    const Config& cf = configs[c];
    const int ranks = 2 * cf.ranks_per_host;
    // The two hosts of this configuration, calibrated on `cal`'s runs (said on stderr where that failed).
    auto calibrated = [&](const std::vector<std::string>& cal, const char* which, sim::ClusterSpec* out) {
      sim::CalibrationResult fit;
      Status st = cal.empty() ? Status::error("no calibration run of this configuration's rounds ran")
                              : sim::calibrate(cal, ModelConfig{}, &fit, {cores, 1});
      if (st) st = sim::two_node_cluster(fit, cf.ranks_per_host, sim::LinkSpec{cf.nic_bits / 8 / kWireFactor, 0}, out);
      if (st) transfer_cpu[c].apply(out);
      if (!st)
        std::fprintf(stderr, "bench cluster-strategies: %s: %s: %s, no prediction\n", cf.name().c_str(), which,
                     st.message().c_str());
      return st;
    };
    sim::ClusterSpec spec, fast_spec;
    const Status spec_status = calibrated(cal_runs[c], "calibration", &spec);
    if (spec_status && !opt.keep.empty()) std::ofstream(dir / (cf.name() + ".cluster.json")) << spec.to_json().dump(2);
    Status fast_status = spec_status;  // from the fastest calibration run alone
    if (fast_status) {
      const size_t fastest = std::min_element(cal_step[c].begin(), cal_step[c].end()) - cal_step[c].begin();
      fast_status = calibrated({cal_runs[c][fastest]}, "fastest calibration run", &fast_spec);
    }
    report.table(str_cat("2 hosts x ", cf.ranks_per_host, " rank(s), NIC ", cf.nic, ", ", cf.workload()),
                 {{"strategy", "", 0, 28}, {"step", "ms", 1}, {"step / ep step", "x"}, {"step / ep rounds median", "x"},
                  {"step / ep rounds min", "x"}, {"step / ep rounds max", "x"}, {"rounds faster than ep", "", 0},
                  {"rounds fastest of all", "", 0}, {"exposed comm", "ms", 1}, {"sparse", "MB"},
                  {"ranks max / mean", "x"}, {"t", "", 0},
                  {"sim step graph", "ms", 0}, {"sim / measured step graph - 1", "%", 0},
                  {"fastest round: sim / measured - 1", "%", 0}});
    const double nan = std::nan("");
    auto med = [&](size_t s, double Run::*field) {
      std::vector<double> v;
      for (const Run& r : runs[c][s])
        if (r.ok) v.push_back(r.*field);
      return median(v);
    };
    const double ep_step = med(0, &Run::step_ms);
    // Per round, the strategy whose run was the fastest (of the runs that succeeded).
    std::vector<int> fastest_of_rounds(strategies.size(), 0);
    for (int r = 0; r < rounds; ++r) {
      size_t best = strategies.size();
      for (size_t s = 0; s < strategies.size(); ++s)
        if (runs[c][s][r].ok && (best == strategies.size() || runs[c][s][r].step_ms < runs[c][best][r].step_ms))
          best = s;
      if (best < strategies.size()) ++fastest_of_rounds[best];
    }
    for (size_t s = 0; s < strategies.size(); ++s) {
      if (med(s, &Run::step_ms) == 0) {
        report.row({strategies[s] + " (failed)", nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan});
        continue;
      }
      std::vector<double> step, ep_step_of_round;  // the rounds where both ran
      for (int r = 0; r < rounds; ++r)
        if (runs[c][s][r].ok && runs[c][0][r].ok)
          step.push_back(runs[c][s][r].step_ms), ep_step_of_round.push_back(runs[c][0][r].step_ms);
      const PairedRounds paired = paired_rounds(step, ep_step_of_round);
      std::vector<double> pred;
      const std::string name = strategies[s].substr(0, strategies[s].find(' '));
      const int reshard_every = strategies[s].find("--reshard-every 5") != std::string::npos ? 5 : -1;
      for (int r = 0; r < rounds; ++r) {
        const Run& run = runs[c][s][r];
        double ms = 0;
        if (run.ok && spec_status && predict(spec, name, reshard_every, ranks, run, &ms)) pred.push_back(ms);
        if (run.ok)
          kept_runs << cf.name() << '\t' << strategies[s] << '\t' << r << '\t'
                    << fs::path(run.metrics).filename().string() << '\t' << run.step_ms << '\t' << run.graph_ms
                    << '\t' << (ms > 0 ? str_cat(ms) : "-") << '\n';
      }
      const double p = median(pred), g = med(s, &Run::graph_ms);
      const Run* fastest = nullptr;
      for (const Run& r : runs[c][s])
        if (r.ok && (!fastest || r.graph_ms < fastest->graph_ms)) fastest = &r;
      double fast_err = nan, fast_ms = 0;
      if (fastest && fast_status && predict(fast_spec, name, reshard_every, ranks, *fastest, &fast_ms) &&
          fastest->graph_ms > 0)
        fast_err = 100 * (fast_ms / fastest->graph_ms - 1);
      report.row({strategies[s], med(s, &Run::step_ms), ep_step > 0 ? med(s, &Run::step_ms) / ep_step : nan,
                  paired.median, paired.lowest, paired.highest, paired.below, static_cast<double>(fastest_of_rounds[s]),
                  med(s, &Run::exposed_ms),
                  med(s, &Run::sparse_mb), med(s, &Run::rank_imbalance), med(s, &Run::t),
                  p > 0 ? p : nan, p > 0 && g > 0 ? 100 * (p / g - 1) : nan, fast_err});
    }
  }
  if (!opt.html.empty())
    for (size_t c = 0; c < configs.size(); ++c) {
      const Config& cf = configs[c];
      const fs::path html(opt.html);
      const std::string name = cf.name();
      std::vector<std::string> files, labels;
      for (size_t s = 0; s < strategies.size(); ++s)
        if (runs[c][s].back().ok) files.push_back(runs[c][s].back().metrics), labels.push_back(strategies[s]);
      write_html_report((html.parent_path() / str_cat(html.stem().string(), "-", name, html.extension().string())).string(),
                        str_cat("moe bench cluster-strategies: 2 hosts x ", cf.ranks_per_host, " rank(s), NIC ", cf.nic,
                                ", ", cf.workload(), ", round ", rounds, " of ", rounds),
                        files, labels);
    }
  if (!opt.keep.empty()) {
    std::ofstream(dir / "runs.tsv") << kept_runs.str();
    std::error_code ec;
    fs::create_directories(opt.keep, ec);
    if (!ec) fs::copy(dir, opt.keep, fs::copy_options::overwrite_existing | fs::copy_options::recursive, ec);
    if (ec) {
      std::fprintf(stderr, "moe bench cluster-strategies: --keep %s: %s\n", opt.keep.c_str(), ec.message().c_str());
      ++failed;
    } else {
      std::fprintf(stderr, "moe bench cluster-strategies: runs kept in %s (runs.tsv says which is which)\n",
                   opt.keep.c_str());
    }
  }
  std::string measured_transfers;
  for (size_t c = 0; c < configs.size(); ++c)
    measured_transfers += str_cat(c ? ", " : "", configs[c].name(), " ", std::round(100 * transfer_cpu[c].threads) / 100,
                                  " / ", std::round(100 * transfer_cpu[c].slowdown) / 100, " / ",
                                  std::round(1000 * transfer_cpu[c].exchange_bytes_per_s * 1e-9) / 1000);
  report.note("sim: a transfer between hosts counted as w compute threads and slowed x times beside compute, and "
              "the NIC carrying at most what an exchange alone reached (GB/s each way, where below the cap); w / x / "
              "GB/s measured at each configuration's cap before its rounds (moe bench transfer-cpu, 3 rounds): " +
              measured_transfers);
  size_t cal_done = 0;
  for (const auto& c : cal_runs) cal_done += c.size();
  report.note(str_cat("sim: the simulator's step graph time (compute + exposed comm) for the run's own loads, "
                      "calibrated on local 2-rank ep runs made one per round of the same configuration (",
                      cal_done, " of ", configs.size() * rounds, " ran); measured step graph: the run's compute + "
                      "exposed comm. Fastest round: the strategy's fastest run against the prediction calibrated on "
                      "the configuration's fastest calibration run alone (the least disturbed on both sides)"));
  return report.finish(failed ? 1 : 0);
}

}  // namespace moe::bench
