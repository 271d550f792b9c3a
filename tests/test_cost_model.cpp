// mpirun-ranks: 2
// The trainer's measured cost model (runtime/measure_costs.h): the alpha-beta fit recovers known
// links from synthetic timings; ranks that measured different figures agree on one set, bit for bit,
// and so plan identically (invariant 2, docs/architecture.md); a real measurement over the world gives a link the
// ranks share.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "mpi_test_env.h"
#include "plan/placement.h"
#include "runtime/measure_costs.h"
#include "strategy/strategy.h"

namespace moe::runtime {
namespace {

const ::testing::Environment* const g_env =
    ::testing::AddGlobalTestEnvironment(new comm::MpiTestEnvironment({comm::kWorldSize}));

comm::Communicator& world() { return *comm::g_world; }

// Samples of t = latency + bytes / bandwidth, each time scaled by 1 + noise[i].
std::vector<LinkSample> synthetic(double latency, double bandwidth, const std::vector<double>& noise) {
  const int64_t sizes[] = {8 << 10, 128 << 10, 1 << 20, 4 << 20};
  std::vector<LinkSample> out;
  for (size_t i = 0; i < noise.size(); ++i) {
    const int64_t b = sizes[i % 4];
    out.push_back({b, (latency + static_cast<double>(b) / bandwidth) * (1 + noise[i])});
  }
  return out;
}

TEST(CostModelFit, RecoversAKnownAlphaBeta) {
  struct Case {
    double latency, bandwidth;
  };
  for (const Case c : {Case{60e-6, 0.118e9}, Case{4e-6, 9.8e9}, Case{0, 1.25e9}}) {
    strategy::LinkCost fit;
    ASSERT_TRUE(fit_link_cost(synthetic(c.latency, c.bandwidth, {0, 0, 0, 0}), &fit).is_ok());
    EXPECT_NEAR(fit.bandwidth, c.bandwidth, 1e-9 * c.bandwidth);
    EXPECT_NEAR(fit.latency, c.latency, 1e-12);
    // 2% noise, repeated sizes: within a few percent of the truth.
    ASSERT_TRUE(
        fit_link_cost(synthetic(c.latency, c.bandwidth, {0.02, -0.01, 0.015, -0.02, -0.02, 0.01, -0.015, 0.02}), &fit)
            .is_ok());
    EXPECT_NEAR(fit.bandwidth, c.bandwidth, 0.05 * c.bandwidth);
    EXPECT_GE(fit.latency, 0);
  }
}

TEST(CostModelFit, RefusesWhatCannotBeFitted) {
  strategy::LinkCost fit;
  EXPECT_FALSE(fit_link_cost({{1 << 20, 0.01}, {1 << 20, 0.011}}, &fit).is_ok()) << "one size";
  EXPECT_FALSE(fit_link_cost({{1 << 10, 0.01}, {1 << 20, 0.001}}, &fit).is_ok()) << "time falls with size";
  EXPECT_FALSE(fit_link_cost({{1 << 10, 0.0}, {1 << 20, 0.001}}, &fit).is_ok()) << "a zero time";
}

TEST(CostModelAgreement, RanksWithDifferentMeasurementsPlanIdentically) {
  const int me = world().rank(), R = world().size();
  // Every rank measured something else; rank 1 had no intra-node partner.
  RawCosts mine;
  mine.intra_node = me == 1 ? strategy::LinkCost{} : strategy::LinkCost{4e-6 * (1 + me), 9e9 + 1e8 * me};
  mine.inter_node = {60e-6 + 1e-6 * me, 0.118e9 * (1 + 0.1 * me)};
  mine.gemm_flops = 100e9 + 7e9 * me;
  RawCosts agreed;
  ASSERT_TRUE(agree_costs(&world(), mine, &agreed).is_ok());
  // The mean over the ranks that measured each figure.
  double inter = 0, gemm = 0;
  for (int r = 0; r < R; ++r) inter += 0.118e9 * (1 + 0.1 * r), gemm += 100e9 + 7e9 * r;
  EXPECT_NEAR(agreed.inter_node.bandwidth, inter / R, 1e-6 * inter / R);
  EXPECT_NEAR(agreed.gemm_flops, gemm / R, 1e-6 * gemm / R);
  EXPECT_GT(agreed.intra_node.bandwidth, 0) << "rank 0 measured it";

  // The planners on every rank from the agreed figures: the same bits, the same plan.
  ModelConfig model;
  model.n_layers = 2;
  model.n_experts = 8;
  plan::Nodes nodes;
  for (int r = 0; r < R; ++r) nodes.node_of_rank.push_back(r);
  strategy::Setup s;
  s.model = model;
  s.world = R;
  s.nodes = nodes;
  s.cost = cost_model_from(model, agreed, nodes, 0, 0);
  std::unique_ptr<strategy::Strategy> hecate;
  ASSERT_TRUE(strategy::make("hecate", s, &hecate).is_ok());
  std::vector<std::vector<int64_t>> loads(2, std::vector<int64_t>{4000, 900, 800, 100, 100, 50, 30, 20});
  // An attention time that lands t near a boundary, as measured times do.
  const double attention = 2.5 * static_cast<double>(s.cost.expert_bytes) / s.cost.overlap_bandwidth;
  hecate->observe(loads, strategy::StepTimes{attention});
  const plan::LayerPlacement p = hecate->before_step(0, plan::even_placement(8, R)).value();
  std::vector<int64_t> plan_here;
  plan_here.push_back(hecate->overlap_degree());
  for (const std::vector<int>& holders : p.replicas) {
    plan_here.push_back(static_cast<int64_t>(holders.size()));
    for (int h : holders) plan_here.push_back(h);
  }
  double figures[4] = {s.cost.bandwidth, s.cost.overlap_bandwidth, s.cost.gemm_flops, s.cost.expert_seconds_per_token};
  int64_t bits[4];
  std::memcpy(bits, figures, sizeof bits);
  plan_here.insert(plan_here.end(), bits, bits + 4);
  const int64_t n = static_cast<int64_t>(plan_here.size());
  std::vector<int64_t> sizes(R), all(n * R);
  ASSERT_TRUE(world().allgather(&n, 1, sizes.data()).is_ok());
  for (int r = 0; r < R; ++r) ASSERT_EQ(sizes[r], n) << "rank " << r << " planned another number of replicas";
  ASSERT_TRUE(world().allgather(plan_here.data(), n, all.data()).is_ok());
  for (int r = 0; r < R; ++r)
    for (int64_t i = 0; i < n; ++i) EXPECT_EQ(all[r * n + i], all[i]) << "rank " << r << " differs at entry " << i;
}

TEST(CostModelMeasurement, GivesEveryRankTheSameLinkAndGemmRate) {
  const int R = world().size();
  plan::Nodes nodes;  // every rank its own node: the exchanges pair them across "hosts"
  for (int r = 0; r < R; ++r) nodes.node_of_rank.push_back(r);
  ModelConfig model;
  model.d_model = 64;
  model.d_ffn = 128;
  RawCosts mine, agreed;
  ASSERT_TRUE(measure_costs(&world(), nodes, model, 64, &mine).is_ok());
  EXPECT_GT(mine.gemm_flops, 0);
  EXPECT_EQ(mine.intra_node.bandwidth, 0) << "no rank shares a node";
  if (world().rank() < R - R % 2) {
    EXPECT_GT(mine.inter_node.bandwidth, 0);
    EXPECT_GE(mine.inter_node.latency, 0);
  }
  ASSERT_TRUE(agree_costs(&world(), mine, &agreed).is_ok());
  double got[2] = {agreed.inter_node.bandwidth, agreed.gemm_flops}, rank0[2] = {got[0], got[1]};
  ASSERT_TRUE(world().broadcast(rank0, 2, 0).is_ok());
  EXPECT_EQ(got[0], rank0[0]);
  EXPECT_EQ(got[1], rank0[1]);
  const strategy::CostModel c = cost_model_from(model, agreed, nodes, 0, 0);
  EXPECT_EQ(c.bandwidth, agreed.inter_node.bandwidth) << "weights arrive across hosts";
  EXPECT_EQ(c.overlap_bandwidth, c.bandwidth);
  const strategy::CostModel forced = cost_model_from(model, agreed, nodes, 2.5, 50);
  EXPECT_EQ(forced.bandwidth, 2.5e9);
  EXPECT_EQ(forced.gemm_flops, 50e9);
}

}  // namespace
}  // namespace moe::runtime
