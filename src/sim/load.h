// Loads for the simulator: how many token assignments each rank routes to each expert, per step and
// per MoE layer, and the function that turns a load into an expert-parallel graph's run-time sizes
// exactly as the runtime computes them (runtime/ep_step_bodies.cpp, moe/moe_layer.cpp).
//
// A load gives, for step s and MoE layer i (the i-th block with is_moe_layer, in block order),
// tokens[r][e]: the assignments source rank r routes to expert e after capacity dropping, top-k
// counted (a token choosing K experts counts once for each), r over the world (the batch group).
//
// Sources (LoadSpec::parse):
//   "uniform"            every rank spreads its N*K assignments evenly over the experts (the
//                        remainder to experts (r + j) mod E, j < remainder, so the totals stay even).
//   "zipf:S"             every rank routes share p_j ∝ 1/(j+1)^S to the expert of popularity rank j,
//                        block l's order being expert (l + j) mod E (as --router-skew orders them),
//                        with no expert above N per rank (a token picks an expert once; the excess
//                        goes to the others in proportion); counts by largest remainder.
//   "zipf-drift:S[,R]"   zipf:S whose popularity order turns by floor(R * step) experts at step
//                        `step` (0-based): the hot expert of block l at step s is (l + floor(R s)) mod E.
//                        R (experts per step, default 1) > 0.
//   FILE (a .jsonl)      a `moe train --metrics` file, replayed: step s uses the s-th line with a
//                        "tokens_per_expert" (cycling when more steps are asked than recorded), layer i
//                        its i-th list. Those are global counts (summed over ranks), so each count c is
//                        spread evenly over the R source ranks: rank r gets c / R, plus 1 if r < c mod
//                        R. Per-rank receive counts (what each expert's owner gets) are therefore exact;
//                        per-source splits are not recorded and are an approximation.
// Capacity (ModelConfig::capacity_factor > 0) applies to synthetic loads per expert on the global
// count, ceil(cf * N_global * K / E), keeping the first ranks' assignments (the runtime keeps by
// global choice-major order; rank order is an approximation). Recorded loads are already kept counts.
// Determinism: no randomness anywhere.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "graph/ep_builder.h"
#include "model/config.h"
#include "plan/placement.h"
#include "util/status.h"

namespace moe::sim {

struct LoadSpec {
  enum class Kind { uniform, zipf, zipf_drift, recorded };
  Kind kind = Kind::uniform;
  double s = 0;        // zipf exponent, >= 0
  double rate = 1;     // zipf-drift: experts per step, > 0
  std::string file;    // recorded
  // "uniform" | "zipf:S" | "zipf-drift:S[,R]" | anything else: a file path. Errors name the text.
  static Status parse(const std::string& text, LoadSpec* out);
  std::string describe() const;  // "zipf:1.2", "recorded (run.jsonl, 20 steps)" needs the file: just the path
};

// tokens[i][r * E + e] for MoE layer i (one step).
using StepLoad = std::vector<std::vector<int64_t>>;

class Load {
 public:
  // REQUIRES nothing; errors: a recorded file that cannot be read, has no "tokens_per_expert" lines,
  // or whose layer count or expert count differs from cfg's (named), a count that is not an integer
  // >= 0, a layer whose counts sum past 2^60 / (d_model * n_experts) (no real step comes near; the
  // simulator's byte counts stay in int64), and cfg.validate() failing. A line's "tokens_per_source"
  // ([layer][rank][expert], checked alike) is replayed as each rank's own counts when it records
  // `ranks` ranks; without it each expert's global count is split evenly over the ranks, which hides
  // how unevenly the ranks' tokens choose (what sizes DeepSpeed's padded exchange).
  // tokens_per_rank: N = sequences per rank * seq_len.
  static Status make(const LoadSpec& spec, const ModelConfig& cfg, int ranks, int64_t tokens_per_rank, Load* out);

  // The load of step `step` (0-based). REQUIRES: step >= 0.
  StepLoad step(int64_t step) const;
  int recorded_steps() const { return static_cast<int>(recorded_.size()); }  // 0 for synthetic loads
  int moe_layers() const { return moe_layers_; }

 private:
  LoadSpec spec_;
  ModelConfig cfg_;
  int ranks_ = 1;
  int64_t tokens_ = 0;
  int moe_layers_ = 0;
  std::vector<int> moe_blocks_;  // block index of MoE layer i
  std::vector<std::vector<std::vector<int64_t>>> recorded_;  // [step][layer][e], global counts
  // [step][layer][r * E + e]: each source rank's counts where the line recorded them for `ranks_` ranks
  // (moe train's "tokens_per_source"), else empty: the step splits the global counts evenly.
  std::vector<std::vector<std::vector<int64_t>>> recorded_source_;
};

// When `op` is one chunk of a dispatch cut in chunks, or the expert_fwd of one (n_micro > 1): the
// chunk of each (rank, expert) pair over `holders` (plan::exchange_chunks), so its sizes count chunk
// op.micro's experts only; empty for every other op (all experts count).
std::vector<std::vector<int>> op_exchange_chunks(const graph::Op& op, const plan::LayerPlacement& holders);

// Writes into `g` (a graph of a strategy's step for opt, built from graph/step_builder.h's pieces,
// for rank `rank`) the sizes the runtime fills in when the gate has run, from `load` (one step):
//   dispatch_a2a, combine_a2a_bwd (to the experts): peer_bytes[j] = 4 * C * (rows rank sends to ep
//     rank j: sum over j's experts of tokens[rank][e]), bytes = their sum (the self entry included,
//     as EpStepBodies counts it);
//   combine_a2a, dispatch_a2a_bwd (back): peer_bytes[j] = 4 * C * (rows ep rank j sent here);
//   expert_fwd, expert_bwd: flops = passes * 2 * mats * rows * C * F (passes 1 / 2, mats 3 for
//     SwiGLU else 2, rows = the rows this rank's experts receive), as EpStepBodies sets them; bytes
//     scaled from the builder's balanced estimate by rows / (N * K) (the runtime leaves the estimate);
//   a dispatch cut in chunks (n_micro > 1) and its expert_fwd chunks: the same sums over the experts
//     of chunk `micro` only (plan::exchange_chunks);
//   gate_sync: bytes = 8 * K * E, this rank's part of the counts allgather (the runtime leaves 0; its
//     second collective, an allreduce of E + 2 doubles, is not modeled).
// REQUIRES: load has one entry per MoE layer of R * E counts with R = opt.world; no placement
// options (std::logic_error).
void fill_ep_costs(const ModelConfig& cfg, const graph::EpStepOptions& opt, const StepLoad& load, int rank,
                   graph::StepGraph* g);

}  // namespace moe::sim
