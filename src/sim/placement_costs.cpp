// The placement strategies' plans and run-time sizes in the simulator (placement_costs.h).
#include "sim/placement_costs.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "plan/hecate.h"
#include "sim/compute.h"
#include "strategy/strategy.h"
#include "util/str_cat.h"

namespace moe::sim {

namespace {

using graph::OpKind;

int weight_mats(const ModelConfig& cfg) { return cfg.activation == "swiglu" ? 3 : 2; }

// The placement of W*E chunks where chunk w*E + e is held like expert e (moe/moe_layer_replicas.cpp).
comm::Placement chunk_placement(const std::vector<std::vector<int>>& replicas, int W) {
  comm::Placement p;
  p.reserve(replicas.size() * W);
  for (int w = 0; w < W; ++w) p.insert(p.end(), replicas.begin(), replicas.end());
  return p;
}

std::vector<int> moe_index_of_blocks(const ModelConfig& cfg) {
  std::vector<int> idx(cfg.n_layers, -1);
  int n = 0;
  for (int64_t b = 0; b < cfg.n_layers; ++b)
    if (cfg.is_moe_layer(b)) idx[b] = n++;
  return idx;
}

const comm::SparsePlan* plan_of(const LayerStepPlacement& l, OpKind kind) {
  switch (kind) {
    case OpKind::materialize: return &l.gather;
    case OpKind::materialize_placed: return &l.gather_placed;
    case OpKind::rematerialize: return &l.regather;
    case OpKind::replica_grad_reduce: return &l.reduce;
    default: return nullptr;
  }
}

// Owners without replicas: shard e lives on owner[e] alone.
plan::LayerPlacement owned_only(const std::vector<int>& owner, int n_ranks) {
  plan::LayerPlacement p;
  p.n_ranks = n_ranks;
  p.owner = owner;
  for (int o : owner) p.replicas.push_back({o});
  return p;
}

// A placement strategy in the simulator: the decisions are the strategy object's (strategy/strategy.h,
// the same the trainer runs), fed the simulated loads; this class keeps what the model's MoE layers
// keep in the runtime (each layer's owners) and turns each step's placements into the graphs' sizes.
// Owners change between steps (re-sharding); the traffic that moves them happens between the
// runtime's steps, outside the StepGraph, so it is counted (PlacementStats::experts_moved) but not
// timed.
class PlacementStrategy : public SimStrategy {
 public:
  // step: the strategy's build_step(s.model, opt); attn_s: the mean attn_fwd time (what observe tells the strategy).
  // cost: the cost model impl was made with.
  PlacementStrategy(std::unique_ptr<strategy::Strategy> impl, const strategy::CostModel& cost, const StrategySetup& s,
                    const graph::EpStepOptions& opt, graph::EpStep step, double attn_s)
      : impl_(std::move(impl)), cost_(cost), setup_(s), opt_(opt), step_(std::move(step)), attn_s_(attn_s) {
    nodes_.node_of_rank = s.node_of_rank;
    owners_.assign(strategy::moe_layer_count(s.model),
                   plan::even_placement(static_cast<int>(s.model.n_experts), s.ranks));
  }

  void step_graphs(const StepLoad& load, std::vector<graph::StepGraph>* out) override {
    const ModelConfig& m = setup_.model;
    const int R = setup_.ranks, E = static_cast<int>(m.n_experts);
    std::vector<LayerStepPlacement> layers;
    std::vector<std::vector<int64_t>> global(load.size(), std::vector<int64_t>(E, 0));
    stats_ = PlacementStats{};
    stats_.weights_gbs = cost_.bandwidth / 1e9;
    for (size_t i = 0; i < load.size(); ++i) {
      std::vector<std::vector<int64_t>> counts(R, std::vector<int64_t>(E, 0));
      for (int r = 0; r < R; ++r)
        for (int e = 0; e < E; ++e) {
          counts[r][e] = load[i][static_cast<size_t>(r) * E + e];
          global[i][e] += counts[r][e];
        }
      const int layer = static_cast<int>(i);
      const plan::LayerPlacement& owners = owners_.at(i);
      plan::LayerPlacement planned = impl_->before_step(layer, owners).value_or(owners);
      plan::LayerPlacement placed = planned;
      impl_->after_gate(layer, owners, planned, counts, &placed);
      for (const std::vector<int>& r : placed.replicas) stats_.replicas += static_cast<int64_t>(r.size()) - 1;
      layers.push_back(layer_step_placement(m, opt_, owners, std::move(planned), std::move(placed), nodes_, counts,
                                            impl_->dispatch_rule()));
    }
    stats_.calibrations = impl_->take_calibrations();
    stats_.overlap_degree = impl_->overlap_degree();
    out->assign(R, step_.graph);
    for (int r = 0; r < R; ++r) fill_placement_costs(m, opt_, layers, r, &(*out)[r]);
    schedules_ = sim::sparse_schedules(step_.graph, m, layers);
    // After the step, as the trainer: the strategy sees the global loads, then re-shards when due.
    impl_->observe(global, strategy::StepTimes{attn_s_});
    ++steps_;
    stats_.experts_moved = reshard();
  }

  const std::vector<SparseSchedule>& sparse_schedules() const override { return schedules_; }
  PlacementStats placement_stats() const override { return stats_; }
  // As the trainer (runtime::Strategy::refresh_weights_rate): the weights bandwidth follows the
  // simulated step's sparse collectives (runtime::weight_transfers over every rank), unless link_gbs
  // gave it.
  void after_step(const std::vector<graph::StepGraph>& graphs,
                  const std::vector<runtime::StepTimeline>& timelines) override {
    if (setup_.placement.link_gbs > 0) return;
    std::vector<std::vector<runtime::SparseOpPart>> parts;
    for (size_t r = 0; r < graphs.size() && r < timelines.size(); ++r)
      parts.push_back(runtime::sparse_op_parts(graphs[r], timelines[r]));
    const runtime::WeightTransfers moved = runtime::weight_transfers(parts);
    if (strategy::observe_weight_transfers(&cost_, moved.bytes, moved.seconds)) impl_->update_cost(cost_);
  }

 private:
  // The strategy's re-sharding after `steps_` steps; returns the experts whose owner changed.
  int64_t reshard() {
    const std::vector<std::vector<int>> next = impl_->reshard(steps_, owners_);
    int64_t moved = 0;
    for (size_t i = 0; i < next.size() && i < owners_.size(); ++i) {
      if (next[i] == owners_[i].owner) continue;
      moved += static_cast<int64_t>(plan::owner_moves(owners_[i].owner, next[i]).size());
      owners_[i] = owned_only(next[i], setup_.ranks);
    }
    return moved;
  }

  std::unique_ptr<strategy::Strategy> impl_;
  strategy::CostModel cost_;
  StrategySetup setup_;
  graph::EpStepOptions opt_;
  graph::EpStep step_;
  plan::Nodes nodes_;
  std::vector<plan::LayerPlacement> owners_;  // per MoE layer: the shards' owners now
  double attn_s_ = 0;
  int64_t steps_ = 0;
  std::vector<SparseSchedule> schedules_;
  PlacementStats stats_;
};

}  // namespace

LayerStepPlacement layer_step_placement(const ModelConfig& cfg, const graph::EpStepOptions& opt,
                                        plan::LayerPlacement owners_now, plan::LayerPlacement planned,
                                        plan::LayerPlacement placed, const plan::Nodes& nodes,
                                        const std::vector<std::vector<int64_t>>& counts, plan::DispatchRule rule) {
  const int W = weight_mats(cfg), R = opt.world;
  LayerStepPlacement l;
  l.owners = std::move(owners_now);
  l.planned = std::move(planned);
  l.placed = std::move(placed);
  l.rows = plan::dispatch_plan(l.placed, nodes, counts, rule);
  l.chunk_bytes = cfg.d_ffn * cfg.d_model * static_cast<int64_t>(sizeof(float));
  const comm::Placement owners = chunk_placement(l.owners.replicas, W);
  const comm::Placement planned_c = chunk_placement(l.planned.replicas, W);
  const comm::Placement placed_c = chunk_placement(l.placed.replicas, W);
  const std::vector<int>& node_of = nodes.node_of_rank;  // topology-aware, as the runtime's MoeLayer plans
  l.gather = comm::plan_sparse_allgather(owners, planned_c, R, node_of);
  l.gather_placed = comm::plan_sparse_allgather(opt.gather_before_gate ? planned_c : owners, placed_c, R, node_of);
  l.regather = comm::plan_sparse_allgather(owners, placed_c, R, node_of);
  l.reduce = comm::plan_sparse_reduce_scatter(placed_c, owners, R, node_of);
  return l;
}

void fill_placement_costs(const ModelConfig& cfg, const graph::EpStepOptions& opt,
                          const std::vector<LayerStepPlacement>& layers, int rank, graph::StepGraph* g) {
  const int R = opt.world;
  if (opt.ep_size != R) throw std::logic_error("sim::fill_placement_costs: REQUIRES one ep group of every rank");
  if (rank < 0 || rank >= R) throw std::logic_error("sim::fill_placement_costs: rank out of range");
  const std::vector<int> moe_index = moe_index_of_blocks(cfg);
  const int n_moe = static_cast<int>(std::count_if(moe_index.begin(), moe_index.end(), [](int i) { return i >= 0; }));
  if (static_cast<int>(layers.size()) != n_moe)
    throw std::logic_error(str_cat("sim::fill_placement_costs: ", layers.size(), " layers, the model has ", n_moe));
  for (const LayerStepPlacement& l : layers)
    if (static_cast<int>(l.rows.size()) != R || l.gather.num_ranks != R)
      throw std::logic_error("sim::fill_placement_costs: a layer's placement is not over the ranks of opt");
  const int64_t E = cfg.n_experts, C = cfg.d_model, F = cfg.d_ffn, K = cfg.top_k;
  const double NK = static_cast<double>(opt.batch * cfg.seq_len * K);
  const double mats = weight_mats(cfg);
  constexpr int64_t kFloat = sizeof(float);
  for (graph::Op& op : g->ops) {
    if (op.layer < 0 || moe_index[op.layer] < 0 || R == 1) continue;
    const LayerStepPlacement& l = layers[moe_index[op.layer]];
    const std::vector<std::vector<int>> chunk = op_exchange_chunks(op, l.placed);
    auto in_chunk = [&](int d, int64_t e) { return chunk.empty() || chunk[d][e] == op.micro; };
    auto sent_to = [&](int d) {  // rows this rank sends to d
      int64_t n = 0;
      for (int64_t e = 0; e < E; ++e)
        if (in_chunk(d, e)) n += l.rows[rank][e][d];
      return n;
    };
    auto received_from = [&](int s) {  // rows s sends to this rank
      int64_t n = 0;
      for (int64_t e = 0; e < E; ++e)
        if (in_chunk(rank, e)) n += l.rows[s][e][rank];
      return n;
    };
    auto exchange = [&](bool to_experts) {
      op.cost.peer_bytes.assign(R, 0);
      op.cost.bytes = 0;
      for (int j = 0; j < R; ++j) {
        op.cost.peer_bytes[j] = kFloat * C * (to_experts ? sent_to(j) : received_from(j));
        op.cost.bytes += op.cost.peer_bytes[j];
      }
    };
    auto expert = [&](double passes, double balanced_bytes) {
      int64_t rows = 0;
      for (int s = 0; s < R; ++s) rows += received_from(s);
      op.cost.flops = passes * 2 * mats * static_cast<double>(rows) * static_cast<double>(C) * static_cast<double>(F);
      op.cost.bytes = static_cast<int64_t>(std::llround(balanced_bytes * static_cast<double>(rows) / NK));
    };
    auto sparse = [&](const comm::SparsePlan& p) {
      const std::vector<int64_t> all = comm::peer_bytes(p, l.chunk_bytes);
      op.cost.peer_bytes.assign(all.begin() + static_cast<size_t>(rank) * R, all.begin() + static_cast<size_t>(rank + 1) * R);
      op.cost.bytes = 0;
      for (int64_t b : op.cost.peer_bytes) op.cost.bytes += b;
      op.cost.bytes_received = comm::bytes_received(p, rank, l.chunk_bytes);
    };
    switch (op.kind) {
      case OpKind::dispatch_a2a:
      case OpKind::combine_a2a_bwd: exchange(true); break;
      case OpKind::combine_a2a:
      case OpKind::dispatch_a2a_bwd: exchange(false); break;
      // The builder's balanced estimates (ep_builder.cpp), scaled, as fill_ep_costs.
      case OpKind::expert_fwd: expert(1, 4 * NK * (4.0 * C + 3.0 * F)); break;
      case OpKind::expert_bwd: expert(2, 8 * NK * (4.0 * C + 3.0 * F)); break;
      case OpKind::gate_sync: op.cost.bytes = 8 * K * E; break;
      case OpKind::materialize:
      case OpKind::materialize_placed:
      case OpKind::rematerialize:
      case OpKind::replica_grad_reduce: sparse(*plan_of(l, op.kind)); break;
      default: break;
    }
  }
}

std::vector<SparseSchedule> sparse_schedules(const graph::StepGraph& g, const ModelConfig& cfg,
                                             const std::vector<LayerStepPlacement>& layers) {
  const std::vector<int> moe_index = moe_index_of_blocks(cfg);
  std::vector<SparseSchedule> out(g.ops.size());
  for (const graph::Op& op : g.ops) {
    if (op.layer < 0 || moe_index[op.layer] < 0) continue;
    const LayerStepPlacement& l = layers.at(moe_index[op.layer]);
    if (const comm::SparsePlan* p = plan_of(l, op.kind)) out[op.id] = SparseSchedule{*p, l.chunk_bytes};
  }
  return out;
}

double placement_bandwidth(const Cluster& cluster) {
  const ClusterSpec& s = cluster.spec();
  if (cluster.n_nodes() > 1)
    return s.node.nic_port.bandwidth * static_cast<double>(s.node.nic_switch.size()) / s.node.devices;
  double bw = std::numeric_limits<double>::infinity();
  for (int d = 1; d < cluster.devices_per_node(); ++d) bw = std::min(bw, cluster.path_bandwidth(cluster.route(0, d)));
  // One device: nothing moves; any positive figure keeps the cost models defined.
  return std::isfinite(bw) ? bw : s.node.device.mem_bandwidth;
}

double overlap_bandwidth(const Cluster& cluster) {
  const ClusterSpec& s = cluster.spec();
  if (cluster.n_nodes() > 1) return s.node.nic_port.bandwidth * static_cast<double>(s.node.nic_switch.size());
  return placement_bandwidth(cluster);
}

void cluster_links(const Cluster& cluster, strategy::LinkCost* intra_node, strategy::LinkCost* inter_node) {
  *intra_node = *inter_node = strategy::LinkCost{};
  for (int d = 1; d < cluster.devices_per_node(); ++d) {
    const std::vector<int> path = cluster.route(0, d);
    const double bw = cluster.path_bandwidth(path);
    if (intra_node->bandwidth == 0 || bw < intra_node->bandwidth) *intra_node = {cluster.path_latency(path), bw};
  }
  if (cluster.n_nodes() > 1) {
    const std::vector<int> path = cluster.route(0, cluster.devices_per_node());
    *inter_node = {cluster.path_latency(path), cluster.path_bandwidth(path)};
  }
}

Status make_placement_strategy(const std::string& name, const StrategySetup& s, std::unique_ptr<SimStrategy>* out) {
  std::unique_ptr<strategy::Strategy> probe;  // for what does not depend on the setup's cost model
  strategy::Setup probe_setup;
  probe_setup.options.rematerialize = s.placement.rematerialize;
  if (Status st = strategy::make(name, probe_setup, &probe); !st) return st;
  if (!probe->uses_placements()) return Status::error(str_cat("sim: strategy \"", name, "\" places no experts"));
  if (s.ep_size != s.ranks)
    return Status::error(str_cat("strategy ", name, ": ep-size (", s.ep_size, ") must equal the ranks (", s.ranks,
                                 "): one expert-parallel group of every rank"));
  int ep = 0;
  if (Status st = probe->ep_size(s.model, s.ranks, &ep); !st) return st;
  if (static_cast<int>(s.node_of_rank.size()) != s.ranks)
    return Status::error(str_cat("strategy ", name, ": the node of every rank is needed"));
  if (s.placement.load_window < 1) return Status::error("load window must be >= 1");
  if (s.placement.replica_slots < -1 || s.placement.overlap_degree < -1 || s.placement.reshard_every < -1)
    return Status::error("replica slots, overlap degree and reshard-every must be >= 0 (-1: default)");
  for (double gbs : {s.placement.link_gbs, s.placement.measured_link_gbs})
    if (!(gbs >= 0) || !std::isfinite(gbs)) return Status::error("link GB/s must be >= 0");
  if (!(s.bandwidth > 0) && !(s.placement.link_gbs > 0))
    return Status::error(str_cat("strategy ", name, ": no bandwidth for the planners' cost models"));

  graph::EpStepOptions opt;
  opt.world = s.ranks;
  opt.ep_size = s.ranks;
  opt.batch = s.batch_per_rank;
  opt.allreduce_micro_bytes = s.allreduce_micro_bytes;
  strategy::Setup setup;
  setup.model = s.model;
  setup.world = s.ranks;
  setup.nodes.node_of_rank = s.node_of_rank;
  setup.cores = s.cores;
  setup.nics = s.nics;
  setup.options.rematerialize = s.placement.rematerialize;
  setup.options.replica_slots = s.placement.replica_slots;
  setup.options.load_window = s.placement.load_window;
  setup.options.reshard_every = s.placement.reshard_every;
  setup.options.overlap_degree = s.placement.overlap_degree;
  probe->configure(&opt);
  // The cost model from the modeled cluster: the device's GEMM rate on the balanced expert_fwd op
  // (compute.h's efficiency curve) and the mean attn_fwd time (the trainer's t measures it).
  graph::EpStep step = probe->build_step(s.model, opt);
  double balanced_flops = 0, attn_s = 0;
  int n_attn = 0;
  for (const graph::Op& op : step.graph.ops) {
    if (op.kind == OpKind::expert_fwd) balanced_flops = op.cost.flops * op.n_micro;  // the whole layer
    if (op.kind == OpKind::attn_fwd) {
      attn_s += op_time(s.device, op.cost.flops, static_cast<double>(op.cost.bytes),
                        kind_speed(s.device, graph::op_kind_name(op.kind)));
      ++n_attn;
    }
  }
  const double gemm_rate = s.device.peak_flops * efficiency(s.device, std::max(balanced_flops, 1.0)) *
                           kind_speed(s.device, graph::op_kind_name(OpKind::expert_fwd));
  // A given figure (link_gbs, or a replayed run's measured one) stands for every bandwidth the
  // trainer's make_cost_model sets from its one measured figure.
  const double given = s.placement.link_gbs > 0 ? s.placement.link_gbs : s.placement.measured_link_gbs;
  const double bandwidth = given > 0 ? given * 1e9 : s.bandwidth;
  setup.cost = strategy::make_cost_model(s.model, bandwidth, gemm_rate);
  setup.cost.overlap_bandwidth = given > 0 ? bandwidth : s.overlap_bandwidth > 0 ? s.overlap_bandwidth : bandwidth;
  setup.cost.transfers_take_compute = s.cpu_ranks;
  setup.cost.intra_node = s.intra_node;
  setup.cost.inter_node = s.inter_node;
  std::unique_ptr<strategy::Strategy> impl;
  if (Status st = strategy::make(name, setup, &impl); !st) return st;
  *out = std::make_unique<PlacementStrategy>(std::move(impl), setup.cost, s, opt, std::move(step),
                                             n_attn ? attn_s / n_attn : 0);
  return Status::ok();
}

}  // namespace moe::sim
