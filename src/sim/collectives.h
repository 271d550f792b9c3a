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
//   * rounds: the point-to-point rounds of a comm::SparsePlan (comm/sparse_collectives.h), as the
//     runtime runs Hecate's sparse collectives: in each round a member makes one blocking call (send,
//     recv, or sendrecv when it does both) and moves on to its next round only when that call ended,
//     so a transfer starts when the transfers of both its ends' previous active rounds have ended. A
//     member skips rounds without transfers of its own (no barrier). Every transfer pays its path's
//     alpha, i.e. alpha once per round on a member's chain. Zero-byte transfers are skipped.
// Step dependencies are per member, as the data flows: in a ring a member's send of step s starts when
// its own send of step s-1 and its predecessor's send of step s-1 (the data it forwards) have ended;
// a phase's first transfers wait for both ends to have finished the previous phase.
//
// Driving it, as an executor does (see network.h for the clock):
//   int c = colls.start(spec);                      // at colls.now()
//   double t = std::min(colls.next_event_time(), t_compute);
//   for (const FinishedCollective& f : colls.advance(t)) ...
//
// Aggregated flows (CollectiveSpec::aggregate), for clusters of thousands of devices, where one flow
// per ring step and per device pair is too many to simulate in seconds (20k flows took 22 s):
//   * a ring phase of s steps becomes one transfer per member of s * chunk bytes to its successor that
//     pays s alphas before transferring (a fluid ring: the steps' pipelining is assumed perfect). On a
//     ring of identical uncontended links this is the closed form exactly: 2(p-1) * alpha + 2(p-1)/p *
//     S/B for allreduce; under contention each member's traffic still crosses the same links, only
//     the per-step synchronisation (a slow step holding up the next) is lost. Every member ends
//     when the collective's last transfer does: in a real ring a member's last step forwards data
//     that went round every other member, so no member finishes before the slowest link has.
//   * alltoallv: pairs on the same node stay one flow each; the bytes all members of one node send to
//     a member j of another node become one flow, from the sending node's member on j's "rail" (the
//     same local index; else local index modulo the node's member count) to j. This is how NCCL's PXN
//     (NCCL 2.12, "PCI x NVLink") sends across nodes: over NVLink to the GPU on the destination's rail,
//     then through that GPU's NIC. The receiver's path carries exactly its bytes, so hot receivers
//     (popular experts) are exact; on the sending node the bytes are spread over the rails by
//     destination, exact in total per NIC when every member sends alike (as every rank routes N*K
//     rows) and approximate otherwise; the NVLink hop to the rail GPU is not modeled. A member's
//     part ends when the flows carrying its bytes have ended, as its blocking call would. An
//     aggregated flow has the weight of the senders it stands for (weighted max-min, network.h), so a
//     competing collective gets the share it would get against the separate flows.
//   * broadcast and reduce chains are not changed.
// Flows: O(p) per ring collective instead of O(p^2), and O(p * (nodes + devices per node)) per
// alltoallv instead of O(p^2).
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

enum class CollectiveKind : uint8_t { allreduce, allgather, reduce_scatter, alltoallv, broadcast, reduce, rounds };
const char* collective_kind_name(CollectiveKind k);  // "allreduce", ...

// One point-to-point transfer of a `rounds` collective: member src sends `bytes` to member dst.
struct RoundTransfer {
  int src = 0, dst = 0;
  double bytes = 0;
};

struct CollectiveSpec {
  CollectiveKind kind = CollectiveKind::allreduce;
  // The members (device ids of the cluster), in ring order: member i is devices[i].
  std::vector<int> devices;
  // Bytes (see the algorithms above): allreduce, broadcast, reduce: the buffer; allgather: the whole
  // output; reduce_scatter: the whole input. Not used by alltoallv.
  double bytes = 0;
  // alltoallv: p * p entries, row-major: [i * p + j] = bytes member i sends to member j.
  std::vector<double> peer_bytes;
  // rounds: rounds[k] = round k's transfers; in one round a member sends at most once and receives at
  // most once (comm::SparsePlan's rule). Empty for the other kinds.
  std::vector<std::vector<RoundTransfer>> rounds;
  int root = 0;               // broadcast, reduce: the root's member index
  bool hierarchical = false;  // allreduce only: the hierarchical algorithm
  bool aggregate = false;     // aggregated flows (see above)
  // Late members (alltoallv without aggregate only): reached[i] says whether member i has reached the
  // collective at start(); the others reach it by Collectives::reach(). Empty: every member has.
  // Eager sends (ClusterSpec::eager_bytes): a transfer between nodes of at most eager_bytes starts
  // once its sender reached, leaves the sender's own link out of its path (its bytes are copied into
  // the kernel at once) and counts as done on the sender when it reached (MPI completes an eager send
  // then), on the receiver when its bytes arrived. A sender's eager sends start one after another, each
  // when the one it posted before has arrived, in the runtime's posting order (to member + 1, + 2, ...),
  // as the emulated cluster's kernel delivers them. Every other transfer starts once both its ends
  // reached. A member's part ends when it reached and its transfers are done, and the collective
  // when every transfer ended and every member reached it.
  std::vector<char> reached;
  double eager_bytes = 0;
};

// A member whose part of a collective ended (its last transfer sent or received), at `time`.
struct MemberEnded {
  int collective = -1;
  int member = -1;
  double time = 0;
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
  // >= 0; peer_bytes of p * p finite entries >= 0 for alltoallv and empty otherwise; rounds only for
  // `rounds`, members in range, src != dst, bytes finite >= 0, at most one send and one receive per
  // member and round; root a member
  // index for broadcast and reduce; hierarchical only for allreduce, with equal members per node.
  int start(const CollectiveSpec& spec);
  // Member `member` of running collective `collective` reaches it at now() (CollectiveSpec::reached):
  // its transfers that waited for it start. REQUIRES (std::logic_error): the collective is running and
  // the member had not reached it.
  void reach(int collective, int member);
  // The next time a transfer starts or ends, or a collective finishes; +inf when idle.
  double next_event_time();
  // Moves the clock to t; returns the collectives that finished at t, by ascending id.
  // REQUIRES: now() <= t <= next_event_time() (std::logic_error).
  std::vector<FinishedCollective> advance(double t);

  // The members whose part ended since the last call, by (time, collective id, member index): members without transfers right after start(), the others at the
  // advance() that ended their last transfer. An executor ends a blocking call on that member then.
  std::vector<MemberEnded> take_member_ends();

  int in_flight() const { return in_flight_; }
  int64_t transfers_started() const { return transfers_started_; }  // flows started so far
  const Network& network() const { return net_; }
  void set_link_bandwidth(int link, double bandwidth) { net_.set_bandwidth(link, bandwidth); }  // Network::set_bandwidth
  const Cluster& cluster() const { return cluster_; }

 private:
  struct Transfer {
    int src = -1, dst = -1;  // member indices
    double bytes = 0;
    double alpha_steps = 1;  // the path's alpha is paid this many times (aggregated ring phases)
    double weight = 1;       // max-min shares (aggregated all-to-all flows: one per sender)
    bool eager = false;      // starts once its sender reached (CollectiveSpec::reached)
    bool queued = false;     // an eager send that follows its sender's previous one onto the link
    int queued_next = -1;    // the sender's next eager send, which starts when this one has arrived
    int deps_left = 0;
    int succ_begin = 0, succ_end = 0;  // its successors: successors[succ_begin, succ_end)
    int carried_begin = 0, carried_end = 0;  // members whose bytes it carries: carried[begin, end)
  };
  struct Running {
    double start = 0;
    std::vector<int> devices;
    std::vector<Transfer> transfers;
    std::vector<int> successors;
    std::vector<int> carried;
    int transfers_left = 0;
    std::vector<int> member_left;  // transfers touching each member that have not ended
    std::vector<double> member_end;
    bool end_together = false;     // every member ends when the last transfer does (aggregated rings)
    std::vector<char> reached;     // by member (CollectiveSpec::reached)
    int not_reached = 0;
  };

  void validate(const CollectiveSpec& spec) const;
  void launch(int collective, int transfer);
  void queue_eager_sends(Running* r);  // each sender's eager sends one after another, in posting order
  // One of the member's transfers is done at t: its part ends with the last, once it reached the collective.
  void transfer_done_on(int collective, int member, double t);
  FinishedCollective finish(int collective);

  const Cluster& cluster_;
  Network net_;
  std::vector<Running> running_;
  std::vector<int> free_ids_;
  int in_flight_ = 0;
  std::vector<std::pair<int, int>> flow_owner_;  // by flow id: (collective, transfer)
  std::vector<int> finished_now_;                // collectives without transfers, finished at now()
  std::vector<MemberEnded> member_ends_;         // since the last take_member_ends()
  std::vector<int> route_;                       // launch()'s scratch: the route of the flow it starts
  int64_t transfers_started_ = 0;
};

// The number of chunks a pipelined chain of `hops` hops cuts `bytes` into: the C in [1, 256] that
// minimizes the uncontended time (C + hops - 1) * (alpha + bytes / (C * bandwidth)), near
// sqrt((hops - 1) * bytes / (bandwidth * alpha)) (the classic pipelined-broadcast segment size, as in
// Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations in MPICH",
// 2005). NCCL pipelines in slices of a few hundred KiB; the cap of 256 chunks bounds the number of
// flows. REQUIRES: hops >= 1, bytes >= 0, bandwidth > 0, alpha >= 0 (std::logic_error).
int pipeline_chunks(int hops, double bytes, double bandwidth, double alpha);

}  // namespace moe::sim
