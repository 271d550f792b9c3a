// The placement strategies' plans and run-time sizes in the simulator (placement_costs.h).
#include "sim/placement_costs.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "plan/baselines.h"
#include "plan/hecate.h"
#include "plan/load_predictor.h"
#include "sim/compute.h"
#include "util/str_cat.h"

namespace moe::sim {

namespace {

using graph::OpKind;

int weight_mats(const ModelConfig& cfg) { return cfg.activation == "swiglu" ? 3 : 2; }

// The placement of W*E chunks where chunk w*E + e is held like expert e (moe_layer_placed.cpp).
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

// The placement strategies over one graph shape, each deciding as runtime::Strategy does
// (runtime/strategy.cpp), from the same planners:
//   hecate     before the step Alg. 1 from the predicted loads, after the gate the calibration; every
//              reshard_every steps Alg. 2 re-shards the owners;
//   fastermoe  after the gate plan::fastermoe_plan;
//   smartmoe   no replicas; every reshard_every steps plan::smartmoe_plan over the loads averaged
//              since (a predictor window of reshard_every steps);
//   flexmoe    persistent replicas gathered before the gate; after every step plan::flexmoe_plan
//              (reserved slots: replica_slots, default 1; replan interval: reshard_every, default 50).
// Owners change between steps (re-sharding); the traffic that moves them happens between the
// runtime's steps, outside the StepGraph, so it is counted (PlacementStats::experts_moved) but not
// timed.
class PlacementStrategy : public SimStrategy {
 public:
  PlacementStrategy(std::string name, const StrategySetup& s) : name_(std::move(name)), setup_(s) {
    const ModelConfig& m = s.model;
    opt_.world = s.ranks;
    opt_.ep_size = s.ranks;
    opt_.batch = s.batch_per_rank;
    opt_.allreduce_micro_bytes = s.allreduce_micro_bytes;
    // As runtime::Strategy::configure.
    opt_.gather_before_gate = name_ == "hecate" || name_ == "flexmoe";
    opt_.rematerialize = name_ == "hecate" && s.placement.rematerialize;
    opt_.gather_after_gate = name_ == "hecate" || name_ == "fastermoe";
    step_ = graph::build_ep_step(m, opt_);
    nodes_.node_of_rank = s.node_of_rank;
    for (int64_t b = 0; b < m.n_layers; ++b) moe_layers_ += m.is_moe_layer(b) ? 1 : 0;
    const int E = static_cast<int>(m.n_experts);
    owners_.assign(std::max(1, moe_layers_), plan::even_placement(E, s.ranks));
    flex_placement_ = owners_;
    flex_since_.assign(owners_.size(), 0);
    reshard_every_ = s.placement.reshard_every >= 0 ? s.placement.reshard_every : (name_ == "flexmoe" ? 50 : 100);
    if (name_ != "fastermoe") {
      // SmartMoE averages the loads since its last update: a window of reshard_every steps.
      const int window = name_ == "smartmoe" ? std::max(1, reshard_every_) : s.placement.load_window;
      predictor_ = std::make_unique<plan::LoadPredictor>(std::max(1, moe_layers_), E, window);
    }
    const double mats = weight_mats(m);
    expert_bytes_ = static_cast<int64_t>(mats) * m.d_model * m.d_ffn * static_cast<int64_t>(sizeof(float));
    // The GEMM rate the cost models assume: the device's on the balanced expert_fwd op.
    double balanced_flops = 0, attn_s = 0;
    int n_attn = 0;
    for (const graph::Op& op : step_.graph.ops) {
      if (op.kind == OpKind::expert_fwd) balanced_flops = op.cost.flops;
      if (op.kind == OpKind::attn_fwd) {
        attn_s += op_time(s.device, op.cost.flops, static_cast<double>(op.cost.bytes),
                          kind_speed(s.device, graph::op_kind_name(op.kind)));
        ++n_attn;
      }
    }
    gemm_rate_ = s.device.peak_flops * efficiency(s.device, std::max(balanced_flops, 1.0)) *
                 kind_speed(s.device, graph::op_kind_name(OpKind::expert_fwd));
    // One token through one expert, forward and backward (3 GEMM passes): Strategy::expert_seconds_per_token.
    expert_seconds_per_token_ = 3 * 2 * mats * static_cast<double>(m.d_model * m.d_ffn) / gemm_rate_;
    // The trainer's t: the mean attn_fwd op time (the compute model gives every rank the same).
    attn_s_ = n_attn ? attn_s / n_attn : 0;
    bandwidth_ = s.placement.link_gbs > 0 ? s.placement.link_gbs * 1e9 : s.bandwidth;
    slots_ = s.placement.replica_slots >= 0 ? s.placement.replica_slots : static_cast<int>(m.n_experts / s.ranks);
  }

  void step_graphs(const StepLoad& load, std::vector<graph::StepGraph>* out) override {
    const ModelConfig& m = setup_.model;
    const int R = setup_.ranks, E = static_cast<int>(m.n_experts);
    // t of this step: fixed, or as the trainer: 0 before any step was measured, then from attention.
    int t = setup_.placement.overlap_degree;
    if (t < 0) t = steps_ == 0 ? 0 : plan::overlap_degree(attn_s_, bandwidth_, expert_bytes_);
    std::vector<LayerStepPlacement> layers;
    std::vector<std::vector<int64_t>> global(load.size(), std::vector<int64_t>(E, 0));
    stats_ = PlacementStats{};
    stats_.overlap_degree = name_ == "hecate" ? t : 0;
    for (size_t i = 0; i < load.size(); ++i) {
      std::vector<std::vector<int64_t>> counts(R, std::vector<int64_t>(E, 0));
      for (int r = 0; r < R; ++r)
        for (int e = 0; e < E; ++e) {
          counts[r][e] = load[i][static_cast<size_t>(r) * E + e];
          global[i][e] += counts[r][e];
        }
      const plan::LayerPlacement& owners = owners_.at(i);
      plan::LayerPlacement planned = owners, placed = owners;
      if (name_ == "hecate") {
        planned = plan::sparse_materialize(owners, predictor_->predict(static_cast<int>(i)), t, slots_, nodes_);
        const plan::CalibrationModel cm{expert_seconds_per_token_, bandwidth_, expert_bytes_};
        const plan::Calibration c = plan::calibrate(planned, counts, t, slots_, nodes_, cm);
        placed = c.gather ? c.placement : planned;
        stats_.calibrations += c.gather ? 1 : 0;
      } else if (name_ == "fastermoe") {
        plan::FasterMoeModel fm;
        fm.d_model = m.d_model;
        fm.ffn_ratio = static_cast<double>(m.d_ffn) / static_cast<double>(m.d_model);
        fm.bytes_per_element = sizeof(float);
        fm.bandwidth = bandwidth_;
        fm.gemm_flops = gemm_rate_;
        placed = plan::fastermoe_plan(owners, counts, fm);
      } else if (name_ == "flexmoe") {
        planned = placed = flex_placement_.at(i);
      }
      for (const std::vector<int>& r : placed.replicas) stats_.replicas += static_cast<int64_t>(r.size()) - 1;
      layers.push_back(layer_step_placement(m, opt_, owners, std::move(planned), std::move(placed), nodes_, counts));
    }
    out->assign(R, step_.graph);
    for (int r = 0; r < R; ++r) fill_placement_costs(m, opt_, layers, r, &(*out)[r]);
    schedules_ = sim::sparse_schedules(step_.graph, m, layers);
    // After the step, as the trainer: the predictor sees the global loads, then re-sharding when due.
    if (predictor_) predictor_->observe(global);
    ++steps_;
    stats_.experts_moved = reshard(t);
  }

  const std::vector<SparseSchedule>& sparse_schedules() const override { return schedules_; }
  PlacementStats placement_stats() const override { return stats_; }

 private:
  // runtime::Strategy::reshard after `steps_` steps; returns the experts whose owner changed.
  int64_t reshard(int t) {
    const int R = setup_.ranks;
    const int n = static_cast<int>(owners_.size());
    std::vector<std::vector<int>> next(n);
    for (int i = 0; i < n; ++i) next[i] = owners_[i].owner;
    if (name_ == "flexmoe") {
      plan::FlexMoeConfig fc;
      fc.reserved_slots = setup_.placement.replica_slots >= 0 ? setup_.placement.replica_slots : 1;
      fc.replan_interval = std::max(1, reshard_every_);
      fc.expert_seconds_per_token = expert_seconds_per_token_;
      fc.expert_state_bytes = 3 * expert_bytes_;  // weights + Adam's two moments
      fc.bandwidth = bandwidth_;
      for (int i = 0; i < n; ++i) {
        ++flex_since_[i];
        const plan::FlexMoePlan p = plan::flexmoe_plan(flex_placement_[i], predictor_->predict(i), flex_since_[i], fc);
        if (!p.replanned) continue;
        flex_since_[i] = 0;
        flex_placement_[i] = p.placement;
        next[i] = p.placement.owner;
      }
    } else if ((name_ == "hecate" || name_ == "smartmoe") && reshard_every_ > 0 && steps_ % reshard_every_ == 0) {
      std::vector<std::vector<double>> loads;
      for (int i = 0; i < n; ++i) loads.push_back(predictor_->predict(i));
      if (name_ == "hecate") {
        next = plan::heterogeneous_sharding(loads, t, nodes_);
      } else {
        for (int i = 0; i < n; ++i)
          next[i] = plan::smartmoe_plan(owners_[i].owner, R, loads[i], reshard_every_,
                                        plan::SmartMoeConfig{reshard_every_})
                        .owner;
      }
    }
    int64_t moved = 0;
    for (int i = 0; i < n; ++i) {
      if (next[i] == owners_[i].owner) continue;
      moved += static_cast<int64_t>(plan::owner_moves(owners_[i].owner, next[i]).size());
      owners_[i] = owned_only(next[i], R);
    }
    return moved;
  }

  std::string name_;
  StrategySetup setup_;
  graph::EpStepOptions opt_;
  graph::EpStep step_;
  plan::Nodes nodes_;
  int moe_layers_ = 0;
  std::unique_ptr<plan::LoadPredictor> predictor_;
  std::vector<plan::LayerPlacement> owners_;          // per MoE layer: the shards' owners now
  std::vector<plan::LayerPlacement> flex_placement_;  // flexmoe: its persistent placement per layer
  std::vector<int> flex_since_;                       // flexmoe: steps since its last re-plan
  int reshard_every_ = 0;
  int64_t expert_bytes_ = 0;
  double gemm_rate_ = 0, attn_s_ = 0, bandwidth_ = 0, expert_seconds_per_token_ = 0;
  int slots_ = 0;
  int64_t steps_ = 0;
  std::vector<SparseSchedule> schedules_;
  PlacementStats stats_;
};

}  // namespace

LayerStepPlacement layer_step_placement(const ModelConfig& cfg, const graph::EpStepOptions& opt,
                                        plan::LayerPlacement owners_now, plan::LayerPlacement planned,
                                        plan::LayerPlacement placed, const plan::Nodes& nodes,
                                        const std::vector<std::vector<int64_t>>& counts) {
  const int W = weight_mats(cfg), R = opt.world;
  LayerStepPlacement l;
  l.owners = std::move(owners_now);
  l.planned = std::move(planned);
  l.placed = std::move(placed);
  l.rows = plan::dispatch_plan(l.placed, nodes, counts);
  l.chunk_bytes = cfg.d_ffn * cfg.d_model * static_cast<int64_t>(sizeof(float));
  const comm::Placement owners = chunk_placement(l.owners.replicas, W);
  const comm::Placement planned_c = chunk_placement(l.planned.replicas, W);
  const comm::Placement placed_c = chunk_placement(l.placed.replicas, W);
  l.gather = comm::plan_sparse_allgather(owners, planned_c, R);
  l.gather_placed = comm::plan_sparse_allgather(opt.gather_before_gate ? planned_c : owners, placed_c, R);
  l.regather = comm::plan_sparse_allgather(owners, placed_c, R);
  l.reduce = comm::plan_sparse_reduce_scatter(placed_c, owners, R);
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
    auto sent_to = [&](int d) {  // rows this rank sends to d
      int64_t n = 0;
      for (int64_t e = 0; e < E; ++e) n += l.rows[rank][e][d];
      return n;
    };
    auto received_from = [&](int s) {  // rows s sends to this rank
      int64_t n = 0;
      for (int64_t e = 0; e < E; ++e) n += l.rows[s][e][rank];
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

Status make_placement_strategy(const std::string& name, const StrategySetup& s, std::unique_ptr<SimStrategy>* out) {
  if (name != "hecate" && name != "fastermoe" && name != "smartmoe" && name != "flexmoe")
    return Status::error(str_cat("sim: no placement strategy \"", name, "\""));
  if (s.ep_size != s.ranks)
    return Status::error(str_cat("strategy ", name, ": ep-size (", s.ep_size, ") must equal the ranks (", s.ranks,
                                 "): one expert-parallel group of every rank"));
  if (s.model.n_experts % s.ranks != 0)
    return Status::error(str_cat("strategy ", name, ": n_experts (", s.model.n_experts,
                                 ") must be a multiple of the ranks (", s.ranks, "): each rank owns the same number of expert shards"));
  if (static_cast<int>(s.node_of_rank.size()) != s.ranks)
    return Status::error(str_cat("strategy ", name, ": the node of every rank is needed"));
  if (s.placement.load_window < 1) return Status::error("load window must be >= 1");
  if (s.placement.replica_slots < -1 || s.placement.overlap_degree < -1 || s.placement.reshard_every < -1)
    return Status::error("replica slots, overlap degree and reshard-every must be >= 0 (-1: default)");
  if (!(s.placement.link_gbs >= 0) || !std::isfinite(s.placement.link_gbs)) return Status::error("link GB/s must be >= 0");
  if (!(s.bandwidth > 0) && !(s.placement.link_gbs > 0))
    return Status::error(str_cat("strategy ", name, ": no bandwidth for the planners' cost models"));
  *out = std::make_unique<PlacementStrategy>(name, s);
  return Status::ok();
}

}  // namespace moe::sim
