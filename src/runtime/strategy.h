// Training strategies: where each MoE layer's experts live during a step (DESIGN.md: a strategy is a
// planner plus a graph builder). Every strategy computes the same mathematics (invariant 1); they
// differ in which ranks run which tokens and in what moves over the network.
//
//   ep         static expert parallelism: expert e on rank e / (E / R), tokens follow their experts.
//   hecate     FSSDP (papers/hecate-fssdp.txt): shards as EP, plus before each step Alg. 1
//              (plan::sparse_materialize) replicates the experts the sliding-window predictor expects
//              to be hot onto other ranks within replica_slots; the SparseAllGather of layer l runs
//              behind attn_fwd(l), replica gradients return by SparseReduceScatter behind attention
//              backward; --rematerialize frees replicas after forward and gathers them again.
//              After the gate, the calibration (plan::calibrate) gathers more replicas when the
//              actual loads differ from the prediction enough to pay for a second gather.
//              Every reshard_every steps Alg. 2 (plan::heterogeneous_sharding) re-assigns the owners
//              of all MoE layers together from the predicted loads; shards move with their Adam
//              moments (MoeLayer::reshard).
//   fastermoe  FasterMoE's dynamic shadowing: after each gate, its cost model picks the hottest
//              experts to broadcast to every rank (plan::fastermoe_plan), on the critical path.
//   flexmoe    FlexMoE's replicas, reconstructed (plan::flexmoe_plan): a persistent placement per
//              layer, re-planned when the ranks' load balance exceeds 1.2 or every reshard_every
//              steps, within replica_slots reserved slots. Deviation: FlexMoE keeps optimizer state in
//              every replica and all-reduces replica gradients; here the owner keeps it, replica
//              gradients are summed into it (SparseReduceScatter) and the updated weights gathered
//              again before the next forward (SparseAllGather): the same bytes per step, split
//              between backward and the next forward. A shrink that drops an owner moves its shard.
//   smartmoe   SmartMoE's expert swaps: no replicas; every reshard_every steps its greedy
//              (plan::smartmoe_plan) re-assigns each layer's experts from the loads averaged over
//              those steps, adopted only when the busiest rank's load drops.
//
// The planners are pure (src/plan); this class keeps what persists across steps (the load predictor)
// and applies plans to the model. Every rank holds the same Strategy state, fed the same all-reduced
// loads, so every rank computes the same placements (invariant 2).
// Thread safety: before_step/observe on the training thread between steps; place() is an op body
// (compute stream, the training thread) during a step.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "graph/ep_builder.h"
#include "model/model.h"
#include "model/optimizer.h"
#include "plan/load_predictor.h"
#include "plan/placement.h"
#include "runtime/train_config.h"
#include "util/status.h"

namespace moe::runtime {

class Strategy {
 public:
  // REQUIRES: cfg.validate() ok.
  explicit Strategy(const TrainConfig& cfg);

  const std::string& name() const { return cfg_.strategy; }
  bool uses_placements() const { return cfg_.strategy != "ep"; }
  // The expert-parallel group size over `world` ranks: EP the largest that divides both experts and
  // ranks (the rest are data-parallel replicas); the placement strategies one group of every rank.
  // Error (placement strategies): n_experts not a multiple of the ranks.
  Status ep_size(int world, int* out) const;
  // Sets the graph options of this strategy (gathers, rematerialization).
  void configure(graph::EpStepOptions* opt) const;
  // After Model::set_expert_parallel: turns placements on in every MoE layer. nodes: node of each rank;
  // gather: the gather lane's communicator over the ep group (Model::enable_placements).
  void attach(Model& model, const plan::Nodes& nodes, comm::Communicator* gather);

  // Before a step (hecate): each MoE layer's placement from the predicted loads. overlap_degree: the
  // t of Alg. 1 (the same on every rank).
  void before_step(Model& model, int overlap_degree);
  // The body of place(l) (fastermoe): the placement from this step's routed counts.
  Status place(Model& model, int64_t layer);
  // After a step: every MoE layer's global tokens per expert [L][E] (the same on every rank).
  void observe(const std::vector<std::vector<int64_t>>& loads);
  // After the optimizer of step `done` (1-based): re-shards when due (hecate, smartmoe), moving
  // shards with their AdamW moments. Collective over the ranks. Returns the experts that moved.
  int reshard(Model& model, AdamW& opt, int64_t done);

  // Replica slots m per rank and layer (hecate).
  int replica_slots(int64_t n_experts, int world) const;
  // Bytes of one expert's weights (the chunk the sparse collectives move).
  int64_t expert_bytes() const;
  // The cost models' seconds for one token through one expert, forward and backward.
  double expert_seconds_per_token() const;

 private:
  int reshard_layer(MoeLayer& moe, AdamW& opt, const std::vector<int>& owner);
  int flexmoe_replan(Model& model, AdamW& opt);

  TrainConfig cfg_;
  std::unique_ptr<plan::LoadPredictor> predictor_;
  plan::Nodes nodes_;
  int overlap_degree_ = 0;     // hecate: the t of this step
  std::vector<plan::LayerPlacement> flex_placement_;  // flexmoe: the persistent placement per MoE layer
  std::vector<int> flex_since_;                       // flexmoe: steps since each layer's last re-plan
  int64_t calibrations_ = 0;   // hecate: layers whose calibration gathered, since take_calibrations()
 public:
  // Hecate: MoE layers whose post-gate calibration issued a second gather since the last call.
  int64_t take_calibrations() {
    const int64_t n = calibrations_;
    calibrations_ = 0;
    return n;
  }
};

}  // namespace moe::runtime
