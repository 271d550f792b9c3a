// Hecate's sparse collectives (the Hecate paper, section 3.1): SparseAllGather materializes
// extra replicas of some chunks (a chunk = one expert's parameters), SparseReduceScatter sums the
// gradients of those replicas back into the owners. Only the chunks that gain (or lose) a replica
// move, so the volume is O(lambda S) instead of the dense collectives' O(S), where S is the bytes of
// all chunks and lambda the fraction of them that move.
//
// Terms. A layer's parameters are num_chunks chunks of chunk_elems floats each. A Placement says,
// per chunk, which ranks of the communicator hold it: placement[c] lists ranks in strictly
// ascending order. Before/after placements P0 (the owners: one per chunk in Hecate's sharding,
// several allowed) and P1 (the materialized placement) satisfy P0[c] non-empty and P0[c] ⊆ P1[c].
//
// Use: plan once per pair of placements (pure, no communication: every rank computes the same
// plan from the same placements, and the StepGraph can take its per-peer bytes as the op's cost),
// then execute it, typically every step:
//
//   SparsePlan ag = plan_sparse_allgather(p0, p1, comm.size());
//   SparsePlan rs = plan_sparse_reduce_scatter(p1, p0, comm.size());
//   Status st = sparse_allgather(comm, ag, params, chunk_elems);   // forward: replicas appear
//   ...                                                            // expert forward/backward
//   st = sparse_reduce_scatter(comm, rs, grads, chunk_elems, &scratch);  // owners get the sums
//
// Algorithm (why it looks like this). The paper builds each collective from one broadcast (or
// reduce) per moving chunk, issued together as an NCCL group. Over MPI a broadcast to an arbitrary
// subset of ranks needs a communicator for that subset, created collectively and anew whenever the
// placement changes (every step), so here every chunk's broadcast is a tree of point-to-point
// messages, and the trees of all chunks are scheduled together in rounds: in one round a rank sends
// at most one chunk and receives at most one (one Communicator::sendrecv, both directions of its
// link busy at once). Each round's transfers are a maximum matching of receivers to senders
// (receivers with most chunks still to get first, senders that have sent least first), and a rank
// that received a chunk in an earlier round may forward it. So:
//   * every new replica is received exactly once, straight into the caller's chunk buffer (no
//     packing: MPI's single-copy shared-memory path copies from the sender's buffer into it);
//   * a rank receives only the chunks it newly holds (|{c : rank in P1[c] \ P0[c]}| chunks, at most
//     lambda S bytes), and forwarding spreads the sending of a chunk wanted by many ranks over its
//     receivers instead of loading its one owner with (P-1) copies (one owner of h chunks that all
//     P ranks want: h + log2 P - 1 rounds instead of h (P-1)): the O(lambda S) bound of the paper's
//     Equation 1 holds per rank for sends too, not only for receives;
//   * the number of rounds meets the lower bound (the most chunks any rank receives) on balanced
//     placements, and on 2000 random ones of 2..16 ranks stays within 1.5x (and 2 rounds) of a
//     simple lower bound.
// Measured against the alternatives on this machine (OpenMPI 4.1 shared memory, 2 and 4 ranks, 8
// chunks per rank of 64 KiB .. 16 MiB; moe bench sparse-collectives runs the chosen one): packing
// the chunks for one Communicator::alltoallv is 1.5-2.3x slower from 256 KiB chunks up (two extra
// copies), and one MPI_Bcast per chunk (only possible here when the subset is the whole group)
// 1.1-2x slower. Posting every message at once (MPI_Isend/Irecv, direct from owners) is 5-30%
// faster than rounds, most with 4 ranks and small chunks, but needs a grouped point-to-point hook
// in Communicator with dependencies for forwarded chunks; rounds need only the existing sendrecv.
// SparseReduceScatter runs the mirror image: the broadcast tree of chunk c from its primary owner
// (the lowest rank of P0[c]) over P1[c], played backwards, with each rank adding what its children
// send before passing the sum to its parent; then, only where P0[c] has several owners, the primary
// owner's total is broadcast to the others (a tree again).
//
// Summation order of SparseReduceScatter: a rank's chunk buffer starts as its own partial; it adds
// each partial it receives for that chunk, one at a time (acc += received), in the order of the
// rounds they arrive in; the primary owner ends with the total and the other owners receive a copy
// of it. The order is a pure function of (P1, P0, number of ranks, node map), not of timing, so every owner
// holds bitwise the same sum, and the same placements give the same bits every step. It is not the
// dense reduce_scatter's order, so the last bits may differ from it.
//
// Bytes moved (bytes_sent / bytes_received / total_bytes / peer_bytes below):
//   SparseAllGather(P0, P1):      total = sum_c |P1[c] \ P0[c]| chunks; rank r receives the chunks
//                                 with r in P1[c] \ P0[c];
//   SparseReduceScatter(P1, P0):  total = sum_c (|P1[c]| - 1 + |P0[c]| - 1) chunks, which is
//                                 sum_c |P1[c] \ P0[c]| with one owner per chunk (then only the
//                                 ranks in P1[c] \ P0[c] send, each its partial once).
//
// The executing functions follow communicator.h's contract: collective over `comm` (every rank
// calls with the same plan, in the same order as the other collectives on it; mismatched plans are
// not detected and typically end in a timeout or a size error); blocking; errors are a Status naming
// the rank, the operation, the group, the round and the chunk, after which the communicator is
// unusable; violated REQUIRES throw std::logic_error without communicating. It is not a barrier: a
// rank with no transfers returns at once. The messages use tag kSparseCollectiveTag: no other
// point-to-point message on `comm` with that tag may be pending. Chunk buffers are the caller's:
// distinct, non-overlapping, valid until the call returns.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "comm/communicator.h"
#include "util/status.h"

namespace moe::comm {

// placement[c]: the ranks holding chunk c, strictly ascending, each in [0, number of ranks).
using Placement = std::vector<std::vector<int>>;

inline constexpr int kSparseCollectiveTag = 30'000;

enum class SparseOp : uint8_t { allgather, reduce_scatter };
const char* sparse_op_name(SparseOp op);  // "sparse_allgather", "sparse_reduce_scatter"

// One message: rank src sends its chunk `chunk` to rank dst. reduce: dst adds it into its chunk
// (the reduction phase of SparseReduceScatter); otherwise dst's chunk becomes a copy of it.
struct ChunkTransfer {
  int64_t chunk = 0;
  int src = 0;
  int dst = 0;
  bool reduce = false;
  bool operator==(const ChunkTransfer&) const = default;
};

// Who sends which chunk to whom, in rounds: rounds[k] is round k's transfers, ordered by dst; in
// one round a rank is src of at most one transfer and dst of at most one, and never both for the
// same chunk. A rank sends a chunk only once it holds its final value for that phase (it held it
// before, or received it in an earlier round).
struct SparsePlan {
  SparseOp op = SparseOp::allgather;
  int num_ranks = 0;
  int64_t num_chunks = 0;
  std::vector<std::vector<ChunkTransfer>> rounds;
  bool operator==(const SparsePlan&) const = default;
};

// The plan of SparseAllGather(P0, P1): every rank of P1[c] \ P0[c] receives chunk c once, from a
// rank of P0[c] or from one that received it in an earlier round. Pure and deterministic.
// node_of (optional: each rank's node): topology-aware; a chunk crosses into a node once, to one rank
// there, and the node's other ranks get it from a rank of their own node (the same holder first
// when it is there already), so with several ranks per node fewer bytes cross the slower links.
// REQUIRES (std::logic_error): num_ranks >= 1; p0.size() == p1.size(); every list strictly
// ascending within [0, num_ranks); p0[c] non-empty and p0[c] ⊆ p1[c]; node_of empty or [num_ranks].
SparsePlan plan_sparse_allgather(const Placement& p0, const Placement& p1, int num_ranks,
                                 std::span<const int> node_of = {});

// The plan of SparseReduceScatter(P1, P0) (note the order: before, after): every rank of P1[c]
// holds a partial of chunk c; afterwards every rank of P0[c] holds the sum over P1[c] (see the
// summation order above). Pure and deterministic. node_of: as plan_sparse_allgather's (the reduction
// tree is the broadcast tree reversed: a node's partials are summed there before one crosses).
// REQUIRES: as plan_sparse_allgather(p0, p1, ..).
SparsePlan plan_sparse_reduce_scatter(const Placement& p1, const Placement& p0, int num_ranks,
                                      std::span<const int> node_of = {});

// Bytes rank `rank` sends / receives when executing `plan` with chunks of chunk_bytes bytes, and the
// total over ranks. REQUIRES: 0 <= rank < plan.num_ranks, chunk_bytes >= 0.
int64_t bytes_sent(const SparsePlan& plan, int rank, int64_t chunk_bytes);
int64_t bytes_received(const SparsePlan& plan, int rank, int64_t chunk_bytes);
int64_t total_bytes(const SparsePlan& plan, int64_t chunk_bytes);
// The per-peer byte matrix (a communication op's cost in the StepGraph): entry [src * num_ranks +
// dst] is the bytes src sends to dst.
std::vector<int64_t> peer_bytes(const SparsePlan& plan, int64_t chunk_bytes);

// Executes a plan of plan_sparse_allgather. chunks[c] (chunks.size() == plan.num_chunks) points to
// this rank's chunk_elems floats of chunk c for every c with this rank in P1[c]: on ranks of P0[c]
// it holds the chunk (read), on ranks of P1[c] \ P0[c] it receives it (written; nothing else is).
// Other entries are ignored and may be null. REQUIRES: plan.op == allgather, plan.num_ranks ==
// comm.size(), chunk_elems >= 0, chunks.size() == plan.num_chunks, and chunks[c] non-null for
// every chunk this rank sends or receives.
Status sparse_allgather(Communicator& comm, const SparsePlan& plan, std::span<float* const> chunks,
                        int64_t chunk_elems);

// Executes a plan of plan_sparse_reduce_scatter. chunks[c] points to this rank's partial of chunk c
// for every c with this rank in P1[c]. Afterwards it holds the sum over P1[c] on the ranks of P0[c];
// on the other ranks of P1[c] it is used as an accumulator and its content is unspecified. Other
// entries are ignored and may be null. *scratch is grown to chunk_elems floats if this rank adds
// anything (keep it across steps to reuse the allocation). REQUIRES: plan.op == reduce_scatter,
// scratch non-null, and as sparse_allgather.
Status sparse_reduce_scatter(Communicator& comm, const SparsePlan& plan, std::span<float* const> chunks,
                             int64_t chunk_elems, std::vector<float>* scratch);

}  // namespace moe::comm
