// MPI backend: see mpi_communicator.h.
#include "comm/mpi_communicator.h"

#include <sched.h>
#include <time.h>

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace moe::comm {
namespace {

bool g_session_alive = false;

// Small allreduces use recursive doubling (log2 P steps of the whole buffer: fewest latencies; in
// other group sizes than powers of two, the ranks beyond the largest power of two first fold into a
// partner and get the result back: 2 steps more); larger ones recursive halving + doubling in
// power-of-two groups (2 log2 P steps, least data), the ring in others (2 (P-1) steps, least data).
// See moe bench collectives.
constexpr size_t kRecursiveDoublingMaxBytes = 64 * 1024;
constexpr int kInternalTag = 7;

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
    case DType::i64: return MPI_INT64_T;
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return MPI_SUM;
    case ReduceOp::max: return MPI_MAX;
    case ReduceOp::min: return MPI_MIN;
  }
  return MPI_OP_NULL;
}

std::string mpi_error_string(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) return "MPI error code " + std::to_string(rc);
  return std::string(buf, len);
}

std::string seconds_str(std::chrono::milliseconds t) {
  char buf[32];
  if (t.count() % 1000 == 0) std::snprintf(buf, sizeof buf, "%lld s", static_cast<long long>(t.count() / 1000));
  else std::snprintf(buf, sizeof buf, "%.3g s", t.count() / 1000.0);
  return buf;
}

template <typename T>
void reduce_into(T* __restrict dst, const T* __restrict src, int64_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
      break;
    case ReduceOp::max:
      for (int64_t i = 0; i < n; ++i) dst[i] = std::max(dst[i], src[i]);
      break;
    case ReduceOp::min:
      for (int64_t i = 0; i < n; ++i) dst[i] = std::min(dst[i], src[i]);
      break;
  }
}

// dst[i] = a[i] op b[i]
template <typename T>
void reduce_to(T* __restrict dst, const T* __restrict a, const T* __restrict b, int64_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      for (int64_t i = 0; i < n; ++i) dst[i] = a[i] + b[i];
      break;
    case ReduceOp::max:
      for (int64_t i = 0; i < n; ++i) dst[i] = std::max(a[i], b[i]);
      break;
    case ReduceOp::min:
      for (int64_t i = 0; i < n; ++i) dst[i] = std::min(a[i], b[i]);
      break;
  }
}

void reduce_into(void* dst, const void* src, int64_t n, DType t, ReduceOp op) {
  switch (t) {
    case DType::f32: return reduce_into(static_cast<float*>(dst), static_cast<const float*>(src), n, op);
    case DType::f64: return reduce_into(static_cast<double*>(dst), static_cast<const double*>(src), n, op);
    case DType::i64: return reduce_into(static_cast<int64_t*>(dst), static_cast<const int64_t*>(src), n, op);
  }
}

void reduce_to(void* dst, const void* a, const void* b, int64_t n, DType t, ReduceOp op) {
  switch (t) {
    case DType::f32:
      return reduce_to(static_cast<float*>(dst), static_cast<const float*>(a), static_cast<const float*>(b), n, op);
    case DType::f64:
      return reduce_to(static_cast<double*>(dst), static_cast<const double*>(a), static_cast<const double*>(b), n,
                       op);
    case DType::i64:
      return reduce_to(static_cast<int64_t*>(dst), static_cast<const int64_t*>(a), static_cast<const int64_t*>(b), n,
                       op);
  }
}

char* at(void* p, int64_t elems, DType t) { return static_cast<char*>(p) + elems * dtype_size(t); }
const char* at(const void* p, int64_t elems, DType t) { return static_cast<const char*>(p) + elems * dtype_size(t); }

int mod(int a, int n) { return ((a % n) + n) % n; }

}  // namespace

// ---- MpiSession ----

Status MpiSession::start(std::unique_ptr<MpiSession>* out) {
  if (g_session_alive) throw std::logic_error("comm: a second MpiSession");
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) return Status::error("comm: MPI was already finalised in this process");
  int provided = MPI_THREAD_SINGLE;
  bool finalize = false;
  if (initialized) {
    MPI_Query_thread(&provided);
  } else {
    // OpenMPI's shared-memory transport sends messages up to 4 KiB eagerly and larger ones with a
    // rendezvous round trip; a 4 KiB payload plus its header falls just past the limit, which made a
    // 4 KiB allreduce 2.5x slower than it needs to be (measured: 2.8 us vs 0.6 us at 8 KiB). Raise it
    // unless the user chose a value (environment or mpirun --mca, which sets the same variable).
    setenv("OMPI_MCA_btl_vader_eager_limit", "8192", /*overwrite=*/0);
    int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) return Status::error("comm: MPI_Init_thread failed: " + mpi_error_string(rc));
    finalize = true;
  }
  g_session_alive = true;
  out->reset(new MpiSession(provided, finalize));
  return Status::ok();
}

MpiSession::~MpiSession() {
  g_session_alive = false;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalize_ && !finalized) MPI_Finalize();
}

const char* MpiSession::thread_level_name() const {
  switch (provided_) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
  }
  return "?";
}

int MpiSession::world_rank() const {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int MpiSession::world_size() const {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

Status MpiSession::world(std::unique_ptr<Communicator>* out, std::chrono::milliseconds timeout) {
  MPI_Comm comm;
  int rc = MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  if (rc != MPI_SUCCESS)
    return Status::error("rank " + std::to_string(world_rank()) + ": creating group 'world': " + mpi_error_string(rc));
  return MpiCommunicator::create(comm, "world", timeout, out);
}

// ---- MpiCommunicator: set-up ----

Status MpiCommunicator::create(MPI_Comm comm, std::string name, std::chrono::milliseconds timeout,
                               std::unique_ptr<Communicator>* out) {
  int world_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  auto fail = [&](const char* what, int rc) {
    MPI_Comm_free(&comm);
    return Status::error("rank " + std::to_string(world_rank) + ": creating group '" + name + "': " + what + ": " +
                         mpi_error_string(rc));
  };
  int rc = MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  if (rc != MPI_SUCCESS) return fail("MPI_Comm_set_errhandler", rc);
  int rank = 0, size = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  // Group rank -> world rank, without communicating.
  MPI_Group group, world_group;
  MPI_Comm_group(comm, &group);
  MPI_Comm_group(MPI_COMM_WORLD, &world_group);
  std::vector<int> ranks(size), world_ranks(size);
  for (int i = 0; i < size; ++i) ranks[i] = i;
  rc = MPI_Group_translate_ranks(group, size, ranks.data(), world_group, world_ranks.data());
  MPI_Group_free(&group);
  MPI_Group_free(&world_group);
  if (rc != MPI_SUCCESS) return fail("MPI_Group_translate_ranks", rc);
  MPI_Comm internal;
  rc = MPI_Comm_dup(comm, &internal);
  if (rc != MPI_SUCCESS) return fail("MPI_Comm_dup", rc);
  MPI_Comm_set_errhandler(internal, MPI_ERRORS_RETURN);
  out->reset(new MpiCommunicator(comm, internal, std::move(name), rank, std::move(world_ranks), timeout));
  return Status::ok();
}

MpiCommunicator::MpiCommunicator(MPI_Comm comm, MPI_Comm internal, std::string name, int rank,
                                 std::vector<int> world_ranks, std::chrono::milliseconds timeout)
    : Communicator(std::move(name), rank, std::move(world_ranks), timeout), comm_(comm), internal_(internal) {}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;  // destroyed after its session: nothing left to free
  if (!orphans_.empty()) {
    auto end = deadline();
    int done = 0;
    while (MPI_Testall(static_cast<int>(orphans_.size()), orphans_.data(), &done, MPI_STATUSES_IGNORE) ==
               MPI_SUCCESS &&
           !done && Clock::now() < end)
      sched_yield();
    if (!done) return;  // leak: MPI must not free a communicator under a pending collective
  }
  MPI_Comm_free(&internal_);
  MPI_Comm_free(&comm_);
}

Status MpiCommunicator::do_split(int color, int key, std::string name, std::unique_ptr<Communicator>* out) {
  MPI_Comm comm;
  int rc = MPI_Comm_split(comm_, color, key, &comm);
  if (rc != MPI_SUCCESS) return mpi_error(("split into '" + name + "'").c_str(), rc);
  Status st = create(comm, std::move(name), timeout(), out);
  return st;
}

// ---- waiting, errors ----

Status MpiCommunicator::mpi_error(const char* op, int rc) const {
  return Status::error(where(op) + ": " + mpi_error_string(rc));
}

Status MpiCommunicator::to_int(const char* op, int64_t v, int* out) const {
  if (v > INT_MAX)
    return Status::error(where(op) + ": count or displacement " + std::to_string(v) +
                         " exceeds MPI's int range (split the operation)");
  *out = static_cast<int>(v);
  return Status::ok();
}

Status MpiCommunicator::to_ints(const char* op, std::span<const int64_t> v, std::vector<int>* out) const {
  out->resize(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    Status st = to_int(op, v[i], &(*out)[i]);
    if (!st) return st;
  }
  return Status::ok();
}

void* MpiCommunicator::scratch(size_t bytes, int which) {
  auto& s = scratch_[which];
  if (s.size() < bytes) s.resize(bytes);  // grows to the largest step, then reused
  return s.data();
}

Status MpiCommunicator::wait(const char* op, std::span<MPI_Request> reqs, Clock::time_point deadline,
                             std::span<const int> recv_peer, MPI_Status* statuses) {
  const int n = static_cast<int>(reqs.size());
  MPI_Status local[4];
  if (!statuses && n <= 4) statuses = local;
  std::vector<MPI_Status> many;
  if (!statuses) many.resize(n), statuses = many.data();
  long nap_ns = 10'000;
  for (uint64_t polls = 0;; ++polls) {
    int done = 0;
    int rc = MPI_Testall(n, reqs.data(), &done, statuses);
    if (rc == MPI_ERR_IN_STATUS) {
      for (int i = 0; i < n; ++i)
        if (statuses[i].MPI_ERROR != MPI_SUCCESS && statuses[i].MPI_ERROR != MPI_ERR_PENDING)
          return mpi_error(op, statuses[i].MPI_ERROR);
    }
    if (rc != MPI_SUCCESS) return mpi_error(op, rc);
    if (done) return Status::ok();
    // Check the clock every 64 polls. Once the wait is not short (4096 polls, ~80 us), offer the core
    // (poll) or sleep 10 us doubling to 100 us (sleep): see WaitMode.
    if ((polls & 63) == 63) {
      if (Clock::now() >= deadline) break;
      if (polls <= 4096) continue;
      if (wait_mode() == WaitMode::poll) {
        sched_yield();
      } else {
        const timespec nap{0, nap_ns};
        nanosleep(&nap, nullptr);
        nap_ns = std::min(2 * nap_ns, 100'000L);
      }
    }
  }
  // Timed out: name the peers still silent, cancel their receives, keep the rest for the destructor.
  std::string silent;
  for (int i = 0; i < n; ++i) {
    if (reqs[i] == MPI_REQUEST_NULL) continue;
    if (i < static_cast<int>(recv_peer.size()) && recv_peer[i] >= 0) {
      if (!silent.empty()) silent += ", ";
      silent += std::to_string(world_ranks()[recv_peer[i]]);
      MPI_Cancel(&reqs[i]);
    }
    orphans_.push_back(reqs[i]);
    reqs[i] = MPI_REQUEST_NULL;
  }
  // A non-blocking collective cannot tell which member is late; in a group of two it is the other.
  if (silent.empty() && recv_peer.empty() && size() == 2) silent = std::to_string(world_ranks()[1 - rank()]);
  std::string waiting = silent.empty() ? "" : "waiting for rank " + silent + "; ";
  return Status::error(where(op) + " did not complete within " + seconds_str(timeout()) + " (" + waiting +
                       "a peer rank died or stopped?)");
}

// ---- all-to-all from point-to-point messages ----

Status MpiCommunicator::alltoallv_p2p(const char* op, const void* send, std::span<const int64_t> send_counts,
                                      std::span<const int64_t> send_displs, void* recv,
                                      std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs,
                                      DType t) {
  // Every receive, then every send, each in pairwise order (from r-k, to r+k) so that not every
  // rank sends to rank 0 first; a rank's own block is a copy; empty blocks are not sent at all
  // (both sides know the count). Measured against MPI_Alltoall at 1 KiB .. 64 MiB: this 0.94-1.06x,
  // MPI_Ialltoallv (libnbc) 0.75-0.90x for small messages on 4 ranks.
  const int P = size(), r = rank();
  for (int p = 0; p < P; ++p) {
    int unused;
    Status st = to_int(op, std::max({send_counts[p], send_displs[p], recv_counts[p], recv_displs[p]}), &unused);
    if (!st) return st;
  }
  auto end = deadline();
  reqs_.clear();
  peers_.clear();
  const MPI_Datatype type = mpi_type(t);
  for (int k = 1; k < P; ++k) {
    int src = mod(r - k, P);
    if (recv_counts[src] == 0) continue;
    reqs_.emplace_back();
    peers_.push_back(src);
    Status st = check(op, MPI_Irecv(at(recv, recv_displs[src], t), static_cast<int>(recv_counts[src]), type, src,
                                    kInternalTag, internal_, &reqs_.back()));
    if (!st) return st;
  }
  for (int k = 1; k < P; ++k) {
    int dst = mod(r + k, P);
    if (send_counts[dst] == 0) continue;
    reqs_.emplace_back();
    peers_.push_back(-1);
    Status st = check(op, MPI_Isend(at(send, send_displs[dst], t), static_cast<int>(send_counts[dst]), type, dst,
                                    kInternalTag, internal_, &reqs_.back()));
    if (!st) return st;
  }
  if (send_counts[r] > 0)
    std::memcpy(at(recv, recv_displs[r], t), at(send, send_displs[r], t), send_counts[r] * dtype_size(t));
  return wait(op, reqs_, end, peers_);
}

Status MpiCommunicator::do_alltoallv(const void* send, std::span<const int64_t> send_counts,
                                     std::span<const int64_t> send_displs, void* recv,
                                     std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs,
                                     DType t) {
  return alltoallv_p2p("alltoallv", send, send_counts, send_displs, recv, recv_counts, recv_displs, t);
}

Status MpiCommunicator::do_alltoall(const void* send, void* recv, int64_t count, DType t) {
  const int P = size();
  counts_.assign(P, count);
  displs_.resize(P);
  for (int p = 0; p < P; ++p) displs_[p] = p * count;
  return alltoallv_p2p("alltoall", send, counts_, displs_, recv, counts_, displs_, t);
}

// ---- MPI's own collectives, issued non-blocking ----

Status MpiCommunicator::do_allgather(const void* send, int64_t count, void* recv, DType t) {
  const char* op = "allgather";
  int n;
  Status st = to_int(op, count, &n);
  if (!st) return st;
  auto end = deadline();
  MPI_Request req;
  st = check(op, MPI_Iallgather(send, n, mpi_type(t), recv, n, mpi_type(t), comm_, &req));
  return st ? wait_one(op, &req, end) : st;
}

Status MpiCommunicator::do_allgatherv(const void* send, int64_t send_count, void* recv,
                                      std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs,
                                      DType t) {
  const char* op = "allgatherv";
  int n;
  Status st = to_int(op, send_count, &n);
  if (st) st = to_ints(op, recv_counts, &ints_[0]);
  if (st) st = to_ints(op, recv_displs, &ints_[1]);
  if (!st) return st;
  auto end = deadline();
  MPI_Request req;
  st = check(op, MPI_Iallgatherv(send, n, mpi_type(t), recv, ints_[0].data(), ints_[1].data(), mpi_type(t), comm_,
                                 &req));
  return st ? wait_one(op, &req, end) : st;
}

Status MpiCommunicator::do_broadcast(void* data, int64_t count, int root, DType t) {
  const char* op = "broadcast";
  int n;
  Status st = to_int(op, count, &n);
  if (!st) return st;
  auto end = deadline();
  MPI_Request req;
  st = check(op, MPI_Ibcast(data, n, mpi_type(t), root, comm_, &req));
  return st ? wait_one(op, &req, end) : st;
}

Status MpiCommunicator::do_reduce(const void* send, void* recv, int64_t count, int root, DType t, ReduceOp rop) {
  const char* op = "reduce";
  int n;
  Status st = to_int(op, count, &n);
  if (!st) return st;
  auto end = deadline();
  MPI_Request req;
  const void* s = (rank() == root && send == recv) ? MPI_IN_PLACE : send;
  st = check(op, MPI_Ireduce(s, recv, n, mpi_type(t), mpi_op(rop), root, comm_, &req));
  return st ? wait_one(op, &req, end) : st;
}

Status MpiCommunicator::do_barrier() {
  auto end = deadline();
  MPI_Request req;
  Status st = check("barrier", MPI_Ibarrier(comm_, &req));
  return st ? wait_one("barrier", &req, end) : st;
}

// ---- point to point ----

Status MpiCommunicator::do_send(const void* data, int64_t count, int peer, int tag, DType t) {
  int n;
  Status st = to_int("send", count, &n);
  if (!st) return st;
  auto end = deadline();
  MPI_Request req;
  st = check("send", MPI_Isend(data, n, mpi_type(t), peer, tag, comm_, &req));
  return st ? wait_one("send", &req, end) : st;
}

Status MpiCommunicator::do_recv(void* data, int64_t count, int peer, int tag, DType t) {
  int n;
  Status st = to_int("recv", count, &n);
  if (!st) return st;
  auto end = deadline();
  MPI_Request req;
  st = check("recv", MPI_Irecv(data, n, mpi_type(t), peer, tag, comm_, &req));
  if (!st) return st;
  MPI_Status status;
  int peers[1] = {peer};
  st = wait("recv", std::span<MPI_Request>(&req, 1), end, peers, &status);
  if (!st) return st;
  int got = 0;
  MPI_Get_count(&status, mpi_type(t), &got);
  if (got != n)
    return Status::error(where("recv") + ": expected " + std::to_string(n) + " elements from rank " +
                         std::to_string(world_ranks()[peer]) + ", got " + std::to_string(got));
  return Status::ok();
}

Status MpiCommunicator::do_sendrecv(const void* send, int64_t send_count, int dst, void* recv, int64_t recv_count,
                                    int src, int tag, DType t) {
  int ns, nr;
  Status st = to_int("sendrecv", send_count, &ns);
  if (st) st = to_int("sendrecv", recv_count, &nr);
  if (!st) return st;
  auto end = deadline();
  MPI_Request reqs[2];
  st = check("sendrecv", MPI_Irecv(recv, nr, mpi_type(t), src, tag, comm_, &reqs[0]));
  if (st) st = check("sendrecv", MPI_Isend(send, ns, mpi_type(t), dst, tag, comm_, &reqs[1]));
  if (!st) return st;
  MPI_Status statuses[2];
  int peers[2] = {src, -1};
  st = wait("sendrecv", reqs, end, peers, statuses);
  if (!st) return st;
  int got = 0;
  MPI_Get_count(&statuses[0], mpi_type(t), &got);
  if (got != nr)
    return Status::error(where("sendrecv") + ": expected " + std::to_string(nr) + " elements from rank " +
                         std::to_string(world_ranks()[src]) + ", got " + std::to_string(got));
  return Status::ok();
}

// ---- allreduce and reduce_scatter from point-to-point steps ----

Status MpiCommunicator::exchange(const char* op, const void* send, int64_t send_count, int dst, void* recv,
                                 int64_t recv_count, int src, DType t, Clock::time_point deadline) {
  // Counts were checked against INT_MAX by the caller (a step never exceeds the whole count).
  MPI_Request reqs[2];
  Status st = check(op, MPI_Irecv(recv, static_cast<int>(recv_count), mpi_type(t), src, kInternalTag, internal_,
                                  &reqs[0]));
  if (st)
    st = check(op, MPI_Isend(send, static_cast<int>(send_count), mpi_type(t), dst, kInternalTag, internal_,
                             &reqs[1]));
  if (!st) return st;
  int peers[2] = {src, -1};
  return wait(op, reqs, deadline, peers);
}

Status MpiCommunicator::do_allreduce(void* data, int64_t count, DType t, ReduceOp rop) {
  const char* op = "allreduce";
  const int P = size(), r = rank();
  int unused;
  Status st = to_int(op, count, &unused);
  if (!st || P == 1 || count == 0) return st;
  auto end = deadline();
  const size_t esz = dtype_size(t);

  if (count * esz <= kRecursiveDoublingMaxBytes) {
    // Recursive doubling over p2 = the largest power of two <= P "active" ranks: log2 p2 exchanges
    // of the whole buffer with active index a ^ mask. Both partners compute a op b with the same
    // operands (the ops are commutative in IEEE arithmetic), so every rank ends with identical bits.
    // With P = p2 + extra, ranks 2i+1 < 2 extra first send their buffer to 2i, which folds it in
    // and sends the result back at the end (MPICH's algorithm for other group sizes).
    int p2 = 1;
    while (p2 * 2 <= P) p2 *= 2;
    const int extra = P - p2;
    void* tmp = scratch(count * esz, 0);
    if (r < 2 * extra && r % 2 == 1) {  // folded out: hand over the buffer, wait for the result
      st = exchange(op, data, count, r - 1, tmp, 0, r - 1, t, end);
      if (!st) return st;
      return exchange(op, tmp, 0, r - 1, data, count, r - 1, t, end);
    }
    if (r < 2 * extra) {
      st = exchange(op, tmp, 0, r + 1, tmp, count, r + 1, t, end);
      if (!st) return st;
      reduce_into(data, tmp, count, t, rop);
    }
    const int active = r < 2 * extra ? r / 2 : r - extra;
    auto rank_of = [&](int a) { return a < extra ? 2 * a : a + extra; };
    for (int mask = 1; mask < p2; mask <<= 1) {
      const int peer = rank_of(active ^ mask);
      st = exchange(op, data, count, peer, tmp, count, peer, t, end);
      if (!st) return st;
      reduce_into(data, tmp, count, t, rop);
    }
    if (r < 2 * extra) return exchange(op, data, count, r + 1, tmp, 0, r + 1, t, end);
    return Status::ok();
  }

  if ((P & (P - 1)) == 0) {
    // Rabenseifner: reduce-scatter by recursive halving (in step `mask` keep the half of the current
    // range on this rank's side of bit `mask`, send the other half to r ^ mask, add what it sends
    // back), then allgather by recursive doubling (the same exchanges in reverse, with the reduced
    // ranges). The ring's bytes in 2 log2 P steps instead of 2 (P-1). Each element's final value is
    // computed on one rank, so all ranks get the same bits.
    int64_t lo = 0, hi = count;
    int64_t parent_lo[32], parent_hi[32];
    int level = 0;
    void* tmp = scratch((count / 2 + 1) * esz, 0);
    for (int mask = P / 2; mask >= 1; mask >>= 1, ++level) {
      const int peer = r ^ mask;
      const int64_t mid = lo + (hi - lo) / 2;
      parent_lo[level] = lo, parent_hi[level] = hi;
      const bool lower = (r & mask) == 0;
      const int64_t keep_lo = lower ? lo : mid, keep_hi = lower ? mid : hi;
      const int64_t give_lo = lower ? mid : lo, give_hi = lower ? hi : mid;
      st = exchange(op, at(data, give_lo, t), give_hi - give_lo, peer, tmp, keep_hi - keep_lo, peer, t, end);
      if (!st) return st;
      reduce_into(at(data, keep_lo, t), tmp, keep_hi - keep_lo, t, rop);
      lo = keep_lo, hi = keep_hi;
    }
    for (int mask = 1; mask < P; mask <<= 1) {
      --level;
      const int peer = r ^ mask;
      const int64_t plo = parent_lo[level], phi = parent_hi[level];
      const int64_t other_lo = lo == plo ? hi : plo, other_hi = lo == plo ? phi : lo;
      st = exchange(op, at(data, lo, t), hi - lo, peer, at(data, other_lo, t), other_hi - other_lo, peer, t, end);
      if (!st) return st;
      lo = plo, hi = phi;
    }
    return Status::ok();
  }

  // Ring (any P): chunk c = [off[c], off[c] + len[c]). Reduce-scatter: after P-1 steps rank r holds the full
  // reduction of chunk r (in step s it sends chunk r-s-1, which it reduced in step s-1, and reduces
  // chunk r-s-2 received from r-1). Allgather: P-1 steps pass the finished chunks around.
  std::vector<int64_t> off(P + 1);
  for (int c = 0; c <= P; ++c) off[c] = count * c / P;
  auto len = [&](int c) { return off[c + 1] - off[c]; };
  const int next = mod(r + 1, P), prev = mod(r - 1, P);
  void* tmp = scratch((count / P + 1) * esz, 0);
  for (int s = 0; s < P - 1; ++s) {
    int sc = mod(r - s - 1, P), rc = mod(r - s - 2, P);
    st = exchange(op, at(data, off[sc], t), len(sc), next, tmp, len(rc), prev, t, end);
    if (!st) return st;
    reduce_into(at(data, off[rc], t), tmp, len(rc), t, rop);
  }
  for (int s = 0; s < P - 1; ++s) {
    int sc = mod(r - s, P), rc = mod(r - s - 1, P);
    st = exchange(op, at(data, off[sc], t), len(sc), next, at(data, off[rc], t), len(rc), prev, t, end);
    if (!st) return st;
  }
  return Status::ok();
}

Status MpiCommunicator::do_reduce_scatter(const void* send, void* recv, int64_t count, DType t, ReduceOp rop) {
  const char* op = "reduce_scatter";
  const int P = size(), r = rank();
  int unused;
  Status st = to_int(op, count, &unused);
  if (!st || count == 0) return st;
  const size_t esz = dtype_size(t);
  if (P == 1) {
    std::memcpy(recv, send, count * esz);
    return Status::ok();
  }
  // The ring's reduce-scatter phase with blocks of `count`: in step s send the partial sum of
  // block r-s-1 (in step 0 this rank's own block), receive the partial of block r-s-2 from r-1 and
  // add this rank's block to it; the last step's block is r, written to recv.
  auto end = deadline();
  void* acc = scratch(count * esz, 0);
  void* tmp = scratch(count * esz, 1);
  const int next = mod(r + 1, P), prev = mod(r - 1, P);
  for (int s = 0; s < P - 1; ++s) {
    int sb = mod(r - s - 1, P), rb = mod(r - s - 2, P);
    const void* out = s == 0 ? at(send, sb * count, t) : acc;
    st = exchange(op, out, count, next, tmp, count, prev, t, end);
    if (!st) return st;
    reduce_to(s == P - 2 ? recv : acc, tmp, at(send, rb * count, t), count, t, rop);
  }
  return Status::ok();
}

bool started_by_mpirun() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMIX_RANK") || std::getenv("PMI_RANK");
}

// ---- aborting ----

void abort_job(const Status& error) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  bool mpi = initialized && !finalized;
  int rank = -1;
  if (mpi) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::string prefix = "rank " + std::to_string(rank) + ": ";
  const std::string& m = error.message();
  if (rank >= 0 && m.rfind(prefix, 0) != 0) std::fprintf(stderr, "moe: %s%s\n", prefix.c_str(), m.c_str());
  else std::fprintf(stderr, "moe: %s\n", m.c_str());
  std::fflush(stderr);
  if (mpi) MPI_Abort(MPI_COMM_WORLD, 1);
  std::_Exit(1);
}

}  // namespace moe::comm
