// Start here for src/plan: where experts live during a step, and how tokens find them. Planners
// (pure functions of load statistics, topology and budgets: docs/architecture.md) produce these values;
// graph builders and the runtime consume them. Nothing here communicates or allocates per token.
//
// Dimension letters: R ranks (of the expert-parallel group), E experts of one MoE layer, L MoE layers.
// Every function in src/plan is deterministic: the same inputs give the same outputs on every rank
// (ties are broken by the lowest index), so ranks that share their statistics agree on the plan
// without communicating it (docs/architecture.md, invariant 2). Violated REQUIRES throw std::logic_error.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "util/status.h"

namespace moe::plan {

// One MoE layer's experts during one step.
//   owner[e]     the rank holding expert e's shard: its parameters and optimizer state (exactly one)
//   replicas[e]  the ranks holding e's parameters this step, ascending, always including owner[e]
//                (EP: {owner}; Hecate: the materialized placement; FasterMoE: shadowed experts on all)
struct LayerPlacement {
  int n_ranks = 0;
  std::vector<int> owner;                  // [E]
  std::vector<std::vector<int>> replicas;  // [E]

  int n_experts() const { return static_cast<int>(owner.size()); }
  // rank in replicas[expert] (false for a rank out of range). REQUIRES: expert in [0, E).
  bool holds(int rank, int expert) const;
  // Experts whose parameters rank holds this step / owns, ascending. REQUIRES: rank in [0, n_ranks).
  std::vector<int> experts_on(int rank) const;
  std::vector<int> experts_owned_by(int rank) const;
  // n_ranks >= 1, replicas has one list per expert, every owner in [0, n_ranks), every replica list
  // ascending, unique, in range and holding its owner. The error names the expert.
  Status validate() const;
};

// EP's placement: expert e owned (and held only) by rank e / (E / R).
// REQUIRES: R >= 1, E >= 0, E % R == 0.
LayerPlacement even_placement(int n_experts, int n_ranks);

// The chunk each (rank, expert) pair's rows travel in when a step cuts its token exchange in n
// (graph::StepBuilder::dispatch, MoeLayer::ep_dispatch_a2a(chunk, n)): rank d's held experts,
// ascending, in n contiguous parts, the one at position i of H in part i * n / H. [R][E]; 0 where d
// does not hold e. REQUIRES: n >= 1.
std::vector<std::vector<int>> exchange_chunks(const LayerPlacement& p, int n);

// Node of each rank (comm::Topology's node_of, as plain data so planners stay free of comm).
// Node ids are 0..n_nodes()-1 (Topology numbers them so; a planner REQUIRES ids >= 0).
struct Nodes {
  std::vector<int> node_of_rank;  // [R]
  int n_nodes() const;            // 1 + the largest id (0 when there are no ranks)
};

// [R]: a group per rank such that two ranks exchange over the slowest link class the ranks span
// exactly when their groups differ: their nodes when the ranks span several, else each rank its own
// (all on one node, the link between two ranks is the slowest). What the planners price rows at
// the network's rate by.
std::vector<int> slowest_link_groups(const Nodes& nodes);

// How dispatch_plan spreads the tokens routed to an expert over the ranks holding it:
//   nearest  Hecate §4.4 (training): tokens that rank s routes to expert e go to a replica on s itself
//            if there is one, else to the replicas on s's node, else to all replicas. They are spread
//            evenly over the n chosen replicas c[0] < c[1] < ... < c[n-1]: with count = q*n + r, each
//            gets q and the r replicas c[(s + i) % n], i = 0..r-1, get one more (rotated by s so that
//            sources spread their remainders instead of all loading c[0]). A replica relieves the
//            ranks whose own tokens it serves, and no token crosses a node it need not.
//   even     Lina (serving): the n holders of e each compute an equal share of all the tokens routed to
//            e (T = q*n + r: the r holders c[(e + i) % n], i = 0..r-1, one more), the load its planner
//            prices (lina_busiest_seconds). A source that holds e keeps as many of its own tokens as
//            its share allows; the rest go, sources in ascending order, to holders with share left,
//            those on the source's node first, then ascending. So only the tokens an even split must
//            move cross ranks. Under nearest, a replica on a rank whose batch routes few tokens to e
//            would take few of them, however many the other ranks route to e.
//   balanced Lina (serving): the holders of e split its tokens so that the ranks' loads level, as Lina's
//            scheduler sets "how many tokens each replica should handle to balance the load"
//            (balanced_shares; whole tokens: each share rounded down, the rest to the largest
//            fractions), the tokens then moving as under even. An equal split lifts a rank that
//            holds other experts' tokens above one that holds few: with 400 tokens of a hot expert
//            on ranks loaded 100 and 200 by their own experts, even gives 300 and 400, balanced 350
//            and 350.
// Without replicas (every expert on its owner only) every rule sends every token to the owner.
enum class DispatchRule { nearest, even, balanced };

// DispatchRule::balanced's split of tokens [E] over p's holders: shares[e][i] is what p.replicas[e][i]
// computes, summing to tokens[e]. A rank's load is first the tokens of the experts it alone holds;
// then the experts with several holders, the most tokens first (ties: lower index), are poured onto
// their holders, the least loaded first, up to the level that takes them all. Real-valued (an
// estimate's expected counts). REQUIRES: p.validate() ok, tokens [E] finite and >= 0.
std::vector<std::vector<double>> balanced_shares(const LayerPlacement& p, const std::vector<double>& tokens);

// The token dispatch over placement p under `rule` (DispatchRule). Deterministic; every rank computes
// the same plan from the same counts.
//   counts [R][E]: tokens (assignments) rank s sends to expert e
//   returns rows [R][E][R]: rows[s][e][d] = tokens rank s sends to rank d for expert e
// REQUIRES: p.validate() ok, nodes has R entries (ids >= 0), counts is [R][E] and non-negative.
std::vector<std::vector<std::vector<int64_t>>> dispatch_plan(const LayerPlacement& p, const Nodes& nodes,
                                                             const std::vector<std::vector<int64_t>>& counts,
                                                             DispatchRule rule = DispatchRule::nearest);

// Tokens each rank computes under a dispatch plan: received[d] = sum over s, e of rows[s][e][d].
// What the busiest-rank cost models of the planners compare. REQUIRES: rows is [R][E][R].
std::vector<int64_t> received_tokens(const std::vector<std::vector<std::vector<int64_t>>>& rows);

// Ranks that take turns on shared CPU cores: CPU ranks of one machine whose compute threads outnumber
// the cores they may run on (4 ranks of one thread on 2 cores; the 2 ranks of an emulated host given
// one core). Empty: every rank computes on cores, or a device, of its own.
struct CorePools {
  std::vector<int> pool_of_rank;      // [R]: pool ids 0..P-1
  std::vector<double> ranks_at_once;  // [P]: how many of the pool's ranks its cores run at full speed at once
  bool empty() const { return pool_of_rank.empty(); }
};

// The busiest rank's expert work where ranks may share cores, in tokens at the rate the ranks measure:
//   max over pools p of min(1, c_p / R_p) * max(max over r in p of load[r], (sum over r in p of load[r]) / c_p)
// with R_p the pool's ranks and c_p its ranks_at_once. Ranks that share cores compute their experts
// side by side, each at c_p / R_p of its speed alone (what their measured rate holds): an even pool
// finishes with its total, and tokens moved between two ranks of one pool save nothing. Without pools,
// or where each pool has cores for all its ranks, the busiest rank's load. What every planner's
// busiest-rank price compares. REQUIRES: pools empty, or pool_of_rank [load.size()] with ids in
// [0, ranks_at_once.size()) and ranks_at_once > 0 and finite.
double busiest_load(const std::vector<double>& load, const CorePools& pools);
double busiest_load(const std::vector<int64_t>& load, const CorePools& pools);

// Ranks that cross the network through one NIC, as pools for busiest_load: a pool per NIC id, each
// running one rank's rows at once. A NIC carries a lone rank's rows at its full rate and several
// ranks' side by side at their share, which is the rate the links are measured at (every rank
// sending at once), so it finishes with its ranks' total: rows moved between two ranks behind one NIC
// save no network time. nic_of_rank [R]: ids >= 0. Empty where no NIC serves two ranks.
CorePools nic_pools(const std::vector<int>& nic_of_rank);

// An expert shard (parameters + optimizer state) that changes owner: what the runtime moves when a
// planner re-shards (Hecate Alg. 2, SmartMoE).
struct ExpertMove {
  int expert = -1;
  int from = -1;  // old owner
  int to = -1;    // new owner
  bool operator==(const ExpertMove&) const = default;
};
// The moves that turn old_owner into new_owner, ascending by expert (experts whose owner is unchanged
// are not listed). REQUIRES: same length, every entry >= 0.
std::vector<ExpertMove> owner_moves(const std::vector<int>& old_owner, const std::vector<int>& new_owner);

}  // namespace moe::plan
