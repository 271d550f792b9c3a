// hecate: fully sharded sparse data parallelism (Hecate). Shards as EP, one owner per expert (its
// weights and optimizer state). Before each step Alg. 1 (plan::sparse_materialize) replicates the
// experts a sliding-window predictor expects to be hot onto other ranks, within m replica slots per
// rank and layer and t experts gathered behind attention; the runtime's SparseAllGather of layer l
// runs behind attn_fwd(l) and replica gradients return by SparseReduceScatter behind attention
// backward (--rematerialize frees replicas after forward and gathers them again). After the gate the
// calibration (plan::calibrate) gathers more replicas when the actual loads differ from the
// prediction enough to pay for a second gather. Every reshard_every steps Alg. 2
// (plan::heterogeneous_sharding) re-assigns the owners of all MoE layers together.
#include <algorithm>
#include <memory>

#include "plan/hecate.h"
#include "plan/load_predictor.h"
#include "strategy/strategy.h"

namespace moe::strategy {
namespace {

class Hecate : public Strategy {
 public:
  explicit Hecate(const Setup& s)
      : s_(s),
        predictor_(moe_layer_count(s.model), static_cast<int>(s.model.n_experts), s.options.load_window),
        reshard_every_(s.options.reshard_every >= 0 ? s.options.reshard_every : 100),
        t_(std::max(0, s.options.overlap_degree)) {
    // A replica costs its weights and, in backward, their gradient buffer (plan::memory_slots counts
    // weights only, so it is given half the budget).
    if (s.options.replica_memory_bytes > 0)
      slots_ = plan::memory_slots(s.options.replica_memory_bytes / 2, s.cost.expert_bytes);
    else
      slots_ = s.options.replica_slots >= 0 ? s.options.replica_slots
                                            : static_cast<int>(s.model.n_experts / std::max(1, s.world));
  }
  const char* name() const override { return "hecate"; }
  void configure(graph::EpStepOptions* opt) const override {
    opt->gather_before_gate = true;
    opt->gather_after_gate = true;  // the calibration's second gather, when it pays
    opt->rematerialize = s_.options.rematerialize;
  }
  // Alg. 1 on the predicted loads. Where transfers take the compute's cores (CPU ranks), Alg. 1 with
  // the t' <= t whose predicted saving beats its gather by the most, priced as the calibration prices
  // its second gather (plan::cheapest_materialization, the predicted loads spread evenly over the
  // source ranks), or nothing when none pays. A deviation from the paper, whose Alg. 1 always gathers
  // the top-t experts: behind the attention the gather costs no step time on a GPU, but on CPU ranks
  // it takes the same cores; without skew (a trained router is ~1.3x uneven) it was measured to cost
  // more than it saved, and under skew the t-th expert to cost more than it saved (docs/strategies.md).
  std::optional<plan::LayerPlacement> before_step(int layer, const plan::LayerPlacement& owners) override {
    const std::vector<double> load = predictor_.predict(layer);
    if (!s_.cost.transfers_take_compute) return plan::sparse_materialize(owners, load, t_, slots_, s_.nodes);
    return plan::cheapest_materialization(owners, load, plan::even_counts(load, owners.n_ranks), 0, t_, slots_,
                                          s_.nodes, calibration_model())
        .placement;
  }
  bool after_gate(int layer, const plan::LayerPlacement& owners, const plan::LayerPlacement& in_force,
                  const std::vector<std::vector<int64_t>>& counts, plan::LayerPlacement* out) override {
    (void)layer, (void)owners;
    const plan::Calibration c = plan::calibrate(in_force, counts, t_, slots_, s_.nodes, calibration_model());
    if (!c.gather) return false;
    *out = c.placement;
    ++calibrations_;
    return true;
  }
  // t for the next step (§4.2, Eq. 1): as many experts as arrive at the inter-node bandwidth while
  // the attention computes, or the fixed --overlap-degree; 0 before any step was measured.
  void observe(const std::vector<std::vector<int64_t>>& loads, const StepTimes& times) override {
    if (!loads.empty()) predictor_.observe(loads);
    if (s_.options.overlap_degree < 0 && times.attention_seconds > 0 && s_.cost.overlap_bandwidth > 0)
      t_ = plan::overlap_degree(times.attention_seconds, s_.cost.overlap_bandwidth, s_.cost.expert_bytes);
  }
  std::vector<std::vector<int>> reshard(int64_t done, const std::vector<plan::LayerPlacement>& owners) override {
    if (reshard_every_ <= 0 || done % reshard_every_ != 0 || owners.empty()) return {};
    std::vector<std::vector<double>> loads;
    for (size_t i = 0; i < owners.size(); ++i) loads.push_back(predictor_.predict(static_cast<int>(i)));
    return plan::heterogeneous_sharding(loads, t_, s_.nodes);
  }
  void update_cost(const CostModel& c) override { s_.cost = c; }  // slots stay: a budget, not a rate
  int replica_slots() const override { return slots_; }
  int overlap_degree() const override { return t_; }
  bool gathers_behind_attention() const override { return true; }

 private:
  // The price of a gather (before the gate and at calibration alike). On CPU ranks every transfer of
  // a replica takes the compute's cores: the gather, the gradient's reduce-scatter and, with
  // rematerialization, the backward's second gather. A token a replica keeps home saves its expert
  // time on the busiest rank and, where it would have crossed between hosts (ranks, on one host), its
  // row's 4 exchanges at the network's rate.
  plan::CalibrationModel calibration_model() const {
    const int transfers = s_.cost.transfers_take_compute ? replica_transfers_per_step(s_.options.rematerialize) : 1;
    const double exchange =
        s_.cost.network_bandwidth > 0 ? row_exchange_bytes(s_.model) / s_.cost.network_bandwidth : 0;
    return {s_.cost.expert_seconds_per_token, s_.cost.bandwidth, s_.cost.expert_bytes, transfers, exchange,
            s_.cores, s_.nics};
  }

  Setup s_;
  plan::LoadPredictor predictor_;
  int reshard_every_ = 0;
  int slots_ = 0;
  int t_ = 0;  // the overlap degree of this step (Alg. 1's t)
};

}  // namespace

std::unique_ptr<Strategy> make_hecate(const Setup& s) { return std::make_unique<Hecate>(s); }

}  // namespace moe::strategy
