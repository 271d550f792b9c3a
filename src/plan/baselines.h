// The planners of the systems Hecate is compared with, over our own types (issue 5, "baselines"), as
// Reconstructed from their papers and public code: FasterMoE's dynamic shadowing,
// FlexMoE's replica re-planning within reserved slots, SmartMoE's expert permutation. Like every
// planner here they are pure and deterministic (ties: lower expert id, lower rank); the caller keeps
// whatever state persists across steps (placements, step counters, load averages).
//
// What is reconstructed rather than taken from code is said at each planner.
#pragma once

#include <cstdint>
#include <vector>

#include "plan/placement.h"

namespace moe::plan {

// ---- FasterMoE dynamic shadowing (fmoe/fastermoe/shadow_policy.py, "global_policy") ----
// Every MoE forward, after the gate: shadow (broadcast to every rank) the hottest experts while its
// latency model says the busiest worker's compute and token traffic shrink by more than the broadcast
// costs. Taken from the code: unit costs, the latency formula's terms, the greedy order by load, and
// that one expert is never shadowed (the loop ends one expert early). Changed: loads are summed over
// source ranks (FastMoE v1 sums the wrong axis), the latency is the busiest rank's where a rank holds
// several experts, and the cheapest prefix of the order is kept (fastermoe_shadowed).

// The model's inputs (all > 0 and finite but weights_bandwidth, >= 0).
struct FasterMoeModel {
  int64_t d_model = 0;            // H
  double ffn_ratio = 0;           // a = d_ffn / H
  int64_t bytes_per_element = 4;  // s
  double bandwidth = 0;           // BW, network bytes/s
  double gemm_flops = 0;          // P, GEMM FLOP/s
  // n, how many times a shadow's bytes cross between ranks at a cost to the step (>= 1): 1 as in
  // FasterMoE, whose GPUs reduce the shadows' gradients beside the backward; 2 on CPU ranks, where that
  // reduce takes the compute's cores as the broadcast does (the same count as Hecate's replicas).
  int transfers_per_shadow = 1;
  // BW for t_m, bytes/s an expert's weights move at (0: bandwidth, FasterMoE's one BW). The trainer
  // measures both: the links, and what the steps' weight transfers achieve beside its compute.
  double weights_bandwidth = 0;
  // Ranks that take turns on shared CPU cores: the compute term prices their rows by busiest_load
  // (plan/placement.h). Empty: each rank computes on its own.
  CorePools cores{};
};

// Seconds per unit: t_c = 4aH^2/P (forward GEMMs of one token), t_f = H*s/BW (moving one token once),
// t_m = n*2aH^2*s/BW_w (moving one expert's weights, n times; BW_w = weights_bandwidth, else BW).
struct FasterMoeUnitCosts {
  double t_c = 0, t_f = 0, t_m = 0;
};
FasterMoeUnitCosts fastermoe_unit_costs(const FasterMoeModel& model);

// The experts to shadow, in the order chosen. owner [E]: the rank holding each expert; counts [R][E]:
// c[w][e], tokens rank w routes to expert e; L_e = sum over w of c[w][e]. With S the experts shadowed
// so far, rank w's rows are
//   B_w(S) = sum over the experts e it owns, e not in S, of L_e  +  sum over e in S of c[w][e]
// (a shadowed expert's tokens are computed where they were routed from), and
//   Lat(S) = 3*t_c * busiest_load(B(S), cores) + 4*t_f * max_w B_w(S) + |S| * t_m
// (busiest_load is max_w B_w(S) where ranks share no cores: FasterMoE's (3*t_c + 4*t_f) * max_w B_w(S)).
// Repeatedly the hottest expert not in S held by the busiest rank (ties: lower ids) joins S, until
// that rank holds none with tokens or one expert is left; the shadowed set is the prefix of that
// order with the lowest Lat (the fewest on ties). FasterMoE's code stops at the first k whose Lat does
// not fall, which over ranks never shadows two equally hot experts of two ranks (each alone moves the
// maximum to the other). It also takes the hottest remaining expert's L_e as the latency
// (Lat_k = (3 t_c + 4 t_f) L(k+1) + k t_m), the same where each rank holds one expert, as in its
// paper, with a shadowed expert's own tokens left out. Where ranks hold several experts the busiest
// rank, not the busiest expert, bounds the step; under the code's rule FasterMoE ran 4-7% slower than
// EP on an unskewed router (2 emulated hosts, 4 experts a rank, medians of paired runs).
// REQUIRES: owner valid for R ranks, counts [R][E] non-negative, model valid.
std::vector<int> fastermoe_shadowed(const std::vector<int>& owner, const std::vector<std::vector<int64_t>>& counts,
                                    const FasterMoeModel& model);

// The step's placement: sharded (the owners, normally even_placement) with every shadowed expert held
// by every rank. counts [R][E]: c[w][e], tokens rank w routes to expert e. Owners are unchanged (the
// owner broadcasts its shadowed experts and receives their summed gradients); the copies live for
// this step only. REQUIRES: sharded.validate() ok, counts [R][E] non-negative, model valid.
LayerPlacement fastermoe_plan(const LayerPlacement& sharded, const std::vector<std::vector<int64_t>>& counts,
                              const FasterMoeModel& model);

// ---- FlexMoE (no public code; Hecate re-implemented it from its paper) ----
// Reconstructed from the FlexMoE paper: each rank has E/R + reserved_slots slots per layer; expert e has
// r_e persistent replicas, its tokens split evenly among them; a rank's load is the sum over its
// replicas of L_e / r_e; re-plan when the balance ratio rho = max / mean rank load exceeds a threshold
// or every K steps. Ours: the cost model and the details of the loop (flexmoe_plan).
//
// Convention for owner[e] (replicas persist across steps): every replica keeps the expert's
// parameters and a copy of its optimizer state (FlexMoE's replicas are data-parallel copies, which is
// why an expand costs parameters + optimizer state), and owner[e] is the master copy: it stays on its
// rank while that replica lives; when it is shrunk, the lowest remaining replica becomes the owner
// (it already holds a full copy, so nothing moves).

struct FlexMoeConfig {
  int reserved_slots = 1;          // R: slots per rank per layer beyond E / ranks (>= 0)
  double balance_threshold = 1.2;  // re-plan when rho exceeds it (>= 1); tuned per run (issue 5)
  int replan_interval = 50;        // K: re-plan at least every K steps (>= 1); also the horizon
  // Cost model (all > 0 and finite but replica_step_seconds, >= 0): a move is accepted when
  //   ((max rank load before - after) * expert_seconds_per_token - added * replica_step_seconds)
  //       * replan_interval > expert_state_bytes / bandwidth
  // where added is 1 for an expand that adds a replica and 0 for a migrate (one replica for another).
  double expert_seconds_per_token = 0;  // one token through one expert, forward + backward
  int64_t expert_state_bytes = 0;       // one expert's parameters + optimizer state
  double bandwidth = 0;                 // bytes/s of the copy
  // What one more replica costs every step: its gathers and its gradients' reduce where they take the
  // compute's cores (CPU ranks); 0 where they run beside it (GPUs).
  double replica_step_seconds = 0;
  // Ranks that take turns on shared CPU cores: "max rank load" above is busiest_load over them
  // (plan/placement.h). Empty: each rank computes on its own.
  CorePools cores{};
};

struct ReplicaMove {
  enum class Kind : uint8_t { expand, shrink };
  Kind kind = Kind::expand;
  int expert = -1;
  int rank = -1;    // expand: the rank gaining a replica; shrink: the rank dropping one
  int source = -1;  // expand: the owner, which sends parameters + optimizer state; shrink: -1
  bool operator==(const ReplicaMove&) const = default;
};

struct FlexMoePlan {
  bool replanned = false;        // the trigger fired (the moves may still be empty; shrinks come without it)
  LayerPlacement placement;      // the new persistent placement (the current one when not replanned)
  std::vector<ReplicaMove> moves;  // in the order to apply them; a migrate is a shrink then an expand
  double balance_before = 1, balance_after = 1;  // rho of the current / new placement
};

// Per-rank load [R]: sum over the experts rank r holds of load[e] / r_e. REQUIRES: p.validate() ok,
// load valid for E experts.
std::vector<double> flexmoe_rank_loads(const LayerPlacement& p, const std::vector<double>& load);
// rho = max / mean of flexmoe_rank_loads (1 when every load is 0).
double flexmoe_balance_ratio(const LayerPlacement& p, const std::vector<double>& load);

// One re-planning decision. current: the persistent placement (start from even_placement);
// load [E]: moving average of L_e (e.g. LoadPredictor::predict); steps_since_replan: steps since the
// last time this returned replanned (or since the start).
// When rho > balance_threshold or steps_since_replan >= replan_interval, repeatedly:
//   hot  = argmax L_e / r_e over experts with load > 0 and a replica short of every rank;
//   expand: hot into the least-loaded rank not holding it that has a free slot; if there is none,
//   migrate: shrink cold = argmin L_e / r_e over the other experts with r_e > 1 that have a replica
//     on a rank not holding hot, on the least-loaded such rank, and expand hot there;
//   keep the move if the cost model above accepts it, else stop (also when no hot or cold exists).
// Each kept move strictly lowers the maximum rank load, so the loop ends and never raises it.
// Then, whether or not it re-planned (replanned says whether the trigger fired): shrink, one at a
// time, the non-owner replica whose removal raises the maximum rank load least, while it raises it
// not at all. A load that moved on leaves replicas behind, and until 2026-11-28 nothing dropped them
// but a migrate's. A shrink moves nothing. (Shrinking also those whose saving the cost model puts
// below their cost a step was tried: on 2 emulated hosts x 1 rank at 1 Gbit/s, skew 1.5, it dropped
// the 3 replicas a step after the weights rate fell from 0.13 to 0.086 GB/s, and FlexMoE went from
// 0.83 to 0.98 of EP's step: the model prices expert time only, and the replicas also kept rows
// home. Not kept.)
// REQUIRES: current.validate() ok, E % ranks == 0, every rank holds at most E / ranks + reserved_slots
// experts, load valid, steps_since_replan >= 0, config valid.
FlexMoePlan flexmoe_plan(const LayerPlacement& current, const std::vector<double>& load, int steps_since_replan,
                         const FlexMoeConfig& cfg);

// ---- SmartMoE online placement (thu-pacman/SmartMoE-AE fmoe/smartmoe/mapping.py) ----
// No replication: each layer's experts are a permutation over E slots, E / R per rank. Every
// `interval` steps a greedy re-assigns them: experts by load descending, each to the rank with the
// lowest accumulated load that has a free slot (ties keep the expert's current rank, else the lower
// rank); the result is adopted only if its maximum rank load is strictly lower. Moved experts carry
// parameters and optimizer state. Ours: the plan is expressed as owners (which slot of a rank an
// expert takes is the runtime's, since slots of one rank are interchangeable for load). Priced (the
// cost fields set, as the trainer and simulator do from the measured cost model), a lower maximum is
// adopted only when what it saves until the next evaluation beats the swap's transfer, on the same
// terms as FlexMoE's moves: without it, the natural few percent of imbalance of an unskewed router
// made SmartMoE swap experts every interval, each swap moving weights and optimizer state over the
// slowest link, and run slower than EP.

struct SmartMoeConfig {
  int interval = 10;  // f: steps between evaluations (>= 1)
  // Cost model (all 0: unpriced, the paper's rule; else all > 0 and finite but
  // exchange_seconds_per_token, >= 0): adopted only when
  //   ((busiest_load before - after) * expert_seconds_per_token
  //    + (busiest_nic load before - after) * exchange_seconds_per_token) * interval
  //       > (most experts one rank receives) * expert_state_bytes / bandwidth
  // busiest_load (plan/placement.h) over `cores`, the max rank load where ranks share no cores;
  // busiest_nic load: busiest_load over `nics`, the max rank load where every rank has a NIC of its own
  // (or all share one node).
  double expert_seconds_per_token = 0;    // one token through one expert, forward + backward
  double exchange_seconds_per_token = 0;  // one routed token's rows through the exchanges, on average
  int64_t expert_state_bytes = 0;         // one expert's parameters + optimizer state
  double bandwidth = 0;                   // bytes/s a rank receives at
  CorePools cores{};                      // ranks that take turns on shared CPU cores (empty: none)
  CorePools nics{};                       // ranks that cross the network through one NIC (nic_pools)
};

struct SmartMoePlan {
  bool evaluated = false;  // steps_since_update >= interval: the greedy ran (restart the count)
  bool adopted = false;    // it strictly lowered the maximum rank load: owner changed
  std::vector<int> owner;  // [E]: the new owners when adopted, else the current ones
  std::vector<ExpertMove> moves;  // owner_moves(current, owner)
  double max_load_before = 0, max_load_after = 0;  // of the current owners / of the returned owners
  double saved_seconds = 0, move_seconds = 0;  // priced: the greedy's saving over the interval, its swap's cost
};

// Per-rank load [R]: sum of the loads of the experts each rank owns. REQUIRES: owners in
// [0, n_ranks), load valid for owner.size() experts.
std::vector<double> owner_rank_loads(const std::vector<int>& owner, int n_ranks, const std::vector<double>& load);

// owner [E]: current owners, each rank exactly E / n_ranks of them; load [E]: per-expert load averaged
// over the steps since the last update, summed over ranks. REQUIRES: that, n_ranks >= 1,
// steps_since_update >= 0, cfg.interval >= 1.
SmartMoePlan smartmoe_plan(const std::vector<int>& owner, int n_ranks, const std::vector<double>& load,
                           int steps_since_update, const SmartMoeConfig& cfg);

}  // namespace moe::plan
