// The simulator's StepGraph executor (src/sim/executor.h): the runtime's semantics (FIFO streams,
// dependencies, priority gating, collectives that start when their last member arrives), closed forms
// through the executor, contention between lanes, determinism of the trace, and the EP graph.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "graph/ep_builder.h"
#include "runtime/trace.h"
#include "sim/executor.h"
#include "sim/load.h"
#include "sim_test_clusters.h"

namespace moe::sim {
namespace {

using graph::Collective;
using graph::Group;
using graph::Op;
using graph::OpKind;
using graph::StepGraph;

// A device that computes 1e14 FLOP/s at any size, no launch overhead: flops / 1e14 seconds.
DeviceSpec unit_device() { return test_device(1e15); }

// Two nodes of one device each, one NIC per node of bandwidth B: both ranks' traffic crosses it.
ClusterSpec two_nodes_one_nic(double B) {
  ClusterSpec c = node_spec(1, unit_device());
  c.nodes = 2;
  c.node.nic_switch = {0};
  c.node.nic_pcie = {1e12, 0};
  c.node.nic_port = {B, 0};
  return c;
}

int compute(StepGraph& g, double flops, std::vector<int> deps = {}) {
  Op op;
  op.kind = OpKind::custom;
  op.cost.flops = flops;
  op.deps = std::move(deps);
  return g.add(op);
}

int comm(StepGraph& g, int stream, Collective c, Group grp, int priority, std::vector<int> deps, int64_t bytes,
         std::vector<int64_t> peer = {}) {
  Op op;
  op.kind = OpKind::custom_comm;
  op.collective = c;
  op.group = grp;
  op.stream = stream;
  op.priority = priority;
  op.deps = std::move(deps);
  op.cost.bytes = bytes;
  op.cost.peer_bytes = std::move(peer);
  return g.add(op);
}

double start_s(const StepResult& r, int rank, int op) { return r.timelines[rank].spans[op].start_ns * 1e-9; }
double end_s(const StepResult& r, int rank, int op) { return r.timelines[rank].spans[op].end_ns * 1e-9; }

StepResult run(const Cluster& cluster, const std::vector<StepGraph>& graphs, ExecutorConfig cfg = {}) {
  cfg.ranks = static_cast<int>(graphs.size());
  if (cfg.ep_size == 0) cfg.ep_size = 1;
  StepExecutor ex(cluster, cfg);
  StepResult r;
  Status s = ex.run_step(graphs, &r);
  EXPECT_TRUE(s) << s.message();
  return r;
}

constexpr double kNs = 2e-9;  // timelines are whole nanoseconds

// FIFO and dependencies on one rank's compute stream and a lane; a collective starts its transfers only
// when its last member reaches it, while each member's op runs from the moment it reached it.
TEST(SimExecutor, FifoDepsAndCollectivesWaitForTheLastMember) {
  const double B = 1e9;
  const Cluster cluster(star_spec(2, B, 0, unit_device()));
  std::vector<StepGraph> g(2);
  for (int r = 0; r < 2; ++r) {
    g[r].add_stream("a2a", true);
    const int c0 = compute(g[r], r == 0 ? 1e14 : 3e14);                              // 1 s on rank 0, 3 s on rank 1
    const int x = comm(g[r], 1, Collective::alltoallv, Group::world, 0, {c0}, 1000000000, {0, 1000000000});
    if (r == 1) g[r].ops[x].cost.peer_bytes = {1000000000, 0};
    compute(g[r], 0.5e14);                                                           // FIFO behind c0
    compute(g[r], 1e14, {x});                                                        // after the exchange
  }
  const StepResult res = run(cluster, g);
  // rank 0 reaches the exchange at 1 s, rank 1 at 3 s; 1 GB each way at 1 GB/s: ends at 4 s.
  EXPECT_NEAR(start_s(res, 0, 1), 1.0, kNs);
  EXPECT_NEAR(start_s(res, 1, 1), 3.0, kNs);
  EXPECT_NEAR(end_s(res, 0, 1), 4.0, kNs);
  EXPECT_NEAR(end_s(res, 1, 1), 4.0, kNs);
  EXPECT_NEAR(start_s(res, 0, 2), 1.0, kNs);  // after its stream predecessor, not the exchange
  EXPECT_NEAR(end_s(res, 0, 2), 1.5, kNs);
  EXPECT_NEAR(start_s(res, 0, 3), 4.0, kNs);  // waits for its dependency
  EXPECT_NEAR(start_s(res, 1, 2), 3.0, kNs);
  EXPECT_NEAR(start_s(res, 1, 3), 4.0, kNs);
  EXPECT_NEAR(res.seconds(), 5.0, kNs);
  // Critical path: rank 1's first op 3 s, the exchange 1 s (from rank 1's arrival), then 1 s of compute.
  double compute_s = 0, a2a_s = 0, total = 0;
  for (const auto& [cat, s] : res.critical_path_s) {
    total += s;
    if (cat == "compute") compute_s = s;
    if (cat == "other comm") a2a_s = s;
  }
  EXPECT_NEAR(total, res.seconds(), 1e-12);
  EXPECT_NEAR(compute_s, 4.0, 1e-9);
  EXPECT_NEAR(a2a_s, 1.0, 1e-9);
}

// A cluster that sends eagerly (ClusterSpec::eager_bytes): an alltoallv between nodes starts with its
// first member. Rank 0 reaches it at 1 s, rank 1 at 3 s; 0.5 GB each way at 1 GB/s.
TEST(SimExecutor, AnEagerAlltoallStartsWithItsFirstMember) {
  const double B = 1e9, S = 0.5e9;
  auto exchange = [&](double eager_bytes) {
    ClusterSpec spec = two_nodes_one_nic(B);
    spec.eager_bytes = eager_bytes;
    const Cluster cluster(spec);
    std::vector<StepGraph> g(2);
    for (int r = 0; r < 2; ++r) {
      g[r].add_stream("a2a", true);
      const int c0 = compute(g[r], r == 0 ? 1e14 : 3e14);
      std::vector<int64_t> peer(2, static_cast<int64_t>(S));
      peer[r] = 0;
      comm(g[r], 1, Collective::alltoallv, Group::world, 0, {c0}, static_cast<int64_t>(S), peer);
    }
    return run(cluster, g);
  };
  // Eager: rank 0's bytes leave at 1 s and have arrived at 1.5 s; rank 1's send is done when it
  // reaches the exchange, which ends there at 3 s; rank 0's at 3.5 s, when rank 1's bytes arrived.
  const StepResult eager = exchange(S);
  EXPECT_NEAR(start_s(eager, 0, 1), 1.0, kNs);
  EXPECT_NEAR(end_s(eager, 1, 1), 3.0, kNs);
  EXPECT_NEAR(end_s(eager, 0, 1), 3.5, kNs);
  double total = 0;
  for (const auto& [cat, sec] : eager.critical_path_s) {
    EXPECT_GE(sec, 0) << cat;
    total += sec;
  }
  EXPECT_NEAR(total, eager.seconds(), 1e-12);
  // Messages above the limit, or no eager sends: every byte waits for rank 1; both end at 3.5 s.
  for (double limit : {S / 2, 0.0}) {
    const StepResult waits = exchange(limit);
    EXPECT_NEAR(end_s(waits, 1, 1), 3.5, kNs) << limit;
    EXPECT_NEAR(end_s(waits, 0, 1), 3.5, kNs) << limit;
  }
}

// CPU ranks sharing cores (ClusterSpec::cpu_cores): the compute ops running at a time split the cores
// (processor sharing); a rank waiting in a collective takes no share.
TEST(SimExecutor, CpuRanksShareTheCoresAmongRunningComputeOps) {
  ClusterSpec spec = star_spec(3, 1e9, 0, unit_device());
  std::vector<StepGraph> g(3);
  for (int r = 0; r < 3; ++r) compute(g[r], r == 2 ? 2e14 : 1e14);  // alone: 1 s, 1 s, 2 s
  {
    const StepResult res = run(Cluster(spec), g);  // accelerators: no sharing
    EXPECT_NEAR(end_s(res, 0, 0), 1.0, kNs);
    EXPECT_NEAR(end_s(res, 2, 0), 2.0, kNs);
  }
  spec.cpu_cores = 2;
  {
    // Three ops on two cores at 2/3 speed: ranks 0 and 1 end at 1.5 s, when rank 2 has 1 s of work
    // left, which it then runs alone.
    const StepResult res = run(Cluster(spec), g);
    EXPECT_NEAR(end_s(res, 0, 0), 1.5, kNs);
    EXPECT_NEAR(end_s(res, 1, 0), 1.5, kNs);
    EXPECT_NEAR(end_s(res, 2, 0), 2.5, kNs);
  }
  spec.cpu_threads_per_device = 2;
  {
    // Six threads on two cores: 1/3 speed until 3 s, then rank 2 alone (2 threads, 2 cores) for 1 s.
    const StepResult res = run(Cluster(spec), g);
    EXPECT_NEAR(end_s(res, 0, 0), 3.0, kNs);
    EXPECT_NEAR(end_s(res, 2, 0), 4.0, kNs);
  }
  // A rank waiting in an exchange leaves the cores to the others: rank 0 reaches it at once and waits
  // for rank 1 (2 s alone); ranks 1 and 2 share one core until rank 1 reaches it.
  spec.cpu_cores = 1;
  spec.cpu_threads_per_device = 1;
  std::vector<StepGraph> w(3);
  for (int r = 0; r < 3; ++r) {
    w[r].add_stream("a2a", true);
    const int c = compute(w[r], r == 0 ? 0 : 1e14);
    comm(w[r], 1, Collective::alltoallv, Group::world, 0, {c}, 0, {0, 0, 0});
  }
  const StepResult res = run(Cluster(spec), w);
  EXPECT_NEAR(end_s(res, 1, 0), 2.0, kNs);  // 1 s alone at half speed
  EXPECT_NEAR(end_s(res, 2, 0), 2.0, kNs);
  EXPECT_NEAR(end_s(res, 0, 1), 2.0, kNs);  // the empty exchange ends when its last member arrives
}

// An op runs at its kind's speed (DeviceSpec::op_kind_speed); kinds the device does not list at 1.
TEST(SimExecutor, ComputeOpsRunAtTheirKindsSpeed) {
  DeviceSpec device = unit_device();
  device.op_kind_speed["attn_fwd"] = 0.25;
  ClusterSpec spec = star_spec(1, 1e9, 0, device);
  std::vector<StepGraph> g(1);
  const int attn = compute(g[0], 1e14);  // 1 s alone at speed 1
  g[0].ops[attn].kind = OpKind::attn_fwd;
  compute(g[0], 1e14, {attn});  // custom: not listed
  const StepResult res = run(Cluster(spec), g);
  EXPECT_NEAR(end_s(res, 0, 0), 4.0, kNs);  // 1 s at full speed, 4 s at a quarter
  EXPECT_NEAR(end_s(res, 0, 1), 5.0, kNs);
}

// With op_time_quantiles, every compute op takes its modeled time times a factor drawn per step, rank
// and op from the table: with {0.5, 2} (entries at the quantiles 1/4 and 3/4, linear between) a 1 s
// op takes 0.5-2 s. The two ranks draw apart, the exchange that follows waits for the slower, so the
// step is the longer rank's op; the same inputs give the same steps; a table of ones is no table.
TEST(SimExecutor, OpTimesVaryByTheDevicesMeasuredSpreadAndTheExchangeWaitsForTheSlowerRank) {
  DeviceSpec device = unit_device();
  device.op_time_quantiles = {0.5, 2.0};
  ClusterSpec spec = star_spec(2, 1e9, 0, device);
  std::vector<StepGraph> g(2);
  for (int r = 0; r < 2; ++r) {
    g[r].add_stream("a2a", true);
    const int c = compute(g[r], 1e14);  // 1 s at the modeled rate
    comm(g[r], 1, Collective::allreduce, Group::world, 0, {c}, 0);
  }
  ExecutorConfig cfg;
  cfg.ranks = 2;
  cfg.ep_size = 1;
  const Cluster cluster(spec);
  StepExecutor a(cluster, cfg), b(cluster, cfg);
  int differ = 0, slow = 0;
  double sum = 0;
  const int steps = 200;
  for (int step = 0; step < steps; ++step) {
    StepResult ra, rb;
    ASSERT_TRUE(a.run_step(g, &ra));
    ASSERT_TRUE(b.run_step(g, &rb));
    double longest = 0;
    for (int r = 0; r < 2; ++r) {
      const double t = end_s(ra, r, 0) - start_s(ra, r, 0);
      EXPECT_GE(t, 0.5 - kNs);
      EXPECT_LE(t, 2.0 + kNs);
      EXPECT_EQ(ra.timelines[r].spans[0].end_ns, rb.timelines[r].spans[0].end_ns);  // deterministic
      longest = std::max(longest, t);
      sum += t;
      slow += t > 1.0;
    }
    differ += std::abs((end_s(ra, 0, 0) - start_s(ra, 0, 0)) - (end_s(ra, 1, 0) - start_s(ra, 1, 0))) > 1e-3;
    EXPECT_NEAR(ra.seconds(), longest, 1e-6);  // the allreduce of 0 bytes ends when the slower arrives
  }
  EXPECT_GT(differ, steps / 2);
  // The factor is 0.5 below u = 1/4, 2 above 3/4, 0.5 + 1.5 (u - 1/4) / (1/2) between: half the
  // draws above 1 and a mean of 1.25 (0.25 x 0.5 + 0.5 x 1.25 + 0.25 x 2).
  EXPECT_NEAR(static_cast<double>(slow) / (2 * steps), 0.5, 0.08);
  EXPECT_NEAR(sum / (2 * steps), 1.25, 0.08);

  device.op_time_quantiles = {1.0, 1.0, 1.0};
  const StepResult ones = run(Cluster(star_spec(2, 1e9, 0, device)), g);
  device.op_time_quantiles.clear();
  const StepResult none = run(Cluster(star_spec(2, 1e9, 0, device)), g);
  EXPECT_EQ(ones.timelines[0].spans[0].end_ns, none.timelines[0].spans[0].end_ns);
  EXPECT_NEAR(none.seconds(), 1.0, kNs);
}

// Two ranks: a compute op of `flops` on rank 0 (none on rank 1) and, ready at once, an exchange of
// 1 GB each way on lane 1.
std::vector<StepGraph> exchange_beside_compute(double flops) {
  std::vector<StepGraph> g(2);
  for (int r = 0; r < 2; ++r) {
    g[r].add_stream("a2a", true);
    compute(g[r], r == 0 ? flops : 0);
    std::vector<int64_t> peer(2, 1000000000);
    peer[r] = 0;
    comm(g[r], 1, Collective::alltoallv, Group::world, 0, {}, 1000000000, peer);
  }
  return g;
}

// CPU ranks' lanes get the cores compute leaves: an exchange ready at 0 waits while rank 0 computes
// on the only core, then both lanes share it (each device link at half its bandwidth).
TEST(SimExecutor, CpuLanesMoveDataOnTheCoresComputeLeaves) {
  ClusterSpec spec = star_spec(2, 1e9, 0, unit_device());
  const std::vector<StepGraph> g = exchange_beside_compute(1e14);  // 1 s on rank 0
  {
    const StepResult res = run(Cluster(spec), g);  // accelerators: the exchange beside the compute
    EXPECT_NEAR(end_s(res, 0, 1), 1.0, kNs);
  }
  spec.cpu_cores = 1;
  const Cluster cluster(spec);
  const StepResult res = run(cluster, g);
  EXPECT_NEAR(end_s(res, 0, 0), 1.0, kNs);  // the lanes take no share from compute
  EXPECT_NEAR(end_s(res, 0, 1), 3.0, kNs);  // 1 GB at 0.5 GB/s from 1 s
  EXPECT_NEAR(end_s(res, 1, 1), 3.0, kNs);
  // With 2 cores the lanes of rank 1 and rank 0 get the core compute leaves: one lane each would need
  // 2, one is free: half speed while rank 0 computes, then full: 0.5 GB by 1 s, the rest in 0.5 s.
  spec.cpu_cores = 2;
  const StepResult two = run(Cluster(spec), g);
  EXPECT_NEAR(end_s(two, 0, 1), 1.5, kNs);
}

// Between hosts the lanes' transfers are CPU work that shares the cores with compute, thread for
// thread (the kernel's TCP path runs beside the compute; executor.h): an exchange of 1 GB each way
// through 1 GB/s device links (1 s alone; the NICs far faster) beside 0.5 s of compute on rank 0.
TEST(SimExecutor, CpuLanesMovingDataBetweenHostsShareTheCoresWithCompute) {
  ClusterSpec spec = two_nodes_one_nic(1e12);
  spec.node.device_pcie = {1e9, 0};
  const std::vector<StepGraph> g = exchange_beside_compute(0.5e14);  // 0.5 s on rank 0
  {
    const StepResult res = run(Cluster(spec), g);  // accelerators: the exchange beside the compute
    EXPECT_NEAR(end_s(res, 0, 0), 0.5, kNs);
    EXPECT_NEAR(end_s(res, 0, 1), 1.0, kNs);
  }
  spec.cpu_cores = 1;
  const StepResult one = run(Cluster(spec), g);
  // One compute thread and two lanes on one core, 1/3 each: the compute ends at 1.5 s, when 0.5 GB
  // has moved; then the two lanes at 1/2: 0.5 GB at 0.5 GB/s.
  EXPECT_NEAR(end_s(one, 0, 0), 1.5, kNs);
  EXPECT_NEAR(end_s(one, 0, 1), 2.5, kNs);
  EXPECT_NEAR(end_s(one, 1, 1), 2.5, kNs);
  // On two cores 2/3 each: compute ends at 0.75 s with 0.5 GB moved, the rest at full speed.
  spec.cpu_cores = 2;
  const StepResult two = run(Cluster(spec), g);
  EXPECT_NEAR(end_s(two, 0, 0), 0.75, kNs);
  EXPECT_NEAR(end_s(two, 0, 1), 1.25, kNs);
  // A NIC keeps its bandwidth: through 1 GB/s NICs (fast device links) the exchange still ends at
  // 1 s on one core; the compute, at 1/3 until then (1/3 s of work done), then alone: 1 + (0.5 - 1/3).
  ClusterSpec nic = two_nodes_one_nic(1e9);
  nic.cpu_cores = 1;
  const StepResult capped = run(Cluster(nic), g);
  EXPECT_NEAR(end_s(capped, 0, 1), 1.0, kNs);
  EXPECT_NEAR(end_s(capped, 0, 0), 1.0 + (0.5 - 1.0 / 3), kNs);
}

// A lane between hosts counts as cpu_threads_per_transfer threads (measured by bench transfer-cpu).
// One core, the exchange above beside 0.5 s of compute: with w = 2 the demand is 1 + 2 x 2, so 1/5 each
// until the compute ends at 2.5 s (0.5 GB moved), then 1/4 for the lanes: 0.5 GB at 0.25 GB/s, 4.5 s.
// With w = 0 a transfer takes nothing: the compute ends at 0.5 s and the exchange at 1 s.
TEST(SimExecutor, ATransferBetweenHostsCountsAsItsMeasuredThreads) {
  ClusterSpec spec = two_nodes_one_nic(1e12);
  spec.node.device_pcie = {1e9, 0};
  spec.cpu_cores = 1;
  const std::vector<StepGraph> g = exchange_beside_compute(0.5e14);
  spec.cpu_threads_per_transfer = 2;
  const StepResult two = run(Cluster(spec), g);
  EXPECT_NEAR(end_s(two, 0, 0), 2.5, kNs);
  EXPECT_NEAR(end_s(two, 0, 1), 4.5, kNs);
  spec.cpu_threads_per_transfer = 0;
  const StepResult none = run(Cluster(spec), g);
  EXPECT_NEAR(end_s(none, 0, 0), 0.5, kNs);
  EXPECT_NEAR(end_s(none, 0, 1), 1.0, kNs);
}

// Beside compute a transfer between hosts is slower than its thread's share says (measured by bench
// transfer-cpu): cpu_transfer_slowdown X caps its lane at the NIC's bandwidth / X while compute runs in
// its pool. The exchange above through 1 GB/s NICs, two pinned hosts of one core each, w = 1: rank 0
// computes 0.5 s of work at 1 / (1 + 1) until 1 s. With X = 4 both directions move at 0.25 GB/s until
// then (rank 0's links), the remaining 0.75 GB at the NIC's 1 GB/s: 1.75 s; with X = 1, 1 s.
TEST(SimExecutor, ATransferBesideComputeRunsAtItsMeasuredSlowdown) {
  ClusterSpec spec = two_nodes_one_nic(1e9);
  spec.cpu_cores = 2;
  spec.cpu_nodes_pinned = true;
  const std::vector<StepGraph> g = exchange_beside_compute(0.5e14);
  const StepResult plain = run(Cluster(spec), g);
  EXPECT_NEAR(end_s(plain, 0, 0), 1.0, kNs);
  EXPECT_NEAR(end_s(plain, 0, 1), 1.0, kNs);
  spec.cpu_transfer_slowdown = 4;
  const StepResult slowed = run(Cluster(spec), g);
  EXPECT_NEAR(end_s(slowed, 0, 0), 1.0, kNs);  // the compute's share is the threads' as before
  EXPECT_NEAR(end_s(slowed, 0, 1), 1.75, kNs);
  EXPECT_NEAR(end_s(slowed, 1, 1), 1.75, kNs);
  // No compute on either host: the exchange alone is not slowed.
  std::vector<StepGraph> idle = exchange_beside_compute(0);
  EXPECT_NEAR(end_s(run(Cluster(spec), idle), 0, 1), 1.0, kNs);
}

// Pinned nodes (ClusterSpec::cpu_nodes_pinned): each node's ranks share its own cores. A rank of 2
// threads computing 1 s of work alone on two nodes of 2 cores in all: all the cores while the other
// node idles; its node's one core when pinned.
TEST(SimExecutor, PinnedNodesShareOnlyTheirOwnCores) {
  ClusterSpec spec = two_nodes_one_nic(1e9);
  spec.cpu_cores = 2;
  spec.cpu_threads_per_device = 2;
  std::vector<StepGraph> g(2);
  for (int r = 0; r < 2; ++r) compute(g[r], r == 0 ? 1e14 : 0);
  EXPECT_NEAR(end_s(run(Cluster(spec), g), 0, 0), 1.0, kNs);
  spec.cpu_nodes_pinned = true;
  EXPECT_NEAR(end_s(run(Cluster(spec), g), 0, 0), 2.0, kNs);
  // Both ranks computing: 4 threads on 2 cores either way.
  for (int r = 0; r < 2; ++r) g[r] = StepGraph{}, compute(g[r], 1e14);
  EXPECT_NEAR(end_s(run(Cluster(spec), g), 1, 0), 2.0, kNs);
  spec.cpu_nodes_pinned = false;
  EXPECT_NEAR(end_s(run(Cluster(spec), g), 1, 0), 2.0, kNs);
}

// Rank graphs for the priority test: an allreduce cut into two micro-ops on lane 2, ready at 0; an
// all-to-all on lane 1 that becomes ready when a compute op ends while the first micro-op runs.
std::vector<StepGraph> priority_graphs(int a2a_priority, double S) {
  std::vector<StepGraph> g(2);
  for (int r = 0; r < 2; ++r) {
    g[r].add_stream("a2a", true);
    g[r].add_stream("allreduce", true);
    const int c = compute(g[r], 0.5e14);  // 0.5 s
    const int ar0 = comm(g[r], 2, Collective::allreduce, Group::world, 0, {}, static_cast<int64_t>(S));
    comm(g[r], 2, Collective::allreduce, Group::world, 0, {ar0}, static_cast<int64_t>(S));
    std::vector<int64_t> peer(2, static_cast<int64_t>(S));
    peer[r] = 0;
    comm(g[r], 1, Collective::alltoallv, Group::world, a2a_priority, {c}, static_cast<int64_t>(S), peer);
  }
  return g;
}

TEST(SimExecutor, AHighPriorityAlltoallOvertakesAnAllreduceQueuedBeforeIt) {
  const double B = 1e9, S = 1e9;  // an allreduce micro-op alone: S/B = 1 s on two ranks
  const Cluster cluster(star_spec(2, B, 0, unit_device()));
  // ops: 0 compute (0 .. 0.5), 1 ar0, 2 ar1, 3 a2a
  const StepResult prio = run(cluster, priority_graphs(1, S));
  EXPECT_NEAR(start_s(prio, 0, 3), 0.5, kNs);             // ar0 running does not hold it (lower priority)
  EXPECT_GE(start_s(prio, 0, 2), end_s(prio, 0, 3) - kNs);  // ar1 waits for the all-to-all
  EXPECT_GT(start_s(prio, 0, 2), end_s(prio, 0, 1) + 0.1);  // although ar0 ended well before

  // Equal priority: ar1 starts as soon as ar0 ends, while the all-to-all still runs.
  const StepResult equal = run(cluster, priority_graphs(0, S));
  EXPECT_NEAR(start_s(equal, 0, 2), end_s(equal, 0, 1), kNs);
  EXPECT_LT(start_s(equal, 0, 2), end_s(equal, 0, 3));
}

TEST(SimExecutor, RingAllreduceAndEqualFlowsMatchTheirClosedForms) {
  const double B = 10e9, alpha = 5e-6, S = 64e6;
  for (int p : {2, 4, 8}) {
    for (bool aggregate : {false, true}) {
      const Cluster cluster(ring_spec(p, B, alpha, unit_device()));
      std::vector<StepGraph> g(p);
      for (int r = 0; r < p; ++r) {
        g[r].add_stream("allreduce", true);
        comm(g[r], 1, Collective::allreduce, Group::world, 0, {}, static_cast<int64_t>(S));
      }
      ExecutorConfig cfg;
      cfg.aggregate_flows = aggregate;
      const StepResult res = run(cluster, g, cfg);
      const double expect = 2.0 * (p - 1) / p * S / B + 2.0 * (p - 1) * alpha;
      EXPECT_NEAR(res.seconds(), expect, 1e-9 * expect + kNs) << "p=" << p << " aggregate=" << aggregate;
    }
  }
  // n senders to one receiver over a star: the receiver's link carries n flows, each at B/n.
  const int n = 4;
  const double b = 1e9;
  const Cluster star(star_spec(n + 1, B, 0, unit_device()));
  std::vector<StepGraph> g(n + 1);
  for (int r = 0; r <= n; ++r) {
    g[r].add_stream("a2a", true);
    std::vector<int64_t> peer(n + 1, 0);
    if (r > 0) peer[0] = static_cast<int64_t>(b);
    comm(g[r], 1, Collective::alltoallv, Group::world, 0, {}, r > 0 ? static_cast<int64_t>(b) : 0, peer);
  }
  const StepResult res = run(star, g);
  EXPECT_NEAR(res.seconds(), n * b / B, 1e-9);
  for (int r = 1; r <= n; ++r) EXPECT_NEAR(end_s(res, r, 0), n * b / B, kNs);
}

// An allreduce (lane 2) and an all-to-all (lane 1) of the same two ranks share each node's NIC.
std::vector<StepGraph> contention_graphs(int a2a_priority, double S) {
  std::vector<StepGraph> g(2);
  for (int r = 0; r < 2; ++r) {
    g[r].add_stream("a2a", true);
    g[r].add_stream("allreduce", true);
    std::vector<int64_t> peer(2, static_cast<int64_t>(2 * S));
    peer[r] = 0;
    comm(g[r], 1, Collective::alltoallv, Group::world, a2a_priority, {}, static_cast<int64_t>(2 * S), peer);
    comm(g[r], 2, Collective::allreduce, Group::world, 0, {}, static_cast<int64_t>(S));
  }
  return g;
}

TEST(SimExecutor, LanesSharingANicSlowEachOtherUnlessTheAlltoallHasPriority) {
  const double B = 12.5e9, S = 100e6;
  const Cluster cluster(two_nodes_one_nic(B));
  // Alone: allreduce S/B, all-to-all 2S/B (collectives.h closed forms). Together at equal priority:
  // fair shares B/2 until the allreduce ends at 2S/B (factor 2), the all-to-all at 3S/B (factor 1.5).
  const StepResult equal = run(cluster, contention_graphs(0, S));
  EXPECT_NEAR(end_s(equal, 0, 1), 2 * S / B, kNs);
  EXPECT_NEAR(end_s(equal, 0, 0), 3 * S / B, kNs);
  // All-to-all first (Lina's rule): it runs alone, 2S/B; the allreduce follows, S/B more.
  const StepResult prio = run(cluster, contention_graphs(1, S));
  EXPECT_NEAR(end_s(prio, 0, 0), 2 * S / B, kNs);
  EXPECT_NEAR(start_s(prio, 0, 1), 2 * S / B, kNs);
  EXPECT_NEAR(end_s(prio, 0, 1), 3 * S / B, kNs);
  // Link utilisation: the NIC port of node 0 carried 2S + S each way over 3S/B: fully busy.
  const std::vector<LinkUse> top = top_links(cluster, prio.link_bytes, prio.seconds(), 2);
  ASSERT_FALSE(top.empty());
  EXPECT_NEAR(top[0].utilisation, 1.0, 1e-6);
  EXPECT_NE(top[0].name.find("nic"), std::string::npos) << top[0].name;
}

// The EP graph of build_ep_step filled from a load, on a p4d-like preset of `ranks` devices.
struct EpRun {
  std::vector<StepGraph> graphs;
  std::vector<StepResult> steps;
};

EpRun run_ep(const Cluster& cluster, int ranks, int ep_size, int steps, const std::string& load_text) {
  ModelConfig cfg;
  graph::EpStepOptions opt;
  opt.world = ranks;
  opt.ep_size = ep_size;
  opt.batch = 4;
  const graph::EpStep step = graph::build_ep_step(cfg, opt);
  LoadSpec spec;
  EXPECT_TRUE(LoadSpec::parse(load_text, &spec));
  Load load;
  EXPECT_TRUE(Load::make(spec, cfg, ranks, opt.batch * cfg.seq_len, &load));
  ExecutorConfig ec;
  ec.ranks = ranks;
  ec.ep_size = ep_size;
  StepExecutor ex(cluster, ec);
  EpRun out;
  for (int s = 0; s < steps; ++s) {
    const StepLoad l = load.step(s);
    out.graphs.assign(ranks, step.graph);
    for (int r = 0; r < ranks; ++r) fill_ep_costs(cfg, opt, l, r, &out.graphs[r]);
    StepResult res;
    Status st = ex.run_step(out.graphs, &res);
    EXPECT_TRUE(st) << st.message();
    out.steps.push_back(std::move(res));
  }
  return out;
}

TEST(SimExecutor, EpGraphRunsAndItsBreakdownIsConsistent) {
  for (int ranks : {2, 8}) {
    ClusterSpec spec;
    ASSERT_TRUE(preset_cluster("p4d.24xlarge", (ranks + 7) / 8, &spec));
    const Cluster cluster(spec);
    const EpRun run = run_ep(cluster, ranks, ranks, 2, "zipf:1.0");
    ASSERT_EQ(run.steps.size(), 2u);
    const StepResult& res = run.steps[1];
    EXPECT_NEAR(res.start_s, run.steps[0].end_s, 1e-15);  // back to back
    const graph::StepGraph& g = run.graphs[0];
    int64_t longest = 0;
    for (int r = 0; r < ranks; ++r) {
      const runtime::StepBreakdown b = runtime::breakdown(g, res.timelines[r]);
      double compute_ms = 0, model_ms = 0;
      for (const Op& op : run.graphs[r].ops) {
        const runtime::OpSpan& sp = res.timelines[r].spans[op.id];
        ASSERT_GE(sp.start_ns, 0);
        ASSERT_GE(sp.end_ns, sp.start_ns);
        if (graph::is_communication(op.kind)) continue;
        compute_ms += (sp.end_ns - sp.start_ns) * 1e-6;
        model_ms += op_time(cluster.device(), op.cost.flops, static_cast<double>(op.cost.bytes)) * 1e3;
      }
      EXPECT_NEAR(b.compute_ms, compute_ms, 1e-9);
      EXPECT_NEAR(b.compute_ms, model_ms, 1e-6 * g.ops.size());  // ns rounding per op
      EXPECT_NEAR(b.exposed_comm_ms, b.wall_ms - b.compute_ms, 1e-9);
      EXPECT_GT(b.comm_ms, 0);
      EXPECT_LE(b.allreduce_hidden_ms, b.allreduce_ms + 1e-9);
      longest = std::max(longest, res.timelines[r].wall_ns);
    }
    EXPECT_NEAR(longest * 1e-9, res.seconds(), 2e-9);
    double total = 0, a2a = 0;
    for (const auto& [cat, s] : res.critical_path_s) {
      total += s;
      if (cat == "all-to-all") a2a = s;
    }
    EXPECT_NEAR(total, res.seconds(), 1e-12);
    EXPECT_GT(a2a, 0) << ranks << " ranks";
    EXPECT_GT(res.flows, 0);
  }
}

std::string read(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(SimExecutor, TheSameInputsGiveTheSameTraceByteForByte) {
  ClusterSpec spec;
  ASSERT_TRUE(preset_cluster("p4d.24xlarge", 2, &spec));
  const Cluster cluster(spec);
  const auto dir = std::filesystem::temp_directory_path();
  std::string texts[2];
  for (int i = 0; i < 2; ++i) {
    const EpRun run = run_ep(cluster, 16, 8, 2, "zipf-drift:1.2,2");
    std::vector<runtime::TraceRecord> records;
    for (size_t s = 0; s < run.steps.size(); ++s)
      for (int r = 0; r < 16; ++r)
        runtime::append_records(&records, run.graphs[r], run.steps[s].timelines[r], r, static_cast<int64_t>(s) + 1, 0);
    const auto path = dir / ("moe_sim_trace_" + std::to_string(::getpid()) + "_" + std::to_string(i) + ".json");
    ASSERT_TRUE(runtime::write_chrome_trace(path.string(), run.graphs[0], records, 16));
    texts[i] = read(path);
    std::filesystem::remove(path);
  }
  EXPECT_GT(texts[0].size(), 1000u);
  EXPECT_EQ(texts[0], texts[1]);
}

TEST(SimExecutor, BadInputIsAnErrorNotAHang) {
  const Cluster cluster(star_spec(2, 1e9, 0, unit_device()));
  std::vector<StepGraph> g(2);
  for (int r = 0; r < 2; ++r) g[r].add_stream("a2a", true);
  comm(g[0], 1, Collective::alltoallv, Group::world, 0, {}, 8, {0, 8, 0});  // 3 entries for 2 members
  comm(g[1], 1, Collective::alltoallv, Group::world, 0, {}, 8, {8, 0});
  ExecutorConfig cfg;
  cfg.ranks = 2;
  StepExecutor ex(cluster, cfg);
  StepResult res;
  Status s = ex.run_step(g, &res);
  EXPECT_FALSE(s);
  EXPECT_NE(s.message().find("peer_bytes"), std::string::npos) << s.message();
  std::vector<StepGraph> one(1);
  EXPECT_FALSE(ex.run_step(one, &res));  // one graph for two ranks
  compute(g[1], 1);                      // different structure
  g[0].ops[0].cost.peer_bytes = {0, 8};
  s = ex.run_step(g, &res);
  EXPECT_NE(s.message().find("structure"), std::string::npos) << s.message();
  cfg.ep_size = 3;
  EXPECT_THROW(StepExecutor(cluster, cfg), std::logic_error);
}

}  // namespace
}  // namespace moe::sim
