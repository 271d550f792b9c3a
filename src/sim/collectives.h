// Collectives on the simulated network: each collective is decomposed into the point-to-point
// transfers of the algorithm NCCL uses, with the dependencies between them, and every transfer runs as
// a flow on a Network (network.h) over the route the Cluster gives (cluster.h). Several collectives
// may be in flight at once; their flows share links max-min fairly, so collectives sharing a link slow
// each other down.
//
// Algorithms (p members; S = CollectiveSpec::bytes; every transfer pays its path's alpha):
//   * allreduce, ring: 2(p-1) steps; in each, every member sends S/p to the next member of the ring
//     (reduce-scatter, then allgather). On a ring of identical links of bandwidth B and latency alpha:
//     2(p-1) * (alpha + S/(p B)).
//   * allreduce, hierarchical: per node, a ring reduce-scatter of S among the node's k members; per
//     local index j, a ring allreduce of the S/k shard among the j-th members of every node; per node,
//     a ring allgather of S. REQUIRES: every node holds the same number of members.
//   * allgather, reduce_scatter, ring: p-1 steps of S/p per member (S is the whole gathered output,
//     resp. the whole input each member reduces; each member contributes / ends with S/p).
//   * alltoallv, direct: every pair's bytes (peer_bytes) sent at once, zero entries and the diagonal
//     skipped: the "direct" alltoallv NCCL runs as grouped send/recv.
//   * broadcast, reduce: NCCL's pipelined ring (a chain): broadcast from the root along the ring order
//     (root, root+1, ...), reduce along (root+1, ..., root) into the root; S is cut into C chunks
//     (pipeline_chunks()) and each hop forwards chunk c after receiving it and after sending chunk c-1.
//     The broadcast and reduce groups of the sparse collectives (Hecate's SparseAllGather and
//     SparseReduceScatter, Pro-Prophet's Trans and Agg) are several of these in flight at once.
// Step dependencies are per member, as the data flows: in a ring a member's send of step s starts when
// its own send of step s-1 and its predecessor's send of step s-1 (the data it forwards) have ended;
// a phase's first transfers wait for both ends to have finished the previous phase.
//
// Driving it, as an executor does (see network.h for the clock):
//   int c = colls.start(spec);                      // at colls.now()
//   double t = std::min(colls.next_event_time(), t_compute);
//   for (const FinishedCollective& f : colls.advance(t)) ...
//
// Determinism: the same calls give the same results bit for bit. Thread safety: none. The Cluster must
// outlive the Collectives.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "sim/cluster.h"
#include "sim/network.h"

namespace moe::sim {

enum class CollectiveKind : uint8_t { allreduce, allgather, reduce_scatter, alltoallv, broadcast, reduce };
const char* collective_kind_name(CollectiveKind k);  // "allreduce", ...

struct CollectiveSpec {
  CollectiveKind kind = CollectiveKind::allreduce;
  // The members (device ids of the cluster), in ring order: member i is devices[i].
  std::vector<int> devices;
  // Bytes (see the algorithms above): allreduce, broadcast, reduce: the buffer; allgather: the whole
  // output; reduce_scatter: the whole input. Not used by alltoallv.
  double bytes = 0;
  // alltoallv: p * p entries, row-major: [i * p + j] = bytes member i sends to member j.
  std::vector<double> peer_bytes;
  int root = 0;               // broadcast, reduce: the root's member index
  bool hierarchical = false;  // allreduce only: the hierarchical algorithm
};

struct FinishedCollective {
  int id = -1;
  double start = 0, end = 0;
  // When member i's part ended: its last transfer (sent or received); `start` for a member without any.
  std::vector<double> member_end;
};

class Collectives {
 public:
  explicit Collectives(const Cluster& cluster);

  double now() const { return net_.now(); }
  // Starts a collective at now() and returns its id (reused after it has been reported finished).
  // A collective without transfers (one member, zero bytes) finishes at now(), reported by the next
  // advance(). REQUIRES (std::logic_error): distinct devices in range, at least one; bytes finite and
  // >= 0; peer_bytes of p * p finite entries >= 0 for alltoallv and empty otherwise; root a member
  // index for broadcast and reduce; hierarchical only for allreduce, with equal members per node.
  int start(const CollectiveSpec& spec);
  // The next time a transfer starts or ends, or a collective finishes; +inf when idle.
  double next_event_time();
  // Moves the clock to t; returns the collectives that finished at t, by ascending id.
  // REQUIRES: now() <= t <= next_event_time() (std::logic_error).
  std::vector<FinishedCollective> advance(double t);

  int in_flight() const { return in_flight_; }
  const Network& network() const { return net_; }
  const Cluster& cluster() const { return cluster_; }

 private:
  struct Transfer {
    int src = -1, dst = -1;  // member indices
    double bytes = 0;
    int deps_left = 0;
    int succ_begin = 0, succ_end = 0;  // its successors: successors[succ_begin, succ_end)
  };
  struct Running {
    double start = 0;
    std::vector<int> devices;
    std::vector<Transfer> transfers;
    std::vector<int> successors;
    int transfers_left = 0;
    std::vector<int> member_left;  // transfers touching each member that have not ended
    std::vector<double> member_end;
  };

  void validate(const CollectiveSpec& spec) const;
  void launch(int collective, int transfer);
  FinishedCollective finish(int collective);

  const Cluster& cluster_;
  Network net_;
  std::vector<Running> running_;
  std::vector<int> free_ids_;
  int in_flight_ = 0;
  std::vector<std::pair<int, int>> flow_owner_;  // by flow id: (collective, transfer)
  std::vector<int> finished_now_;                // collectives without transfers, finished at now()
};

// The number of chunks a pipelined chain of `hops` hops cuts `bytes` into: the C in [1, 256] that
// minimizes the uncontended time (C + hops - 1) * (alpha + bytes / (C * bandwidth)), near
// sqrt((hops - 1) * bytes / (bandwidth * alpha)) (the classic pipelined-broadcast segment size, as in
// Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations in MPICH",
// 2005). NCCL pipelines in slices of a few hundred KiB; the cap of 256 chunks bounds the number of
// flows. REQUIRES: hops >= 1, bytes >= 0, bandwidth > 0, alpha >= 0 (std::logic_error).
int pipeline_chunks(int hops, double bytes, double bandwidth, double alpha);

}  // namespace moe::sim
