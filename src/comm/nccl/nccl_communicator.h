// The NCCL backend of Communicator: one rank per GPU, collectives between GPUs (NVLink, or the
// network through NCCL's transports). Built only with the CUDA backend (MOE_HAVE_CUDA).
//
// Launch: mpirun starts one process per GPU as for the MPI backend; each process makes its MPI world
// (MpiSession::world) and passes it to NcclCommunicator::create as the bootstrap, which carries the
// NCCL unique id from rank 0 to the others. The NCCL group has the bootstrap's ranks, rank order
// and timeout; the bootstrap may be destroyed afterwards.
//
// Buffers: every pointer passed to the collectives of an NcclCommunicator is DEVICE memory of
// device() (cudaMalloc, cudaMallocAsync or managed memory), not host memory. The one exception is
// allreduce, which also takes host memory (it stages it through the device, synchronously),
// because Communicator::split agrees on the new groups with an allreduce of a host int64.
//
// Streams: each NcclCommunicator owns one non-blocking CUDA stream (stream()), created with the
// priority given to create(), and runs all its NCCL calls on it, so communicators of different
// lanes run concurrently on the GPU. Work on other streams that writes a send buffer must be
// complete before the call, or ordered before it with depend_on(event). CUDA stream priorities:
// LOWER numbers are HIGHER priority, in [greatest, least] (stream_priority_range: least is 0, the
// default streams' priority, greatest negative); values outside are clamped by CUDA. The runtime's communication
// lanes (graph/ep_builder.h) map to priorities with lane_priority(): the all-to-all and gather
// lanes get the highest priority (their results gate expert compute), the allreduce lane the
// lowest (gradient sums overlap with everything else).
//
// Blocking calls (the Communicator contract): each call enqueues its NCCL operation(s) on stream(),
// records an event and polls it (cudaEventQuery) together with ncclCommGetAsyncError until it
// completes, NCCL reports an error, or timeout() passes. On an error or a timeout the NCCL
// communicator is aborted (ncclCommAbort stops its kernels) and the call returns a Status such as
// "rank 1: alltoallv on group 'ep0' did not complete within 60 s (waiting for rank 0; a peer rank
// died or stopped?)" (the peer is named for point-to-point calls and in groups of two). Then this
// communicator is unusable and the caller ends the job (abort_job in comm/mpi_communicator.h).
// NCCL errors read "rank W: OP on group 'G': <ncclGetErrorString> (<ncclGetLastError>)".
//
// How the operations map to NCCL: alltoallv and alltoall are one ncclGroupStart/End of an
// ncclSend and an ncclRecv per peer with a non-empty block (the rank's own block is a
// cudaMemcpyAsync on the stream); allgatherv the same with this rank's block sent to every peer;
// sendrecv a group of one ncclSend and one ncclRecv (a peer may be this rank); allreduce,
// allgather, reduce_scatter, broadcast, reduce, send and recv are NCCL's own calls; barrier is an
// allreduce of one element on a device buffer the communicator owns. Differences from the MPI
// backend that callers must respect:
//   * send/recv/sendrecv: tags are not used; messages between two ranks match in issue order. The
//     receiver's count must equal the sender's (NCCL cannot detect a longer message: the result is
//     undefined, typically a hang that ends in the timeout).
//   * allreduce: every rank gets the same values (NCCL's ring and tree compute each element once),
//     but the summation order is NCCL's and may differ from the MPI backend's.
//   * Counts are not limited to int (NCCL takes size_t).
//
// Non-blocking use (the runtime's lanes): enqueue_alltoallv / enqueue_allreduce validate the
// arguments like the blocking calls, enqueue the operation on stream() and return at once. The
// caller makes a compute stream wait for it with cudaStreamWaitEvent(compute, last_event()), or
// blocks with wait(). Buffers must stay valid until the operation completes. An error from enqueue_*
// or wait() breaks the communicator like a blocking call's (every later call fails). A blocking
// call after enqueued ones also completes them (one stream, in order).
//
// Threads: one thread at a time per communicator, as the Communicator contract says. Different
// NcclCommunicators may be used from different threads at once. NCCL kernels wait on the GPU for
// their peers: two communicators whose operations are issued in different orders on different
// ranks can deadlock if the GPU cannot run both kernels at once (NCCL documents this); the
// runtime's lanes issue each communicator's operations in the same order on every rank, and the
// timeout turns such a deadlock into an error.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace moe::comm {

// The runtime's communication lanes (graph/ep_builder.h).
enum class CommLane : uint8_t { a2a, gather, allreduce };

// A device's stream priorities. CUDA: lower is higher priority, greatest <= least.
struct StreamPriorityRange {
  int least = 0;     // the lowest priority (the default streams' priority), usually 0
  int greatest = 0;  // the highest priority (negative)
};

class NcclCommunicator final : public Communicator {
 public:
  // Makes the NCCL group over bootstrap's ranks on GPU `device` of this process, named `name` in
  // errors. Collective over `bootstrap` (an MPI communicator over the same ranks, used only here):
  // every rank checks its device and rank 0 makes the NCCL unique id; the ranks agree that all
  // succeeded (an allreduce), rank 0 broadcasts the id (as int64 elements), and every rank
  // creates its stream (priority `stream_priority`, see above), its event and its barrier buffer,
  // and initialises NCCL non-blocking, bounded by bootstrap.timeout(). Errors name the world rank,
  // the group and the cause, e.g. "rank 0: creating NCCL group 'world': no CUDA device 0 (CUDA
  // driver version is insufficient for CUDA runtime version)"; when one rank fails its checks
  // every rank returns an error. Leaves `device` the current CUDA device of the calling thread.
  static Status create(Communicator& bootstrap, int device, int stream_priority, std::string name,
                       std::unique_ptr<NcclCommunicator>* out);

  // Device `device`'s stream priorities (cudaDeviceGetStreamPriorityRange). Errors: no such device.
  static Status stream_priority_range(int device, StreamPriorityRange* out);
  // The priority of a lane's communicator: a2a and gather the highest (range.greatest), allreduce
  // the lowest (range.least).
  static int lane_priority(CommLane lane, const StreamPriorityRange& range);

  // Completes what is still enqueued and releases NCCL (ncclCommFinalize, then ncclCommDestroy),
  // waiting at most timeout() for the peers; past that, or after an error, ncclCommAbort.
  ~NcclCommunicator() override;

  int device() const { return device_; }
  int stream_priority() const { return priority_; }
  cudaStream_t stream() const { return stream_; }
  // Null once aborted (after an error).
  ncclComm_t nccl_comm() const { return comm_; }

  // ---- non-blocking use ----

  // Later operations on this communicator start after `event` (recorded by the caller on another
  // stream, e.g. after the kernel that wrote the send buffer) completes: cudaStreamWaitEvent.
  Status depend_on(cudaEvent_t event);

  // As alltoallv / allreduce, but return once the operation is enqueued on stream() (see above).
  // REQUIRES (std::logic_error): the same as the blocking calls.
  template <Element T>
  Status enqueue_alltoallv(const T* send, std::span<const int64_t> send_counts, std::span<const int64_t> send_displs,
                           T* recv, std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs) {
    return enqueue_alltoallv_impl(send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype_of<T>());
  }
  template <Element T>
  Status enqueue_allreduce(T* data, int64_t count, ReduceOp op = ReduceOp::sum) {
    return enqueue_allreduce_impl(data, count, dtype_of<T>(), op);
  }

  // Recorded on stream() after every operation (enqueued or blocking). Owned by the communicator:
  // valid until it is destroyed; never destroy it. cudaStreamWaitEvent(s, last_event()) makes `s`
  // wait for the operations enqueued so far; a later operation re-records the event, which does not
  // affect waits issued before it (CUDA semantics), so call it right after the enqueue_* it is for.
  cudaEvent_t last_event() const { return event_; }

  // Blocks until every enqueued operation completes, or fails after timeout() (counted from this
  // call) like a blocking call, naming the last enqueued operation.
  Status wait();

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
  // ncclCommSplit (MPI_Comm_split semantics); the members' world ranks come from an allgather of
  // every rank's (color, key) over this communicator. Waits without the timeout (set-up).
  Status do_split(int color, int key, std::string name, std::unique_ptr<Communicator>* out) override;

 private:
  using Clock = std::chrono::steady_clock;
  NcclCommunicator(std::string name, int rank, std::vector<int> world_ranks, std::chrono::milliseconds timeout,
                   int device, int priority);

  // Creates the stream, the event and the barrier buffer on device_ (the current device).
  Status init_resources(const std::string& what);

  // Issues `issue` (NCCL calls and copies on stream_; returns a Status made with check()) once the
  // communicator is usable, waits for NCCL to accept the calls (non-blocking mode may answer
  // ncclInProgress: NCCL requires polling until ncclSuccess before anything else goes on the stream)
  // and records event_. `op` is a literal; `peer` (a group rank, or -1) is the rank a timeout names.
  template <typename Issue>
  Status enqueue(const char* op, int peer, Clock::time_point deadline, Issue&& issue);
  // enqueue, then wait_event, both bounded by timeout() from now.
  template <typename Issue>
  Status run(const char* op, int peer, Issue&& issue);
  // Polls event_ and NCCL's asynchronous error until the event completes or the deadline passes.
  Status wait_event(const char* op, int peer, Clock::time_point deadline);

  // ncclSuccess and ncclInProgress are fine; anything else fails through nccl_fail.
  Status check(const char* op, ncclResult_t r) {
    return (r == ncclSuccess || r == ncclInProgress) ? Status::ok() : nccl_fail(op, r);
  }
  // The error for `r` (with ncclGetLastError's text); aborts the NCCL communicator.
  Status nccl_fail(const std::string& op, ncclResult_t r);
  Status cuda_fail(const std::string& op, const char* call, cudaError_t e);
  Status timeout_fail(const char* op, int peer);
  Status fail(std::string message);  // aborts comm_ and remembers the first message
  Status unusable(const char* op) const;

  Status enqueue_alltoallv_impl(const void* send, std::span<const int64_t> send_counts,
                                std::span<const int64_t> send_displs, void* recv,
                                std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs, DType t);
  Status enqueue_allreduce_impl(void* data, int64_t count, DType t, ReduceOp op);
  // The own block's copy and the grouped sends and receives of an all-to-all.
  Status issue_alltoallv(const char* op, const void* send, std::span<const int64_t> send_counts,
                         std::span<const int64_t> send_displs, void* recv, std::span<const int64_t> recv_counts,
                         std::span<const int64_t> recv_displs, DType t);
  Status allreduce_host(void* data, int64_t count, DType t, ReduceOp op);

  int device_;
  int priority_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t event_ = nullptr;
  void* barrier_buf_ = nullptr;  // one float on device_
  std::string error_;            // first error; later calls fail with it
  const char* pending_op_ = "operation";  // the last enqueued operation, named by wait()'s timeout
  int pending_peer_ = -1;
  std::vector<int64_t> counts_, displs_;  // the blocks alltoall and allgatherv pass to issue_alltoallv
};

}  // namespace moe::comm
