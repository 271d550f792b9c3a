// Collectives on the simulated network (src/sim/collectives.h): closed forms on uncontended links,
// contention between collectives sharing a NIC, and determinism.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "sim/collectives.h"
#include "sim_test_clusters.h"

namespace moe::sim {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

std::vector<int> iota(int n) {
  std::vector<int> v(n);
  for (int i = 0; i < n; ++i) v[i] = i;
  return v;
}

// Runs the collectives started so far to the end; returns them by id.
std::vector<FinishedCollective> run(Collectives& colls) {
  std::vector<FinishedCollective> done;
  while (colls.in_flight() > 0) {
    const double t = colls.next_event_time();
    if (t == kInf) break;
    for (FinishedCollective& f : colls.advance(t)) done.push_back(std::move(f));
  }
  std::sort(done.begin(), done.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
  return done;
}

double run_one(const Cluster& cluster, const CollectiveSpec& spec) {
  Collectives colls(cluster);
  colls.start(spec);
  const std::vector<FinishedCollective> done = run(colls);
  EXPECT_EQ(done.size(), 1u);
  return done.empty() ? -1 : done[0].end;
}

CollectiveSpec spec_of(CollectiveKind kind, std::vector<int> devices, double bytes) {
  CollectiveSpec s;
  s.kind = kind;
  s.devices = std::move(devices);
  s.bytes = bytes;
  return s;
}

TEST(SimCollectives, RingAllreduceMatchesItsClosedForm) {
  const double B = 20e9, alpha = 3e-6, S = 64e6;
  for (int p : {2, 3, 4, 8}) {
    SCOPED_TRACE(p);
    const Cluster ring(ring_spec(p, B, alpha));
    const double t = run_one(ring, spec_of(CollectiveKind::allreduce, iota(p), S));
    // 2(p-1)/p * S/B + 2(p-1) * alpha
    EXPECT_NEAR(t, 2.0 * (p - 1) / p * S / B + 2 * (p - 1) * alpha, 1e-12);
  }
}

TEST(SimCollectives, RingAllgatherAndReduceScatterTakeHalfTheSteps) {
  const double B = 20e9, alpha = 3e-6, S = 64e6;
  const int p = 6;
  const Cluster ring(ring_spec(p, B, alpha));
  const double expected = (p - 1) * (alpha + S / p / B);
  EXPECT_NEAR(run_one(ring, spec_of(CollectiveKind::allgather, iota(p), S)), expected, 1e-12);
  EXPECT_NEAR(run_one(ring, spec_of(CollectiveKind::reduce_scatter, iota(p), S)), expected, 1e-12);
}

TEST(SimCollectives, BroadcastAndReduceArePipelinedChains) {
  const double B = 20e9, alpha = 3e-6, S = 64e6;
  const int p = 5;
  const Cluster ring(ring_spec(p, B, alpha));
  const int C = pipeline_chunks(p - 1, S, B, alpha);
  EXPECT_EQ(C, 57);  // sqrt(3 * 64e6 / (20e9 * 3e-6)) = 56.6; 57 chunks give the lower time
  const double expected = (C + p - 2) * (alpha + S / C / B);
  for (int root : {0, 3}) {
    CollectiveSpec b = spec_of(CollectiveKind::broadcast, iota(p), S);
    b.root = root;
    EXPECT_NEAR(run_one(ring, b), expected, 1e-12);
    CollectiveSpec r = spec_of(CollectiveKind::reduce, iota(p), S);
    r.root = root;
    EXPECT_NEAR(run_one(ring, r), expected, 1e-12);
  }
  // Against the unpipelined chain it replaces: (p - 1) * (alpha + S / B).
  EXPECT_LT(expected, (p - 1) * (alpha + S / B) / 2);
}

TEST(SimCollectives, PipelineChunksMinimizeTheChainTime) {
  EXPECT_EQ(pipeline_chunks(1, 1e9, 1e9, 1e-6), 1);     // one hop: no gain
  EXPECT_EQ(pipeline_chunks(7, 0, 1e9, 1e-6), 1);       // nothing to send
  EXPECT_EQ(pipeline_chunks(7, 1e3, 25e9, 3e-6), 1);    // small: latency dominates
  EXPECT_EQ(pipeline_chunks(7, 1e12, 1e9, 1e-6), 256);  // capped
  EXPECT_EQ(pipeline_chunks(3, 1e8, 1e9, 0), 256);
  for (int hops : {2, 5, 9}) {
    for (double bytes : {1e5, 3e6, 2e8}) {
      const double B = 12e9, a = 5e-6;
      const int c = pipeline_chunks(hops, bytes, B, a);
      auto time = [&](int k) { return (k + hops - 1) * (a + bytes / (k * B)); };
      for (int k = 1; k <= 256; ++k) EXPECT_LE(time(c), time(k) * (1 + 1e-12)) << hops << " " << bytes << " " << k;
    }
  }
  EXPECT_THROW(pipeline_chunks(0, 1, 1, 1), std::logic_error);
}

TEST(SimCollectives, AlltoallOnAStarTakesTheBusiestPortsTime) {
  const double B = 10e9, alpha = 4e-6;
  const int p = 6;
  const Cluster star(star_spec(p, B, alpha));
  // Uniform: every device sends 8 MB to every other; each port carries 5 x 8 MB.
  CollectiveSpec uniform = spec_of(CollectiveKind::alltoallv, iota(p), 0);
  uniform.peer_bytes.assign(p * p, 8e6);
  EXPECT_NEAR(run_one(star, uniform), (p - 1) * 8e6 / B + alpha, 1e-12);
  // Skewed: the time is the largest bytes in or out of one device over the port bandwidth. Here
  // device 0 receives from everyone (sizes 1..5 MB), and the others exchange a little among themselves.
  CollectiveSpec skewed = spec_of(CollectiveKind::alltoallv, iota(p), 0);
  skewed.peer_bytes.assign(p * p, 0);
  for (int i = 1; i < p; ++i) skewed.peer_bytes[i * p + 0] = i * 1e6;
  skewed.peer_bytes[1 * p + 2] = 0.5e6;
  skewed.peer_bytes[3 * p + 4] = 0.5e6;
  double busiest = 0;
  for (int d = 0; d < p; ++d) {
    double in = 0, out = 0;
    for (int e = 0; e < p; ++e) {
      out += skewed.peer_bytes[d * p + e];
      in += skewed.peer_bytes[e * p + d];
    }
    busiest = std::max({busiest, in, out});
  }
  EXPECT_DOUBLE_EQ(busiest, 15e6);
  Collectives colls(star);
  colls.start(skewed);
  const std::vector<FinishedCollective> done = run(colls);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_NEAR(done[0].end, busiest / B + alpha, 1e-12);
  // Member ends: device 1's 1 MB to device 0 ends first, while 5 flows share device 0's port.
  EXPECT_NEAR(done[0].member_end[1], 5 * 1e6 / B + alpha, 1e-12);
  EXPECT_EQ(done[0].member_end[0], done[0].end);
}

// Two nodes of two GPUs with one NIC each; only the NIC ports (B) are slow, no latencies. An
// allreduce between the nodes' GPU 0 and an alltoall between their GPU 1 cross the same NIC ports.
Cluster two_nodes_one_nic(double B) {
  ClusterSpec c = node_spec(2);
  c.nodes = 2;
  c.node.nic_switch = {0};
  c.node.nic_pcie = {1e12, 0};
  c.node.nic_port = {B, 0};
  return Cluster(c);
}

TEST(SimCollectives, AllreduceAndAlltoallSharingANicSlowEachOtherByTheFairShare) {
  const double B = 12.5e9, S = 100e6;
  const Cluster cluster = two_nodes_one_nic(B);
  const CollectiveSpec allreduce = spec_of(CollectiveKind::allreduce, {0, 2}, S);
  CollectiveSpec alltoall = spec_of(CollectiveKind::alltoallv, {1, 3}, 0);
  alltoall.peer_bytes = {0, 2 * S, 2 * S, 0};

  // Alone: the allreduce's 2 steps of S/2 each way take S/B; the alltoall's 2S each way takes 2S/B.
  const double allreduce_alone = run_one(cluster, allreduce);
  const double alltoall_alone = run_one(cluster, alltoall);
  EXPECT_NEAR(allreduce_alone, S / B, 1e-12);
  EXPECT_NEAR(alltoall_alone, 2 * S / B, 1e-12);

  // Together each direction of each NIC port has two flows, B/2 each: the allreduce's two steps take
  // S/B each (fair-share factor 2: it ends at 2 S/B); by then the alltoall has moved S of its 2S, the
  // other S goes alone at B: it ends at 3 S/B (factor 1.5).
  Collectives colls(cluster);
  const int ar = colls.start(allreduce);
  const int a2a = colls.start(alltoall);
  const std::vector<FinishedCollective> done = run(colls);
  ASSERT_EQ(done.size(), 2u);
  EXPECT_EQ(done[0].id, ar);
  EXPECT_EQ(done[1].id, a2a);
  EXPECT_NEAR(done[0].end, 2 * S / B, 1e-12);
  EXPECT_NEAR(done[0].end / allreduce_alone, 2.0, 1e-9);
  EXPECT_NEAR(done[1].end, 3 * S / B, 1e-12);
  EXPECT_NEAR(done[1].end / alltoall_alone, 1.5, 1e-9);
  // The NIC port of node 0 carried both: S for the allreduce and 2S for the alltoall, each way.
  const Network& net = colls.network();
  int nic_port = -1;
  for (int l = 0; l < cluster.n_links(); ++l) nic_port = cluster.link_name(l) == "n0.nic0->leaf0" ? l : nic_port;
  ASSERT_GE(nic_port, 0);
  EXPECT_NEAR(net.link_bytes(nic_port), 3 * S, 1e-3);

  // The alltoall started alone (as a schedule that gives it priority runs it) takes its alone time.
  Collectives alone(cluster);
  alone.start(alltoall);
  EXPECT_NEAR(run(alone)[0].end, alltoall_alone, 1e-12);
}

// Eager sends (CollectiveSpec::reached, eager_bytes): an alltoallv between two nodes started when its
// first member reached it. Members: 0 = device 0 (node 0), 1 = device 2 (node 1), 2 = device 1 (node 0),
// S bytes each way between member 0 and each other; member 1 reaches it at S / 2B, member 2 at 2 S / B.
TEST(SimCollectives, EagerSendsStartWithTheirSenderAndAreDoneOnItAtOnce) {
  const double B = 1e9, S = 1e6, pcie = 1e12;
  const Cluster cluster = two_nodes_one_nic(B);
  auto exchange = [&](double eager_bytes) {
    CollectiveSpec a2a = spec_of(CollectiveKind::alltoallv, {0, 2, 1}, 0);
    a2a.peer_bytes = {0, S, S, S, 0, 0, S, 0, 0};
    a2a.reached = {1, 0, 0};
    a2a.eager_bytes = eager_bytes;
    return a2a;
  };
  // Member ends, by member, and the bytes device 0's own link out carried.
  auto run_exchange = [&](double eager_bytes, std::vector<double>* ends, double* dev0_out_bytes) {
    Collectives colls(cluster);
    const int id = colls.start(exchange(eager_bytes));
    ends->assign(3, -1);
    auto take = [&]() {
      for (const MemberEnded& m : colls.take_member_ends()) (*ends)[m.member] = m.time;
    };
    take();
    for (const auto& [at, member] : {std::pair{S / (2 * B), 1}, std::pair{2 * S / B, 2}}) {
      while (colls.next_event_time() <= at) {
        colls.advance(colls.next_event_time());
        take();
      }
      colls.advance(at);
      colls.reach(id, member);
      take();
    }
    EXPECT_THROW(colls.reach(id, 2), std::logic_error);  // it has reached it already
    const std::vector<FinishedCollective> done = run(colls);
    take();
    EXPECT_EQ(done.size(), 1u);
    *dev0_out_bytes = 0;
    for (int l = 0; l < cluster.n_links(); ++l)
      if (cluster.link_name(l) == "n0.gpu0->n0.pcie0") *dev0_out_bytes = colls.network().link_bytes(l);
  };
  std::vector<double> ends;
  double dev0_out = -1;
  // S is eager: 0 -> 1 crosses the NIC at once (S / B) past device 0's own link, and is done on member 0
  // at 0; 1 -> 0 starts at S / 2B. Member 1 ends when 0 -> 1 arrived (its own send was done when it
  // started); member 0 and 2 when their exchange within node 0 ended (S / pcie after 2 S / B), after
  // 1 -> 0 arrived at 1.5 S / B.
  run_exchange(S, &ends, &dev0_out);
  EXPECT_NEAR(ends[1], S / B, 1e-12);
  EXPECT_NEAR(ends[0], 2 * S / B + S / pcie, 1e-12);
  EXPECT_NEAR(ends[2], 2 * S / B + S / pcie, 1e-12);
  EXPECT_NEAR(dev0_out, S, 1e-6);  // only its send within the node
  // A limit below S, or none: nothing is eager; 0 -> 1 waits for member 1 and ends at 1.5 S / B with 1 -> 0.
  for (double limit : {S / 2, 0.0}) {
    run_exchange(limit, &ends, &dev0_out);
    EXPECT_NEAR(ends[1], 1.5 * S / B, 1e-12) << limit;
    EXPECT_NEAR(ends[0], 2 * S / B + S / pcie, 1e-12) << limit;
    EXPECT_NEAR(dev0_out, 2 * S, 1e-6) << limit;
  }

  Collectives colls(cluster);
  CollectiveSpec bad = exchange(S);
  bad.reached = {1, 0};
  EXPECT_THROW(colls.start(bad), std::logic_error);
  bad = spec_of(CollectiveKind::allreduce, {0, 2}, S);
  bad.reached = {1, 0};
  EXPECT_THROW(colls.start(bad), std::logic_error);
}

// A sender's eager sends cross one after another in its posting order (to member + 1, + 2, ...), each
// when the one before has arrived; sends above the eager limit share the NIC side by side. Members:
// 0 = device 0 and 2 = device 1 (node 0), 1 = device 2 and 3 = device 3 (node 1). Member 2 sends S to
// members 1 and 3: it posts to 3 first (2 + 1), then to 1 (2 + 3).
TEST(SimCollectives, EagerSendsOfOneSenderCrossInItsPostingOrder) {
  const double B = 1e9, S = 1e6;
  const Cluster cluster = two_nodes_one_nic(B);
  auto member_ends = [&](double eager_bytes) {
    CollectiveSpec a2a = spec_of(CollectiveKind::alltoallv, {0, 2, 1, 3}, 0);
    a2a.peer_bytes.assign(16, 0);
    a2a.peer_bytes[2 * 4 + 1] = a2a.peer_bytes[2 * 4 + 3] = S;
    a2a.eager_bytes = eager_bytes;
    Collectives colls(cluster);
    colls.start(a2a);
    const std::vector<FinishedCollective> done = run(colls);
    EXPECT_EQ(done.size(), 1u);
    return done.empty() ? std::vector<double>{} : done[0].member_end;
  };
  const std::vector<double> eager = member_ends(S);
  ASSERT_EQ(eager.size(), 4u);
  EXPECT_NEAR(eager[3], S / B, 1e-9);      // posted first: the NIC alone
  EXPECT_NEAR(eager[1], 2 * S / B, 1e-9);  // then the second
  EXPECT_NEAR(eager[2], 0, 1e-12);         // both done on the sender when it reached the exchange
  const std::vector<double> rendezvous = member_ends(S / 2);
  ASSERT_EQ(rendezvous.size(), 4u);
  for (int m : {1, 2, 3}) EXPECT_NEAR(rendezvous[m], 2 * S / B, 1e-9) << m;  // side by side, half the NIC each
}

// Aggregated flows (collectives.h) on 4 H100 HGX nodes: a skewed all-to-all (every member sends most
// to member 0, as tokens to a hot expert) and a uniform one finish when the exact ones do, with far
// fewer flows; an aggregated ring allreduce ends on every member at once.
TEST(SimCollectives, AggregatedFlowsKeepTheReceiversBottleneck) {
  ClusterSpec spec;
  ASSERT_TRUE(preset_cluster("h100x8-hgx", 4, &spec));
  const Cluster cluster(spec);
  const int p = 32;
  for (double s : {0.0, 1.0}) {
    CollectiveSpec a = spec_of(CollectiveKind::alltoallv, iota(p), 0);
    a.peer_bytes.assign(p * p, 0);
    double wsum = 0;
    for (int j = 0; j < p; ++j) wsum += 1 / std::pow(j + 1.0, s);
    for (int i = 0; i < p; ++i)
      for (int j = 0; j < p; ++j)
        if (i != j) a.peer_bytes[i * p + j] = 8e6 * p / std::pow(j + 1.0, s) / wsum;
    Collectives exact(cluster), aggregated(cluster);
    exact.start(a);
    a.aggregate = true;
    aggregated.start(a);
    const std::vector<FinishedCollective> e = run(exact), g = run(aggregated);
    ASSERT_EQ(e.size(), 1u);
    ASSERT_EQ(g.size(), 1u);
    EXPECT_NEAR(g[0].end, e[0].end, 1e-9 * e[0].end) << "s=" << s;
    for (int m = 0; m < p; ++m) EXPECT_NEAR(g[0].member_end[m], e[0].member_end[m], 1e-9 * e[0].end) << m;
    EXPECT_LT(aggregated.transfers_started() * 2, exact.transfers_started());
  }
  CollectiveSpec ar = spec_of(CollectiveKind::allreduce, iota(p), 64e6);
  ar.aggregate = true;
  Collectives colls(cluster);
  colls.start(ar);
  const std::vector<FinishedCollective> done = run(colls);
  ASSERT_EQ(done.size(), 1u);
  for (double t : done[0].member_end) EXPECT_EQ(t, done[0].end);
  EXPECT_EQ(colls.transfers_started(), p);
}

TEST(SimCollectives, HierarchicalAllreduceMatchesItsClosedForm) {
  // m nodes of k GPUs on an NVSwitch (bandwidth Bi per GPU), one NIC per node (Bn): per node a ring
  // reduce-scatter and allgather of S over k GPUs; per local index a ring allreduce of S/k over the m
  // nodes, the k rings sharing each NIC (Bn/k each).
  const int m = 3, k = 4;
  const double Bi = 100e9, Bn = 10e9, S = 48e6;
  ClusterSpec c = node_spec(k);
  c.nodes = m;
  c.node.interconnect = Interconnect::nvswitch;
  c.node.nvlink = {Bi, 1e-6};
  c.node.nvswitch_links = 1;
  c.node.device_pcie = {1e12, 2e-6};
  c.node.nic_switch = {0};
  c.node.nic_pcie = {1e12, 2e-6};
  c.node.nic_port = {Bn, 3e-6};
  const Cluster cluster(c);
  const double alpha_intra = cluster.path_latency(cluster.route(0, 1));
  const double alpha_inter = cluster.path_latency(cluster.route(0, k));
  EXPECT_NEAR(alpha_intra, 2e-6, 1e-15);
  EXPECT_NEAR(alpha_inter, 4 * 2e-6 + 2 * 3e-6, 1e-15);
  CollectiveSpec h = spec_of(CollectiveKind::allreduce, iota(m * k), S);
  h.hierarchical = true;
  const double expected = 2 * (k - 1) * (alpha_intra + S / k / Bi) +                                  // RS + AG
                          2 * (m - 1) * (alpha_inter + S / (static_cast<double>(k) * m) / (Bn / k));  // inter AR
  EXPECT_NEAR(run_one(cluster, h), expected, 1e-12);
  // The flat ring over all 12 GPUs crosses the NICs in 2(p-1) steps instead, and is slower here.
  EXPECT_GT(run_one(cluster, spec_of(CollectiveKind::allreduce, iota(m * k), S)), expected);
}

TEST(SimCollectives, TrivialCollectivesFinishAtOnceAndBadSpecsThrow) {
  const Cluster ring(ring_spec(4, 1e9, 1e-6));
  Collectives colls(ring);
  const int one = colls.start(spec_of(CollectiveKind::allreduce, {2}, 1e6));
  const int empty = colls.start(spec_of(CollectiveKind::allgather, iota(4), 0));
  EXPECT_EQ(colls.in_flight(), 2);
  EXPECT_EQ(colls.next_event_time(), 0);
  const std::vector<FinishedCollective> done = colls.advance(0);
  ASSERT_EQ(done.size(), 2u);
  EXPECT_EQ(done[0].id, std::min(one, empty));
  EXPECT_EQ(done[0].end, 0);
  EXPECT_EQ(colls.in_flight(), 0);
  EXPECT_EQ(colls.next_event_time(), kInf);

  EXPECT_THROW(colls.start(spec_of(CollectiveKind::allreduce, {}, 1)), std::logic_error);
  EXPECT_THROW(colls.start(spec_of(CollectiveKind::allreduce, {0, 0}, 1)), std::logic_error);
  EXPECT_THROW(colls.start(spec_of(CollectiveKind::allreduce, {0, 4}, 1)), std::logic_error);
  EXPECT_THROW(colls.start(spec_of(CollectiveKind::allreduce, {0, 1}, -1)), std::logic_error);
  CollectiveSpec a2a = spec_of(CollectiveKind::alltoallv, {0, 1}, 0);
  a2a.peer_bytes = {0, 1, 1};
  EXPECT_THROW(colls.start(a2a), std::logic_error);
  CollectiveSpec bcast = spec_of(CollectiveKind::broadcast, {0, 1}, 1);
  bcast.root = 2;
  EXPECT_THROW(colls.start(bcast), std::logic_error);
  CollectiveSpec hier = spec_of(CollectiveKind::allgather, {0, 1}, 1);
  hier.hierarchical = true;
  EXPECT_THROW(colls.start(hier), std::logic_error);
  const Cluster two(two_nodes_one_nic(1e9));
  Collectives uneven(two);
  CollectiveSpec h = spec_of(CollectiveKind::allreduce, {0, 1, 2}, 1);  // 2 GPUs on node 0, 1 on node 1
  h.hierarchical = true;
  EXPECT_THROW(uneven.start(h), std::logic_error);
}

// Several collectives of every kind started at different times on a p4d cluster; the log of their
// ends, per-member ends and link bytes, floats in hex.
std::string mixed_run_log() {
  ClusterSpec spec;
  EXPECT_TRUE(preset_cluster("p4d.24xlarge", 4, &spec));
  const Cluster cluster(spec);
  Collectives colls(cluster);
  std::mt19937_64 rng(99);
  std::string log;
  char buf[96];
  int started = 0;
  for (int round = 0; round < 40; ++round) {
    if (started < 24) {
      CollectiveSpec s;
      s.kind = static_cast<CollectiveKind>(rng() % 6);
      const int p = 2 + static_cast<int>(rng() % 15);
      std::vector<int> devices = iota(32);
      std::shuffle(devices.begin(), devices.end(), rng);
      devices.resize(p);
      s.devices = devices;
      s.bytes = static_cast<double>(1 + rng() % 1000) * 1e5;
      s.root = static_cast<int>(rng() % p);
      if (s.kind == CollectiveKind::alltoallv) {
        for (int i = 0; i < p * p; ++i)
          s.peer_bytes.push_back(i % (p + 1) == 0 ? 0 : static_cast<double>(rng() % 1000) * 1e4);
      }
      colls.start(s);
      ++started;
    }
    const double next = colls.next_event_time();
    if (next == kInf) continue;
    const double t = rng() % 2 == 0 ? next : colls.now() + (next - colls.now()) / 2;
    for (const FinishedCollective& f : colls.advance(t)) {
      std::snprintf(buf, sizeof buf, "%d %a %a:", f.id, f.start, f.end);
      log += buf;
      for (double e : f.member_end) {
        std::snprintf(buf, sizeof buf, " %a", e);
        log += buf;
      }
      log += "\n";
    }
  }
  for (const FinishedCollective& f : run(colls)) {
    std::snprintf(buf, sizeof buf, "%d %a %a\n", f.id, f.start, f.end);
    log += buf;
  }
  for (int l = 0; l < cluster.n_links(); ++l) {
    std::snprintf(buf, sizeof buf, "%d %a\n", l, colls.network().link_bytes(l));
    log += buf;
  }
  return log;
}

TEST(SimCollectives, TheSameCallsGiveByteIdenticalLogs) {
  const std::string a = mixed_run_log();
  EXPECT_GT(a.size(), 1000u);
  EXPECT_EQ(a, mixed_run_log());
}

}  // namespace
}  // namespace moe::sim
