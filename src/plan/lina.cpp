#include "plan/lina.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <numeric>
#include <stdexcept>
#include <string>
#include <unordered_map>

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

std::vector<double> PathProfile::estimate(int64_t l, std::span<const int32_t> paths, int64_t path_len,
                                          int64_t k) const {
  if (path_len < 1 || paths.size() % static_cast<size_t>(path_len) != 0)
    throw std::logic_error("PathProfile::estimate: REQUIRES paths [N][path_len], path_len >= 1");
  // distribution() reads the last min(path_length, l) choices: those key the tokens that share one.
  // Choices out of range are found in no profile, whatever their value: one key for all of them.
  const int64_t tail = std::min<int64_t>({path_length_, l, path_len});
  const int64_t N = static_cast<int64_t>(paths.size()) / path_len;
  const bool keyed = tail * std::log2(static_cast<double>(E_) + 1) < 62;
  std::unordered_map<uint64_t, std::vector<double>> seen;  // key -> the token's top-k share of P(e | path)
  std::vector<double> pop(E_, 0.0), p;
  for (int64_t t = 0; t < N; ++t) {
    const std::span<const int32_t> path = paths.subspan(t * path_len, path_len);
    uint64_t key = 0;
    for (int64_t i = path_len - tail; keyed && i < path_len; ++i)
      key = key * static_cast<uint64_t>(E_ + 1) + static_cast<uint64_t>(path[i] >= 0 && path[i] < E_ ? path[i] : E_);
    auto it = keyed ? seen.find(key) : seen.end();
    if (it == seen.end()) {
      distribution(l, path, &p);
      std::vector<double> share(E_, 0.0);
      for (int e : top_experts(p, k)) share[e] = p[e];
      if (!keyed) {
        for (int64_t e = 0; e < E_; ++e) pop[e] += share[e];
        continue;
      }
      it = seen.emplace(key, std::move(share)).first;
    }
    for (int64_t e = 0; e < E_; ++e) pop[e] += it->second[e];
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

LinaCost::Weights LinaCost::weights(double tokens) const {
  if (rows.empty() || rows.size() != seconds.size())
    throw std::logic_error("LinaCost::weights, expert_seconds: REQUIRES rows and seconds of one size >= 1");
  if (!(tokens > 0)) return {};
  const size_t n = rows.size();
  if (tokens <= rows[0]) return {0, 0, tokens / rows[0], 0};
  const size_t hi = std::min<size_t>(n - 1, std::upper_bound(rows.begin(), rows.end(), tokens) - rows.begin());
  if (hi == 0) return {0, 0, 1, 0};  // one point: flat beyond it
  const size_t lo = hi - 1;
  const double t = (tokens - rows[lo]) / (rows[hi] - rows[lo]);  // beyond the last point: > 1
  return {lo, hi, 1 - t, t};
}

double LinaCost::expert_seconds(double tokens) const {
  const Weights w = weights(tokens);
  return w.w_lo * seconds[w.lo] + w.w_hi * seconds[w.hi];
}

LinaCurveFit::LinaCurveFit(std::vector<double> rows) {
  if (rows.empty() || !(rows[0] > 0) || !std::is_sorted(rows.begin(), rows.end()) ||
      std::adjacent_find(rows.begin(), rows.end()) != rows.end())
    throw std::logic_error("LinaCurveFit: REQUIRES rows non-empty, ascending, rows[0] > 0");
  const size_t G = rows.size();
  shape_.seconds.assign(G, 0.0);
  shape_.rows = std::move(rows);
  gram_.assign(G * G, 0.0);
  rhs_.assign(G, 0.0);
}

void LinaCurveFit::add(std::span<const int64_t> rows_of_each, double seconds) {
  const size_t G = rhs_.size();
  std::vector<double> a(G, 0.0);  // the run's time = a . curve seconds
  bool ran = false;
  for (int64_t n : rows_of_each) {
    if (n <= 0) continue;
    const LinaCost::Weights w = shape_.weights(static_cast<double>(n));
    a[w.lo] += w.w_lo, a[w.hi] += w.w_hi;
    ran = true;
  }
  if (!ran) return;
  squares_ += seconds * seconds;
  for (size_t i = 0; i < G; ++i) {
    rhs_[i] += a[i] * seconds;
    for (size_t j = 0; j < G; ++j) gram_[i * G + j] += a[i] * a[j];
  }
  runs_ += 1;
}

std::vector<double> LinaCurveFit::sums() const {
  std::vector<double> s = gram_;
  s.insert(s.end(), rhs_.begin(), rhs_.end());
  s.push_back(squares_);
  s.push_back(runs_);
  return s;
}

void LinaCurveFit::clear() {
  std::fill(gram_.begin(), gram_.end(), 0.0);
  std::fill(rhs_.begin(), rhs_.end(), 0.0);
  squares_ = runs_ = 0;
}

void LinaCurveFit::add_sums(std::span<const double> sums) {
  const size_t G = rhs_.size();
  if (sums.size() != G * G + G + 2) throw std::logic_error("LinaCurveFit::add_sums: not [G*G + G + 2]");
  for (size_t i = 0; i < G * G; ++i) gram_[i] += sums[i];
  for (size_t i = 0; i < G; ++i) rhs_[i] += sums[G * G + i];
  squares_ += sums[G * G + G];
  runs_ += sums[G * G + G + 1];
}

void LinaCurveFit::decay(double keep) {
  for (double& x : gram_) x *= keep;
  for (double& x : rhs_) x *= keep;
  squares_ *= keep, runs_ *= keep;
}

LinaCost LinaCurveFit::fitted(const LinaCost& prior, double prior_weight) const {
  const size_t G = rhs_.size();
  if (prior.rows != shape_.rows || prior.seconds.size() != G || !(prior_weight > 0))
    throw std::logic_error("LinaCurveFit::fitted: REQUIRES the prior's rows and prior_weight > 0");
  // The prior's shape at the runs' level first: the scale s that fits the runs best with the prior's
  // curve alone (s = p.rhs / p.gram.p), so that points the runs leave undetermined move with the
  // rest instead of holding the start-up level (a start-up measurement 2x off moves every point).
  double p_rhs = 0, p_gram_p = 0;
  for (size_t i = 0; i < G; ++i) {
    p_rhs += prior.seconds[i] * rhs_[i];
    for (size_t j = 0; j < G; ++j) p_gram_p += prior.seconds[i] * gram_[i * G + j] * prior.seconds[j];
  }
  const double scale = p_gram_p > 0 && p_rhs > 0 ? p_rhs / p_gram_p : 1.0;
  // (gram + w I) x = rhs + w scale prior: symmetric positive definite, solved by elimination.
  std::vector<double> a = gram_, b = rhs_;
  for (size_t i = 0; i < G; ++i) a[i * G + i] += prior_weight, b[i] += prior_weight * scale * prior.seconds[i];
  for (size_t k = 0; k < G; ++k)
    for (size_t i = k + 1; i < G; ++i) {
      const double f = a[i * G + k] / a[k * G + k];
      for (size_t j = k; j < G; ++j) a[i * G + j] -= f * a[k * G + j];
      b[i] -= f * b[k];
    }
  std::vector<double> x(G);
  for (size_t i = G; i-- > 0;) {
    double s = b[i];
    for (size_t j = i + 1; j < G; ++j) s -= a[i * G + j] * x[j];
    x[i] = s / a[i * G + i];
  }
  LinaCost out = prior;
  for (size_t i = 0; i < G; ++i)
    out.seconds[i] = std::max(x[i], i > 0 ? out.seconds[i - 1] : scale * prior.seconds[0] * 1e-3);
  if (runs_ > 0) {  // residual sum of squares of x: sum t^2 - 2 x.rhs + x.gram.x
    double rss = squares_;
    for (size_t i = 0; i < G; ++i) {
      rss -= 2 * x[i] * rhs_[i];
      for (size_t j = 0; j < G; ++j) rss += x[i] * gram_[i * G + j] * x[j];
    }
    out.noise_seconds = std::sqrt(std::max(0.0, rss) / runs_);
  }
  return out;
}

LinaCost LinaCost::affine(double fixed_seconds, double token_seconds, double move_seconds) {
  return LinaCost{{1, 2}, {fixed_seconds + token_seconds, fixed_seconds + 2 * token_seconds}, move_seconds};
}

double lina_busiest_seconds(const LayerPlacement& p, const std::vector<double>& popularity, const LinaCost& cost) {
  const int E = p.n_experts();
  if (static_cast<int>(popularity.size()) != E) throw std::logic_error("lina_busiest_seconds: popularity is not [E]");
  std::vector<double> rank(p.n_ranks, 0.0);
  const std::vector<std::vector<double>> shares = balanced_shares(p, popularity);
  for (int e = 0; e < E; ++e) {
    if (!(popularity[e] > 0)) continue;
    // A holder that runs the expert runs at least one row: one token (or an estimate's fraction of
    // one) cannot be split, it lands whole on one holder.
    const double whole = std::min(popularity[e], 1.0);
    for (size_t i = 0; i < p.replicas[e].size(); ++i)
      if (shares[e][i] > 0) rank[p.replicas[e][i]] += cost.expert_seconds(std::max(shares[e][i], whole));
  }
  if (!(cost.noise_seconds > 0)) return *std::max_element(rank.begin(), rank.end());
  // Clark (1961): the first two moments of max(X, Y) for independent normal X, Y, the running maximum
  // taken as normal again, over the ranks that run an expert (the others take no time).
  const double v = cost.noise_seconds * cost.noise_seconds;
  double mean = 0, var = -1;  // var < 0: no rank folded in yet
  for (double t : rank) {
    if (!(t > 0)) continue;
    if (var < 0) {
      mean = t, var = v;
      continue;
    }
    const double theta = std::sqrt(var + v);
    const double alpha = (mean - t) / theta;
    const double cdf = 0.5 * std::erfc(-alpha / std::numbers::sqrt2);
    const double pdf = std::exp(-0.5 * alpha * alpha) * std::numbers::inv_sqrtpi / std::numbers::sqrt2;
    const double m1 = mean * cdf + t * (1 - cdf) + theta * pdf;
    const double m2 = (mean * mean + var) * cdf + (t * t + v) * (1 - cdf) + (mean + t) * theta * pdf;
    mean = m1, var = std::max(0.0, m2 - m1 * m1);
  }
  return mean;
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
