// Start here for src/graph: the StepGraph, one training step as data (docs/architecture.md, "a step is data").
//
// A StepGraph is the list of operations of one step as one rank sees it. The runtime
// (src/runtime/executor.h) runs it on real ranks; the simulator runs the very same graph on a
// modeled cluster. Strategies assemble graphs from step_builder.h's pieces; nothing here runs
// anything.
//
// Semantics both executors share:
//   * Ops are stored in a topological order: every dependency has a smaller id than its op.
//   * A stream is a FIFO: its ops start in id order, each after the previous one on the stream ended
//     and after all its dependencies ended.
//   * Stream 0 is the compute stream (the main thread). Every other stream is a communication lane
//     with its own thread and its own communicator, so collectives on one lane are issued in the same
//     order on every rank (the lane's id order) while lanes run concurrently.
//   * Priority across lanes: a communication op does not start while a communication op of higher
//     priority on another lane is running or ready (its dependencies ended and it heads its lane).
//     This is how an all-to-all overtakes a gradient allreduce queued before it: the allreduce, cut
//     into micro-ops, yields between micro-ops. REQUIRES of builders: no communication op depends,
//     directly or through other ops' deps, on a communication op of lower priority (or ranks could
//     wait on each other forever); validate() checks it.
//   * Sizes only the gate can tell (all-to-all splits) are written into Op::cost by the op that learns
//     them (a compute op), before the communication op that uses them becomes ready.
//
// Thread safety: a graph is built on one thread; during execution an op's cost may be written by the
// op that precedes it in dependency order and read after that, nothing else changes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "util/status.h"

namespace moe::graph {

// What an op does. Compute kinds name a phase of the model; communication kinds name the exchange.
enum class OpKind : uint8_t {
  // compute
  embed_fwd,         // token + position embedding
  attn_fwd,          // block l: norm1, qkv, attention, proj, residual, norm2 (the FFN input)
  ffn_fwd,           // block l: dense FFN, or the whole MoE layer in one process, + residual
  gate_fwd,          // block l (expert parallel): router, top-k, this rank's loss statistics and counts
  dispatch_fwd,      // block l: global capacity, layout, rows packed for the dispatch all-to-all
  expert_fwd,        // block l: this rank's experts over the rows it received
  combine_fwd,       // block l: gate-weighted sum of the returned rows + residual
  head_fwd,          // final norm, logits, cross-entropy
  head_bwd,
  combine_bwd,       // block l: gradients of the returned rows and of the gate weights
  expert_bwd,        // block l: expert weight and input-row gradients
  dispatch_bwd,      // block l: gradients of the dispatched rows back onto tokens
  gate_bwd,          // block l: router backward (incl. aux/z loss terms)
  ffn_bwd,           // block l: dense FFN / single-process MoE layer backward
  attn_bwd,          // block l: norm2, proj, attention, qkv, norm1 backward
  embed_bwd,
  optimizer,         // clip + AdamW over every parameter
  place,             // block l: a planner that sees this step's routed counts (FasterMoE shadowing,
                     // Hecate's calibration) and may add replicas to the layer's placement
  custom,            // hand-built graphs (tests, benchmarks)
  // communication
  gate_sync,         // block l: loss statistics and per-expert counts shared over the EP group
  dispatch_a2a,      // block l forward: token rows to their experts' ranks (alltoallv)
  combine_a2a,       // block l forward: expert outputs back to the tokens' ranks (alltoallv)
  combine_a2a_bwd,   // block l backward: output gradients to the experts' ranks
  dispatch_a2a_bwd,  // block l backward: input-row gradients back to the tokens' ranks
  grad_allreduce,    // gradients summed over the replicas of a parameter (a micro-op of a bucket)
  materialize,       // block l forward: SparseAllGather of the planned expert replicas, before the gate
  materialize_placed,  // block l forward: SparseAllGather of the replicas `place` added
  rematerialize,     // block l backward: the replicas gathered again (they were freed after forward)
  replica_grad_reduce,  // block l backward: SparseReduceScatter of replica gradients into the owners
  custom_comm,
};
const char* op_kind_name(OpKind k);  // "attn_fwd", "dispatch_a2a", ...
bool is_communication(OpKind k);

// The collective an op performs (none for compute): what the simulator decomposes into flows.
// sparse_allgather / sparse_reduce_scatter: Hecate's (comm/sparse_collectives.h), broadcast / reduce
// trees of expert chunks over point-to-point messages; peer_bytes as for alltoallv.
enum class Collective : uint8_t {
  none, alltoallv, allreduce, allgather, reduce_scatter, broadcast, reduce, sendrecv, sparse_allgather,
  sparse_reduce_scatter
};
const char* collective_name(Collective c);

// The group a collective spans. world: every rank; ep: the ranks that together hold one copy of every
// expert; dp: the ranks holding the same experts (comm::Groups).
enum class Group : uint8_t { none, world, ep, dp };
const char* group_name(Group g);

struct Cost {
  double flops = 0;    // compute: floating-point operations of this rank's op
  int64_t bytes = 0;   // compute: bytes read + written; communication: bytes this rank sends
  // Communication: bytes this rank sends to each rank of the group, indexed by group rank (empty
  // when not known yet, or for collectives whose flows follow from `bytes` and the algorithm).
  std::vector<int64_t> peer_bytes;
  // Sparse collectives: bytes this rank receives (what its peers' peer_bytes send it); 0 elsewhere.
  int64_t bytes_received = 0;
};

struct Op {
  int id = -1;               // index in StepGraph::ops
  OpKind kind = OpKind::custom;
  Collective collective = Collective::none;
  Group group = Group::none;
  int layer = -1;            // block index; -1: not per layer (embedding, head, optimizer)
  int micro = 0;             // micro-op index in [0, n_micro)
  int n_micro = 1;           // number of equal micro-ops the op was cut into
  int stream = 0;            // index into StepGraph::streams
  int priority = 0;          // higher runs first among communication lanes
  std::vector<int> deps;     // op ids, each < id
  Cost cost;
  std::string label;         // optional extra name (hand-built ops, parameter bucket)
};

struct Stream {
  std::string name;          // "compute", "a2a", "allreduce", ...
  bool communication = false;
};

struct StepGraph {
  std::vector<Stream> streams;  // streams[0] is the compute stream
  std::vector<Op> ops;

  StepGraph();  // with the compute stream
  int add_stream(std::string name, bool communication);
  // Appends op (its id is set here) and returns its id. REQUIRES: deps < the new id, stream exists,
  // communication kinds on communication streams and compute kinds on stream 0 (std::logic_error).
  int add(Op op);
  // Appends n ops that together are `op` cut into equal micro-ops (micro = 0..n-1, n_micro = n, cost
  // divided evenly, the remainder of bytes and of each peer_bytes entry on the last), each depending
  // on op.deps and on the previous micro-op. Returns the id of the last. REQUIRES: n >= 1, and those
  // of add (std::logic_error).
  int add_micro_ops(Op op, int n);

  // Whole-graph checks (the invariants above incl. the priority REQUIRES, streams and ids in range,
  // micro in [0, n_micro), no negative cost, no collective on a compute op). Error names the op.
  Status validate() const;
  // "L3 dispatch_a2a", "L0 grad_allreduce 2/4 blocks.0", "embed_fwd": how traces name ops.
  std::string op_name(const Op& op) const;
};

// Where an op stands in a running step; both executors keep one per op.
enum class OpState : uint8_t { waiting, running, ended };

// The start rule of the semantics above, the one both executors run (the runtime on real threads,
// the simulator on simulated clocks): op may start when it waits, heads its stream and its
// dependencies ended, and, on a communication lane, no other lane's head of higher priority is
// running or ready. state(i): the OpState of op i; head(s): the op heading stream s (its running op,
// else its next one), or -1 when the stream has none left. REQUIRES: op in range.
template <class StateOf, class HeadOf>
bool may_start(const StepGraph& g, int op, const StateOf& state, const HeadOf& head) {
  auto deps_ended = [&](int i) {
    for (int d : g.ops[i].deps)
      if (state(d) != OpState::ended) return false;
    return true;
  };
  const Op& o = g.ops[op];
  if (state(op) != OpState::waiting || head(o.stream) != op || !deps_ended(op)) return false;
  if (o.stream == 0) return true;
  for (int s = 1; s < static_cast<int>(g.streams.size()); ++s) {
    if (s == o.stream) continue;
    const int other = head(s);
    if (other >= 0 && g.ops[other].priority > o.priority && (state(other) == OpState::running || deps_ended(other)))
      return false;
  }
  return true;
}

// The half-open element range [begin, end) of micro-op `micro` of `n_micro` over `count` elements:
// equal parts, the remainder spread over the first parts. REQUIRES: count >= 0, 0 <= micro < n_micro
// (std::logic_error).
struct Range {
  int64_t begin = 0, end = 0;
};
Range micro_range(int64_t count, int micro, int n_micro);

}  // namespace moe::graph
