// The MPI backend of Communicator (OpenMPI here; any MPI-3 library).
//
// Lifetime: an MpiSession initialises MPI and finalises it when destroyed; communicators made
// from it (world(), then split()) must be destroyed before it.
//
// Threads: MpiSession::start asks for MPI_THREAD_MULTIPLE. What the library provides decides who
// may call (thread_level()):
//   MPI_THREAD_MULTIPLE    any thread; each communicator used by one thread at a time, and
//                          different communicators from different threads at once (the runtime's
//                          communication lanes);
//   MPI_THREAD_SERIALIZED  any thread, but only one thread in any communicator at a time (one
//                          communication thread for the whole process);
//   MPI_THREAD_FUNNELED    only the thread that called MpiSession::start.
// Debian's OpenMPI 4.1 provides MPI_THREAD_MULTIPLE.
//
// Timeouts: every operation is issued non-blocking (MPI_Ialltoallv, MPI_Isend/Irecv, ...) and
// polled with MPI_Test (yielding or sleeping between polls, per wait_mode()) until it completes,
// MPI reports an error, or timeout() passes. Then the call returns an error Status, e.g. "rank 1:
// alltoallv on group 'ep0' did not complete within 60 s (a peer rank died or stopped?)", and the
// communicator is broken: MPI cannot cancel a collective, so the caller ends the job with
// abort_job(), which makes mpirun stop every rank.
// (Usually mpirun is faster: it kills the whole job as soon as a rank dies, naming it.)
// Errors: communicators use MPI_ERRORS_RETURN; an MPI error becomes a Status with the rank, the
// operation, the group and MPI_Error_string's text.
//
// Algorithms: alltoall(v), allreduce and reduce_scatter are built here from MPI_Isend/Irecv.
// All-to-all posts every message at once in pairwise order (empty blocks send nothing). Allreduce
// in power-of-two groups uses recursive doubling when small, else recursive halving + doubling;
// in other groups a ring of reduce-scatter + allgather steps; reduce_scatter uses the ring. Why:
// OpenMPI's non-blocking MPI_Iallreduce (libnbc) runs at half the speed of its blocking
// MPI_Allreduce on this machine, and MPI_Ialltoallv is 10-25% slower than MPI_Alltoall for small
// messages; these match MPI's blocking calls (moe bench collectives). Every rank gets bitwise
// identical allreduce results. The other collectives are MPI's own non-blocking ones. Counts and
// displacements must fit in an int (MPI-3): larger ones are errors.
#pragma once

#include <mpi.h>

#include <chrono>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace moe::comm {

class MpiSession {
 public:
  // Initialises MPI (MPI_Init_thread asking for MPI_THREAD_MULTIPLE) unless the program already
  // did; works with or without mpirun (alone it is a world of one rank). REQUIRES: no other
  // MpiSession exists. Errors: MPI already finalised, or initialisation failed.
  static Status start(std::unique_ptr<MpiSession>* out);
  ~MpiSession();  // MPI_Finalize, if start() initialised MPI

  int thread_level() const { return provided_; }  // MPI_THREAD_SINGLE .. MPI_THREAD_MULTIPLE
  const char* thread_level_name() const;           // "MPI_THREAD_MULTIPLE", ...
  int world_rank() const;
  int world_size() const;

  // All ranks as a communicator named "world" (over a duplicate of MPI_COMM_WORLD, so moe's
  // traffic never mixes with another library's). Collective over all ranks.
  Status world(std::unique_ptr<Communicator>* out, std::chrono::milliseconds timeout = kDefaultTimeout);

 private:
  MpiSession(int provided, bool finalize) : provided_(provided), finalize_(finalize) {}
  int provided_;
  bool finalize_;
};

class MpiCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm` (freed by the destructor) and makes `out` over it. Collective over
  // `comm` (it duplicates it for the internal traffic of allreduce and reduce_scatter).
  static Status create(MPI_Comm comm, std::string name, std::chrono::milliseconds timeout,
                       std::unique_ptr<Communicator>* out);
  // Frees the MPI communicators. After a timeout, first waits up to timeout() for the operation
  // left pending (a late peer may still complete it); if it does not complete, the MPI
  // communicators are leaked rather than freed under a pending operation.
  ~MpiCommunicator() override;

  MPI_Comm mpi_comm() const { return comm_; }

 protected:
  Status do_alltoallv(const void* send, std::span<const int64_t> send_counts, std::span<const int64_t> send_displs,
                      void* recv, std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs,
                      DType t) override;
  Status do_alltoall(const void* send, void* recv, int64_t count, DType t) override;
  Status do_allreduce(void* data, int64_t count, DType t, ReduceOp op) override;
  Status do_allgather(const void* send, int64_t count, void* recv, DType t) override;
  Status do_allgatherv(const void* send, int64_t send_count, void* recv, std::span<const int64_t> recv_counts,
                       std::span<const int64_t> recv_displs, DType t) override;
  Status do_reduce_scatter(const void* send, void* recv, int64_t count, DType t, ReduceOp op) override;
  Status do_broadcast(void* data, int64_t count, int root, DType t) override;
  Status do_reduce(const void* send, void* recv, int64_t count, int root, DType t, ReduceOp op) override;
  Status do_send(const void* data, int64_t count, int peer, int tag, DType t) override;
  Status do_recv(void* data, int64_t count, int peer, int tag, DType t) override;
  Status do_sendrecv(const void* send, int64_t send_count, int dst, void* recv, int64_t recv_count, int src, int tag,
                     DType t) override;
  Status do_barrier() override;
  Status do_split(int color, int key, std::string name, std::unique_ptr<Communicator>* out) override;

 private:
  using Clock = std::chrono::steady_clock;
  MpiCommunicator(MPI_Comm comm, MPI_Comm internal, std::string name, int rank, std::vector<int> world_ranks,
                  std::chrono::milliseconds timeout);

  Clock::time_point deadline() const { return Clock::now() + timeout(); }
  Status mpi_error(const char* op, int rc) const;
  Status check(const char* op, int rc) const { return rc == MPI_SUCCESS ? Status::ok() : mpi_error(op, rc); }
  // Polls reqs until all complete. recv_peer[i] >= 0 marks request i as a receive from that group
  // rank (named in the timeout message, cancelled on timeout); statuses, if given, has reqs.size().
  Status wait(const char* op, std::span<MPI_Request> reqs, Clock::time_point deadline,
              std::span<const int> recv_peer = {}, MPI_Status* statuses = nullptr);
  Status wait_one(const char* op, MPI_Request* req, Clock::time_point deadline) {
    return wait(op, std::span<MPI_Request>(req, 1), deadline);
  }
  // One step of the point-to-point algorithms on the internal communicator.
  Status exchange(const char* op, const void* send, int64_t send_count, int dst, void* recv, int64_t recv_count,
                  int src, DType t, Clock::time_point deadline);
  Status alltoallv_p2p(const char* op, const void* send, std::span<const int64_t> send_counts,
                       std::span<const int64_t> send_displs, void* recv, std::span<const int64_t> recv_counts,
                       std::span<const int64_t> recv_displs, DType t);
  Status to_int(const char* op, int64_t v, int* out) const;
  Status to_ints(const char* op, std::span<const int64_t> v, std::vector<int>* out) const;
  void* scratch(size_t bytes, int which);

  MPI_Comm comm_;      // user-visible traffic and MPI's collectives
  MPI_Comm internal_;  // messages of the point-to-point algorithms
  std::vector<MPI_Request> orphans_;  // requests left pending by a timeout
  std::vector<int> ints_[2];          // int copies of counts/displacements for MPI
  std::vector<int64_t> counts_, displs_;  // alltoall's equal blocks
  std::vector<MPI_Request> reqs_;     // the point-to-point messages of one all-to-all
  std::vector<int> peers_;            // their source ranks (receives) or -1 (sends)
  std::vector<std::byte> scratch_[2];
};

// Whether this process is a rank mpirun started (Open MPI's, PMIx's or PMI's environment), so a
// command joins the job's MPI world instead of running alone.
bool started_by_mpirun();

// Prints "moe: rank R: <message>" to stderr (once, whether or not the message already starts with
// "rank R: ") and calls MPI_Abort, which makes mpirun stop every rank with a non-zero exit.
// Without MPI (not initialised, or finalised) it exits with status 1.
[[noreturn]] void abort_job(const Status& error);

}  // namespace moe::comm
