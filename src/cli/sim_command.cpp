// `moe sim`: predict training steps on a modeled cluster (src/sim/simulate.h) and print a fixed report;
// `moe sim --calibrate RUN`: fit a cluster file to a real run (src/sim/calibrate.h).
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "sim/calibrate.h"
#include "sim/simulate.h"
#include "strategy/strategy.h"
#include "util/quantile.h"
#include "util/str_cat.h"

namespace moe::cli {
namespace {

using json = nlohmann::json;

Status load_model(const std::string& path, ModelConfig* out) {
  std::ifstream in(path);
  if (!in) return Status::error(str_cat("model config ", path, ": cannot be opened"));
  json j;
  try {
    in >> j;
  } catch (const json::exception& e) {
    return Status::error(str_cat("model config ", path, ": not valid JSON (", e.what(), ")"));
  }
  // A `moe train --config` file holds the model under "model".
  if (j.is_object() && j.contains("model") && j.at("model").is_object()) j = j.at("model");
  if (Status s = ModelConfig::from_json(j, out); !s) return Status::error(str_cat("model config ", path, ": ", s.message()));
  return Status::ok();
}

// nodes: 0 for a preset's one node or a file's own count.
Status load_cluster(const std::string& name_or_file, int nodes, sim::ClusterSpec* out) {
  const int preset_nodes = nodes > 0 ? nodes : 1;
  for (const std::string& p : sim::preset_names())
    if (p == name_or_file) return sim::preset_cluster(name_or_file, preset_nodes, out);
  if (name_or_file.find(".json") == std::string::npos && name_or_file.find('/') == std::string::npos) {
    return sim::preset_cluster(name_or_file, preset_nodes, out);  // the unknown-preset message lists the presets
  }
  if (Status s = sim::load_cluster_file(name_or_file, out); !s) return s;
  if (nodes > 0) out->nodes = nodes;
  return out->validate();
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / static_cast<double>(v.size());
}

void print_report(const sim::SimRunConfig& cfg, const sim::SimRunResult& res) {
  const sim::ClusterSpec& c = cfg.cluster;
  const ModelConfig& m = cfg.model;
  std::printf("cluster   %s: %d node(s) x %d %s (%s)%s\n", c.name.c_str(), c.nodes, c.node.devices,
              c.node.device.name.c_str(), sim::interconnect_name(c.node.interconnect),
              c.nodes > 1 ? str_cat(", NIC ", c.node.nic_port.bandwidth * 8e-9, " Gb/s x ", c.node.nic_switch.size(),
                                    " per node").c_str()
                          : "");
  std::printf("model     L=%lld C=%lld F=%lld heads=%lld E=%lld K=%lld T=%lld %s%s\n", (long long)m.n_layers,
              (long long)m.d_model, (long long)m.d_ffn, (long long)m.n_heads, (long long)m.n_experts,
              (long long)m.top_k, (long long)m.seq_len, m.activation.c_str(),
              m.capacity_factor > 0 ? str_cat(" capacity ", m.capacity_factor).c_str() : " dropless");
  std::printf("strategy  %s: %d ranks, ep groups of %d (%d replica(s) of each expert), batch %lld (%lld per rank), "
              "load %s, %d step(s)%s\n",
              cfg.strategy.c_str(), res.ranks, res.ep_size, res.ranks / res.ep_size, (long long)cfg.batch,
              (long long)(cfg.batch / res.ranks), cfg.load.describe().c_str(), cfg.steps,
              res.aggregated ? ", flows aggregated" : "");
  std::vector<double> step_ms;
  for (const auto& s : res.steps) step_ms.push_back(s.step_ms);
  std::printf("\nstep time (ms)       mean %9.3f   p50 %9.3f   p90 %9.3f   max %9.3f\n", mean(step_ms),
              nearest_rank_quantile(step_ms, 0.5), nearest_rank_quantile(step_ms, 0.9), nearest_rank_quantile(step_ms, 1.0));
  runtime::StepBreakdown b;
  for (const auto& s : res.steps) {
    const double n = static_cast<double>(res.steps.size());
    b.compute_ms += s.mean.compute_ms / n;
    b.exposed_comm_ms += s.mean.exposed_comm_ms / n;
    b.comm_ms += s.mean.comm_ms / n;
    b.allreduce_ms += s.mean.allreduce_ms / n;
    b.allreduce_hidden_ms += s.mean.allreduce_hidden_ms / n;
  }
  {
    const double n = static_cast<double>(res.steps.size());
    double moe = 0, moe_max = 0, replicas = 0, calibrations = 0, sparse_mb = 0;
    int64_t moved = 0;
    for (const auto& s : res.steps) {
      moe += s.moe_ms / n;
      moe_max += s.moe_ms_max / n;
      replicas += static_cast<double>(s.placement.replicas) / n;
      calibrations += static_cast<double>(s.placement.calibrations) / n;
      moved += s.placement.experts_moved;
      sparse_mb += 1e-6 * static_cast<double>(s.sparse_bytes) / n;
    }
    std::printf("MoE layers (ms)      mean over ranks %9.3f   busiest rank %9.3f\n", moe, moe_max);
    if (strategy::places_experts(cfg.strategy))
      std::printf("placement (per step) extra replicas %.1f   calibrations %.1f   sparse collectives %.3f MB sent+received\n"
                  "re-sharding          %lld expert shards moved over the run (between steps: not in the step times)\n",
                  replicas, calibrations, sparse_mb, static_cast<long long>(moved));
  }
  std::printf("breakdown (ms, mean over ranks and steps)\n");
  std::printf("  compute %9.3f   exposed comm %9.3f   comm (all lanes) %9.3f   allreduce %9.3f (hidden %9.3f)\n",
              b.compute_ms, b.exposed_comm_ms, b.comm_ms, b.allreduce_ms, b.allreduce_hidden_ms);
  std::printf("critical path (ms per step, mean over steps)\n");
  const double total = mean(step_ms);
  for (size_t i = 0; i < sim::path_categories().size(); ++i) {
    double ms = 0;
    for (const auto& s : res.steps) ms += s.critical_path_ms[i].second / static_cast<double>(res.steps.size());
    if (ms <= 0) continue;
    std::printf("  %-20s %9.3f  %5.1f%%\n", sim::path_categories()[i].c_str(), ms, total > 0 ? 100 * ms / total : 0);
  }
  const sim::Cluster cluster(cfg.cluster);
  std::printf("most utilised links (over the simulated time)\n");
  for (const sim::LinkUse& u : sim::top_links(cluster, res.link_bytes, res.simulated_s, 5))
    std::printf("  %-28s %5.1f%%  %10.3f MB\n", u.name.c_str(), 100 * u.utilisation, u.bytes * 1e-6);
  int64_t flows = 0;
  for (const auto& s : res.steps) flows += s.flows;
  std::printf("simulated %.3f ms of training in %.3f s (%lld flows)\n", res.simulated_s * 1e3, res.wall_s,
              (long long)flows);
}

Status write_metrics(const std::string& path, const sim::SimRunConfig& cfg, const sim::SimRunResult& res) {
  std::ofstream out(path);
  if (!out) return Status::error(str_cat("metrics ", path, ": cannot be written"));
  for (size_t i = 0; i < res.steps.size(); ++i) {
    const sim::SimStepSummary& s = res.steps[i];
    json cp = json::object();
    for (const auto& [cat, ms] : s.critical_path_ms) cp[cat] = ms;
    out << json{{"step", i + 1},
                {"step_ms", s.step_ms},
                {"tokens_per_s", static_cast<double>(cfg.batch * cfg.model.seq_len) / (s.step_ms * 1e-3)},
                {"compute_ms", s.mean.compute_ms},
                {"exposed_comm_ms", s.mean.exposed_comm_ms},
                {"comm_ms", s.mean.comm_ms},
                {"allreduce_ms", s.mean.allreduce_ms},
                {"allreduce_hidden_ms", s.mean.allreduce_hidden_ms},
                {"tokens_per_expert", s.tokens_per_expert},
                {"tokens_per_rank", s.tokens_per_rank},
                {"moe_ms_per_rank", s.moe_ms_per_rank},
                {"replicas", s.placement.replicas},
                {"calibrations", s.placement.calibrations},
                {"experts_moved", s.placement.experts_moved},
                {"overlap_degree", s.placement.overlap_degree},
                {"weights_gbs", s.placement.weights_gbs},  // the trainer's cost_model.weights_gbs; 0 without placements
                {"sparse_bytes", s.sparse_bytes},
                {"strategy", cfg.strategy},
                {"critical_path_ms", cp},
                {"simulated", true}}
                .dump()
        << "\n";
  }
  if (!out) return Status::error(str_cat("metrics ", path, ": write failed"));
  return Status::ok();
}

}  // namespace

CLI::App* add_sim_command(CLI::App& app, SimFlags* f) {
  CLI::App* c = app.add_subcommand("sim", "predict training steps on a modeled cluster (see docs/sim.md)");
  c->add_option("--cluster", f->cluster, "preset name or cluster JSON file");
  c->add_option("--nodes", f->nodes, "nodes of the preset (default 1), or instead of the cluster file's")
      ->check(CLI::PositiveNumber);
  c->add_option("--model", f->model, "model config JSON (ModelConfig keys, or a train config with \"model\")");
  std::string strategies;
  for (const auto& [name, info] : sim::sim_strategies()) strategies += (strategies.empty() ? "" : ", ") + name;
  c->add_option("--strategy", f->strategy, "strategy: " + strategies);
  c->add_option("--load", f->load,
                "uniform | zipf:S | zipf-drift:S[,RATE] | FILE.jsonl (a moe train run's metrics: its recorded loads)");
  c->add_option("--steps", f->steps, "training steps to simulate");
  c->add_option("--batch", f->batch, "sequences per step over all ranks (a multiple of the ranks)");
  c->add_option("--ranks", f->ranks, "ranks (0: every device of the cluster)");
  c->add_option("--ep-size", f->ep_size, "ranks per expert-parallel group (0: largest divisor of ranks and experts)");
  c->add_option("--allreduce-micro-kb", f->allreduce_micro_kb, "gradient allreduce micro-op size in KiB (0: whole)");
  c->add_option("--aggregate", f->aggregate, "aggregated flows: auto (above 64 ranks), on, off")
      ->check(CLI::IsMember({"auto", "on", "off"}));
  c->add_flag("--hierarchical-allreduce", f->hierarchical_allreduce, "allreduce across nodes: hierarchical rings");
  sim::PlacementOptions& p = f->placement;
  c->add_flag("--rematerialize", p.rematerialize, "hecate: free replicas after forward, gather again for backward");
  c->add_option("--overlap-degree", p.overlap_degree,
                "hecate: experts gathered behind attention (-1: from the modeled attention time)");
  c->add_option("--replica-slots", p.replica_slots, "hecate: extra experts a rank may hold per layer (-1: experts per rank)");
  c->add_option("--load-window", p.load_window, "hecate: steps of the load prediction window");
  c->add_option("--reshard-every", p.reshard_every,
                "hecate: Alg. 2 every N steps; smartmoe: its interval; flexmoe: its replan interval (-1: 100/100/50)");
  c->add_option("--link-gbs", p.link_gbs,
                "GB/s the planners' cost models assume for moving expert weights (0: the cluster's, see docs/sim.md)");
  c->add_option("--start-link-gbs", p.measured_link_gbs,
                "GB/s the planners' cost models start from and then follow the simulated steps' transfers, as the "
                "trainer's do (to predict a run: its metrics' first cost_model.network_gbs; 0: the cluster's)");
  c->add_option("--trace", f->trace, "write a Chrome trace of every rank and step to FILE");
  c->add_option("--metrics", f->metrics, "write per-step metrics as JSON lines to FILE");
  c->add_option("--calibrate", f->calibrate,
                "fit a cluster to real EP runs of --model, all of one configuration: each a directory with "
                "metrics.jsonl and trace.json, or METRICS,TRACE");
  c->add_option("--out", f->out, "--calibrate: the cluster JSON file to write");
  c->add_option("--cpu-cores", f->cpu_cores,
                "--calibrate: cores the run's CPU ranks shared (-1: this machine's; 0: accelerators, no sharing)")
      ->check(CLI::Range(-1, 1 << 20));
  c->add_option("--cpu-threads", f->cpu_threads,
                "--calibrate: the run's compute threads per rank, its --threads (0: as its metrics record, else cores / ranks)")
      ->check(CLI::Range(0, 1 << 20));
  return c;
}

int run_sim(const SimFlags& f) {
  // Flags and configuration rejected: exit 2, as every command's; a failure while working: 1.
  auto say = [](const std::string& m, int code) {
    std::fprintf(stderr, "moe sim: %s\n", m.c_str());
    return code;
  };
  auto rejected = [&](const std::string& m) { return say(m, 2); };
  auto fail = [&](const std::string& m) { return say(m, 1); };
  if (!f.calibrate.empty()) {
    if (f.out.empty()) return rejected("--calibrate needs --out FILE (the cluster file to write)");
    ModelConfig model;
    if (!f.model.empty())
      if (Status s = load_model(f.model, &model); !s) return rejected(s.message());
    sim::CalibrationResult cal;
    sim::CalibrationMachine machine;
    machine.cpu_cores = f.cpu_cores >= 0 ? f.cpu_cores : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    machine.threads_per_rank = f.cpu_threads;
    if (Status s = sim::calibrate(f.calibrate, model, &cal, machine); !s) return fail(s.message());
    std::fputs(sim::describe(cal).c_str(), stdout);
    if (Status s = sim::write_cluster_file(f.out, cal.cluster); !s) return fail(s.message());
    std::printf("cluster written to %s (use --cluster %s)\n", f.out.c_str(), f.out.c_str());
    return 0;
  }
  if (f.cluster.empty()) return rejected("--cluster PRESET|FILE is required");
  sim::SimRunConfig cfg;
  if (Status s = load_cluster(f.cluster, f.nodes, &cfg.cluster); !s) return rejected(s.message());
  if (!f.model.empty())
    if (Status s = load_model(f.model, &cfg.model); !s) return rejected(s.message());
  cfg.strategy = f.strategy;
  if (Status s = sim::LoadSpec::parse(f.load, &cfg.load); !s) return rejected(s.message());
  cfg.steps = f.steps;
  cfg.ranks = f.ranks;
  cfg.ep_size = f.ep_size;
  if (f.ranks < 0 || f.ep_size < 0) return rejected("--ranks and --ep-size must be >= 0");
  if (f.allreduce_micro_kb < 0) return rejected("--allreduce-micro-kb must be >= 0");
  cfg.allreduce_micro_bytes = f.allreduce_micro_kb * 1024;
  cfg.aggregate = f.aggregate == "on"    ? sim::SimRunConfig::Aggregate::on
                  : f.aggregate == "off" ? sim::SimRunConfig::Aggregate::off
                                         : sim::SimRunConfig::Aggregate::automatic;
  cfg.hierarchical_allreduce = f.hierarchical_allreduce;
  cfg.keep_trace = !f.trace.empty();
  cfg.placement = f.placement;
  // The default batch: 4 sequences per rank.
  cfg.batch = f.batch != 0 ? f.batch : 4LL * (f.ranks > 0 ? f.ranks : cfg.cluster.nodes * cfg.cluster.node.devices);
  if (Status s = sim::resolve(&cfg); !s) return rejected(s.message());
  // A recorded load must fit the model before any work.
  {
    sim::Load probe;
    if (Status s = sim::Load::make(cfg.load, cfg.model, cfg.ranks, cfg.batch / cfg.ranks * cfg.model.seq_len, &probe); !s)
      return rejected(s.message());
  }
  sim::SimRunResult res;
  if (Status s = sim::simulate(cfg, &res); !s) return fail(s.message());
  print_report(cfg, res);
  if (!f.trace.empty()) {
    if (Status s = runtime::write_chrome_trace(f.trace, res.graph, res.trace, res.ranks); !s) return fail(s.message());
    std::printf("trace: %d step(s) of %d rank(s) written to %s\n", cfg.steps, res.ranks, f.trace.c_str());
  }
  if (!f.metrics.empty()) {
    if (Status s = write_metrics(f.metrics, cfg, res); !s) return fail(s.message());
    std::printf("metrics: %d line(s) written to %s\n", cfg.steps, f.metrics.c_str());
  }
  return 0;
}

}  // namespace moe::cli
