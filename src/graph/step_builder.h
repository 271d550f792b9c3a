// The pieces one rank's training step is assembled from: a strategy composes its StepGraph out of
// these (graph/ep_builder.h's build_ep_step is the standard composition every registered strategy
// uses; tests/test_toy_strategy.cpp assembles one with its dispatch cut in two chunks).
//
// Dimension letters: B sequences per rank, T positions, C model width, F FFN width, E experts, K
// choices per token, V vocabulary, N = B*T tokens per rank.
//
// Every piece appends ops for one block (or the embedding / head) and returns the id of its last op,
// the op the next piece waits for; `x` is the op a piece's first op waits for. Costs are estimates
// for balanced routing (the runtime and the simulator write the sizes the gate decides into the ops).
// Gradient buckets are added by the pieces whose backward produces them (head, attention_backward,
// moe_backward, embed_backward), in the order the standard composition issues them.
//
// Chunks: dispatch() may cut the token exchange into n ops (micro = chunk, n_micro = n); chunk c
// carries, to each rank, the rows of the c-th of n contiguous parts of the experts that rank holds
// (ascending ids; MoeLayer::ep_dispatch_a2a). experts_forward() then runs one expert_fwd per chunk,
// each after its chunk arrived, so the experts of chunk 0 compute while chunk 1 is on the wire.
#pragma once

#include <cstdint>
#include <functional>
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

class StepBuilder {
 public:
  // REQUIRES: cfg.validate() ok; opt.world % opt.ep_size == 0; cfg.n_experts % opt.ep_size == 0;
  // opt.batch >= 1; replica gathers only with ep_size == world (std::invalid_argument otherwise).
  StepBuilder(const ModelConfig& cfg, const EpStepOptions& opt);

  const ModelConfig& model() const { return cfg_; }
  const EpStepOptions& options() const { return opt_; }
  // Whether block l's MoE layer runs as separate phases (gate, exchanges, experts): a MoE block
  // with more than one rank. Else its FFN (dense, or the whole MoE layer) is one ffn_fwd / ffn_bwd.
  bool expert_parallel(int64_t l) const;

  // ---- forward ----
  int embed_forward();
  int attention_forward(int64_t l, int x);
  int ffn_forward(int64_t l, int x);  // REQUIRES: !expert_parallel(l)
  // Pieces of an expert-parallel block (REQUIRES: expert_parallel(l)):
  int replica_gather(int64_t l);      // materialize: behind the attention (after the previous MoE
                                      // block's experts with rematerialize)
  int gate(int64_t l, int x);         // gate_fwd, then gate_sync; returns gate_sync
  int place(int64_t l, std::vector<int> deps);  // place (a compute op)
  int placed_gather(int64_t l, int place);      // materialize_placed
  // dispatch_fwd, then the exchange in `chunks` ops; returns their ids in chunk order. REQUIRES: chunks >= 1.
  std::vector<int> dispatch(int64_t l, int x, int chunks = 1);
  // One expert_fwd per chunk of `arrived` (dispatch's ids), chunk c after arrived[c]; the first also
  // after `before` (ids < 0 ignored: replica gathers). Returns the last.
  int experts_forward(int64_t l, const std::vector<int>& arrived, const std::vector<int>& before = {});
  int combine(int64_t l, int x);      // combine_a2a, combine_fwd
  // EP's MoE block after its attention: the options' gathers, gate, dispatch, experts, combine.
  int moe_forward(int64_t l, int x);
  int head(int x);                    // head_fwd, head_bwd, the head's gradient bucket

  // ---- backward ----
  int moe_backward(int64_t l, int x); // combine_bwd .. gate_bwd, expert gradient bucket, replica gathers
  int ffn_backward(int64_t l, int x); // REQUIRES: !expert_parallel(l)
  int attention_backward(int64_t l, int x);  // attn_bwd and the block's replicated-parameter bucket
  int block_backward(int64_t l, int x);      // the standard block's backward
  void embed_backward(int x);

  // The graph, validated (std::logic_error naming the op when a composition broke a rule of
  // step_graph.h). The builder is spent.
  EpStep finish();

  // A whole step in which only the expert-parallel blocks' forward after their attention is the
  // caller's (moe(builder, l, x) returns its last op): embed_forward; per block attention_forward,
  // then ffn_forward or moe; head; block_backward per block from the last; embed_backward; finish.
  // build_ep_step is compose with moe_forward. The builder is spent.
  using MoeForward = std::function<int(StepBuilder&, int64_t l, int x)>;
  EpStep compose(const MoeForward& moe);

 private:
  int compute(OpKind kind, int64_t layer, std::vector<int> deps, double flops, double bytes);
  int exchange(OpKind kind, Collective c, Group g, int64_t layer, std::vector<int> deps);
  void allreduce(GradBucket bucket, int dep, int64_t layer = -1);
  void block_buckets(int64_t l, GradBucket* dense, GradBucket* experts) const;

  ModelConfig cfg_;
  EpStepOptions opt_;
  double B_, T_, C_, F_, E_, K_, V_, N_;
  double ffn_mats_;  // 3 with SwiGLU, else 2
  bool distributed_ = false;
  EpStep step_;
  std::vector<int> expert_fwd_;  // [blocks] id of the last expert_fwd of block l
  int last_expert_fwd_ = -1;
};

}  // namespace moe::graph
