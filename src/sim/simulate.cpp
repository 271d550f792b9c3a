// A simulated run: strategy registry, validation, the step loop and its summaries (simulate.h).
#include "sim/simulate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>

#include "runtime/cpu_threads.h"
#include "sim/placement_costs.h"
#include "strategy/strategy.h"
#include "util/str_cat.h"

namespace moe::sim {

namespace {

// Expert parallelism: one graph shape (build_ep_step), sizes from the load per rank.
class EpStrategy : public SimStrategy {
 public:
  // name: a registered strategy that places no experts (ep, deepspeed); its configure sets the
  // graph options (deepspeed: the padded exchange).
  EpStrategy(const StrategySetup& s, const std::string& name) : setup_(s) {
    opt_.world = s.ranks;
    opt_.ep_size = s.ep_size;
    opt_.batch = s.batch_per_rank;
    opt_.allreduce_micro_bytes = s.allreduce_micro_bytes;
    std::unique_ptr<strategy::Strategy> impl;
    if (opt_.world > 1 && strategy::make(name, strategy::Setup{}, &impl)) {
      impl->configure(&opt_);
      step_ = impl->build_step(s.model, opt_);
    } else {
      step_ = graph::build_ep_step(s.model, opt_);
    }
  }
  void step_graphs(const StepLoad& load, std::vector<graph::StepGraph>* out) override {
    out->assign(setup_.ranks, step_.graph);
    for (int r = 0; r < setup_.ranks; ++r) fill_ep_costs(setup_.model, opt_, load, r, &(*out)[r]);
  }

 private:
  StrategySetup setup_;
  graph::EpStepOptions opt_;
  graph::EpStep step_;
};

}  // namespace

std::map<std::string, StrategyInfo> sim_strategies() {
  // The strategies of strategy/strategy.h's registry, the same objects the trainer runs: ep's graphs
  // from EpStrategy, the others' from their decisions (placement_costs.h).
  std::map<std::string, StrategyInfo> r;
  for (const strategy::Registration& reg : strategy::registry()) {
    const std::string name = reg.name;
    if (!strategy::places_experts(name)) {
      r[name] = {reg.summary, [name](const StrategySetup& s, std::unique_ptr<SimStrategy>* out) -> Status {
                   *out = std::make_unique<EpStrategy>(s, name);
                   return Status::ok();
                 }};
    } else {
      r[name] = {reg.summary, [name](const StrategySetup& s, std::unique_ptr<SimStrategy>* out) {
                   return make_placement_strategy(name, s, out);
                 }};
    }
  }
  return r;
}

Status resolve(SimRunConfig* cfg) {
  if (Status s = cfg->cluster.validate(); !s) return s;
  if (Status s = cfg->model.validate(); !s) return s;
  if (!sim_strategies().count(cfg->strategy)) {
    std::string known;
    for (const auto& [name, info] : sim_strategies()) known += (known.empty() ? "" : ", ") + name;
    return Status::error(str_cat("strategy \"", cfg->strategy, "\" is not known (known: ", known, ")"));
  }
  const int devices = cfg->cluster.nodes * cfg->cluster.node.devices;
  if (cfg->ranks == 0) cfg->ranks = devices;
  if (cfg->ranks < 1 || cfg->ranks > devices)
    return Status::error(str_cat("ranks (", cfg->ranks, ") must be in [1, ", devices, "], the cluster's devices"));
  // The placement strategies place experts over one group of every rank (strategy::Strategy::ep_size).
  if (cfg->ep_size == 0 && strategy::places_experts(cfg->strategy)) cfg->ep_size = cfg->ranks;
  if (cfg->ep_size == 0) {
    for (int g = 1; g <= cfg->ranks; ++g)
      if (cfg->ranks % g == 0 && cfg->model.n_experts % g == 0) cfg->ep_size = g;
  }
  if (cfg->ep_size < 1 || cfg->ranks % cfg->ep_size != 0 || cfg->model.n_experts % cfg->ep_size != 0)
    return Status::error(str_cat("ep-size (", cfg->ep_size, ") must divide the ranks (", cfg->ranks,
                                 ") and the experts (", cfg->model.n_experts, ")"));
  if (cfg->steps < 1) return Status::error(str_cat("steps (", cfg->steps, ") must be >= 1"));
  if (cfg->batch < 1 || cfg->batch % cfg->ranks != 0)
    return Status::error(str_cat("batch (", cfg->batch, ") must be a positive multiple of the ranks (", cfg->ranks, ")"));
  if (cfg->allreduce_micro_bytes < 0) return Status::error("allreduce micro-op size must be >= 0");
  return Status::ok();
}

plan::CorePools sim_core_pools(const ClusterSpec& cluster, const std::vector<int>& node_of_rank) {
  if (cluster.cpu_cores <= 0 || node_of_rank.empty()) return {};
  const int nodes = 1 + *std::max_element(node_of_rank.begin(), node_of_rank.end());
  const int per_node = cluster.cpu_nodes_pinned ? std::max(1, cluster.cpu_cores / nodes) : cluster.cpu_cores;
  std::vector<runtime::RankCpus> cpus(node_of_rank.size());
  for (size_t r = 0; r < node_of_rank.size(); ++r) {
    const int first = cluster.cpu_nodes_pinned ? node_of_rank[r] * per_node : 0;
    for (int c = first; c < first + per_node && c < runtime::RankCpus::kWords * 64; ++c)
      cpus[r].mask[c / 64] |= uint64_t{1} << (c % 64);
  }
  return runtime::core_pools(cpus, std::vector<int>(node_of_rank.size(), cluster.cpu_threads_per_device));
}

plan::CorePools sim_nic_pools(const Cluster& cluster, int ranks) {
  if (cluster.n_nodes() < 2) return {};
  const int nics = static_cast<int>(cluster.spec().node.nic_switch.size());
  std::vector<int> nic_of_rank;
  for (int r = 0; r < ranks; ++r) nic_of_rank.push_back(cluster.node_of(r) * nics + cluster.nic_of(r));
  return plan::nic_pools(nic_of_rank);
}

Status simulate(SimRunConfig cfg, SimRunResult* out) {
  const auto wall0 = std::chrono::steady_clock::now();
  if (Status s = resolve(&cfg); !s) return s;
  const int R = cfg.ranks;
  const int64_t per_rank = cfg.batch / R;
  Load load;
  if (Status s = Load::make(cfg.load, cfg.model, R, per_rank * cfg.model.seq_len, &load); !s) return s;
  const Cluster cluster(cfg.cluster);
  StrategySetup setup;
  setup.model = cfg.model;
  setup.ranks = R;
  setup.ep_size = cfg.ep_size;
  setup.batch_per_rank = per_rank;
  setup.allreduce_micro_bytes = cfg.allreduce_micro_bytes;
  setup.placement = cfg.placement;
  for (int r = 0; r < R; ++r) setup.node_of_rank.push_back(cluster.node_of(r));  // rank r on device r
  setup.device = cluster.device();
  setup.bandwidth = placement_bandwidth(cluster);
  setup.overlap_bandwidth = overlap_bandwidth(cluster);
  cluster_links(cluster, &setup.intra_node, &setup.inter_node);
  setup.cpu_ranks = cfg.cluster.cpu_cores > 0;
  setup.cores = sim_core_pools(cfg.cluster, setup.node_of_rank);
  setup.nics = sim_nic_pools(cluster, R);
  std::unique_ptr<SimStrategy> strategy;
  try {
    if (Status s = sim_strategies().at(cfg.strategy).make(setup, &strategy); !s) return s;
  } catch (const std::invalid_argument& e) {
    return Status::error(e.what());
  }
  ExecutorConfig ec;
  ec.ranks = R;
  ec.ep_size = cfg.ep_size;
  ec.hierarchical_allreduce = cfg.hierarchical_allreduce;
  ec.aggregate_flows = cfg.aggregate == SimRunConfig::Aggregate::on ||
                       (cfg.aggregate == SimRunConfig::Aggregate::automatic && R > 64);
  StepExecutor executor(cluster, ec);

  SimRunResult res;
  res.ranks = R;
  res.ep_size = cfg.ep_size;
  res.aggregated = ec.aggregate_flows;
  res.link_bytes.assign(cluster.n_links(), 0.0);
  const int64_t E = cfg.model.n_experts, G = cfg.ep_size, El = E / G;
  std::vector<graph::StepGraph> graphs;
  for (int s = 0; s < cfg.steps; ++s) {
    const StepLoad l = load.step(s);
    strategy->step_graphs(l, &graphs);
    StepResult step;
    if (Status st = executor.run_step(graphs, &step, strategy->sparse_schedules()); !st)
      return Status::error(str_cat("step ", s + 1, ": ", st.message()));
    strategy->after_step(graphs, step.timelines);
    SimStepSummary sum;
    sum.step_ms = step.seconds() * 1e3;
    for (int r = 0; r < R; ++r) {
      const runtime::StepBreakdown b = runtime::breakdown(graphs[r], step.timelines[r]);
      sum.mean.wall_ms += b.wall_ms / R;
      sum.mean.compute_ms += b.compute_ms / R;
      sum.mean.exposed_comm_ms += b.exposed_comm_ms / R;
      sum.mean.comm_ms += b.comm_ms / R;
      sum.mean.allreduce_ms += b.allreduce_ms / R;
      sum.mean.allreduce_hidden_ms += b.allreduce_hidden_ms / R;
    }
    for (const auto& [cat, sec] : step.critical_path_s) sum.critical_path_ms.emplace_back(cat, sec * 1e3);
    // Rows each rank's experts ran: from its expert_fwd FLOPs (2 * mats * rows * C * F, exact in a
    // double), whatever the placement; EP's formula where the layer has no expert_fwd (one rank).
    const double row_flops = 2.0 * (cfg.model.activation == "swiglu" ? 3 : 2) * static_cast<double>(cfg.model.d_model) *
                             static_cast<double>(cfg.model.d_ffn);
    std::vector<int> moe_block;
    for (int64_t b = 0; b < cfg.model.n_layers; ++b)
      if (cfg.model.is_moe_layer(b)) moe_block.push_back(static_cast<int>(b));
    for (size_t i = 0; i < l.size(); ++i) {
      const std::vector<int64_t>& t = l[i];
      std::vector<int64_t> per_expert(E, 0), per_rank_rows(R, 0);
      for (int r = 0; r < R; ++r)
        for (int64_t e = 0; e < E; ++e) {
          per_expert[e] += t[r * E + e];
          // The replica of expert e in r's ep group runs on that group's rank e / El.
          per_rank_rows[r / G * G + e / El] += t[r * E + e];
        }
      // The rows each rank's experts ran: its expert_fwd ops of this layer (one per dispatch chunk).
      bool expert_parallel = false;
      for (int r = 0; r < R; ++r) {
        double flops = 0;
        for (const graph::Op& op : graphs[r].ops)
          if (op.kind == graph::OpKind::expert_fwd && op.layer == moe_block[i]) {
            flops += op.cost.flops;
            expert_parallel = true;
          }
        if (expert_parallel) per_rank_rows[r] = std::llround(flops / row_flops);
      }
      sum.tokens_per_expert.push_back(std::move(per_expert));
      sum.tokens_per_rank.push_back(std::move(per_rank_rows));
    }
    for (int r = 0; r < R; ++r) {
      sum.moe_ms_per_rank.push_back(runtime::moe_layer_ms(graphs[r], step.timelines[r]));
      sum.moe_ms += sum.moe_ms_per_rank.back() / R;
      sum.moe_ms_max = std::max(sum.moe_ms_max, sum.moe_ms_per_rank.back());
      for (const graph::Op& op : graphs[r].ops)
        if (op.collective == graph::Collective::sparse_allgather ||
            op.collective == graph::Collective::sparse_reduce_scatter)
          sum.sparse_bytes += 2 * op.cost.bytes;  // what r sends is what its peers receive
    }
    sum.placement = strategy->placement_stats();
    sum.flows = step.flows;
    sum.rates_computed = step.rates_computed;
    for (size_t k = 0; k < res.link_bytes.size(); ++k) res.link_bytes[k] += step.link_bytes[k];
    res.simulated_s += step.seconds();
    if (cfg.keep_trace)
      for (int r = 0; r < R; ++r) runtime::append_records(&res.trace, graphs[r], step.timelines[r], r, s + 1, 0);
    res.steps.push_back(std::move(sum));
  }
  if (!graphs.empty()) res.graph = std::move(graphs[0]);
  res.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
  *out = std::move(res);
  return Status::ok();
}

}  // namespace moe::sim
