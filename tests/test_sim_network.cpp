// The simulator's flow-level network (src/sim/network.h): max-min fair sharing against hand-computed
// answers, start latencies, incremental recomputation against a from-scratch oracle, determinism.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "sim/network.h"

namespace moe::sim {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Links of the given bandwidths and no latency.
Network links(std::vector<double> bandwidth) {
  std::vector<double> latency(bandwidth.size(), 0);
  return Network(std::move(bandwidth), std::move(latency));
}

TEST(SimNetwork, EqualFlowsOnOneLinkShareItAndEndTogether) {
  const double B = 10e9, S = 1e6;
  for (int n : {1, 2, 5, 16}) {
    SCOPED_TRACE(n);
    Network net = links({B});
    std::vector<int> ids;
    for (int i = 0; i < n; ++i) ids.push_back(net.start_flow({0}, S));
    for (int id : ids) EXPECT_DOUBLE_EQ(net.rate(id), B / n);
    EXPECT_DOUBLE_EQ(net.link_load(0), B);
    const double t = net.next_event_time();
    EXPECT_NEAR(t, n * S / B, 1e-15);
    EXPECT_EQ(net.advance(t), ids);  // all at once, by id
    EXPECT_EQ(net.live_flows(), 0);
    EXPECT_EQ(net.next_event_time(), kInf);
    EXPECT_NEAR(net.link_bytes(0), n * S, 1e-6);
  }
}

// Hundreds of flows on links of their own (the event queue grows past its first size while flows
// are live): every flow ends once, at bytes / bandwidth after its start latency, and each advance()
// returns the flows due then by ascending id, many at once where end times are equal.
TEST(SimNetwork, ManyFlowsEndInTimeThenIdOrder) {
  const int n = 300;
  std::vector<double> bandwidth(n, 1e9), latency(n, 0);
  Network net(bandwidth, latency);
  std::map<double, std::vector<int>> expected;  // end time -> flows, by id
  for (int i = 0; i < n; ++i) {
    const double bytes = 1e6 * (1 + (i * 7) % 13);  // 13 distinct sizes: groups of equal end times
    const double alpha = (i % 3) * 1e-3;            // and start latencies that shift some of them
    const int id = net.start_flow({i}, bytes, alpha);
    ASSERT_EQ(id, i);
    expected[alpha + bytes / 1e9].push_back(id);
  }
  std::map<double, std::vector<int>> got;
  int steps = 0;
  for (double t = net.next_event_time(); t < kInf; t = net.next_event_time()) {
    const std::vector<int> ended = net.advance(t);
    if (!ended.empty()) got[t] = ended;
    ASSERT_LT(++steps, 10 * n);
  }
  EXPECT_EQ(net.live_flows(), 0);
  ASSERT_EQ(got.size(), expected.size());
  for (auto g = got.begin(), e = expected.begin(); g != got.end(); ++g, ++e) {
    EXPECT_NEAR(g->first, e->first, 1e-15);
    EXPECT_EQ(g->second, e->second) << "at t = " << g->first;
  }
}

// A link whose bandwidth changes (CPU lanes, executor.h): flows account their bytes at the old rate
// and go on at the new one; at 0 they stall; a flow on another link is untouched.
TEST(SimNetwork, ChangingABandwidthRetimesItsFlows) {
  Network net = links({1e9, 1e9});
  const int a = net.start_flow({0}, 1e9), b = net.start_flow({1}, 1e9);
  net.advance(0.5);
  net.set_bandwidth(0, 0.5e9);  // 0.5 GB left at 0.5 GB/s
  EXPECT_DOUBLE_EQ(net.rate(a), 0.5e9);
  EXPECT_DOUBLE_EQ(net.rate(b), 1e9);
  EXPECT_NEAR(net.next_event_time(), 1.0, 1e-12);
  EXPECT_EQ(net.advance(1.0), std::vector<int>{b});
  net.set_bandwidth(0, 0);  // 0.25 GB left, stalled
  EXPECT_EQ(net.rate(a), 0);
  EXPECT_EQ(net.next_event_time(), kInf);
  net.advance(2.0);
  net.set_bandwidth(0, 1e9);
  EXPECT_NEAR(net.next_event_time(), 2.25, 1e-12);
  EXPECT_EQ(net.advance(net.next_event_time()), std::vector<int>{a});
  EXPECT_NEAR(net.link_bytes(0), 1e9, 1);
  EXPECT_THROW(net.set_bandwidth(0, -1), std::logic_error);
  EXPECT_THROW(net.set_bandwidth(2, 1), std::logic_error);
}

// A flow of weight w stands for w flows (aggregated transfers): it gets w shares of a shared link, and
// a link it shares with a narrower bottleneck's flow gives it what that flow leaves.
TEST(SimNetwork, WeightedFlowsGetTheirSharesOfMaxMin) {
  Network net = links({8e9, 1e9});
  const int heavy = net.start_flow({0}, 1e12, 0, 3);
  const int light = net.start_flow({0}, 1e12, 0, 1);
  EXPECT_DOUBLE_EQ(net.rate(heavy), 6e9);
  EXPECT_DOUBLE_EQ(net.rate(light), 2e9);
  const int capped = net.start_flow({0, 1}, 1e12, 0, 4);  // 1 GB/s at most (link 1)
  EXPECT_DOUBLE_EQ(net.rate(capped), 1e9);
  EXPECT_DOUBLE_EQ(net.rate(heavy), 5.25e9);  // 7 GB/s left, 3 : 1
  EXPECT_DOUBLE_EQ(net.rate(light), 1.75e9);
  EXPECT_THROW(net.start_flow({0}, 1, 0, 0), std::logic_error);
}

TEST(SimNetwork, MaxMinOnTheClassicThreeLinkExample) {
  // Bertsekas & Gallager, Data Networks, sec. 6.5.2: links of equal capacity; flow 0 crosses all
  // three, flows 1, 2 cross link 0, link 1, and flows 3, 4 link 2. Link 2 is the bottleneck of
  // flows 0, 3, 4 (1/3 each); flows 1 and 2 take what flow 0 leaves on links 0 and 1 (2/3).
  const double C = 3e9;
  Network net = links({C, C, C});
  const int f0 = net.start_flow({0, 1, 2}, 1e9);
  const int f1 = net.start_flow({0}, 1e9);
  const int f2 = net.start_flow({1}, 1e9);
  const int f3 = net.start_flow({2}, 1e9);
  const int f4 = net.start_flow({2}, 1e9);
  EXPECT_DOUBLE_EQ(net.rate(f0), C / 3);
  EXPECT_DOUBLE_EQ(net.rate(f3), C / 3);
  EXPECT_DOUBLE_EQ(net.rate(f4), C / 3);
  EXPECT_DOUBLE_EQ(net.rate(f1), 2 * C / 3);
  EXPECT_DOUBLE_EQ(net.rate(f2), 2 * C / 3);
  // f1 and f2 end first (1e9 bytes at 2e9/s = 0.5 s); then f0, f3, f4 still share link 2 equally.
  EXPECT_DOUBLE_EQ(net.next_event_time(), 0.5);
  EXPECT_EQ(net.advance(0.5), (std::vector<int>{f1, f2}));
  EXPECT_DOUBLE_EQ(net.rate(f0), C / 3);
  // They have 0.5e9 bytes left at 1e9/s: all end at 1 s.
  EXPECT_DOUBLE_EQ(net.next_event_time(), 1.0);
  EXPECT_EQ(net.advance(1.0), (std::vector<int>{f0, f3, f4}));
  EXPECT_DOUBLE_EQ(net.link_bytes(0), 2e9);  // f0 and f1
  EXPECT_DOUBLE_EQ(net.link_bytes(2), 3e9);  // f0, f3 and f4
}

TEST(SimNetwork, MaxMinWithTwoBottleneckLevels) {
  // Link A (10 GB/s): flows x, y. Link B (4 GB/s): flows x, z, w. B is the tighter: x = z = w = 4/3;
  // y takes the rest of A: 10 - 4/3 = 26/3 GB/s.
  Network net = links({10e9, 4e9});
  const int x = net.start_flow({0, 1}, 1e9);
  const int y = net.start_flow({0}, 1e9);
  const int z = net.start_flow({1}, 1e9);
  const int w = net.start_flow({1}, 1e9);
  EXPECT_DOUBLE_EQ(net.rate(x), 4e9 / 3);
  EXPECT_DOUBLE_EQ(net.rate(z), 4e9 / 3);
  EXPECT_DOUBLE_EQ(net.rate(w), 4e9 / 3);
  EXPECT_NEAR(net.rate(y), 26e9 / 3, 1);
}

TEST(SimNetwork, StartLatencyDelaysTheTransferAndTheLinksSumIt) {
  // Two links of 1 us each: alpha = 2 us, then 1 MB at the slower link's 1 GB/s.
  Network net(std::vector<double>{1e9, 4e9}, std::vector<double>{1e-6, 1e-6});
  const int f = net.start_flow({0, 1}, 1e6);
  EXPECT_DOUBLE_EQ(net.next_event_time(), 2e-6);
  EXPECT_EQ(net.rate(f), 0);  // still in its start latency
  EXPECT_TRUE(net.advance(1e-6).empty());
  EXPECT_TRUE(net.advance(2e-6).empty());
  EXPECT_DOUBLE_EQ(net.rate(f), 1e9);
  EXPECT_DOUBLE_EQ(net.next_event_time(), 2e-6 + 1e-3);
  // A flow with an explicit alpha and no bytes ends after its alpha alone.
  const int g = net.start_flow({0}, 0, 5e-6);
  EXPECT_DOUBLE_EQ(net.next_event_time(), 7e-6);
  EXPECT_EQ(net.advance(net.next_event_time()), std::vector<int>{g});
  EXPECT_EQ(net.advance(2e-6 + 1e-3), std::vector<int>{f});
}

TEST(SimNetwork, RefusesToSkipEventsAndBadFlows) {
  Network net = links({1e9});
  net.start_flow({0}, 1e9);
  EXPECT_THROW(net.advance(2.0), std::logic_error);  // the flow ends at 1 s
  net.advance(0.5);
  EXPECT_THROW(net.advance(0.25), std::logic_error);  // back in time
  EXPECT_THROW(net.start_flow({1}, 1), std::logic_error);
  EXPECT_THROW(net.start_flow({0, 0}, 1), std::logic_error);
  EXPECT_THROW(net.start_flow({0}, -1), std::logic_error);
  EXPECT_THROW(net.rate(7), std::logic_error);
  EXPECT_THROW(Network(std::vector<double>{0}, std::vector<double>{0}), std::logic_error);
}

TEST(SimNetwork, OnlyTheConnectedComponentIsRecomputed) {
  // Links 0-1 carry 100 flows; link 2 is disjoint. A flow starting or ending on link 2 recomputes one
  // flow, not 101.
  Network net = links({1e9, 1e9, 1e9});
  for (int i = 0; i < 100; ++i) net.start_flow({i % 2 == 0 ? 0 : 1}, 1e9 + i);
  net.start_flow({0, 1}, 5e9);
  net.next_event_time();
  const uint64_t before = net.rates_computed();
  const int lone = net.start_flow({2}, 1e3);
  EXPECT_DOUBLE_EQ(net.rate(lone), 1e9);
  EXPECT_EQ(net.rates_computed() - before, 1u);
  EXPECT_EQ(net.advance(net.next_event_time()), std::vector<int>{lone});
  net.next_event_time();
  EXPECT_EQ(net.rates_computed() - before, 1u);  // its component is now empty
}

TEST(SimNetwork, AnEndingFlowRecomputesOnlyFlowsAtLeastAsFast) {
  // Link 0 (10 GB/s): a, b, c. Link 1 (2 GB/s): a, d. a and d get 1 GB/s on link 1; b and c split
  // the 9 GB/s a leaves on link 0. When b ends, c alone (at least as fast as b) is recomputed: a and
  // d, slower than b, cannot change.
  Network net = links({10e9, 2e9});
  const int a = net.start_flow({0, 1}, 1e12);
  const int b = net.start_flow({0}, 1e9);
  const int c = net.start_flow({0}, 1e12);
  const int d = net.start_flow({1}, 1e12);
  EXPECT_DOUBLE_EQ(net.rate(a), 1e9);
  EXPECT_DOUBLE_EQ(net.rate(d), 1e9);
  EXPECT_DOUBLE_EQ(net.rate(b), 4.5e9);
  EXPECT_DOUBLE_EQ(net.rate(c), 4.5e9);
  const uint64_t before = net.rates_computed();
  EXPECT_EQ(net.advance(net.next_event_time()), std::vector<int>{b});
  EXPECT_DOUBLE_EQ(net.rate(c), 9e9);
  EXPECT_DOUBLE_EQ(net.rate(a), 1e9);
  EXPECT_EQ(net.rates_computed() - before, 1u);
}

TEST(SimNetwork, AFlowEndingOnLinksWithSlackRecomputesNothing) {
  // Link 0 (10 GB/s) carries a, b and c, and has slack: a is held to 1 GB/s by link 1, b to 2 GB/s by
  // link 2, c to 1 GB/s by link 3. When c ends, link 0 (slack: nobody's bottleneck) and link 3 (now
  // empty) free capacity that no flow can use: nothing is recomputed, and the rates stay max-min.
  Network net = links({10e9, 1e9, 2e9, 1e9});
  const int a = net.start_flow({0, 1}, 1e12);
  const int b = net.start_flow({0, 2}, 1e12);
  const int c = net.start_flow({0, 3}, 1e9);
  EXPECT_DOUBLE_EQ(net.rate(a), 1e9);
  EXPECT_DOUBLE_EQ(net.rate(b), 2e9);
  EXPECT_DOUBLE_EQ(net.rate(c), 1e9);
  const uint64_t before = net.rates_computed();
  EXPECT_EQ(net.advance(net.next_event_time()), std::vector<int>{c});
  EXPECT_DOUBLE_EQ(net.rate(a), 1e9);
  EXPECT_DOUBLE_EQ(net.rate(b), 2e9);
  EXPECT_EQ(net.rates_computed() - before, 0u);
  EXPECT_DOUBLE_EQ(net.link_load(0), 3e9);
  EXPECT_DOUBLE_EQ(net.link_load(3), 0);
  // A flow ending on a saturated link still lets the others there go faster.
  const int d = net.start_flow({1}, 1e6);  // a and d share link 1: 0.5 GB/s each
  EXPECT_DOUBLE_EQ(net.rate(a), 0.5e9);
  EXPECT_EQ(net.advance(net.next_event_time()), std::vector<int>{d});
  EXPECT_DOUBLE_EQ(net.rate(a), 1e9);
}

// A flow at the level of one that ends (bottlenecked with it) gains, even when its level, computed
// with another weight, comes out a few ulps below the ended flow's.
TEST(SimNetwork, AFlowAtTheEndedFlowsLevelUpToRoundingGains) {
  // One link shared by x (weight 1) and e (weight 3): both at level C / 4. Pick a capacity where e's
  // level, (3 * (C / 4)) / 3, rounds above x's, C / 4.
  double C = 0;
  for (double c = 1e9; c < 2e9; c += 12345.678901) {  // an odd step: round capacities divide exactly
    const double s = c / 4;
    if ((3 * s) / 3 > s) {
      C = c;
      break;
    }
  }
  ASSERT_GT(C, 0);
  Network net = links({C});
  const int x = net.start_flow({0}, 1e12, 0, 1);
  const int e = net.start_flow({0}, 1e6, 0, 3);
  EXPECT_DOUBLE_EQ(net.rate(x), C / 4);
  EXPECT_GT(net.rate(e) / 3, net.rate(x));  // the rounding this test is about
  EXPECT_EQ(net.advance(net.next_event_time()), std::vector<int>{e});
  EXPECT_DOUBLE_EQ(net.rate(x), C);
}

// Max-min rates from scratch (progressive filling), independent of Network's implementation;
// weighted (a flow of weight w gets w shares) when `weight` names the flow.
std::map<int, double> max_min(const std::vector<double>& capacity, const std::map<int, std::vector<int>>& paths,
                              const std::map<int, double>& weight = {}) {
  auto w = [&](int f) { return weight.count(f) ? weight.at(f) : 1.0; };
  const size_t L = capacity.size();
  std::vector<std::vector<int>> on(L);  // flows on each link
  std::vector<int> unfixed(L, 0);
  std::vector<double> unfixed_weight(L, 0);
  for (const auto& [f, p] : paths) {
    for (int x : p) {
      on[x].push_back(f);
      ++unfixed[x];
      unfixed_weight[x] += w(f);
    }
  }
  std::vector<double> left = capacity;
  std::map<int, double> rate;
  while (true) {
    // The link with the smallest fair share among those with unfixed flows.
    int best = -1;
    double best_share = kInf;
    for (size_t l = 0; l < L; ++l) {
      if (unfixed[l] > 0 && left[l] / unfixed_weight[l] < best_share) {
        best_share = left[l] / unfixed_weight[l];
        best = static_cast<int>(l);
      }
    }
    if (best < 0) return rate;
    for (int f : on[best]) {
      if (rate.count(f)) continue;
      rate[f] = w(f) * best_share;
      for (int x : paths.at(f)) {
        left[x] -= w(f) * best_share;
        --unfixed[x];
        unfixed_weight[x] -= w(f);
      }
    }
  }
}

// A random scenario on L links: flows of random paths, sizes and start latencies,
// started between events, the clock sometimes stopping short of the next event (as an executor's
// compute events make it), weighted when `weighted` (weights 1, 2, 3 or 8, as aggregated flows have).
// After every advance, `check` gets the network, the link capacities, the flows the test knows to be
// transferring (live, start latency over) and the live flows' weights. Returns the log of events and
// rates, floats in hex so that equal logs mean bit-equal runs.
using Check = std::function<void(Network&, const std::vector<double>&, const std::map<int, std::vector<int>>&,
                                 const std::map<int, double>&)>;

std::string run_random(uint64_t seed, int L, int steps, const Check& check, bool weighted = false) {
  std::mt19937_64 rng(seed);
  auto uniform = [&](double lo, double hi) { return lo + (hi - lo) * static_cast<double>(rng() >> 11) * 0x1.0p-53; };
  std::vector<double> capacity(L), latency(L);
  for (int l = 0; l < L; ++l) {
    capacity[l] = uniform(1e9, 50e9);
    latency[l] = rng() % 3 == 0 ? 0 : uniform(0, 5e-6);
  }
  Network net(capacity, latency);
  std::map<int, std::vector<int>> paths;  // live flows
  std::map<int, double> transfer_from;    // live flows: when their start latency ends
  std::map<int, double> weight;           // live flows
  std::string log;
  char buf[64];
  for (int step = 0; step < steps; ++step) {
    const int starts = static_cast<int>(rng() % 4);
    for (int i = 0; i < starts; ++i) {
      std::vector<int> path;
      const int hops = 1 + static_cast<int>(rng() % 4);
      while (static_cast<int>(path.size()) < hops) {
        const int l = static_cast<int>(rng() % L);
        if (std::find(path.begin(), path.end(), l) == path.end()) path.push_back(l);
      }
      const double bytes = uniform(1e3, 1e8);
      double alpha = 0;
      int id;
      if (weighted) {
        // Weights as aggregated flows have; no start latency half the time, so that flows at one level
        // start and end together.
        const double weights[] = {1, 2, 3, 8};
        const double w = weights[rng() % 4];
        alpha = rng() % 2 == 0 ? 0 : uniform(0, 1e-5);
        id = net.start_flow(path, bytes, alpha, w);
        weight[id] = w;
      } else if (rng() % 2 == 0) {
        for (int l : path) alpha += latency[l];
        id = net.start_flow(path, bytes);
      } else {
        alpha = rng() % 2 == 0 ? 0 : uniform(0, 1e-5);
        id = net.start_flow(path, bytes, alpha);
      }
      paths[id] = path;
      transfer_from[id] = net.now() + alpha;
    }
    const double next = net.next_event_time();
    if (next == kInf) continue;
    const double t = rng() % 3 == 0 ? net.now() + (next - net.now()) * uniform(0, 1) : next;
    const std::vector<int> ended = net.advance(t);
    std::snprintf(buf, sizeof buf, "%a:", t);
    log += buf;
    for (int f : ended) {
      std::snprintf(buf, sizeof buf, " %d", f);
      log += buf;
      paths.erase(f);
      transfer_from.erase(f);
      weight.erase(f);
    }
    log += "\n";
    std::map<int, std::vector<int>> transferring;
    for (const auto& [f, p] : paths) {
      if (transfer_from[f] <= net.now()) transferring[f] = p;
    }
    check(net, capacity, transferring, weight);
    for (const auto& [f, p] : paths) {
      std::snprintf(buf, sizeof buf, " %d=%a", f, net.rate(f));
      log += buf;
    }
    for (int l = 0; l < L; ++l) {
      std::snprintf(buf, sizeof buf, " L%d=%a", l, net.link_bytes(l));
      log += buf;
    }
    log += "\n";
  }
  return log;
}

TEST(SimNetwork, IncrementalRatesEqualAFullRecomputationOnRandomFlowSets) {
  // 12 links: one big component; 200 links: many small ones that merge and split. Weighted: flows at
  // one level whose levels differ in rounding (a weight-3 flow's rate / 3), the case the frozen floor
  // of ended-only recomputations must not cut through.
  for (bool weighted : {false, true}) {
    for (auto [seed, n_links] : {std::pair{1, 12}, {2, 12}, {3, 12}, {4, 200}, {5, 200}, {6, 200}}) {
      SCOPED_TRACE(seed);
      SCOPED_TRACE(weighted);
      int checked = 0;
      run_random(
          seed, n_links, 250,
          [&](Network& net, const std::vector<double>& capacity, const std::map<int, std::vector<int>>& transferring,
              const std::map<int, double>& weight) {
            const std::map<int, double> expected = max_min(capacity, transferring, weight);
            ASSERT_EQ(expected.size(), transferring.size());
            for (const auto& [f, r] : expected) {
              ASSERT_NEAR(net.rate(f), r, 1e-9 * r) << "flow " << f << " at t = " << net.now();
              ++checked;
            }
            EXPECT_GE(net.live_flows(), static_cast<int>(transferring.size()));
            // Every link carries at most its capacity, and its load is the sum of its flows' rates.
            for (size_t l = 0; l < capacity.size(); ++l) {
              double load = 0;
              for (const auto& [f, p] : transferring) {
                if (std::find(p.begin(), p.end(), static_cast<int>(l)) != p.end()) load += net.rate(f);
              }
              EXPECT_LE(net.link_load(static_cast<int>(l)), capacity[l] * (1 + 1e-12));
              EXPECT_NEAR(net.link_load(static_cast<int>(l)), load, 1e-9 * capacity[l]);
            }
          },
          weighted);
      EXPECT_GT(checked, 1000);
    }
  }
}

TEST(SimNetwork, TheSameCallsGiveByteIdenticalEventLogs) {
  const Check none = [](Network&, const std::vector<double>&, const std::map<int, std::vector<int>>&,
                        const std::map<int, double>&) {};
  const std::string a = run_random(7, 12, 300, none);
  const std::string b = run_random(7, 12, 300, none);
  EXPECT_GT(a.size(), 10000u);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, run_random(8, 12, 300, none));
  EXPECT_EQ(run_random(9, 12, 300, none, true), run_random(9, 12, 300, none, true));
}

}  // namespace
}  // namespace moe::sim
