// The placement strategies in the simulator (src/sim/placement_costs.h) and the sparse collectives'
// rounds (collectives.h "rounds", executor.h SparseSchedule): filled sizes against the plans built
// independently here, Hecate without replicas against EP, Hecate against EP on a skewed load, the
// rounds' timing in closed form, and determinism.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "comm/sparse_collectives.h"
#include "graph/ep_builder.h"
#include "plan/placement.h"
#include "runtime/trace.h"
#include "sim/collectives.h"
#include "sim/placement_costs.h"
#include "sim/simulate.h"
#include "sim_test_clusters.h"

namespace moe::sim {
namespace {

using graph::OpKind;

ModelConfig small_model() {
  ModelConfig m;
  m.seq_len = 64;
  m.d_model = 128;
  m.n_layers = 2;
  m.n_heads = 4;
  m.d_ffn = 256;
  m.n_experts = 8;
  m.top_k = 2;
  return m;
}

// W*E chunks, chunk w*E + e held like expert e (what MoeLayer gathers), built here on its own.
comm::Placement chunks_of(const plan::LayerPlacement& p, int W) {
  comm::Placement c;
  for (int w = 0; w < W; ++w)
    for (const auto& r : p.replicas) c.push_back(r);
  return c;
}

TEST(SimStrategies, SparseOpBytesEqualThePlansPeerBytes) {
  const ModelConfig m = small_model();
  const int R = 4, E = 8, W = 2;
  graph::EpStepOptions opt;
  opt.world = opt.ep_size = R;
  opt.batch = 2;
  opt.gather_before_gate = opt.gather_after_gate = opt.rematerialize = true;
  const graph::EpStep step = graph::build_ep_step(m, opt);
  const plan::Nodes nodes{{0, 0, 1, 1}};
  const plan::LayerPlacement owners = plan::even_placement(E, R);
  // Planned: expert 0 on every rank; placed adds expert 5 on ranks 0 and 3.
  plan::LayerPlacement planned = owners, placed;
  planned.replicas[0] = {0, 1, 2, 3};
  placed = planned;
  placed.replicas[5] = {0, 2, 3};
  std::vector<std::vector<int64_t>> counts(R, std::vector<int64_t>(E, 0));
  for (int r = 0; r < R; ++r)
    for (int e = 0; e < E; ++e) counts[r][e] = (e == 0 ? 40 : 5) + r;
  std::vector<LayerStepPlacement> layers;
  for (int i = 0; i < 2; ++i) layers.push_back(layer_step_placement(m, opt, owners, planned, placed, nodes, counts));
  const int64_t chunk = m.d_ffn * m.d_model * 4;
  // The runtime's plans: topology-aware over the same nodes (each copy crosses into a node once).
  const std::vector<int>& node_of = nodes.node_of_rank;
  const comm::SparsePlan ag = comm::plan_sparse_allgather(chunks_of(owners, W), chunks_of(planned, W), R, node_of);
  const comm::SparsePlan ag2 =
      comm::plan_sparse_allgather(chunks_of(planned, W), chunks_of(placed, W), R, node_of);
  const comm::SparsePlan reag = comm::plan_sparse_allgather(chunks_of(owners, W), chunks_of(placed, W), R, node_of);
  const comm::SparsePlan rs =
      comm::plan_sparse_reduce_scatter(chunks_of(placed, W), chunks_of(owners, W), R, node_of);
  const auto rows = plan::dispatch_plan(placed, nodes, counts);
  int checked = 0;
  for (int r = 0; r < R; ++r) {
    graph::StepGraph g = step.graph;
    fill_placement_costs(m, opt, layers, r, &g);
    for (const graph::Op& op : g.ops) {
      const comm::SparsePlan* p = op.kind == OpKind::materialize           ? &ag
                                  : op.kind == OpKind::materialize_placed  ? &ag2
                                  : op.kind == OpKind::rematerialize       ? &reag
                                  : op.kind == OpKind::replica_grad_reduce ? &rs
                                                                           : nullptr;
      if (p) {
        const std::vector<int64_t> all = comm::peer_bytes(*p, chunk);
        const std::vector<int64_t> want(all.begin() + r * R, all.begin() + (r + 1) * R);
        EXPECT_EQ(op.cost.peer_bytes, want) << g.op_name(op) << " rank " << r;
        int64_t sum = 0;
        for (int64_t b : want) sum += b;
        EXPECT_EQ(op.cost.bytes, sum) << g.op_name(op);
        ++checked;
      }
      if (op.kind == OpKind::dispatch_a2a) {
        for (int d = 0; d < R; ++d) {
          int64_t n = 0;
          for (int e = 0; e < E; ++e) n += rows[r][e][d];
          EXPECT_EQ(op.cost.peer_bytes[d], 4 * m.d_model * n);
        }
      }
      if (op.kind == OpKind::expert_fwd) {
        int64_t n = 0;
        for (int s = 0; s < R; ++s)
          for (int e = 0; e < E; ++e) n += rows[s][e][r];
        EXPECT_DOUBLE_EQ(op.cost.flops, 2.0 * 2 * n * m.d_model * m.d_ffn);
      }
    }
  }
  EXPECT_EQ(checked, R * 2 * 4);  // 4 sparse ops per MoE block
  // Non-trivial: the plans move bytes (rank 1 receives expert 0's two matrices).
  EXPECT_EQ(comm::bytes_received(ag, 1, chunk), 2 * chunk);
  // Every replica's partial crosses one tree edge: expert 0's 3 extra replicas and expert 5's 2
  // (owner rank 2; replicas on 0 and 3), W matrices each.
  EXPECT_EQ(comm::total_bytes(rs, chunk), (3 + 2) * W * chunk);

  // The executor runs them by their rounds, and rejects costs that disagree with the plans.
  std::vector<graph::StepGraph> graphs(R, step.graph);
  for (int r = 0; r < R; ++r) fill_placement_costs(m, opt, layers, r, &graphs[r]);
  ClusterSpec spec;
  ASSERT_TRUE(preset_cluster("p3dn.24xlarge", 1, &spec));
  const Cluster cluster(spec);
  ExecutorConfig ec;
  ec.ranks = ec.ep_size = R;
  StepExecutor ex(cluster, ec);
  StepResult res;
  ASSERT_TRUE(ex.run_step(graphs, &res, sparse_schedules(step.graph, m, layers)));
  for (graph::Op& op : graphs[2].ops)
    if (op.kind == OpKind::materialize) op.cost.peer_bytes[0] += 1;
  const Status bad = ex.run_step(graphs, &res, sparse_schedules(step.graph, m, layers));
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.message().find("sparse plan"), std::string::npos) << bad.message();
}

double run_alone(const Cluster& cluster, const CollectiveSpec& spec) {
  Collectives colls(cluster);
  colls.start(spec);
  double end = -1;
  while (colls.in_flight() > 0) {
    const double t = colls.next_event_time();
    if (t == std::numeric_limits<double>::infinity()) break;
    for (const FinishedCollective& f : colls.advance(t)) end = f.end;
  }
  return end;
}

TEST(SimStrategies, RoundsSerialisePerMemberAndPayAlphaPerRound) {
  const double B = 10e9, alpha = 4e-6, S = 8e6;
  const Cluster c(star_spec(4, B, alpha));
  CollectiveSpec spec;
  spec.kind = CollectiveKind::rounds;
  spec.devices = {0, 1, 2, 3};
  // Member 0 sends one chunk to 1, 2, 3 in three rounds (its one blocking call per round).
  spec.rounds = {{{0, 1, S}}, {{0, 2, S}}, {{0, 3, S}}};
  EXPECT_NEAR(run_alone(c, spec), 3 * (alpha + S / B), 1e-12);
  // Forwarding: 0 -> 1, then 0 -> 2 and 1 -> 3 at once: two rounds.
  spec.rounds = {{{0, 1, S}}, {{0, 2, S}, {1, 3, S}}};
  EXPECT_NEAR(run_alone(c, spec), 2 * (alpha + S / B), 1e-12);
  // No barrier: 2 -> 3 in round 1 does not wait for round 0's 0 -> 1.
  spec.rounds = {{{0, 1, 2 * S}}, {{2, 3, S}}};
  EXPECT_NEAR(run_alone(c, spec), alpha + 2 * S / B, 1e-12);
  // The direct exchange of the same bytes (the approximation without a schedule) is faster.
  CollectiveSpec direct;
  direct.kind = CollectiveKind::alltoallv;
  direct.devices = spec.devices;
  direct.peer_bytes.assign(16, 0);
  direct.peer_bytes[1] = direct.peer_bytes[2] = direct.peer_bytes[3] = S;
  spec.rounds = {{{0, 1, S}}, {{0, 2, S}}, {{0, 3, S}}};
  EXPECT_LT(run_alone(c, direct), run_alone(c, spec));
}

SimRunConfig run_config(const std::string& strategy, const std::string& load) {
  SimRunConfig cfg;
  EXPECT_TRUE(preset_cluster("p4d.24xlarge", 1, &cfg.cluster));
  cfg.model.seq_len = 256;
  cfg.model.d_model = 512;
  cfg.model.n_layers = 2;
  cfg.model.n_heads = 8;
  cfg.model.d_ffn = 2048;
  cfg.model.n_experts = 16;
  cfg.model.top_k = 2;
  cfg.strategy = strategy;
  EXPECT_TRUE(LoadSpec::parse(load, &cfg.load));
  cfg.steps = 4;
  cfg.ranks = 8;
  cfg.ep_size = 8;
  cfg.batch = 8 * 8;
  return cfg;
}

TEST(SimStrategies, HecateWithoutReplicasTimesLikeEp) {
  // Without launch overhead the place ops Hecate adds take no time; the zero-byte sparse ops end
  // when their members arrive, inside the all-to-alls they run beside.
  SimRunConfig ep = run_config("ep", "zipf:1.2"), hec = run_config("hecate", "zipf:1.2");
  ep.cluster.node.device.launch_overhead = hec.cluster.node.device.launch_overhead = 0;
  hec.placement.replica_slots = 0;
  SimRunResult a, b;
  ASSERT_TRUE(simulate(ep, &a));
  ASSERT_TRUE(simulate(hec, &b));
  ASSERT_EQ(a.steps.size(), b.steps.size());
  for (size_t s = 0; s < a.steps.size(); ++s) {
    EXPECT_EQ(b.steps[s].placement.replicas, 0);
    EXPECT_NEAR(b.steps[s].step_ms, a.steps[s].step_ms, 1e-9 * a.steps[s].step_ms) << "step " << s;
    EXPECT_NEAR(b.steps[s].moe_ms, a.steps[s].moe_ms, 1e-9 * a.steps[s].moe_ms);
    EXPECT_NEAR(b.steps[s].mean.exposed_comm_ms, a.steps[s].mean.exposed_comm_ms, 1e-9 * a.steps[s].step_ms);
    EXPECT_NEAR(b.steps[s].mean.compute_ms, a.steps[s].mean.compute_ms, 1e-9 * a.steps[s].step_ms);
    EXPECT_EQ(b.steps[s].tokens_per_rank, a.steps[s].tokens_per_rank);
    EXPECT_EQ(b.steps[s].sparse_bytes, 0);
  }
}

TEST(SimStrategies, HecateRelievesTheBusiestRankOnASkewedLoad) {
  SimRunConfig ep = run_config("ep", "zipf:1.2"), hec = run_config("hecate", "zipf:1.2");
  hec.placement.overlap_degree = 4;  // room to replicate; m = E / R = 2 slots
  SimRunResult a, b;
  ASSERT_TRUE(simulate(ep, &a));
  ASSERT_TRUE(simulate(hec, &b));
  // From step 2 the predictor has seen the (fixed) skew.
  for (size_t s = 1; s < a.steps.size(); ++s) {
    SCOPED_TRACE(s);
    EXPECT_GT(b.steps[s].placement.replicas, 0);
    EXPECT_GT(b.steps[s].sparse_bytes, 0);
    for (size_t l = 0; l < a.steps[s].tokens_per_rank.size(); ++l) {
      const auto& ea = a.steps[s].tokens_per_rank[l];
      const auto& hb = b.steps[s].tokens_per_rank[l];
      EXPECT_LT(*std::max_element(hb.begin(), hb.end()), *std::max_element(ea.begin(), ea.end()));
    }
    EXPECT_LT(b.steps[s].moe_ms, a.steps[s].moe_ms);
  }
  // FasterMoE shadows the hot experts on every rank after the gate: fewer rows on the busiest rank too.
  SimRunResult f;
  ASSERT_TRUE(simulate(run_config("fastermoe", "zipf:1.2"), &f));
  EXPECT_GT(f.steps[0].placement.replicas, 0);
  const auto& fr = f.steps[0].tokens_per_rank[0];
  const auto& er = a.steps[0].tokens_per_rank[0];
  EXPECT_LT(*std::max_element(fr.begin(), fr.end()), *std::max_element(er.begin(), er.end()));
}

int64_t busiest(const std::vector<int64_t>& tokens_per_rank) {
  return *std::max_element(tokens_per_rank.begin(), tokens_per_rank.end());
}

TEST(SimStrategies, SmartMoeSwapsOwnersAwayFromTheHotRank) {
  // Zipf 1.2 over 16 experts, 2 per rank: EP puts the two hottest experts on rank 0. SmartMoE's
  // greedy (every step here) spreads them; no replicas, no sparse traffic.
  SimRunConfig ep = run_config("ep", "zipf:1.2"), sm = run_config("smartmoe", "zipf:1.2");
  sm.placement.reshard_every = 1;
  SimRunResult a, b;
  ASSERT_TRUE(simulate(ep, &a));
  ASSERT_TRUE(simulate(sm, &b));
  EXPECT_GT(b.steps[0].placement.experts_moved, 0) << "the first evaluation re-assigns";
  EXPECT_EQ(busiest(b.steps[0].tokens_per_rank[0]), busiest(a.steps[0].tokens_per_rank[0])) << "step 1 still as EP";
  for (size_t s = 1; s < a.steps.size(); ++s) {
    SCOPED_TRACE(s);
    EXPECT_EQ(b.steps[s].placement.replicas, 0);
    EXPECT_EQ(b.steps[s].sparse_bytes, 0);
    // Layer 1's zipf order happens to pair its hottest expert with its coldest under EP already
    // (nothing to gain: the greedy keeps it); layer 0's does not.
    for (size_t l = 0; l < a.steps[s].tokens_per_rank.size(); ++l)
      EXPECT_LE(busiest(b.steps[s].tokens_per_rank[l]), busiest(a.steps[s].tokens_per_rank[l])) << "layer " << l;
    EXPECT_LT(busiest(b.steps[s].tokens_per_rank[0]), busiest(a.steps[s].tokens_per_rank[0]));
    EXPECT_LT(b.steps[s].moe_ms, a.steps[s].moe_ms);
  }
}

TEST(SimStrategies, FlexMoeGathersItsPersistentReplicasBeforeTheGate) {
  SimRunConfig ep = run_config("ep", "zipf:1.2"), fx = run_config("flexmoe", "zipf:1.2");
  fx.placement.replica_slots = 2;
  SimRunResult a, b;
  ASSERT_TRUE(simulate(ep, &a));
  ASSERT_TRUE(simulate(fx, &b));
  EXPECT_EQ(b.steps[0].placement.replicas, 0) << "no plan before the first step's loads";
  for (size_t s = 1; s < a.steps.size(); ++s) {
    SCOPED_TRACE(s);
    EXPECT_GT(b.steps[s].placement.replicas, 0);
    EXPECT_GT(b.steps[s].sparse_bytes, 0) << "replicas are gathered (and their gradients reduced) every step";
    for (size_t l = 0; l < a.steps[s].tokens_per_rank.size(); ++l)
      EXPECT_LT(busiest(b.steps[s].tokens_per_rank[l]), busiest(a.steps[s].tokens_per_rank[l]));
  }
}

TEST(SimStrategies, HecateReshardsWithAlg2EveryNSteps) {
  SimRunConfig cfg = run_config("hecate", "zipf:1.2");
  cfg.placement.overlap_degree = 2;
  cfg.placement.reshard_every = 2;
  SimRunResult r;
  ASSERT_TRUE(simulate(cfg, &r));
  ASSERT_EQ(r.steps.size(), 4u);
  EXPECT_EQ(r.steps[0].placement.experts_moved, 0);
  EXPECT_GT(r.steps[1].placement.experts_moved, 0) << "Alg. 2 after step 2 moves the hot experts apart";
  EXPECT_EQ(r.steps[2].placement.experts_moved, 0);
  cfg.placement.reshard_every = 0;
  ASSERT_TRUE(simulate(cfg, &r));
  for (const auto& s : r.steps) EXPECT_EQ(s.placement.experts_moved, 0) << "0: never";
}

// As the trainer's: the planners start from the cluster's weights bandwidth and, after each step,
// move half-way to the rate that step's sparse collectives achieved (bytes sent over the time of the
// ops that sent them, all ranks; summed here from the trace); --link-gbs keeps it.
TEST(SimStrategies, WeightsBandwidthFollowsTheSimulatedTransfers) {
  // Two ranks, so that what one rank sends in a sparse op is what the other receives: the trace
  // (sent bytes and times per rank and op) then says everything runtime::weight_transfers reads.
  SimRunConfig cfg = run_config("hecate", "zipf:1.2");
  cfg.ranks = cfg.ep_size = 2;
  cfg.batch = 16;
  cfg.steps = 6;
  cfg.placement.overlap_degree = 4;
  cfg.keep_trace = true;
  SimRunResult r;
  ASSERT_TRUE(simulate(cfg, &r));
  EXPECT_DOUBLE_EQ(r.steps[0].placement.weights_gbs, placement_bandwidth(Cluster(cfg.cluster)) / 1e9);
  int moved = 0;
  for (size_t s = 0; s + 1 < r.steps.size(); ++s) {
    std::map<int64_t, std::array<const runtime::TraceRecord*, 2>> by_op;  // the step's sparse ops
    for (const runtime::TraceRecord& rec : r.trace) {
      const graph::Op& op = r.graph.ops.at(rec.op);
      if (rec.step == static_cast<int64_t>(s) + 1 && (op.collective == graph::Collective::sparse_allgather ||
                                                      op.collective == graph::Collective::sparse_reduce_scatter))
        by_op[rec.op][rec.rank] = &rec;
    }
    double bytes = 0, seconds = 0;
    for (const auto& [op, ranks] : by_op) {
      ASSERT_TRUE(ranks[0] && ranks[1]) << "op " << op << " of step " << s + 1 << " ran on one rank only";
      const double sent = static_cast<double>(ranks[0]->bytes + ranks[1]->bytes);
      double rate = 0;
      for (int me : {0, 1}) {
        const double moved_here = static_cast<double>(std::max(ranks[me]->bytes, ranks[1 - me]->bytes));
        const double t = 1e-9 * static_cast<double>(ranks[me]->end_ns - ranks[me]->start_ns);
        if (moved_here > 0 && t > 0) rate = std::max(rate, moved_here / t);
      }
      if (sent > 0 && rate > 0) bytes += sent, seconds += sent / rate;
    }
    const double before = r.steps[s].placement.weights_gbs;
    const double expected = bytes > 0 ? 0.5 * before + 0.5 * bytes / seconds / 1e9 : before;
    EXPECT_NEAR(r.steps[s + 1].placement.weights_gbs, expected, 1e-6 * expected) << "after step " << s + 1;
    moved += bytes > 0;
  }
  EXPECT_GT(moved, 0) << "no step moved weights: nothing was checked";
  cfg.placement.link_gbs = 3;
  ASSERT_TRUE(simulate(cfg, &r));
  for (const auto& s : r.steps) EXPECT_EQ(s.placement.weights_gbs, 3);
  // A replayed run's start-up figure: the first step is priced at it, then the rate follows the steps.
  cfg.placement.link_gbs = 0;
  cfg.placement.measured_link_gbs = 3;
  ASSERT_TRUE(simulate(cfg, &r));
  EXPECT_EQ(r.steps[0].placement.weights_gbs, 3);
  bool followed = false;
  for (const auto& s : r.steps) followed = followed || s.placement.weights_gbs != 3;
  EXPECT_TRUE(followed) << "the weights rate stayed at the start-up figure";
}

std::string trace_text(const SimRunResult& r) {
  const std::string path = ::testing::TempDir() + "sim_strategies_trace.json";
  EXPECT_TRUE(runtime::write_chrome_trace(path, r.graph, r.trace, r.ranks));
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::remove(path.c_str());
  return ss.str();
}

// A calibrated CPU cluster's planners see the ranks that share cores as the trainer finds them there.
TEST(SimStrategies, CpuClustersGiveThePlannersTheirCorePools) {
  ClusterSpec c;
  EXPECT_TRUE(sim_core_pools(c, {0, 0, 1, 1}).empty());  // devices: nothing shared
  c.cpu_cores = 2, c.cpu_threads_per_device = 1, c.cpu_nodes_pinned = true;
  plan::CorePools p = sim_core_pools(c, {0, 0, 1, 1});  // 2 emulated hosts of one core, 2 ranks each
  EXPECT_EQ(p.pool_of_rank, (std::vector<int>{0, 0, 1, 1}));
  EXPECT_EQ(p.ranks_at_once, (std::vector<double>{1, 1}));
  EXPECT_TRUE(sim_core_pools(c, {0, 1}).empty());  // a core each
  c.cpu_nodes_pinned = false;
  p = sim_core_pools(c, {0, 0, 1, 1});  // all 4 ranks on both cores
  EXPECT_EQ(p.pool_of_rank, (std::vector<int>{0, 0, 0, 0}));
  EXPECT_EQ(p.ranks_at_once, (std::vector<double>{2}));
}

TEST(SimStrategies, Deterministic) {
  for (bool remat : {false, true}) {
    SimRunConfig cfg = run_config("hecate", "zipf-drift:1.0,0.5");
    cfg.placement.overlap_degree = 3;
    cfg.placement.rematerialize = remat;
    cfg.keep_trace = true;
    SimRunResult a, b;
    ASSERT_TRUE(simulate(cfg, &a));
    ASSERT_TRUE(simulate(cfg, &b));
    ASSERT_EQ(a.steps.size(), b.steps.size());
    for (size_t s = 0; s < a.steps.size(); ++s) {
      EXPECT_EQ(a.steps[s].step_ms, b.steps[s].step_ms);
      EXPECT_EQ(a.steps[s].moe_ms_per_rank, b.steps[s].moe_ms_per_rank);
      EXPECT_EQ(a.steps[s].sparse_bytes, b.steps[s].sparse_bytes);
    }
    const std::string ta = trace_text(a);
    EXPECT_GT(ta.size(), 1000u);
    EXPECT_EQ(ta, trace_text(b));
  }
}

TEST(SimStrategies, RejectsWhatThePlacementStrategiesCannotRun) {
  SimRunConfig cfg = run_config("hecate", "uniform");
  cfg.ep_size = 4;  // two ep groups
  SimRunResult r;
  const Status s = simulate(cfg, &r);
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find("ep-size"), std::string::npos) << s.message();
  cfg = run_config("fastermoe", "uniform");
  cfg.model.n_experts = 12;  // not a multiple of 8 ranks
  cfg.ep_size = 0;
  const Status s2 = simulate(cfg, &r);
  ASSERT_FALSE(s2);
}

}  // namespace
}  // namespace moe::sim
