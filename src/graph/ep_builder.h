// The expert-parallel (EP) training step as a StepGraph: the standard composition of
// graph/step_builder.h's pieces, the step every registered strategy runs (GShard / DeepSpeed-MoE
// style, with the placement strategies' replica gathers where their options ask for them).
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

#include "graph/step_builder.h"

namespace moe::graph {

// Pure: the graph for cfg and opt (the same on every rank up to sizes filled in at run time):
// StepBuilder::compose with StepBuilder::moe_forward. REQUIRES: those of StepBuilder
// (std::invalid_argument otherwise).
EpStep build_ep_step(const ModelConfig& cfg, const EpStepOptions& opt);

}  // namespace moe::graph
