#include "runtime/ep_step_bodies.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>

#include "graph/step_graph.h"

namespace moe::runtime {

using graph::Op;
using graph::OpKind;

EpStepBodies::EpStepBodies(Model& model, const graph::EpStep& step, GradComms comms, PlacementHooks hooks)
    : model_(model), step_(step), exchanges_(static_cast<size_t>(model.n_blocks())), comms_(comms), hooks_(std::move(hooks)) {
  std::map<std::string, Param*> by_name;
  for (Param* p : model.params()) by_name[p->name] = p;
  for (const graph::GradBucket& gb : step.buckets) {
    Bucket b;
    b.over = gb.group == graph::Group::dp ? comms.grad_dp : comms.grad_world;
    for (const std::string& name : gb.params) {
      auto it = by_name.find(name);
      if (it == by_name.end()) throw std::logic_error("EpStepBodies: the model has no parameter " + name);
      b.params.push_back(it->second);
      b.elements += static_cast<int64_t>(it->second->grad.numel());
    }
    if (b.elements != gb.elements)
      throw std::logic_error("EpStepBodies: bucket " + gb.label + " has " + std::to_string(b.elements) +
                             " elements here, the graph says " + std::to_string(gb.elements));
    buckets_.push_back(std::move(b));
  }
}

Status EpStepBodies::allreduce(const Op& op) {
  size_t i = 0;
  while (i < step_.buckets.size() && step_.buckets[i].label != op.label) ++i;
  if (i == buckets_.size()) throw std::logic_error("EpStepBodies: no bucket " + op.label);
  const Bucket& b = buckets_[i];
  if (!b.over || b.over->size() == 1) return Status::ok();
  // This micro-op's share of the bucket, as if its parameters' gradients were one array.
  const graph::Range r = graph::micro_range(b.elements, op.micro, op.n_micro);
  int64_t first = 0;  // bucket index of the current parameter's element 0
  for (Param* p : b.params) {
    const int64_t n = static_cast<int64_t>(p->grad.numel());
    const int64_t lo = std::max(r.begin, first), hi = std::min(r.end, first + n);
    if (lo < hi)
      if (Status s = b.over->allreduce(p->grad.data() + (lo - first), hi - lo); !s) return s;
    first += n;
  }
  return Status::ok();
}

Status EpStepBodies::run(Op& op) {
  const int64_t l = op.layer;
  MoeLayer* moe = l >= 0 ? model_.moe_layer(l) : nullptr;
  // Sizes only the gate knows, recorded on the op for the trace and the metrics.
  TokenExchange* ex = l >= 0 ? &exchanges_.at(l) : nullptr;
  auto exchange_cost = [&](bool to_experts) {
    op.cost.peer_bytes = ex->peer_bytes(to_experts, op.micro, op.n_micro);
    op.cost.bytes = 0;
    for (int64_t b : op.cost.peer_bytes) op.cost.bytes += b;
  };
  auto sparse_cost = [&]() {
    op.cost.peer_bytes = moe->sparse_peer_bytes();
    op.cost.bytes = 0;
    for (int64_t b : op.cost.peer_bytes) op.cost.bytes += b;
    op.cost.bytes_received = moe->sparse_received_bytes();
  };
  auto expert_flops = [&](double passes, int64_t rows) {
    const MoeConfig& c = moe->config();
    const double mats = c.activation == Activation::swiglu ? 3 : 2;
    op.cost.flops = passes * 2 * mats * static_cast<double>(rows) * c.d_model * c.d_ffn;
  };
  switch (op.kind) {
    case OpKind::embed_fwd: model_.embed_forward(); break;
    case OpKind::attn_fwd: model_.attn_forward(l); break;
    case OpKind::ffn_fwd: model_.ffn_forward(l); break;
    case OpKind::gate_fwd: model_.moe_gate_forward(l); break;
    case OpKind::gate_sync: moe->ep_gate_sync(); break;
    case OpKind::dispatch_fwd: moe->ep_dispatch(ex); break;
    case OpKind::dispatch_a2a:  // one chunk of n_micro (graph/step_builder.h)
      exchange_cost(true);
      moe->ep_dispatch_a2a(*ex, op.micro, op.n_micro);
      break;
    case OpKind::expert_fwd:
      expert_flops(1, moe->ep_experts(ex, op.micro, op.n_micro));
      if (hooks_.rematerialize && op.micro == op.n_micro - 1) moe->release_replicas(true);
      break;
    case OpKind::combine_a2a:
      exchange_cost(false);
      moe->ep_combine_a2a(*ex);
      break;
    case OpKind::combine_fwd: model_.moe_combine_forward(l, *ex); break;
    case OpKind::head_fwd: model_.head_forward(); break;
    case OpKind::head_bwd: model_.head_backward(); break;
    case OpKind::combine_bwd: model_.moe_combine_backward(l, *ex); break;
    case OpKind::combine_a2a_bwd:
      exchange_cost(true);
      moe->ep_combine_a2a_bwd(*ex);
      break;
    case OpKind::expert_bwd:
      expert_flops(2, ex->received_rows);
      moe->ep_experts_bwd(*ex);
      break;
    case OpKind::dispatch_a2a_bwd:
      exchange_cost(false);
      moe->ep_dispatch_a2a_bwd(*ex);
      break;
    case OpKind::gate_bwd: model_.moe_gate_backward(l, *ex); break;
    case OpKind::ffn_bwd: model_.ffn_backward(l); break;
    case OpKind::attn_bwd: model_.attn_backward(l); break;
    case OpKind::embed_bwd: model_.embed_backward(); break;
    case OpKind::grad_allreduce: return allreduce(op);
    case OpKind::place:
      if (!hooks_.place) throw std::logic_error("EpStepBodies: the graph has place ops but no planner was given");
      return hooks_.place(l);
    case OpKind::materialize:
    case OpKind::materialize_placed:
    case OpKind::rematerialize:
      moe->ep_materialize();
      sparse_cost();
      break;
    case OpKind::replica_grad_reduce:
      moe->ep_reduce_replica_grads();
      sparse_cost();
      moe->release_replicas(hooks_.rematerialize);
      break;
    default: throw std::logic_error(std::string("EpStepBodies: no body for ") + graph::op_kind_name(op.kind));
  }
  return Status::ok();
}

}  // namespace moe::runtime
