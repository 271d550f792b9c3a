#include "plan/lina.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>

namespace moe::plan {

PathProfile::PathProfile(int64_t moe_layers, int64_t experts, int path_length)
    : L_(moe_layers), E_(experts), path_length_(path_length) {
  if (moe_layers < 1 || experts < 1 || path_length < 1)
    throw std::logic_error("PathProfile: REQUIRES moe_layers, experts, path_length >= 1");
  counts_.resize(L_);
}

void PathProfile::add(std::span<const int32_t> first, std::span<const int32_t> chosen) {
  if (static_cast<int64_t>(first.size()) != L_ || chosen.empty() || chosen.size() % L_ != 0)
    throw std::logic_error("PathProfile::add: REQUIRES first [L] and chosen [L*K]");
  const int64_t K = static_cast<int64_t>(chosen.size()) / L_;
  if (K_ != 0 && K != K_) throw std::logic_error("PathProfile::add: every token needs the same top-k");
  K_ = K;
  for (int32_t e : chosen)
    if (e < 0 || e >= E_) throw std::logic_error("PathProfile::add: expert " + std::to_string(e) + " out of range");
  ++tokens_;
  for (int64_t l = 0; l < L_; ++l) {
    const int64_t longest = std::min<int64_t>(path_length_, l);
    for (int64_t len = 0; len <= longest; ++len) {
      std::vector<int32_t> path(first.begin() + (l - len), first.begin() + l);
      std::vector<int64_t>& c = counts_[l][path];
      if (c.empty()) c.assign(E_, 0);
      for (int64_t k = 0; k < K; ++k) ++c[chosen[l * K + k]];
    }
  }
}

void PathProfile::distribution(int64_t l, std::span<const int32_t> previous, std::vector<double>* p) const {
  if (l < 0 || l >= L_) throw std::logic_error("PathProfile::distribution: layer out of range");
  p->assign(E_, 1.0 / static_cast<double>(E_));
  const int64_t longest = std::min<int64_t>({static_cast<int64_t>(path_length_), l, static_cast<int64_t>(previous.size())});
  for (int64_t len = longest; len >= 0; --len) {
    const std::vector<int32_t> path(previous.end() - len, previous.end());
    auto it = counts_[l].find(path);
    if (it == counts_[l].end()) continue;
    const int64_t n = std::accumulate(it->second.begin(), it->second.end(), int64_t{0});
    if (n == 0 || (len > 0 && n < kMinPathCount * K_)) continue;  // n counts choices: K per token
    for (int64_t e = 0; e < E_; ++e) (*p)[e] = static_cast<double>(it->second[e]) / static_cast<double>(n);
    return;
  }
}

std::vector<double> PathProfile::estimate(int64_t l, const std::vector<std::vector<int32_t>>& paths, int64_t k) const {
  std::vector<double> pop(E_, 0.0), p;
  for (const std::vector<int32_t>& path : paths) {
    distribution(l, path, &p);
    for (int e : top_experts(p, k)) pop[e] += p[e];
  }
  return pop;
}

std::vector<int> top_experts(const std::vector<double>& value, int64_t k) {
  std::vector<int> order(value.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return value[a] > value[b]; });
  order.resize(std::min<size_t>(order.size(), static_cast<size_t>(std::max<int64_t>(k, 0))));
  std::sort(order.begin(), order.end());
  return order;
}

std::vector<int> lina_slots(const std::vector<double>& popularity, int n_ranks) {
  if (n_ranks < 1) throw std::logic_error("lina_slots: REQUIRES n_ranks >= 1");
  const double total = std::accumulate(popularity.begin(), popularity.end(), 0.0);
  const int E = static_cast<int>(popularity.size());
  std::vector<int> slots(E, 1);
  if (!(total > 0)) return slots;
  for (int e = 0; e < E; ++e) {
    if (popularity[e] < 0) throw std::logic_error("lina_slots: negative popularity");
    slots[e] = std::clamp(static_cast<int>(std::lround(E * popularity[e] / total)), 1, n_ranks);
  }
  return slots;
}

double LinaCost::expert_seconds(double tokens) const {
  if (rows.empty() || rows.size() != seconds.size())
    throw std::logic_error("LinaCost::expert_seconds: REQUIRES rows and seconds of one size >= 1");
  if (!(tokens > 0)) return 0;
  const size_t n = rows.size();
  if (tokens <= rows[0]) return seconds[0] * tokens / rows[0];
  const size_t hi = std::min<size_t>(n - 1, std::upper_bound(rows.begin(), rows.end(), tokens) - rows.begin());
  if (hi == 0) return seconds[0];  // one point: flat beyond it
  const size_t lo = hi - 1;
  const double slope = (seconds[hi] - seconds[lo]) / (rows[hi] - rows[lo]);
  return seconds[lo] + slope * (tokens - rows[lo]);
}

LinaCost LinaCost::affine(double fixed_seconds, double token_seconds, double move_seconds) {
  return LinaCost{{1, 2}, {fixed_seconds + token_seconds, fixed_seconds + 2 * token_seconds}, move_seconds};
}

double lina_busiest_seconds(const LayerPlacement& p, const std::vector<double>& popularity, const LinaCost& cost) {
  const int E = p.n_experts();
  if (static_cast<int>(popularity.size()) != E) throw std::logic_error("lina_busiest_seconds: popularity is not [E]");
  std::vector<double> rank(p.n_ranks, 0.0);
  for (int e = 0; e < E; ++e) {
    if (!(popularity[e] > 0)) continue;
    // Holders split the tokens, but a holder that runs the expert runs at least one row: one token (or
    // an estimate's fraction of one) cannot be halved, it lands whole on one holder.
    const double share = std::max(popularity[e] / static_cast<double>(p.replicas[e].size()),
                                  std::min(popularity[e], 1.0));
    for (int r : p.replicas[e]) rank[r] += cost.expert_seconds(share);
  }
  return *std::max_element(rank.begin(), rank.end());
}

LayerPlacement lina_placement(const std::vector<double>& popularity, const LayerPlacement& owners,
                              const LinaCost* cost, const LayerPlacement* held, std::vector<double>* foregone) {
  const int E = owners.n_experts(), R = owners.n_ranks;
  if (foregone && static_cast<int64_t>(foregone->size()) != static_cast<int64_t>(R) * E)
    throw std::logic_error("lina_placement: foregone is not [R*E]");
  if (static_cast<int>(popularity.size()) != E) throw std::logic_error("lina_placement: popularity is not [E]");
  if (!owners.validate()) throw std::logic_error("lina_placement: " + owners.validate().message());
  if (held && (!held->validate() || held->n_experts() != E || held->n_ranks != R))
    throw std::logic_error("lina_placement: held is not a valid placement of the same experts and ranks");
  const std::vector<int> slots = lina_slots(popularity, R);
  LayerPlacement p = owners;
  auto load_of = [&](int rank) {
    double load = 0;
    for (int e = 0; e < E; ++e)
      if (p.holds(rank, e)) load += popularity[e] / static_cast<double>(p.replicas[e].size());
    return load;
  };
  std::vector<int> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return slots[a] != slots[b] ? slots[a] > slots[b] : popularity[a] > popularity[b];
  });
  for (int e : order) {
    while (static_cast<int>(p.replicas[e].size()) < slots[e]) {
      int best = -1;
      double best_load = 0;
      for (int r = 0; r < R; ++r) {
        if (p.holds(r, e)) continue;
        const double l = load_of(r);
        if (best < 0 || l < best_load) best = r, best_load = l;
      }
      if (best < 0) break;
      auto& holders = p.replicas[e];
      const double before = cost ? lina_busiest_seconds(p, popularity, *cost) : 0;
      holders.insert(std::upper_bound(holders.begin(), holders.end(), best), best);
      if (cost) {
        const double move = held && held->holds(best, e) ? 0.0 : cost->move_seconds;
        const double saving = before - lina_busiest_seconds(p, popularity, *cost);
        double* rent = foregone ? &(*foregone)[static_cast<size_t>(best) * E + e] : nullptr;
        if (!(saving + (rent ? *rent : 0.0) > move)) {
          if (rent && saving > 0) *rent += saving;
          holders.erase(std::find(holders.begin(), holders.end(), best));
          break;
        }
        if (rent) *rent = 0;
      }
    }
  }
  return p;
}

}  // namespace moe::plan
