// The trainer's side of a strategy: see strategy.h.
#include "runtime/strategy.h"

#include <cmath>
#include <optional>
#include <stdexcept>

#include "runtime/measure_costs.h"

namespace moe::runtime {

Strategy::Strategy(const TrainConfig& cfg)
    // Until set_cost_model: the flags, else placeholders (ep_size and configure do not use them).
    : cfg_(cfg),
      cost_(strategy::make_cost_model(cfg.model, cfg.link_gbs > 0 ? cfg.link_gbs * 1e9 : 1e9,
                                      cfg.gemm_gflops > 0 ? cfg.gemm_gflops * 1e9 : 1e11)) {
  // One rank until attach() says otherwise (ep_size and configure do not depend on the ranks).
  if (Status s = strategy::make(cfg_.strategy, setup(plan::Nodes{{0}}), &impl_); !s)
    throw std::logic_error("runtime::Strategy: " + s.message());
}

strategy::Setup Strategy::setup(const plan::Nodes& nodes) const {
  strategy::Setup s;
  s.model = cfg_.model;
  s.world = static_cast<int>(nodes.node_of_rank.size());
  s.nodes = nodes;
  s.cores = cores_;
  // One NIC a host: the emulated cluster's, and what the runtime can see (a node with a NIC per GPU
  // would need its NIC map).
  if (nodes.n_nodes() > 1) s.nics = plan::nic_pools(nodes.node_of_rank);
  s.options.rematerialize = cfg_.rematerialize;
  s.options.replica_slots = static_cast<int>(cfg_.replica_slots);
  s.options.replica_memory_bytes = static_cast<int64_t>(cfg_.replica_memory_mb * (1 << 20));
  s.options.load_window = static_cast<int>(cfg_.load_window);
  s.options.reshard_every = static_cast<int>(cfg_.reshard_every);
  s.options.overlap_degree = static_cast<int>(cfg_.overlap_degree);
  s.cost = cost_;
  return s;
}

void Strategy::configure(graph::EpStepOptions* opt) const {
  if (opt->world == 1) return;  // one process: nothing to place
  impl_->configure(opt);
}

graph::EpStep Strategy::build_step(const graph::EpStepOptions& opt) const {
  if (opt.world == 1 || !impl_) return graph::build_ep_step(cfg_.model, opt);
  return impl_->build_step(cfg_.model, opt);
}

void Strategy::attach(Model& model, const plan::Nodes& nodes, const plan::CorePools& cores,
                      comm::Communicator* gather) {
  nodes_ = nodes;
  cores_ = cores;
  if (Status s = strategy::make(cfg_.strategy, setup(nodes), &impl_); !s)
    throw std::logic_error("runtime::Strategy: " + s.message());
  if (uses_placements() && nodes.node_of_rank.size() > 1) model.enable_placements(nodes, gather);
  layers_.clear();
  index_of_block_.assign(model.n_blocks(), -1);
  for (int64_t l = 0; l < model.n_blocks(); ++l)
    if (MoeLayer* m = model.moe_layer(l); m && m->placements_enabled()) {
      index_of_block_[l] = static_cast<int>(layers_.size());
      layers_.push_back(m);
      m->set_dispatch_rule(impl_->dispatch_rule());
    }
}

void Strategy::set_cost_model(const strategy::CostModel& cost) {
  cost_ = cost;
  if (Status s = strategy::make(cfg_.strategy, setup(nodes_), &impl_); !s)
    throw std::logic_error("runtime::Strategy: " + s.message());
}

void Strategy::refresh_gemm_rate(double measured_flops) {
  // --gemm-gflops is an override: a rate given is kept.
  if (cfg_.gemm_gflops > 0 || !(measured_flops > 0) || !std::isfinite(measured_flops)) return;
  strategy::set_gemm_rate(&cost_, cfg_.model, 0.8 * cost_.gemm_flops + 0.2 * measured_flops);
  impl_->update_cost(cost_);
}

void Strategy::refresh_links(const strategy::LinkCost& intra_node, const strategy::LinkCost& inter_node) {
  if (cfg_.link_gbs > 0) return;
  auto fold = [](strategy::LinkCost* now, const strategy::LinkCost& measured) {
    if (!(measured.bandwidth > 0) || !std::isfinite(measured.bandwidth) || !std::isfinite(measured.latency)) return;
    if (!(now->bandwidth > 0)) {
      *now = measured;
      return;
    }
    now->bandwidth = 0.5 * now->bandwidth + 0.5 * measured.bandwidth;
    now->latency = 0.5 * now->latency + 0.5 * measured.latency;
  };
  RawCosts folded{cost_.intra_node, cost_.inter_node, cost_.gemm_flops};
  fold(&folded.intra_node, intra_node);
  fold(&folded.inter_node, inter_node);
  // The rest follows by start-up's rule (the GEMM rate as it is now).
  cost_ = cost_model_from(cfg_.model, folded, nodes_, 0, 0);
  impl_->update_cost(cost_);
}

void Strategy::refresh_weights_rate(double bytes, double seconds) {
  if (cfg_.link_gbs > 0) return;
  if (strategy::observe_weight_transfers(&cost_, bytes, seconds)) impl_->update_cost(cost_);
}

void Strategy::before_step() {
  for (size_t i = 0; i < layers_.size(); ++i)
    if (std::optional<plan::LayerPlacement> p = impl_->before_step(static_cast<int>(i), layers_[i]->owners()))
      layers_[i]->set_placement(*p);
}

Status Strategy::place(int64_t block) {
  if (block < 0 || block >= static_cast<int64_t>(index_of_block_.size()) || index_of_block_[block] < 0)
    return Status::ok();
  const int i = index_of_block_[block];
  MoeLayer* moe = layers_[i];
  plan::LayerPlacement placed;
  if (impl_->after_gate(i, moe->owners(), moe->placement(), moe->routed_counts(), &placed))
    moe->set_placement(std::move(placed));
  return Status::ok();
}

int Strategy::reshard(AdamW& opt, int64_t done) {
  if (layers_.empty()) return 0;
  std::vector<plan::LayerPlacement> owners;
  for (MoeLayer* m : layers_) owners.push_back(m->owners());
  const std::vector<std::vector<int>> next = impl_->reshard(done, owners);
  int moved = 0;
  for (size_t i = 0; i < next.size() && i < layers_.size(); ++i) {
    MoeLayer& moe = *layers_[i];
    if (next[i] == moe.owners().owner) continue;  // applied only when shards change
    std::vector<std::pair<Tensor*, Tensor*>> moments;
    for (Param* p : moe.expert_params())
      for (size_t k = 0; k < opt.params().size(); ++k)
        if (opt.params()[k] == p) moments.push_back({&opt.m(k), &opt.v(k)});
    moved += moe.reshard(next[i], moments);
  }
  return moved;
}

}  // namespace moe::runtime
