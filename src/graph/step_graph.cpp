// StepGraph: building (add, add_micro_ops), the whole-graph checks and the names traces use.
#include "graph/step_graph.h"

#include <algorithm>
#include <charconv>
#include <limits>
#include <stdexcept>

namespace moe::graph {

const char* op_kind_name(OpKind k) {
  switch (k) {
    case OpKind::embed_fwd: return "embed_fwd";
    case OpKind::attn_fwd: return "attn_fwd";
    case OpKind::ffn_fwd: return "ffn_fwd";
    case OpKind::gate_fwd: return "gate_fwd";
    case OpKind::dispatch_fwd: return "dispatch_fwd";
    case OpKind::expert_fwd: return "expert_fwd";
    case OpKind::combine_fwd: return "combine_fwd";
    case OpKind::head_fwd: return "head_fwd";
    case OpKind::head_bwd: return "head_bwd";
    case OpKind::combine_bwd: return "combine_bwd";
    case OpKind::expert_bwd: return "expert_bwd";
    case OpKind::dispatch_bwd: return "dispatch_bwd";
    case OpKind::gate_bwd: return "gate_bwd";
    case OpKind::ffn_bwd: return "ffn_bwd";
    case OpKind::attn_bwd: return "attn_bwd";
    case OpKind::embed_bwd: return "embed_bwd";
    case OpKind::optimizer: return "optimizer";
    case OpKind::place: return "place";
    case OpKind::custom: return "custom";
    case OpKind::gate_sync: return "gate_sync";
    case OpKind::dispatch_a2a: return "dispatch_a2a";
    case OpKind::combine_a2a: return "combine_a2a";
    case OpKind::combine_a2a_bwd: return "combine_a2a_bwd";
    case OpKind::dispatch_a2a_bwd: return "dispatch_a2a_bwd";
    case OpKind::grad_allreduce: return "grad_allreduce";
    case OpKind::materialize: return "materialize";
    case OpKind::materialize_placed: return "materialize_placed";
    case OpKind::rematerialize: return "rematerialize";
    case OpKind::replica_grad_reduce: return "replica_grad_reduce";
    case OpKind::custom_comm: return "custom_comm";
  }
  return "?";
}

bool is_communication(OpKind k) { return k >= OpKind::gate_sync; }

const char* collective_name(Collective c) {
  switch (c) {
    case Collective::none: return "none";
    case Collective::alltoallv: return "alltoallv";
    case Collective::allreduce: return "allreduce";
    case Collective::allgather: return "allgather";
    case Collective::reduce_scatter: return "reduce_scatter";
    case Collective::broadcast: return "broadcast";
    case Collective::reduce: return "reduce";
    case Collective::sendrecv: return "sendrecv";
    case Collective::sparse_allgather: return "sparse_allgather";
    case Collective::sparse_reduce_scatter: return "sparse_reduce_scatter";
  }
  return "?";
}

const char* group_name(Group g) {
  switch (g) {
    case Group::none: return "none";
    case Group::world: return "world";
    case Group::ep: return "ep";
    case Group::dp: return "dp";
  }
  return "?";
}

StepGraph::StepGraph() { streams.push_back({"compute", false}); }

int StepGraph::add_stream(std::string name, bool communication) {
  streams.push_back({std::move(name), communication});
  return static_cast<int>(streams.size()) - 1;
}

int StepGraph::add(Op op) {
  op.id = static_cast<int>(ops.size());
  auto where = [&] {
    std::string w = "StepGraph::add: ";
    w += op_name(op);
    return w;
  };
  if (op.stream < 0 || op.stream >= static_cast<int>(streams.size()))
    throw std::logic_error(where() + ": stream " + std::to_string(op.stream) + " does not exist");
  if (is_communication(op.kind) != streams[op.stream].communication || (!is_communication(op.kind) && op.stream != 0))
    throw std::logic_error(where() + " on stream '" + streams[op.stream].name + "': compute ops go on stream 0, " +
                           "communication ops on communication streams");
  for (int d : op.deps)
    if (d < 0 || d >= op.id)
      throw std::logic_error(where() + ": dependency " + std::to_string(d) + " is not an earlier op (id " +
                             std::to_string(op.id) + ")");
  ops.push_back(std::move(op));
  return ops.back().id;
}

int StepGraph::add_micro_ops(Op op, int n) {
  if (n < 1) {
    std::string msg = "StepGraph::add_micro_ops: n must be >= 1, got ";
    msg += std::to_string(n);
    throw std::logic_error(msg);
  }
  const Cost whole = op.cost;
  const std::vector<int> deps = op.deps;
  int prev = -1;
  for (int k = 0; k < n; ++k) {
    const bool last = k == n - 1;
    Op m = op;
    m.micro = k;
    m.n_micro = n;
    m.deps = deps;
    if (prev >= 0) m.deps.push_back(prev);
    m.cost.flops = whole.flops / n;
    m.cost.bytes = whole.bytes / n + (last ? whole.bytes % n : 0);
    for (size_t j = 0; j < whole.peer_bytes.size(); ++j)
      m.cost.peer_bytes[j] = whole.peer_bytes[j] / n + (last ? whole.peer_bytes[j] % n : 0);
    prev = add(std::move(m));
  }
  return prev;
}

Status StepGraph::validate() const {
  if (streams.empty() || streams[0].communication)
    return Status::error("graph: stream 0 must exist and be the compute stream");
  // Lowest priority among the communication ops each op depends on, directly or through other ops.
  std::vector<int> lowest_comm_dep(ops.size(), std::numeric_limits<int>::max());
  for (size_t i = 0; i < ops.size(); ++i) {
    const Op& op = ops[i];
    auto where = [&] {  // built only for an error: validate() runs before every step
      std::string w = "graph: op ";
      w += std::to_string(i) + " (" + op_name(op) + ")";
      return w;
    };
    if (op.id != static_cast<int>(i)) return Status::error(where() + " has id " + std::to_string(op.id));
    if (op.stream < 0 || op.stream >= static_cast<int>(streams.size()))
      return Status::error(where() + ": stream " + std::to_string(op.stream) + " does not exist");
    if (is_communication(op.kind) != streams[op.stream].communication || (!is_communication(op.kind) && op.stream != 0))
      return Status::error(where() + " is on stream '" + streams[op.stream].name +
                           "': compute ops go on stream 0, communication ops on communication streams");
    if (!is_communication(op.kind) && (op.collective != Collective::none || op.group != Group::none))
      return Status::error(where() + " is a compute op with a collective or group");
    if (op.n_micro < 1 || op.micro < 0 || op.micro >= op.n_micro)
      return Status::error(where() + ": micro-op " + std::to_string(op.micro) + " of " + std::to_string(op.n_micro));
    if (op.cost.flops < 0 || op.cost.bytes < 0 ||
        std::any_of(op.cost.peer_bytes.begin(), op.cost.peer_bytes.end(), [](int64_t b) { return b < 0; }))
      return Status::error(where() + " has a negative cost");
    for (int d : op.deps) {
      if (d < 0 || d >= op.id)
        return Status::error(where() + ": dependency " + std::to_string(d) + " is not an earlier op");
      const int via = is_communication(ops[d].kind) ? ops[d].priority : std::numeric_limits<int>::max();
      lowest_comm_dep[i] = std::min({lowest_comm_dep[i], lowest_comm_dep[d], via});
    }
    if (is_communication(op.kind) && lowest_comm_dep[i] < op.priority)
      return Status::error(where() + " (priority " + std::to_string(op.priority) +
                           ") depends on a communication op of lower priority (" +
                           std::to_string(lowest_comm_dep[i]) + "): ranks could wait on each other forever");
  }
  return Status::ok();
}

std::string StepGraph::op_name(const Op& op) const {
  // Appends through a buffer: GCC 12 reports a false -Wrestrict on += std::to_string(...) here.
  std::string name;
  char num[16];
  auto append = [&](int v) { name.append(num, std::to_chars(num, num + sizeof num, v).ptr); };
  if (op.layer >= 0) {
    name += 'L';
    append(op.layer);
    name += ' ';
  }
  name += op_kind_name(op.kind);
  if (op.n_micro > 1) {
    name += ' ';
    append(op.micro + 1);
    name += '/';
    append(op.n_micro);
  }
  if (!op.label.empty()) {
    name += ' ';
    name += op.label;
  }
  return name;
}

Range micro_range(int64_t count, int micro, int n_micro) {
  if (count < 0 || n_micro < 1 || micro < 0 || micro >= n_micro) {
    std::string msg = "micro_range: micro-op ";
    msg += std::to_string(micro) + " of " + std::to_string(n_micro) + " over " + std::to_string(count) + " elements";
    throw std::logic_error(msg);
  }
  const int64_t base = count / n_micro, rem = count % n_micro;
  Range r;
  r.begin = micro * base + std::min<int64_t>(micro, rem);
  r.end = r.begin + base + (micro < rem ? 1 : 0);
  return r;
}

}  // namespace moe::graph
