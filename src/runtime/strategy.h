// The trainer's side of a strategy (strategy/strategy.h): the decisions are the strategy object's,
// the same the simulator runs; this class applies them to the model's MoE layers (placements, shard
// moves with their AdamW moments) and holds the cost model the trainer's flags give.
//
// Thread safety: before_step/observe/reshard on the training thread between steps; place() is an op
// body (compute stream, the training thread) during a step.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "graph/ep_builder.h"
#include "model/model.h"
#include "model/optimizer.h"
#include "plan/placement.h"
#include "runtime/train_config.h"
#include "strategy/strategy.h"
#include "util/status.h"

namespace moe::runtime {

class Strategy {
 public:
  // REQUIRES: cfg.validate() ok (the strategy's name is registered).
  explicit Strategy(const TrainConfig& cfg);

  const std::string& name() const { return cfg_.strategy; }
  bool uses_placements() const { return impl_->uses_placements(); }
  // The expert-parallel group size over `world` ranks (strategy::Strategy::ep_size).
  Status ep_size(int world, int* out) const { return impl_->ep_size(cfg_.model, world, out); }
  // Sets the graph options of this strategy (gathers, rematerialization); none with one process.
  void configure(graph::EpStepOptions* opt) const;
  // The step graph for opt (configured): the strategy's own with more than one rank (after attach),
  // else graph::build_ep_step.
  graph::EpStep build_step(const graph::EpStepOptions& opt) const;
  // After Model::set_expert_parallel: turns placements on in every MoE layer and sets the strategy up
  // for these ranks. nodes: node of each rank; cores: the ranks that take turns on shared CPU cores
  // (runtime::core_pools); gather: the gather lane's communicator over the ep group. The model's MoE
  // layers are kept for the calls below (REQUIRES: model outlives this object).
  void attach(Model& model, const plan::Nodes& nodes, const plan::CorePools& cores, comm::Communicator* gather);
  // The planners' cost model (runtime/measure_costs.h; until set, the one --link-gbs and
  // --gemm-gflops give). Starts the strategy afresh: REQUIRES attach() done, before the first step.
  void set_cost_model(const strategy::CostModel& cost);
  const strategy::CostModel& cost_model() const { return cost_; }
  // Between steps: the expert GEMM rate measured in the step (the same value on every rank) folded
  // into the cost model (an exponential average, weight 0.2 on the new rate), which the strategy
  // then plans with. Ignored unless finite and > 0, and when --gemm-gflops gave the rate.
  void refresh_gemm_rate(double measured_flops);
  // Between steps: links measured again (runtime::measure_links, agreed over the ranks), folded into
  // the cost model (exponential average, weight 0.5 on the new figures; a class not measured is
  // kept); the weights' and Hecate's overlap bandwidth follow the slowest class the ranks span, as
  // at start-up (the steps' own transfers then fold in again, below). Ignored when --link-gbs gave the
  // bandwidth.
  void refresh_links(const strategy::LinkCost& intra_node, const strategy::LinkCost& inter_node);
  // Between steps: the expert weights the step's sparse collectives sent and the time they took, over
  // every rank (runtime::weight_transfers; the same on every rank), folded into the weights bandwidth
  // (strategy::observe_weight_transfers). Ignored when --link-gbs gave the bandwidth.
  void refresh_weights_rate(double bytes, double seconds);

  // Before a step: each MoE layer's placement from the strategy.
  void before_step();
  // The body of place(l), after block l's gate: the strategy's placement from this step's counts.
  Status place(int64_t block);
  // After a step: every MoE layer's global tokens per expert [L][E] (the same on every rank).
  // times: the step's, averaged over ranks (Hecate's next t comes from its attention time).
  void observe(const std::vector<std::vector<int64_t>>& loads, const strategy::StepTimes& times) {
    impl_->observe(loads, times);
  }
  // Hecate: the overlap degree t of the last before_step; 0 for the others.
  int overlap_degree() const { return impl_->overlap_degree(); }
  // After the optimizer of step `done` (1-based): moves the shards the strategy re-assigns, with their
  // AdamW moments. Collective over the ranks. Returns the experts that moved.
  int reshard(AdamW& opt, int64_t done);

  // Replica slots per rank and layer (hecate's m, flexmoe's reserved slots; 0 for the others).
  int replica_slots() const { return impl_->replica_slots(); }
  bool gathers_behind_attention() const { return impl_->gathers_behind_attention(); }
  // Bytes of one expert's weights (the chunk the sparse collectives move).
  int64_t expert_bytes() const { return cost_.expert_bytes; }
  // Hecate: MoE layers whose post-gate calibration issued a second gather since the last call.
  int64_t take_calibrations() { return impl_->take_calibrations(); }

 private:
  strategy::Setup setup(const plan::Nodes& nodes) const;

  TrainConfig cfg_;
  strategy::CostModel cost_;
  std::unique_ptr<strategy::Strategy> impl_;
  plan::Nodes nodes_{{0}};
  plan::CorePools cores_;
  // From attach: the placement-enabled MoE layers in order (the strategy's layer index is the
  // position here), and each block's position (-1: none).
  std::vector<MoeLayer*> layers_;
  std::vector<int> index_of_block_;
};

}  // namespace moe::runtime
