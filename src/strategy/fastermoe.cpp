// fastermoe: FasterMoE's dynamic shadowing. After each gate its cost model (plan::fastermoe_plan)
// picks the hottest experts to broadcast to every rank; the broadcast is on the critical path,
// between the gate and the dispatch.
#include "plan/baselines.h"
#include "strategy/strategy.h"

namespace moe::strategy {
namespace {

class FasterMoe : public Strategy {
 public:
  explicit FasterMoe(const Setup& s) {
    model_.d_model = s.model.d_model;
    model_.ffn_ratio = static_cast<double>(s.model.d_ffn) / static_cast<double>(s.model.d_model);
    model_.bytes_per_element = sizeof(float);
    model_.cores = s.cores;
    update_cost(s.cost);
  }
  void update_cost(const CostModel& c) override {
    // Tokens cross the links; the shadows' weights move at what the steps' transfers achieve.
    model_.bandwidth = c.network_bandwidth;
    model_.weights_bandwidth = c.bandwidth;
    model_.gemm_flops = c.gemm_flops;
    // On CPU ranks the shadow's broadcast and its gradients' reduce.
    model_.transfers_per_shadow = c.transfers_take_compute ? replica_transfers_per_step(false) : 1;
  }
  const char* name() const override { return "fastermoe"; }
  void configure(graph::EpStepOptions* opt) const override { opt->gather_after_gate = true; }
  bool after_gate(int layer, const plan::LayerPlacement& owners, const plan::LayerPlacement& in_force,
                  const std::vector<std::vector<int64_t>>& counts, plan::LayerPlacement* out) override {
    (void)layer, (void)in_force;
    *out = plan::fastermoe_plan(owners, counts, model_);
    return true;
  }

 private:
  plan::FasterMoeModel model_;
};

}  // namespace

std::unique_ptr<Strategy> make_fastermoe(const Setup& s) { return std::make_unique<FasterMoe>(s); }

}  // namespace moe::strategy
