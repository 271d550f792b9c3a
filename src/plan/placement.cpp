// LayerPlacement queries and checks, EP's even placement, Hecate's topology-aware token dispatch.
#include "plan/placement.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

#include "plan/detail.h"

namespace moe::plan {

using detail::violated;

bool LayerPlacement::holds(int rank, int expert) const {
  if (expert < 0 || expert >= n_experts() || expert >= static_cast<int>(replicas.size()))
    violated("LayerPlacement::holds", "expert out of range");
  const auto& r = replicas[expert];
  return std::binary_search(r.begin(), r.end(), rank);
}

std::vector<int> LayerPlacement::experts_on(int rank) const {
  if (rank < 0 || rank >= n_ranks) violated("LayerPlacement::experts_on", "rank out of range");
  std::vector<int> out;
  for (int e = 0; e < static_cast<int>(replicas.size()); ++e)
    if (std::binary_search(replicas[e].begin(), replicas[e].end(), rank)) out.push_back(e);
  return out;
}

std::vector<int> LayerPlacement::experts_owned_by(int rank) const {
  if (rank < 0 || rank >= n_ranks) violated("LayerPlacement::experts_owned_by", "rank out of range");
  std::vector<int> out;
  for (int e = 0; e < n_experts(); ++e)
    if (owner[e] == rank) out.push_back(e);
  return out;
}

Status LayerPlacement::validate() const {
  if (n_ranks < 1) return Status::error("placement: n_ranks must be at least 1");
  if (replicas.size() != owner.size()) {
    std::string m = "placement: ";
    m += std::to_string(owner.size());
    m += " owners but ";
    m += std::to_string(replicas.size());
    m += " replica lists";
    return Status::error(m);
  }
  for (int e = 0; e < n_experts(); ++e) {
    auto fail = [&](const char* what) {
      std::string m = "placement: expert ";
      m += std::to_string(e);
      m += ": ";
      m += what;
      return Status::error(m);
    };
    if (owner[e] < 0 || owner[e] >= n_ranks) return fail("owner out of range");
    const auto& r = replicas[e];
    for (size_t i = 0; i < r.size(); ++i) {
      if (r[i] < 0 || r[i] >= n_ranks) return fail("replica rank out of range");
      if (i > 0 && r[i] <= r[i - 1]) return fail("replicas not strictly ascending (unsorted or repeated)");
    }
    if (!std::binary_search(r.begin(), r.end(), owner[e])) return fail("replicas do not include the owner");
  }
  return Status::ok();
}

std::vector<std::vector<int>> exchange_chunks(const LayerPlacement& p, int n) {
  if (n < 1) violated("exchange_chunks", "needs n >= 1");
  std::vector<std::vector<int>> chunk(p.n_ranks, std::vector<int>(p.n_experts(), 0));
  for (int d = 0; d < p.n_ranks; ++d) {
    const std::vector<int> held = p.experts_on(d);
    const int64_t H = static_cast<int64_t>(held.size());
    for (int64_t i = 0; i < H; ++i) chunk[d][held[i]] = static_cast<int>(i * n / H);
  }
  return chunk;
}

LayerPlacement even_placement(int n_experts, int n_ranks) {
  if (n_ranks < 1 || n_experts < 0 || n_experts % n_ranks != 0)
    violated("even_placement", "needs n_ranks >= 1 and n_experts a non-negative multiple of n_ranks");
  LayerPlacement p;
  p.n_ranks = n_ranks;
  const int per_rank = n_experts / n_ranks;
  for (int e = 0; e < n_experts; ++e) {
    p.owner.push_back(e / per_rank);
    p.replicas.push_back({e / per_rank});
  }
  return p;
}

int Nodes::n_nodes() const {
  int largest = -1;
  for (int id : node_of_rank) largest = std::max(largest, id);
  return largest + 1;
}

std::vector<int> slowest_link_groups(const Nodes& nodes) {
  if (nodes.n_nodes() > 1) return nodes.node_of_rank;
  std::vector<int> own(nodes.node_of_rank.size());
  std::iota(own.begin(), own.end(), 0);
  return own;
}

namespace {

using Rows = std::vector<std::vector<std::vector<int64_t>>>;  // [R][E][R]

void dispatch_nearest(const LayerPlacement& p, const Nodes& nodes, const std::vector<std::vector<int64_t>>& counts,
                      Rows* rows) {
  const int R = p.n_ranks, E = p.n_experts();
  std::vector<int> chosen;  // reused across (s, e)
  for (int s = 0; s < R; ++s) {
    for (int e = 0; e < E; ++e) {
      const int64_t count = counts[s][e];
      if (count == 0) continue;
      const auto& holders = p.replicas[e];
      chosen.clear();
      if (std::binary_search(holders.begin(), holders.end(), s)) {
        chosen.push_back(s);
      } else {
        for (int d : holders)
          if (nodes.node_of_rank[d] == nodes.node_of_rank[s]) chosen.push_back(d);
        if (chosen.empty()) chosen = holders;
      }
      const int64_t n = static_cast<int64_t>(chosen.size());
      const int64_t base = count / n, extra = count % n;
      for (int64_t i = 0; i < n; ++i) (*rows)[s][e][chosen[i]] = base;
      for (int64_t i = 0; i < extra; ++i) ++(*rows)[s][e][chosen[(s + i) % n]];
    }
  }
}

// The rows of a split in which holder d of expert e computes share[e][d] of its tokens (zero where d
// does not hold e; each expert's shares sum to its tokens): a source that holds e keeps as many of its
// own tokens as its share allows; the rest go, sources in ascending order, to holders with share left,
// those on the source's node first, then ascending.
void dispatch_by_shares(const LayerPlacement& p, const Nodes& nodes, const std::vector<std::vector<int64_t>>& counts,
                        std::vector<std::vector<int64_t>> share, Rows* rows) {
  const int R = p.n_ranks, E = p.n_experts();
  std::vector<int64_t> left(R);
  for (int e = 0; e < E; ++e) {
    for (int s = 0; s < R; ++s) {
      const int64_t keep = std::min(counts[s][e], share[e][s]);
      (*rows)[s][e][s] = keep;
      share[e][s] -= keep;
      left[s] = counts[s][e] - keep;
    }
    for (const bool same_node_only : {true, false}) {
      for (int s = 0; s < R; ++s) {
        for (int d : p.replicas[e]) {
          if (left[s] == 0) break;
          if (same_node_only && nodes.node_of_rank[d] != nodes.node_of_rank[s]) continue;
          const int64_t moved = std::min(left[s], share[e][d]);
          (*rows)[s][e][d] += moved;
          share[e][d] -= moved;
          left[s] -= moved;
        }
      }
    }
  }
}

// Whole tokens from a real split: each holder its share rounded down, the tokens left one each to the
// holders with the largest fractions (ties: holders in the order c[(e + i) % n], as under even).
std::vector<int64_t> whole_shares(const std::vector<int>& holders, const std::vector<double>& share, int64_t total,
                                  int e, int R) {
  const int64_t n = static_cast<int64_t>(holders.size());
  std::vector<int64_t> whole(R, 0);
  std::vector<std::pair<double, int64_t>> fraction;  // (fraction, position in the rotated order)
  int64_t given = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t at = (e + i) % n;
    const double x = std::max(0.0, share[at]);
    whole[holders[at]] = std::min(total - given, static_cast<int64_t>(std::floor(x)));
    given += whole[holders[at]];
    fraction.emplace_back(x - std::floor(x), i);
  }
  std::stable_sort(fraction.begin(), fraction.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (int64_t k = 0; given < total; k = (k + 1) % n, ++given) ++whole[holders[(e + fraction[k].second) % n]];
  return whole;
}

}  // namespace

std::vector<std::vector<double>> balanced_shares(const LayerPlacement& p, const std::vector<double>& tokens) {
  detail::require_valid("balanced_shares", p);
  const int R = p.n_ranks, E = p.n_experts();
  if (static_cast<int>(tokens.size()) != E) violated("balanced_shares", "tokens must be [E]");
  std::vector<std::vector<double>> share(E);
  std::vector<double> load(R, 0.0);
  std::vector<int> shared;  // experts with several holders
  for (int e = 0; e < E; ++e) {
    if (!(tokens[e] >= 0) || !std::isfinite(tokens[e])) violated("balanced_shares", "tokens must be finite, >= 0");
    share[e].assign(p.replicas[e].size(), 0.0);
    if (p.replicas[e].size() == 1) {
      share[e][0] = tokens[e];
      load[p.replicas[e][0]] += tokens[e];
    } else {
      shared.push_back(e);
    }
  }
  std::stable_sort(shared.begin(), shared.end(), [&](int a, int b) { return tokens[a] > tokens[b]; });
  for (int e : shared) {
    // Pour tokens[e] onto its holders, the least loaded first, up to the level L where
    // sum over holders of max(0, L - load) = tokens[e].
    const std::vector<int>& holders = p.replicas[e];
    std::vector<size_t> order(holders.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return load[holders[a]] < load[holders[b]]; });
    double level = 0, below = 0;  // below: the loads of the holders under the level
    for (size_t k = 0; k < order.size(); ++k) {
      below += load[holders[order[k]]];
      level = (tokens[e] + below) / static_cast<double>(k + 1);
      if (k + 1 == order.size() || level <= load[holders[order[k + 1]]]) break;
    }
    for (size_t i = 0; i < holders.size(); ++i) {
      share[e][i] = std::max(0.0, level - load[holders[i]]);
      load[holders[i]] += share[e][i];
    }
  }
  return share;
}

std::vector<std::vector<std::vector<int64_t>>> dispatch_plan(const LayerPlacement& p, const Nodes& nodes,
                                                             const std::vector<std::vector<int64_t>>& counts,
                                                             DispatchRule rule) {
  constexpr const char* kWhere = "dispatch_plan";
  detail::require_valid(kWhere, p);
  const int R = p.n_ranks, E = p.n_experts();
  detail::require_nodes(kWhere, nodes, R);
  detail::require_counts(kWhere, counts, R, E);

  Rows rows(R, std::vector<std::vector<int64_t>>(E, std::vector<int64_t>(R, 0)));
  if (rule == DispatchRule::nearest) {
    dispatch_nearest(p, nodes, counts, &rows);
    return rows;
  }
  std::vector<int64_t> total(E, 0);
  for (int s = 0; s < R; ++s)
    for (int e = 0; e < E; ++e) total[e] += counts[s][e];
  std::vector<std::vector<int64_t>> share(E, std::vector<int64_t>(R, 0));
  if (rule == DispatchRule::even) {
    for (int e = 0; e < E; ++e) {
      const auto& holders = p.replicas[e];
      const int64_t n = static_cast<int64_t>(holders.size());
      for (int d : holders) share[e][d] = total[e] / n;
      for (int64_t i = 0; i < total[e] % n; ++i) ++share[e][holders[(e + i) % n]];
    }
  } else {
    const std::vector<std::vector<double>> split = balanced_shares(p, std::vector<double>(total.begin(), total.end()));
    for (int e = 0; e < E; ++e) share[e] = whole_shares(p.replicas[e], split[e], total[e], e, R);
  }
  dispatch_by_shares(p, nodes, counts, std::move(share), &rows);
  return rows;
}

std::vector<int64_t> received_tokens(const std::vector<std::vector<std::vector<int64_t>>>& rows) {
  const size_t R = rows.size();
  std::vector<int64_t> received(R, 0);
  for (const auto& per_expert : rows) {
    for (const auto& to : per_expert) {
      if (to.size() != R) violated("received_tokens", "rows must be [R][E][R]");
      for (size_t d = 0; d < R; ++d) received[d] += to[d];
    }
  }
  return received;
}

std::vector<ExpertMove> owner_moves(const std::vector<int>& old_owner, const std::vector<int>& new_owner) {
  if (old_owner.size() != new_owner.size()) violated("owner_moves", "owner vectors differ in length");
  std::vector<ExpertMove> moves;
  for (size_t e = 0; e < old_owner.size(); ++e) {
    if (old_owner[e] < 0 || new_owner[e] < 0) violated("owner_moves", "negative owner");
    if (old_owner[e] != new_owner[e]) moves.push_back({static_cast<int>(e), old_owner[e], new_owner[e]});
  }
  return moves;
}

double busiest_load(const std::vector<double>& load, const CorePools& pools) {
  if (pools.empty()) return load.empty() ? 0.0 : *std::max_element(load.begin(), load.end());
  const int P = static_cast<int>(pools.ranks_at_once.size());
  if (pools.pool_of_rank.size() != load.size()) violated("busiest_load", "pool_of_rank must have one pool per rank");
  std::vector<double> most(P, 0.0), sum(P, 0.0);
  std::vector<int> ranks(P, 0);
  for (size_t r = 0; r < load.size(); ++r) {
    const int p = pools.pool_of_rank[r];
    if (p < 0 || p >= P) violated("busiest_load", "a pool id out of range");
    most[p] = std::max(most[p], load[r]), sum[p] += load[r], ++ranks[p];
  }
  double busiest = 0;
  for (int p = 0; p < P; ++p) {
    const double c = pools.ranks_at_once[p];
    if (!(c > 0) || !std::isfinite(c)) violated("busiest_load", "ranks_at_once must be positive and finite");
    if (ranks[p] > 0) busiest = std::max(busiest, std::min(1.0, c / ranks[p]) * std::max(most[p], sum[p] / c));
  }
  return busiest;
}

double busiest_load(const std::vector<int64_t>& load, const CorePools& pools) {
  return busiest_load(std::vector<double>(load.begin(), load.end()), pools);
}

CorePools nic_pools(const std::vector<int>& nic_of_rank) {
  CorePools pools;
  std::map<int, int> pool_of_nic;
  bool shared = false;
  for (int nic : nic_of_rank) {
    if (nic < 0) violated("nic_pools", "NIC ids must be >= 0");
    const auto [it, added] = pool_of_nic.emplace(nic, static_cast<int>(pool_of_nic.size()));
    shared = shared || !added;
    pools.pool_of_rank.push_back(it->second);
  }
  if (!shared) return {};
  pools.ranks_at_once.assign(pool_of_nic.size(), 1.0);
  return pools;
}

}  // namespace moe::plan
