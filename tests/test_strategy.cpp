// The strategy objects (strategy/strategy.h) on their own: the registry, what each asks of the step
// graph, and their decisions on made-up loads. The trainer and the simulator run these objects
// (test_distributed.cpp: every strategy trains ep's model; test_sim_strategies.cpp: their simulated
// steps).
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <cmath>

#include "plan/hecate.h"
#include "runtime/strategy.h"
#include "strategy/strategy.h"

namespace {

using moe::plan::LayerPlacement;
namespace strategy = moe::strategy;

strategy::Setup setup(int world, int experts = 8) {
  strategy::Setup s;
  s.model.n_layers = 2;
  s.model.n_experts = experts;
  s.world = world;
  for (int r = 0; r < world; ++r) s.nodes.node_of_rank.push_back(r / 2);  // 2 ranks per node
  s.cost = strategy::make_cost_model(s.model, 1e9, 1e11);
  return s;
}

std::unique_ptr<strategy::Strategy> make(const std::string& name, const strategy::Setup& s) {
  std::unique_ptr<strategy::Strategy> out;
  moe::Status st = strategy::make(name, s, &out);
  EXPECT_TRUE(st) << st.message();
  return out;
}

TEST(StrategyRegistry, ListsEveryStrategyOnceAndRefusesOthers) {
  std::vector<std::string> names;
  for (const strategy::Registration& r : strategy::registry()) {
    names.push_back(r.name);
    EXPECT_EQ(strategy::find(r.name), &r);
    EXPECT_EQ(make(r.name, setup(4))->name(), std::string(r.name));
    EXPECT_NE(strategy::help().find(r.name), std::string::npos);
  }
  EXPECT_EQ(names, (std::vector<std::string>{"ep", "hecate", "fastermoe", "smartmoe", "flexmoe", "deepspeed"}));
  EXPECT_EQ(strategy::names(), "ep, hecate, fastermoe, smartmoe, flexmoe, deepspeed");
  std::unique_ptr<strategy::Strategy> none;
  moe::Status st = strategy::make("deepspeed-typo", setup(4), &none);
  EXPECT_FALSE(st);
  EXPECT_NE(st.message().find("'deepspeed-typo' is not one of ep, hecate"), std::string::npos) << st.message();
  EXPECT_FALSE(strategy::places_experts("ep"));
  EXPECT_FALSE(strategy::places_experts("deepspeed"));
  EXPECT_FALSE(strategy::places_experts("nope"));
  EXPECT_TRUE(strategy::places_experts("smartmoe"));
}

TEST(StrategyShape, EachAsksTheGraphForItsOwnExchanges) {
  struct Want {
    const char* name;
    bool before, after, remat, padded = false;
  };
  for (const Want& w : {Want{"ep", false, false, false}, Want{"hecate", true, true, true},
                        Want{"fastermoe", false, true, false}, Want{"smartmoe", false, false, false},
                        Want{"flexmoe", true, false, false}, Want{"deepspeed", false, false, false, true}}) {
    strategy::Setup s = setup(4);
    s.options.rematerialize = true;
    moe::graph::EpStepOptions opt;
    opt.world = 4;
    make(w.name, s)->configure(&opt);
    EXPECT_EQ(opt.gather_before_gate, w.before) << w.name;
    EXPECT_EQ(opt.gather_after_gate, w.after) << w.name;
    EXPECT_EQ(opt.rematerialize, w.remat) << w.name;
    EXPECT_EQ(opt.padded_exchange, w.padded) << w.name;
  }
}

TEST(StrategyShape, ExpertParallelGroups) {
  int g = 0;
  ASSERT_TRUE(make("ep", setup(6))->ep_size(setup(6).model, 6, &g));
  EXPECT_EQ(g, 2);  // gcd(8 experts, 6 ranks): 3 data-parallel copies of 2-rank groups
  ASSERT_TRUE(make("hecate", setup(4))->ep_size(setup(4).model, 4, &g));
  EXPECT_EQ(g, 4);  // one group of every rank
  moe::Status st = make("smartmoe", setup(6))->ep_size(setup(6).model, 6, &g);
  EXPECT_FALSE(st);
  EXPECT_NE(st.message().find("must be a multiple of the ranks (6)"), std::string::npos) << st.message();
}

// [L][E] loads with expert 0 taking half of every layer's tokens.
std::vector<std::vector<int64_t>> skewed(int layers, int experts) {
  std::vector<std::vector<int64_t>> l(layers, std::vector<int64_t>(experts, 100));
  for (auto& row : l) row[0] = 100 * (experts - 1);
  return l;
}

// The attention time in which Hecate's t (Alg. 1, Eq. 1) comes to t + 1/2 experts at cost's bw.
double attention_for(int t, const strategy::CostModel& cost) {
  return (t + 0.5) * static_cast<double>(cost.expert_bytes) / cost.overlap_bandwidth;
}

TEST(StrategyDecisions, HecateReplicatesTheHotExpertItPredicts) {
  const strategy::Setup s = setup(4);
  auto h = make("hecate", s);
  const LayerPlacement owners = moe::plan::even_placement(8, 4);
  // No attention time measured yet: t = 0, nothing may be gathered behind the attention.
  for (int step = 0; step < 5; ++step) h->observe(skewed(2, 8), strategy::StepTimes{});
  std::optional<LayerPlacement> p = h->before_step(0, owners);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(h->overlap_degree(), 0);
  for (const std::vector<int>& r : p->replicas) EXPECT_EQ(r.size(), 1u);
  h->observe(skewed(2, 8), strategy::StepTimes{attention_for(4, s.cost)});
  p = h->before_step(0, owners);
  ASSERT_TRUE(p.has_value());
  EXPECT_GT(p->replicas[0].size(), 1u) << "the hot expert 0 is replicated";
  for (size_t e = 1; e < p->replicas.size(); ++e)
    EXPECT_GE(p->replicas[0].size(), p->replicas[e].size()) << "expert " << e << " has more copies than the hot one";
  EXPECT_EQ(p->owner, owners.owner) << "replicas never move an owner";
  EXPECT_EQ(h->overlap_degree(), 4);
  EXPECT_EQ(h->replica_slots(), 2);  // E / R
}

// On CPU ranks the replicas' transfers take the compute's cores, so of Alg. 1's plans for t' = 0..t
// Hecate keeps the one whose saving (the busiest rank's expert time, and the exchanges of rows the
// replicas keep home, at the links' bandwidth) beats the gather and the gradient's reduce-scatter
// together by the most, and nothing when none does.
TEST(StrategyDecisions, HecateOnCpuRanksPaysForTheGatherAndTheReduceScatter) {
  strategy::Setup s = setup(4);
  const LayerPlacement owners = moe::plan::even_placement(8, 4);
  auto planned_by = [&](const strategy::Setup& with) {
    auto h = make("hecate", with);
    h->observe(skewed(2, 8), strategy::StepTimes{attention_for(4, with.cost)});
    return h->before_step(0, owners).value();
  };
  const LayerPlacement planned = planned_by(s);  // GPU ranks: Alg. 1's plan with t = 4 as it stands
  const std::vector<int64_t> row = skewed(1, 8)[0];
  const std::vector<double> load(row.begin(), row.end());
  ASSERT_EQ(planned.replicas, moe::plan::sparse_materialize(owners, load, 4, 2, s.nodes).replicas);
  // Each t' priced once with one transfer; with n transfers at bandwidth bw its net saving is
  // saved - n * gather_bytes / bw (the saving does not depend on the weights' bandwidth).
  const double exchange = 4.0 * static_cast<double>(s.model.d_model) * 4 / s.cost.network_bandwidth;
  std::vector<LayerPlacement> plans;
  std::vector<moe::plan::Calibration> priced;
  for (int t = 0; t <= 4; ++t) {
    plans.push_back(moe::plan::sparse_materialize(owners, load, t, 2, s.nodes));
    priced.push_back(moe::plan::price_placement(owners, plans.back(), moe::plan::even_counts(load, 4), s.nodes,
                                                {s.cost.expert_seconds_per_token, s.cost.bandwidth,
                                                 s.cost.expert_bytes, 1, exchange}));
  }
  auto best_of = [&](int n, double bw) {
    LayerPlacement best = owners;
    double best_net = 0;
    for (size_t t = 0; t < plans.size(); ++t) {
      const double net = priced[t].saved_seconds - n * static_cast<double>(priced[t].gather_bytes) / bw;
      if (net > best_net) best = plans[t], best_net = net;
    }
    return best;
  };
  double nothing_pays = 1e300;  // below this bandwidth no t' saves more than two transfers take
  for (const auto& c : priced)
    if (c.gather_bytes > 0 && c.saved_seconds > 0)
      nothing_pays = std::min(nothing_pays, 2 * static_cast<double>(c.gather_bytes) / c.saved_seconds);
  ASSERT_LT(nothing_pays, 1e300);

  s.cost.transfers_take_compute = true;
  s.cost.bandwidth = 0.9 * nothing_pays;
  EXPECT_EQ(planned_by(s).replicas, owners.replicas);
  for (double factor : {1.5, 3.0, 10.0, 1000.0}) {
    s.cost.bandwidth = factor * nothing_pays;
    s.options.rematerialize = false;
    const LayerPlacement two = planned_by(s);
    EXPECT_EQ(two.replicas, best_of(2, s.cost.bandwidth).replicas) << "bandwidth x" << factor;
    EXPECT_NE(two.replicas, owners.replicas) << "bandwidth x" << factor;
    // Rematerialization gathers again for the backward: three transfers.
    s.options.rematerialize = true;
    EXPECT_EQ(planned_by(s).replicas, best_of(3, s.cost.bandwidth).replicas) << "bandwidth x" << factor;
  }
}

TEST(StrategyDecisions, HecateTakesItsOverlapDegreeFromTheInterNodeBandwidth) {
  // The paper's Alg. 1 bw is the inter-node bandwidth, not the rate one rank receives weights at.
  strategy::Setup s = setup(4);
  s.cost.bandwidth = 1e8;
  s.cost.overlap_bandwidth = 4e9;
  auto h = make("hecate", s);
  h->observe(skewed(2, 8), strategy::StepTimes{attention_for(3, s.cost)});
  h->before_step(0, moe::plan::even_placement(8, 4));
  EXPECT_EQ(h->overlap_degree(), 3);
  // A fixed --overlap-degree wins over the measured attention.
  s.options.overlap_degree = 1;
  auto fixed = make("hecate", s);
  EXPECT_EQ(fixed->overlap_degree(), 1);
  fixed->observe(skewed(2, 8), strategy::StepTimes{attention_for(3, s.cost)});
  EXPECT_EQ(fixed->overlap_degree(), 1);
}

TEST(StrategyDecisions, FasterMoeShadowsAfterTheGateOnly) {
  auto f = make("fastermoe", setup(4));
  const LayerPlacement owners = moe::plan::even_placement(8, 4);
  EXPECT_FALSE(f->before_step(0, owners).has_value());
  std::vector<std::vector<int64_t>> counts(4, std::vector<int64_t>(8, 10));
  for (auto& row : counts) row[0] = 5000;
  LayerPlacement placed;
  ASSERT_TRUE(f->after_gate(0, owners, owners, counts, &placed));
  EXPECT_EQ(placed.replicas[0].size(), 4u) << "the hot expert is broadcast to every rank";
}

TEST(StrategyDecisions, SmartMoeSwapsOnlyWhenDue) {
  strategy::Setup s = setup(2, 4);
  s.options.reshard_every = 3;
  auto m = make("smartmoe", s);
  std::vector<LayerPlacement> owners(2, moe::plan::even_placement(4, 2));  // experts 0,1 on rank 0
  std::vector<std::vector<int64_t>> hot_pair(2, std::vector<int64_t>{400, 400, 10, 10});
  for (int64_t done = 1; done <= 2; ++done) {
    m->observe(hot_pair, strategy::StepTimes{});
    EXPECT_TRUE(m->reshard(done, owners).empty()) << "step " << done << " is not a multiple of 3";
  }
  m->observe(hot_pair, strategy::StepTimes{});
  const std::vector<std::vector<int>> next = m->reshard(3, owners);
  ASSERT_EQ(next.size(), 2u);
  EXPECT_NE(next[0][0], next[0][1]) << "the two hot experts end on different ranks";
}

// 4 ranks, experts 0 and 1 (of 8) hot on rank 0: the greedy moves 6 experts, at most 2 onto one rank
// (2 x 786432 B of weights and moments), for 1200 fewer tokens on the busiest rank. Expert time is
// free (1e18 FLOP/s), so the saving is the exchanges of the rows that no longer cross to it: 2048 B
// each over the same link. On one host 3 of 4 of a rank's rows come over that link (1200 x 3/4 x
// 2048 = 1843200 B: the swap pays); on 2 hosts x 2 ranks only the 2 of 4 from the other host do
// (1228800 B: it does not).
TEST(StrategyDecisions, SmartMoePricesOnlyTheRowsThatCrossTheSlowestLink) {
  std::vector<std::vector<int64_t>> hot(2, std::vector<int64_t>{1210, 1210, 10, 10, 10, 10, 10, 10});
  const std::vector<LayerPlacement> owners(2, moe::plan::even_placement(8, 4));
  auto decide = [&](int ranks_per_node) {
    strategy::Setup s = setup(4);
    s.nodes.node_of_rank.clear();
    for (int r = 0; r < 4; ++r) s.nodes.node_of_rank.push_back(r / ranks_per_node);
    s.cost = strategy::make_cost_model(s.model, 1e9, 1e18);
    s.options.reshard_every = 1;
    auto m = make("smartmoe", s);
    m->observe(hot, strategy::StepTimes{});
    const std::vector<std::vector<int>> next = m->reshard(1, owners);
    EXPECT_EQ(next.size(), 2u);
    return next.empty() ? std::vector<int>{} : next[0];
  };
  EXPECT_NE(decide(4), owners[0].owner) << "one host: the swap pays";
  EXPECT_EQ(decide(2), owners[0].owner) << "2 hosts x 2 ranks: rows within a host cross no NIC";
}

TEST(StrategyDecisions, FlexMoeStartsFromTheOwnersAndKeepsItsPlacement) {
  auto f = make("flexmoe", setup(4));
  const LayerPlacement owners = moe::plan::even_placement(8, 4);
  std::optional<LayerPlacement> p = f->before_step(0, owners);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->replicas, owners.replicas);
  EXPECT_EQ(f->replica_slots(), 1);
  for (int64_t done = 1; done <= 3; ++done) {
    f->observe(skewed(2, 8), strategy::StepTimes{});
    const std::vector<std::vector<int>> next = f->reshard(done, {owners, owners});
    ASSERT_EQ(next.size(), 2u);
  }
  // Once it re-planned under the skew, the next step gathers its replicas of expert 0.
  p = f->before_step(0, owners);
  ASSERT_TRUE(p.has_value());
  EXPECT_GT(p->replicas[0].size(), 1u);
}

// On CPU ranks a FlexMoE replica is gathered and its gradients reduce-scattered every step on the
// compute's cores: its first expand (expert 0 onto rank 1: rank loads 800 -> 550 tokens, S = 250
// tokens' time saved a step) is priced at two transfers a step. With each transfer 3/4 S it does not
// pay; on GPU ranks the same link pays (the move, 3 transfers of weights and moments, is 2.25 S once in
// 50 steps).
// FlexMoE's planner balances L_e / r_e, an even split over an expert's replicas, so its tokens are
// dispatched that way; the others send a token to the nearest holder (Hecate's rule).
TEST(StrategyDecisions, FlexMoeSplitsAnExpertsTokensEvenlyOverItsReplicas) {
  for (const strategy::Registration& r : strategy::registry())
    EXPECT_EQ(make(r.name, setup(4))->dispatch_rule(), std::string(r.name) == "flexmoe"
                                                           ? moe::plan::DispatchRule::even
                                                           : moe::plan::DispatchRule::nearest)
        << r.name;
}

TEST(StrategyDecisions, FlexMoeOnCpuRanksPaysForEachReplicasTransfersEveryStep) {
  strategy::Setup s = setup(4);
  const LayerPlacement owners = moe::plan::even_placement(8, 4);
  const double saved = 250 * s.cost.expert_seconds_per_token;
  s.cost.bandwidth = static_cast<double>(s.cost.expert_bytes) / (0.75 * saved);
  auto planned_by = [&](const strategy::Setup& with) {
    auto f = make("flexmoe", with);
    f->before_step(0, owners);
    f->observe(skewed(2, 8), strategy::StepTimes{});
    f->reshard(1, {owners, owners});
    return f->before_step(0, owners).value();
  };
  EXPECT_GT(planned_by(s).replicas[0].size(), 1u);
  s.cost.transfers_take_compute = true;
  EXPECT_EQ(planned_by(s).replicas, owners.replicas);
}

}  // namespace

namespace {

// The trainer's side: the GEMM rate follows the measured expert ops unless --gemm-gflops gave it.
TEST(RuntimeStrategy, TheGemmRateFollowsMeasurementsUnlessGiven) {
  moe::TrainConfig cfg;
  cfg.strategy = "hecate";
  cfg.gemm_gflops = 50;
  moe::runtime::Strategy given(cfg);
  given.refresh_gemm_rate(200e9);
  EXPECT_EQ(given.cost_model().gemm_flops, 50e9);
  cfg.gemm_gflops = 0;
  moe::runtime::Strategy measured(cfg);
  const double before = measured.cost_model().gemm_flops;
  measured.refresh_gemm_rate(200e9);
  EXPECT_DOUBLE_EQ(measured.cost_model().gemm_flops, 0.8 * before + 0.2 * 200e9);
  EXPECT_DOUBLE_EQ(measured.cost_model().expert_seconds_per_token,
                   strategy::expert_flops_per_token(cfg.model) / measured.cost_model().gemm_flops);
}


// Links measured again during training fold into the cost model, and the weights' bandwidth follows
// the slowest class the ranks span, unless --link-gbs gave it.
TEST(RuntimeStrategy, LinksFollowRemeasurementsUnlessGiven) {
  moe::TrainConfig cfg;
  cfg.strategy = "hecate";
  cfg.link_gbs = 2;
  moe::runtime::Strategy given(cfg);
  const double before_given = given.cost_model().bandwidth;
  given.refresh_links({1e-5, 8e9}, {});
  EXPECT_EQ(given.cost_model().bandwidth, before_given);
  EXPECT_EQ(given.cost_model().intra_node.bandwidth, 0);
  cfg.link_gbs = 0;
  moe::runtime::Strategy measured(cfg);  // one node: the intra-node class is the one weights cross
  measured.refresh_links({1e-5, 8e9}, {});  // no figure yet: taken as measured
  EXPECT_EQ(measured.cost_model().intra_node.bandwidth, 8e9);
  measured.refresh_links({3e-5, 4e9}, {0, 0});  // a slower link; no inter-node partner (kept at 0)
  EXPECT_DOUBLE_EQ(measured.cost_model().intra_node.bandwidth, 6e9);
  EXPECT_DOUBLE_EQ(measured.cost_model().intra_node.latency, 2e-5);
  EXPECT_EQ(measured.cost_model().inter_node.bandwidth, 0);
  EXPECT_DOUBLE_EQ(measured.cost_model().bandwidth, 6e9);
  EXPECT_DOUBLE_EQ(measured.cost_model().overlap_bandwidth, 6e9);
  measured.refresh_links({0, std::nan("")}, {});  // not a figure: ignored
  EXPECT_DOUBLE_EQ(measured.cost_model().bandwidth, 6e9);
}

// The weights bandwidth follows what the steps' own sparse collectives achieved: half-way to each
// step's rate; a step that moved nothing, or --link-gbs, leaves it.
TEST(RuntimeStrategy, WeightsBandwidthFollowsTheStepsTransfersUnlessGiven) {
  moe::TrainConfig cfg;
  cfg.strategy = "hecate";
  cfg.link_gbs = 2;
  moe::runtime::Strategy given(cfg);
  given.refresh_weights_rate(1e6, 0.01);
  EXPECT_EQ(given.cost_model().bandwidth, 2e9);
  cfg.link_gbs = 0;
  moe::runtime::Strategy measured(cfg);
  measured.refresh_links({1e-5, 8e9}, {});
  measured.refresh_weights_rate(4e6, 0.002);  // 2 GB/s: half-way from 8
  EXPECT_DOUBLE_EQ(measured.cost_model().bandwidth, 5e9);
  EXPECT_DOUBLE_EQ(measured.cost_model().intra_node.bandwidth, 8e9);  // the links are kept
  EXPECT_DOUBLE_EQ(measured.cost_model().network_bandwidth, 8e9);
  measured.refresh_weights_rate(0, 0);  // nothing moved
  EXPECT_DOUBLE_EQ(measured.cost_model().bandwidth, 5e9);
  measured.refresh_weights_rate(1e6, 0.001);  // 1 GB/s
  EXPECT_DOUBLE_EQ(measured.cost_model().bandwidth, 3e9);
  measured.refresh_weights_rate(1e7, 0.001);  // 10 GB/s, faster than the fastest link: read as 8
  EXPECT_DOUBLE_EQ(measured.cost_model().bandwidth, 5.5e9);
  measured.refresh_links({1e-5, 8e9}, {});  // a link refresh starts over from the links
  EXPECT_DOUBLE_EQ(measured.cost_model().bandwidth, 8e9);
}

}  // namespace
