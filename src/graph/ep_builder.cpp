#include "graph/ep_builder.h"

#include <stdexcept>

namespace moe::graph {
namespace {

// Dimension letters: B sequences per rank, T positions, C model width, F FFN width, E experts,
// K choices per token, V vocabulary, N = B*T tokens per rank.
struct Dims {
  double B, T, C, F, E, K, V, N;
  double El;  // experts per rank
};

// Parameter names and sizes of a block, split into replicated and expert (sharded) parameters.
void block_params(const ModelConfig& cfg, int64_t l, int ep_size, GradBucket* dense, GradBucket* experts) {
  const int64_t C = cfg.d_model, F = cfg.d_ffn, E = cfg.n_experts;
  const bool ln = !cfg.use_rmsnorm(), swiglu = cfg.activation == "swiglu";
  const std::string p = "blocks." + std::to_string(l) + ".";
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
  if (cfg.is_moe_layer(l)) {
    add(dense, p + "moe.router.weight", E * C);
    const int64_t El = E / ep_size;
    add(experts, p + "moe.w1", El * F * C);
    add(experts, p + "moe.w2", El * C * F);
    if (swiglu) add(experts, p + "moe.w3", El * F * C);
  } else {
    add(dense, p + "mlp.w1", F * C);
    add(dense, p + "mlp.w2", C * F);
    if (swiglu) add(dense, p + "mlp.w3", F * C);
  }
}

class Builder {
 public:
  Builder(const ModelConfig& cfg, const EpStepOptions& opt) : cfg_(cfg), opt_(opt) {
    const double El = static_cast<double>(cfg.n_experts) / opt.ep_size;
    d_ = Dims{static_cast<double>(opt.batch), static_cast<double>(cfg.seq_len), static_cast<double>(cfg.d_model),
              static_cast<double>(cfg.d_ffn), static_cast<double>(cfg.n_experts), static_cast<double>(cfg.top_k),
              static_cast<double>(cfg.vocab_size), static_cast<double>(opt.batch * cfg.seq_len), El};
    distributed_ = opt.world > 1;
    if (distributed_) {
      step_.graph.add_stream("a2a", true);
      step_.graph.add_stream("allreduce", true);
      if (gathers_replicas(opt)) step_.graph.add_stream("gather", true);
    }
  }

  EpStep build() {
    int x = compute(OpKind::embed_fwd, -1, {}, 0, 4 * d_.N * d_.C * 3);
    for (int64_t l = 0; l < cfg_.n_layers; ++l) x = block_forward(l, x);
    x = compute(OpKind::head_fwd, -1, {x}, 2 * d_.N * d_.C * d_.V, 4 * d_.N * d_.V * 2);
    x = compute(OpKind::head_bwd, -1, {x}, 4 * d_.N * d_.C * d_.V, 4 * d_.N * d_.V * 2);
    GradBucket head{"head", Group::world, {"norm_f.weight"}, cfg_.d_model};
    if (!cfg_.use_rmsnorm()) {
      head.params.push_back("norm_f.bias");
      head.elements += cfg_.d_model;
    }
    allreduce(head, x);
    for (int64_t l = cfg_.n_layers - 1; l >= 0; --l) x = block_backward(l, x);
    x = compute(OpKind::embed_bwd, -1, {x}, 0, 4 * d_.N * d_.C * 3);
    allreduce(GradBucket{"embeddings", Group::world, {"wte.weight", "wpe.weight"},
                         (cfg_.vocab_size + cfg_.seq_len) * cfg_.d_model},
              x);
    if (Status s = step_.graph.validate(); !s) throw std::logic_error("build_ep_step: " + s.message());
    return std::move(step_);
  }

 private:
  int compute(OpKind kind, int64_t layer, std::vector<int> deps, double flops, double bytes) {
    Op op;
    op.kind = kind;
    op.layer = static_cast<int>(layer);
    op.stream = kComputeStream;
    op.deps = std::move(deps);
    op.cost.flops = flops;
    op.cost.bytes = static_cast<int64_t>(bytes);
    return step_.graph.add(std::move(op));
  }

  // An exchange on the all-to-all lane; sizes are filled in at run time (the gate decides them).
  int exchange(OpKind kind, Collective c, Group g, int64_t layer, std::vector<int> deps) {
    Op op;
    op.stream = c == Collective::sparse_allgather || c == Collective::sparse_reduce_scatter ? kGatherStream
                                                                                             : kA2aStream;
    op.kind = kind;
    op.collective = c;
    op.group = g;
    op.layer = static_cast<int>(layer);
    op.priority = kA2aPriority;
    op.deps = std::move(deps);
    return step_.graph.add(std::move(op));
  }
  int exchange(OpKind kind, Collective c, Group g, int64_t layer, int dep) {
    return exchange(kind, c, g, layer, std::vector<int>{dep});
  }
  std::vector<int> deps(std::initializer_list<int> ids) {  // the ids >= 0
    std::vector<int> d;
    for (int id : ids)
      if (id >= 0) d.push_back(id);
    return d;
  }

  // Sums a bucket's gradients on the allreduce lane once `dep` ended, cut into micro-ops.
  void allreduce(GradBucket bucket, int dep, int64_t layer = -1) {
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

  bool split_moe(int64_t l) const { return distributed_ && cfg_.is_moe_layer(l); }

  int block_forward(int64_t l, int x) {
    const double N = d_.N, C = d_.C, F = d_.F, T = d_.T, E = d_.E, K = d_.K;
    const double ffn_mats = cfg_.activation == "swiglu" ? 3 : 2;
    x = compute(OpKind::attn_fwd, l, {x}, 2 * N * C * 4 * C + 2 * 2 * N * T * C, 4 * N * (8 * C + 2 * T));
    // Expert FLOPs assume balanced routing; the runtime replaces them with the rows it ran.
    const double expert_flops = 2 * ffn_mats * N * K * C * F;
    if (!split_moe(l)) {
      const double flops = cfg_.is_moe_layer(l) ? 2 * N * C * E + expert_flops : 2 * ffn_mats * N * C * F;
      return compute(OpKind::ffn_fwd, l, {x}, flops, 4 * N * (4 * C + 2 * F));
    }
    // It runs behind attn_fwd(l) (no dependency on it); with re-materialization only once the previous
    // MoE block's expert_fwd freed its replicas, so one block's replicas are held at a time. Its sizes
    // are filled in when it runs (the plan is made before the step).
    const int gather =
        opt_.gather_before_gate
            ? exchange(OpKind::materialize, Collective::sparse_allgather, Group::ep, l,
                       opt_.rematerialize ? deps({last_expert_fwd_}) : std::vector<int>{})
            : -1;
    x = compute(OpKind::gate_fwd, l, {x}, 2 * N * C * E, 4 * N * (C + 2 * E));
    x = exchange(OpKind::gate_sync, Collective::allgather, Group::world, l, x);
    int placed_gather = -1;
    if (opt_.gather_after_gate) {
      // After the forward gather too: place changes the placement that gather reads.
      x = compute(OpKind::place, l, deps({x, gather}), 0, 0);
      placed_gather = exchange(OpKind::materialize_placed, Collective::sparse_allgather, Group::ep, l, x);
    }
    x = compute(OpKind::dispatch_fwd, l, {x}, 0, 4 * 2 * N * K * C);
    x = exchange(OpKind::dispatch_a2a, Collective::alltoallv, Group::ep, l, x);
    x = compute(OpKind::expert_fwd, l, deps({x, gather, placed_gather}), expert_flops, 4 * N * K * (4 * C + 3 * F));
    expert_fwd_[l] = last_expert_fwd_ = x;
    x = exchange(OpKind::combine_a2a, Collective::alltoallv, Group::ep, l, x);
    return compute(OpKind::combine_fwd, l, {x}, 2 * N * K * C, 4 * (N * K * C + 2 * N * C));
  }

  int block_backward(int64_t l, int x) {
    const double N = d_.N, C = d_.C, F = d_.F, T = d_.T, E = d_.E, K = d_.K;
    const double ffn_mats = cfg_.activation == "swiglu" ? 3 : 2;
    const double expert_flops = 2 * 2 * ffn_mats * N * K * C * F;
    GradBucket dense{"blocks." + std::to_string(l), Group::world, {}, 0};
    GradBucket experts{"blocks." + std::to_string(l) + ".experts", Group::dp, {}, 0};
    block_params(cfg_, l, split_moe(l) ? opt_.ep_size : 1, &dense, &experts);
    if (!split_moe(l)) {
      const double flops = cfg_.is_moe_layer(l) ? 4 * N * C * E + expert_flops : 4 * ffn_mats * N * C * F;
      x = compute(OpKind::ffn_bwd, l, {x}, flops, 8 * N * (4 * C + 2 * F));
      // One process (or a dense block): its FFN weights are replicated like the attention's.
      for (size_t i = 0; i < experts.params.size(); ++i) dense.params.push_back(experts.params[i]);
      dense.elements += experts.elements;
    } else {
      x = compute(OpKind::combine_bwd, l, {x}, 2 * N * K * C, 4 * (N * K * C + 2 * N * C));
      // After the forward's expert_fwd(l) freed the replicas, and (the lane's FIFO) after the block
      // above reduced its replica gradients: it runs behind the backward of the blocks above.
      const int regather = opt_.rematerialize ? exchange(OpKind::rematerialize, Collective::sparse_allgather,
                                                         Group::ep, l, std::vector<int>{expert_fwd_[l]})
                                              : -1;
      x = exchange(OpKind::combine_a2a_bwd, Collective::alltoallv, Group::ep, l, x);
      x = compute(OpKind::expert_bwd, l, deps({x, regather}), expert_flops, 8 * N * K * (4 * C + 3 * F));
      allreduce(experts, x, l);
      const int expert_grads = x;
      x = exchange(OpKind::dispatch_a2a_bwd, Collective::alltoallv, Group::ep, l, x);
      if (gathers_replicas(opt_))
        exchange(OpKind::replica_grad_reduce, Collective::sparse_reduce_scatter, Group::ep, l, expert_grads);
      x = compute(OpKind::gate_bwd, l, {x}, 4 * N * C * E, 4 * N * (2 * C + 3 * E));
    }
    x = compute(OpKind::attn_bwd, l, {x}, 4 * N * C * 4 * C + 4 * 2 * N * T * C, 8 * N * (8 * C + 2 * T));
    allreduce(std::move(dense), x, l);
    return x;
  }

  const ModelConfig& cfg_;
  EpStepOptions opt_;
  Dims d_{};
  bool distributed_ = false;
  EpStep step_;
  std::vector<int> expert_fwd_ = std::vector<int>(cfg_.n_layers, -1);  // op id of expert_fwd(l)
  int last_expert_fwd_ = -1;
};

}  // namespace

bool gathers_replicas(const EpStepOptions& opt) {
  return opt.gather_before_gate || opt.gather_after_gate || opt.rematerialize;
}

EpStep build_ep_step(const ModelConfig& cfg, const EpStepOptions& opt) {
  if (Status s = cfg.validate(); !s) throw std::invalid_argument("build_ep_step: " + s.message());
  if (opt.world < 1 || opt.ep_size < 1 || opt.world % opt.ep_size != 0 || cfg.n_experts % opt.ep_size != 0 ||
      opt.batch < 1)
    throw std::invalid_argument("build_ep_step: ep_size (" + std::to_string(opt.ep_size) +
                                ") must divide the ranks (" + std::to_string(opt.world) + ") and n_experts (" +
                                std::to_string(cfg.n_experts) + "), batch >= 1");
  if (gathers_replicas(opt) && opt.ep_size != opt.world)
    throw std::invalid_argument("build_ep_step: replica gathers need one expert-parallel group of every rank");
  return Builder(cfg, opt).build();
}

}  // namespace moe::graph
