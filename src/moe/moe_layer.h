// Start here for src/moe: the Mixture-of-Experts FFN layer, single process.
//
// Phases, one file each, so the distributed strategies can put communication between them:
//   router.*  gate: linear -> softmax -> top-k, gate weights, aux and z losses
//   layout.*  expert-contiguous permutation of (token, choice) assignments; capacity dropping
//   experts.* one FFN GEMM chain per expert over its contiguous rows (GELU or SwiGLU)
//   combine.* gather rows into expert order; scale by gate weight and scatter back to tokens
//
// Math (the PyTorch reference in tests/ implements exactly this):
//   logits[N,E] = x @ router^T (+ router_bias);  probs = softmax(logits);  (idx, p)[N,K] = top-k of probs
//   gate weight w = p (K == 1, Switch) or p / sum_k p (K > 1 and renormalize, GShard)
//   y[n] = sum_k w[n,k] * FFN_{idx[n,k]}(x[n])            (dropped assignments contribute 0)
//   FFN_e(x) = w2[e] @ act(w1[e] @ x)  (GELU)  or  w2[e] @ (silu(w1[e] @ x) * (w3[e] @ x))  (SwiGLU)
//   aux  = E * sum_e f_e * P_e, f_e = share of the N*K top-k assignments (before dropping) that chose e,
//          P_e = mean over tokens of probs[:, e]; gradient flows through P_e only (Switch Transformer).
//   z    = mean over tokens of logsumexp(logits[n,:])^2 (ST-MoE router z-loss).
//   The layer's loss contribution is aux_loss_weight * aux + z_loss_weight * z; backward() adds its
//   gradient itself.
//   Capacity (capacity_factor > 0): each expert keeps at most ceil(cf * N * K / E) assignments,
//   filled in global order: all first choices in token order, then all second choices, ...
//   (defined on the whole batch, so it does not depend on how ranks split it: invariant 1, docs/architecture.md).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "moe/token_exchange.h"
#include "plan/placement.h"
#include "tensor/tensor.h"

namespace moe {
namespace comm {
class Communicator;
struct SparsePlan;
}

enum class Activation { gelu, swiglu };

struct MoeConfig {
  int64_t d_model = 0;   // C
  int64_t d_ffn = 0;     // F
  int64_t n_experts = 0; // E
  int64_t top_k = 1;     // K, 1 <= K <= E
  Activation activation = Activation::gelu;
  bool renormalize = true;        // K > 1: gate weights renormalized over the chosen K
  float capacity_factor = 0.0f;   // 0 = dropless
  float aux_loss_weight = 0.01f;
  float z_loss_weight = 0.001f;
  // Constant added to the router logits of every token ([E], or empty for none): the router skew that
  // makes imbalance reproducible (ModelConfig::router_skew). Part of the model, so every strategy and
  // rank count sees the same routing.
  std::vector<float> router_bias;
};

// Where each (token, choice) assignment went. Filled by the layout phase, read by every later phase.
struct Routing {
  int64_t N = 0, K = 0, E = 0;
  std::vector<int32_t> expert;         // [N*K] chosen expert of assignment n*K+k (descending prob)
  std::vector<float> prob;             // [N*K] router probability of that choice
  std::vector<float> weight;           // [N*K] gate weight; 0 for a dropped assignment
  std::vector<int64_t> expert_offset;  // [E+1] expert e owns permuted rows [off[e], off[e+1])
  std::vector<int32_t> row_token;      // [R] token of each permuted row (rows of one expert in token order)
  std::vector<int32_t> row_assignment; // [R] assignment index n*K+k of each permuted row
  std::vector<int64_t> tokens_per_expert;  // [E] assignments kept per expert (the load statistic)
  int64_t dropped = 0;                 // assignments dropped by capacity
  int64_t rows() const { return expert_offset.empty() ? 0 : expert_offset.back(); }
};

// Bytes of materialized expert replicas (weights + gradient buffers) held now by all the MoE layers
// that share it, and the peak since reset_peak(). Updated from whichever thread (de)allocates.
class ReplicaMemory {
 public:
  void add(int64_t bytes);
  int64_t now() const { return now_.load(); }
  int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_.store(now_.load()); }

 private:
  std::atomic<int64_t> now_{0}, peak_{0};
};

// Parameters (names relative to `prefix`, e.g. "blocks.0.moe."):
//   router.weight [E,C];  w1 [E,F,C];  w2 [E,C,F];  w3 [E,F,C] (SwiGLU only)
// Thread safety: none. Buffers are sized for max_tokens at construction and reused.
class MoeLayer {
 public:
  MoeLayer(const std::string& prefix, const MoeConfig& cfg, int64_t max_tokens);
  const MoeConfig& config() const { return cfg_; }
  std::vector<Param*> params();

  // y = MoE(x). REQUIRES: N <= max_tokens. Records routing() and the losses.
  void forward(float* y /*[N,C]*/, const float* x /*[N,C]*/, int64_t N);
  // dx += d(loss)/dx given dy = d(loss)/dy; accumulates parameter gradients, including the
  // aux/z-loss terms. REQUIRES: forward() on the same x just before.
  void backward(float* dx /*[N,C]*/, const float* dy /*[N,C]*/);

  float aux_loss() const { return aux_loss_; }   // unweighted
  float z_loss() const { return z_loss_; }       // unweighted
  // aux_loss_weight * aux + z_loss_weight * z: what this layer adds to the training loss.
  float weighted_loss() const { return cfg_.aux_loss_weight * aux_loss_ + cfg_.z_loss_weight * z_loss_; }
  const Routing& routing() const { return routing_; }

  // Expert parallelism. `ep` is the group that together holds one copy of every expert: with
  // P = ep->size() > 1, experts [rank*E/P, (rank+1)*E/P) run here on the rows every group rank sends
  // them (alltoallv), and the results go back the same way. `batch` (default: ep) is the group whose
  // ranks together hold the global batch, ordered by batch rank (rank 0's tokens first); with more
  // batch ranks than ep ranks, each ep group is one replica of the experts (comm::Groups: ep groups
  // of consecutive ranks) and the caller sums expert gradients over the replicas.
  // Aux and z losses, f_e, P_e and capacity dropping are those of the global batch (the same numbers
  // on every rank), so the mathematics is that of one process running the whole batch (invariant 1,
  // docs/architecture.md).
  // Parameters: with P > 1, w1, w2, w3 keep only this rank's experts (Param::sharded, rows
  // [rank*E/P, ...) of the full tensors, sliced from the current values; after reshard() the experts
  // Param::shard_rows lists); the router stays whole.
  // Gradients: the router's is this rank's share (sum over batch ranks); an expert's is this
  // replica's share (sum over replicas; complete when there is one replica).
  // Collective failures throw std::runtime_error naming the rank and operation.
  // REQUIRES: E % P == 0; batch->size() % P == 0; called at most once, before an optimizer is
  // built over params(); the groups outlive the layer.
  void set_expert_parallel(comm::Communicator* ep, comm::Communicator* batch = nullptr);
  bool expert_parallel() const { return ep_ != nullptr; }
  // The exchange forward()'s expert-parallel path used last (its rows per source, expert, holder).
  const TokenExchange& forward_exchange() const { return own_exchange_; }
  // Wall seconds forward()'s expert-parallel path spent in each phase, summed since the last take:
  // gate (router, statistics exchange), exchange (layout, both all-to-alls, combine; waiting for a
  // busier rank included), experts (this rank's expert GEMMs). For serving's per-stage metrics; a
  // caller running the ep_* phases itself times them itself.
  struct ForwardSeconds {
    double gate = 0, exchange = 0, experts = 0;
  };
  ForwardSeconds take_forward_seconds() { return std::exchange(forward_seconds_, {}); }

  // The expert-parallel forward and backward phase by phase, for the runtime (src/graph: one graph
  // op each). forward()/backward() run them in this order; a caller running them itself must too.
  // Compute phases touch no communicator; communication phases (ep_gate_sync: batch group; the
  // *_a2a*: ep group) do nothing else but exchange, so they can run on a communication thread.
  // From ep_dispatch on, the phases of one step read the step's TokenExchange (token_exchange.h),
  // which the caller owns and passes to each (the same object through the step).
  // REQUIRES: expert_parallel().
  void ep_gate(const float* x /*[N,C]*/, int64_t N);  // router, local statistics (x kept until ep_gate_bwd)
  // Counts + statistics over the batch group. sum_also (optional): more values summed over the group
  // in the statistics' allreduce, in place (the serving engine's next-layer popularity estimate rides
  // along instead of a collective of its own).
  void ep_gate_sync(std::vector<double>* sum_also = nullptr);
  // Global aux/z/capacity, layout, the exchange planned into *ex, rows packed.
  void ep_dispatch(TokenExchange* ex);
  void ep_dispatch_a2a(const TokenExchange& ex);       // the rows, to the experts' holders
  void ep_experts(TokenExchange* ex);                  // my held experts over the received rows
  // The same two phases in n chunks, so a step can pipeline the exchange with the experts: chunk c
  // carries to each rank d the rows of the c-th of n contiguous parts of the experts d holds this
  // step (plan::exchange_chunks), and ep_experts(ex, c, n) runs my held experts of chunk c once it
  // arrived. Run chunks 0..n-1 of each in order. The results equal the unchunked phases' bit for
  // bit. ep_experts returns the rows it computed. REQUIRES: 0 <= chunk < n.
  void ep_dispatch_a2a(const TokenExchange& ex, int chunk, int n_chunks);
  int64_t ep_experts(TokenExchange* ex, int chunk, int n_chunks);
  void ep_combine_a2a(const TokenExchange& ex);        // results back to the tokens' ranks
  void ep_combine(const TokenExchange& ex, float* y /*[N,C]*/);  // gate-weighted sum
  void ep_combine_bwd(const TokenExchange& ex, const float* dy /*[N,C]*/);
  void ep_combine_a2a_bwd(const TokenExchange& ex);
  void ep_experts_bwd(const TokenExchange& ex);
  void ep_dispatch_a2a_bwd(const TokenExchange& ex);
  void ep_gate_bwd(const TokenExchange& ex, float* dx /*[N,C]*/);  // dx += token-row and router gradients
  // DeepSpeed-MoE's fixed-size exchange: every rank sends every expert S slots, S = the most rows any
  // rank of the ep group keeps for any expert this step (what DeepSpeed's dropless mode agrees on with
  // an allreduce-max; here every rank knows it from the synced counts), its kept rows first and zeros
  // after; each expert computes over all P * S slots it receives (the padding's GEMM cost included),
  // and only the real rows go back to their tokens. Dropping follows the global rule above, so the
  // mathematics is EP's. REQUIRES: expert_parallel(), no placements enabled, before the first step.
  void set_padded_exchange(bool on);
  // Benchmarks only (the "ideal" reference of Lina's serving figures): replaces the router's choices by a
  // perfectly balanced gate, token n's k-th choice being expert (n * K + k + shift) mod E with gate
  // weight 1 / K (shift: this rank's place in the batch group times N, so the ranks interleave). The
  // layer then computes another function: its output is meaningless, its load is even.
  void set_balanced_gate(bool on) { balanced_gate_ = on; }
  // Replaces the router bias (MoeConfig::router_bias) from the next forward on: a drifting router skew
  // (ModelConfig::router_skew_drift) turns it between steps (the backward does not read it).
  // REQUIRES: bias empty or [E] (std::invalid_argument otherwise).
  void set_router_bias(std::vector<float> bias);
  // Rows this rank's experts processed in the last forward (all rows when not expert-parallel).
  int64_t expert_rows() const { return expert_rows_; }

  // ---- placements: experts held this step by more ranks than their owner (Hecate, FasterMoE) ----
  // Every expert-parallel layer runs over a placement; without enable_placements it is EP's: each
  // expert held by its owner only (plan::even_placement). With placements enabled, a step may hold
  // extra replicas of experts (plan::LayerPlacement: the owners are this layer's expert-parallel
  // shards, replicas[e] ⊇ {owner[e]}), and re-sharding may move owners. Tokens go where
  // plan::dispatch_plan sends them under set_dispatch_rule's rule (by default a replica on the token's
  // rank, else on its node, else any, spread evenly); a replica's weights come from its owner by
  // SparseAllGather (ep_materialize) and its gradient goes back, summed into the owner's, by
  // SparseReduceScatter (ep_reduce_replica_grads).
  // The mathematics is that of EP (invariant 1, docs/architecture.md); only rows move and the order of some float
  // sums changes. Without extra replicas and re-sharding the step is EP's, bit for bit.
  // REQUIRES: set_expert_parallel(ep, batch) with ep and batch of the same ranks (one copy of every expert over the
  // batch group); nodes has one entry per ep rank; called before the first step.
  // memory: where this layer accounts its replica buffers (may be shared by layers; outlives the layer).
  // gather: the communicator of the sparse collectives (the ep group's ranks; not used by another
  // thread while they run: the runtime's gather lane), so they can run beside the all-to-alls.
  void enable_placements(const plan::Nodes& nodes, ReplicaMemory* memory, comm::Communicator* gather);
  bool placements_enabled() const { return gather_ != nullptr; }
  const plan::LayerPlacement& owners() const { return owners_; }  // replicas == {owner}
  // The placement for the rest of this step: before ep_dispatch (e.g. from predicted loads, then
  // ep_materialize behind the attention), or after ep_gate_sync from routed_counts() (FasterMoE,
  // Hecate's calibration), then ep_materialize again. The same value on every rank (invariant 2).
  // REQUIRES: placements enabled; p.validate() ok, p.owner == owners().owner, and p holds every
  // replica materialized since the last release_replicas (std::logic_error); not while an
  // ep_materialize of this layer runs (the runtime orders them: graph/ep_builder.h).
  void set_placement(const plan::LayerPlacement& p);
  const plan::LayerPlacement& placement() const { return placement_; }
  // How tokens are spread over an expert's replicas (plan::DispatchRule): nearest (the default,
  // Hecate's: a replica on the token's rank, else its node) or even (Lina's: every holder an equal
  // share of the expert's tokens). The same on every rank; not between ep_gate_sync and ep_combine.
  void set_dispatch_rule(plan::DispatchRule rule) { dispatch_rule_ = rule; }
  plan::DispatchRule dispatch_rule() const { return dispatch_rule_; }
  // Inference with a cache of replicas (weights never change): tokens go where p says, and the
  // replicas held now that p does not use stay held, receiving no rows (retain_replicas drops them);
  // the next ep_materialize gathers only p's replicas not held. The same value on every rank.
  // REQUIRES: placements enabled; p.validate() ok, p.owner == owners().owner (std::logic_error).
  void set_inference_placement(const plan::LayerPlacement& p);
  // The replicas materialized now: placement()'s and, after set_inference_placement, the cached ones.
  const plan::LayerPlacement& held() const { return held_; }
  // Communication (ep group): replicas of placement() not held yet arrive from their owners (or from
  // ranks that already got them); held() becomes held() + placement(). A no-op when nothing is missing.
  void ep_materialize();
  // Communication (ep group): every replica's weight gradient summed into its owner's (after
  // ep_experts_bwd). The replicas' own gradient buffers are left unspecified.
  void ep_reduce_replica_grads();
  // Inference, where weights never change: keeps the replicas held now that `keep` also holds (their
  // weights stay valid, so the next ep_materialize gathers only what is new) and drops the others;
  // placement() becomes the replicas kept. Collective in effect: every rank calls it with the same
  // `keep` (no communication). REQUIRES: placements enabled; keep.validate() ok with this layer's
  // owners (std::logic_error).
  void retain_replicas(const plan::LayerPlacement& keep);
  // Drops the materialized replicas (placement() is kept, so ep_materialize gathers them again).
  // free_memory: give their buffers back (re-materialization); else keep them for the next step.
  void release_replicas(bool free_memory);
  // Assignments each rank of the ep group routes to each expert this step after capacity dropping,
  // [R][E]. Valid after ep_gate_sync (computed from the synced counts, the same on every rank).
  std::vector<std::vector<int64_t>> routed_counts() const;
  // Re-sharding (Hecate's Alg. 2, SmartMoE): expert e's shard moves to rank new_owner[e] with its
  // optimizer state. moments[i]: the AdamW first and second moments of expert_params()[i], moved and
  // reallocated here with the values (Param::shard_rows says which experts a rank then owns, in
  // ascending order). Gradients restart at zero; placement() becomes the new owners. Collective over
  // the ep group (on the gather communicator, idle between steps). Returns the experts that moved.
  // REQUIRES: placements enabled, between steps (no replica held), new_owner [E] in [0, R),
  // moments.size() == expert_params().size() with tensors of the params' shapes (std::logic_error).
  int reshard(const std::vector<int>& new_owner, const std::vector<std::pair<Tensor*, Tensor*>>& moments);
  std::vector<Param*> expert_params();  // w1, w2 (, w3 for SwiGLU)
  // Bytes this rank sent to each ep rank, and received, in the last ep_materialize /
  // ep_reduce_replica_grads.
  const std::vector<int64_t>& sparse_peer_bytes() const { return sparse_peer_bytes_; }
  int64_t sparse_received_bytes() const { return sparse_received_bytes_; }
  // Bytes this rank sent + received in sparse collectives since the last call (then reset).
  int64_t take_sparse_bytes();
  // Bytes held in this layer's replica weights and gradient buffers now.
  int64_t replica_bytes() const { return replica_bytes_; }

 private:
  MoeConfig cfg_;
  int64_t max_tokens_;
  Param router_, w1_, w2_, w3_;
  Routing routing_;
  float aux_loss_ = 0, z_loss_ = 0;
  // Saved by forward for backward (x_ is the caller's buffer, which must stay unchanged until backward).
  const float* x_ = nullptr;
  int64_t n_ = 0;
  // Buffers sized at construction for max_tokens (NK = max_tokens * K rows at most); shapes:
  //   logits_, probs_, dprobs_, dlogits_ [N,E]; lse_ [N]; load_frac_, mean_prob_ [E]
  //   xp_, outp_, dout_p_, dxp_ [NK,C]; h1_, h3_ (SwiGLU), act_, dact_, dh_, dh3_ (SwiGLU) [NK,F]
  //   row_weight_ [NK]; dgate_ [NK]
  Tensor logits_, probs_, lse_, load_frac_, mean_prob_;
  Tensor xp_, h1_, h3_, act_, outp_, row_weight_;
  Tensor dout_p_, dgate_, dh_, dh3_, dact_, dxp_, dprobs_, dlogits_;
  std::vector<int64_t> layout_scratch_;  // [layout_scratch_size(E, K)], see layout.h
  int64_t expert_rows_ = 0;

  // ---- expert parallelism (see set_expert_parallel) ----
  void forward_ep(float* y, const float* x, int64_t N);
  void backward_ep(float* dx, const float* dy);
  comm::Communicator* ep_ = nullptr;
  comm::Communicator* batch_ = nullptr;
  int64_t loss_tokens_ = 0;                 // tokens of the global batch
  std::vector<int64_t> local_counts_;       // [K*E] this rank's choice-k assignments to e (k-major)
  std::vector<int64_t> all_counts_;         // [R*K*E] every batch rank's local_counts_
  std::vector<double> stats_;               // [E+2] sum probs per expert, sum lse^2, tokens
  std::vector<int64_t> prior_;              // [E*K] see layout_build
  std::vector<int64_t> batch_rank_of_ep_;   // [P] batch rank of each ep group rank
  // Rows received for my experts (up to P*max_tokens*K): source-major (as the alltoallv delivers
  // them) and expert-major (one contiguous block per held expert, for the GEMMs). Workspace: what a
  // step's exchange means is in its TokenExchange.
  Tensor xr_, xe_, ye_, yr_, dr_, de_, dxe_, dxr_;
  // My rows in the send order when it is not the layout's (!TokenExchange::send_in_place): [NK,C],
  // allocated at the first such step.
  Tensor xs_;
  // The exchange of forward()/backward() called whole (tests, evaluation).
  TokenExchange own_exchange_;
  ForwardSeconds forward_seconds_;
  void plan_exchange(TokenExchange* ex);  // rows, counts and displacements, send_perm
  void plan_padded_exchange(TokenExchange* ex, const std::vector<std::vector<int64_t>>& kept);  // the same, padded
  void order_received_rows(TokenExchange* ex);  // perm, local_offset, held_order for this step's held experts
  void to_send_order(const TokenExchange& ex, float* dst /*[send rows, C]*/, const float* src /*[rows, C] expert-major*/);
  void size_received_buffers(int64_t rows);  // every buffer of received rows to [rows, C] or [rows, F], zeroed
  void grow_exchange_buffers(int64_t received_rows, int64_t sent_rows);
  bool padded_ = false;        // set_padded_exchange
  bool balanced_gate_ = false; // set_balanced_gate
  void balance_routing(int64_t N);

  // ---- placements (see enable_placements); implemented in moe_layer_replicas.cpp ----
  void ensure_replica_slots(int64_t slots);     // grows the slot buffers, keeping their contents
  std::vector<float*> chunk_pointers(bool grads);  // [W*E] see ep_materialize
  // After a sparse collective of `plan`: this rank's bytes sent to each peer and received, and the
  // running sparse_bytes_.
  void record_sparse_traffic(const comm::SparsePlan& plan, int64_t chunk_bytes);
  plan::Nodes nodes_;                           // node of each ep rank (all 0 until enable_placements)
  plan::DispatchRule dispatch_rule_ = plan::DispatchRule::nearest;
  plan::LayerPlacement owners_, placement_, held_;  // held_: materialized now
  std::vector<int> owned_;                      // experts this rank owns, ascending (rows of w1_, w2_, w3_)
  std::vector<int> replica_expert_;             // [S] the expert in each used replica slot, in gather order
  std::vector<int> released_order_;             // replica_expert_ at the last release_replicas
  // Replica slots: weights rw1_ [S,F,C], rw2_ [S,C,F], rw3_ [S,F,C] (SwiGLU) and their gradients.
  Tensor rw1_, rw2_, rw3_, rg1_, rg2_, rg3_;
  int64_t slot_capacity_ = 0;
  std::vector<float> reduce_scratch_;
  std::vector<int64_t> sparse_peer_bytes_;
  int64_t sparse_received_bytes_ = 0;  // by this rank in the last sparse collective
  int64_t sparse_bytes_ = 0, replica_bytes_ = 0;
  ReplicaMemory* memory_ = nullptr;
  comm::Communicator* gather_ = nullptr;
};

}  // namespace moe
