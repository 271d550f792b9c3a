// Hecate's planners (the Hecate paper, "Hecate: Unlocking Efficient Sparse Model Training via Fully Sharded Sparse Data Parallelism": FSSDP §3.2, Hecate §4.2-4.3): where each expert's shard
// lives (heterogeneous sharding, Alg. 2, re-run every few hundred steps) and which extra replicas a
// step materializes with SparseAllGather (sparse materialization, Alg. 1, every step and layer, plus
// the optional calibration after the gate). Token dispatch over the result is dispatch_plan
// (placement.h); the shard moves of a re-sharding are owner_moves (placement.h), layer by layer.
//
// Terms. An "extra" expert of rank r is one r holds this step but does not own (a materialized
// replica). A "slot" is room for one extra expert's parameters. Loads are tokens per step (or any
// non-negative weights proportional to them: only ratios matter here), e.g. LoadPredictor::predict.
// All functions are pure and deterministic (ties: lower expert id, node id, rank).
#pragma once

#include <cstdint>
#include <vector>

#include "plan/placement.h"

namespace moe::plan {

// Overlap degree t (§4.2): how many experts' parameters one rank can receive while the preceding
// non-MoE layers (attention) compute, so that the SparseAllGather stays hidden:
//   t = floor(non_moe_seconds * bandwidth / expert_bytes)
// non_moe_seconds: attention (non-MoE) compute time before the layer's gate, seconds;
// bandwidth: bytes/s a rank receives at (the inter-node bandwidth on a cluster whose inter-node links
// are much slower than its intra-node ones, as the paper prescribes); expert_bytes: one expert's
// parameter bytes. Saturates at INT_MAX. REQUIRES: non_moe_seconds >= 0, bandwidth > 0,
// expert_bytes > 0, all finite.
int overlap_degree(double non_moe_seconds, double bandwidth, int64_t expert_bytes);

// Memory slots m: how many extra experts fit in a rank's budget, floor(budget_bytes / expert_bytes),
// saturating at INT_MAX. What counts: only the parameters of materialized replicas (expert_bytes as
// in overlap_degree). The rank's own shards (their parameters, gradients, optimizer state) are outside
// the budget: Alg. 2 already keeps them equal across ranks. A replica's gradient buffer, alive in the
// backward pass until SparseReduceScatter, is also outside: a caller that must fit it too passes a
// budget that leaves room for one layer's replica gradients. REQUIRES: budget_bytes >= 0,
// expert_bytes > 0.
int memory_slots(int64_t budget_bytes, int64_t expert_bytes);

// Extra experts per rank [R]: |experts_on(r)| - |experts_owned_by(r)|. REQUIRES: p.validate() ok.
std::vector<int> extra_experts(const LayerPlacement& p);

// Alg. 1, sparse materialization of one layer. base: the placement to extend, normally the sharded
// placement (every replicas[e] == {owner[e]}); at calibration, the placement in force. load [E]:
// predicted loads F. t: overlap degree; m: memory slots per rank.
// Every rank ends with at most m extra experts, counting those base already has, so a rank's free
// slots are m - extra_experts(base)[r] (all m for a sharded base). Experts with zero load are never
// materialized (no tokens to balance), so t is first cut to min(t, E, experts with load > 0), and the
// candidates are the top-t experts by load.
//   * t <= every rank's free slots (the paper's t <= m): the top-t experts go to every rank.
//   * otherwise: the sum of the ranks' free slots (|D| * m for a sharded base) is shared among the
//     top-t experts in load order, expert i getting ceil(slots_left * F_i / (F_i + F_i+1 + ...))
//     replicas (proportional to load; the hotter expert gets the rounding; what an expert cannot use
//     passes to the next, and slots still free at the end go to whichever candidates can still take
//     them, hottest first, so a slot stays empty only if every candidate is on its rank). Each replica goes to a node first, preferring the nodes with the fewest
//     holders of the expert (none first), then the most free slots on ranks not holding it; then to
//     the rank of that node with the most free slots. A rank never takes a replica it already holds.
// Owners are unchanged; replicas only grow. REQUIRES: base.validate() ok, nodes has R entries,
// load valid for E experts, t >= 0, m >= 0, every rank of base has at most m extra experts.
LayerPlacement sparse_materialize(const LayerPlacement& base, const std::vector<double>& load, int t, int m,
                                  const Nodes& nodes);

// The cost model of the calibration (all fields > 0 and finite but exchange_seconds_per_token, >= 0).
struct CalibrationModel {
  // Seconds one token spends in one expert on a rank over the step, for as long as the placement holds
  // (forward and backward: about 3x the forward GEMM time, since the backward re-gathers the same
  // placement).
  double expert_seconds_per_token = 0;
  double bandwidth = 0;      // bytes/s a rank receives a gathered expert at
  int64_t expert_bytes = 0;  // one expert's parameter bytes
  // How many times a replica's bytes cross between ranks in the step at a cost to it (>= 1): 1 where
  // only the forward gather sits on the critical path (GPUs: the backward's transfers run beside
  // attention backward); on CPU ranks every transfer takes the compute's cores, so 2 (the gather and
  // the gradient's SparseReduceScatter), 3 with rematerialization (the backward gathers again).
  int transfers_per_replica = 1;
  // Seconds one token's row costs in the all-to-alls when it crosses the slowest link class the ranks
  // span (4 exchanges: dispatch and combine, forward and backward); 0 leaves the all-to-alls out of
  // the price.
  double exchange_seconds_per_token = 0;
  // Ranks that take turns on shared CPU cores: their expert work is priced by busiest_load
  // (plan/placement.h). Empty: each rank computes on its own.
  CorePools cores{};
  // Ranks that cross the network through one NIC (nic_pools): the rows over the slowest link class
  // are priced by busiest_load over them. Empty: each rank has a link of its own.
  CorePools nics{};
};

// Whether the calibration's extra SparseAllGather pays, and the placement to dispatch over.
struct Calibration {
  bool gather = false;         // true: gather `placement` now, before dispatching
  LayerPlacement placement;    // the calibrated placement when gather, else the one in force
  double busiest_before = 0;   // busiest_load of the ranks' tokens under the placement in force
  double busiest_after = 0;    // ... under the calibrated placement (computed in both cases)
  double remote_before = 0;    // rows the busiest receiver over the slowest link receives (NIC pools), in force
  double remote_after = 0;     // ... calibrated
  int64_t gather_bytes = 0;    // bytes received by the rank receiving the most in the extra gather
  double saved_seconds = 0;    // (busiest_before - busiest_after) * expert_seconds_per_token
                               //   + (remote_before - remote_after) * exchange_seconds_per_token
  double gather_seconds = 0;   // transfers_per_replica * gather_bytes / bandwidth
};

// Calibration after the gate (§4.2): re-runs Alg. 1 on the placement in force with the actual loads
// (L_e = sum over s of counts[s][e]) and the remaining memory (m minus the extras in force, as
// sparse_materialize counts them), then prices the result; once for each t' from t up to the number
// of experts with tokens, keeping the gathering placement with the largest saved_seconds -
// gather_seconds (the smallest t' on ties; t's own result when none gathers); then each extra replica
// of that placement, the coldest expert's first (ranks ascending), is dropped where the placement
// without it prices no worse: Alg. 1 fills every free slot, and a replica that shortens neither the
// busiest rank (or pool) nor the busiest receiver's rows over the slowest link costs its transfers
// for nothing (a host-mate's copy where ranks share a core). The overlap degree
// bounds what hides behind attention; this gather is on the critical path, so its price bounds it
// (the paper re-runs Alg. 1 without saying with which t). Cost model:
//   busiest(P)      = busiest_load (plan/placement.h) over model.cores of the tokens dispatch_plan(P,
//                     nodes, counts) sends to each rank: the busiest rank's where ranks share no cores
//   remote(P)       = busiest_load over model.nics of the tokens each rank d receives over the slowest
//                     link class the ranks span: from ranks of other nodes (rows within a node cross no
//                     NIC), or from the other ranks when all share one node; the busiest rank's where
//                     each rank has a NIC of its own, the busiest NIC's total where ranks share one
//   saved_seconds   = (busiest(in force) - busiest(calibrated)) * expert_seconds_per_token
//                     + (remote(in force) - remote(calibrated)) * exchange_seconds_per_token
//   gather_seconds  = transfers_per_replica * max over ranks of (experts it newly holds) * expert_bytes
//                     / bandwidth
//   gather          = saved_seconds > gather_seconds
// The gather time is the busiest receiver's, not the total over ranks, because the ranks' receives
// run concurrently (comm/sparse_collectives.h: rounds ~ the most chunks any rank receives). With
// transfers_per_replica = 1 only the forward gather is charged: it sits on the critical path, while
// the backward's re-gather and the SparseReduceScatter of the extra replicas hide behind attention
// backward (§3.2); where they cannot hide, the caller counts them. The all-to-alls a better balance
// also shortens count through exchange_seconds_per_token (0: left out, erring towards not gathering).
// t: the fewest experts Alg. 1 considers (the overlap degree, as in the overlapped run).
// counts [R][E] as in dispatch_plan. REQUIRES: those of sparse_materialize and dispatch_plan,
// model fields > 0 and finite.
Calibration calibrate(const LayerPlacement& in_force, const std::vector<std::vector<int64_t>>& counts, int t,
                      int m, const Nodes& nodes, const CalibrationModel& model);

// The same price for any candidate placement against the one in force: busiest ranks under both,
// the busiest receiver's gather, and whether the saving beats the gather (Calibration::gather; the
// placement returned is the candidate when it does, else in_force). REQUIRES: those of calibrate,
// candidate.validate() ok over the same ranks and experts, candidate holds everything in_force holds.
Calibration price_placement(const LayerPlacement& in_force, const LayerPlacement& candidate,
                            const std::vector<std::vector<int64_t>>& counts, const Nodes& nodes,
                            const CalibrationModel& model);

// Alg. 1 on base for each t' from t_min to t_max (cut to the experts with load > 0), each priced by
// price_placement against base over counts: the gathering placement with the largest saved_seconds -
// gather_seconds (the smallest t' on ties) less the replicas that save nothing (calibrate), else
// t_min's price (gather false). calibrate is this
// with base = the placement in force, t_min = t, t_max = E; Hecate's overlapped gather on CPU ranks
// with base = the owners, t_min = 0, t_max = t and the predicted loads' even_counts. REQUIRES: those
// of sparse_materialize and price_placement, 0 <= t_min.
Calibration cheapest_materialization(const LayerPlacement& base, const std::vector<double>& load,
                                     const std::vector<std::vector<int64_t>>& counts, int t_min, int t_max, int m,
                                     const Nodes& nodes, const CalibrationModel& model);

// Predicted loads as counts [R][E]: load[e] spread evenly over the R source ranks (rounded down, the
// remainder on the lowest ranks), what price_placement needs before the gate has run. REQUIRES:
// R >= 1, loads >= 0 and finite.
std::vector<std::vector<int64_t>> even_counts(const std::vector<double>& load, int R);

// Alg. 2, heterogeneous sharding of all MoE layers together. loads [L][E_l]: predicted load per layer
// and expert; t: overlap degree; returns owner [L][E_l] (each expert exactly one owner).
//   * Slots: every rank gets S = (sum over l of E_l) / R shards in total over all layers, so memory
//     for shards (parameters + optimizer state, equal per expert) is equal across ranks, while a rank
//     may own any number (0..E_l) of one layer's experts.
//   * Per layer the top-t experts by load are "overlappable" (Alg. 1 will replicate them); the others
//     are "underloaded" and placed first: layers in order of their largest expert load (descending),
//     each layer's underloaded experts by load (descending), each to the least-loaded node (node load:
//     this layer's load placed on it so far; ties: fewer free slots) and on it to the least-loaded rank
//     (ties: fewer free slots), among those with a free slot.
//   * Then the overlappable experts fill the remaining slots, layers and experts in the same order and
//     by the same rule (the paper places them "arbitrarily"; this keeps each layer's owners balanced).
// REQUIRES: nodes has R >= 1 entries (ids >= 0), L >= 1, every layer E_l >= 1 with valid loads,
// (sum of E_l) % R == 0, t >= 0.
std::vector<std::vector<int>> heterogeneous_sharding(const std::vector<std::vector<double>>& loads, int t,
                                                     const Nodes& nodes);

}  // namespace moe::plan
