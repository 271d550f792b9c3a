// smartmoe: SmartMoE's expert swaps. No replicas; every reshard_every steps its greedy
// (plan::smartmoe_plan) re-assigns each layer's experts from the loads averaged over those steps,
// adopted only when the busiest rank's load drops by more than the swap costs to move (priced from the
// measured cost model, as FlexMoE's moves are). The shards move with their optimizer state.
#include <algorithm>

#include "plan/baselines.h"
#include "plan/load_predictor.h"
#include "strategy/strategy.h"

namespace moe::strategy {
namespace {

// The share of a rank's tokens that reach it over the slowest link class the ranks span
// (plan::slowest_link_groups; network_bandwidth is that class's rate), tokens coming evenly from every
// rank: the (source, destination) pairs in different groups. Without a node per rank, as on one node.
double slow_link_share(const plan::Nodes& nodes, int world) {
  if (static_cast<int>(nodes.node_of_rank.size()) != world) return (world - 1.0) / world;
  const std::vector<int> group = plan::slowest_link_groups(nodes);
  std::vector<int64_t> ranks_of(*std::max_element(group.begin(), group.end()) + 1, 0);
  for (int g : group) ++ranks_of[g];
  int64_t same = 0;  // pairs within a group, counted exactly
  for (int64_t r : ranks_of) same += r * r;
  const int64_t pairs = static_cast<int64_t>(world) * world;
  return static_cast<double>(pairs - same) / static_cast<double>(pairs);
}

class SmartMoe : public Strategy {
 public:
  // The loads averaged since the last update: a predictor window of reshard_every steps.
  explicit SmartMoe(const Setup& s)
      : reshard_every_(s.options.reshard_every >= 0 ? s.options.reshard_every : 100),
        predictor_(moe_layer_count(s.model), static_cast<int>(s.model.n_experts), std::max(1, reshard_every_)),
        exchange_bytes_(row_exchange_bytes(s.model) * slow_link_share(s.nodes, std::max(1, s.world))) {
    config_.interval = std::max(1, reshard_every_);
    config_.cores = s.cores;
    config_.nics = s.nics;
    update_cost(s.cost);
  }
  // A token routed to a rank costs it the expert's compute and its 4 exchanges (dispatch and combine,
  // forward and backward) where it crosses the slowest link: the swap's saving is in both, and where the
  // step waits on the all-to-all (every GPU preset) mostly in the second.
  void update_cost(const CostModel& c) override {
    config_.expert_seconds_per_token = c.expert_seconds_per_token;
    config_.exchange_seconds_per_token = c.network_bandwidth > 0 ? exchange_bytes_ / c.network_bandwidth : 0;
    config_.expert_state_bytes = 3 * c.expert_bytes;  // weights + Adam's two moments
    config_.bandwidth = c.bandwidth;
  }
  const char* name() const override { return "smartmoe"; }
  void observe(const std::vector<std::vector<int64_t>>& loads, const StepTimes& times) override {
    (void)times;
    if (!loads.empty()) predictor_.observe(loads);
  }
  std::vector<std::vector<int>> reshard(int64_t done, const std::vector<plan::LayerPlacement>& owners) override {
    if (reshard_every_ <= 0 || done % reshard_every_ != 0 || owners.empty()) return {};
    std::vector<std::vector<int>> next;
    for (size_t i = 0; i < owners.size(); ++i)
      next.push_back(plan::smartmoe_plan(owners[i].owner, owners[i].n_ranks, predictor_.predict(static_cast<int>(i)),
                                         reshard_every_, config_)
                         .owner);
    return next;
  }

 private:
  int reshard_every_ = 0;
  plan::LoadPredictor predictor_;
  double exchange_bytes_ = 0;  // a routed token's row bytes over the slowest link, on average
  plan::SmartMoeConfig config_;
};

}  // namespace

std::unique_ptr<Strategy> make_smartmoe(const Setup& s) { return std::make_unique<SmartMoe>(s); }

}  // namespace moe::strategy
