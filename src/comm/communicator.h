// Start here for src/comm: the communicator every distributed part of moe talks through, and the
// process groups of expert parallelism. The MPI backend is mpi_communicator.h; topology.h maps
// ranks to nodes.
//
// A Communicator is one group of ranks (the world, an expert-parallel group, a data-parallel group,
// later model-parallel or expert-sharding groups) and the collectives over it. Ranks are numbered
// 0..size()-1 within the group; world_ranks() maps them back to world ranks.
//
// Contract of every operation below:
//   * Collective: every rank of the group calls it, in the same order as the other collectives on
//     this communicator, with matching counts/root (the shapes each comment states).
//   * Buffers: the caller owns them; they must hold the stated number of elements and stay valid
//     until the call returns. Counts and displacements are in elements, not bytes. Element types
//     are float, double and int64_t.
//   * Blocking: a call returns when this rank's part is complete (its receive buffers are filled,
//     its send buffers may be reused), or with an error after timeout() (default 60 s).
//   * Errors: a Status whose message names the world rank, the operation and the group, e.g.
//     "rank 1: alltoallv on group 'ep0' did not complete within 60 s (a peer rank died or stopped?)".
//     After any error the communicator is unusable (every later call fails at once) and the
//     peers are in an unknown state: the caller ends the job (abort_job() in mpi_communicator.h),
//     which makes mpirun stop every rank. The only errors that leave it usable are split()'s
//     agreed "inconsistent groups" error and std::logic_error for violated REQUIRES.
//   * Violated REQUIRES (wrong number of counts, negative count, root or peer out of range) are
//     programming errors and throw std::logic_error without communicating.
//   * Threads: one thread at a time owns a communicator (the runtime's communication thread).
//     Different communicators may be used by different threads concurrently where the backend
//     allows it (MPI: when MPI_THREAD_MULTIPLE was provided; see MpiSession).
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "util/status.h"

namespace moe::comm {

enum class DType : uint8_t { f32, f64, i64 };
template <typename T>
concept Element = std::same_as<T, float> || std::same_as<T, double> || std::same_as<T, int64_t>;
template <Element T>
constexpr DType dtype_of() {
  if constexpr (std::same_as<T, float>) return DType::f32;
  else if constexpr (std::same_as<T, double>) return DType::f64;
  else return DType::i64;
}
size_t dtype_size(DType t);
const char* dtype_name(DType t);  // "float", "double", "int64"

enum class ReduceOp : uint8_t { sum, max, min };
const char* reduce_op_name(ReduceOp op);

inline constexpr std::chrono::milliseconds kDefaultTimeout{60'000};

// How a blocked operation waits for its peers once the wait is not short (the MPI backend; the NCCL
// backend, whose waits are on device events, always polls).
//   poll:  keeps polling, offering the core with sched_yield between polls. Lowest latency: for
//          waits on the critical path (the all-to-all of a step or of a decode step).
//   sleep: sleeps between polls (tens of microseconds). For lanes that wait behind compute (expert
//          gathers, gradient reductions): on CPU ranks the lane shares its core with the compute,
//          and under Linux's EEVDF scheduler a yielding lane still takes its turns there.
enum class WaitMode : uint8_t { poll, sleep };

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }  // this rank within the group
  int size() const { return static_cast<int>(world_ranks_.size()); }
  const std::string& name() const { return name_; }  // "world", "ep0", "dp1", ...
  int world_rank() const { return world_ranks_[rank_]; }
  const std::vector<int>& world_ranks() const { return world_ranks_; }  // group rank -> world rank

  // How long one operation may take before it fails (a dead or stalled peer). REQUIRES: > 0.
  std::chrono::milliseconds timeout() const { return timeout_; }
  void set_timeout(std::chrono::milliseconds t);

  // How a blocked call waits (above); poll unless set. Not copied by split() or dup().
  WaitMode wait_mode() const { return wait_mode_; }
  void set_wait_mode(WaitMode m) { wait_mode_ = m; }

  // True after an error: every later call fails with the first error's message.
  bool broken() const { return !error_.empty(); }

  // Personalized all-to-all. This rank sends send[send_displs[p] .. + send_counts[p]) to group
  // rank p and receives recv_counts[p] elements from p at recv[recv_displs[p]]. Each span has size()
  // entries; recv_counts[p] on this rank must equal send_counts[this rank] on p (exchange the counts
  // first, e.g. with alltoall of int64), so recv_counts[rank()] == send_counts[rank()]. Zero counts
  // in either direction are fine. Regions of recv outside the received blocks are left untouched.
  template <Element T>
  Status alltoallv(const T* send, std::span<const int64_t> send_counts, std::span<const int64_t> send_displs, T* recv,
                   std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs) {
    return alltoallv_impl(send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype_of<T>());
  }
  // All-to-all with equal blocks: send and recv hold size() * count elements, block p to/from rank p.
  template <Element T>
  Status alltoall(const T* send, T* recv, int64_t count) {
    return alltoall_impl(send, recv, count, dtype_of<T>());
  }
  // In place: data[0, count) becomes the element-wise reduction over all ranks. Every rank ends with
  // bitwise identical values (the reduction order is fixed by count and size(), not by timing).
  template <Element T>
  Status allreduce(T* data, int64_t count, ReduceOp op = ReduceOp::sum) {
    return allreduce_impl(data, count, dtype_of<T>(), op);
  }
  // recv[p*count .. (p+1)*count) = rank p's send[0, count). recv holds size() * count elements.
  template <Element T>
  Status allgather(const T* send, int64_t count, T* recv) {
    return allgather_impl(send, count, recv, dtype_of<T>());
  }
  // recv[recv_displs[p] .. + recv_counts[p]) = rank p's send[0, recv_counts[p]); this rank's
  // send_count must equal recv_counts[rank()]. Empty contributions are fine.
  template <Element T>
  Status allgatherv(const T* send, int64_t send_count, T* recv, std::span<const int64_t> recv_counts,
                    std::span<const int64_t> recv_displs) {
    return allgatherv_impl(send, send_count, recv, recv_counts, recv_displs, dtype_of<T>());
  }
  // send holds size() equal blocks of count elements; recv[0, count) = the reduction over all ranks
  // of their block rank(). send and recv must not overlap.
  template <Element T>
  Status reduce_scatter(const T* send, T* recv, int64_t count, ReduceOp op = ReduceOp::sum) {
    return reduce_scatter_impl(send, recv, count, dtype_of<T>(), op);
  }
  // data[0, count) on every rank = data on `root`.
  template <Element T>
  Status broadcast(T* data, int64_t count, int root) {
    return broadcast_impl(data, count, root, dtype_of<T>());
  }
  // On root, recv[0, count) = the reduction of every rank's send[0, count); recv is not used on
  // other ranks (may be null). On root, send == recv reduces in place.
  template <Element T>
  Status reduce(const T* send, T* recv, int64_t count, int root, ReduceOp op = ReduceOp::sum) {
    return reduce_impl(send, recv, count, root, dtype_of<T>(), op);
  }
  // Point to point, matched by (peer, tag) in order. REQUIRES: peer != rank(), 0 <= tag < 32768.
  // A send may complete before the matching recv starts (small messages) or not (large ones): two
  // ranks that both send first to each other can deadlock; use sendrecv for exchanges.
  template <Element T>
  Status send(const T* data, int64_t count, int peer, int tag = 0) {
    return send_impl(data, count, peer, tag, dtype_of<T>());
  }
  // Receives exactly `count` elements (a longer message is an error).
  template <Element T>
  Status recv(T* data, int64_t count, int peer, int tag = 0) {
    return recv_impl(data, count, peer, tag, dtype_of<T>());
  }
  // Sends to dst and receives from src at once (a ring step, a pairwise exchange); dst or src may
  // be rank() itself (a local copy).
  template <Element T>
  Status sendrecv(const T* send, int64_t send_count, int dst, T* recv, int64_t recv_count, int src, int tag = 0) {
    return sendrecv_impl(send, send_count, dst, recv, recv_count, src, tag, dtype_of<T>());
  }
  Status barrier();

  // Sub-groups. Collective over this communicator: every rank calls it with the members of its
  // own group, as ranks of this communicator, in the order that becomes the new group's rank order
  // (so every rank is in exactly one group: the one it lists, which must contain it). If the lists
  // do not form consistent groups, every rank gets the same error and this communicator stays
  // usable. `name` names the new group in errors (e.g. "ep1").
  // Blocking without the timeout (it runs at set-up). The new communicator has this one's timeout.
  Status split(std::span<const int> members, std::string name, std::unique_ptr<Communicator>* out);
  // A second communicator over the same ranks, for traffic that must not interleave with this
  // one's (e.g. a second communication lane). Collective.
  Status dup(std::string name, std::unique_ptr<Communicator>* out);

  // "rank W: OP on group 'NAME'": the prefix of this communicator's error messages.
  std::string where(const std::string& op) const;

 protected:
  Communicator(std::string name, int rank, std::vector<int> world_ranks, std::chrono::milliseconds timeout);

  // Backend hooks. Arguments are validated (sizes, ranges, non-negative counts); the communicator
  // is not broken. They return errors made with where().
  virtual Status do_alltoallv(const void* send, std::span<const int64_t> send_counts,
                              std::span<const int64_t> send_displs, void* recv, std::span<const int64_t> recv_counts,
                              std::span<const int64_t> recv_displs, DType t) = 0;
  virtual Status do_alltoall(const void* send, void* recv, int64_t count, DType t) = 0;
  virtual Status do_allreduce(void* data, int64_t count, DType t, ReduceOp op) = 0;
  virtual Status do_allgather(const void* send, int64_t count, void* recv, DType t) = 0;
  virtual Status do_allgatherv(const void* send, int64_t send_count, void* recv, std::span<const int64_t> recv_counts,
                               std::span<const int64_t> recv_displs, DType t) = 0;
  virtual Status do_reduce_scatter(const void* send, void* recv, int64_t count, DType t, ReduceOp op) = 0;
  virtual Status do_broadcast(void* data, int64_t count, int root, DType t) = 0;
  virtual Status do_reduce(const void* send, void* recv, int64_t count, int root, DType t, ReduceOp op) = 0;
  virtual Status do_send(const void* data, int64_t count, int peer, int tag, DType t) = 0;
  virtual Status do_recv(void* data, int64_t count, int peer, int tag, DType t) = 0;
  virtual Status do_sendrecv(const void* send, int64_t send_count, int dst, void* recv, int64_t recv_count, int src,
                             int tag, DType t) = 0;
  virtual Status do_barrier() = 0;
  // The group of the ranks that pass the same color, ordered by key (MPI_Comm_split semantics).
  virtual Status do_split(int color, int key, std::string name, std::unique_ptr<Communicator>* out) = 0;

 private:
  Status alltoallv_impl(const void* send, std::span<const int64_t> send_counts, std::span<const int64_t> send_displs,
                        void* recv, std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs,
                        DType t);
  Status alltoall_impl(const void* send, void* recv, int64_t count, DType t);
  Status allreduce_impl(void* data, int64_t count, DType t, ReduceOp op);
  Status allgather_impl(const void* send, int64_t count, void* recv, DType t);
  Status allgatherv_impl(const void* send, int64_t send_count, void* recv, std::span<const int64_t> recv_counts,
                         std::span<const int64_t> recv_displs, DType t);
  Status reduce_scatter_impl(const void* send, void* recv, int64_t count, DType t, ReduceOp op);
  Status broadcast_impl(void* data, int64_t count, int root, DType t);
  Status reduce_impl(const void* send, void* recv, int64_t count, int root, DType t, ReduceOp op);
  Status send_impl(const void* data, int64_t count, int peer, int tag, DType t);
  Status recv_impl(void* data, int64_t count, int peer, int tag, DType t);
  Status sendrecv_impl(const void* send, int64_t send_count, int dst, void* recv, int64_t recv_count, int src, int tag,
                       DType t);
  // Fails at once when broken; otherwise runs `st` through record().
  bool usable(const char* op, Status* st) const;
  Status record(Status st);  // the first error breaks the communicator

  std::string name_;
  int rank_;
  std::vector<int> world_ranks_;
  std::chrono::milliseconds timeout_;
  WaitMode wait_mode_ = WaitMode::poll;
  std::string error_;  // first error; empty while usable
};

// Process groups of expert parallelism over a world of P ranks with expert-parallel size G
// (REQUIRES: G divides P):
//   ep: the G consecutive ranks [g*G, (g+1)*G) with g = rank / G. Together they hold one copy of
//       every expert (each rank E/G of them); tokens are dispatched and combined with alltoallv
//       inside it. Named "ep<g>"; a rank's ep rank is rank % G.
//   dp: the P/G ranks with the same rank % G: they hold the same experts (replicas), and expert
//       gradients are allreduced over it. Named "dp<rank % G>"; a rank's dp rank is g.
// Dense (non-expert) gradients are allreduced over the world. Example, P = 4, G = 2: ep0 = {0,1},
// ep1 = {2,3}; dp0 = {0,2}, dp1 = {1,3}. G = P is pure expert parallelism (dp groups of 1 rank);
// G = 1 is pure data parallelism (ep groups of 1 rank). Model-parallel or expert-sharding groups
// are further split()s of the world or of these groups.
struct Groups {
  int ep_size = 1;
  int dp_size = 1;
  std::unique_ptr<Communicator> ep;
  std::unique_ptr<Communicator> dp;
};
// Collective over world. Errors: G does not divide P (the same on every rank, before communicating),
// or a split error.
Status make_groups(Communicator& world, int ep_size, Groups* out);

}  // namespace moe::comm
