// The planners of src/plan on synthetic loads (uniform, seeded Zipf, a single hot expert, zero):
// placement checks and token dispatch, load prediction, Hecate's Alg. 1 / calibration / Alg. 2, and the
// FasterMoE, FlexMoE and SmartMoE baselines. Exact values are worked out by hand in the comments.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "plan/baselines.h"
#include "plan/hecate.h"
#include "plan/load_predictor.h"
#include "plan/placement.h"

namespace moe::plan {
namespace {

using Counts = std::vector<std::vector<int64_t>>;

Nodes uniform_nodes(int n_ranks, int ranks_per_node) {
  Nodes nodes;
  for (int r = 0; r < n_ranks; ++r) nodes.node_of_rank.push_back(r / ranks_per_node);
  return nodes;
}

// Zipf-shaped counts [R][E]: every rank routes `tokens` tokens, expert of popularity rank i with weight
// 1 / (i + 1)^s, the popularity order shuffled by the seed. Only raw std::mt19937 output is used (the
// standard fixes its sequence; the distributions are implementation-defined).
Counts zipf_counts(int R, int E, int64_t tokens, double s, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<int> expert_of(E);
  std::iota(expert_of.begin(), expert_of.end(), 0);
  for (int i = E - 1; i > 0; --i) std::swap(expert_of[i], expert_of[gen() % static_cast<uint32_t>(i + 1)]);
  std::vector<double> cumulative(E);
  double total = 0;
  for (int i = 0; i < E; ++i) cumulative[i] = total += 1.0 / std::pow(i + 1.0, s);
  Counts counts(R, std::vector<int64_t>(E, 0));
  for (int r = 0; r < R; ++r) {
    for (int64_t k = 0; k < tokens; ++k) {
      const double u = (static_cast<double>(gen()) + 0.5) / 4294967296.0 * total;
      const int i = static_cast<int>(std::upper_bound(cumulative.begin(), cumulative.end(), u) - cumulative.begin());
      ++counts[r][expert_of[std::min(i, E - 1)]];
    }
  }
  return counts;
}

std::vector<int64_t> column_sums(const Counts& counts) {
  std::vector<int64_t> sums(counts.at(0).size(), 0);
  for (const auto& row : counts)
    for (size_t e = 0; e < row.size(); ++e) sums[e] += row[e];
  return sums;
}

std::vector<double> as_loads(const std::vector<int64_t>& v) { return std::vector<double>(v.begin(), v.end()); }

Counts single_hot_counts(int R, int E, int hot, int64_t per_rank) {
  Counts counts(R, std::vector<int64_t>(E, 0));
  for (auto& row : counts) row[hot] = per_rank;
  return counts;
}

void expect_same(const LayerPlacement& a, const LayerPlacement& b) {
  EXPECT_EQ(a.n_ranks, b.n_ranks);
  EXPECT_EQ(a.owner, b.owner);
  EXPECT_EQ(a.replicas, b.replicas);
}

double max_of(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }

// ---------------------------------------------------------------- placement

TEST(Placement, EvenPlacementOwnsContiguousBlocks) {
  const LayerPlacement p = even_placement(8, 4);
  EXPECT_TRUE(p.validate()) << p.validate().message();
  EXPECT_EQ(p.owner, (std::vector<int>{0, 0, 1, 1, 2, 2, 3, 3}));
  for (int e = 0; e < 8; ++e) EXPECT_EQ(p.replicas[e], std::vector<int>{e / 2});
  EXPECT_EQ(p.experts_on(1), (std::vector<int>{2, 3}));
  EXPECT_EQ(p.experts_owned_by(3), (std::vector<int>{6, 7}));
  EXPECT_TRUE(p.holds(2, 5));
  EXPECT_FALSE(p.holds(1, 5));
  EXPECT_FALSE(p.holds(9, 5));  // a rank out of range holds nothing
  EXPECT_THROW(p.holds(0, 8), std::logic_error);
  EXPECT_THROW(p.experts_on(4), std::logic_error);
  EXPECT_THROW(even_placement(6, 4), std::logic_error);
  EXPECT_THROW(even_placement(4, 0), std::logic_error);
  EXPECT_EQ(even_placement(0, 2).n_experts(), 0);
}

TEST(Placement, ValidateCatchesEachKindOfBadPlacement) {
  const LayerPlacement good = even_placement(4, 2);  // owners {0, 0, 1, 1}
  ASSERT_TRUE(good.validate());
  auto expect_bad = [](const LayerPlacement& p, const std::string& fragment) {
    const Status st = p.validate();
    ASSERT_FALSE(st) << "accepted: " << fragment;
    EXPECT_NE(st.message().find(fragment), std::string::npos) << st.message();
  };
  LayerPlacement p = good;
  p.n_ranks = 0;
  expect_bad(p, "n_ranks");
  p = good;
  p.replicas.pop_back();
  expect_bad(p, "replica lists");
  p = good;
  p.owner[2] = 2;
  expect_bad(p, "expert 2: owner out of range");
  p = good;
  p.owner[2] = -1;
  expect_bad(p, "expert 2: owner out of range");
  p = good;
  p.replicas[1] = {0, 5};
  expect_bad(p, "expert 1: replica rank out of range");
  p = good;
  p.replicas[3] = {1, 0};
  expect_bad(p, "expert 3: replicas not strictly ascending");
  p = good;
  p.replicas[3] = {1, 1};
  expect_bad(p, "expert 3: replicas not strictly ascending");
  p = good;
  p.replicas[0] = {1};
  expect_bad(p, "expert 0: replicas do not include the owner");
  p = good;
  p.replicas[0] = {};
  expect_bad(p, "expert 0: replicas do not include the owner");
}

TEST(Placement, NodesAndOwnerMoves) {
  EXPECT_EQ(uniform_nodes(8, 2).n_nodes(), 4);
  EXPECT_EQ(Nodes{}.n_nodes(), 0);
  EXPECT_EQ(owner_moves({0, 0, 1, 1}, {0, 1, 1, 0}), (std::vector<ExpertMove>{{1, 0, 1}, {3, 1, 0}}));
  EXPECT_TRUE(owner_moves({0, 1}, {0, 1}).empty());
  EXPECT_THROW(owner_moves({0, 1}, {0}), std::logic_error);
}

// ---------------------------------------------------------------- dispatch

// A chunked exchange's rule: each rank's held experts, ascending, in n contiguous parts.
TEST(Placement, ExchangeChunksSplitEachRanksHeldExpertsInOrder) {
  LayerPlacement p = even_placement(6, 2);  // rank 0 holds 0,1,2; rank 1 holds 3,4,5
  p.replicas[4] = {0, 1};                   // rank 0 also holds 4: 0,1,2,4
  const std::vector<std::vector<int>> c = exchange_chunks(p, 2);
  EXPECT_EQ(c[0], (std::vector<int>{0, 0, 1, 0, 1, 0}));  // 0,1 | 2,4 (3, 5 not held: 0)
  EXPECT_EQ(c[1], (std::vector<int>{0, 0, 0, 0, 0, 1}));  // 3 | 4,5 (position i of 3 -> i*2/3)
  EXPECT_EQ(exchange_chunks(p, 1), std::vector<std::vector<int>>(2, std::vector<int>(6, 0)));
  // More chunks than experts: some chunks carry nothing; every chunk index stays below n.
  const std::vector<std::vector<int>> many = exchange_chunks(even_placement(4, 2), 4);
  EXPECT_EQ(many[0], (std::vector<int>{0, 2, 0, 0}));
  EXPECT_EQ(many[1], (std::vector<int>{0, 0, 0, 2}));
  EXPECT_THROW(exchange_chunks(p, 0), std::logic_error);
}

// Ranks that share cores (CorePools): tokens moved between two ranks of one pool save nothing.
TEST(Placement, BusiestLoadPricesRanksSharingCoresByTheirPool) {
  EXPECT_DOUBLE_EQ(busiest_load(std::vector<double>{3, 1, 1, 1}, CorePools{}), 3);
  // 2 hosts of one core, 2 ranks each. Host 0 computes 3 + 1 tokens on its core, each rank having
  // measured its rate at half of it.
  const CorePools hosts{{0, 0, 1, 1}, {1, 1}};
  EXPECT_DOUBLE_EQ(busiest_load(std::vector<double>{3, 1, 1, 1}, hosts), 2);
  EXPECT_DOUBLE_EQ(busiest_load(std::vector<double>{2, 2, 1, 1}, hosts), 2);    // to the host-mate
  EXPECT_DOUBLE_EQ(busiest_load(std::vector<double>{2, 1, 2, 1}, hosts), 1.5);  // to the other host
  EXPECT_DOUBLE_EQ(busiest_load(std::vector<double>{1, 1, 1, 1}, hosts), 1);    // even: as without pools
  EXPECT_DOUBLE_EQ(busiest_load(std::vector<int64_t>{3, 1, 1, 1}, hosts), 2);
  // 4 ranks on 2 cores: the busiest rank bounds the step once it holds more than the cores' share.
  const CorePools machine{{0, 0, 0, 0}, {2}};
  EXPECT_DOUBLE_EQ(busiest_load(std::vector<double>{4, 2, 1, 1}, machine), 2);  // 0.5 * max(4, 8 / 2)
  EXPECT_DOUBLE_EQ(busiest_load(std::vector<double>{6, 0, 1, 1}, machine), 3);  // 0.5 * max(6, 8 / 2)
  EXPECT_DOUBLE_EQ(busiest_load(std::vector<double>{3, 1}, CorePools{{0, 0}, {2}}), 3);  // a core each
  EXPECT_THROW(busiest_load(std::vector<double>{1, 1}, hosts), std::logic_error);  // 2 loads, 4 ranks
  EXPECT_THROW(busiest_load(std::vector<double>{1, 1, 1, 1}, CorePools{{0, 0, 1, 2}, {1, 1}}), std::logic_error);
  EXPECT_THROW(busiest_load(std::vector<double>{1, 1, 1, 1}, CorePools{{0, 0, 1, 1}, {1, 0}}), std::logic_error);
}

// Ranks behind one NIC (nic_pools): rows moved between them save no network time.
TEST(Placement, NicPoolsGroupTheRanksOfEachNic) {
  const CorePools hosts = nic_pools({0, 0, 1, 1});
  EXPECT_EQ(hosts.pool_of_rank, (std::vector<int>{0, 0, 1, 1}));
  EXPECT_EQ(hosts.ranks_at_once, (std::vector<double>{1, 1}));
  // Host 0's NIC carries 3 + 1 rows, each rank having measured its rate at half the NIC's.
  EXPECT_DOUBLE_EQ(busiest_load(std::vector<double>{3, 1, 1, 1}, hosts), 2);
  EXPECT_DOUBLE_EQ(busiest_load(std::vector<double>{2, 2, 1, 1}, hosts), 2);    // to the host-mate
  EXPECT_DOUBLE_EQ(busiest_load(std::vector<double>{2, 1, 2, 1}, hosts), 1.5);  // to the other host
  const CorePools ids = nic_pools({7, 3, 7});  // pools numbered in the order of their first rank
  EXPECT_EQ(ids.pool_of_rank, (std::vector<int>{0, 1, 0}));
  EXPECT_DOUBLE_EQ(busiest_load(std::vector<double>{1, 5, 2}, ids), 5);  // a NIC of its own: its rows
  EXPECT_TRUE(nic_pools({0, 1, 2, 3}).empty());  // a NIC per rank: as without pools
  EXPECT_TRUE(nic_pools({}).empty());
  EXPECT_THROW(nic_pools({0, -1}), std::logic_error);
}

TEST(Dispatch, KeepsTokensLocalWhenTheSourceHoldsAReplica) {
  LayerPlacement p = even_placement(4, 4);  // expert e on rank e
  p.replicas[0] = {0, 1, 2, 3};
  const Counts counts = {{5, 0, 0, 0}, {7, 0, 0, 0}, {0, 0, 0, 0}, {9, 0, 0, 3}};
  const auto rows = dispatch_plan(p, uniform_nodes(4, 2), counts);
  EXPECT_EQ(rows[0][0], (std::vector<int64_t>{5, 0, 0, 0}));
  EXPECT_EQ(rows[1][0], (std::vector<int64_t>{0, 7, 0, 0}));
  EXPECT_EQ(rows[3][0], (std::vector<int64_t>{0, 0, 0, 9}));
  EXPECT_EQ(rows[3][3], (std::vector<int64_t>{0, 0, 0, 3}));  // its own expert
  EXPECT_EQ(received_tokens(rows), (std::vector<int64_t>{5, 7, 0, 12}));
}

TEST(Dispatch, PrefersSameNodeReplicasThenSplitsOverAll) {
  // 2 nodes x 2 ranks. Expert 0: replicas {0, 2} (one per node); expert 1: replicas {2, 3} (node 1 only).
  LayerPlacement p = even_placement(4, 4);
  p.replicas[0] = {0, 2};
  p.replicas[2] = {2, 3};
  const Counts counts = {{0, 0, 6, 0}, {10, 0, 4, 0}, {0, 0, 0, 0}, {8, 0, 5, 0}};
  const auto rows = dispatch_plan(p, uniform_nodes(4, 2), counts);
  EXPECT_EQ(rows[1][0], (std::vector<int64_t>{10, 0, 0, 0}));  // node 0's replica only
  EXPECT_EQ(rows[3][0], (std::vector<int64_t>{0, 0, 8, 0}));   // node 1's replica only
  // Expert 2 from node 0: no replica there, so both of node 1's, 6 = 3 + 3 and 4 = 2 + 2.
  EXPECT_EQ(rows[0][2], (std::vector<int64_t>{0, 0, 3, 3}));
  EXPECT_EQ(rows[1][2], (std::vector<int64_t>{0, 0, 2, 2}));
  EXPECT_EQ(rows[3][2], (std::vector<int64_t>{0, 0, 0, 5}));  // rank 3 holds a replica itself
}

TEST(Dispatch, SplitsEvenlyAndRotatesRemaindersBySource) {
  // Every rank its own node; expert 1 on ranks {1, 2, 3}. Source 0 sends 7 = 3 * 2 + 1: the one extra
  // token goes to chosen[(0 + 0) % 3] = rank 1. Source 4 sends 8 = 3 * 2 + 2: extras to
  // chosen[(4 + 0) % 3] = rank 2 and chosen[(4 + 1) % 3] = rank 3.
  LayerPlacement p = even_placement(5, 5);
  p.replicas[1] = {1, 2, 3};
  Counts counts(5, std::vector<int64_t>(5, 0));
  counts[0][1] = 7;
  counts[4][1] = 8;
  const auto rows = dispatch_plan(p, uniform_nodes(5, 1), counts);
  EXPECT_EQ(rows[0][1], (std::vector<int64_t>{0, 3, 2, 2, 0}));
  EXPECT_EQ(rows[4][1], (std::vector<int64_t>{0, 2, 3, 3, 0}));
}

// The dispatch tests' varied cases: seed's Zipf counts over R ranks and E experts and Alg. 1's placement
// for them (overlap degree and slots varying with the seed).
struct ZipfCase {
  Counts counts;
  LayerPlacement p;
};
ZipfCase zipf_case(int R, int E, const Nodes& nodes, uint32_t seed) {
  Counts counts = zipf_counts(R, E, 400, 1.2, seed);
  LayerPlacement p =
      sparse_materialize(even_placement(E, R), as_loads(column_sums(counts)), 2 + seed % 6, 1 + seed % 3, nodes);
  return {std::move(counts), std::move(p)};
}

TEST(Dispatch, ConservesTokensOnMaterializedZipfPlacements) {
  // Placements from Alg. 1 on Zipf loads, 8 ranks on 2 nodes: every property of dispatch_plan at once.
  const int R = 8, E = 16;
  const Nodes nodes = uniform_nodes(R, 4);
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    const auto [counts, p] = zipf_case(R, E, nodes, seed);
    const auto rows = dispatch_plan(p, nodes, counts);
    for (int s = 0; s < R; ++s) {
      for (int e = 0; e < E; ++e) {
        const auto& to = rows[s][e];
        EXPECT_EQ(std::accumulate(to.begin(), to.end(), int64_t{0}), counts[s][e]);
        std::vector<int64_t> shares;
        bool same_node_replica = false;
        for (int d : p.replicas[e]) same_node_replica |= nodes.node_of_rank[d] == nodes.node_of_rank[s];
        for (int d = 0; d < R; ++d) {
          if (to[d] > 0) {
            EXPECT_TRUE(p.holds(d, e)) << "seed " << seed << ": tokens to a rank without expert " << e;
            if (same_node_replica) {
              EXPECT_EQ(nodes.node_of_rank[d], nodes.node_of_rank[s]);
            }
          }
          if (p.holds(s, e) && d != s) {
            EXPECT_EQ(to[d], 0);
          }
        }
        // Over the chosen replicas (those on the source, else its node, else all) the split is even.
        for (int d : p.replicas[e]) {
          const bool chosen = p.holds(s, e) ? d == s
                                            : !same_node_replica || nodes.node_of_rank[d] == nodes.node_of_rank[s];
          if (chosen) shares.push_back(to[d]);
        }
        const auto [lo, hi] = std::minmax_element(shares.begin(), shares.end());
        EXPECT_LE(*hi - *lo, 1);
      }
    }
    EXPECT_EQ(rows, dispatch_plan(p, nodes, counts));  // deterministic
    const auto received = received_tokens(rows);
    const auto sums = column_sums(counts);
    EXPECT_EQ(std::accumulate(received.begin(), received.end(), int64_t{0}),
              std::accumulate(sums.begin(), sums.end(), int64_t{0}));
  }
}

TEST(Dispatch, EvenGivesEveryHolderAnEqualShareMovingOnlyWhatItMust) {
  // 2 ranks, expert 0 on both: rank 0 routes 90 tokens to it, rank 1 10. Nearest keeps them home
  // (90 / 10); even gives each holder 50, so rank 0 sends 40 of its own to rank 1's replica.
  LayerPlacement p = even_placement(2, 2);
  p.replicas[0] = {0, 1};
  const Counts counts = {{90, 3}, {10, 5}};
  const auto nearest = dispatch_plan(p, uniform_nodes(2, 1), counts, DispatchRule::nearest);
  EXPECT_EQ(received_tokens(nearest), (std::vector<int64_t>{90, 18}));
  const auto rows = dispatch_plan(p, uniform_nodes(2, 1), counts, DispatchRule::even);
  EXPECT_EQ(rows[0][0], (std::vector<int64_t>{50, 40}));
  EXPECT_EQ(rows[1][0], (std::vector<int64_t>{0, 10}));
  EXPECT_EQ(rows[0][1], (std::vector<int64_t>{0, 3}));  // expert 1: its owner only, as under nearest
  EXPECT_EQ(rows[1][1], (std::vector<int64_t>{0, 5}));
  EXPECT_EQ(received_tokens(rows), (std::vector<int64_t>{50, 58}));
  // Without replicas the rules agree.
  const LayerPlacement ep = even_placement(2, 2);
  EXPECT_EQ(dispatch_plan(ep, uniform_nodes(2, 1), counts, DispatchRule::even),
            dispatch_plan(ep, uniform_nodes(2, 1), counts, DispatchRule::nearest));
}

TEST(Dispatch, EvenFillsSameNodeHoldersFirstAndRotatesRemaindersByExpert) {
  // Nodes {0, 1, 1, 0}; expert 0 on ranks 0 (node 0) and 1 (node 1), shares 4 / 4. Ranks 2 (node 1)
  // and 3 (node 0) send 4 each: each to its own node's holder, though ascending order alone would
  // send rank 2's to rank 0.
  LayerPlacement p = even_placement(4, 4);
  p.replicas[0] = {0, 1};
  // Expert 1 on {0, 1, 2}: 11 tokens = 3 * 3 + 2, the extras to holders (1 + 0) % 3 and (1 + 1) % 3
  // of the list, ranks 1 and 2: shares 3 / 4 / 4, filled by rank 3 after its node's rank 0.
  p.replicas[1] = {0, 1, 2};
  Counts counts(4, std::vector<int64_t>(4, 0));
  counts[2][0] = 4;
  counts[3][0] = 4;
  counts[3][1] = 11;
  const auto rows = dispatch_plan(p, Nodes{{0, 1, 1, 0}}, counts, DispatchRule::even);
  EXPECT_EQ(rows[2][0], (std::vector<int64_t>{0, 4, 0, 0}));
  EXPECT_EQ(rows[3][0], (std::vector<int64_t>{4, 0, 0, 0}));
  EXPECT_EQ(rows[3][1], (std::vector<int64_t>{3, 4, 4, 0}));
}

TEST(Dispatch, EvenConservesTokensAndBalancesHoldersOnZipfPlacements) {
  const int R = 8, E = 16;
  const Nodes nodes = uniform_nodes(R, 4);
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    const auto [counts, p] = zipf_case(R, E, nodes, seed);
    const auto rows = dispatch_plan(p, nodes, counts, DispatchRule::even);
    for (int e = 0; e < E; ++e) {
      int64_t total = 0, kept_home = 0, home_bound = 0;
      std::vector<int64_t> per_holder(R, 0);
      for (int s = 0; s < R; ++s) {
        const auto& to = rows[s][e];
        EXPECT_EQ(std::accumulate(to.begin(), to.end(), int64_t{0}), counts[s][e]);
        for (int d = 0; d < R; ++d) {
          if (to[d] > 0) {
            EXPECT_TRUE(p.holds(d, e)) << "seed " << seed << ": tokens to a rank without expert " << e;
          }
          per_holder[d] += to[d];
        }
        total += counts[s][e];
        kept_home += to[s];
      }
      std::vector<int64_t> shares;
      for (int d : p.replicas[e]) shares.push_back(per_holder[d]);
      const auto [lo, hi] = std::minmax_element(shares.begin(), shares.end());
      EXPECT_LE(*hi - *lo, 1) << "seed " << seed << ", expert " << e;
      // No token crosses ranks that an even split lets stay home.
      for (int d : p.replicas[e]) home_bound += std::min(counts[d][e], per_holder[d]);
      EXPECT_EQ(kept_home, home_bound) << "seed " << seed << ", expert " << e;
      EXPECT_EQ(std::accumulate(per_holder.begin(), per_holder.end(), int64_t{0}), total);
    }
    EXPECT_EQ(rows, dispatch_plan(p, nodes, counts, DispatchRule::even));  // deterministic
  }
}

TEST(Dispatch, BalancedSplitsAReplicatedExpertSoThatTheRanksLevel) {
  // 2 ranks; experts 0, 1 owned by rank 0, 2, 3 by rank 1; expert 0 also on rank 1. Rank 0's own
  // expert 1 has 100 tokens, rank 1's experts 150 + 50: loads 100 and 200 before expert 0's 400
  // (rank 0 routes 300 of them, rank 1 100). Even halves them: 300 and 400. Balanced levels: rank 0
  // computes 250 of them, rank 1 150, both at 350; rank 0 sends only the 50 its share cannot keep.
  LayerPlacement p = even_placement(4, 2);
  p.replicas[0] = {0, 1};
  const Counts counts = {{300, 60, 90, 30}, {100, 40, 60, 20}};
  const auto shares = balanced_shares(p, {400, 100, 150, 50});
  EXPECT_EQ(shares[0], (std::vector<double>{250, 150}));
  EXPECT_EQ(shares[1], (std::vector<double>{100}));
  EXPECT_EQ(received_tokens(dispatch_plan(p, uniform_nodes(2, 1), counts, DispatchRule::even)),
            (std::vector<int64_t>{300, 400}));
  const auto rows = dispatch_plan(p, uniform_nodes(2, 1), counts, DispatchRule::balanced);
  EXPECT_EQ(rows[0][0], (std::vector<int64_t>{250, 50}));
  EXPECT_EQ(rows[1][0], (std::vector<int64_t>{0, 100}));
  EXPECT_EQ(received_tokens(rows), (std::vector<int64_t>{350, 350}));
  // A rank already above the level gets none: with rank 1 at 500 of its own, all 400 stay on rank 0.
  const auto heavy = balanced_shares(p, {400, 100, 450, 50});
  EXPECT_EQ(heavy[0], (std::vector<double>{400, 0}));
  // Without replicas the rules agree.
  const LayerPlacement ep = even_placement(4, 2);
  EXPECT_EQ(dispatch_plan(ep, uniform_nodes(2, 1), counts, DispatchRule::balanced),
            dispatch_plan(ep, uniform_nodes(2, 1), counts, DispatchRule::nearest));
}

TEST(Dispatch, BalancedPoursTheLargestSharedExpertFirstAndRoundsToWholeTokens) {
  // 3 ranks, one expert each (owners 0, 1, 2 with 10, 0, 4 tokens), and a fourth expert on rank 0
  // replicated on all three with 11 tokens, and expert 1 (0 tokens) on ranks 1 and 2. Pouring 11 onto
  // loads 10 / 0 / 4: level (11 + 0 + 4) / 2 = 7.5 for ranks 1 and 2 (rank 0 stays at 10): shares 0,
  // 7.5, 3.5; whole tokens 0, 7, 3, and the eleventh to the largest fraction: ranks 1 and 2 tie at
  // 0.5, and the order rotated by the expert (from holder 3 % 3 = 0) puts rank 1 first.
  LayerPlacement p;
  p.n_ranks = 3;
  p.owner = {0, 1, 2, 0};
  p.replicas = {{0}, {1, 2}, {2}, {0, 1, 2}};
  const auto shares = balanced_shares(p, {10, 0, 4, 11});
  EXPECT_EQ(shares[3], (std::vector<double>{0, 7.5, 3.5}));
  EXPECT_EQ(shares[1], (std::vector<double>{0, 0}));
  Counts counts(3, std::vector<int64_t>(4, 0));
  counts[0][0] = 10;
  counts[2][2] = 4;
  counts[0][3] = 5;
  counts[1][3] = 6;
  const auto rows = dispatch_plan(p, uniform_nodes(3, 1), counts, DispatchRule::balanced);
  const std::vector<int64_t> got = received_tokens(rows);
  EXPECT_EQ(got, (std::vector<int64_t>{10, 8, 7}));
  for (int s = 0; s < 3; ++s)
    for (int e = 0; e < 4; ++e)
      EXPECT_EQ(std::accumulate(rows[s][e].begin(), rows[s][e].end(), int64_t{0}), counts[s][e]);
  EXPECT_EQ(rows[1][3], (std::vector<int64_t>{0, 6, 0}));  // rank 1 keeps its own 6 of its 8
  EXPECT_THROW(balanced_shares(p, {1, 2, 3}), std::logic_error);
  EXPECT_THROW(balanced_shares(p, {1, 2, 3, -1}), std::logic_error);
}

TEST(Dispatch, RejectsBadInputs) {
  const LayerPlacement p = even_placement(2, 2);
  const Nodes nodes = uniform_nodes(2, 1);
  EXPECT_THROW(dispatch_plan(p, nodes, {{1, -1}, {0, 0}}), std::logic_error);
  EXPECT_THROW(dispatch_plan(p, nodes, {{1, 1}}), std::logic_error);
  EXPECT_THROW(dispatch_plan(p, nodes, {{1}, {1}}), std::logic_error);
  EXPECT_THROW(dispatch_plan(p, uniform_nodes(3, 1), {{1, 1}, {1, 1}}), std::logic_error);
  LayerPlacement bad = p;
  bad.replicas[0] = {1};
  EXPECT_THROW(dispatch_plan(bad, nodes, {{1, 1}, {1, 1}}), std::logic_error);
}

// ---------------------------------------------------------------- load prediction

TEST(LoadPredictor, UniformBeforeAnyStep) {
  const LoadPredictor predictor(2, 3);
  EXPECT_EQ(predictor.window(), 5);
  EXPECT_EQ(predictor.steps_observed(), 0);
  EXPECT_EQ(predictor.predict(1), (std::vector<double>{1.0, 1.0, 1.0}));
}

TEST(LoadPredictor, AveragesTheLastWindowSteps) {
  LoadPredictor predictor(2, 3, 3);
  predictor.observe({{3, 0, 6}, {1, 1, 1}});
  EXPECT_EQ(predictor.predict(0), (std::vector<double>{3, 0, 6}));
  predictor.observe({{5, 2, 0}, {1, 1, 1}});
  EXPECT_EQ(predictor.predict(0), (std::vector<double>{4, 1, 3}));
  predictor.observe({{7, 4, 0}, {4, 1, 1}});
  EXPECT_EQ(predictor.predict(0), (std::vector<double>{5, 2, 2}));
  EXPECT_EQ(predictor.predict(1), (std::vector<double>{2, 1, 1}));
  predictor.observe({{9, 0, 0}, {7, 7, 7}});  // the first step leaves the window
  EXPECT_EQ(predictor.predict(0), (std::vector<double>{7, 2, 0}));
  EXPECT_EQ(predictor.predict(1), (std::vector<double>{4, 3, 3}));
  for (int i = 0; i < 3; ++i) predictor.observe({{0, 0, 0}, {0, 0, 0}});
  EXPECT_EQ(predictor.predict(0), (std::vector<double>{0, 0, 0}));
  EXPECT_EQ(predictor.steps_observed(), 7);
}

TEST(LoadPredictor, RejectsBadArguments) {
  EXPECT_THROW(LoadPredictor(0, 3), std::logic_error);
  EXPECT_THROW(LoadPredictor(1, 3, 0), std::logic_error);
  LoadPredictor predictor(1, 2);
  EXPECT_THROW(predictor.observe({{1, 2, 3}}), std::logic_error);
  EXPECT_THROW(predictor.observe({{1, -2}}), std::logic_error);
  EXPECT_THROW(predictor.predict(1), std::logic_error);
}

// ---------------------------------------------------------------- Hecate: t, m, Alg. 1

TEST(Hecate, OverlapDegreeAndMemorySlots) {
  EXPECT_EQ(overlap_degree(0.5, 1024, 100), 5);  // floor(512 / 100)
  EXPECT_EQ(overlap_degree(0.5, 1024, 512), 1);
  EXPECT_EQ(overlap_degree(0, 1024, 512), 0);
  EXPECT_EQ(overlap_degree(1e9, 1e12, 1), INT_MAX);
  EXPECT_THROW(overlap_degree(0.5, 0, 100), std::logic_error);
  EXPECT_THROW(overlap_degree(-1, 1, 100), std::logic_error);
  EXPECT_THROW(overlap_degree(1, 1, 0), std::logic_error);
  EXPECT_EQ(memory_slots(1000, 300), 3);
  EXPECT_EQ(memory_slots(0, 300), 0);
  EXPECT_EQ(memory_slots(int64_t{1} << 50, 1), INT_MAX);
  EXPECT_THROW(memory_slots(-1, 300), std::logic_error);
  EXPECT_THROW(memory_slots(10, 0), std::logic_error);
}

TEST(Hecate, Alg1SmallOverlapPutsTopTOnEveryRank) {
  // t = 2 <= m = 3: the two hottest experts (7 and 6, both owned by rank 3) go to every rank.
  const LayerPlacement base = even_placement(8, 4);
  const std::vector<double> load = {10, 20, 30, 40, 50, 60, 70, 80};
  const LayerPlacement p = sparse_materialize(base, load, 2, 3, uniform_nodes(4, 2));
  ASSERT_TRUE(p.validate());
  EXPECT_EQ(p.owner, base.owner);
  for (int e = 0; e < 6; ++e) EXPECT_EQ(p.replicas[e], base.replicas[e]);
  EXPECT_EQ(p.replicas[6], (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(p.replicas[7], (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(extra_experts(p), (std::vector<int>{2, 2, 2, 0}));
}

TEST(Hecate, Alg1LargeOverlapSharesSlotsByLoadAcrossNodesFirst) {
  // 2 nodes x 2 ranks, expert e owned by rank e, t = 3 > m = 1: 4 slots for the top 3 experts
  // (expert 3 has no load). Expert 0: ceil(4 * 60 / 100) = 3 replicas: first to node 1 (no holder;
  // rank 2, the lower of two equally free ranks), then node 0 (one holder each now; equal free slots,
  // lower id: rank 1), then rank 3. Expert 1: ceil(1 * 30 / 40) = 1: only rank 0 has a slot left.
  // Expert 2: no slot left.
  const LayerPlacement p =
      sparse_materialize(even_placement(4, 4), {60, 30, 10, 0}, 3, 1, uniform_nodes(4, 2));
  ASSERT_TRUE(p.validate());
  EXPECT_EQ(p.owner, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(p.replicas, (std::vector<std::vector<int>>{{0, 1, 2, 3}, {0, 1}, {2}, {3}}));
  EXPECT_EQ(extra_experts(p), (std::vector<int>{1, 1, 1, 1}));

  // Equal loads, t = 4 > m = 1: one replica each (ceil(4/4), ceil(3/3), ...), always on the node
  // that does not have the expert yet.
  const LayerPlacement q =
      sparse_materialize(even_placement(4, 4), {10, 10, 10, 10}, 4, 1, uniform_nodes(4, 2));
  EXPECT_EQ(q.replicas, (std::vector<std::vector<int>>{{0, 2}, {1, 3}, {0, 2}, {1, 3}}));
}

TEST(Hecate, Alg1RespectsTheMemoryCapOnZipfLoads) {
  const int R = 8, E = 16;
  const Nodes nodes = uniform_nodes(R, 4);
  const LayerPlacement base = even_placement(E, R);
  for (uint32_t seed = 1; seed <= 10; ++seed) {
    const std::vector<double> load = as_loads(column_sums(zipf_counts(R, E, 500, 1.0, seed)));
    for (int t : {0, 1, 3, 6, 16, 40}) {
      for (int m : {0, 1, 2, 5, 16}) {
        const LayerPlacement p = sparse_materialize(base, load, t, m, nodes);
        ASSERT_TRUE(p.validate()) << p.validate().message();
        EXPECT_EQ(p.owner, base.owner);
        for (int extra : extra_experts(p)) EXPECT_LE(extra, m) << "t " << t << " m " << m;
        int materialized = 0;  // experts with more than their owner
        for (int e = 0; e < E; ++e) materialized += p.replicas[e].size() > 1;
        EXPECT_LE(materialized, std::min(t, E));
        if (t <= m) {  // branch 1: the top-t experts on every rank
          int everywhere = 0;
          for (int e = 0; e < E; ++e) everywhere += static_cast<int>(p.replicas[e].size()) == R;
          EXPECT_EQ(everywhere, std::min(t, E));
        } else {  // branch 2: a slot stays empty only on a rank that holds every candidate already
          std::vector<int> top(E);
          std::iota(top.begin(), top.end(), 0);
          std::stable_sort(top.begin(), top.end(), [&](int a, int b) { return load[a] > load[b]; });
          top.resize(std::min(t, E));
          const auto extra = extra_experts(p);
          for (int r = 0; r < R; ++r) {
            if (extra[r] == m) continue;
            for (int e : top) EXPECT_TRUE(p.holds(r, e)) << "rank " << r << " left a slot free; t " << t << " m " << m;
          }
        }
        expect_same(p, sparse_materialize(base, load, t, m, nodes));  // deterministic
      }
    }
  }
}

TEST(Hecate, Alg1SingleHotAndZeroLoads) {
  const LayerPlacement base = even_placement(8, 4);
  const Nodes nodes = uniform_nodes(4, 2);
  std::vector<double> load(8, 0.0);
  load[5] = 1000;
  // Only expert 5 has load: t is cut to 1 <= m, so it goes to every rank and nothing else moves.
  LayerPlacement p = sparse_materialize(base, load, 4, 1, nodes);
  EXPECT_EQ(p.replicas[5], (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(extra_experts(p), (std::vector<int>{1, 1, 0, 1}));
  expect_same(sparse_materialize(base, std::vector<double>(8, 0.0), 4, 2, nodes), base);
  expect_same(sparse_materialize(base, load, 0, 2, nodes), base);  // t = 0
}

TEST(Hecate, Alg1CountsReplicasAlreadyHeldAgainstM) {
  LayerPlacement base = even_placement(4, 4);
  base.replicas[1] = {0, 1};  // rank 0 already holds one extra expert
  const Nodes nodes = uniform_nodes(4, 1);
  // m = 1: rank 0 has no free slot left, so branch 2 (t = 1 > 0 free slots on rank 0): the 3 free slots
  // all go to expert 3 (ceil(3 * 5 / 5)), but only ranks 1 and 2 have one and lack the expert.
  const LayerPlacement p = sparse_materialize(base, {0, 0, 0, 5}, 1, 1, nodes);
  EXPECT_EQ(p.replicas[3], (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(p.replicas[1], (std::vector<int>{0, 1}));
  EXPECT_EQ(extra_experts(p), (std::vector<int>{1, 1, 1, 0}));
  EXPECT_THROW(sparse_materialize(base, {0, 0, 0, 5}, 1, 0, nodes), std::logic_error);  // base exceeds m
  EXPECT_THROW(sparse_materialize(base, {0, 0, 5}, 1, 1, nodes), std::logic_error);
  EXPECT_THROW(sparse_materialize(base, {0, 0, 0, -1}, 1, 1, nodes), std::logic_error);
  EXPECT_THROW(sparse_materialize(base, {0, 0, 0, 5}, -1, 1, nodes), std::logic_error);
}

// ---------------------------------------------------------------- Hecate: calibration

TEST(Hecate, CalibrationGathersOnlyWhenItPays) {
  // One node, 4 ranks, expert e on rank e, every rank routes 100 tokens to expert 0: rank 0 computes
  // 400. Alg. 1 with t = m = 1 puts expert 0 everywhere: each rank computes its own 100. Saved:
  // 300 tokens * 1 ms = 0.3 s; the gather: each of ranks 1..3 receives one expert of 1000 bytes.
  const LayerPlacement in_force = even_placement(4, 4);
  const Counts counts = single_hot_counts(4, 4, 0, 100);
  const Nodes nodes = uniform_nodes(4, 4);
  CalibrationModel model{1e-3, 1e5, 1000};  // gather: 1000 / 1e5 = 0.01 s
  Calibration c = calibrate(in_force, counts, 1, 1, nodes, model);
  EXPECT_TRUE(c.gather);
  EXPECT_EQ(c.busiest_before, 400);
  EXPECT_EQ(c.busiest_after, 100);
  EXPECT_EQ(c.gather_bytes, 1000);
  EXPECT_DOUBLE_EQ(c.saved_seconds, 0.3);
  EXPECT_DOUBLE_EQ(c.gather_seconds, 0.01);
  EXPECT_EQ(c.placement.replicas[0], (std::vector<int>{0, 1, 2, 3}));

  model.bandwidth = 1e3;  // gather: 1 s > 0.3 s saved
  c = calibrate(in_force, counts, 1, 1, nodes, model);
  EXPECT_FALSE(c.gather);
  EXPECT_EQ(c.busiest_after, 100);
  expect_same(c.placement, in_force);

  // Remaining memory: the placement in force already fills the one slot of ranks 0..2 (expert 3 on
  // every rank), so only rank 3 can take expert 0. Ranks 1 and 2 then split their tokens over ranks
  // 0 and 3: 100 + 50 + 50 each.
  LayerPlacement busy = in_force;
  busy.replicas[3] = {0, 1, 2, 3};
  c = calibrate(busy, counts, 1, 1, nodes, CalibrationModel{1e-3, 1e5, 1000});
  EXPECT_TRUE(c.gather);
  EXPECT_EQ(c.placement.replicas[0], (std::vector<int>{0, 3}));
  EXPECT_EQ(c.busiest_before, 400);
  EXPECT_EQ(c.busiest_after, 200);
  EXPECT_EQ(c.gather_bytes, 1000);
  // No memory left at all: nothing to gather however hot expert 0 is.
  c = calibrate(in_force, counts, 1, 0, nodes, CalibrationModel{1e-3, 1e5, 1000});
  EXPECT_FALSE(c.gather);
  EXPECT_EQ(c.gather_bytes, 0);
  EXPECT_EQ(c.busiest_after, 400);
  expect_same(c.placement, in_force);
  EXPECT_THROW(calibrate(in_force, counts, 1, 1, nodes, CalibrationModel{0, 1e5, 1000}), std::logic_error);
}

// 2 hosts of one core, 2 ranks each, every rank routing 100 tokens to expert 0 (rank 0's). Only rank
// 1, rank 0's host-mate, has a slot free (expert 1 fills the others'): a replica there halves rank 0's
// tokens but not its host's, so it pays only where the ranks compute on cores of their own.
TEST(Hecate, CalibrationPricesRanksSharingACoreByTheirPool) {
  LayerPlacement busy = even_placement(4, 4);
  busy.replicas[1] = {0, 1, 2, 3};
  const Counts counts = single_hot_counts(4, 4, 0, 100);
  const Nodes nodes = uniform_nodes(4, 2);
  CalibrationModel model{1e-3, 1e5, 1000};
  Calibration c = calibrate(busy, counts, 1, 1, nodes, model);
  EXPECT_TRUE(c.gather);
  EXPECT_EQ(c.placement.replicas[0], (std::vector<int>{0, 1}));
  EXPECT_EQ(c.busiest_before, 400);
  EXPECT_EQ(c.busiest_after, 200);
  model.cores = CorePools{{0, 0, 1, 1}, {1, 1}};
  c = calibrate(busy, counts, 1, 1, nodes, model);
  EXPECT_FALSE(c.gather);
  EXPECT_EQ(c.busiest_before, 200);  // host 0's 400 tokens, at the half core each rank measured
  EXPECT_EQ(c.busiest_after, 200);
  expect_same(c.placement, busy);
}

// Alg. 1 copies expert 0 (rank 0's, 100 tokens from every rank) to every rank. On 2 hosts of one core,
// 2 ranks each, a copy on rank 1 beside the owner saves its host nothing, and one of host 1's two copies
// is enough to keep its tokens home: the calibration drops those replicas, the coldest expert's and the
// lowest rank's first, for the same saving. With a core per rank every copy shortens the busiest rank.
TEST(Hecate, CalibrationDropsTheReplicasThatSaveNothing) {
  const LayerPlacement in_force = even_placement(4, 4);
  const Counts counts = single_hot_counts(4, 4, 0, 100);
  const Nodes nodes = uniform_nodes(4, 2);
  CalibrationModel model{1e-3, 1e5, 1000};
  Calibration c = calibrate(in_force, counts, 1, 1, nodes, model);
  EXPECT_TRUE(c.gather);
  EXPECT_EQ(c.placement.replicas[0], (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(c.busiest_after, 100);
  model.cores = CorePools{{0, 0, 1, 1}, {1, 1}};
  c = calibrate(in_force, counts, 1, 1, nodes, model);
  EXPECT_TRUE(c.gather);
  EXPECT_EQ(c.placement.replicas[0], (std::vector<int>{0, 3}));
  EXPECT_EQ(c.busiest_before, 200);  // host 0's 400 tokens at the half core each rank measured
  EXPECT_EQ(c.busiest_after, 100);   // each host's 200
  EXPECT_EQ(c.remote_after, 0);
  EXPECT_EQ(c.gather_bytes, 1000);
}

// Two equally hot experts: Alg. 1 with t = 1 copies expert 0 everywhere, which leaves rank 1 with all of
// expert 1's tokens and adds its own share of expert 0 (busiest 400 -> 500: no gather). The
// calibration goes on to t' = 2, both experts on every rank, each rank computing its own 200.
TEST(Hecate, CalibrationWidensAlgOneWhileTheGatherPays) {
  const LayerPlacement in_force = even_placement(4, 4);
  Counts counts(4, std::vector<int64_t>{100, 100, 0, 0});
  const Nodes nodes = uniform_nodes(4, 4);
  const CalibrationModel model{1e-3, 1e5, 1000};  // one expert: 0.01 s; a token: 1 ms
  EXPECT_FALSE(price_placement(in_force, sparse_materialize(in_force, {400, 400, 0, 0}, 1, 2, nodes), counts, nodes,
                               model)
                   .gather);
  Calibration c = calibrate(in_force, counts, 1, 2, nodes, model);
  EXPECT_TRUE(c.gather);
  EXPECT_EQ(c.busiest_before, 400);
  EXPECT_EQ(c.busiest_after, 200);
  EXPECT_EQ(c.gather_bytes, 2000);
  EXPECT_DOUBLE_EQ(c.saved_seconds, 0.2);
  EXPECT_EQ(c.placement.replicas[0], (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(c.placement.replicas[1], (std::vector<int>{0, 1, 2, 3}));
  // Experts 2 and 3 have no tokens: never a candidate, however cheap the gather.
  EXPECT_EQ(c.placement.replicas[2], (std::vector<int>{2}));
  // The second expert's gather dearer than what it saves: nothing pays.
  c = calibrate(in_force, counts, 1, 2, nodes, CalibrationModel{1e-3, 1e4, 1000});  // 0.2 s a rank
  EXPECT_FALSE(c.gather);
  expect_same(c.placement, in_force);
}

// Before the gate on CPU ranks Hecate takes Alg. 1 with the cheapest t' <= t. Two hosts of one rank,
// experts 0-1 on rank 0, 2-3 on rank 1, loads {300, 60, 20, 20} from both sources alike: rank 0
// computes 360. t = 2 copies experts 0 and 1 to rank 1, which then computes its own 180 and all 40 of
// experts 2-3: busiest 220. t' = 1 copies expert 0 alone: rank 0 computes 150 + 60 = 210, rank 1
// 150 + 40 = 190; fewer tokens on the busiest rank for one expert's gather instead of two.
TEST(Hecate, TheCheapestMaterializationCanStopBeforeT) {
  const LayerPlacement owners = even_placement(4, 2);
  const std::vector<double> load{300, 60, 20, 20};
  const Counts counts = even_counts(load, 2);
  const Nodes nodes = uniform_nodes(2, 1);
  const CalibrationModel model{1e-3, 1e5, 1000};  // one expert: 0.01 s; a token: 1 ms
  const Calibration at_t = price_placement(owners, sparse_materialize(owners, load, 2, 2, nodes), counts, nodes, model);
  ASSERT_TRUE(at_t.gather);
  EXPECT_EQ(at_t.busiest_after, 220);
  Calibration c = cheapest_materialization(owners, load, counts, 0, 2, 2, nodes, model);
  EXPECT_TRUE(c.gather);
  EXPECT_EQ(c.busiest_before, 360);
  EXPECT_EQ(c.busiest_after, 210);
  EXPECT_EQ(c.gather_bytes, 1000);
  EXPECT_EQ(c.placement.replicas[0], (std::vector<int>{0, 1}));
  EXPECT_EQ(c.placement.replicas[1], (std::vector<int>{0}));
  // t_max = 0: Alg. 1 copies nothing, nothing to price.
  c = cheapest_materialization(owners, load, counts, 0, 0, 2, nodes, model);
  EXPECT_FALSE(c.gather);
  expect_same(c.placement, owners);
}

// Before the gate Hecate prices Alg. 1's plan with the calibration's price, the predicted loads spread
// evenly over the source ranks.
TEST(Hecate, PricingAPlannedPlacementKeepsItOnlyWhenItPays) {
  EXPECT_EQ(even_counts({7.0, 0.0, 4.0}, 2), (Counts{{4, 0, 2}, {3, 0, 2}}));
  EXPECT_THROW(even_counts({1.0}, 0), std::logic_error);
  EXPECT_THROW(even_counts({-1.0}, 2), std::logic_error);

  const LayerPlacement owners = even_placement(4, 4);
  const Nodes nodes = uniform_nodes(4, 4);
  LayerPlacement hot_everywhere = owners;
  hot_everywhere.replicas[0] = {0, 1, 2, 3};
  // Skewed: expert 0 takes 400 of 460 tokens; rank 0 computes 400, with copies everywhere 100 + 20.
  const Counts skewed = even_counts({400, 20, 20, 20}, 4);
  Calibration c = price_placement(owners, hot_everywhere, skewed, nodes, CalibrationModel{1e-3, 1e5, 1000});
  EXPECT_TRUE(c.gather);
  EXPECT_EQ(c.busiest_before, 400);
  EXPECT_EQ(c.busiest_after, 120);
  EXPECT_EQ(c.gather_bytes, 1000);
  EXPECT_EQ(c.placement.replicas[0], (std::vector<int>{0, 1, 2, 3}));
  // Balanced: the copies only make it worse (each rank keeps its own 25 tokens of expert 0 on top of
  // the 100 its own expert receives), so the gather never pays however fast the link.
  const Counts balanced = even_counts({100, 100, 100, 100}, 4);
  c = price_placement(owners, hot_everywhere, balanced, nodes, CalibrationModel{1e-3, 1e12, 1000});
  EXPECT_FALSE(c.gather);
  EXPECT_EQ(c.busiest_before, 100);
  EXPECT_EQ(c.busiest_after, 125);
  expect_same(c.placement, owners);
  // A slow link: the skewed saving (0.28 s) loses to the gather (1 s).
  c = price_placement(owners, hot_everywhere, skewed, nodes, CalibrationModel{1e-3, 1e3, 1000});
  EXPECT_FALSE(c.gather);
  // Each transfer of the replica counted (CPU ranks: gather and reduce-scatter, 3 with
  // rematerialization): at 5e3 B/s one transfer (0.2 s) pays for the 0.28 s saved, two (0.4 s) do not.
  c = price_placement(owners, hot_everywhere, skewed, nodes, CalibrationModel{1e-3, 5e3, 1000, 1});
  EXPECT_TRUE(c.gather);
  EXPECT_DOUBLE_EQ(c.gather_seconds, 0.2);
  c = price_placement(owners, hot_everywhere, skewed, nodes, CalibrationModel{1e-3, 5e3, 1000, 2});
  EXPECT_FALSE(c.gather);
  EXPECT_DOUBLE_EQ(c.gather_seconds, 0.4);
  expect_same(c.placement, owners);
  EXPECT_THROW(price_placement(owners, hot_everywhere, skewed, nodes, CalibrationModel{1e-3, 5e3, 1000, 0}),
               std::logic_error);
  // The all-to-alls it shortens: rank 0 received 300 of expert 0's tokens from the others; with a copy
  // everywhere each source keeps its own, and the most any rank receives from the others is 15 (5 of
  // its expert's from each other rank). At 1 ms a crossing row that adds 0.285 s: two transfers
  // (0.4 s) pay against 0.565 s.
  c = price_placement(owners, hot_everywhere, skewed, nodes, CalibrationModel{1e-3, 5e3, 1000, 2, 1e-3});
  EXPECT_EQ(c.remote_before, 300);
  EXPECT_EQ(c.remote_after, 15);
  EXPECT_DOUBLE_EQ(c.saved_seconds, 0.28 + 0.285);
  EXPECT_TRUE(c.gather);
  // On 2 nodes x 2 ranks only the rows between nodes cross the network: rank 0 received 200 of
  // expert 0's tokens from ranks 2 and 3 (its node's rank 1 sends its 100 over shared memory); with
  // the copies every rank receives 10 from the other node (5 from each of its ranks): 0.19 s saved.
  c = price_placement(owners, hot_everywhere, skewed, uniform_nodes(4, 2), CalibrationModel{1e-3, 5e3, 1000, 2, 1e-3});
  EXPECT_EQ(c.remote_before, 200);
  EXPECT_EQ(c.remote_after, 10);
  EXPECT_DOUBLE_EQ(c.saved_seconds, 0.28 + 0.19);
  EXPECT_TRUE(c.gather);
  // The same nodes with one NIC each: node 0's NIC carried rank 0's 200 rows and rank 1's 10 (105 at
  // each rank's share of it), and with the copies rank 1's 10 (5); node 1's 20 and 20 (10): 0.095 s
  // saved, and the two transfers (0.4 s) no longer pay against 0.375 s.
  CalibrationModel shared_nics{1e-3, 5e3, 1000, 2, 1e-3};
  shared_nics.nics = nic_pools({0, 0, 1, 1});
  c = price_placement(owners, hot_everywhere, skewed, uniform_nodes(4, 2), shared_nics);
  EXPECT_DOUBLE_EQ(c.remote_before, 105);
  EXPECT_DOUBLE_EQ(c.remote_after, 10);
  EXPECT_DOUBLE_EQ(c.saved_seconds, 0.28 + 0.095);
  EXPECT_FALSE(c.gather);
  EXPECT_THROW(price_placement(owners, hot_everywhere, skewed, nodes, CalibrationModel{1e-3, 5e3, 1000, 2, -1}),
               std::logic_error);
  EXPECT_THROW(price_placement(owners, even_placement(8, 4), skewed, nodes, CalibrationModel{1e-3, 1e5, 1000}),
               std::logic_error);
}

// ---------------------------------------------------------------- Hecate: Alg. 2

TEST(Hecate, Alg2PlacesUnderloadedExpertsOnLeastLoadedNodesFirst) {
  // 2 nodes x 2 ranks, one layer of 8 experts, t = 2: experts 0, 1 are overlappable; 2..7 underloaded.
  // S = 2 slots per rank. Underloaded, by load (node loads / rank loads so far):
  //   e2 (8): nodes tie at 0 and at 4 free -> node 0, rank 0.      e3 (7): node 1 (0 < 8), rank 2.
  //   e4 (6): node 1 (7 < 8), rank 3 (0 < 7).                       e5 (5): node 0 (8 < 13), rank 1.
  //   e6 (4): nodes tie at 13 and at 2 free -> node 0, rank 1 (5 < 8). e7 (3): node 1 (13 < 17), rank 3.
  // Overlappable: e0 (100): node 1 (16 < 17), its only free rank 2; e1 (50): rank 0, the last slot.
  const auto owners = heterogeneous_sharding({{100, 50, 8, 7, 6, 5, 4, 3}}, 2, uniform_nodes(4, 2));
  ASSERT_EQ(owners.size(), 1u);
  EXPECT_EQ(owners[0], (std::vector<int>{2, 0, 0, 2, 3, 1, 1, 3}));
  EXPECT_EQ(owner_moves(even_placement(8, 4).owner, owners[0]),
            (std::vector<ExpertMove>{{0, 0, 2}, {2, 1, 0}, {3, 1, 2}, {4, 2, 3}, {5, 2, 1}, {6, 3, 1}}));
}

TEST(Hecate, Alg2TiesGoToFewerFreeSlotsSoColdExpertsPack) {
  // One node, 2 ranks, t = 0. Layer 0 (max load 6) first: e0 -> rank 0, e1 (0) -> rank 1 (load 0 < 6).
  // S = 3. Layer 1, all zero loads: every choice ties on load, so the rank with fewer free slots wins
  // and the cold experts pack: e0 -> rank 0 (2 vs 2 free, lower rank), e1 -> rank 0 (1 < 2 free),
  // then rank 0 is full and e2, e3 go to rank 1.
  const auto owners = heterogeneous_sharding({{6, 0}, {0, 0, 0, 0}}, 0, uniform_nodes(2, 2));
  EXPECT_EQ(owners[0], (std::vector<int>{0, 1}));
  EXPECT_EQ(owners[1], (std::vector<int>{0, 0, 1, 1}));
}

TEST(Hecate, Alg2KeepsSlotsEqualAcrossRanksOverAllLayers) {
  const int R = 8, E = 16, L = 4;
  const Nodes nodes = uniform_nodes(R, 4);
  for (uint32_t seed = 1; seed <= 10; ++seed) {
    std::vector<std::vector<double>> loads;
    for (int l = 0; l < L; ++l) loads.push_back(as_loads(column_sums(zipf_counts(R, E, 300, 1.0 + 0.2 * l, seed * 7 + l))));
    for (int t : {0, 2, 5, 16}) {
      const auto owners = heterogeneous_sharding(loads, t, nodes);
      ASSERT_EQ(owners.size(), static_cast<size_t>(L));
      std::vector<int> slots(R, 0);
      for (int l = 0; l < L; ++l) {
        ASSERT_EQ(owners[l].size(), static_cast<size_t>(E));
        for (int r : owners[l]) {  // every expert exactly one owner, in range
          ASSERT_GE(r, 0);
          ASSERT_LT(r, R);
          ++slots[r];
        }
      }
      EXPECT_EQ(slots, std::vector<int>(R, L * E / R)) << "seed " << seed << " t " << t;
      EXPECT_EQ(owners, heterogeneous_sharding(loads, t, nodes));  // deterministic
    }
  }
  // Layers of different sizes: only the total must divide.
  const auto mixed = heterogeneous_sharding({{1, 2, 3}, {4, 5, 6, 7, 8}}, 1, uniform_nodes(4, 2));
  std::vector<int> slots(4, 0);
  for (const auto& layer : mixed)
    for (int r : layer) ++slots[r];
  EXPECT_EQ(slots, std::vector<int>(4, 2));
  EXPECT_THROW(heterogeneous_sharding({{1, 2, 3}}, 1, uniform_nodes(2, 1)), std::logic_error);
  EXPECT_THROW(heterogeneous_sharding({}, 1, uniform_nodes(2, 1)), std::logic_error);
  EXPECT_THROW(heterogeneous_sharding({{1, 2}}, -1, uniform_nodes(2, 1)), std::logic_error);
}

// ---------------------------------------------------------------- FasterMoE

FasterMoeModel small_model() {
  // t_c = 4 * 2 * 16 / 128 = 1, t_f = 4 * 4 / 64 = 0.25, t_m = 2 * 2 * 16 * 4 / 64 = 4.
  return FasterMoeModel{4, 2.0, 4, 64.0, 128.0};
}

// The shadowing over ranks, written out again from its formulas: B_w(S) recomputed from scratch for
// every candidate set, the whole order walked, the cheapest prefix kept.
std::vector<int> expected_shadowed(const std::vector<int>& owner, const Counts& c, const FasterMoeUnitCosts& u) {
  const size_t R = c.size(), E = owner.size();
  auto lat = [&](const std::vector<int>& s) {
    std::vector<double> b(R, 0);
    for (size_t e = 0; e < E; ++e) {
      const bool shadowed = std::find(s.begin(), s.end(), static_cast<int>(e)) != s.end();
      for (size_t w = 0; w < R; ++w) b[shadowed ? w : owner[e]] += static_cast<double>(c[w][e]);
    }
    return (3 * u.t_c + 4 * u.t_f) * *std::max_element(b.begin(), b.end()) + static_cast<double>(s.size()) * u.t_m;
  };
  std::vector<int> s, best;
  while (s.size() + 1 < E) {
    std::vector<double> b(R, 0);
    for (size_t e = 0; e < E; ++e)
      for (size_t w = 0; w < R; ++w)
        b[std::find(s.begin(), s.end(), static_cast<int>(e)) != s.end() ? w : owner[e]] += static_cast<double>(c[w][e]);
    const int busiest = static_cast<int>(std::max_element(b.begin(), b.end()) - b.begin());
    int hot = -1;
    int64_t hot_load = 0;
    for (size_t e = 0; e < E; ++e) {
      int64_t l = 0;
      for (size_t w = 0; w < R; ++w) l += c[w][e];
      if (owner[e] == busiest && std::find(s.begin(), s.end(), static_cast<int>(e)) == s.end() && l > hot_load)
        hot = static_cast<int>(e), hot_load = l;
    }
    if (hot < 0) break;
    s.push_back(hot);
    if (lat(s) < lat(best)) best = s;
  }
  return best;
}

TEST(FasterMoe, UnitCosts) {
  const FasterMoeUnitCosts u = fastermoe_unit_costs(small_model());
  EXPECT_DOUBLE_EQ(u.t_c, 1.0);
  EXPECT_DOUBLE_EQ(u.t_f, 0.25);
  EXPECT_DOUBLE_EQ(u.t_m, 4.0);
  FasterMoeModel bad = small_model();
  bad.bandwidth = 0;
  EXPECT_THROW(fastermoe_unit_costs(bad), std::logic_error);
  bad = small_model();
  bad.transfers_per_shadow = 0;
  EXPECT_THROW(fastermoe_unit_costs(bad), std::logic_error);
  // CPU ranks: the broadcast and the gradients' reduce both count.
  FasterMoeModel cpu = small_model();
  cpu.transfers_per_shadow = 2;
  EXPECT_DOUBLE_EQ(fastermoe_unit_costs(cpu).t_m, 8.0);
  EXPECT_DOUBLE_EQ(fastermoe_unit_costs(cpu).t_c, 1.0);
  // Weights moving at their own measured rate (a quarter of the links'): t_m 4x, t_f as before.
  FasterMoeModel slow_weights = small_model();
  slow_weights.weights_bandwidth = 16;
  EXPECT_DOUBLE_EQ(fastermoe_unit_costs(slow_weights).t_m, 16.0);
  EXPECT_DOUBLE_EQ(fastermoe_unit_costs(slow_weights).t_f, 0.25);
  slow_weights.weights_bandwidth = -1;
  EXPECT_THROW(fastermoe_unit_costs(slow_weights), std::logic_error);
}

TEST(FasterMoe, ShadowsNothingUnderUniformOrZeroLoad) {
  const LayerPlacement base = even_placement(8, 4);
  const Counts uniform(4, std::vector<int64_t>(8, 50));
  expect_same(fastermoe_plan(base, uniform, small_model()), base);  // Lat_1 = Lat_0 + t_m
  expect_same(fastermoe_plan(base, Counts(4, std::vector<int64_t>(8, 0)), small_model()), base);
}

TEST(FasterMoe, ShadowsTheHotExpertUnderASingleHotLoad) {
  // 3 t_c + 4 t_f = 4 per token. Hot expert 6 (rank 3's) with 10 tokens from each of 4 ranks:
  // Lat_0 = 4 * 40 = 160; shadowed, every rank computes its own 10: 4 * 10 + t_m = 44 < 160. Next the
  // busiest rank (all tie at 10: rank 0) holds no expert with tokens: stop.
  const LayerPlacement base = even_placement(8, 4);
  const Counts counts = single_hot_counts(4, 8, 6, 10);
  EXPECT_EQ(fastermoe_shadowed(base.owner, counts, small_model()), std::vector<int>{6});
  const LayerPlacement p = fastermoe_plan(base, counts, small_model());
  EXPECT_EQ(p.owner, base.owner);
  const std::vector<int> everywhere = {0, 1, 2, 3};
  for (int e = 0; e < 8; ++e) EXPECT_EQ(p.replicas[e], e == 6 ? everywhere : base.replicas[e]);
  // Counting the gradients' reduce too (t_m = 8), one expert per rank as in FasterMoE's code: 4 tokens
  // for expert 1, one from each rank (Lat_0 = 16 > 4 + 8) are shadowed; 2 (Lat_0 = 8 = 4 + 4) are not
  // even with one transfer (t_m = 4).
  FasterMoeModel cpu = small_model();
  cpu.transfers_per_shadow = 2;
  const std::vector<int> one_each = {0, 1, 2, 3};
  EXPECT_EQ(fastermoe_shadowed(one_each, {{0, 1, 0, 0}, {0, 1, 0, 0}, {0, 1, 0, 0}, {0, 1, 0, 0}}, cpu),
            std::vector<int>{1});
  EXPECT_TRUE(fastermoe_shadowed(one_each, {{0, 1, 0, 0}, {0, 1, 0, 0}, {0, 0, 0, 0}, {0, 0, 0, 0}}, small_model())
                  .empty());
  // Tokens that all come from one rank gain nothing from a shadow: that rank computes them all.
  EXPECT_TRUE(fastermoe_shadowed(one_each, {{0, 40, 0, 0}, {0, 0, 0, 0}, {0, 0, 0, 0}, {0, 0, 0, 0}}, cpu).empty());
  // Sums over source ranks: rank 1 routes 3 tokens to expert 0 (rank 0's) and rank 0 one, L_0 = 4:
  // Lat_0 = 16; shadowed, rank 1 computes its 3: 12 + 4 = 16, not lower: kept home.
  EXPECT_TRUE(fastermoe_shadowed({0, 1}, {{1, 0}, {3, 0}}, small_model()).empty());
  EXPECT_EQ(fastermoe_shadowed({0, 1}, {{3, 0}, {3, 0}}, small_model()), std::vector<int>{0});  // 24 > 12 + 4
}

// Several experts a rank: the busiest rank bounds the step. Rank 0 holds experts 0, 1 (60 and 0
// tokens), rank 1 holds 2, 3 (60 each): rows 60 / 120. FasterMoE's code sees three experts of 60 and
// shadows none (Lat_1 = 4 * 60 + 4 > 240). Here rank 1's expert 2 is shadowed: rank 0 computes its 40
// tokens, rank 1 its 20: rows 100 / 80, Lat 404 < 480; then rank 0's expert 0 (70 / 110, 448) and
// rank 1's expert 3 (110 / 70, 452) cost more.
TEST(FasterMoe, TheBusiestRankNotTheHottestExpertBoundsTheStep) {
  const Counts counts = {{30, 0, 40, 40}, {30, 0, 20, 20}};
  EXPECT_EQ(fastermoe_shadowed({0, 0, 1, 1}, counts, small_model()), std::vector<int>{2});
  EXPECT_THROW(fastermoe_shadowed({0, 0, 2, 1}, counts, small_model()), std::logic_error);  // owner out of range
  // Two equally hot experts on two ranks: either alone moves the maximum to the other rank (4 sources x
  // 32 tokens each: rows 128 / 128 / 0 / 0 -> 32 / 160 / 32 / 32), both together halve it (64 each):
  // Lat 4 * 64 + 2 t_m = 264 < 512, where FasterMoE's code would stop at the first.
  const Counts two_hot(4, std::vector<int64_t>{32, 32, 0, 0});
  EXPECT_EQ(fastermoe_shadowed({0, 1, 2, 3}, two_hot, small_model()), (std::vector<int>{0, 1}));
}

TEST(FasterMoe, ZipfMatchesTheLatencyFormula) {
  const FasterMoeUnitCosts u = fastermoe_unit_costs(small_model());
  bool some_shadowed = false;
  for (int R : {4, 8}) {
    const LayerPlacement even = even_placement(16, R);
    for (uint32_t seed = 1; seed <= 20; ++seed) {
      const Counts counts = zipf_counts(R, 16, 50 + 20 * seed, 1.4, seed);
      const auto shadowed = fastermoe_shadowed(even.owner, counts, small_model());
      EXPECT_EQ(shadowed, expected_shadowed(even.owner, counts, u)) << "R " << R << " seed " << seed;
      EXPECT_LT(shadowed.size(), 16u);  // one expert is never shadowed
      some_shadowed |= !shadowed.empty();
    }
  }
  EXPECT_TRUE(some_shadowed);
}

// ---------------------------------------------------------------- FlexMoE

FlexMoeConfig flex_config() {
  FlexMoeConfig cfg;
  cfg.reserved_slots = 1;
  cfg.balance_threshold = 1.2;
  cfg.replan_interval = 50;
  cfg.expert_seconds_per_token = 1e-3;
  cfg.expert_state_bytes = 1000;
  cfg.bandwidth = 1e5;  // a move costs 0.01 s
  return cfg;
}

TEST(FlexMoe, ExpandsTheHotExpertIntoAReservedSlot) {
  // 2 ranks x (2 + 1) slots, loads {100, 10, 10, 10}: rank loads 110 / 20, rho = 110 / 65 > 1.2.
  // Expand expert 0 into rank 1: 60 / 70, saved 40 tokens * 1 ms * 50 steps = 2 s > 0.01 s.
  // Next hot: expert 1 (expert 0 is on every rank); no free slot on rank 1, so migrate cold expert 0
  // there: rank loads 105 / 25, max 105 > 70: rejected, stop.
  const FlexMoePlan plan = flexmoe_plan(even_placement(4, 2), {100, 10, 10, 10}, 0, flex_config());
  EXPECT_TRUE(plan.replanned);
  EXPECT_EQ(plan.moves, (std::vector<ReplicaMove>{{ReplicaMove::Kind::expand, 0, 1, 0}}));
  EXPECT_EQ(plan.placement.owner, (std::vector<int>{0, 0, 1, 1}));
  EXPECT_EQ(plan.placement.replicas, (std::vector<std::vector<int>>{{0, 1}, {0}, {1}, {1}}));
  EXPECT_EQ(flexmoe_rank_loads(plan.placement, {100, 10, 10, 10}), (std::vector<double>{60, 70}));
  EXPECT_DOUBLE_EQ(plan.balance_before, 110.0 / 65);
  EXPECT_DOUBLE_EQ(plan.balance_after, 70.0 / 65);

  FlexMoeConfig slow = flex_config();
  slow.bandwidth = 1e2;  // a move costs 10 s > 2 s saved
  const FlexMoePlan rejected = flexmoe_plan(even_placement(4, 2), {100, 10, 10, 10}, 0, slow);
  EXPECT_TRUE(rejected.replanned);
  EXPECT_TRUE(rejected.moves.empty());
  expect_same(rejected.placement, even_placement(4, 2));

  // On CPU ranks the replica's transfers cost every step: 40 ms saved against 30 ms a step still pays
  // (10 ms x 50 steps > 10 ms); against 50 ms a step it does not.
  FlexMoeConfig cpu = flex_config();
  cpu.replica_step_seconds = 0.03;
  EXPECT_EQ(flexmoe_plan(even_placement(4, 2), {100, 10, 10, 10}, 0, cpu).moves.size(), 1u);
  cpu.replica_step_seconds = 0.05;
  EXPECT_TRUE(flexmoe_plan(even_placement(4, 2), {100, 10, 10, 10}, 0, cpu).moves.empty());
  cpu.replica_step_seconds = -1;
  EXPECT_THROW(flexmoe_plan(even_placement(4, 2), {100, 10, 10, 10}, 0, cpu), std::logic_error);
}

TEST(FlexMoe, MigrateHandsOwnershipToTheRemainingReplica) {
  // 2 ranks x (2 + 1) slots, both full: rank 0 holds {0 (owner), 1, 2}, rank 1 holds {0, 2 (owner), 3}.
  // Loads {2, 1, 2, 100}: hot = 3, no free slot on rank 0: migrate cold = 0 (1 per replica, ties with
  // 2, lower id) off rank 0, where it was the owner, so rank 1 becomes its owner; expand 3 on rank 0
  // from its owner 1. Rank loads 3 / 102 -> 52 / 53. Next: hot = 0 (2 on one replica), migrate cold 2
  // off rank 0: 52 / 53 again, saves nothing: stop.
  LayerPlacement current = even_placement(4, 2);
  current.replicas[0] = {0, 1};
  current.replicas[2] = {0, 1};
  const std::vector<double> load = {2, 1, 2, 100};
  const FlexMoePlan plan = flexmoe_plan(current, load, 0, flex_config());
  EXPECT_EQ(plan.moves, (std::vector<ReplicaMove>{{ReplicaMove::Kind::shrink, 0, 0, -1},
                                                  {ReplicaMove::Kind::expand, 3, 0, 1}}));
  EXPECT_EQ(plan.placement.owner, (std::vector<int>{1, 0, 1, 1}));
  EXPECT_EQ(plan.placement.replicas, (std::vector<std::vector<int>>{{1}, {0}, {0, 1}, {0, 1}}));
  EXPECT_EQ(flexmoe_rank_loads(plan.placement, load), (std::vector<double>{52, 53}));
}

TEST(FlexMoe, ShrinksAReplicaThatRelievesNoMaximum) {
  // 2 ranks x (2 + 1) slots; expert 0 (owner rank 0) has a replica on rank 1, its load gone: {0, 10,
  // 10, 10}, rank loads 10 / 20, rho 1.33: re-plan. Hot = expert 1, no free slot on rank 1, migrate
  // cold expert 0 there: 5 / 25, rejected. Then the shrink: dropping expert 0's replica leaves 10 /
  // 20, the same maximum: dropped.
  LayerPlacement current = even_placement(4, 2);
  current.replicas[0] = {0, 1};
  FlexMoePlan plan = flexmoe_plan(current, {0, 10, 10, 10}, 0, flex_config());
  EXPECT_TRUE(plan.replanned);
  EXPECT_EQ(plan.moves, (std::vector<ReplicaMove>{{ReplicaMove::Kind::shrink, 0, 1, -1}}));
  expect_same(plan.placement, even_placement(4, 2));

  // Loads {40, 10, 10, 10}: 30 / 40, rho 1.14, no trigger. Without the replica rank 0 would run 50:
  // it relieves the maximum, and stays whatever a replica costs a step.
  FlexMoeConfig cpu = flex_config();
  cpu.replica_step_seconds = 1;
  plan = flexmoe_plan(current, {40, 10, 10, 10}, 0, cpu);
  EXPECT_FALSE(plan.replanned);
  EXPECT_TRUE(plan.moves.empty());
  expect_same(plan.placement, current);
  // Without the trigger too: a replica of expert 2 (owner rank 1) on rank 0, loads {10, 10, 0, 18}:
  // 20 / 18, rho 1.05. Expert 2 has no load; its replica relieves nothing: dropped.
  current = even_placement(4, 2);
  current.replicas[2] = {0, 1};
  plan = flexmoe_plan(current, {10, 10, 0, 18}, 0, cpu);
  EXPECT_FALSE(plan.replanned);
  EXPECT_EQ(plan.moves, (std::vector<ReplicaMove>{{ReplicaMove::Kind::shrink, 2, 0, -1}}));
  expect_same(plan.placement, even_placement(4, 2));
}

TEST(FlexMoe, TriggersOnTheThresholdOrEveryKSteps) {
  const std::vector<double> uniform(8, 10.0);
  const LayerPlacement even = even_placement(8, 4);
  FlexMoePlan plan = flexmoe_plan(even, uniform, 49, flex_config());
  EXPECT_FALSE(plan.replanned);  // rho = 1, and not yet K steps
  EXPECT_DOUBLE_EQ(plan.balance_before, 1.0);
  plan = flexmoe_plan(even, uniform, 50, flex_config());
  EXPECT_TRUE(plan.replanned);  // every K steps, but no move helps a balanced load
  EXPECT_TRUE(plan.moves.empty());
  expect_same(plan.placement, even);
  EXPECT_FALSE(flexmoe_plan(even, std::vector<double>(8, 0.0), 0, flex_config()).replanned);
  LayerPlacement overfull = even;
  overfull.replicas[0] = {0, 1};
  overfull.replicas[1] = {0, 1};
  EXPECT_THROW(flexmoe_plan(overfull, uniform, 0, flex_config()), std::logic_error);  // rank 1: 4 > 3
  EXPECT_THROW(flexmoe_plan(even, uniform, -1, flex_config()), std::logic_error);
}

TEST(FlexMoe, ReducesTheMaxRankLoadOnZipfAndNeverIncreasesIt) {
  for (int R : {4, 8}) {
    const int E = 16;
    FlexMoeConfig cfg = flex_config();
    cfg.reserved_slots = 2;
    for (uint32_t seed = 1; seed <= 15; ++seed) {
      const std::vector<double> load = as_loads(column_sums(zipf_counts(R, E, 500, 1.2, seed)));
      const LayerPlacement even = even_placement(E, R);
      const FlexMoePlan plan = flexmoe_plan(even, load, 0, cfg);
      ASSERT_TRUE(plan.placement.validate());
      const double before = max_of(flexmoe_rank_loads(even, load));
      const double after = max_of(flexmoe_rank_loads(plan.placement, load));
      EXPECT_TRUE(plan.replanned);
      EXPECT_LT(after, before) << "R " << R << " seed " << seed;
      for (int r = 0; r < R; ++r)
        EXPECT_LE(static_cast<int>(plan.placement.experts_on(r).size()), E / R + cfg.reserved_slots);
      // Replanning again from the result never makes it worse.
      const FlexMoePlan again = flexmoe_plan(plan.placement, load, cfg.replan_interval, cfg);
      EXPECT_LE(max_of(flexmoe_rank_loads(again.placement, load)), after);
      const FlexMoePlan twice = flexmoe_plan(even, load, 0, cfg);  // deterministic
      expect_same(twice.placement, plan.placement);
      EXPECT_EQ(twice.moves, plan.moves);
    }
  }
}

// ---------------------------------------------------------------- SmartMoE

TEST(SmartMoe, GreedySwapAdoptedWhenTheMaxDrops) {
  // Loads {40, 30, 20, 10}, owners {0, 0, 1, 1}: rank loads 70 / 30. Greedy: e0 -> rank 0 (tie, its
  // current rank), e1 -> rank 1 (0 < 40), e2 -> rank 1 (30 < 40), e3 -> rank 0 (the only free slot):
  // 50 / 50 < 70, adopted.
  const SmartMoePlan plan = smartmoe_plan({0, 0, 1, 1}, 2, {40, 30, 20, 10}, 10, SmartMoeConfig{});
  EXPECT_TRUE(plan.evaluated);
  EXPECT_TRUE(plan.adopted);
  EXPECT_EQ(plan.owner, (std::vector<int>{0, 1, 1, 0}));
  EXPECT_EQ(plan.moves, (std::vector<ExpertMove>{{1, 0, 1}, {3, 1, 0}}));
  EXPECT_DOUBLE_EQ(plan.max_load_before, 70);
  EXPECT_DOUBLE_EQ(plan.max_load_after, 50);

  const SmartMoePlan early = smartmoe_plan({0, 0, 1, 1}, 2, {40, 30, 20, 10}, 9, SmartMoeConfig{});
  EXPECT_FALSE(early.evaluated);  // every f = 10 steps
  EXPECT_EQ(early.owner, (std::vector<int>{0, 0, 1, 1}));
}

TEST(SmartMoe, KeepsThePlacementWhenTheMaxWouldNotStrictlyDrop) {
  // Uniform: the greedy reaches 20 / 20, equal to the current maximum: not adopted.
  const SmartMoePlan plan = smartmoe_plan({0, 0, 1, 1}, 2, {10, 10, 10, 10}, 10, SmartMoeConfig{});
  EXPECT_TRUE(plan.evaluated);
  EXPECT_FALSE(plan.adopted);
  EXPECT_EQ(plan.owner, (std::vector<int>{0, 0, 1, 1}));
  EXPECT_TRUE(plan.moves.empty());
  EXPECT_FALSE(smartmoe_plan({0, 0, 1, 1}, 2, {0, 0, 0, 0}, 10, SmartMoeConfig{}).adopted);
  EXPECT_THROW(smartmoe_plan({0, 0, 0, 1}, 2, {1, 1, 1, 1}, 10, SmartMoeConfig{}), std::logic_error);
  EXPECT_THROW(smartmoe_plan({0, 0, 1, 1}, 2, {1, 1, 1, 1}, 10, SmartMoeConfig{0}), std::logic_error);
}

// Priced: the swap of GreedySwapAdoptedWhenTheMaxDrops saves (70 - 50) tokens x 1 ms x 10 steps = 200 ms
// a interval; each rank receives one expert of 3 MB. At 100 MB/s the move takes 30 ms: adopted. At
// 10 MB/s, 300 ms: kept as it is. A nearly balanced layer (the natural imbalance of an unskewed
// router) never pays for a move over a slow link.
TEST(SmartMoe, PricedSwapAdoptedOnlyWhenItsSavingBeatsTheMove) {
  SmartMoeConfig cfg;
  cfg.expert_seconds_per_token = 1e-3, cfg.expert_state_bytes = 3'000'000, cfg.bandwidth = 100e6;
  const SmartMoePlan fast = smartmoe_plan({0, 0, 1, 1}, 2, {40, 30, 20, 10}, 10, cfg);
  EXPECT_TRUE(fast.adopted);
  EXPECT_EQ(fast.owner, (std::vector<int>{0, 1, 1, 0}));
  EXPECT_DOUBLE_EQ(fast.saved_seconds, 0.2);
  EXPECT_DOUBLE_EQ(fast.move_seconds, 0.03);
  cfg.bandwidth = 10e6;
  const SmartMoePlan slow = smartmoe_plan({0, 0, 1, 1}, 2, {40, 30, 20, 10}, 10, cfg);
  EXPECT_TRUE(slow.evaluated);
  EXPECT_FALSE(slow.adopted);
  EXPECT_EQ(slow.owner, (std::vector<int>{0, 0, 1, 1}));
  EXPECT_TRUE(slow.moves.empty());
  EXPECT_DOUBLE_EQ(slow.move_seconds, 0.3);
  // 4% apart, as an unskewed router leaves them: unpriced it swaps, priced at 1 Gbit/s it does not.
  const std::vector<double> near{260, 250, 245, 245};
  EXPECT_TRUE(smartmoe_plan({0, 0, 1, 1}, 2, near, 10, SmartMoeConfig{}).adopted);
  cfg.expert_seconds_per_token = 50e-6, cfg.expert_state_bytes = 3 * 8'388'608, cfg.bandwidth = 125e6;
  EXPECT_FALSE(smartmoe_plan({0, 0, 1, 1}, 2, near, 10, cfg).adopted);
  cfg.bandwidth = 0;
  EXPECT_THROW(smartmoe_plan({0, 0, 1, 1}, 2, near, 10, cfg), std::logic_error);  // half priced
}

// Two ranks on one core: the swap that evens them leaves the core's total as it was; the rows it keeps
// off the slowest link still count.
TEST(SmartMoe, ASwapBetweenRanksSharingACoreSavesOnlyTheirExchanges) {
  SmartMoeConfig cfg;
  cfg.expert_seconds_per_token = 1e-3, cfg.expert_state_bytes = 3'000'000, cfg.bandwidth = 100e6;
  cfg.cores = CorePools{{0, 0}, {1}};
  const SmartMoePlan shared = smartmoe_plan({0, 0, 1, 1}, 2, {40, 30, 20, 10}, 10, cfg);
  EXPECT_TRUE(shared.evaluated);
  EXPECT_FALSE(shared.adopted);
  EXPECT_DOUBLE_EQ(shared.saved_seconds, 0);
  cfg.exchange_seconds_per_token = 1e-3;
  const SmartMoePlan exchanges = smartmoe_plan({0, 0, 1, 1}, 2, {40, 30, 20, 10}, 10, cfg);
  EXPECT_TRUE(exchanges.adopted);
  EXPECT_DOUBLE_EQ(exchanges.saved_seconds, 0.2);  // (70 - 50) rows x 1 ms x 10 steps
}

// 2 hosts of one core and one NIC, 2 ranks each: evening the ranks of a host changes neither its core's
// work nor its NIC's rows, so the swap saves nothing; evening the hosts does.
TEST(SmartMoe, ASwapWithinAHostSavesNothingWhereItsRanksShareACoreAndANic) {
  SmartMoeConfig cfg;
  cfg.expert_seconds_per_token = 1e-3, cfg.expert_state_bytes = 3'000'000, cfg.bandwidth = 100e6;
  cfg.exchange_seconds_per_token = 1e-3;
  cfg.cores = CorePools{{0, 0, 1, 1}, {1, 1}};
  const std::vector<int> owner{0, 0, 1, 1, 2, 2, 3, 3};
  const std::vector<double> host_mates{40, 30, 1, 1, 20, 20, 20, 20};  // rank 0 hot, host 0 = host 1
  EXPECT_TRUE(smartmoe_plan(owner, 4, host_mates, 10, cfg).adopted);  // each rank its own NIC
  cfg.nics = nic_pools({0, 0, 1, 1});
  const SmartMoePlan within = smartmoe_plan(owner, 4, host_mates, 10, cfg);
  EXPECT_TRUE(within.evaluated);
  EXPECT_FALSE(within.adopted);
  EXPECT_DOUBLE_EQ(within.saved_seconds, 0);
  const std::vector<double> hosts{40, 30, 20, 10, 5, 5, 5, 5};  // host 0 has 100 rows, host 1 20
  const SmartMoePlan across = smartmoe_plan(owner, 4, hosts, 10, cfg);
  EXPECT_TRUE(across.adopted);
  EXPECT_GT(across.saved_seconds, across.move_seconds);
}

TEST(SmartMoe, ReducesTheMaxRankLoadOnZipfAndNeverIncreasesIt) {
  for (int R : {2, 4, 8}) {
    const int E = 16;
    for (uint32_t seed = 1; seed <= 15; ++seed) {
      const std::vector<double> load = as_loads(column_sums(zipf_counts(R, E, 500, 1.2, seed)));
      const std::vector<int> even = even_placement(E, R).owner;
      const SmartMoePlan plan = smartmoe_plan(even, R, load, 10, SmartMoeConfig{});
      const double before = max_of(owner_rank_loads(even, R, load));
      const double after = max_of(owner_rank_loads(plan.owner, R, load));
      EXPECT_DOUBLE_EQ(plan.max_load_before, before);
      EXPECT_DOUBLE_EQ(plan.max_load_after, after);
      EXPECT_LE(after, before);
      std::vector<int> owned(R, 0);
      for (int r : plan.owner) ++owned[r];
      EXPECT_EQ(owned, std::vector<int>(R, E / R));  // still a permutation onto the slots
      EXPECT_EQ(plan.moves, owner_moves(even, plan.owner));
      // A skewed expert order (Zipf, shuffled) almost never leaves even blocks optimal; with the
      // hottest experts together on rank 0 it never does.
      std::vector<int> sorted(E);
      std::iota(sorted.begin(), sorted.end(), 0);
      std::stable_sort(sorted.begin(), sorted.end(), [&](int a, int b) { return load[a] > load[b]; });
      std::vector<int> clustered(E);
      for (int i = 0; i < E; ++i) clustered[sorted[i]] = i / (E / R);
      const SmartMoePlan fix = smartmoe_plan(clustered, R, load, 10, SmartMoeConfig{});
      EXPECT_TRUE(fix.adopted);
      EXPECT_LT(fix.max_load_after, fix.max_load_before);
      const SmartMoePlan twice = smartmoe_plan(even, R, load, 10, SmartMoeConfig{});  // deterministic
      EXPECT_EQ(twice.owner, plan.owner);
      EXPECT_EQ(twice.moves, plan.moves);
    }
  }
}

}  // namespace
}  // namespace moe::plan
