// The expert-parallel (EP) training step as a StepGraph: the baseline every strategy is measured
// against (GShard / DeepSpeed-MoE style).
//
// Placement: experts divided evenly among the ranks of an expert-parallel group of ep_size ranks
// (consecutive world ranks, comm::Groups); world / ep_size groups each hold a replica of every
// expert. The global batch is spread over all ranks.
//
// One rank's step (l = block; per MoE block with ep_size > 1 the MoE layer's phases are separate ops):
//   forward   embed_fwd, then per block: attn_fwd, gate_fwd, gate_sync [a2a lane, world],
//             dispatch_fwd, dispatch_a2a [a2a lane, ep], expert_fwd, combine_a2a [a2a], combine_fwd
//             (dense blocks, or one process: attn_fwd, ffn_fwd), then head_fwd
//   backward  head_bwd, then per block from the last: combine_bwd, combine_a2a_bwd [a2a], expert_bwd,
//             dispatch_a2a_bwd [a2a], gate_bwd, attn_bwd (or ffn_bwd, attn_bwd), then embed_bwd
//   gradients the replicated parameters of block l (attention, norms, router, dense FFN) are summed
//             over the world by grad_allreduce micro-ops on the allreduce lane, issued as soon as
//             attn_bwd(l) ends, so they run under the backward of the blocks below; expert weights
//             are summed over their replicas (dp group) after expert_bwd(l); the head's norm after
//             head_bwd; the embeddings after embed_bwd.
// Priorities: the all-to-all lane (priority 1) before the allreduce lane (priority 0): an exchange on
// the critical path overtakes gradient traffic at the next micro-op boundary (Lina's rule).
// The optimizer is not part of the graph: it runs after every op ended.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "graph/step_graph.h"
#include "model/config.h"

namespace moe::graph {

struct EpStepOptions {
  int world = 1;          // ranks
  int ep_size = 1;        // ranks per expert-parallel group; divides world and n_experts
  int64_t batch = 1;      // sequences per rank
  // Gradient allreduce is cut into micro-ops of at most this many bytes (0: one op per bucket).
  int64_t allreduce_micro_bytes = 1 << 20;
  // Placement strategies (MoeLayer::enable_placements: experts held by more ranks than their owner,
  // Hecate and FasterMoE). REQUIRES: ep_size == world when any is set. Their ops run on a lane of
  // their own (kGatherStream), so a gather never holds up the gate's sync or a token exchange queued
  // behind it; per block, in the lane's FIFO order:
  //   forward   [materialize] [materialize_placed]      (expert_fwd(l) waits for both)
  //   backward  [rematerialize] [replica_grad_reduce]   (expert_bwd(l) waits for the first)
  // With rematerialize, materialize(l) waits for the previous MoE block's expert_fwd and
  // rematerialize(l) for expert_fwd(l): the forward frees a block's replicas in its expert_fwd.
  // so a forward gather runs while attn_fwd(l) computes, and the gradient reduction and the next
  // block's re-gather while gate_bwd(l) and attn_bwd(l) compute.
  bool gather_before_gate = false;  // materialize(l): the replicas planned before the step (Hecate)
  bool gather_after_gate = false;   // place(l) after gate_sync(l), then materialize_placed(l)
  bool rematerialize = false;       // replicas freed after expert_fwd(l), gathered again for expert_bwd(l)
  // DeepSpeed-MoE's exchange (MoeLayer::set_padded_exchange): every rank sends each expert the same
  // number of slots, its kept rows then zero padding, and the experts compute over every slot. Same
  // graph; the exchanges' and experts' sizes change.
  bool padded_exchange = false;
};

bool gathers_replicas(const EpStepOptions& opt);  // any of the placement options set

// The stream indices of an EP graph (streams absent with one rank).
// The gather lane exists only with replica gathers (gathers_replicas): it has the all-to-all lane's
// priority, so gathers and exchanges run side by side and both overtake the gradient allreduce.
inline constexpr int kComputeStream = 0, kA2aStream = 1, kAllreduceStream = 2, kGatherStream = 3;
inline constexpr int kA2aPriority = 1, kAllreducePriority = 0;

// A gradient bucket: the parameters one grad_allreduce op (and its micro-ops) sums, by name.
struct GradBucket {
  std::string label;                 // "blocks.3", "blocks.3.experts", "embeddings", "head"
  Group group = Group::world;        // world: replicated parameters; dp: expert replicas
  std::vector<std::string> params;   // parameter names (docs/model.md)
  int64_t elements = 0;              // this rank's elements over all of them
};

struct EpStep {
  StepGraph graph;
  // Buckets by index; the grad_allreduce ops of bucket i have label buckets[i].label.
  std::vector<GradBucket> buckets;
};

// Pure: the graph for cfg and opt (the same on every rank up to sizes filled in at run time).
// REQUIRES: cfg.validate() ok; opt.world % opt.ep_size == 0; cfg.n_experts % opt.ep_size == 0;
// opt.batch >= 1 (std::invalid_argument otherwise).
EpStep build_ep_step(const ModelConfig& cfg, const EpStepOptions& opt);

}  // namespace moe::graph
