// Hecate's planners: overlap degree and memory slots, Alg. 1 (sparse materialization) with the
// calibration after the gate, Alg. 2 (heterogeneous sharding across layers).
#include "plan/hecate.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <numeric>
#include <tuple>

#include "plan/detail.h"

namespace moe::plan {

using detail::add_replica;
using detail::violated;

namespace {

// The experts (only those with load > 0 if positive_only), hottest first (ties: lower id).
std::vector<int> by_load_descending(const std::vector<double>& load, bool positive_only) {
  std::vector<int> order;
  for (int e = 0; e < static_cast<int>(load.size()); ++e)
    if (!positive_only || load[e] > 0) order.push_back(e);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return load[a] > load[b]; });
  return order;
}

// Adds up to n replicas of expert to ranks with free slots that do not hold it: node first (fewest
// holders of the expert, then most free slots among its ranks that could take it, then lowest id),
// then the node's rank with the most free slots (then lowest rank). Returns how many it placed.
int place_replicas(LayerPlacement& p, int expert, int n, std::vector<int>& free, const Nodes& nodes) {
  const int R = p.n_ranks, n_nodes = nodes.n_nodes();
  int placed = 0;
  std::vector<int> holders(n_nodes), node_free(n_nodes);
  while (placed < n) {
    std::fill(holders.begin(), holders.end(), 0);
    std::fill(node_free.begin(), node_free.end(), 0);
    for (int r = 0; r < R; ++r) {
      const int node = nodes.node_of_rank[r];
      if (p.holds(r, expert)) ++holders[node];
      else node_free[node] += free[r];
    }
    auto better_node = [&](int a, int b) {
      if (holders[a] != holders[b]) return holders[a] < holders[b];
      return node_free[a] > node_free[b];
    };
    int best_node = -1;
    for (int node = 0; node < n_nodes; ++node)
      if (node_free[node] > 0 && (best_node < 0 || better_node(node, best_node))) best_node = node;
    if (best_node < 0) break;  // every rank with a free slot already holds the expert
    int best_rank = -1;
    for (int r = 0; r < R; ++r) {
      if (nodes.node_of_rank[r] != best_node || free[r] == 0 || p.holds(r, expert)) continue;
      if (best_rank < 0 || free[r] > free[best_rank]) best_rank = r;
    }
    add_replica(p, expert, best_rank);
    --free[best_rank];
    ++placed;
  }
  return placed;
}

int saturate(double x) { return x >= static_cast<double>(INT_MAX) ? INT_MAX : static_cast<int>(x); }

// The busiest rank's tokens under p (busiest_load over the ranks that share cores), and the busiest
// receiver's rows over the slowest link class the ranks span (busiest_load over the ranks that share
// a NIC): from ranks of other nodes, or from the other ranks when all share one node.
struct RankLoad {
  double busiest = 0;  // busiest_load over the core pools
  double remote = 0;   // busiest_load over the NIC pools
};
RankLoad rank_load(const LayerPlacement& p, const Nodes& nodes, const std::vector<std::vector<int64_t>>& counts,
                   const CorePools& cores, const CorePools& nics) {
  const auto rows = dispatch_plan(p, nodes, counts);
  const std::vector<int64_t> received = received_tokens(rows);
  const std::vector<int> group = slowest_link_groups(nodes);
  std::vector<int64_t> slow(p.n_ranks, 0);  // rows each rank receives over the slowest link class
  for (int d = 0; d < p.n_ranks; ++d)
    for (int s = 0; s < p.n_ranks; ++s) {
      if (group[s] == group[d]) continue;
      for (int e = 0; e < p.n_experts(); ++e) slow[d] += rows[s][e][d];
    }
  return {busiest_load(received, cores), busiest_load(slow, nics)};
}

// price_placement's price of calibrated, in_force's load already known. REQUIRES: those of
// price_placement, before == rank_load(in_force, nodes, counts, model.cores, model.nics).
Calibration price_against(const LayerPlacement& in_force, RankLoad before, const LayerPlacement& calibrated,
                          const std::vector<std::vector<int64_t>>& counts, const Nodes& nodes,
                          const CalibrationModel& model) {
  Calibration c;
  c.busiest_before = before.busiest, c.remote_before = before.remote;
  const RankLoad after = rank_load(calibrated, nodes, counts, model.cores, model.nics);
  c.busiest_after = after.busiest, c.remote_after = after.remote;
  std::vector<int64_t> gained(in_force.n_ranks, 0);
  for (int e = 0; e < in_force.n_experts(); ++e)
    for (int r : calibrated.replicas[e])
      if (!in_force.holds(r, e)) ++gained[r];
  c.gather_bytes = *std::max_element(gained.begin(), gained.end()) * model.expert_bytes;
  c.saved_seconds = (c.busiest_before - c.busiest_after) * model.expert_seconds_per_token +
                    (c.remote_before - c.remote_after) * model.exchange_seconds_per_token;
  c.gather_seconds = model.transfers_per_replica * static_cast<double>(c.gather_bytes) / model.bandwidth;
  c.gather = c.saved_seconds > c.gather_seconds;
  c.placement = c.gather ? calibrated : in_force;
  return c;
}

}  // namespace

int overlap_degree(double non_moe_seconds, double bandwidth, int64_t expert_bytes) {
  if (!std::isfinite(non_moe_seconds) || non_moe_seconds < 0 || !std::isfinite(bandwidth) || bandwidth <= 0 ||
      expert_bytes <= 0)
    violated("overlap_degree", "needs non_moe_seconds >= 0, bandwidth > 0, expert_bytes > 0, all finite");
  return saturate(std::floor(non_moe_seconds * bandwidth / static_cast<double>(expert_bytes)));
}

int memory_slots(int64_t budget_bytes, int64_t expert_bytes) {
  if (budget_bytes < 0 || expert_bytes <= 0) violated("memory_slots", "needs budget_bytes >= 0, expert_bytes > 0");
  const int64_t slots = budget_bytes / expert_bytes;
  return slots >= INT_MAX ? INT_MAX : static_cast<int>(slots);
}

std::vector<int> extra_experts(const LayerPlacement& p) {
  detail::require_valid("extra_experts", p);
  std::vector<int> extra(p.n_ranks, 0);
  for (int e = 0; e < p.n_experts(); ++e)
    for (int r : p.replicas[e])
      if (r != p.owner[e]) ++extra[r];
  return extra;
}

LayerPlacement sparse_materialize(const LayerPlacement& base, const std::vector<double>& load, int t, int m,
                                  const Nodes& nodes) {
  constexpr const char* kWhere = "sparse_materialize";
  detail::require_valid(kWhere, base);
  const int R = base.n_ranks;
  detail::require_nodes(kWhere, nodes, R);
  detail::require_loads(kWhere, load, base.n_experts());
  if (t < 0 || m < 0) violated(kWhere, "t and m must be non-negative");
  std::vector<int> free = extra_experts(base);
  for (int r = 0; r < R; ++r) {
    if (free[r] > m) violated(kWhere, "a rank of base already holds more than m extra experts");
    free[r] = m - free[r];
  }

  std::vector<int> top = by_load_descending(load, /*positive_only=*/true);
  if (static_cast<int>(top.size()) > t) top.resize(t);
  LayerPlacement out = base;
  if (top.empty()) return out;

  if (static_cast<int>(top.size()) <= *std::min_element(free.begin(), free.end())) {
    // Every rank has room for all of them: replicate each on every rank, so their tokens never leave
    // their source rank.
    for (int e : top) {
      std::vector<int> all(R);
      std::iota(all.begin(), all.end(), 0);
      out.replicas[e] = std::move(all);
    }
    return out;
  }

  // Share the free slots among the candidates in proportion to load. The suffix sums make the last
  // candidate's share exactly the slots left, whatever the rounding before it.
  std::vector<double> suffix(top.size() + 1, 0.0);
  for (size_t i = top.size(); i-- > 0;) suffix[i] = suffix[i + 1] + load[top[i]];
  int slots_left = std::accumulate(free.begin(), free.end(), 0);
  for (size_t i = 0; i < top.size() && slots_left > 0; ++i) {
    const double share = slots_left * load[top[i]] / suffix[i];
    // The slack keeps a share that rounding nudged above an integer from taking one slot more.
    const int n = std::min(slots_left, static_cast<int>(std::ceil(share - 1e-9)));
    slots_left -= place_replicas(out, top[i], n, free, nodes);
  }
  // Slots the colder candidates could not use (they sit on ranks already holding them) go to any
  // candidate that can, hottest first, rather than stay empty.
  for (size_t i = 0; i < top.size() && slots_left > 0; ++i)
    slots_left -= place_replicas(out, top[i], slots_left, free, nodes);
  return out;
}

Calibration calibrate(const LayerPlacement& in_force, const std::vector<std::vector<int64_t>>& counts, int t,
                      int m, const Nodes& nodes, const CalibrationModel& model) {
  constexpr const char* kWhere = "calibrate";
  detail::require_valid(kWhere, in_force);
  const int R = in_force.n_ranks, E = in_force.n_experts();
  detail::require_counts(kWhere, counts, R, E);
  std::vector<double> actual(E, 0.0);
  for (int s = 0; s < R; ++s)
    for (int e = 0; e < E; ++e) actual[e] += static_cast<double>(counts[s][e]);
  return cheapest_materialization(in_force, actual, counts, t, E, m, nodes, model);
}

Calibration cheapest_materialization(const LayerPlacement& base, const std::vector<double>& load,
                                     const std::vector<std::vector<int64_t>>& counts, int t_min, int t_max, int m,
                                     const Nodes& nodes, const CalibrationModel& model) {
  const int loaded = static_cast<int>(std::count_if(load.begin(), load.end(), [](double l) { return l > 0; }));
  Calibration best = price_placement(base, sparse_materialize(base, load, t_min, m, nodes), counts, nodes, model);
  const RankLoad before{best.busiest_before, best.remote_before};  // base's, the same for every t'
  auto net = [](const Calibration& c) { return c.saved_seconds - c.gather_seconds; };
  for (int t = t_min + 1; t <= std::min(t_max, loaded); ++t) {
    Calibration c = price_against(base, before, sparse_materialize(base, load, t, m, nodes), counts, nodes, model);
    if (c.gather && (!best.gather || net(c) > net(best))) best = std::move(c);
  }
  if (!best.gather) return best;
  // Alg. 1 fills every free slot; a replica that saves nothing still costs its transfers (hecate.h).
  std::vector<std::pair<int, int>> extras;  // (expert, rank)
  for (int e = 0; e < base.n_experts(); ++e)
    for (int r : best.placement.replicas[e])
      if (!base.holds(r, e)) extras.emplace_back(e, r);
  std::stable_sort(extras.begin(), extras.end(),
                   [&](const auto& a, const auto& b) { return load[a.first] < load[b.first]; });
  for (const auto& [e, r] : extras) {
    LayerPlacement fewer = best.placement;
    std::erase(fewer.replicas[e], r);
    Calibration c = price_against(base, before, fewer, counts, nodes, model);
    if (c.gather && net(c) >= net(best)) best = std::move(c);
  }
  return best;
}

Calibration price_placement(const LayerPlacement& in_force, const LayerPlacement& calibrated,
                            const std::vector<std::vector<int64_t>>& counts, const Nodes& nodes,
                            const CalibrationModel& model) {
  constexpr const char* kWhere = "price_placement";
  detail::require_valid(kWhere, in_force);
  detail::require_valid(kWhere, calibrated);
  const int R = in_force.n_ranks, E = in_force.n_experts();
  if (calibrated.n_ranks != R || calibrated.n_experts() != E) violated(kWhere, "placements of different shapes");
  detail::require_counts(kWhere, counts, R, E);
  if (!std::isfinite(model.expert_seconds_per_token) || model.expert_seconds_per_token <= 0 ||
      !std::isfinite(model.bandwidth) || model.bandwidth <= 0 || model.expert_bytes <= 0 ||
      model.transfers_per_replica < 1 || !std::isfinite(model.exchange_seconds_per_token) ||
      model.exchange_seconds_per_token < 0)
    violated(kWhere, "CalibrationModel fields must be positive and finite");
  const RankLoad before = rank_load(in_force, nodes, counts, model.cores, model.nics);
  return price_against(in_force, before, calibrated, counts, nodes, model);
}

std::vector<std::vector<int64_t>> even_counts(const std::vector<double>& load, int R) {
  if (R < 1) violated("even_counts", "needs at least one rank");
  const int E = static_cast<int>(load.size());
  std::vector<std::vector<int64_t>> counts(R, std::vector<int64_t>(E, 0));
  for (int e = 0; e < E; ++e) {
    if (!std::isfinite(load[e]) || load[e] < 0) violated("even_counts", "loads must be finite and >= 0");
    const int64_t total = std::llround(load[e]), q = total / R, r = total % R;
    for (int s = 0; s < R; ++s) counts[s][e] = q + (s < r ? 1 : 0);
  }
  return counts;
}

std::vector<std::vector<int>> heterogeneous_sharding(const std::vector<std::vector<double>>& loads, int t,
                                                     const Nodes& nodes) {
  constexpr const char* kWhere = "heterogeneous_sharding";
  const int R = static_cast<int>(nodes.node_of_rank.size());
  if (R < 1) violated(kWhere, "needs at least one rank");
  detail::require_nodes(kWhere, nodes, R);
  if (loads.empty()) violated(kWhere, "needs at least one layer");
  if (t < 0) violated(kWhere, "t must be non-negative");
  const int L = static_cast<int>(loads.size());
  int64_t total = 0;
  for (const auto& layer : loads) {
    if (layer.empty()) violated(kWhere, "every layer needs at least one expert");
    detail::require_loads(kWhere, layer, static_cast<int>(layer.size()));
    total += static_cast<int64_t>(layer.size());
  }
  if (total % R != 0) violated(kWhere, "the total number of experts must be a multiple of the number of ranks");

  const int n_nodes = nodes.n_nodes();
  std::vector<int> free(R, static_cast<int>(total / R));
  std::vector<std::vector<double>> rank_load(L, std::vector<double>(R, 0.0));  // [L][R]: load placed so far
  std::vector<std::vector<int>> owner(L);
  for (int l = 0; l < L; ++l) owner[l].assign(loads[l].size(), -1);

  std::vector<int> layer_order(L);
  std::iota(layer_order.begin(), layer_order.end(), 0);
  std::vector<double> max_load(L);
  for (int l = 0; l < L; ++l) max_load[l] = *std::max_element(loads[l].begin(), loads[l].end());
  std::stable_sort(layer_order.begin(), layer_order.end(), [&](int a, int b) { return max_load[a] > max_load[b]; });

  // Least-loaded node, then its least-loaded rank, each among those with a free slot, ties to fewer
  // free slots (then the lower id). A slot always exists: every layer's experts fit the total.
  auto place = [&](int l, int e) {
    std::vector<double> node_load(n_nodes, 0.0);
    std::vector<int> node_free(n_nodes, 0);
    for (int r = 0; r < R; ++r) {
      node_load[nodes.node_of_rank[r]] += rank_load[l][r];
      node_free[nodes.node_of_rank[r]] += free[r];
    }
    int node = -1;
    for (int n = 0; n < n_nodes; ++n) {
      if (node_free[n] == 0) continue;
      if (node < 0 || std::tie(node_load[n], node_free[n]) < std::tie(node_load[node], node_free[node])) node = n;
    }
    int rank = -1;
    for (int r = 0; r < R; ++r) {
      if (nodes.node_of_rank[r] != node || free[r] == 0) continue;
      if (rank < 0 || std::tie(rank_load[l][r], free[r]) < std::tie(rank_load[l][rank], free[rank])) rank = r;
    }
    owner[l][e] = rank;
    --free[rank];
    rank_load[l][rank] += loads[l][e];
  };

  std::vector<std::vector<int>> sorted(L);
  for (int l = 0; l < L; ++l) sorted[l] = by_load_descending(loads[l], /*positive_only=*/false);
  const auto n_overlappable = [&](int l) { return std::min<size_t>(static_cast<size_t>(t), sorted[l].size()); };
  for (int l : layer_order)  // underloaded experts first
    for (size_t i = n_overlappable(l); i < sorted[l].size(); ++i) place(l, sorted[l][i]);
  for (int l : layer_order)  // then the top-t of each layer into the remaining slots
    for (size_t i = 0; i < n_overlappable(l); ++i) place(l, sorted[l][i]);
  return owner;
}

}  // namespace moe::plan
