// mpirun-ranks: 2 3 4
// Collectives on exact, predictable data (nccl-tests style): every element a rank sends is a
// function of (source rank, destination rank, index), so every received element (and every
// element of padding that must stay untouched) is checked exactly and the wrong ones counted.
// Each check runs on the world and on every expert-parallel and data-parallel group of every EP
// size that divides the rank count; the counts of wrong elements are summed over all ranks so that
// every rank reports the same verdict. Runs under mpirun (see tests/CMakeLists.txt).
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "comm/mpi_communicator.h"
#include "comm/topology.h"
#include "mpi_test_env.h"

namespace moe::comm {
namespace {

const ::testing::Environment* const g_env =
    ::testing::AddGlobalTestEnvironment(new MpiTestEnvironment({1, 2, kWorldSize}));

Communicator& world() { return *g_world; }

// The number of wrong elements over all ranks (every rank gets the same number).
int64_t total(int64_t wrong) {
  EXPECT_TRUE(world().allreduce(&wrong, 1).is_ok());
  return wrong;
}

std::string label(const Communicator& c) {
  return "group '" + c.name() + "' (rank " + std::to_string(c.rank()) + " of " + std::to_string(c.size()) + ")";
}

// Counts a mismatch and reports the first few of each check on stderr.
struct Counter {
  std::string what;
  int64_t wrong = 0;
  template <typename T>
  void expect(T got, T want, int64_t index) {
    if (got == want) return;
    if (wrong++ < 3)
      std::fprintf(stderr, "[rank %d] %s: element %ld is %.17g, expected %.17g\n", g_world->rank(), what.c_str(),
                   static_cast<long>(index), static_cast<double>(got), static_cast<double>(want));
  }
};

// Exact in float (< 2^24), different for every (src, dst, i) that a misrouted block could confuse.
float pattern(int src, int dst, int64_t i, int salt = 0) {
  return static_cast<float>((uint64_t(src) * 7919 + uint64_t(dst) * 104729 + uint64_t(i) * 31 + uint64_t(salt) * 13) %
                            16777213ull);
}
constexpr float kSentinel = -7.0f;

// ---- alltoallv ----

// Elements rank src sends to rank dst: uneven, zero for some pairs in one direction only, and
// nothing at all from the group's last rank.
int64_t a2a_count(int src, int dst, int P, int64_t scale) {
  if (P > 1 && src == P - 1) return 0;
  int64_t c = (src * 3 + dst * 5 + 1) % 4;
  return c == 0 ? 0 : c * scale + (src + dst) % 3;
}

int64_t check_alltoallv(Communicator& c, int64_t scale) {
  const int P = c.size(), r = c.rank();
  // Send blocks in reverse peer order with gaps of 3; receive blocks in peer order with gaps of 2.
  std::vector<int64_t> sc(P), sd(P), rc(P), rd(P);
  int64_t s_total = 0, r_total = 0;
  for (int p = P - 1; p >= 0; --p) sc[p] = a2a_count(r, p, P, scale), sd[p] = s_total, s_total += sc[p] + 3;
  for (int p = 0; p < P; ++p) rc[p] = a2a_count(p, r, P, scale), rd[p] = r_total, r_total += rc[p] + 2;
  std::vector<float> send(s_total, kSentinel), recv(r_total, kSentinel);
  for (int p = 0; p < P; ++p)
    for (int64_t i = 0; i < sc[p]; ++i) send[sd[p] + i] = pattern(r, p, i, static_cast<int>(scale));
  Status st = c.alltoallv(send.data(), sc, sd, recv.data(), rc, rd);
  EXPECT_TRUE(st.is_ok()) << st.message();
  Counter n{"alltoallv scale " + std::to_string(scale) + " on " + label(c)};
  for (int p = 0; p < P; ++p) {
    for (int64_t i = 0; i < rc[p]; ++i) n.expect(recv[rd[p] + i], pattern(p, r, i, static_cast<int>(scale)), rd[p] + i);
    for (int64_t i = rc[p]; i < rc[p] + 2; ++i) n.expect(recv[rd[p] + i], kSentinel, rd[p] + i);  // padding untouched
  }
  return n.wrong;
}

TEST(CommCollectives, AlltoallvUnevenSplitsWithEmptyBlocksOnEveryGroup) {
  int64_t wrong = 0;
  for (Communicator* c : g_all_groups)
    for (int64_t scale : {1, 100, 70000}) wrong += check_alltoallv(*c, scale);  // 70000: rendezvous-sized blocks
  EXPECT_EQ(total(wrong), 0);
}

TEST(CommCollectives, AlltoallInt64CountsThenAlltoallvAsTheMoeLayerDoes) {
  // The dispatch pattern: exchange per-peer counts with alltoall, then size the alltoallv from them.
  int64_t wrong = 0;
  for (Communicator* c : g_all_groups) {
    const int P = c->size(), r = c->rank();
    std::vector<int64_t> send_counts(P), recv_counts(P);
    for (int p = 0; p < P; ++p) send_counts[p] = a2a_count(r, p, P, 10);
    Status st = c->alltoall(send_counts.data(), recv_counts.data(), 1);
    EXPECT_TRUE(st.is_ok()) << st.message();
    Counter n{"alltoall int64 on " + label(*c)};
    for (int p = 0; p < P; ++p) n.expect(recv_counts[p], a2a_count(p, r, P, 10), p);
    wrong += n.wrong;
  }
  EXPECT_EQ(total(wrong), 0);
}

// ---- allreduce ----

int64_t check_allreduce(Communicator& c, int64_t count) {
  const int P = c.size(), r = c.rank();
  const int64_t tri = int64_t(P) * (P + 1) / 2;
  Counter n{"allreduce count " + std::to_string(count) + " on " + label(c)};
  std::vector<float> f(count);
  for (int64_t i = 0; i < count; ++i) f[i] = static_cast<float>((r + 1) * (i % 97));
  Status st = c.allreduce(f.data(), count);
  EXPECT_TRUE(st.is_ok()) << st.message();
  for (int64_t i = 0; i < count; ++i) n.expect(f[i], static_cast<float>(tri * (i % 97)), i);

  std::vector<double> d(count);
  for (int64_t i = 0; i < count; ++i) d[i] = 0.25 * (r + 1) * (i % 89);
  st = c.allreduce(d.data(), count);
  EXPECT_TRUE(st.is_ok()) << st.message();
  for (int64_t i = 0; i < count; ++i) n.expect(d[i], 0.25 * tri * (i % 89), i);

  std::vector<int64_t> mx(count), mn(count), sum(count);
  for (int64_t i = 0; i < count; ++i) mx[i] = mn[i] = r * 1000 + i % 7, sum[i] = 1'000'000'000'000 + r;
  st = c.allreduce(mx.data(), count, ReduceOp::max);
  EXPECT_TRUE(st.is_ok()) << st.message();
  st = c.allreduce(mn.data(), count, ReduceOp::min);
  EXPECT_TRUE(st.is_ok()) << st.message();
  st = c.allreduce(sum.data(), count);
  EXPECT_TRUE(st.is_ok()) << st.message();
  for (int64_t i = 0; i < count; ++i) {
    n.expect(mx[i], int64_t((P - 1) * 1000 + i % 7), i);
    n.expect(mn[i], int64_t(i % 7), i);
    n.expect(sum[i], int64_t(P) * 1'000'000'000'000 + tri - P, i);
  }
  return n.wrong;
}

TEST(CommCollectives, AllreduceFloatDoubleInt64OnEveryGroup) {
  int64_t wrong = 0;
  // 0 and counts below the group size (empty ring chunks), recursive doubling sizes, ring sizes.
  for (Communicator* c : g_all_groups)
    for (int64_t count : {0, 1, 3, 1000, 16384, 100003, (1 << 20) + 7}) wrong += check_allreduce(*c, count);
  EXPECT_EQ(total(wrong), 0);
}

TEST(CommCollectives, SleepingWaitsDeliverTheSameExactDataWhenPeersAreLate) {
  // WaitMode::sleep changes only how a rank waits: with each rank arriving 30 ms after the previous
  // one (so every wait but the last rank's passes its short phase and sleeps), the data is exact.
  std::unique_ptr<Communicator> c;
  ASSERT_TRUE(world().dup("sleeping", &c).is_ok());
  EXPECT_EQ(c->wait_mode(), WaitMode::poll);
  c->set_wait_mode(WaitMode::sleep);
  std::unique_ptr<Communicator> copy;
  ASSERT_TRUE(c->dup("sleeping-dup", &copy).is_ok());
  EXPECT_EQ(copy->wait_mode(), WaitMode::poll);  // not inherited
  const auto late = std::chrono::milliseconds(30 * c->rank());
  int64_t wrong = 0;
  for (int64_t count : {1, 100003}) {
    std::this_thread::sleep_for(late);
    wrong += check_allreduce(*c, count);
    std::this_thread::sleep_for(late);
    wrong += check_alltoallv(*c, count);
  }
  EXPECT_EQ(total(wrong), 0);
}

TEST(CommCollectives, AllreduceGivesBitwiseIdenticalResultsOnEveryRank) {
  // Inexact sums: the order of additions must be the same on every rank.
  int64_t wrong = 0;
  for (int64_t count : {1000, 100003}) {
    std::vector<float> f(count);
    for (int64_t i = 0; i < count; ++i) f[i] = std::sin(0.001f * i + world().rank()) / 3.0f;
    ASSERT_TRUE(world().allreduce(f.data(), count).is_ok());
    int64_t hash = 1469598103934665603ll;
    for (float v : f) {
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      hash = (hash ^ bits) * 1099511628211ll;
    }
    std::vector<int64_t> hashes(world().size());
    ASSERT_TRUE(world().allgather(&hash, 1, hashes.data()).is_ok());
    for (int64_t h : hashes) wrong += h != hashes[0];
  }
  EXPECT_EQ(total(wrong), 0);
}

// ---- allgather, allgatherv ----

int64_t check_allgather(Communicator& c, int64_t count) {
  const int P = c.size(), r = c.rank();
  Counter n{"allgather count " + std::to_string(count) + " on " + label(c)};
  std::vector<float> send(count), recv(count * P, kSentinel);
  for (int64_t i = 0; i < count; ++i) send[i] = pattern(r, 0, i);
  Status st = c.allgather(send.data(), count, recv.data());
  EXPECT_TRUE(st.is_ok()) << st.message();
  for (int p = 0; p < P; ++p)
    for (int64_t i = 0; i < count; ++i) n.expect(recv[p * count + i], pattern(p, 0, i), p * count + i);

  std::vector<int64_t> s64(count), r64(count * P, -1);
  for (int64_t i = 0; i < count; ++i) s64[i] = r * 1'000'000'000'000 + i;
  st = c.allgather(s64.data(), count, r64.data());
  EXPECT_TRUE(st.is_ok()) << st.message();
  for (int p = 0; p < P; ++p)
    for (int64_t i = 0; i < count; ++i) n.expect(r64[p * count + i], p * 1'000'000'000'000 + i, p * count + i);
  return n.wrong;
}

int64_t check_allgatherv(Communicator& c, int64_t scale) {
  const int P = c.size(), r = c.rank();
  // Every third rank contributes nothing; blocks land in reverse rank order with gaps of 1.
  auto count_of = [&](int p) -> int64_t { return p % 3 == 1 ? 0 : (p + 1) * scale + p; };
  std::vector<int64_t> counts(P), displs(P);
  int64_t total_len = 0;
  for (int p = P - 1; p >= 0; --p) counts[p] = count_of(p), displs[p] = total_len, total_len += counts[p] + 1;
  std::vector<float> send(count_of(r)), recv(total_len, kSentinel);
  for (int64_t i = 0; i < count_of(r); ++i) send[i] = pattern(r, 1, i);
  Status st = c.allgatherv(send.data(), count_of(r), recv.data(), counts, displs);
  EXPECT_TRUE(st.is_ok()) << st.message();
  Counter n{"allgatherv scale " + std::to_string(scale) + " on " + label(c)};
  for (int p = 0; p < P; ++p) {
    for (int64_t i = 0; i < counts[p]; ++i) n.expect(recv[displs[p] + i], pattern(p, 1, i), displs[p] + i);
    n.expect(recv[displs[p] + counts[p]], kSentinel, displs[p] + counts[p]);
  }
  return n.wrong;
}

TEST(CommCollectives, AllgatherAndAllgathervWithEmptyContributionsOnEveryGroup) {
  int64_t wrong = 0;
  for (Communicator* c : g_all_groups) {
    for (int64_t count : {0, 1, 1000, 300000}) wrong += check_allgather(*c, count);
    for (int64_t scale : {0, 5, 50000}) wrong += check_allgatherv(*c, scale);
  }
  EXPECT_EQ(total(wrong), 0);
}

// ---- reduce_scatter ----

int64_t check_reduce_scatter(Communicator& c, int64_t count) {
  const int P = c.size(), r = c.rank();
  const int64_t tri = int64_t(P) * (P + 1) / 2;
  std::vector<float> send(count * P), recv(count, kSentinel);
  for (int b = 0; b < P; ++b)
    for (int64_t i = 0; i < count; ++i) send[b * count + i] = static_cast<float>((r + 1) * ((b * 131 + i) % 1000));
  Status st = c.reduce_scatter(send.data(), recv.data(), count);
  EXPECT_TRUE(st.is_ok()) << st.message();
  Counter n{"reduce_scatter count " + std::to_string(count) + " on " + label(c)};
  for (int64_t i = 0; i < count; ++i) n.expect(recv[i], static_cast<float>(tri * ((r * 131 + i) % 1000)), i);

  std::vector<int64_t> s64(count * P), r64(count, -1);
  for (int b = 0; b < P; ++b)
    for (int64_t i = 0; i < count; ++i) s64[b * count + i] = (r == P - 1 ? 10'000 : 0) + b * 100 + i % 5;
  st = c.reduce_scatter(s64.data(), r64.data(), count, ReduceOp::max);
  EXPECT_TRUE(st.is_ok()) << st.message();
  for (int64_t i = 0; i < count; ++i) n.expect(r64[i], int64_t(10'000 + r * 100 + i % 5), i);
  return n.wrong;
}

TEST(CommCollectives, ReduceScatterOnEveryGroup) {
  int64_t wrong = 0;
  for (Communicator* c : g_all_groups)
    for (int64_t count : {0, 1, 1000, 250001}) wrong += check_reduce_scatter(*c, count);
  EXPECT_EQ(total(wrong), 0);
}

// ---- broadcast, reduce ----

TEST(CommCollectives, BroadcastFromEveryRootOnEveryGroup) {
  int64_t wrong = 0;
  for (Communicator* c : g_all_groups) {
    for (int root = 0; root < c->size(); ++root) {
      for (int64_t count : {1, 100000}) {
        std::vector<float> data(count, kSentinel);
        if (c->rank() == root)
          for (int64_t i = 0; i < count; ++i) data[i] = pattern(root, 2, i);
        Status st = c->broadcast(data.data(), count, root);
        EXPECT_TRUE(st.is_ok()) << st.message();
        Counter n{"broadcast from " + std::to_string(root) + " on " + label(*c)};
        for (int64_t i = 0; i < count; ++i) n.expect(data[i], pattern(root, 2, i), i);
        wrong += n.wrong;
      }
    }
  }
  EXPECT_EQ(total(wrong), 0);
}

TEST(CommCollectives, ReduceToEveryRootInPlaceAndNotOnEveryGroup) {
  int64_t wrong = 0;
  for (Communicator* c : g_all_groups) {
    const int P = c->size(), r = c->rank();
    const int64_t tri = int64_t(P) * (P + 1) / 2, count = 50000;
    for (int root = 0; root < P; ++root) {
      for (bool in_place : {false, true}) {
        std::vector<float> send(count), recv(count, kSentinel);
        for (int64_t i = 0; i < count; ++i) send[i] = static_cast<float>((r + 1) * (i % 97));
        float* out = r == root ? (in_place ? send.data() : recv.data()) : nullptr;
        Status st = c->reduce(send.data(), out, count, root);
        EXPECT_TRUE(st.is_ok()) << st.message();
        if (r != root) continue;
        Counter n{std::string("reduce ") + (in_place ? "in place " : "") + "to " + std::to_string(root) + " on " +
                  label(*c)};
        for (int64_t i = 0; i < count; ++i) n.expect(out[i], static_cast<float>(tri * (i % 97)), i);
        wrong += n.wrong;
      }
    }
  }
  EXPECT_EQ(total(wrong), 0);
}

// ---- point to point ----

TEST(CommCollectives, SendRecvPairsAndSendrecvRingOnEveryGroup) {
  int64_t wrong = 0;
  for (Communicator* c : g_all_groups) {
    const int P = c->size(), r = c->rank();
    for (int64_t count : {10, 200000}) {
      Counter n{"send/recv count " + std::to_string(count) + " on " + label(*c)};
      int peer = r ^ 1;  // pairs (0,1), (2,3), ...; the last rank of an odd group sits out
      if (peer < P) {
        std::vector<float> out(count), in(count, kSentinel);
        for (int64_t i = 0; i < count; ++i) out[i] = pattern(r, peer, i, 3);
        Status st1, st2;
        if (r % 2 == 0) st1 = c->send(out.data(), count, peer, 5), st2 = c->recv(in.data(), count, peer, 5);
        else st2 = c->recv(in.data(), count, peer, 5), st1 = c->send(out.data(), count, peer, 5);
        EXPECT_TRUE(st1.is_ok()) << st1.message();
        EXPECT_TRUE(st2.is_ok()) << st2.message();
        for (int64_t i = 0; i < count; ++i) n.expect(in[i], pattern(peer, r, i, 3), i);
      }
      // Ring: to the next rank, from the previous one (to itself in a group of one).
      int next = (r + 1) % P, prev = (r + P - 1) % P;
      std::vector<float> out(count), in(count, kSentinel);
      for (int64_t i = 0; i < count; ++i) out[i] = pattern(r, next, i, 4);
      Status st = c->sendrecv(out.data(), count, next, in.data(), count, prev, 9);
      EXPECT_TRUE(st.is_ok()) << st.message();
      for (int64_t i = 0; i < count; ++i) n.expect(in[i], pattern(prev, r, i, 4), i);
      wrong += n.wrong;
    }
  }
  EXPECT_EQ(total(wrong), 0);
}

// ---- groups ----

TEST(CommGroups, EpGroupsAreConsecutiveRanksAndDpGroupsShareRankModEp) {
  const int P = world().size(), r = world().rank();
  EXPECT_EQ(world().name(), "world");
  for (int p = 0; p < P; ++p) EXPECT_EQ(world().world_ranks()[p], p);
  for (const Groups& g : g_groups) {
    const int G = g.ep_size;
    EXPECT_EQ(g.dp_size, P / G);
    EXPECT_EQ(g.ep->size(), G);
    EXPECT_EQ(g.ep->rank(), r % G);
    EXPECT_EQ(g.ep->name(), "ep" + std::to_string(r / G));
    for (int k = 0; k < G; ++k) EXPECT_EQ(g.ep->world_ranks()[k], (r / G) * G + k);
    EXPECT_EQ(g.dp->size(), P / G);
    EXPECT_EQ(g.dp->rank(), r / G);
    EXPECT_EQ(g.dp->name(), "dp" + std::to_string(r % G));
    for (int k = 0; k < P / G; ++k) EXPECT_EQ(g.dp->world_ranks()[k], k * G + r % G);
  }
  Groups bad;
  Status st = make_groups(world(), P + 1, &bad);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("does not divide the " + std::to_string(P) + " ranks"), std::string::npos)
      << st.message();
}

TEST(CommGroups, SplitOrdersRanksAsListedAndRejectsInconsistentListsOnEveryRank) {
  const int P = world().size(), r = world().rank();
  std::vector<int> reversed(P);
  for (int p = 0; p < P; ++p) reversed[p] = P - 1 - p;
  std::unique_ptr<Communicator> rev;
  Status st = world().split(reversed, "reversed", &rev);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(rev->rank(), P - 1 - r);
  EXPECT_EQ(rev->world_ranks(), reversed);
  // The group works: a broadcast from its rank 0 (world rank P-1).
  int64_t x = r == P - 1 ? 42 : 0;
  ASSERT_TRUE(rev->broadcast(&x, 1, 0).is_ok());
  EXPECT_EQ(x, 42);

  if (P < 2) GTEST_SKIP() << "needs 2 ranks";
  // Rank 0 claims a group of its own; the others list everyone (rank 0 included).
  std::vector<int> members;
  if (r == 0) members = {0};
  else members.resize(P), std::iota(members.begin(), members.end(), 0);
  std::unique_ptr<Communicator> bad;
  st = world().split(members, "bad", &bad);
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("do not form consistent groups"), std::string::npos) << st.message();
  EXPECT_EQ(bad, nullptr);
  EXPECT_FALSE(world().broken());
  EXPECT_TRUE(world().barrier().is_ok());  // the parent is still usable

  EXPECT_THROW(world().split(std::vector<int>{(r + 1) % P}, "x", &bad), std::logic_error);  // without itself
}

// ---- topology ----

TEST(CommTopology, DetectedFromSharedMemoryAndOverriddenByRanksPerNode) {
  const int P = world().size(), r = world().rank();
  Topology t;
  Status st = detect_topology(world(), 0, &t);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(t.world_size(), P);
  EXPECT_EQ(t.n_nodes(), 1) << "all test ranks run on this machine";
  EXPECT_EQ(t.local_rank(r), r);
  EXPECT_EQ(t.ranks_per_node(), P);

  const int rpn = P % 2 == 0 ? 2 : 1;  // one machine standing in for P / rpn nodes
  st = detect_topology(world(), rpn, &t);
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(t.n_nodes(), P / rpn);
  EXPECT_EQ(t.ranks_per_node(), rpn);
  for (int p = 0; p < P; ++p) {
    EXPECT_EQ(t.node_of(p), p / rpn);
    EXPECT_EQ(t.local_rank(p), p % rpn);
    EXPECT_EQ(t.same_node(p, 0), p < rpn);
  }
  if (P == 4) {
    EXPECT_EQ(t.describe(), "2 nodes x 2 ranks");
  }

  st = detect_topology(world(), P + 1, &t);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("--ranks-per-node " + std::to_string(P + 1) + " does not divide the " +
                              std::to_string(P) + " ranks"),
            std::string::npos)
      << st.message();
}

TEST(CommTopology, ExplicitMapsNumberLocalRanksInRankOrder) {
  Topology t({0, 0, 1, 1, 0});
  EXPECT_EQ(t.n_nodes(), 2);
  EXPECT_EQ(t.local_rank(4), 2);
  EXPECT_EQ(t.ranks_of_node(0), (std::vector<int>{0, 1, 4}));
  EXPECT_EQ(t.ranks_per_node(), 3);
  EXPECT_FALSE(t.uniform());
  EXPECT_EQ(t.describe(), "2 nodes (3, 2 ranks)");
  EXPECT_THROW(Topology({1, 0}), std::logic_error);
  EXPECT_THROW(Topology::uniform(4, 3), std::logic_error);
}

// ---- errors ----

TEST(CommErrors, BadArgumentsThrowBeforeCommunicating) {
  const int P = world().size();
  std::vector<int64_t> short_counts(P + 1, 0), counts(P, 0);
  float x = 0;
  EXPECT_THROW(world().alltoallv(&x, short_counts, counts, &x, counts, counts), std::logic_error);
  EXPECT_THROW(world().allreduce(&x, -1), std::logic_error);
  EXPECT_THROW(world().broadcast(&x, 1, P), std::logic_error);
  EXPECT_THROW(world().send(&x, 1, world().rank()), std::logic_error);
  EXPECT_FALSE(world().broken());
}

TEST(CommErrors, CountBeyondMpiIntRangeIsAnError) {
  std::unique_ptr<Communicator> c;
  ASSERT_TRUE(world().dup("big", &c).is_ok());
  float x = 0;
  Status st = c->broadcast(&x, int64_t(1) << 31, 0);  // fails before touching the buffer
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("broadcast on group 'big': count or displacement 2147483648 exceeds MPI's int range"),
            std::string::npos)
      << st.message();
  EXPECT_TRUE(c->broken());
  st = c->barrier();
  EXPECT_NE(st.message().find("unusable after an earlier error"), std::string::npos) << st.message();
}

TEST(CommErrors, MpiErrorBecomesStatusNamingRankOpAndGroup) {
  // Rank 1 receives fewer elements than rank 0 sends: MPI reports truncation.
  if (world().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  std::unique_ptr<Communicator> c;
  ASSERT_TRUE(world().dup("trunc", &c).is_ok());
  float out[8] = {}, in[4] = {};
  if (c->rank() == 0) {
    Status st = c->send(out, 8, 1);
    EXPECT_TRUE(st.is_ok()) << st.message();
  } else if (c->rank() == 1) {
    Status st = c->recv(in, 4, 0);
    ASSERT_FALSE(st.is_ok());
    EXPECT_NE(st.message().find("rank 1: recv on group 'trunc': MPI_ERR_TRUNCATE"), std::string::npos)
        << st.message();
  }
  EXPECT_TRUE(world().barrier().is_ok());
}

TEST(CommErrors, CollectiveThatAPeerSkipsTimesOutNamingTheOpThenCompletesWhenItJoins) {
  // Rank 1 is late for an alltoallv: the others get an error after 1 s naming the operation and
  // group. Then rank 1 joins, completing the operation the others left pending; their communicator
  // stays broken and its destructor waits for that operation before freeing it. The waits sleep
  // here (WaitMode::sleep); test_comm_failure times out polling ones. (Not both here: the late
  // rank's messages to a receive already cancelled can meet a later communicator's receives.)
  const int P = world().size(), r = world().rank();
  if (P < 2) GTEST_SKIP() << "needs 2 ranks";
  std::vector<float> send(P), recv(P, kSentinel);
  for (int p = 0; p < P; ++p) send[p] = pattern(r, p, 0);
  std::vector<int64_t> ones(P, 1), displs(P);
  std::iota(displs.begin(), displs.end(), 0);
  {
    std::unique_ptr<Communicator> c;
    ASSERT_TRUE(world().dup("timeout-test", &c).is_ok());
    c->set_wait_mode(WaitMode::sleep);
    c->set_timeout(std::chrono::seconds(1));
    if (r != 1) {
      auto t0 = std::chrono::steady_clock::now();
      Status st = c->alltoallv(send.data(), ones, displs, recv.data(), ones, displs);
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      ASSERT_FALSE(st.is_ok());
      EXPECT_NE(st.message().find("rank " + std::to_string(r) +
                                  ": alltoallv on group 'timeout-test' did not complete within 1 s"),
                std::string::npos)
          << st.message();
      EXPECT_NE(st.message().find("a peer rank died or stopped?"), std::string::npos) << st.message();
      EXPECT_GE(s, 0.9);
      EXPECT_LT(s, 5.0);
      st = c->barrier();
      EXPECT_NE(st.message().find("unusable after an earlier error"), std::string::npos) << st.message();
      c->set_timeout(std::chrono::seconds(15));  // how long the destructor waits for the late rank
    }
    ASSERT_TRUE(world().barrier().is_ok());  // rank 1 passes only once the others have given up
    if (r == 1) {
      Status st = c->alltoallv(send.data(), ones, displs, recv.data(), ones, displs);
      ASSERT_TRUE(st.is_ok()) << st.message();
      Counter n{"late alltoallv"};
      for (int p = 0; p < P; ++p) n.expect(recv[p], pattern(p, r, 0), p);
      EXPECT_EQ(n.wrong, 0);
    }
  }
  EXPECT_TRUE(world().barrier().is_ok());
}

}  // namespace
}  // namespace moe::comm
