// Baseline planners: FasterMoE shadowing, FlexMoE replica re-planning, SmartMoE permutation.
#include "plan/baselines.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "plan/detail.h"

namespace moe::plan {

using detail::add_replica;
using detail::violated;

namespace {

bool positive_finite(double x) { return std::isfinite(x) && x > 0; }

void require_fastermoe_model(const char* where, const FasterMoeModel& m) {
  if (m.d_model <= 0 || !positive_finite(m.ffn_ratio) || m.bytes_per_element <= 0 || !positive_finite(m.bandwidth) ||
      !positive_finite(m.gemm_flops) || m.transfers_per_shadow < 1 || !(m.weights_bandwidth >= 0) ||
      !std::isfinite(m.weights_bandwidth))
    violated(where, "FasterMoeModel fields must be positive and finite");
}

double max_of(const std::vector<double>& v) { return v.empty() ? 0.0 : *std::max_element(v.begin(), v.end()); }

}  // namespace

// ---- FasterMoE ----

FasterMoeUnitCosts fastermoe_unit_costs(const FasterMoeModel& model) {
  require_fastermoe_model("fastermoe_unit_costs", model);
  const double H = static_cast<double>(model.d_model), s = static_cast<double>(model.bytes_per_element);
  const double a_h2 = model.ffn_ratio * H * H;
  FasterMoeUnitCosts u;
  u.t_c = 4 * a_h2 / model.gemm_flops;
  u.t_f = H * s / model.bandwidth;
  const double weights_bandwidth = model.weights_bandwidth > 0 ? model.weights_bandwidth : model.bandwidth;
  u.t_m = model.transfers_per_shadow * 2 * a_h2 * s / weights_bandwidth;
  return u;
}

std::vector<int> fastermoe_shadowed(const std::vector<int>& owner, const std::vector<std::vector<int64_t>>& counts,
                                    const FasterMoeModel& model) {
  constexpr const char* kWhere = "fastermoe_shadowed";
  const FasterMoeUnitCosts u = fastermoe_unit_costs(model);
  const int R = static_cast<int>(counts.size()), E = static_cast<int>(owner.size());
  detail::require_counts(kWhere, counts, R, E);
  std::vector<int64_t> load(E, 0);
  std::vector<int64_t> rows(R, 0);  // B_w(S), S empty
  for (int e = 0; e < E; ++e) {
    if (owner[e] < 0 || owner[e] >= R) violated(kWhere, "owner out of range");
    for (int w = 0; w < R; ++w) load[e] += counts[w][e];
    rows[owner[e]] += load[e];
  }
  // Per token on the busiest rank: 3 GEMM passes (forward + backward), on cores its pool may share,
  // and 4 transfers (two all-to-alls each way).
  auto latency = [&](const std::vector<int64_t>& b, size_t k) {
    return 3 * u.t_c * busiest_load(b, model.cores) +
           4 * u.t_f * static_cast<double>(*std::max_element(b.begin(), b.end())) + static_cast<double>(k) * u.t_m;
  };
  std::vector<int> shadowed;
  std::vector<bool> in_s(E, false);
  double best = latency(rows, 0);
  size_t best_size = 0;
  while (static_cast<int>(shadowed.size()) + 1 < E) {
    const int busiest = static_cast<int>(std::max_element(rows.begin(), rows.end()) - rows.begin());
    int hot = -1;
    for (int e = 0; e < E; ++e)
      if (owner[e] == busiest && !in_s[e] && load[e] > 0 && (hot < 0 || load[e] > load[hot])) hot = e;
    if (hot < 0) break;
    rows[busiest] -= load[hot];
    for (int w = 0; w < R; ++w) rows[w] += counts[w][hot];
    shadowed.push_back(hot);
    in_s[hot] = true;
    if (const double lat = latency(rows, shadowed.size()); lat < best) best = lat, best_size = shadowed.size();
  }
  shadowed.resize(best_size);
  return shadowed;
}

LayerPlacement fastermoe_plan(const LayerPlacement& sharded, const std::vector<std::vector<int64_t>>& counts,
                              const FasterMoeModel& model) {
  constexpr const char* kWhere = "fastermoe_plan";
  detail::require_valid(kWhere, sharded);
  const int R = sharded.n_ranks, E = sharded.n_experts();
  detail::require_counts(kWhere, counts, R, E);
  LayerPlacement out = sharded;
  std::vector<int> all(R);
  std::iota(all.begin(), all.end(), 0);
  // L_e over source ranks (FastMoE v1 summed the other axis).
  for (int e : fastermoe_shadowed(sharded.owner, counts, model)) out.replicas[e] = all;
  return out;
}

// ---- FlexMoE ----

std::vector<double> flexmoe_rank_loads(const LayerPlacement& p, const std::vector<double>& load) {
  detail::require_valid("flexmoe_rank_loads", p);
  detail::require_loads("flexmoe_rank_loads", load, p.n_experts());
  std::vector<double> rank_load(p.n_ranks, 0.0);
  for (int e = 0; e < p.n_experts(); ++e) {
    const double share = load[e] / static_cast<double>(p.replicas[e].size());
    for (int r : p.replicas[e]) rank_load[r] += share;
  }
  return rank_load;
}

double flexmoe_balance_ratio(const LayerPlacement& p, const std::vector<double>& load) {
  const std::vector<double> rank_load = flexmoe_rank_loads(p, load);
  const double mean = std::accumulate(rank_load.begin(), rank_load.end(), 0.0) / p.n_ranks;
  return mean > 0 ? max_of(rank_load) / mean : 1.0;
}

namespace {

void drop_replica(LayerPlacement& p, int expert, int rank) {
  auto& r = p.replicas[expert];
  r.erase(std::find(r.begin(), r.end(), rank));
  if (p.owner[expert] == rank) p.owner[expert] = r.front();  // the master copy passes to the lowest replica
}

}  // namespace

FlexMoePlan flexmoe_plan(const LayerPlacement& current, const std::vector<double>& load, int steps_since_replan,
                         const FlexMoeConfig& cfg) {
  constexpr const char* kWhere = "flexmoe_plan";
  detail::require_valid(kWhere, current);
  const int R = current.n_ranks, E = current.n_experts();
  detail::require_loads(kWhere, load, E);
  if (E % R != 0) violated(kWhere, "the number of experts must be a multiple of the number of ranks");
  if (cfg.reserved_slots < 0 || !(cfg.balance_threshold >= 1) || cfg.replan_interval < 1 ||
      !positive_finite(cfg.expert_seconds_per_token) || cfg.expert_state_bytes <= 0 || !positive_finite(cfg.bandwidth) ||
      !(cfg.replica_step_seconds >= 0) || !std::isfinite(cfg.replica_step_seconds))
    violated(kWhere, "invalid FlexMoeConfig");
  if (steps_since_replan < 0) violated(kWhere, "steps_since_replan must be non-negative");
  const int slots = E / R + cfg.reserved_slots;
  std::vector<int> held(R, 0);
  for (int e = 0; e < E; ++e)
    for (int r : current.replicas[e]) ++held[r];
  for (int r = 0; r < R; ++r)
    if (held[r] > slots) violated(kWhere, "a rank holds more experts than its slots");

  FlexMoePlan plan;
  plan.placement = current;
  plan.balance_before = plan.balance_after = flexmoe_balance_ratio(current, load);
  plan.replanned = plan.balance_before > cfg.balance_threshold || steps_since_replan >= cfg.replan_interval;

  const double move_seconds = static_cast<double>(cfg.expert_state_bytes) / cfg.bandwidth;
  LayerPlacement& p = plan.placement;
  auto per_replica = [&](const LayerPlacement& q, int e) {
    return load[e] / static_cast<double>(q.replicas[e].size());
  };
  while (plan.replanned) {
    const std::vector<double> rank_load = flexmoe_rank_loads(p, load);
    int hot = -1;
    for (int e = 0; e < E; ++e) {
      if (load[e] <= 0 || static_cast<int>(p.replicas[e].size()) == R) continue;
      if (hot < 0 || per_replica(p, e) > per_replica(p, hot)) hot = e;
    }
    if (hot < 0) break;

    LayerPlacement next = p;
    std::vector<ReplicaMove> moves;
    int target = -1;
    for (int r = 0; r < R; ++r) {
      if (held[r] >= slots || p.holds(r, hot)) continue;
      if (target < 0 || rank_load[r] < rank_load[target]) target = r;
    }
    if (target < 0) {  // no free slot anywhere it could go: migrate a replica of the coldest expert
      int cold = -1;
      for (int e = 0; e < E; ++e) {
        if (e == hot || p.replicas[e].size() < 2) continue;
        const bool movable = std::any_of(p.replicas[e].begin(), p.replicas[e].end(),
                                         [&](int r) { return !p.holds(r, hot); });
        if (movable && (cold < 0 || per_replica(p, e) < per_replica(p, cold))) cold = e;
      }
      if (cold < 0) break;
      for (int r : p.replicas[cold]) {
        if (p.holds(r, hot)) continue;
        if (target < 0 || rank_load[r] < rank_load[target]) target = r;
      }
      drop_replica(next, cold, target);
      moves.push_back({ReplicaMove::Kind::shrink, cold, target, -1});
    }
    add_replica(next, hot, target);
    moves.push_back({ReplicaMove::Kind::expand, hot, target, p.owner[hot]});

    const double saved =
        (busiest_load(rank_load, cfg.cores) - busiest_load(flexmoe_rank_loads(next, load), cfg.cores)) *
        cfg.expert_seconds_per_token;
    const double added = moves.size() == 1 ? cfg.replica_step_seconds : 0;  // an expand keeps one more replica
    if (!((saved - added) * cfg.replan_interval > move_seconds)) break;
    if (moves.size() == 1) ++held[target];  // a migrate keeps the target's count
    p = std::move(next);
    plan.moves.insert(plan.moves.end(), moves.begin(), moves.end());
  }
  // Shrink, every step, the replicas that relieve no maximum (a load that moved on leaves them behind;
  // dropping one moves nothing).
  for (;;) {
    const double max_before = busiest_load(flexmoe_rank_loads(p, load), cfg.cores);
    double least_rise = std::numeric_limits<double>::infinity();
    int drop_expert = -1, drop_rank = -1;
    for (int e = 0; e < E; ++e)
      for (int r : p.replicas[e]) {
        if (r == p.owner[e]) continue;  // the master copy stays
        LayerPlacement without = p;
        drop_replica(without, e, r);
        const double rise = busiest_load(flexmoe_rank_loads(without, load), cfg.cores) - max_before;
        if (rise < least_rise) least_rise = rise, drop_expert = e, drop_rank = r;
      }
    if (drop_expert < 0 || least_rise > 0) break;
    drop_replica(p, drop_expert, drop_rank);
    plan.moves.push_back({ReplicaMove::Kind::shrink, drop_expert, drop_rank, -1});
  }
  plan.balance_after = flexmoe_balance_ratio(p, load);
  return plan;
}

// ---- SmartMoE ----

std::vector<double> owner_rank_loads(const std::vector<int>& owner, int n_ranks, const std::vector<double>& load) {
  if (n_ranks < 1) violated("owner_rank_loads", "needs n_ranks >= 1");
  detail::require_loads("owner_rank_loads", load, static_cast<int>(owner.size()));
  std::vector<double> rank_load(n_ranks, 0.0);
  for (size_t e = 0; e < owner.size(); ++e) {
    if (owner[e] < 0 || owner[e] >= n_ranks) violated("owner_rank_loads", "owner out of range");
    rank_load[owner[e]] += load[e];
  }
  return rank_load;
}

SmartMoePlan smartmoe_plan(const std::vector<int>& owner, int n_ranks, const std::vector<double>& load,
                           int steps_since_update, const SmartMoeConfig& cfg) {
  constexpr const char* kWhere = "smartmoe_plan";
  if (cfg.interval < 1 || steps_since_update < 0) violated(kWhere, "needs interval >= 1, steps_since_update >= 0");
  const bool priced = cfg.expert_seconds_per_token != 0 || cfg.expert_state_bytes != 0 || cfg.bandwidth != 0;
  if (priced && (!positive_finite(cfg.expert_seconds_per_token) || cfg.expert_state_bytes <= 0 ||
                 !positive_finite(cfg.bandwidth) || !(cfg.exchange_seconds_per_token >= 0) ||
                 !std::isfinite(cfg.exchange_seconds_per_token)))
    violated(kWhere, "a priced SmartMoeConfig needs every cost field > 0 and finite");
  const std::vector<double> before = owner_rank_loads(owner, n_ranks, load);
  const int E = static_cast<int>(owner.size());
  if (E % n_ranks != 0) violated(kWhere, "the number of experts must be a multiple of the number of ranks");
  const int per_rank = E / n_ranks;
  std::vector<int> owned(n_ranks, 0);
  for (int r : owner) ++owned[r];
  for (int r = 0; r < n_ranks; ++r)
    if (owned[r] != per_rank) violated(kWhere, "every rank must own exactly E / n_ranks experts");

  SmartMoePlan plan;
  plan.owner = owner;
  plan.max_load_before = plan.max_load_after = max_of(before);
  if (steps_since_update < cfg.interval) return plan;
  plan.evaluated = true;

  std::vector<int> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return load[a] > load[b]; });
  std::vector<int> next(E, -1), free(n_ranks, per_rank);
  std::vector<double> acc(n_ranks, 0.0);
  for (int e : order) {
    int best = -1;
    for (int r = 0; r < n_ranks; ++r) {
      if (free[r] == 0) continue;
      // Strictly lower wins; on a tie the expert's current rank wins over the lower rank found first.
      if (best < 0 || acc[r] < acc[best] || (acc[r] == acc[best] && r == owner[e])) best = r;
    }
    next[e] = best;
    --free[best];
    acc[best] += load[e];
  }
  const double after = max_of(acc);
  if (!(after < plan.max_load_before)) return plan;
  std::vector<ExpertMove> moves = owner_moves(owner, next);
  if (priced) {
    std::vector<int> received(n_ranks, 0);
    for (const ExpertMove& m : moves) ++received[m.to];
    const int most = *std::max_element(received.begin(), received.end());
    const double compute = (busiest_load(before, cfg.cores) - busiest_load(acc, cfg.cores)) *
                           cfg.expert_seconds_per_token;
    const double exchange = (busiest_load(before, cfg.nics) - busiest_load(acc, cfg.nics)) *
                            cfg.exchange_seconds_per_token;
    plan.saved_seconds = (compute + exchange) * cfg.interval;
    plan.move_seconds = most * static_cast<double>(cfg.expert_state_bytes) / cfg.bandwidth;
    if (!(plan.saved_seconds > plan.move_seconds)) return plan;
  }
  plan.adopted = true;
  plan.moves = std::move(moves);
  plan.owner = std::move(next);
  plan.max_load_after = after;
  return plan;
}

}  // namespace moe::plan
