// Sparse collectives: the planner (pure) and the executors. See sparse_collectives.h.
#include "comm/sparse_collectives.h"
#include "util/str_cat.h"

#include <algorithm>
#include <concepts>
#include <iterator>
#include <stdexcept>
#include <string>
#include <utility>

namespace moe::comm {
namespace {

[[noreturn]] void fail(const char* op, const std::string& what) { throw std::logic_error(str_cat(op, " plan: ", what)); }

void check_list(const char* op, const char* name, size_t c, const std::vector<int>& list, int num_ranks) {
  for (size_t i = 0; i < list.size(); ++i) {
    if (list[i] < 0 || list[i] >= num_ranks)
      fail(op, str_cat("chunk ", c, ": ", name, " lists rank ", list[i], ", outside a group of ", num_ranks));
    if (i > 0 && list[i] <= list[i - 1]) fail(op, str_cat("chunk ", c, ": ", name, "'s ranks are not strictly ascending"));
  }
}

// REQUIRES of both planners: `before` are the owners, `after` ⊇ before the holders after.
void check_placements(const char* op, const Placement& before, const Placement& after, int num_ranks) {
  if (num_ranks < 1) fail(op, str_cat("a group of ", num_ranks, " ranks"));
  if (before.size() != after.size()) fail(op, str_cat("P0 has ", before.size(), " chunks, P1 has ", after.size()));
  for (size_t c = 0; c < before.size(); ++c) {
    check_list(op, "P0", c, before[c], num_ranks);
    check_list(op, "P1", c, after[c], num_ranks);
    if (before[c].empty()) fail(op, str_cat("chunk ", c, " has no owner in P0"));
    if (!std::includes(after[c].begin(), after[c].end(), before[c].begin(), before[c].end()))
      fail(op, str_cat("chunk ", c, ": P1 does not contain every rank of P0"));
  }
}

void check_nodes(const char* op, std::span<const int> node_of, int num_ranks) {
  if (!node_of.empty() && static_cast<int>(node_of.size()) != num_ranks)
    fail(op, str_cat("node_of has ", node_of.size(), " entries for ", num_ranks, " ranks"));
}

// Schedules, for every chunk c, its broadcast from the ranks in have[c] to the ranks in need[c]
// (disjoint from have[c]), in rounds where each rank sends at most one chunk and receives at most
// one, forwarding allowed from the round after a rank received a chunk. Round by round: a maximum
// matching of receivers to senders that hold one of their missing chunks (Kuhn's augmenting paths;
// receivers with most missing chunks tried first, because they bound the number of rounds;
// candidate senders in order of fewest chunks sent so far, then rank, which spreads the sending
// over forwarders), then each matched pair moves the missing chunk with fewest holders (ties: lowest
// chunk), so that scarce chunks gain forwarders early. Every round moves at least one chunk (each
// missing chunk has a holder, and no rank needs a chunk it holds), so it terminates with
// sum |need[c]| transfers in at most that many rounds.
// With nodes (node_of non-empty), a chunk enters a node once: a rank takes it from a holder on its own
// node; only the node's entry for the chunk (the lowest rank there that needs it, when no rank there
// holds it) takes it from another node, and the node's other ranks wait for a copy on their node. Every
// round still moves a chunk (an entry can always receive), so it terminates as above.
std::vector<std::vector<ChunkTransfer>> schedule_broadcasts(const Placement& have, const Placement& need, int P,
                                                            std::span<const int> node_of) {
  const int64_t C = static_cast<int64_t>(have.size());
  std::vector<char> holds(C * P, 0);  // holds[c * P + r]
  std::vector<int> holders(C, 0);
  std::vector<std::vector<int64_t>> missing(P);  // per rank, ascending chunks
  std::vector<char> entry(C * P, 0);             // entry[c * P + r]: r may take c across nodes
  for (int64_t c = 0; c < C; ++c) {
    for (int r : have[c]) holds[c * P + r] = 1;
    holders[c] = static_cast<int>(have[c].size());
    for (int r : need[c]) missing[r].push_back(c);
    for (int r : need[c]) {
      bool node_has = false;
      for (int q = 0; q < P && !node_has && !node_of.empty(); ++q)
        node_has = node_of[q] == node_of[r] && (holds[c * P + q] || (q < r && std::binary_search(need[c].begin(), need[c].end(), q)));
      entry[c * P + r] = node_of.empty() || !node_has;
    }
  }
  // s may send c to d now: it holds c, and d may take c from s's node.
  auto may_send = [&](int s, int d, int64_t c) {
    return holds[c * P + s] && (node_of.empty() || node_of[s] == node_of[d] || entry[c * P + d]);
  };
  std::vector<int64_t> sent(P, 0);
  std::vector<std::vector<ChunkTransfer>> rounds;

  std::vector<int> receivers, sender_of(P), receiver_of(P);
  std::vector<std::vector<int>> candidates(P);
  std::vector<char> seen(P);
  std::vector<int> order(P);
  for (int r = 0; r < P; ++r) order[r] = r;

  for (;;) {
    receivers.clear();
    for (int r = 0; r < P; ++r)
      if (!missing[r].empty()) receivers.push_back(r);
    if (receivers.empty()) break;
    std::stable_sort(receivers.begin(), receivers.end(),
                     [&](int a, int b) { return missing[a].size() > missing[b].size(); });
    std::sort(order.begin(), order.end(), [&](int a, int b) { return sent[a] != sent[b] ? sent[a] < sent[b] : a < b; });
    for (int d : receivers) {
      candidates[d].clear();
      for (int s : order) {
        if (s == d) continue;
        for (int64_t c : missing[d])
          if (may_send(s, d, c)) {
            candidates[d].push_back(s);
            break;
          }
      }
    }
    std::fill(sender_of.begin(), sender_of.end(), -1);    // receiver -> sender
    std::fill(receiver_of.begin(), receiver_of.end(), -1);  // sender -> receiver
    // Kuhn's augmenting path from receiver d; a matched receiver stays matched.
    auto augment = [&](auto& self, int d) -> bool {
      for (int s : candidates[d]) {
        if (seen[s]) continue;
        seen[s] = 1;
        if (receiver_of[s] < 0 || self(self, receiver_of[s])) {
          receiver_of[s] = d, sender_of[d] = s;
          return true;
        }
      }
      return false;
    };
    for (int d : receivers) {
      std::fill(seen.begin(), seen.end(), 0);
      augment(augment, d);
    }

    std::vector<ChunkTransfer> round;
    for (int d = 0; d < P; ++d) {
      const int s = sender_of[d];
      if (s < 0) continue;
      int64_t best = -1;
      for (int64_t c : missing[d])
        if (may_send(s, d, c) && (best < 0 || holders[c] < holders[best])) best = c;
      round.push_back({best, s, d, false});
    }
    // Apply after choosing, so that nothing received in this round is forwarded in it.
    for (const ChunkTransfer& t : round) {
      holds[t.chunk * P + t.dst] = 1;
      ++holders[t.chunk];
      ++sent[t.src];
      auto& m = missing[t.dst];
      m.erase(std::find(m.begin(), m.end(), t.chunk));
    }
    rounds.push_back(std::move(round));
  }
  return rounds;
}

// need[c] = after[c] \ have[c] (both ascending).
Placement difference(const Placement& after, const Placement& have) {
  Placement need(after.size());
  for (size_t c = 0; c < after.size(); ++c)
    std::set_difference(after[c].begin(), after[c].end(), have[c].begin(), have[c].end(),
                        std::back_inserter(need[c]));
  return need;
}

void check_bytes_args(const SparsePlan& plan, int rank, int64_t chunk_bytes) {
  if (rank < 0 || rank >= plan.num_ranks)
    fail(sparse_op_name(plan.op), str_cat("rank ", rank, " outside a group of ", plan.num_ranks));
  if (chunk_bytes < 0) fail(sparse_op_name(plan.op), str_cat("negative chunk_bytes ", chunk_bytes));
}

// ---- execution ----

[[noreturn]] void fail_run(const Communicator& comm, SparseOp op, const std::string& what) {
  throw std::logic_error(str_cat(comm.where(sparse_op_name(op)), ": ", what));
}

// Hot path: messages are only built on failure.
void check_run_args(const Communicator& comm, SparseOp op, const SparsePlan& plan, std::span<float* const> chunks,
                    int64_t chunk_elems) {
  if (plan.op != op) fail_run(comm, op, str_cat("given a plan of ", sparse_op_name(plan.op)));
  if (plan.num_ranks != comm.size())
    fail_run(comm, op, str_cat("the plan is for ", plan.num_ranks, " ranks, the group has ", comm.size()));
  if (chunk_elems < 0) fail_run(comm, op, str_cat("negative chunk_elems ", chunk_elems));
  if (static_cast<int64_t>(chunks.size()) != plan.num_chunks)
    fail_run(comm, op, str_cat(chunks.size(), " chunk pointers for a plan of ", plan.num_chunks, " chunks"));
  const int r = comm.rank();
  for (const auto& round : plan.rounds)
    for (const ChunkTransfer& t : round)
      if ((t.src == r || t.dst == r) && chunks[t.chunk] == nullptr)
        fail_run(comm, op, str_cat("null pointer for chunk ", t.chunk, ", which this rank sends or receives"));
}

// This rank's send and receive in one round (null where it has none).
struct Step {
  const ChunkTransfer* send = nullptr;
  const ChunkTransfer* recv = nullptr;
};

Step step_of(const std::vector<ChunkTransfer>& round, int r) {
  Step s;
  for (const ChunkTransfer& t : round) {
    if (t.src == r) s.send = &t;
    if (t.dst == r) s.recv = &t;
  }
  return s;
}

// "rank 1: sparse_allgather on group 'world': round 3 of 8 (sending chunk 2 to rank 0, receiving
// chunk 5 from rank 3): <the point-to-point error without its own "rank 1: " prefix>".
Status round_error(const Communicator& comm, SparseOp op, size_t k, size_t rounds, const Step& s, const Status& st) {
  std::string m = str_cat(comm.where(sparse_op_name(op)), ": round ", k + 1, " of ", rounds, " (");
  if (s.send) m += str_cat("sending chunk ", s.send->chunk, " to rank ", comm.world_ranks()[s.send->dst]);
  if (s.send && s.recv) m += ", ";
  if (s.recv) m += str_cat("receiving chunk ", s.recv->chunk, " from rank ", comm.world_ranks()[s.recv->src]);
  m += "): ";
  const std::string prefix = str_cat("rank ", comm.world_rank(), ": ");
  const std::string& inner = st.message();
  m.append(inner, inner.rfind(prefix, 0) == 0 ? prefix.size() : 0);
  return Status::error(std::move(m));
}

void add_into(float* __restrict dst, const float* __restrict src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

Status run(Communicator& comm, const SparsePlan& plan, std::span<float* const> chunks, int64_t n,
           std::vector<float>* scratch) {
  const int r = comm.rank();
  if (n == 0) return Status::ok();
  for (size_t k = 0; k < plan.rounds.size(); ++k) {
    const Step s = step_of(plan.rounds[k], r);
    if (!s.send && !s.recv) continue;
    // A reduction receives into scratch and adds after the round; a copy lands in place.
    float* in = nullptr;
    if (s.recv) {
      if (s.recv->reduce) {
        if (static_cast<int64_t>(scratch->size()) < n) scratch->resize(n);
        in = scratch->data();
      } else {
        in = chunks[s.recv->chunk];
      }
    }
    Status st;
    if (s.send && s.recv)
      st = comm.sendrecv(chunks[s.send->chunk], n, s.send->dst, in, n, s.recv->src, kSparseCollectiveTag);
    else if (s.send)
      st = comm.send(chunks[s.send->chunk], n, s.send->dst, kSparseCollectiveTag);
    else
      st = comm.recv(in, n, s.recv->src, kSparseCollectiveTag);
    if (!st) return round_error(comm, plan.op, k, plan.rounds.size(), s, st);
    if (s.recv && s.recv->reduce) add_into(chunks[s.recv->chunk], in, n);
  }
  return Status::ok();
}

}  // namespace

const char* sparse_op_name(SparseOp op) {
  switch (op) {
    case SparseOp::allgather: return "sparse_allgather";
    case SparseOp::reduce_scatter: return "sparse_reduce_scatter";
  }
  return "?";
}

SparsePlan plan_sparse_allgather(const Placement& p0, const Placement& p1, int num_ranks,
                                 std::span<const int> node_of) {
  check_placements("sparse_allgather", p0, p1, num_ranks);
  check_nodes("sparse_allgather", node_of, num_ranks);
  SparsePlan plan;
  plan.op = SparseOp::allgather;
  plan.num_ranks = num_ranks;
  plan.num_chunks = static_cast<int64_t>(p0.size());
  plan.rounds = schedule_broadcasts(p0, difference(p1, p0), num_ranks, node_of);
  return plan;
}

SparsePlan plan_sparse_reduce_scatter(const Placement& p1, const Placement& p0, int num_ranks,
                                      std::span<const int> node_of) {
  check_placements("sparse_reduce_scatter", p0, p1, num_ranks);
  check_nodes("sparse_reduce_scatter", node_of, num_ranks);
  // The reduction tree of chunk c is the broadcast tree from its primary owner over P1[c], played
  // backwards (round k of R becomes round R-1-k, src and dst swapped): a rank receives from its
  // children before it sends to its parent, since in the broadcast it received before forwarding.
  Placement primary(p0.size());
  for (size_t c = 0; c < p0.size(); ++c) primary[c] = {p0[c].front()};
  auto reduce_rounds = schedule_broadcasts(primary, difference(p1, primary), num_ranks, node_of);
  auto copy_rounds = schedule_broadcasts(primary, difference(p0, primary), num_ranks, node_of);

  SparsePlan plan;
  plan.op = SparseOp::reduce_scatter;
  plan.num_ranks = num_ranks;
  plan.num_chunks = static_cast<int64_t>(p0.size());
  for (auto it = reduce_rounds.rbegin(); it != reduce_rounds.rend(); ++it) {
    std::vector<ChunkTransfer> round;
    for (const ChunkTransfer& t : *it) round.push_back({t.chunk, t.dst, t.src, true});
    std::sort(round.begin(), round.end(), [](const ChunkTransfer& a, const ChunkTransfer& b) { return a.dst < b.dst; });
    plan.rounds.push_back(std::move(round));
  }
  for (auto& round : copy_rounds) plan.rounds.push_back(std::move(round));
  return plan;
}

int64_t bytes_sent(const SparsePlan& plan, int rank, int64_t chunk_bytes) {
  check_bytes_args(plan, rank, chunk_bytes);
  int64_t n = 0;
  for (const auto& round : plan.rounds)
    for (const ChunkTransfer& t : round) n += t.src == rank;
  return n * chunk_bytes;
}

int64_t bytes_received(const SparsePlan& plan, int rank, int64_t chunk_bytes) {
  check_bytes_args(plan, rank, chunk_bytes);
  int64_t n = 0;
  for (const auto& round : plan.rounds)
    for (const ChunkTransfer& t : round) n += t.dst == rank;
  return n * chunk_bytes;
}

int64_t total_bytes(const SparsePlan& plan, int64_t chunk_bytes) {
  check_bytes_args(plan, 0, chunk_bytes);
  int64_t n = 0;
  for (const auto& round : plan.rounds) n += static_cast<int64_t>(round.size());
  return n * chunk_bytes;
}

std::vector<int64_t> peer_bytes(const SparsePlan& plan, int64_t chunk_bytes) {
  check_bytes_args(plan, 0, chunk_bytes);
  std::vector<int64_t> m(static_cast<size_t>(plan.num_ranks) * plan.num_ranks, 0);
  for (const auto& round : plan.rounds)
    for (const ChunkTransfer& t : round) m[static_cast<size_t>(t.src) * plan.num_ranks + t.dst] += chunk_bytes;
  return m;
}

Status sparse_allgather(Communicator& comm, const SparsePlan& plan, std::span<float* const> chunks,
                        int64_t chunk_elems) {
  check_run_args(comm, SparseOp::allgather, plan, chunks, chunk_elems);
  return run(comm, plan, chunks, chunk_elems, nullptr);
}

Status sparse_reduce_scatter(Communicator& comm, const SparsePlan& plan, std::span<float* const> chunks,
                             int64_t chunk_elems, std::vector<float>* scratch) {
  check_run_args(comm, SparseOp::reduce_scatter, plan, chunks, chunk_elems);
  if (scratch == nullptr) fail_run(comm, SparseOp::reduce_scatter, "null scratch");
  return run(comm, plan, chunks, chunk_elems, scratch);
}

}  // namespace moe::comm
