// smartmoe: SmartMoE's expert swaps. No replicas; every reshard_every steps its greedy
// (plan::smartmoe_plan) re-assigns each layer's experts from the loads averaged over those steps,
// adopted only when the busiest rank's load drops. The shards move with their optimizer state.
#include <algorithm>

#include "plan/baselines.h"
#include "plan/load_predictor.h"
#include "strategy/strategy.h"

namespace moe::strategy {
namespace {

class SmartMoe : public Strategy {
 public:
  // The loads averaged since the last update: a predictor window of reshard_every steps.
  explicit SmartMoe(const Setup& s)
      : reshard_every_(s.options.reshard_every >= 0 ? s.options.reshard_every : 100),
        predictor_(moe_layer_count(s.model), static_cast<int>(s.model.n_experts), std::max(1, reshard_every_)) {}
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
                                         reshard_every_, plan::SmartMoeConfig{reshard_every_})
                         .owner);
    return next;
  }

 private:
  int reshard_every_ = 0;
  plan::LoadPredictor predictor_;
};

}  // namespace

std::unique_ptr<Strategy> make_smartmoe(const Setup& s) { return std::make_unique<SmartMoe>(s); }

}  // namespace moe::strategy
