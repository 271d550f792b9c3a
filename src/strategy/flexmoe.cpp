// flexmoe: FlexMoE's replicas, reconstructed (plan::flexmoe_plan): a persistent placement per layer,
// gathered before each gate, re-planned when the ranks' load balance exceeds 1.2 or every
// reshard_every steps (50 when unset), within replica_slots reserved slots (1 when unset); a replica
// that relieves no rank's maximum is dropped at any step.
// An expert's tokens are split evenly over its replicas (plan::DispatchRule::even), the split its
// balance ratio assumes.
// Deviation from FlexMoE: it keeps optimizer state in every replica and all-reduces replica
// gradients; here the owner keeps it, replica gradients are summed into it (SparseReduceScatter) and
// the updated weights gathered again before the next forward (SparseAllGather): the same bytes per
// step, split between backward and the next forward. A re-plan that drops an owner moves its shard.
#include "plan/baselines.h"
#include "plan/load_predictor.h"
#include "strategy/strategy.h"

namespace moe::strategy {
namespace {

class FlexMoe : public Strategy {
 public:
  explicit FlexMoe(const Setup& s)
      : predictor_(moe_layer_count(s.model), static_cast<int>(s.model.n_experts), s.options.load_window) {
    config_.reserved_slots = s.options.replica_slots >= 0 ? s.options.replica_slots : 1;
    config_.replan_interval = s.options.reshard_every > 0 ? s.options.reshard_every : 50;
    config_.cores = s.cores;
    update_cost(s.cost);
  }
  void update_cost(const CostModel& c) override {
    config_.expert_seconds_per_token = c.expert_seconds_per_token;
    config_.expert_state_bytes = 3 * c.expert_bytes;  // weights + Adam's two moments
    config_.bandwidth = c.bandwidth;
    // Every step a replica is gathered before the gate and its gradients reduce-scattered to the owner.
    config_.replica_step_seconds = c.transfers_take_compute ? replica_transfers_per_step(false) *
                                                                  static_cast<double>(c.expert_bytes) / c.bandwidth
                                                            : 0;
  }
  const char* name() const override { return "flexmoe"; }
  // FlexMoE splits an expert's tokens evenly over its replicas (L_e / r_e in flexmoe_plan's balance).
  plan::DispatchRule dispatch_rule() const override { return plan::DispatchRule::even; }
  void configure(graph::EpStepOptions* opt) const override { opt->gather_before_gate = true; }
  // The persistent placement, first the owners' own.
  std::optional<plan::LayerPlacement> before_step(int layer, const plan::LayerPlacement& owners) override {
    while (static_cast<int>(placement_.size()) <= layer) {
      placement_.push_back(owners);
      since_.push_back(0);
    }
    return placement_[layer];
  }
  void observe(const std::vector<std::vector<int64_t>>& loads, const StepTimes& times) override {
    (void)times;
    if (!loads.empty()) predictor_.observe(loads);
  }
  // Every step: each layer re-plans when its balance or its interval says so.
  std::vector<std::vector<int>> reshard(int64_t done, const std::vector<plan::LayerPlacement>& owners) override {
    (void)done;
    std::vector<std::vector<int>> next;
    for (const plan::LayerPlacement& o : owners) next.push_back(o.owner);
    for (size_t i = 0; i < owners.size() && i < placement_.size(); ++i) {
      ++since_[i];
      const plan::FlexMoePlan p = plan::flexmoe_plan(placement_[i], predictor_.predict(static_cast<int>(i)), since_[i], config_);
      if (!p.replanned && p.moves.empty()) continue;
      if (p.replanned) since_[i] = 0;
      placement_[i] = p.placement;
      next[i] = p.placement.owner;
    }
    return next;
  }
  int replica_slots() const override { return config_.reserved_slots; }

 private:
  plan::LoadPredictor predictor_;
  plan::FlexMoeConfig config_;
  std::vector<plan::LayerPlacement> placement_;  // per MoE layer
  std::vector<int> since_;                       // steps since each layer's last re-plan
};

}  // namespace

std::unique_ptr<Strategy> make_flexmoe(const Setup& s) { return std::make_unique<FlexMoe>(s); }

}  // namespace moe::strategy
