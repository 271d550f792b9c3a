// Start here for src/serve: inference on a trained model, in one process or over expert-parallel ranks.
//
//   engine.*   InferenceEngine: one forward over a ragged set of rows (sequence slot, position,
//              token) with a KV cache, so the prefill of new prompts and the decode steps of running
//              sequences share one pass (continuous batching)
//   sampler.*  the next token from a row's logits: greedy, temperature, top-k, top-p, seeded per
//              request so the choice does not depend on which rank or batch ran it
//   generate.* `moe generate`: one prompt, its continuation streamed to stdout
//
// Dimension letters: C d_model, NH heads, HS = C / NH, F d_ffn, V vocabulary, T seq_len (the context:
// the model has T learned positions), S slots (sequences the KV cache holds), N rows of one forward.
#pragma once

#include <cstdint>
#include <future>
#include <optional>
#include <span>
#include <vector>

#include "comm/communicator.h"
#include "model/model.h"
#include "moe/token_exchange.h"
#include "plan/lina.h"
#include "tensor/tensor.h"

namespace moe::serve {

// One token of one sequence to run through the model.
struct Row {
  int32_t slot = 0;     // the sequence's KV-cache slot, in [0, S)
  int32_t pos = 0;      // its position, in [0, T)
  int32_t token = 0;    // in [0, V)
  bool logits = false;  // return this row's next-token logits
};

// How the experts of each MoE layer are spread over the ranks during a forward (plan/lina.h):
//   ep                static expert parallelism: every expert on its owner only
//   lina              Lina: phase 1 replicates the experts its path profile estimates popular before the
//                     gate; phase 2 re-plans with the real counts when the top-k experts differ
//   lina_no_estimate  Lina planning only after the gate, from the real counts (every layer blocks on it)
//   lina_no_phase2    Lina's phase 1 only: the estimate's plan, whatever the gate chooses
//   ideal             ep with a perfectly balanced gate (MoeLayer::set_balanced_gate): the latency an even
//                     load would have, the reference Lina's figures are normalised by. Its text is
//                     meaningless.
// The first MoE layer has no path to estimate from: lina plans it after the gate, lina_no_phase2 runs
// it as ep.
enum class Schedule { ep, lina, lina_no_estimate, lina_no_phase2, ideal };
// "ep", "lina", "lina-no-estimate", "lina-no-phase2", "ideal"; parse_schedule returns false for other names.
const char* schedule_name(Schedule s);
bool parse_schedule(const std::string& name, Schedule* out);

// What the scheduling did, summed over MoE layers and forwards (the same on every rank).
struct ScheduleStats {
  int64_t layer_steps = 0;     // MoE layer forwards over several ranks
  int64_t estimated = 0;       // ... with a phase-1 estimate
  int64_t accurate = 0;        // ... whose estimate had the real top-k experts (Lina's accuracy)
  int64_t replanned = 0;       // phase-2 re-plans
  int64_t replicas = 0;        // extra expert replicas placed (sum over layer forwards)
  int64_t gathered_bytes = 0;  // expert weights this rank sent and received for replicas
  int64_t cached = 0;          // replicas held but unused by the plan (the replica cache), summed likewise
  // Expert rows (token assignments) the busiest rank ran and the mean over the ranks, summed over
  // MoE layer forwards of every schedule (ep's too): busiest / mean is the load imbalance a
  // schedule leaves, the step's critical path Lina's replicas shorten.
  int64_t busiest_rank_rows = 0;
  double mean_rank_rows = 0;
};

// Where this rank's forward() calls spent their wall time, in seconds summed over the calls. Unlike
// ScheduleStats these are this rank's own clock, so they differ between ranks; a rank waits for a
// busier one inside the collectives (gate: the statistics exchange; exchange: the all-to-alls).
struct StageSeconds {
  int64_t forwards = 0;  // forward() calls, heartbeats with no rows included
  double total = 0;      // forward() from start to end
  double gate = 0;       // MoE layers: router and its statistics exchange
  double exchange = 0;   // MoE layers: layout, both all-to-alls, combine
  double experts = 0;    // MoE layers: this rank's expert GEMMs
  double schedule = 0;   // Lina's work on this thread: estimate, plans, placing, waiting for a gather
  // The rest of total: embedding, attention, dense blocks, norms, logits.
  double other() const { return total - gate - exchange - experts - schedule; }
  StageSeconds& operator+=(const StageSeconds& o) {
    forwards += o.forwards, total += o.total, gate += o.gate, exchange += o.exchange, experts += o.experts;
    schedule += o.schedule;
    return *this;
  }
};

// Thread safety: none (one thread drives it; the kernels inside use OpenMP).
class InferenceEngine {
 public:
  // model: the weights, loaded; expert-parallel already when the ranks share the experts
  // (Model::set_expert_parallel with ep == batch, every rank holding an engine). Not owned; it must
  // outlive the engine, and its training activations are not used. slots: sequences held at once.
  // max_rows: the most rows of one forward(). REQUIRES: slots >= 1, 1 <= max_rows <=
  // model.max_batch() * T (what the MoE layers were sized for).
  InferenceEngine(Model& model, int64_t slots, int64_t max_rows);
  ~InferenceEngine();
  InferenceEngine(const InferenceEngine&) = delete;
  InferenceEngine& operator=(const InferenceEngine&) = delete;

  const ModelConfig& config() const { return cfg_; }
  int64_t slots() const { return slots_; }
  int64_t max_rows() const { return max_rows_; }

  // Runs `rows` through the model. First every row's key and value go into its slot's cache at its
  // position (layer by layer), then each row attends to positions 0..pos of its slot: so a prompt
  // prefilled in one call attends causally within itself, and a decode row sees everything cached
  // before. The positions 0..pos-1 of a row's slot must hold that sequence's tokens (written by this
  // or earlier calls since the slot was last reused). logits: [n, V] for the n rows with
  // Row::logits, in row order (null when n == 0).
  // Expert parallel: collective over the MoE layers' group; every rank calls it the same number of
  // times, each with its own rows (none is fine). REQUIRES: rows.size() <= max_rows, fields in range
  // (std::logic_error). Collective failures throw std::runtime_error naming the rank.
  void forward(std::span<const Row> rows, float* logits);

  // Schedules other than ep replicate experts over `world`, the MoE layers' group (Model::
  // set_expert_parallel(world, world)), the holders of an expert splitting its tokens so that the ranks
  // level (plan::DispatchRule::balanced); lina and lina_no_phase2 estimate from `profile` (not owned;
  // outlives the engine; its layers are the model's MoE blocks). Call once, before serving's first
  // forward (start-up's profiling forwards run before it, under ep: serve::start_schedule), on every
  // rank alike. REQUIRES: the model expert-parallel over world (std::logic_error).
  void set_schedule(Schedule s, const plan::PathProfile* profile, comm::Communicator* world);
  Schedule schedule() const { return schedule_; }
  // Prices the lina schedules' replicas (plan::lina_placement): a replica only where it saves more
  // than its move. Unset, every replica the popularity asks for is gathered. The same on every rank.
  // While serving, the curve follows the experts' own runs: every kRefitForwards forwards the ranks
  // sum what each measured (plan::LinaCurveFit; one allreduce) and refit it, start-up's curve the
  // prior and older runs weighing half as much at each refit.
  void set_lina_cost(const plan::LinaCost& cost);
  const std::optional<plan::LinaCost>& lina_cost() const { return cost_; }
  static constexpr int64_t kRefitForwards = 64;
  // The replica cache of the lina schedules: a replica the plan stops using stays on its rank, up to
  // `per_rank` such replicas per rank and MoE layer (the most recently used; each costs one expert's
  // weights of memory), so a later plan that wants it again gathers nothing. With a cache, a priced
  // plan buys a replica by rent or buy (plan::lina_placement's foregone): once the savings it refused
  // for it pass its move. 0 (the default): only the plan's replicas are held, each priced against one
  // step's saving. The same on every rank; call before the first forward.
  void set_replica_cache(int per_rank) { replica_cache_ = per_rank < 0 ? 0 : per_rank; }
  int replica_cache() const { return replica_cache_; }
  // One of this rank's experts' forward time at each of `rows` rows, for plan::LinaCost's curve: every
  // expert of every MoE block run in turn (as a step runs them, so each one's weights come from
  // wherever the others left them), 5 passes over the sizes in turn, the median of each. Zeros when
  // this rank holds no expert. REQUIRES: rows non-empty, each >= 1.
  std::vector<double> measure_expert_seconds(const std::vector<int64_t>& rows) const;
  const ScheduleStats& schedule_stats() const { return stats_; }
  // Zeroes schedule_stats(), stage_seconds() and the expert loads, so that they count serving's
  // forwards and not start-up's (serve::profile_routing runs the profiling windows through forward()).
  void reset_counters() { stats_ = {}, stages_ = {}, take_expert_loads(); }
  const StageSeconds& stage_seconds() const { return stages_; }
  // The same for the last forward() alone.
  const StageSeconds& last_stage_seconds() const { return last_stages_; }
  // The last forward()'s expert GEMM seconds in each MoE block ([moe_blocks()]; they sum to
  // last_stage_seconds().experts): every rank waits at each block's exchange for the slowest one.
  const std::vector<double>& last_block_expert_seconds() const { return block_experts_; }
  // The last forward's routing of its rows: [N][Lm*K] every row's top-k experts at each MoE block
  // (block order, then choice order). For profiling.
  const std::vector<int32_t>& last_routes() const { return routes_; }
  int64_t moe_blocks() const { return n_moe_; }

  // Assignments this rank's rows sent to each expert, per block ([L][E]; zeros for a dense block),
  // since the last call (then reset).
  std::vector<std::vector<int64_t>> take_expert_loads();

 private:
  struct Block;  // one transformer block's weights (pointers into the model)
  void attention(int64_t l, std::span<const Row> rows);
  void count_rank_rows(const TokenExchange& ex);
  // MoE block l (its m-th MoE block) under a schedule other than ep: phase 1 before the block's
  // attention (its gather overlaps it), then the rest with y = tmp_, x = ln_.
  bool estimates() const;  // lina and lina_no_phase2: phase 1 plans from an estimate
  void refit_lina_cost();
  std::future<void> start_phase1(int64_t l, int64_t m);
  void scheduled_moe(int64_t l, int64_t m, int64_t N, std::future<void>* phase1);
  // The placement for MoE block l (its m-th) from popularity (plan::lina_placement, priced when a cost
  // is set), against the replicas held now; with the cache, rent or buy.
  plan::LayerPlacement plan_block(int64_t m, const MoeLayer& moe, const std::vector<double>& popularity);
  // Runs the next exchange of MoE block m over p: the replicas p lacks gathered, the others dropped or,
  // with the cache, kept up to its size.
  void place(int64_t m, MoeLayer* moe, const plan::LayerPlacement& p);

  Model& model_;
  ModelConfig cfg_;
  int64_t slots_, max_rows_;
  std::vector<Block> blocks_;
  const Param *wte_, *wpe_, *normf_w_, *normf_b_;
  // KV cache, per block: k_[l], v_[l] [S,T,C] (head h at columns [h*HS, (h+1)*HS)).
  std::vector<Tensor> k_, v_;
  // Scratch for N <= max_rows rows.
  Tensor x_;      // [N,C] residual stream
  Tensor ln_;     // [N,C] a norm's output
  Tensor norm_mean_, norm_rstd_;  // [N]
  Tensor qkv_;    // [N,3C]
  Tensor atty_;   // [N,C] attention output before proj
  Tensor tmp_;    // [N,C] proj / FFN output before the residual add
  Tensor h1_, h3_, act_;  // [N,F] dense FFN blocks
  Tensor att_;    // [N,NH,T] attention probabilities
  Tensor last_;   // [n,C] norm_f input of the logit rows
  std::vector<std::vector<int64_t>> loads_;  // [L][E]
  int64_t n_moe_ = 0;
  std::vector<int32_t> routes_;  // [N][Lm*K]
  std::vector<int32_t> paths_;   // [N][m+1] phase 1's paths at MoE block m's gate (scratch)
  Schedule schedule_ = Schedule::ep;
  const plan::PathProfile* profile_ = nullptr;
  comm::Communicator* world_ = nullptr;
  std::optional<plan::LinaCost> cost_;
  std::optional<plan::LinaCost> start_cost_;        // set_lina_cost's: the refits' prior
  std::optional<plan::LinaCurveFit> runs_, fitted_;  // this rank's runs since the last refit; all ranks' before
  std::vector<double> estimate_;       // phase 1's popularity estimate of the current MoE block ([E]; empty: none)
  std::vector<double> next_estimate_;  // the next MoE block's, summed over the ranks at this block's gate
  int replica_cache_ = 0;
  int64_t forwards_ = 0;  // forward() calls: the clock of last_used_
  // Per MoE block, [R*E] rank-major, the same on every rank: the replica savings the plans refused so
  // far (rent or buy), and the forward in which each replica was last in a plan (the cache's order).
  std::vector<std::vector<double>> foregone_;
  std::vector<std::vector<int64_t>> last_used_;
  // foregone_[m] as it was before phase 1 planned the current MoE block: a phase-2 re-plan replaces
  // phase 1's plan, so it prices from here and the savings refused on a wrong estimate do not count.
  std::vector<double> foregone_before_phase1_;
  ScheduleStats stats_;
  StageSeconds stages_, last_stages_;
  std::vector<double> block_experts_;  // [n_moe_]: last_block_expert_seconds()
  TokenExchange exchange_;
};

}  // namespace moe::serve
