// What each op of an expert-parallel StepGraph (graph/ep_builder.h) does on this rank: the bridge
// between the graph (data) and the Model's phases and the communicators. The Executor decides when
// an op runs; this decides what it does.
#pragma once

#include <functional>
#include <vector>

#include "comm/communicator.h"
#include "graph/ep_builder.h"
#include "model/model.h"
#include "util/status.h"

namespace moe::runtime {

// Communicators of the lanes. The all-to-all lane uses the MoE layers' own groups (set by
// Model::set_expert_parallel); the allreduce lane sums over `grad_world` (a communicator no other
// thread uses during a step, e.g. a dup of the world) and `grad_dp` (expert replicas; null or one rank
// when every expert has a single copy). Both null for one process.
struct GradComms {
  comm::Communicator* grad_world = nullptr;
  comm::Communicator* grad_dp = nullptr;
};

// What the placement ops need from the strategy (graph/ep_builder.h, "placement strategies").
struct PlacementHooks {
  // The body of place(l): may call MoeLayer::set_placement on block l's layer from its routed_counts().
  std::function<Status(int64_t layer)> place;
  // Replicas are freed after expert_fwd(l) and after replica_grad_reduce(l) (else kept for reuse).
  bool rematerialize = false;
};

class EpStepBodies {
 public:
  // REQUIRES: step was built for model's config, and every bucket's parameters exist in model; the
  // model, step and communicators outlive this object.
  EpStepBodies(Model& model, const graph::EpStep& step, GradComms comms, PlacementHooks hooks = {});

  // Runs op (an OpBody for Executor::run). Communication failures come back as the communicator's
  // Status (naming the rank); the MoE layer's exchanges throw, which the Executor turns into a Status.
  Status run(graph::Op& op);

 private:
  struct Bucket {
    std::vector<Param*> params;
    int64_t elements = 0;
    comm::Communicator* over = nullptr;
  };
  Status allreduce(const graph::Op& op);

  Model& model_;
  const graph::EpStep& step_;
  // Per block, the step's token exchange of its MoE layer: planned by dispatch_fwd, read by the
  // layer's later ops (the state the graph's edges carry; empty for other blocks).
  std::vector<TokenExchange> exchanges_;
  GradComms comms_;
  PlacementHooks hooks_;
  std::vector<Bucket> buckets_;  // same order as step_.buckets
};

}  // namespace moe::runtime
