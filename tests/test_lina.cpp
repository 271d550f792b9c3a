// Lina's scheduling planner (plan/lina.h) against closed forms: path profiles and their back-off, the
// estimate of Eq. 1, slots proportional to popularity, the replica placement, top-k with ties.
#include <vector>

#include <gtest/gtest.h>

#include "plan/lina.h"

using moe::plan::LayerPlacement;
using moe::plan::PathProfile;

namespace {

// 3 MoE layers, 4 experts, top-2; a token's first choice at layer l is (first at layer 0 + l) % 4 and
// its second ((first + 1) % 4): a path predicts the next layer exactly.
PathProfile deterministic_profile(int tokens_per_start) {
  PathProfile p(3, 4, 2);
  for (int start = 0; start < 4; ++start)
    for (int i = 0; i < tokens_per_start; ++i) {
      std::vector<int32_t> first, chosen;
      for (int l = 0; l < 3; ++l) {
        first.push_back((start + l) % 4);
        chosen.push_back((start + l) % 4);
        chosen.push_back((start + l + 1) % 4);
      }
      p.add(first, chosen);
    }
  return p;
}

TEST(LinaProfile, APathPredictsItsNextLayer) {
  const PathProfile p = deterministic_profile(10);
  EXPECT_EQ(p.tokens(), 40);
  std::vector<double> d;
  p.distribution(2, std::vector<int32_t>{1, 2}, &d);  // started at expert 1: layer 2 chooses 3 and 0
  EXPECT_EQ(d, (std::vector<double>{0.5, 0, 0, 0.5}));
  // Estimate of a batch of 3 such tokens and one started at 0 (layer 2: experts 2 and 3), top-2 each.
  const std::vector<int32_t> paths{1, 2, 1, 2, 1, 2, 0, 1};  // [4][2]
  const std::vector<double> pop = p.estimate(2, paths, 2, 2);
  EXPECT_EQ(pop, (std::vector<double>{1.5, 0, 0.5, 2.0}));
  // Top-1 keeps one expert per token (ties to the lower index): 0 for the first three, 2 for the last.
  EXPECT_EQ(p.estimate(2, paths, 2, 1), (std::vector<double>{1.5, 0, 0.5, 0}));
  // The tokens that share a path are looked up once: the sum is the same token by token.
  std::vector<double> one_by_one(4, 0.0);
  for (size_t t = 0; t < 4; ++t) {
    const std::vector<double> alone = p.estimate(2, std::span<const int32_t>(paths).subspan(2 * t, 2), 2, 2);
    for (int e = 0; e < 4; ++e) one_by_one[e] += alone[e];
  }
  EXPECT_EQ(one_by_one, pop);
  // Only the last path_length choices count, and a choice out of range is found nowhere, whatever it is.
  EXPECT_EQ(p.estimate(2, std::vector<int32_t>{7, 1, 2}, 3, 2), p.estimate(2, std::vector<int32_t>{1, 2}, 2, 2));
  EXPECT_EQ(p.estimate(2, std::vector<int32_t>{9, 2}, 2, 2), p.estimate(2, std::vector<int32_t>{-3, 2}, 2, 2));
  EXPECT_THROW(p.estimate(2, std::vector<int32_t>{1, 2, 3}, 2, 2), std::logic_error);
}

TEST(LinaProfile, RarePathsBackOffToShorterOnesThenTheMarginal) {
  // 4 tokens per start: paths of length 1 and 2 are seen 4 times, fewer than kMinPathCount (8).
  const PathProfile p = deterministic_profile(4);
  std::vector<double> d;
  p.distribution(2, std::vector<int32_t>{1, 2}, &d);
  EXPECT_EQ(d, (std::vector<double>{0.25, 0.25, 0.25, 0.25}));  // layer 2's marginal
  // An unseen path backs off to its longest seen suffix: (3, 3) to (3), the tokens started at 2.
  const PathProfile q = deterministic_profile(10);
  q.distribution(2, std::vector<int32_t>{3, 3}, &d);
  EXPECT_EQ(d, (std::vector<double>{0.5, 0.5, 0.0, 0.0}));
  q.distribution(2, std::vector<int32_t>{0, 2}, &d);  // (0, 2) unseen, (2): started at 1
  EXPECT_EQ(d, (std::vector<double>{0.5, 0, 0, 0.5}));
  // Layer 0 has no path: its marginal.
  q.distribution(0, std::vector<int32_t>{}, &d);
  EXPECT_EQ(d, (std::vector<double>{0.25, 0.25, 0.25, 0.25}));
  EXPECT_THROW(q.distribution(3, std::vector<int32_t>{}, &d), std::logic_error);
}

TEST(LinaPlan, SlotsAreProportionalToPopularityWithinOneToR) {
  EXPECT_EQ(moe::plan::lina_slots({4, 2, 1, 1}, 4), (std::vector<int>{2, 1, 1, 1}));  // E * share: 2, 1, .5, .5
  EXPECT_EQ(moe::plan::lina_slots({7, 1, 0, 0}, 4), (std::vector<int>{4, 1, 1, 1}));  // 3.5 -> 4, capped at R
  EXPECT_EQ(moe::plan::lina_slots({7, 1, 0, 0}, 2), (std::vector<int>{2, 1, 1, 1}));
  EXPECT_EQ(moe::plan::lina_slots({0, 0, 0, 0}, 2), (std::vector<int>{1, 1, 1, 1}));
}

TEST(LinaPlan, PopularExpertsGetReplicasOnTheLeastLoadedRanks) {
  // 8 experts on 4 ranks (owners 0,0,1,1,2,2,3,3). Expert 2 (rank 1) holds half the load: 4 slots,
  // capped at 4 ranks: replicas everywhere. Expert 5 (rank 2) a quarter: 2 slots, the second on the
  // least loaded rank without it (rank 0 or 3: rank 0 holds experts 0, 1 of pop 1 each and a quarter
  // of expert 2; rank 3 experts 6, 7 of pop 1 each and the same share: tie to the lower rank, 0).
  const LayerPlacement owners = moe::plan::even_placement(8, 4);
  const LayerPlacement p = moe::plan::lina_placement({1, 1, 16, 1, 1, 8, 1, 1}, owners);
  EXPECT_TRUE(p.validate());
  EXPECT_EQ(p.owner, owners.owner);
  EXPECT_EQ(p.replicas[2], (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(p.replicas[5], (std::vector<int>{1, 2}));
  for (int e : {0, 1, 3, 4, 6, 7}) EXPECT_EQ(p.replicas[e], owners.replicas[e]) << e;
  // Even popularity: nothing moves.
  EXPECT_EQ(moe::plan::lina_placement(std::vector<double>(8, 1.0), owners).replicas, owners.replicas);
}

// Priced: 4 experts on 2 ranks (owners 0, 0, 1, 1), expert 0 hot (30 of 36 tokens: 2 slots).
// 1 ms a token, 0.5 ms to read an expert: rank 0 takes 30 + 0.5 + 2 + 0.5 = 33 ms, rank 1 5 ms. A
// replica of expert 0 on rank 1, its 30 tokens split so that the ranks' tokens level at 18 (16 on rank
// 0 beside expert 1's 2, 14 on rank 1 beside 4), makes them 19 and 19.5 ms: 13.5 ms saved (an even
// split, 15 and 15, would make them 18 and 20.5). Kept for a 10 ms move, refused for 20 ms unless rank
// 1 already holds it.
TEST(LinaPlan, PricedReplicaOnlyWhereItsSavingBeatsItsMove) {
  const LayerPlacement owners = moe::plan::even_placement(4, 2);
  const std::vector<double> pop{30, 2, 2, 2};
  moe::plan::LinaCost cost = moe::plan::LinaCost::affine(0.5e-3, 1e-3, 10e-3);
  EXPECT_DOUBLE_EQ(moe::plan::lina_busiest_seconds(owners, pop, cost), 33e-3);
  const LayerPlacement cheap = moe::plan::lina_placement(pop, owners, &cost);
  EXPECT_EQ(cheap.replicas[0], (std::vector<int>{0, 1}));
  EXPECT_DOUBLE_EQ(moe::plan::lina_busiest_seconds(cheap, pop, cost), 19.5e-3);
  cost.move_seconds = 20e-3;
  EXPECT_EQ(moe::plan::lina_placement(pop, owners, &cost).replicas, owners.replicas);
  EXPECT_EQ(moe::plan::lina_placement(pop, owners, &cost, &cheap).replicas[0], (std::vector<int>{0, 1}));
  // A decode-sized batch (6 tokens) at 10 us a token: reading the weights dominates, and a replica
  // makes its new holder read them too (rank 1 from 1.02 to 1.53 ms, its share 1 of the 3 tokens):
  // refused even when held.
  const std::vector<double> small{3, 1, 1, 1};
  const moe::plan::LinaCost decode = moe::plan::LinaCost::affine(0.5e-3, 10e-6, 0);
  EXPECT_EQ(moe::plan::lina_slots(small, 2)[0], 2);  // the unpriced rule would replicate it
  EXPECT_EQ(moe::plan::lina_placement(small, owners).replicas[0], (std::vector<int>{0, 1}));
  EXPECT_EQ(moe::plan::lina_placement(small, owners, &decode, &cheap).replicas, owners.replicas);
}

// The price of an expert is its measured curve: linear between the points, from 0 at 0 rows, on the
// last segment's slope beyond the last point, flat beyond a single point.
TEST(LinaPlan, ExpertSecondsFollowsTheMeasuredCurve) {
  const moe::plan::LinaCost c{{1, 4, 16}, {2e-4, 4e-4, 10e-4}, 0};
  EXPECT_DOUBLE_EQ(c.expert_seconds(0), 0);
  EXPECT_DOUBLE_EQ(c.expert_seconds(0.5), 1e-4);
  EXPECT_DOUBLE_EQ(c.expert_seconds(1), 2e-4);
  EXPECT_NEAR(c.expert_seconds(2.5), 3e-4, 1e-15);
  EXPECT_DOUBLE_EQ(c.expert_seconds(4), 4e-4);
  EXPECT_NEAR(c.expert_seconds(10), 7e-4, 1e-15);
  EXPECT_NEAR(c.expert_seconds(32), 18e-4, 1e-15);  // 0.5 us a row beyond 16, as between 4 and 16
  const moe::plan::LinaCost one{{8}, {5e-4}, 0};
  EXPECT_DOUBLE_EQ(one.expert_seconds(4), 2.5e-4);
  EXPECT_DOUBLE_EQ(one.expert_seconds(100), 5e-4);
  EXPECT_THROW(moe::plan::LinaCost{}.expert_seconds(1), std::logic_error);
  const moe::plan::LinaCost a = moe::plan::LinaCost::affine(0.5e-3, 1e-3, 0);
  EXPECT_NEAR(a.expert_seconds(30), 30.5e-3, 1e-15);
}

// Runs timed against a known curve (a layer's experts at assorted rows, each run the curve's sum over
// them, as serving measures a rank's experts) give that curve back; points the runs never reach keep
// the prior's; ranks' runs summed give the curve all of them together give.
TEST(LinaPlan, CurveFitRecoversTheCurveThatTimedTheRuns) {
  const moe::plan::LinaCost truth{{1, 2, 4, 8, 16}, {3e-4, 3.1e-4, 3.3e-4, 4.1e-4, 5.7e-4}, 2e-4};
  moe::plan::LinaCost prior = truth;
  for (double& s : prior.seconds) s *= 2;  // start-up read everything twice as slow
  auto time = [&](const std::vector<int64_t>& rows) {
    double t = 0;
    for (int64_t n : rows) t += truth.expert_seconds(static_cast<double>(n));
    return t;
  };
  const std::vector<std::vector<int64_t>> runs = {{1, 1, 0, 2}, {3, 0, 5, 1}, {4, 4, 1, 0}, {8, 2, 0, 0},
                                                   {6, 1, 1, 1}, {16, 0, 0, 3}, {12, 7, 2, 0}, {20, 1, 0, 0}};
  moe::plan::LinaCurveFit fit(truth.rows), rank0(truth.rows), rank1(truth.rows);
  for (size_t i = 0; i < runs.size(); ++i) {
    fit.add(runs[i], time(runs[i]));
    (i % 2 ? rank1 : rank0).add(runs[i], time(runs[i]));
  }
  EXPECT_DOUBLE_EQ(fit.runs(), 8);
  const moe::plan::LinaCost got = fit.fitted(prior, 1e-9);
  for (size_t j = 0; j < truth.rows.size(); ++j) EXPECT_NEAR(got.seconds[j], truth.seconds[j], 1e-12) << j;
  EXPECT_DOUBLE_EQ(got.move_seconds, prior.move_seconds);
  // The ranks' sums added: the same fit.
  moe::plan::LinaCurveFit both(truth.rows);
  both.add_sums(rank0.sums());
  both.add_sums(rank1.sums());
  const moe::plan::LinaCost summed = both.fitted(prior, 1e-9);
  for (size_t j = 0; j < truth.rows.size(); ++j) EXPECT_NEAR(summed.seconds[j], got.seconds[j], 1e-12) << j;
  // Decode runs alone (1 and 2 rows) leave the points beyond them at the prior's shape scaled to the
  // runs' level (here exactly the truth: the prior is twice it), kept non-decreasing.
  moe::plan::LinaCurveFit decode(truth.rows);
  for (int i = 0; i < 200; ++i) decode.add(std::vector<int64_t>{1, 2, 1}, time({1, 2, 1}));
  const moe::plan::LinaCost d = decode.fitted(prior, 16);
  EXPECT_NEAR(d.seconds[0] + d.seconds[1] + d.seconds[0], time({1, 2, 1}), 0.05 * time({1, 2, 1}));
  EXPECT_NEAR(d.seconds[4], truth.seconds[4], 1e-12);
  for (size_t j = 1; j < d.seconds.size(); ++j) EXPECT_GE(d.seconds[j], d.seconds[j - 1]);
  EXPECT_NEAR(got.noise_seconds, 0, 1e-9);  // exact runs: no residual
  // Runs of one shape timed T + d and T - d: the fit is T, the spread d.
  moe::plan::LinaCurveFit noisy(truth.rows);
  for (int i = 0; i < 100; ++i) noisy.add(std::vector<int64_t>{1}, 3e-4 + (i % 2 ? 5e-5 : -5e-5));
  const moe::plan::LinaCost n = noisy.fitted(prior, 1e-9);
  EXPECT_NEAR(n.seconds[0], 3e-4, 1e-12);
  EXPECT_NEAR(n.noise_seconds, 5e-5, 1e-9);
  noisy.add(std::vector<int64_t>{0, 0}, 1.0);  // no rows: not a run
  EXPECT_DOUBLE_EQ(noisy.runs(), 100);
  // No runs: the prior. Halving the runs and clearing.
  EXPECT_EQ(moe::plan::LinaCurveFit(truth.rows).fitted(prior, 16).seconds, prior.seconds);
  fit.decay(0.5);
  EXPECT_DOUBLE_EQ(fit.runs(), 4);
  fit.clear();
  EXPECT_DOUBLE_EQ(fit.runs(), 0);
  EXPECT_THROW(fit.fitted(prior, 0), std::logic_error);
  EXPECT_THROW(fit.fitted(moe::plan::LinaCost::affine(1e-4, 1e-5, 0), 16), std::logic_error);  // other rows
  EXPECT_THROW(fit.add_sums(std::vector<double>(3, 0.0)), std::logic_error);
  EXPECT_THROW(moe::plan::LinaCurveFit({2, 1}), std::logic_error);
  EXPECT_THROW(moe::plan::LinaCurveFit({}), std::logic_error);
}

// A held replica that splits a decode batch's hot expert (6 tokens) saves the busiest rank 30 us and
// lifts the other rank level with it: with no noise the plan takes it; with ranks' times spread by
// 200 us the expected slowest of two level ranks is longer than of one clearly busier rank (753
// against 684 us), and the plan keeps EP's placement. A prefill's 200 tokens still split.
TEST(LinaPlan, UnderNoiseADecodeSplitThatLevelsTheRanksIsRefused) {
  const LayerPlacement owners = moe::plan::even_placement(4, 2);
  LayerPlacement held = owners;
  held.replicas[0] = {0, 1};
  moe::plan::LinaCost cost = moe::plan::LinaCost::affine(300e-6, 10e-6, 1e-3);
  const std::vector<double> decode{6, 1, 1, 0}, prefill{200, 1, 1, 0};
  std::vector<double> foregone(8, 0.0);
  EXPECT_EQ(moe::plan::lina_placement(decode, owners, &cost, &held, &foregone).replicas[0], (std::vector<int>{0, 1}));
  EXPECT_NEAR(moe::plan::lina_busiest_seconds(owners, decode, cost), 670e-6, 1e-12);
  cost.noise_seconds = 200e-6;
  EXPECT_NEAR(moe::plan::lina_busiest_seconds(owners, decode, cost), 683.7e-6, 0.5e-6);
  EXPECT_NEAR(moe::plan::lina_busiest_seconds(held, decode, cost), 752.8e-6, 0.5e-6);
  EXPECT_EQ(moe::plan::lina_placement(decode, owners, &cost, &held, &foregone).replicas[0], (std::vector<int>{0}));
  EXPECT_EQ(moe::plan::lina_placement(prefill, owners, &cost, &held, &foregone).replicas[0], (std::vector<int>{0, 1}));
  // A rank with nothing to run adds no noise: one busy rank's expected time is its own.
  EXPECT_NEAR(moe::plan::lina_busiest_seconds(owners, {6, 0, 0, 0}, cost), 360e-6, 1e-9);
}

// Where the kernel's time is nearly flat over a decode batch's rows (as measured on CPUs: the first
// few rows cost about the same), splitting a hot expert's 12 tokens saves its owner 21 us (t(12) - t(6)),
// while its new holder pays t(6) = 364 us on a load 50 us above the owner's other work (rank 0: expert
// 1, 1 token, 200 us; rank 1: experts 2 and 3, 1 and 0.25 tokens, 250 us): the busiest rank gets slower,
// so even a free (held) replica is refused. A line through the same 1-row and 64-row times prices the
// split at 105 us saved and keeps it.
TEST(LinaPlan, AFlatCurveRefusesADecodeReplicaThatALineWouldKeep) {
  const LayerPlacement owners = moe::plan::even_placement(4, 2);
  const std::vector<double> pop{12, 1, 1, 0.25};
  const moe::plan::LinaCost curve{{1, 2, 16, 64}, {0.2e-3, 0.35e-3, 0.4e-3, 1.3e-3}, 0};
  const double per_token = 1.1e-3 / 63;
  const moe::plan::LinaCost line = moe::plan::LinaCost::affine(0.2e-3 - per_token, per_token, 0);
  LayerPlacement held = owners;
  held.replicas[0] = {0, 1};
  EXPECT_EQ(moe::plan::lina_placement(pop, owners, &line, &held).replicas[0], (std::vector<int>{0, 1}));
  EXPECT_EQ(moe::plan::lina_placement(pop, owners, &curve, &held).replicas, owners.replicas);
}

// A batch of one token whose two choices both sit on rank 0 (a lone request decoding). A token is not
// split: a holder that runs an expert runs at least one row (priced at half a token per holder, a
// replica once looked like halving rank 0's time: one replica per layer and forward). But the split
// levels the ranks, so a replica rank 1 holds takes the token of its expert whole: each rank then
// reads one expert, 0.4 ms instead of 0.8 on rank 0. Both replicas held, both experts split half and
// half: each rank runs both, 0.8 ms, nothing saved.
TEST(LinaPlan, ALoneTokenGoesWholeToAHeldReplicaOnAnIdleRank) {
  const LayerPlacement owners = moe::plan::even_placement(4, 2);
  const std::vector<double> pop{1, 1, 0, 0};
  const moe::plan::LinaCost curve{{1, 4, 16}, {0.4e-3, 0.45e-3, 0.6e-3}, 0};
  LayerPlacement held = owners;
  held.replicas[0] = {0, 1};
  held.replicas[1] = {0, 1};
  EXPECT_DOUBLE_EQ(moe::plan::lina_busiest_seconds(held, pop, curve), 0.8e-3);
  const LayerPlacement p = moe::plan::lina_placement(pop, owners, &curve, &held);
  EXPECT_EQ(p.replicas, (std::vector<std::vector<int>>{{0, 1}, {0}, {1}, {1}}));
  EXPECT_DOUBLE_EQ(moe::plan::lina_busiest_seconds(p, pop, curve), 0.4e-3);
  EXPECT_EQ(moe::plan::balanced_shares(p, pop)[0], (std::vector<double>{0, 1}));
  // An estimate's fractions of a token: a replica of expert 0 (0.4) on rank 1 would level the ranks by
  // splitting it 0.05 / 0.35, each holder then running the whole fraction (not split), saving nothing;
  // expert 1's 0.3 goes whole to rank 1, below rank 0's remaining 0.4: 0.28 ms -> 0.16 on rank 0.
  const std::vector<double> estimate{0.4, 0.3, 0, 0};
  const LayerPlacement q = moe::plan::lina_placement(estimate, owners, &curve, &held);
  EXPECT_EQ(q.replicas, (std::vector<std::vector<int>>{{0}, {0, 1}, {1}, {1}}));
  EXPECT_DOUBLE_EQ(moe::plan::lina_busiest_seconds(owners, estimate, curve), 0.28e-3);
  EXPECT_DOUBLE_EQ(moe::plan::lina_busiest_seconds(q, estimate, curve), 0.16e-3);
}

// Rent or buy: the same hot expert (13.5 ms saved a step, as above) against a 30 ms move. Refused on
// the first and second steps (13.5, then 13.5 + 13.5 = 27 <= 30), bought on the third (40.5 > 30), when
// the savings refused so far plus this step's pass the move; the sum is then reset. Without the sum
// it is refused every step.
TEST(LinaPlan, RentOrBuyBuysAReplicaOnceTheRefusedSavingsPassItsMove) {
  const LayerPlacement owners = moe::plan::even_placement(4, 2);
  const std::vector<double> pop{30, 2, 2, 2};
  const moe::plan::LinaCost cost = moe::plan::LinaCost::affine(0.5e-3, 1e-3, 30e-3);
  std::vector<double> foregone(2 * 4, 0.0);
  for (int step = 1; step <= 2; ++step) {
    EXPECT_EQ(moe::plan::lina_placement(pop, owners, &cost, &owners, &foregone).replicas, owners.replicas) << step;
    EXPECT_NEAR(foregone[1 * 4 + 0], step * 13.5e-3, 1e-12) << "rank 1, expert 0, step " << step;
  }
  const LayerPlacement bought = moe::plan::lina_placement(pop, owners, &cost, &owners, &foregone);
  EXPECT_EQ(bought.replicas[0], (std::vector<int>{0, 1}));
  EXPECT_EQ(foregone, std::vector<double>(8, 0.0));
  for (int step = 1; step <= 5; ++step)
    EXPECT_EQ(moe::plan::lina_placement(pop, owners, &cost, &owners).replicas, owners.replicas) << step;
  std::vector<double> wrong_size(3, 0.0);
  EXPECT_THROW(moe::plan::lina_placement(pop, owners, &cost, &owners, &wrong_size), std::logic_error);
}

TEST(LinaPlan, TopExpertsBreakTiesToTheLowerIndex) {
  EXPECT_EQ(moe::plan::top_experts({1, 3, 3, 2}, 2), (std::vector<int>{1, 2}));
  EXPECT_EQ(moe::plan::top_experts({5, 1, 5, 5}, 2), (std::vector<int>{0, 2}));
  EXPECT_EQ(moe::plan::top_experts({1, 2}, 5), (std::vector<int>{0, 1}));
}

}  // namespace
