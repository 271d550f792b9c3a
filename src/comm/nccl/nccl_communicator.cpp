// NCCL backend: see nccl_communicator.h.
#include "comm/nccl/nccl_communicator.h"

#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "util/str_cat.h"

namespace moe::comm {
namespace {

using Clock = std::chrono::steady_clock;

// The NCCL unique id travels over the bootstrap as int64 elements (the element types Communicator has).
constexpr int kIdWords = sizeof(ncclUniqueId) / sizeof(int64_t);
static_assert(sizeof(ncclUniqueId) % sizeof(int64_t) == 0);

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::i64: return ncclInt64;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::min: return ncclMin;
  }
  return ncclSum;
}

char* at(void* p, int64_t elems, DType t) { return static_cast<char*>(p) + elems * dtype_size(t); }
const char* at(const void* p, int64_t elems, DType t) { return static_cast<const char*>(p) + elems * dtype_size(t); }

std::string seconds_str(std::chrono::milliseconds t) {
  char buf[32];
  if (t.count() % 1000 == 0) std::snprintf(buf, sizeof buf, "%lld s", static_cast<long long>(t.count() / 1000));
  else std::snprintf(buf, sizeof buf, "%.3g s", t.count() / 1000.0);
  return buf;
}

// " (text)" of ncclGetLastError, or "" when NCCL has nothing to add.
std::string last_error(ncclComm_t comm) {
  const char* s = ncclGetLastError(comm);
  return (s && *s) ? str_cat(" (", s, ")") : std::string();
}

// Makes `device` current for the scope: cudaMalloc*, stream and event creation act on the current
// device, and the caller's thread may have another one current (several GPUs per process).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) {
      (void)cudaGetLastError();
      prev_ = -1;
    }
    if (prev_ != device_) (void)cudaSetDevice(device_);
  }
  ~DeviceGuard() {
    if (prev_ >= 0 && prev_ != device_) (void)cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_;
  int prev_ = -1;
};

// A non-blocking communicator answers ncclInProgress while it works in the background (init,
// split, grouped launches, finalize); NCCL requires polling it until it is no longer in progress.
// Returns the final state (or the query's own error); *timed_out when `deadline` passed first.
ncclResult_t settle(ncclComm_t comm, Clock::time_point deadline, bool* timed_out) {
  *timed_out = false;
  for (uint64_t polls = 0;; ++polls) {
    ncclResult_t state = ncclInProgress;
    ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return r;
    if (state != ncclInProgress) return state;
    if ((polls & 63) == 63) {
      if (Clock::now() >= deadline) {
        *timed_out = true;
        return ncclInProgress;
      }
      sched_yield();
    }
  }
}

// Host memory (pageable or pinned) must be staged for NCCL; device and managed memory need not.
bool device_accessible(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

}  // namespace

// ---- set-up ----

NcclCommunicator::NcclCommunicator(std::string name, int rank, std::vector<int> world_ranks,
                                   std::chrono::milliseconds timeout, int device, int priority)
    : Communicator(std::move(name), rank, std::move(world_ranks), timeout), device_(device), priority_(priority) {}

Status NcclCommunicator::init_resources(const std::string& what) {
  auto cuda = [&](cudaError_t e, const char* call) {
    return e == cudaSuccess ? Status::ok() : Status::error(str_cat(what, ": ", call, ": ", cudaGetErrorString(e)));
  };
  Status st = cuda(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, priority_),
                   "cudaStreamCreateWithPriority");
  if (st) st = cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate");
  if (st) st = cuda(cudaMalloc(&barrier_buf_, sizeof(float)), "cudaMalloc(barrier buffer)");
  // On the stream, so the first barrier's allreduce is ordered after it.
  if (st) st = cuda(cudaMemsetAsync(barrier_buf_, 0, sizeof(float), stream_), "cudaMemsetAsync");
  return st;
}

Status NcclCommunicator::create(Communicator& bootstrap, int device, int stream_priority, std::string name,
                                std::unique_ptr<NcclCommunicator>* out) {
  const std::string what = str_cat("rank ", bootstrap.world_rank(), ": creating NCCL group '", name, "'");

  // Local checks first, then agree, so that a rank without its GPU fails every rank at once
  // instead of leaving the others waiting in NCCL's initialisation.
  std::string local;
  int n = 0;
  if (cudaError_t e = cudaGetDeviceCount(&n); e != cudaSuccess) {
    (void)cudaGetLastError();
    local = str_cat("no CUDA device ", device, " (", cudaGetErrorString(e), ")");
  } else if (device < 0 || device >= n) {
    local = str_cat("no CUDA device ", device, " (", n, " present)");
  } else if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
    local = str_cat("cudaSetDevice(", device, "): ", cudaGetErrorString(e));
  }
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  if (local.empty() && bootstrap.rank() == 0) {
    if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess)
      local = str_cat("ncclGetUniqueId: ", ncclGetErrorString(r), last_error(nullptr));
  }
  int64_t failed = local.empty() ? 0 : 1;
  if (Status st = bootstrap.allreduce(&failed, 1, ReduceOp::max); !st)
    return Status::error(str_cat(what, ": bootstrap: ", st.message()));
  if (!local.empty()) return Status::error(str_cat(what, ": ", local));
  if (failed) return Status::error(str_cat(what, ": another rank could not set up its GPU or NCCL (its error says why)"));

  int64_t words[kIdWords];
  std::memcpy(words, &id, sizeof id);
  if (Status st = bootstrap.broadcast(words, kIdWords, 0); !st)
    return Status::error(str_cat(what, ": bootstrap: ", st.message()));
  std::memcpy(&id, words, sizeof id);

  std::unique_ptr<NcclCommunicator> c(new NcclCommunicator(std::move(name), bootstrap.rank(), bootstrap.world_ranks(),
                                                           bootstrap.timeout(), device, stream_priority));
  if (Status st = c->init_resources(what); !st) return st;

  // Non-blocking, so that a rank that never arrives turns into a timeout rather than a hang.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const auto deadline = Clock::now() + bootstrap.timeout();
  ncclResult_t r = ncclCommInitRankConfig(&comm, bootstrap.size(), id, bootstrap.rank(), &config);
  bool timed_out = false;
  if ((r == ncclSuccess || r == ncclInProgress) && comm) r = settle(comm, deadline, &timed_out);
  if (timed_out || r != ncclSuccess || !comm) {
    std::string why = timed_out ? str_cat(" did not complete within ", seconds_str(bootstrap.timeout()),
                                          " (a peer rank died, stopped or cannot reach this one?)")
                                : str_cat(": ", ncclGetErrorString(r), last_error(comm));
    if (comm) ncclCommAbort(comm);
    return Status::error(str_cat(what, ": ncclCommInitRankConfig", why));
  }
  c->comm_ = comm;
  *out = std::move(c);
  return Status::ok();
}

Status NcclCommunicator::stream_priority_range(int device, StreamPriorityRange* out) {
  int n = 0;
  if (cudaError_t e = cudaGetDeviceCount(&n); e != cudaSuccess) {
    (void)cudaGetLastError();
    return Status::error(str_cat("cuda: no CUDA device ", device, " (", cudaGetErrorString(e), ")"));
  }
  if (device < 0 || device >= n) return Status::error(str_cat("cuda: no CUDA device ", device, " (", n, " present)"));
  DeviceGuard guard(device);
  StreamPriorityRange range;
  if (cudaError_t e = cudaDeviceGetStreamPriorityRange(&range.least, &range.greatest); e != cudaSuccess)
    return Status::error(str_cat("cuda: cudaDeviceGetStreamPriorityRange(device ", device, "): ", cudaGetErrorString(e)));
  *out = range;
  return Status::ok();
}

int NcclCommunicator::lane_priority(CommLane lane, const StreamPriorityRange& range) {
  switch (lane) {
    case CommLane::a2a:
    case CommLane::gather: return range.greatest;
    case CommLane::allreduce: return range.least;
  }
  return range.least;
}

NcclCommunicator::~NcclCommunicator() {
  DeviceGuard guard(device_);
  if (comm_) {
    // Finalize flushes what is still enqueued and waits for the peers; a peer that never gets
    // here must not hang the destructor, so past the timeout the communicator is aborted.
    bool clean = false;
    ncclResult_t r = ncclCommFinalize(comm_);
    if (r == ncclSuccess || r == ncclInProgress) {
      bool timed_out = false;
      clean = settle(comm_, Clock::now() + timeout(), &timed_out) == ncclSuccess && !timed_out;
    }
    if (clean) ncclCommDestroy(comm_);
    else ncclCommAbort(comm_);
    comm_ = nullptr;
  }
  if (event_) cudaEventDestroy(event_);
  if (barrier_buf_) cudaFree(barrier_buf_);
  if (stream_) cudaStreamDestroy(stream_);
}

// ---- errors ----

Status NcclCommunicator::fail(std::string message) {
  if (error_.empty()) error_ = message;
  if (comm_) {
    // After an error or a timeout the peers are in an unknown state: stop this rank's kernels
    // (they may be waiting for a dead peer) and never use the NCCL communicator again.
    ncclCommAbort(comm_);
    comm_ = nullptr;
  }
  return Status::error(std::move(message));
}

Status NcclCommunicator::nccl_fail(const std::string& op, ncclResult_t r) {
  // ncclGetLastError before the abort frees the communicator.
  return fail(str_cat(where(op), ": ", ncclGetErrorString(r), last_error(comm_)));
}

Status NcclCommunicator::cuda_fail(const std::string& op, const char* call, cudaError_t e) {
  return fail(str_cat(where(op), ": ", call, ": ", cudaGetErrorString(e)));
}

Status NcclCommunicator::timeout_fail(const char* op, int peer) {
  // A collective cannot tell which member is late; a point-to-point call or a group of two can.
  int late = -1;
  if (peer >= 0 && peer != rank()) late = peer;
  else if (size() == 2) late = 1 - rank();
  std::string waiting = late >= 0 ? str_cat("waiting for rank ", world_ranks()[late], "; ") : std::string();
  return fail(str_cat(where(op), " did not complete within ", seconds_str(timeout()), " (", waiting,
                      "a peer rank died or stopped?)"));
}

Status NcclCommunicator::unusable(const char* op) const {
  return Status::error(str_cat(where(op), ": communicator unusable after an earlier error (", error_, ")"));
}

// ---- issuing and waiting ----

template <typename Issue>
Status NcclCommunicator::enqueue(const char* op, int peer, Clock::time_point deadline, Issue&& issue) {
  if (!comm_) return unusable(op);
  DeviceGuard guard(device_);
  if (Status st = issue(); !st) return st;
  bool timed_out = false;
  ncclResult_t state = settle(comm_, deadline, &timed_out);
  if (timed_out) return timeout_fail(op, peer);
  if (state != ncclSuccess) return nccl_fail(op, state);
  if (cudaError_t e = cudaEventRecord(event_, stream_); e != cudaSuccess) return cuda_fail(op, "cudaEventRecord", e);
  pending_op_ = op;
  pending_peer_ = peer;
  return Status::ok();
}

template <typename Issue>
Status NcclCommunicator::run(const char* op, int peer, Issue&& issue) {
  const auto deadline = Clock::now() + timeout();
  Status st = enqueue(op, peer, deadline, std::forward<Issue>(issue));
  return st ? wait_event(op, peer, deadline) : st;
}

Status NcclCommunicator::wait_event(const char* op, int peer, Clock::time_point deadline) {
  for (uint64_t polls = 0;; ++polls) {
    cudaError_t e = cudaEventQuery(event_);
    if (e == cudaSuccess) return Status::ok();
    if (e != cudaErrorNotReady) return cuda_fail(op, "cudaEventQuery (a kernel or copy on the device failed)", e);
    // A network failure or a peer's abort shows here while the kernels are still waiting.
    ncclResult_t async = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(comm_, &async);
    if (r != ncclSuccess) return nccl_fail(op, r);
    if (async != ncclSuccess && async != ncclInProgress) return nccl_fail(op, async);
    // Check the clock every 64 polls; yield the core (to the compute thread's launches) once the
    // wait is not short.
    if ((polls & 63) == 63) {
      if (Clock::now() >= deadline) return timeout_fail(op, peer);
      if (polls > 4096) sched_yield();
    }
  }
}

Status NcclCommunicator::wait() {
  if (!comm_) return unusable("wait");
  return wait_event(pending_op_, pending_peer_, Clock::now() + timeout());
}

Status NcclCommunicator::depend_on(cudaEvent_t event) {
  if (!comm_) return unusable("depend_on");
  if (cudaError_t e = cudaStreamWaitEvent(stream_, event, 0); e != cudaSuccess)
    return cuda_fail("depend_on", "cudaStreamWaitEvent", e);
  return Status::ok();
}

// ---- all-to-all and allgatherv as grouped point-to-point ----

Status NcclCommunicator::issue_alltoallv(const char* op, const void* send, std::span<const int64_t> send_counts,
                                         std::span<const int64_t> send_displs, void* recv,
                                         std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs,
                                         DType t) {
  const int P = size(), r = rank();
  void* own = at(recv, recv_displs[r], t);
  const void* own_send = at(send, send_displs[r], t);
  if (send_counts[r] > 0 && own != own_send) {  // in place (allgatherv): nothing to copy
    cudaError_t e = cudaMemcpyAsync(own, own_send, send_counts[r] * dtype_size(t), cudaMemcpyDefault, stream_);
    if (e != cudaSuccess) return cuda_fail(op, "cudaMemcpyAsync (own block)", e);
  }
  if (P == 1) return Status::ok();
  // Empty blocks are not sent at all: both sides know the count. Inside one group the order of the
  // calls does not matter to NCCL; pairwise order (to r+k, from r-k) matches the MPI backend.
  const ncclDataType_t type = nccl_type(t);
  ncclResult_t first = ncclGroupStart();
  if (first != ncclSuccess) return nccl_fail(op, first);
  for (int k = 1; k < P; ++k) {
    const int dst = (r + k) % P, src = (r - k + P) % P;
    if (send_counts[dst] > 0 && first == ncclSuccess)
      first = ncclSend(at(send, send_displs[dst], t), send_counts[dst], type, dst, comm_, stream_);
    if (recv_counts[src] > 0 && first == ncclSuccess)
      first = ncclRecv(at(recv, recv_displs[src], t), recv_counts[src], type, src, comm_, stream_);
  }
  // Always close the group, also after an error inside it.
  ncclResult_t end = ncclGroupEnd();
  return check(op, first != ncclSuccess ? first : end);
}

Status NcclCommunicator::do_alltoallv(const void* send, std::span<const int64_t> send_counts,
                                      std::span<const int64_t> send_displs, void* recv,
                                      std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs,
                                      DType t) {
  return run("alltoallv", -1, [&] {
    return issue_alltoallv("alltoallv", send, send_counts, send_displs, recv, recv_counts, recv_displs, t);
  });
}

Status NcclCommunicator::do_alltoall(const void* send, void* recv, int64_t count, DType t) {
  const int P = size();
  counts_.assign(P, count);
  displs_.resize(P);
  for (int p = 0; p < P; ++p) displs_[p] = p * count;
  return run("alltoall", -1,
             [&] { return issue_alltoallv("alltoall", send, counts_, displs_, recv, counts_, displs_, t); });
}

Status NcclCommunicator::do_allgatherv(const void* send, int64_t send_count, void* recv,
                                       std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs,
                                       DType t) {
  // An alltoallv whose every send block is the one contribution.
  counts_.assign(size(), send_count);
  displs_.assign(size(), 0);
  return run("allgatherv", -1, [&] {
    return issue_alltoallv("allgatherv", send, counts_, displs_, recv, recv_counts, recv_displs, t);
  });
}

// ---- NCCL's own collectives ----
// Zero counts return at once: every rank passes the same count, so all of them skip together.

Status NcclCommunicator::do_allreduce(void* data, int64_t count, DType t, ReduceOp rop) {
  if (count == 0) return Status::ok();
  if (!device_accessible(data)) return allreduce_host(data, count, t, rop);
  return run("allreduce", -1, [&] {
    return check("allreduce", ncclAllReduce(data, data, count, nccl_type(t), nccl_op(rop), comm_, stream_));
  });
}

Status NcclCommunicator::allreduce_host(void* data, int64_t count, DType t, ReduceOp rop) {
  const char* op = "allreduce";
  if (!comm_) return unusable(op);
  DeviceGuard guard(device_);
  const size_t bytes = count * dtype_size(t);
  const auto deadline = Clock::now() + timeout();
  // A copy from pageable memory may block the host until the stream reaches it: let enqueued
  // operations finish first (bounded), so that only this allreduce can keep the stream busy.
  if (Status st = wait_event(pending_op_, pending_peer_, deadline); !st) return st;
  void* tmp = nullptr;
  // Stream-ordered allocation: cudaMalloc/cudaFree would synchronise the whole device, i.e. wait
  // for other lanes' NCCL kernels, which may be waiting for this rank.
  if (cudaError_t e = cudaMallocAsync(&tmp, bytes, stream_); e != cudaSuccess)
    return cuda_fail(op, "cudaMallocAsync (staging host memory)", e);
  Status st = enqueue(op, -1, deadline, [&] {
    cudaError_t e = cudaMemcpyAsync(tmp, data, bytes, cudaMemcpyHostToDevice, stream_);
    if (e != cudaSuccess) return cuda_fail(op, "cudaMemcpyAsync (to device)", e);
    return check(op, ncclAllReduce(tmp, tmp, count, nccl_type(t), nccl_op(rop), comm_, stream_));
  });
  if (st) st = wait_event(op, -1, deadline);
  // Copied back only after the allreduce completed: a copy to pageable memory blocks the host,
  // which must not happen while the allreduce may still be waiting for a peer.
  if (st) {
    cudaError_t e = cudaMemcpyAsync(data, tmp, bytes, cudaMemcpyDeviceToHost, stream_);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream_);
    if (e != cudaSuccess) st = cuda_fail(op, "cudaMemcpyAsync (to host)", e);
  }
  (void)cudaFreeAsync(tmp, stream_);
  return st;
}

Status NcclCommunicator::do_allgather(const void* send, int64_t count, void* recv, DType t) {
  if (count == 0) return Status::ok();
  return run("allgather", -1,
             [&] { return check("allgather", ncclAllGather(send, recv, count, nccl_type(t), comm_, stream_)); });
}

Status NcclCommunicator::do_reduce_scatter(const void* send, void* recv, int64_t count, DType t, ReduceOp rop) {
  if (count == 0) return Status::ok();
  return run("reduce_scatter", -1, [&] {
    return check("reduce_scatter",
                 ncclReduceScatter(send, recv, count, nccl_type(t), nccl_op(rop), comm_, stream_));
  });
}

Status NcclCommunicator::do_broadcast(void* data, int64_t count, int root, DType t) {
  if (count == 0) return Status::ok();
  return run("broadcast", -1, [&] {
    return check("broadcast", ncclBroadcast(data, data, count, nccl_type(t), root, comm_, stream_));
  });
}

Status NcclCommunicator::do_reduce(const void* send, void* recv, int64_t count, int root, DType t, ReduceOp rop) {
  if (count == 0) return Status::ok();
  // recv is only written on root (NCCL takes null elsewhere); send == recv on root is in place.
  return run("reduce", -1, [&] {
    return check("reduce", ncclReduce(send, rank() == root ? recv : nullptr, count, nccl_type(t), nccl_op(rop), root,
                                      comm_, stream_));
  });
}

Status NcclCommunicator::do_barrier() {
  // An allreduce completes on a rank only after every rank contributed: a barrier.
  return run("barrier", -1, [&] {
    return check("barrier", ncclAllReduce(barrier_buf_, barrier_buf_, 1, ncclFloat32, ncclSum, comm_, stream_));
  });
}

// ---- point to point (tags unused: NCCL matches messages between two ranks in issue order) ----

Status NcclCommunicator::do_send(const void* data, int64_t count, int peer, int tag, DType t) {
  if (count == 0) return Status::ok();
  return run("send", peer,
             [&] { return check("send", ncclSend(data, count, nccl_type(t), peer, comm_, stream_)); });
}

Status NcclCommunicator::do_recv(void* data, int64_t count, int peer, int tag, DType t) {
  if (count == 0) return Status::ok();
  return run("recv", peer,
             [&] { return check("recv", ncclRecv(data, count, nccl_type(t), peer, comm_, stream_)); });
}

Status NcclCommunicator::do_sendrecv(const void* send, int64_t send_count, int dst, void* recv, int64_t recv_count,
                                     int src, int tag, DType t) {
  const char* op = "sendrecv";
  if (send_count == 0 && recv_count == 0) return Status::ok();
  // The rank this one waits for: the source, unless it receives from itself.
  const int peer = src != rank() ? src : dst;
  return run(op, peer, [&] {
    // One group, so both directions progress together (two ranks exchanging cannot deadlock), and
    // a peer may be this rank (NCCL copies within the group).
    const ncclDataType_t type = nccl_type(t);
    ncclResult_t first = ncclGroupStart();
    if (first != ncclSuccess) return nccl_fail(op, first);
    if (send_count > 0) first = ncclSend(send, send_count, type, dst, comm_, stream_);
    if (recv_count > 0 && first == ncclSuccess) first = ncclRecv(recv, recv_count, type, src, comm_, stream_);
    ncclResult_t end = ncclGroupEnd();
    return check(op, first != ncclSuccess ? first : end);
  });
}

// ---- non-blocking variants ----

namespace {

[[noreturn]] void fail_require(const Communicator& c, const char* op, const std::string& what) {
  throw std::logic_error(c.where(op) + ": " + what);
}

void check_vector(const Communicator& c, const char* op, const char* what, std::span<const int64_t> v) {
  if (static_cast<int>(v.size()) != c.size())
    fail_require(c, op, str_cat(what, " has ", v.size(), " entries, the group has ", c.size(), " ranks"));
  for (size_t p = 0; p < v.size(); ++p)
    if (v[p] < 0) fail_require(c, op, str_cat(what, "[", p, "] = ", v[p], " (negative)"));
}

}  // namespace

Status NcclCommunicator::enqueue_alltoallv_impl(const void* send, std::span<const int64_t> send_counts,
                                                std::span<const int64_t> send_displs, void* recv,
                                                std::span<const int64_t> recv_counts,
                                                std::span<const int64_t> recv_displs, DType t) {
  const char* op = "alltoallv";
  check_vector(*this, op, "send_counts", send_counts);
  check_vector(*this, op, "send_displs", send_displs);
  check_vector(*this, op, "recv_counts", recv_counts);
  check_vector(*this, op, "recv_displs", recv_displs);
  if (recv_counts[rank()] != send_counts[rank()])
    fail_require(*this, op,
                 str_cat("recv_counts[", rank(), "] = ", recv_counts[rank()], " != send_counts[", rank(),
                         "] = ", send_counts[rank()], " (the block a rank sends itself)"));
  return enqueue(op, -1, Clock::now() + timeout(), [&] {
    return issue_alltoallv(op, send, send_counts, send_displs, recv, recv_counts, recv_displs, t);
  });
}

Status NcclCommunicator::enqueue_allreduce_impl(void* data, int64_t count, DType t, ReduceOp rop) {
  const char* op = "allreduce";
  if (count < 0) fail_require(*this, op, str_cat("negative count ", count));
  if (count == 0) return comm_ ? Status::ok() : unusable(op);
  return enqueue(op, -1, Clock::now() + timeout(), [&] {
    return check(op, ncclAllReduce(data, data, count, nccl_type(t), nccl_op(rop), comm_, stream_));
  });
}

// ---- split ----

Status NcclCommunicator::do_split(int color, int key, std::string name, std::unique_ptr<Communicator>* out) {
  const std::string op = "split into '" + name + "'";
  if (!comm_) return unusable("split");
  DeviceGuard guard(device_);
  // Set-up: no timeout (the Communicator contract), as in the MPI backend.
  const auto forever = Clock::time_point::max();
  const int P = size(), r = rank();

  // Every rank's (color, key), to know the new group's world ranks (NCCL does not tell them).
  std::vector<int64_t> all(2 * P);
  all[2 * r] = color;
  all[2 * r + 1] = key;
  if (Status st = wait_event(pending_op_, pending_peer_, forever); !st) return st;  // as in allreduce_host
  int64_t* dev = nullptr;
  if (cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&dev), all.size() * sizeof(int64_t), stream_);
      e != cudaSuccess)
    return cuda_fail(op, "cudaMallocAsync", e);
  Status st = enqueue("split", -1, forever, [&] {
    cudaError_t e = cudaMemcpyAsync(dev + 2 * r, &all[2 * r], 2 * sizeof(int64_t), cudaMemcpyHostToDevice, stream_);
    if (e != cudaSuccess) return cuda_fail(op, "cudaMemcpyAsync", e);
    return check("split", ncclAllGather(dev + 2 * r, dev, 2, ncclInt64, comm_, stream_));
  });
  if (st) st = wait_event("split", -1, forever);
  if (st) {
    cudaError_t e = cudaMemcpyAsync(all.data(), dev, all.size() * sizeof(int64_t), cudaMemcpyDeviceToHost, stream_);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream_);
    if (e != cudaSuccess) st = cuda_fail(op, "cudaMemcpyAsync (to host)", e);
  }
  (void)cudaFreeAsync(dev, stream_);
  if (!st) return st;

  // MPI_Comm_split's order, which ncclCommSplit follows: by key, then by rank in this group.
  std::vector<int> members;
  for (int q = 0; q < P; ++q)
    if (all[2 * q] == color) members.push_back(q);
  std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return all[2 * a + 1] < all[2 * b + 1]; });
  std::vector<int> world;
  int new_rank = -1;
  for (size_t i = 0; i < members.size(); ++i) {
    world.push_back(world_ranks()[members[i]]);
    if (members[i] == r) new_rank = static_cast<int>(i);
  }

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t res = ncclCommSplit(comm_, color, key, &comm, &config);
  if (res != ncclSuccess && res != ncclInProgress) return nccl_fail(op, res);
  // Both the parent and the new communicator may be in progress; NCCL wants both settled.
  bool timed_out = false;
  res = settle(comm_, forever, &timed_out);
  if (res != ncclSuccess) {
    if (comm) ncclCommAbort(comm);
    return nccl_fail(op, res);
  }
  if (!comm) return fail(str_cat(where(op), ": ncclCommSplit returned no communicator"));
  res = settle(comm, forever, &timed_out);
  int got_rank = -1, got_size = 0;
  if (res == ncclSuccess) res = ncclCommUserRank(comm, &got_rank);
  if (res == ncclSuccess) res = ncclCommCount(comm, &got_size);
  if (res != ncclSuccess) {
    std::string msg = str_cat(where(op), ": ncclCommSplit: ", ncclGetErrorString(res), last_error(comm));
    ncclCommAbort(comm);
    return fail(std::move(msg));
  }
  if (got_rank != new_rank || got_size != static_cast<int>(members.size())) {
    ncclCommAbort(comm);
    return fail(str_cat(where(op), ": ncclCommSplit made rank ", got_rank, " of ", got_size, ", expected rank ",
                        new_rank, " of ", members.size()));
  }

  std::unique_ptr<NcclCommunicator> child(
      new NcclCommunicator(std::move(name), new_rank, std::move(world), timeout(), device_, priority_));
  child->comm_ = comm;  // from here the child's destructor releases it
  if (st = child->init_resources(where(op)); !st) {
    child->fail(st.message());  // aborts the new NCCL communicator (its peers are told nothing)
    return fail(st.message());
  }
  *out = std::move(child);
  return Status::ok();
}

}  // namespace moe::comm
