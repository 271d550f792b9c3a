#include "graph/step_builder.h"

#include <algorithm>
#include <stdexcept>

namespace moe::graph {

bool gathers_replicas(const EpStepOptions& opt) {
  return opt.gather_before_gate || opt.gather_after_gate || opt.rematerialize;
}

StepBuilder::StepBuilder(const ModelConfig& cfg, const EpStepOptions& opt) : cfg_(cfg), opt_(opt) {
  if (Status s = cfg.validate(); !s) throw std::invalid_argument("StepBuilder: " + s.message());
  if (opt.world < 1 || opt.ep_size < 1 || opt.world % opt.ep_size != 0 || cfg.n_experts % opt.ep_size != 0 ||
      opt.batch < 1)
    throw std::invalid_argument("StepBuilder: ep_size (" + std::to_string(opt.ep_size) + ") must divide the ranks (" +
                                std::to_string(opt.world) + ") and n_experts (" + std::to_string(cfg.n_experts) +
                                "), batch >= 1");
  if (gathers_replicas(opt) && opt.ep_size != opt.world)
    throw std::invalid_argument("StepBuilder: replica gathers need one expert-parallel group of every rank");
  B_ = static_cast<double>(opt.batch), T_ = static_cast<double>(cfg.seq_len), C_ = static_cast<double>(cfg.d_model);
  F_ = static_cast<double>(cfg.d_ffn), E_ = static_cast<double>(cfg.n_experts), K_ = static_cast<double>(cfg.top_k);
  V_ = static_cast<double>(cfg.vocab_size), N_ = B_ * T_;
  ffn_mats_ = cfg.activation == "swiglu" ? 3 : 2;
  distributed_ = opt.world > 1;
  expert_fwd_.assign(static_cast<size_t>(cfg.n_layers), -1);
  if (distributed_) {
    step_.graph.add_stream("a2a", true);
    step_.graph.add_stream("allreduce", true);
    if (gathers_replicas(opt)) step_.graph.add_stream("gather", true);
  }
}

bool StepBuilder::expert_parallel(int64_t l) const { return distributed_ && cfg_.is_moe_layer(l); }

int StepBuilder::compute(OpKind kind, int64_t layer, std::vector<int> deps, double flops, double bytes) {
  Op op;
  op.kind = kind;
  op.layer = static_cast<int>(layer);
  op.stream = kComputeStream;
  op.deps = std::move(deps);
  op.cost.flops = flops;
  op.cost.bytes = static_cast<int64_t>(bytes);
  return step_.graph.add(std::move(op));
}

// An exchange on the all-to-all lane (sparse collectives: the gather lane); sizes are filled in at
// run time (the gate decides them). Negative deps are dropped.
int StepBuilder::exchange(OpKind kind, Collective c, Group g, int64_t layer, std::vector<int> deps) {
  Op op;
  op.stream = c == Collective::sparse_allgather || c == Collective::sparse_reduce_scatter ? kGatherStream
                                                                                           : kA2aStream;
  op.kind = kind;
  op.collective = c;
  op.group = g;
  op.layer = static_cast<int>(layer);
  op.priority = kA2aPriority;
  deps.erase(std::remove(deps.begin(), deps.end(), -1), deps.end());
  op.deps = std::move(deps);
  return step_.graph.add(std::move(op));
}

// Sums a bucket's gradients on the allreduce lane once `dep` ended, cut into micro-ops.
void StepBuilder::allreduce(GradBucket bucket, int dep, int64_t layer) {
  if (!distributed_ || bucket.elements == 0) return;
  if (bucket.group == Group::dp && opt_.world == opt_.ep_size) return;  // one replica: nothing to sum
  Op op;
  op.kind = OpKind::grad_allreduce;
  op.collective = Collective::allreduce;
  op.group = bucket.group;
  op.layer = static_cast<int>(layer);
  op.stream = kAllreduceStream;
  op.priority = kAllreducePriority;
  op.deps = {dep};
  op.label = bucket.label;
  op.cost.bytes = bucket.elements * static_cast<int64_t>(sizeof(float));
  int n = 1;
  if (opt_.allreduce_micro_bytes > 0)
    n = static_cast<int>(std::max<int64_t>(1, (op.cost.bytes + opt_.allreduce_micro_bytes - 1) /
                                                  opt_.allreduce_micro_bytes));
  n = static_cast<int>(std::min<int64_t>(n, bucket.elements));
  step_.graph.add_micro_ops(std::move(op), n);
  step_.buckets.push_back(std::move(bucket));
}

// Block l's parameters by name and size: the replicated ones (attention, norms, router, dense FFN)
// and the expert shards. Without expert parallelism the experts are replicated like the rest.
void StepBuilder::block_buckets(int64_t l, GradBucket* dense, GradBucket* experts) const {
  const int64_t C = cfg_.d_model, F = cfg_.d_ffn, E = cfg_.n_experts;
  const bool ln = !cfg_.use_rmsnorm(), swiglu = cfg_.activation == "swiglu";
  const std::string p = "blocks." + std::to_string(l) + ".";
  *dense = GradBucket{"blocks." + std::to_string(l), Group::world, {}, 0};
  *experts = GradBucket{"blocks." + std::to_string(l) + ".experts", Group::dp, {}, 0};
  auto add = [](GradBucket* b, const std::string& name, int64_t n) {
    b->params.push_back(name);
    b->elements += n;
  };
  add(dense, p + "norm1.weight", C);
  if (ln) add(dense, p + "norm1.bias", C);
  add(dense, p + "attn.qkv.weight", 3 * C * C);
  add(dense, p + "attn.proj.weight", C * C);
  add(dense, p + "norm2.weight", C);
  if (ln) add(dense, p + "norm2.bias", C);
  if (cfg_.is_moe_layer(l)) {
    add(dense, p + "moe.router.weight", E * C);
    GradBucket* into = expert_parallel(l) ? experts : dense;
    const int64_t El = E / (expert_parallel(l) ? opt_.ep_size : 1);
    add(into, p + "moe.w1", El * F * C);
    add(into, p + "moe.w2", El * C * F);
    if (swiglu) add(into, p + "moe.w3", El * F * C);
  } else {
    add(dense, p + "mlp.w1", F * C);
    add(dense, p + "mlp.w2", C * F);
    if (swiglu) add(dense, p + "mlp.w3", F * C);
  }
}

int StepBuilder::embed_forward() { return compute(OpKind::embed_fwd, -1, {}, 0, 4 * N_ * C_ * 3); }

int StepBuilder::attention_forward(int64_t l, int x) {
  return compute(OpKind::attn_fwd, l, {x}, 2 * N_ * C_ * 4 * C_ + 2 * 2 * N_ * T_ * C_,
                 4 * N_ * (8 * C_ + 2 * T_));
}

int StepBuilder::ffn_forward(int64_t l, int x) {
  if (expert_parallel(l)) throw std::logic_error("StepBuilder::ffn_forward: block " + std::to_string(l) + " is expert-parallel");
  const double expert_flops = 2 * ffn_mats_ * N_ * K_ * C_ * F_;
  const double flops = cfg_.is_moe_layer(l) ? 2 * N_ * C_ * E_ + expert_flops : 2 * ffn_mats_ * N_ * C_ * F_;
  return compute(OpKind::ffn_fwd, l, {x}, flops, 4 * N_ * (4 * C_ + 2 * F_));
}

// Behind attn_fwd(l) (no dependency on it); with re-materialization only once the previous MoE
// block's expert_fwd freed its replicas, so one block's replicas are held at a time. Its sizes are
// filled in when it runs (the plan is made before the step).
int StepBuilder::replica_gather(int64_t l) {
  return exchange(OpKind::materialize, Collective::sparse_allgather, Group::ep, l,
                  opt_.rematerialize ? std::vector<int>{last_expert_fwd_} : std::vector<int>{});
}

int StepBuilder::gate(int64_t l, int x) {
  x = compute(OpKind::gate_fwd, l, {x}, 2 * N_ * C_ * E_, 4 * N_ * (C_ + 2 * E_));
  return exchange(OpKind::gate_sync, Collective::allgather, Group::world, l, {x});
}

int StepBuilder::place(int64_t l, std::vector<int> deps) {
  deps.erase(std::remove(deps.begin(), deps.end(), -1), deps.end());
  return compute(OpKind::place, l, std::move(deps), 0, 0);
}

int StepBuilder::placed_gather(int64_t l, int place) {
  return exchange(OpKind::materialize_placed, Collective::sparse_allgather, Group::ep, l, {place});
}

std::vector<int> StepBuilder::dispatch(int64_t l, int x, int chunks) {
  if (chunks < 1) throw std::logic_error("StepBuilder::dispatch: REQUIRES chunks >= 1");
  x = compute(OpKind::dispatch_fwd, l, {x}, 0, 4 * 2 * N_ * K_ * C_);
  std::vector<int> ids;
  for (int c = 0; c < chunks; ++c) {
    Op op;
    op.kind = OpKind::dispatch_a2a;
    op.collective = Collective::alltoallv;
    op.group = Group::ep;
    op.layer = static_cast<int>(l);
    op.stream = kA2aStream;
    op.priority = kA2aPriority;
    op.micro = c;
    op.n_micro = chunks;
    op.deps = {x};
    ids.push_back(step_.graph.add(std::move(op)));
  }
  return ids;
}

int StepBuilder::experts_forward(int64_t l, const std::vector<int>& arrived, const std::vector<int>& before) {
  const int n = static_cast<int>(arrived.size());
  if (n < 1) throw std::logic_error("StepBuilder::experts_forward: no exchange to wait for");
  // Expert FLOPs assume balanced routing; the runtime replaces them with the rows it ran.
  const double flops = 2 * ffn_mats_ * N_ * K_ * C_ * F_ / n, bytes = 4 * N_ * K_ * (4 * C_ + 3 * F_) / n;
  int x = -1;
  for (int c = 0; c < n; ++c) {
    std::vector<int> deps{arrived[c]};
    if (c == 0)
      for (int b : before)
        if (b >= 0) deps.push_back(b);
    Op op;
    op.kind = OpKind::expert_fwd;
    op.layer = static_cast<int>(l);
    op.stream = kComputeStream;
    op.micro = c;
    op.n_micro = n;
    op.deps = std::move(deps);
    op.cost.flops = flops;
    op.cost.bytes = static_cast<int64_t>(bytes);
    x = step_.graph.add(std::move(op));
  }
  expert_fwd_[l] = last_expert_fwd_ = x;
  return x;
}

int StepBuilder::combine(int64_t l, int x) {
  x = exchange(OpKind::combine_a2a, Collective::alltoallv, Group::ep, l, {x});
  return compute(OpKind::combine_fwd, l, {x}, 2 * N_ * K_ * C_, 4 * (N_ * K_ * C_ + 2 * N_ * C_));
}

int StepBuilder::moe_forward(int64_t l, int x) {
  const int gather = opt_.gather_before_gate ? replica_gather(l) : -1;
  x = gate(l, x);
  int placed = -1;
  if (opt_.gather_after_gate) {
    // After the forward gather too: place changes the placement that gather reads.
    x = place(l, {x, gather});
    placed = placed_gather(l, x);
  }
  x = experts_forward(l, dispatch(l, x), {gather, placed});
  return combine(l, x);
}

int StepBuilder::head(int x) {
  x = compute(OpKind::head_fwd, -1, {x}, 2 * N_ * C_ * V_, 4 * N_ * V_ * 2);
  x = compute(OpKind::head_bwd, -1, {x}, 4 * N_ * C_ * V_, 4 * N_ * V_ * 2);
  GradBucket bucket{"head", Group::world, {"norm_f.weight"}, cfg_.d_model};
  if (!cfg_.use_rmsnorm()) {
    bucket.params.push_back("norm_f.bias");
    bucket.elements += cfg_.d_model;
  }
  allreduce(std::move(bucket), x);
  return x;
}

int StepBuilder::moe_backward(int64_t l, int x) {
  if (!expert_parallel(l)) throw std::logic_error("StepBuilder::moe_backward: block " + std::to_string(l) + " is not expert-parallel");
  const double expert_flops = 2 * 2 * ffn_mats_ * N_ * K_ * C_ * F_;
  GradBucket dense, experts;
  block_buckets(l, &dense, &experts);
  x = compute(OpKind::combine_bwd, l, {x}, 2 * N_ * K_ * C_, 4 * (N_ * K_ * C_ + 2 * N_ * C_));
  // After the forward's expert_fwd(l) freed the replicas, and (the lane's FIFO) after the block
  // above reduced its replica gradients: it runs behind the backward of the blocks above.
  const int regather =
      opt_.rematerialize
          ? exchange(OpKind::rematerialize, Collective::sparse_allgather, Group::ep, l, {expert_fwd_[l]})
          : -1;
  x = exchange(OpKind::combine_a2a_bwd, Collective::alltoallv, Group::ep, l, {x});
  std::vector<int> deps{x};
  if (regather >= 0) deps.push_back(regather);
  x = compute(OpKind::expert_bwd, l, std::move(deps), expert_flops, 8 * N_ * K_ * (4 * C_ + 3 * F_));
  allreduce(std::move(experts), x, l);
  const int expert_grads = x;
  x = exchange(OpKind::dispatch_a2a_bwd, Collective::alltoallv, Group::ep, l, {x});
  if (gathers_replicas(opt_))
    exchange(OpKind::replica_grad_reduce, Collective::sparse_reduce_scatter, Group::ep, l, {expert_grads});
  return compute(OpKind::gate_bwd, l, {x}, 4 * N_ * C_ * E_, 4 * N_ * (2 * C_ + 3 * E_));
}

int StepBuilder::ffn_backward(int64_t l, int x) {
  if (expert_parallel(l)) throw std::logic_error("StepBuilder::ffn_backward: block " + std::to_string(l) + " is expert-parallel");
  const double expert_flops = 2 * 2 * ffn_mats_ * N_ * K_ * C_ * F_;
  const double flops = cfg_.is_moe_layer(l) ? 4 * N_ * C_ * E_ + expert_flops : 4 * ffn_mats_ * N_ * C_ * F_;
  return compute(OpKind::ffn_bwd, l, {x}, flops, 8 * N_ * (4 * C_ + 2 * F_));
}

int StepBuilder::attention_backward(int64_t l, int x) {
  x = compute(OpKind::attn_bwd, l, {x}, 4 * N_ * C_ * 4 * C_ + 4 * 2 * N_ * T_ * C_, 8 * N_ * (8 * C_ + 2 * T_));
  GradBucket dense, experts;
  block_buckets(l, &dense, &experts);
  allreduce(std::move(dense), x, l);
  return x;
}

int StepBuilder::block_backward(int64_t l, int x) {
  x = expert_parallel(l) ? moe_backward(l, x) : ffn_backward(l, x);
  return attention_backward(l, x);
}

void StepBuilder::embed_backward(int x) {
  x = compute(OpKind::embed_bwd, -1, {x}, 0, 4 * N_ * C_ * 3);
  allreduce(GradBucket{"embeddings", Group::world, {"wte.weight", "wpe.weight"},
                       (cfg_.vocab_size + cfg_.seq_len) * cfg_.d_model},
            x);
}

EpStep StepBuilder::compose(const MoeForward& moe) {
  int x = embed_forward();
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    x = attention_forward(l, x);
    x = expert_parallel(l) ? moe(*this, l, x) : ffn_forward(l, x);
  }
  x = head(x);
  for (int64_t l = cfg_.n_layers - 1; l >= 0; --l) x = block_backward(l, x);
  embed_backward(x);
  return finish();
}

EpStep StepBuilder::finish() {
  if (Status s = step_.graph.validate(); !s) throw std::logic_error("StepBuilder: " + s.message());
  return std::move(step_);
}

}  // namespace moe::graph
