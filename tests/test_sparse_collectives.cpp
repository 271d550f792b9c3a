// mpirun-ranks: 2 4
// Sparse collectives (src/comm/sparse_collectives.h). The planner is pure, so its tests replay
// plans symbolically on every rank (which chunks each rank holds after each round, and for the
// reduce-scatter which ranks' partials each rank's sum contains). The collectives run on exact,
// predictable data (value = f(chunk, element), integer-valued so that every sum is exact) and are
// compared element by element with the expected values and with the dense Communicator::allgather
// / reduce_scatter on the same data, on the world and on every expert- and data-parallel group;
// counts of wrong elements are summed over ranks so that every rank reports the same verdict.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <concepts>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/mpi_communicator.h"
#include "comm/sparse_collectives.h"
#include "mpi_test_env.h"
#include "util/str_cat.h"

namespace moe::comm {
namespace {

const ::testing::Environment* const g_env = ::testing::AddGlobalTestEnvironment(new MpiTestEnvironment({2}));

Communicator& world() { return *g_world; }

// The sum over all ranks (every rank gets the same number).
int64_t total(int64_t wrong) {
  EXPECT_TRUE(world().allreduce(&wrong, 1).is_ok());
  return wrong;
}

std::string label(const Communicator& c) {
  return str_cat("group '", c.name(), "' (rank ", c.rank(), " of ", c.size(), ")");
}

// Counts a mismatch and reports the first few of each check on stderr.
struct Counter {
  std::string what;
  int64_t wrong = 0;
  void expect(float got, float want, int64_t chunk, int64_t index) {
    if (got == want) return;
    if (wrong++ < 3)
      std::fprintf(stderr, "[rank %d] %s: chunk %ld element %ld is %.9g, expected %.9g\n", g_world->rank(),
                   what.c_str(), static_cast<long>(chunk), static_cast<long>(index), got, want);
  }
};

// A chunk's parameters: exact in float, different for every (chunk, element).
float param(int64_t c, int64_t i) { return static_cast<float>((uint64_t(c) * 7919 + uint64_t(i) * 31) % 16777213ull); }
// Rank r's partial gradient of chunk c: small integers, so any summation order is exact.
float partial(int r, int64_t c, int64_t i) { return static_cast<float>((r + 1) * ((c * 131 + i) % 1000)); }
constexpr float kSentinel = -7.0f;

bool holds(const Placement& p, int64_t c, int r) { return std::binary_search(p[c].begin(), p[c].end(), r); }

std::vector<int> all_ranks(int P) {
  std::vector<int> v(P);
  for (int r = 0; r < P; ++r) v[r] = r;
  return v;
}

// ---- placements ----

struct Case {
  std::string name;
  Placement p0, p1;
};

// Random placements (the same on every rank: the generator is seeded and rank-independent). Owners:
// one per chunk, or up to three where multi_owner; new replicas: per chunk none, some or all ranks.
Case random_case(int P, int64_t C, uint64_t seed, bool multi_owner) {
  std::mt19937_64 gen(seed);
  Case k;
  k.name = str_cat("random seed ", seed, multi_owner ? " (several owners)" : "");
  k.p0.resize(C), k.p1.resize(C);
  for (int64_t c = 0; c < C; ++c) {
    const int owners = multi_owner ? 1 + static_cast<int>(gen() % std::min(P, 3)) : 1;
    std::vector<int> ranks = all_ranks(P);
    std::shuffle(ranks.begin(), ranks.end(), gen);
    k.p0[c].assign(ranks.begin(), ranks.begin() + owners);
    std::sort(k.p0[c].begin(), k.p0[c].end());
    const double q = std::array<double, 3>{0.0, 0.4, 1.0}[gen() % 3];
    for (int r = 0; r < P; ++r)
      if (holds(k.p0, c, r) || std::uniform_real_distribution<double>(0, 1)(gen) < q) k.p1[c].push_back(r);
  }
  return k;
}

// The named corner cases, then random ones, for a group of P ranks.
std::vector<Case> cases(int P) {
  const int64_t C = 3 * P + 1;
  std::vector<Case> v;
  auto block_owners = [&](Case* k) {
    k->p0.resize(C);
    for (int64_t c = 0; c < C; ++c) k->p0[c] = {static_cast<int>(c % P)};
  };
  {
    Case k{"nothing moves (P1 = P0)", {}, {}};
    block_owners(&k);
    k.p1 = k.p0;
    v.push_back(k);
  }
  {
    Case k{"chunk 1 replicated everywhere, the others stay", {}, {}};
    block_owners(&k);
    k.p1 = k.p0;
    k.p1[1] = all_ranks(P);
    v.push_back(k);
  }
  {
    Case k{"every chunk everywhere (the dense allgather)", {}, {}};
    block_owners(&k);
    k.p1.assign(C, all_ranks(P));
    v.push_back(k);
  }
  {
    Case k{"rank 0 owns everything, every chunk everywhere (forwarding)", Placement(C, {0}),
           Placement(C, all_ranks(P))};
    v.push_back(k);
  }
  if (P > 1) {
    // The last rank holds nothing before or after; the others trade chunks.
    Case k{"last rank holds nothing", {}, {}};
    k.p0.resize(C), k.p1.resize(C);
    for (int64_t c = 0; c < C; ++c) {
      k.p0[c] = {static_cast<int>(c % (P - 1))};
      k.p1[c] = k.p0[c];
      if (c % 2 == 0 && P > 2) k.p1[c] = all_ranks(P - 1);
    }
    v.push_back(k);
    // The last rank owns nothing but receives every third chunk.
    Case g{"last rank owns nothing, receives some", k.p0, k.p0};
    for (int64_t c = 0; c < C; c += 3) g.p1[c].push_back(P - 1);
    v.push_back(g);
  }
  {
    Case k{"every chunk owned by every rank (nothing moves)", Placement(C, all_ranks(P)), Placement(C, all_ranks(P))};
    v.push_back(k);
  }
  for (uint64_t seed = 0; seed < 12; ++seed) v.push_back(random_case(P, C, seed, seed % 3 == 2));
  return v;
}

int64_t count_new(const Case& k, int r) {
  int64_t n = 0;
  for (size_t c = 0; c < k.p0.size(); ++c) n += holds(k.p1, c, r) && !holds(k.p0, c, r);
  return n;
}

// ---- symbolic replay of plans ----

// Checks the round rules and the allgather's effect; returns the failures as text (empty: fine).
std::string replay_allgather(const SparsePlan& plan, const Placement& p0, const Placement& p1) {
  const int P = plan.num_ranks;
  const int64_t C = plan.num_chunks;
  std::vector<std::vector<char>> has(C, std::vector<char>(P, 0));
  for (int64_t c = 0; c < C; ++c)
    for (int r : p0[c]) has[c][r] = 1;
  std::string err;
  for (size_t k = 0; k < plan.rounds.size(); ++k) {
    std::vector<int> sends(P, 0), recvs(P, 0);
    auto before = has;
    for (const ChunkTransfer& t : plan.rounds[k]) {
      const std::string at = str_cat("round ", k, " chunk ", t.chunk, ": ");
      if (++sends[t.src] > 1) err += at + "a second send\n";
      if (++recvs[t.dst] > 1) err += at + "a second receive\n";
      if (t.reduce) err += at + "a reduction in an allgather\n";
      if (!before[t.chunk][t.src]) err += at + "sender does not hold it\n";
      if (before[t.chunk][t.dst]) err += at + "receiver already holds it\n";
      if (!holds(p1, t.chunk, t.dst)) err += at + "receiver is not in P1\n";
      has[t.chunk][t.dst] = 1;
    }
  }
  for (int64_t c = 0; c < C; ++c)
    for (int r = 0; r < P; ++r)
      if (has[c][r] != holds(p1, c, r)) err += str_cat("chunk ", c, " rank ", r, " wrong at the end\n");
  return err;
}

// Replays a reduce-scatter plan with each rank's value as the set of ranks whose partials it sums:
// a reduction must not add a partial twice, a rank must not receive after it passed its sum on,
// and every owner must end with exactly the ranks of P1[c].
std::string replay_reduce_scatter(const SparsePlan& plan, const Placement& p1, const Placement& p0) {
  const int P = plan.num_ranks;
  const int64_t C = plan.num_chunks;
  std::vector<std::vector<uint64_t>> sum(C, std::vector<uint64_t>(P, 0));
  std::vector<std::vector<char>> passed(C, std::vector<char>(P, 0));
  for (int64_t c = 0; c < C; ++c)
    for (int r : p1[c]) sum[c][r] = uint64_t(1) << r;
  std::string err;
  for (size_t k = 0; k < plan.rounds.size(); ++k) {
    std::vector<int> sends(P, 0), recvs(P, 0);
    auto before = sum;
    for (const ChunkTransfer& t : plan.rounds[k]) {
      const std::string at = str_cat("round ", k, " chunk ", t.chunk, ": ");
      if (++sends[t.src] > 1) err += at + "a second send\n";
      if (++recvs[t.dst] > 1) err += at + "a second receive\n";
      if (!holds(p1, t.chunk, t.src) || !holds(p1, t.chunk, t.dst)) err += at + "a rank outside P1\n";
      if (t.reduce) {
        if (before[t.chunk][t.src] & before[t.chunk][t.dst]) err += at + "a partial added twice\n";
        if (passed[t.chunk][t.dst]) err += at + "received after passing its sum on\n";
        sum[t.chunk][t.dst] |= before[t.chunk][t.src];
        passed[t.chunk][t.src] = 1;
      } else {
        sum[t.chunk][t.dst] = before[t.chunk][t.src];
      }
    }
  }
  for (int64_t c = 0; c < C; ++c) {
    uint64_t want = 0;
    for (int r : p1[c]) want |= uint64_t(1) << r;
    for (int r : p0[c])
      if (sum[c][r] != want) err += str_cat("chunk ", c, " owner ", r, " lacks partials\n");
  }
  return err;
}

int64_t max_over_ranks(const SparsePlan& plan, bool sent) {
  int64_t m = 0;
  for (int r = 0; r < plan.num_ranks; ++r) m = std::max(m, sent ? bytes_sent(plan, r, 1) : bytes_received(plan, r, 1));
  return m;
}

// ---- plan tests (pure; every rank runs them) ----

TEST(SparsePlan, AllgatherMovesEachNewReplicaOnceFromAHolderWithinTheRoundRules) {
  for (int P : {1, 2, 3, 4, 8, 13}) {
    for (const Case& k : cases(P)) {
      SCOPED_TRACE(str_cat(k.name, ", ", P, " ranks"));
      SparsePlan plan = plan_sparse_allgather(k.p0, k.p1, P);
      EXPECT_EQ(plan.op, SparseOp::allgather);
      EXPECT_EQ(replay_allgather(plan, k.p0, k.p1), "");
      int64_t want_total = 0;
      for (int r = 0; r < P; ++r) {
        EXPECT_EQ(bytes_received(plan, r, 12), count_new(k, r) * 12) << "rank " << r;
        want_total += count_new(k, r) * 12;
      }
      EXPECT_EQ(total_bytes(plan, 12), want_total);
      std::vector<int64_t> m = peer_bytes(plan, 12);
      for (int r = 0; r < P; ++r) {
        int64_t row = 0, col = 0;
        for (int q = 0; q < P; ++q) row += m[r * P + q], col += m[q * P + r];
        EXPECT_EQ(row, bytes_sent(plan, r, 12));
        EXPECT_EQ(col, bytes_received(plan, r, 12));
        EXPECT_EQ(m[r * P + r], 0);
      }
      // Rounds: at least the lower bound (the most chunks a rank receives, or a sole owner sends
      // once each, one per round; a chunk's holders at most double per round), at most twice it.
      int64_t bound = max_over_ranks(plan, false);
      std::vector<int64_t> sole(P, 0);
      for (size_t c = 0; c < k.p0.size(); ++c) {
        if (k.p1[c].size() == k.p0[c].size()) continue;
        if (k.p0[c].size() == 1) bound = std::max(bound, ++sole[k.p0[c].front()]);
        bound = std::max(bound, static_cast<int64_t>(std::ceil(std::log2(double(k.p1[c].size()) / k.p0[c].size()))));
      }
      EXPECT_GE(static_cast<int64_t>(plan.rounds.size()), bound);
      EXPECT_LE(static_cast<int64_t>(plan.rounds.size()), 2 * bound);
      EXPECT_EQ(plan, plan_sparse_allgather(k.p0, k.p1, P)) << "not deterministic";
    }
  }
}

TEST(SparsePlan, ReduceScatterSumsEveryPartialOnceIntoEveryOwner) {
  for (int P : {1, 2, 3, 4, 8, 13}) {
    for (const Case& k : cases(P)) {
      SCOPED_TRACE(str_cat(k.name, ", ", P, " ranks"));
      SparsePlan plan = plan_sparse_reduce_scatter(k.p1, k.p0, P);
      EXPECT_EQ(plan.op, SparseOp::reduce_scatter);
      EXPECT_EQ(replay_reduce_scatter(plan, k.p1, k.p0), "");
      int64_t want_total = 0;
      bool one_owner = true;
      for (size_t c = 0; c < k.p0.size(); ++c) {
        want_total += static_cast<int64_t>(k.p1[c].size() - 1 + k.p0[c].size() - 1);
        one_owner &= k.p0[c].size() == 1;
      }
      EXPECT_EQ(total_bytes(plan, 1), want_total);
      if (one_owner) {
        // Exactly the ranks of P1 \ P0 send, each of its chunks once; owners only receive.
        for (int r = 0; r < P; ++r) EXPECT_EQ(bytes_sent(plan, r, 1), count_new(k, r)) << "rank " << r;
      }
      EXPECT_EQ(plan, plan_sparse_reduce_scatter(k.p1, k.p0, P)) << "not deterministic";
    }
  }
}

// Transfers between nodes in a plan.
int64_t crossings(const SparsePlan& plan, std::span<const int> node_of) {
  int64_t n = 0;
  for (const auto& round : plan.rounds)
    for (const ChunkTransfer& t : round) n += node_of[t.src] != node_of[t.dst];
  return n;
}

// A broadcast from `have` to `need` crosses into each node that needs the chunk and holds none: once.
int64_t least_crossings(const Placement& have, const Placement& need, std::span<const int> node_of) {
  int64_t n = 0;
  const int nodes = *std::max_element(node_of.begin(), node_of.end()) + 1;
  for (size_t c = 0; c < have.size(); ++c)
    for (int node = 0; node < nodes; ++node) {
      bool needs = false, has = false;
      for (int r : need[c]) needs |= node_of[r] == node && !holds(have, c, r);
      for (int r : have[c]) has |= node_of[r] == node;
      n += needs && !has;
    }
  return n;
}

TEST(SparsePlan, TopologyAwarePlansCrossIntoEachNodeOnce) {
  // 2 nodes x 2 ranks, chunk 0 of rank 0 wanted everywhere: one copy crosses (the flat plan sends
  // two), to rank 2, which passes it to rank 3; rank 1 gets it from rank 0.
  const std::vector<int> two_by_two{0, 0, 1, 1};
  const SparsePlan hot = plan_sparse_allgather({{0}}, {{0, 1, 2, 3}}, 4, two_by_two);
  EXPECT_EQ(replay_allgather(hot, {{0}}, {{0, 1, 2, 3}}), "");
  EXPECT_EQ(crossings(hot, two_by_two), 1);
  EXPECT_EQ(crossings(plan_sparse_allgather({{0}}, {{0, 1, 2, 3}}, 4), two_by_two), 2);
  for (int P : {2, 3, 4, 8, 13}) {
    std::mt19937 rng(static_cast<uint32_t>(P));
    for (int layout = 0; layout < 3; ++layout) {
      // Two equal nodes, nodes of 2 ranks (the last may hold 1), then random uneven nodes.
      std::vector<int> node_of(P);
      for (int r = 0; r < P; ++r)
        node_of[r] = layout == 0 ? 2 * r / P : layout == 1 ? r / 2 : static_cast<int>(rng() % 3);
      for (const Case& k : cases(P)) {
        SCOPED_TRACE(str_cat(k.name, ", ", P, " ranks, layout ", layout));
        const SparsePlan ag = plan_sparse_allgather(k.p0, k.p1, P, node_of);
        EXPECT_EQ(replay_allgather(ag, k.p0, k.p1), "");
        EXPECT_EQ(crossings(ag, node_of), least_crossings(k.p0, k.p1, node_of));
        EXPECT_EQ(ag, plan_sparse_allgather(k.p0, k.p1, P, node_of)) << "not deterministic";
        const SparsePlan rs = plan_sparse_reduce_scatter(k.p1, k.p0, P, node_of);
        EXPECT_EQ(replay_reduce_scatter(rs, k.p1, k.p0), "");
        Placement primary(k.p0.size());
        for (size_t c = 0; c < k.p0.size(); ++c) primary[c] = {k.p0[c].front()};
        EXPECT_EQ(crossings(rs, node_of),
                  least_crossings(primary, k.p1, node_of) + least_crossings(primary, k.p0, node_of));
      }
    }
  }
  EXPECT_THROW(plan_sparse_allgather({{0}}, {{0, 1}}, 2, std::vector<int>{0}), std::logic_error);
}

TEST(SparsePlan, BalancedHotChunksMeetTheReceiveBoundAndSpreadTheSends) {
  // Each of P ranks owns K chunks; h of each rank's chunks are replicated everywhere (Hecate's
  // first branch of Alg. 1 with the hot experts spread over owners). Every rank must receive
  // h (P - 1) chunks, one per round at most: the plan meets that bound, and no rank sends more.
  for (int P : {2, 4, 8}) {
    const int K = 4;
    for (int h : {1, 2, 4}) {
      SCOPED_TRACE(str_cat(P, " ranks, ", h, " hot chunks per rank"));
      Placement p0(P * K), p1(P * K);
      for (int c = 0; c < P * K; ++c) {
        p0[c] = {c / K};
        p1[c] = c % K < h ? all_ranks(P) : p0[c];
      }
      SparsePlan ag = plan_sparse_allgather(p0, p1, P);
      EXPECT_EQ(static_cast<int64_t>(ag.rounds.size()), int64_t(h) * (P - 1));
      EXPECT_EQ(max_over_ranks(ag, true), int64_t(h) * (P - 1));
      SparsePlan rs = plan_sparse_reduce_scatter(p1, p0, P);
      EXPECT_EQ(static_cast<int64_t>(rs.rounds.size()), int64_t(h) * (P - 1));
      EXPECT_EQ(max_over_ranks(rs, false), int64_t(h) * (P - 1));
    }
  }
}

TEST(SparsePlan, OneOwnerOfEveryHotChunkIsRelievedByForwarding) {
  // Rank 0 owns h chunks that every rank wants: sent directly that is h (P - 1) rounds and chunks
  // out of rank 0; forwarded through the receivers it is a pipelined broadcast, within log2 P
  // rounds (filling the tree) of the receive bound h, and no rank sends more than that.
  for (int P : {4, 8, 16}) {
    for (int h : {1, 4, 8}) {
      SCOPED_TRACE(str_cat(P, " ranks, ", h, " hot chunks"));
      Placement p0(h, std::vector<int>{0}), p1(h, all_ranks(P));
      SparsePlan ag = plan_sparse_allgather(p0, p1, P);
      const int log2p = static_cast<int>(std::ceil(std::log2(P)));
      EXPECT_LE(static_cast<int64_t>(ag.rounds.size()), h + log2p);
      EXPECT_LE(max_over_ranks(ag, true), h + log2p);
      SparsePlan rs = plan_sparse_reduce_scatter(p1, p0, P);
      EXPECT_EQ(rs.rounds.size(), ag.rounds.size());
      EXPECT_EQ(max_over_ranks(rs, false), max_over_ranks(ag, true));
    }
  }
}

TEST(SparsePlan, ViolatedRequiresThrowLogicError) {
  const Placement p0{{0}, {1}}, p1{{0, 1}, {1}};
  EXPECT_NO_THROW(plan_sparse_allgather(p0, p1, 2));
  EXPECT_THROW(plan_sparse_allgather(p0, p1, 0), std::logic_error);                        // no ranks
  EXPECT_THROW(plan_sparse_allgather(p0, Placement{{0, 1}}, 2), std::logic_error);         // chunk counts differ
  EXPECT_THROW(plan_sparse_allgather(p0, Placement{{1, 0}, {1}}, 2), std::logic_error);    // not ascending
  EXPECT_THROW(plan_sparse_allgather(p0, Placement{{0, 0}, {1}}, 2), std::logic_error);    // duplicate
  EXPECT_THROW(plan_sparse_allgather(p0, Placement{{0, 2}, {1}}, 2), std::logic_error);    // rank out of range
  EXPECT_THROW(plan_sparse_allgather(p0, Placement{{0}, {0}}, 2), std::logic_error);       // P1 lacks an owner
  EXPECT_THROW(plan_sparse_allgather(Placement{{0}, {}}, p1, 2), std::logic_error);        // chunk without owner
  EXPECT_THROW(plan_sparse_reduce_scatter(Placement{{0}, {0}}, p0, 2), std::logic_error);  // P1 lacks an owner
  try {
    plan_sparse_reduce_scatter(p1, Placement{{0}, {-1}}, 2);
    ADD_FAILURE() << "no exception";
  } catch (const std::logic_error& e) {
    EXPECT_STREQ(e.what(), "sparse_reduce_scatter plan: chunk 1: P0 lists rank -1, outside a group of 2");
  }
  SparsePlan plan = plan_sparse_allgather(p0, p1, 2);
  EXPECT_THROW(bytes_sent(plan, 2, 4), std::logic_error);
  EXPECT_THROW(bytes_received(plan, -1, 4), std::logic_error);
  EXPECT_THROW(total_bytes(plan, -4), std::logic_error);
}

// ---- the collectives on real ranks ----

// Every chunk has a buffer on every rank so that writes outside P1 show; where this rank is not in
// P1[c], odd chunks get a null pointer instead (which the collectives must accept).
struct Buffers {
  std::vector<std::vector<float>> data;
  std::vector<float*> ptrs;
  Buffers(const Case& k, int r, int64_t n) : data(k.p0.size()), ptrs(k.p0.size()) {
    for (size_t c = 0; c < data.size(); ++c) {
      data[c].assign(n, kSentinel);
      ptrs[c] = holds(k.p1, c, r) || c % 2 == 0 ? data[c].data() : nullptr;
    }
  }
};

// The dense reference of a sparse allgather: an allgather of every rank's whole chunk buffer, in
// which only a chunk's primary owner fills its chunk; returns chunk c = what its owner sent.
std::vector<float> dense_allgather(Communicator& comm, const Case& k, int64_t n) {
  const int P = comm.size(), r = comm.rank();
  const int64_t C = static_cast<int64_t>(k.p0.size());
  std::vector<float> mine(C * n, 0.0f), all(P * C * n);
  for (int64_t c = 0; c < C; ++c)
    if (k.p0[c].front() == r)
      for (int64_t i = 0; i < n; ++i) mine[c * n + i] = param(c, i);
  EXPECT_TRUE(comm.allgather(mine.data(), C * n, all.data()).is_ok());
  std::vector<float> ref(C * n);
  for (int64_t c = 0; c < C; ++c)
    std::copy_n(all.begin() + (k.p0[c].front() * C + c) * n, n, ref.begin() + c * n);
  return ref;
}

// The dense reference of a sparse reduce-scatter: every rank contributes its partials of the
// chunks it holds in P1 (zeros elsewhere) to a reduce_scatter over blocks of ceil(C/P) chunks, and
// an allgather of the blocks gives every rank every chunk's sum.
std::vector<float> dense_reduce_scatter(Communicator& comm, const Case& k, int64_t n) {
  const int P = comm.size(), r = comm.rank();
  const int64_t C = static_cast<int64_t>(k.p0.size()), per = (C + P - 1) / P, block = per * n;
  std::vector<float> send(P * block, 0.0f), mine(block), all(P * block);
  for (int64_t c = 0; c < C; ++c)
    if (holds(k.p1, c, r))
      for (int64_t i = 0; i < n; ++i) send[c * n + i] = partial(r, c, i);
  EXPECT_TRUE(comm.reduce_scatter(send.data(), mine.data(), block).is_ok());
  EXPECT_TRUE(comm.allgather(mine.data(), block, all.data()).is_ok());
  all.resize(C * n);
  return all;
}

int64_t check_allgather(Communicator& comm, const Case& k, int64_t n, std::span<const int> node_of = {}) {
  const int r = comm.rank();
  const int64_t C = static_cast<int64_t>(k.p0.size());
  Buffers b(k, r, n);
  for (int64_t c = 0; c < C; ++c)
    if (holds(k.p0, c, r))
      for (int64_t i = 0; i < n; ++i) b.data[c][i] = param(c, i);
  SparsePlan plan = plan_sparse_allgather(k.p0, k.p1, comm.size(), node_of);
  Status st = sparse_allgather(comm, plan, b.ptrs, n);
  EXPECT_TRUE(st.is_ok()) << st.message();
  std::vector<float> ref = dense_allgather(comm, k, n);
  Counter w{str_cat("sparse_allgather '", k.name, "' n ", n, " on ", label(comm))};
  for (int64_t c = 0; c < C; ++c) {
    const bool in_p1 = holds(k.p1, c, r);
    for (int64_t i = 0; i < n; ++i) {
      w.expect(b.data[c][i], in_p1 ? param(c, i) : kSentinel, c, i);
      if (in_p1) w.expect(b.data[c][i], ref[c * n + i], c, i);
    }
  }
  // Bytes: exactly this rank's new replicas in, the sum of |P1 \ P0| chunks in all.
  int64_t new_total = 0;
  for (int q = 0; q < comm.size(); ++q) new_total += count_new(k, q);
  if (bytes_received(plan, r, n * 4) != count_new(k, r) * n * 4) ++w.wrong;
  if (total_bytes(plan, n * 4) != new_total * n * 4) ++w.wrong;
  return w.wrong;
}

int64_t check_reduce_scatter(Communicator& comm, const Case& k, int64_t n, std::vector<float>* scratch,
                             std::span<const int> node_of = {}) {
  const int r = comm.rank();
  const int64_t C = static_cast<int64_t>(k.p0.size());
  Buffers b(k, r, n);
  for (int64_t c = 0; c < C; ++c)
    if (holds(k.p1, c, r))
      for (int64_t i = 0; i < n; ++i) b.data[c][i] = partial(r, c, i);
  SparsePlan plan = plan_sparse_reduce_scatter(k.p1, k.p0, comm.size(), node_of);
  Status st = sparse_reduce_scatter(comm, plan, b.ptrs, n, scratch);
  EXPECT_TRUE(st.is_ok()) << st.message();
  std::vector<float> ref = dense_reduce_scatter(comm, k, n);
  Counter w{str_cat("sparse_reduce_scatter '", k.name, "' n ", n, " on ", label(comm))};
  for (int64_t c = 0; c < C; ++c) {
    if (holds(k.p0, c, r)) {
      for (int64_t i = 0; i < n; ++i) {
        float want = 0;
        for (int q : k.p1[c]) want += partial(q, c, i);
        w.expect(b.data[c][i], want, c, i);
        w.expect(b.data[c][i], ref[c * n + i], c, i);
      }
    } else if (!holds(k.p1, c, r)) {
      for (int64_t i = 0; i < n; ++i) w.expect(b.data[c][i], kSentinel, c, i);
    }
  }
  return w.wrong;
}

// 1 element, a few KiB (eager messages), 280 KB (rendezvous).
constexpr int64_t kChunkElems[] = {1, 1000, 70000};

TEST(SparseCollectives, AllgatherMatchesDenseAllgatherOnCornerAndRandomPlacementsOnEveryGroup) {
  int64_t wrong = 0;
  for (Communicator* c : g_all_groups)
    for (const Case& k : cases(c->size()))
      for (int64_t n : kChunkElems) wrong += check_allgather(*c, k, n);
  EXPECT_EQ(total(wrong), 0);
}

TEST(SparseCollectives, ReduceScatterMatchesDenseReduceScatterOnCornerAndRandomPlacementsOnEveryGroup) {
  int64_t wrong = 0;
  std::vector<float> scratch;
  for (Communicator* c : g_all_groups)
    for (const Case& k : cases(c->size()))
      for (int64_t n : kChunkElems) wrong += check_reduce_scatter(*c, k, n, &scratch);
  EXPECT_EQ(total(wrong), 0);
}

// The topology-aware plans on the data: the group's ranks split into two "nodes" (lower and upper
// half), every corner and random case, both collectives exact.
TEST(SparseCollectives, TopologyAwarePlansMoveTheSameDataOnEveryGroup) {
  int64_t wrong = 0;
  std::vector<float> scratch;
  for (Communicator* c : g_all_groups) {
    std::vector<int> node_of(c->size());
    for (int r = 0; r < c->size(); ++r) node_of[r] = 2 * r / c->size();
    for (const Case& k : cases(c->size()))
      for (int64_t n : {int64_t{1}, int64_t{1000}}) {
        wrong += check_allgather(*c, k, n, node_of);
        wrong += check_reduce_scatter(*c, k, n, &scratch, node_of);
      }
  }
  EXPECT_EQ(total(wrong), 0);
}

TEST(SparseCollectives, ReduceScatterGivesEveryOwnerTheSameBitsEveryTime) {
  // Inexact sums: every owner of a chunk must get the same bits, and a second run the same again.
  const int P = world().size(), r = world().rank();
  const int64_t n = 20000;
  std::vector<float> scratch;
  int64_t wrong = 0;
  for (uint64_t seed : {3, 5, 8}) {
    Case k = random_case(P, 2 * P + 1, seed, true);
    SparsePlan plan = plan_sparse_reduce_scatter(k.p1, k.p0, P);
    const int64_t C = static_cast<int64_t>(k.p0.size());
    std::vector<int64_t> first;
    for (int run = 0; run < 2; ++run) {
      Buffers b(k, r, n);
      for (int64_t c = 0; c < C; ++c)
        if (holds(k.p1, c, r))
          for (int64_t i = 0; i < n; ++i) b.data[c][i] = std::sin(0.001f * i + r + c) / 3.0f;
      Status st = sparse_reduce_scatter(world(), plan, b.ptrs, n, &scratch);
      ASSERT_TRUE(st.is_ok()) << st.message();
      std::vector<int64_t> hash(C, 0), hashes(P * C);  // 0 where this rank owns nothing
      for (int64_t c = 0; c < C; ++c) {
        if (!holds(k.p0, c, r)) continue;
        uint64_t h = 1469598103934665603ull;
        for (float v : b.data[c]) {
          uint32_t bits;
          std::memcpy(&bits, &v, 4);
          h = (h ^ bits) * 1099511628211ull;
        }
        hash[c] = static_cast<int64_t>(h | 1);
      }
      ASSERT_TRUE(world().allgather(hash.data(), C, hashes.data()).is_ok());
      for (int64_t c = 0; c < C; ++c)
        for (int q : k.p0[c]) wrong += hashes[q * C + c] != hashes[k.p0[c].front() * C + c];
      if (run == 0) first = hashes;
      else wrong += hashes != first;
    }
  }
  EXPECT_EQ(total(wrong), 0);
}

TEST(SparseCollectives, EveryRankComputesTheSamePlan) {
  // Invariant 2 of docs/architecture.md: the plan is a function of the placements only.
  const int P = world().size();
  int64_t wrong = 0;
  for (const Case& k : cases(P)) {
    for (const SparsePlan& plan : {plan_sparse_allgather(k.p0, k.p1, P), plan_sparse_reduce_scatter(k.p1, k.p0, P)}) {
      uint64_t h = 1469598103934665603ull;
      for (const auto& round : plan.rounds) {
        for (const ChunkTransfer& t : round)
          for (int64_t v : {t.chunk, int64_t(t.src), int64_t(t.dst), int64_t(t.reduce)})
            h = (h ^ uint64_t(v)) * 1099511628211ull;
        h = (h ^ 0xffff) * 1099511628211ull;
      }
      int64_t mine = static_cast<int64_t>(h);
      std::vector<int64_t> all(P);
      ASSERT_TRUE(world().allgather(&mine, 1, all.data()).is_ok());
      for (int64_t v : all) wrong += v != all[0];
    }
  }
  EXPECT_EQ(total(wrong), 0);
}

TEST(SparseCollectives, ViolatedRequiresThrowWithoutCommunicating) {
  const int P = world().size();
  Placement p0(P), p1(P, all_ranks(P));
  for (int c = 0; c < P; ++c) p0[c] = {c};
  SparsePlan ag = plan_sparse_allgather(p0, p1, P), rs = plan_sparse_reduce_scatter(p1, p0, P);
  std::vector<float> data(P * 4, 0.0f), scratch;
  std::vector<float*> ptrs(P);
  for (int c = 0; c < P; ++c) ptrs[c] = data.data() + c * 4;
  EXPECT_THROW(sparse_allgather(world(), rs, ptrs, 4), std::logic_error);  // a reduce-scatter plan
  EXPECT_THROW(sparse_reduce_scatter(world(), ag, ptrs, 4, &scratch), std::logic_error);
  EXPECT_THROW(sparse_reduce_scatter(world(), rs, ptrs, 4, nullptr), std::logic_error);
  EXPECT_THROW(sparse_allgather(world(), ag, ptrs, -1), std::logic_error);
  EXPECT_THROW(sparse_allgather(world(), ag, std::span<float* const>(ptrs.data(), P - 1), 4), std::logic_error);
  SparsePlan other = plan_sparse_allgather(Placement{{0}}, Placement{{0}}, P + 1);
  EXPECT_THROW(sparse_allgather(world(), other, std::span<float* const>(ptrs.data(), 1), 4), std::logic_error);
  if (P > 1) {
    std::vector<float*> holes = ptrs;
    holes[(world().rank() + 1) % P] = nullptr;  // a chunk this rank receives
    try {
      (void)sparse_allgather(world(), ag, holes, 4);
      ADD_FAILURE() << "no exception";
    } catch (const std::logic_error& e) {
      const std::string want =
          str_cat("rank ", world().world_rank(), ": sparse_allgather on group 'world': null pointer for chunk ");
      EXPECT_EQ(std::string(e.what()).rfind(want, 0), 0u) << e.what();
    }
  }
  // Nothing was sent: the group still works.
  EXPECT_FALSE(world().broken());
  EXPECT_TRUE(world().barrier().is_ok());
}

TEST(SparseCollectives, CommunicationErrorNamesRankOperationRoundAndChunk) {
  // Rank 1 expects chunks of 16 floats, rank 0 sends 8: rank 1's receive fails, naming itself,
  // the operation, the group, the round and the chunk; the broken group is a duplicate so that the
  // world stays usable.
  const int P = world().size(), r = world().rank();
  std::unique_ptr<Communicator> dup;
  ASSERT_TRUE(world().dup("sparse_err", &dup).is_ok());
  dup->set_timeout(std::chrono::seconds(10));
  Placement p0{{0}}, p1{{0, 1}};
  SparsePlan plan = plan_sparse_allgather(p0, p1, P);
  std::vector<float> data(16, 1.0f);
  std::vector<float*> ptrs{data.data()};
  Status st = sparse_allgather(*dup, plan, ptrs, r == 1 ? 16 : 8);
  if (r == 1) {
    ASSERT_FALSE(st.is_ok());
    EXPECT_EQ(st.message().rfind("rank 1: sparse_allgather on group 'sparse_err': round 1 of 1 (receiving chunk 0 "
                                 "from rank 0): recv on group 'sparse_err': expected 16 elements from rank 0, got 8",
                                 0),
              0u)
        << st.message();
    EXPECT_TRUE(dup->broken());
  } else {
    EXPECT_TRUE(st.is_ok()) << st.message();
  }
  dup.reset();
  EXPECT_TRUE(world().barrier().is_ok());
}

}  // namespace
}  // namespace moe::comm
