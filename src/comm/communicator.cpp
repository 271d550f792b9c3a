// Communicator: argument checks, the broken state, split and the expert-parallel groups. The
// backends implement the do_* hooks (mpi_communicator.cpp).
#include "comm/communicator.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace moe::comm {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::i64: return 8;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float";
    case DType::f64: return "double";
    case DType::i64: return "int64";
  }
  return "?";
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::max: return "max";
    case ReduceOp::min: return "min";
  }
  return "?";
}

namespace {

std::string list_str(const std::vector<int>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(v[i]);
  }
  return s + "]";
}

}  // namespace

Communicator::Communicator(std::string name, int rank, std::vector<int> world_ranks, std::chrono::milliseconds timeout)
    : name_(std::move(name)), rank_(rank), world_ranks_(std::move(world_ranks)), timeout_(timeout) {
  if (rank_ < 0 || rank_ >= static_cast<int>(world_ranks_.size()))
    throw std::logic_error("comm: rank " + std::to_string(rank_) + " outside a group of " +
                           std::to_string(world_ranks_.size()));
  if (timeout_.count() <= 0) throw std::logic_error("comm: timeout must be > 0");
}

void Communicator::set_timeout(std::chrono::milliseconds t) {
  if (t.count() <= 0) throw std::logic_error(where("set_timeout") + ": timeout must be > 0");
  timeout_ = t;
}

std::string Communicator::where(const std::string& op) const {
  return "rank " + std::to_string(world_rank()) + ": " + op + " on group '" + name_ + "'";
}

bool Communicator::usable(const char* op, Status* st) const {
  if (error_.empty()) return true;
  *st = Status::error(where(op) + ": communicator unusable after an earlier error (" + error_ + ")");
  return false;
}

Status Communicator::record(Status st) {
  if (!st && error_.empty()) error_ = st.message();
  return st;
}

// ---- argument checks (REQUIRES: logic_error) ----
// Hot path: messages are only built on failure.

namespace {

[[noreturn]] void fail_require(const Communicator& c, const char* op, const std::string& what) {
  throw std::logic_error(c.where(op) + ": " + what);
}

#define MOE_COMM_REQUIRE(ok, c, op, what) \
  do {                                    \
    if (!(ok)) fail_require(c, op, what); \
  } while (0)

void check_count(const Communicator& c, const char* op, int64_t count) {
  MOE_COMM_REQUIRE(count >= 0, c, op, "negative count " + std::to_string(count));
}

void check_vector(const Communicator& c, const char* op, const char* what, std::span<const int64_t> v,
                  bool displs) {
  MOE_COMM_REQUIRE(static_cast<int>(v.size()) == c.size(), c, op,
                   std::string(what) + " has " + std::to_string(v.size()) + " entries, the group has " +
                       std::to_string(c.size()) + " ranks");
  for (size_t p = 0; p < v.size(); ++p)
    MOE_COMM_REQUIRE(v[p] >= 0, c, op,
                     std::string(what) + "[" + std::to_string(p) + "] = " + std::to_string(v[p]) +
                         (displs ? " (negative displacement)" : " (negative count)"));
}

void check_rank(const Communicator& c, const char* op, const char* what, int r) {
  MOE_COMM_REQUIRE(r >= 0 && r < c.size(), c, op,
                   std::string(what) + " " + std::to_string(r) + " outside a group of " + std::to_string(c.size()));
}

void check_tag(const Communicator& c, const char* op, int tag) {
  MOE_COMM_REQUIRE(tag >= 0 && tag < 32768, c, op, "tag " + std::to_string(tag) + " outside [0, 32768)");
}

}  // namespace

Status Communicator::alltoallv_impl(const void* send, std::span<const int64_t> send_counts,
                                    std::span<const int64_t> send_displs, void* recv,
                                    std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs,
                                    DType t) {
  const char* op = "alltoallv";
  check_vector(*this, op, "send_counts", send_counts, false);
  check_vector(*this, op, "send_displs", send_displs, true);
  check_vector(*this, op, "recv_counts", recv_counts, false);
  check_vector(*this, op, "recv_displs", recv_displs, true);
  MOE_COMM_REQUIRE(recv_counts[rank_] == send_counts[rank_], *this, op,
          "recv_counts[" + std::to_string(rank_) + "] = " + std::to_string(recv_counts[rank_]) +
              " != send_counts[" + std::to_string(rank_) + "] = " + std::to_string(send_counts[rank_]) +
              " (the block a rank sends itself)");
  Status st;
  if (!usable(op, &st)) return st;
  return record(do_alltoallv(send, send_counts, send_displs, recv, recv_counts, recv_displs, t));
}

Status Communicator::alltoall_impl(const void* send, void* recv, int64_t count, DType t) {
  check_count(*this, "alltoall", count);
  Status st;
  if (!usable("alltoall", &st)) return st;
  return record(do_alltoall(send, recv, count, t));
}

Status Communicator::allreduce_impl(void* data, int64_t count, DType t, ReduceOp op) {
  check_count(*this, "allreduce", count);
  Status st;
  if (!usable("allreduce", &st)) return st;
  return record(do_allreduce(data, count, t, op));
}

Status Communicator::allgather_impl(const void* send, int64_t count, void* recv, DType t) {
  check_count(*this, "allgather", count);
  Status st;
  if (!usable("allgather", &st)) return st;
  return record(do_allgather(send, count, recv, t));
}

Status Communicator::allgatherv_impl(const void* send, int64_t send_count, void* recv,
                                     std::span<const int64_t> recv_counts, std::span<const int64_t> recv_displs,
                                     DType t) {
  const char* op = "allgatherv";
  check_count(*this, op, send_count);
  check_vector(*this, op, "recv_counts", recv_counts, false);
  check_vector(*this, op, "recv_displs", recv_displs, true);
  MOE_COMM_REQUIRE(recv_counts[rank_] == send_count, *this, op,
          "send_count " + std::to_string(send_count) + " != recv_counts[" + std::to_string(rank_) +
              "] = " + std::to_string(recv_counts[rank_]));
  Status st;
  if (!usable(op, &st)) return st;
  return record(do_allgatherv(send, send_count, recv, recv_counts, recv_displs, t));
}

Status Communicator::reduce_scatter_impl(const void* send, void* recv, int64_t count, DType t, ReduceOp op) {
  check_count(*this, "reduce_scatter", count);
  MOE_COMM_REQUIRE(count == 0 || send != recv, *this, "reduce_scatter", "send and recv must not overlap");
  Status st;
  if (!usable("reduce_scatter", &st)) return st;
  return record(do_reduce_scatter(send, recv, count, t, op));
}

Status Communicator::broadcast_impl(void* data, int64_t count, int root, DType t) {
  check_count(*this, "broadcast", count);
  check_rank(*this, "broadcast", "root", root);
  Status st;
  if (!usable("broadcast", &st)) return st;
  return record(do_broadcast(data, count, root, t));
}

Status Communicator::reduce_impl(const void* send, void* recv, int64_t count, int root, DType t, ReduceOp op) {
  check_count(*this, "reduce", count);
  check_rank(*this, "reduce", "root", root);
  Status st;
  if (!usable("reduce", &st)) return st;
  return record(do_reduce(send, recv, count, root, t, op));
}

Status Communicator::send_impl(const void* data, int64_t count, int peer, int tag, DType t) {
  check_count(*this, "send", count);
  check_rank(*this, "send", "peer", peer);
  MOE_COMM_REQUIRE(peer != rank_, *this, "send", "send to itself (use sendrecv)");
  check_tag(*this, "send", tag);
  Status st;
  if (!usable("send", &st)) return st;
  return record(do_send(data, count, peer, tag, t));
}

Status Communicator::recv_impl(void* data, int64_t count, int peer, int tag, DType t) {
  check_count(*this, "recv", count);
  check_rank(*this, "recv", "peer", peer);
  MOE_COMM_REQUIRE(peer != rank_, *this, "recv", "receive from itself (use sendrecv)");
  check_tag(*this, "recv", tag);
  Status st;
  if (!usable("recv", &st)) return st;
  return record(do_recv(data, count, peer, tag, t));
}

Status Communicator::sendrecv_impl(const void* send, int64_t send_count, int dst, void* recv, int64_t recv_count,
                                   int src, int tag, DType t) {
  check_count(*this, "sendrecv", send_count);
  check_count(*this, "sendrecv", recv_count);
  check_rank(*this, "sendrecv", "dst", dst);
  check_rank(*this, "sendrecv", "src", src);
  check_tag(*this, "sendrecv", tag);
  Status st;
  if (!usable("sendrecv", &st)) return st;
  return record(do_sendrecv(send, send_count, dst, recv, recv_count, src, tag, t));
}

Status Communicator::barrier() {
  Status st;
  if (!usable("barrier", &st)) return st;
  return record(do_barrier());
}

Status Communicator::split(std::span<const int> members, std::string name, std::unique_ptr<Communicator>* out) {
  std::string op = "split into '" + name + "'";
  MOE_COMM_REQUIRE(!members.empty(), *this, op.c_str(), "empty member list");
  std::vector<int> sorted(members.begin(), members.end());
  std::sort(sorted.begin(), sorted.end());
  MOE_COMM_REQUIRE(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(), *this, op.c_str(),
          "member listed twice");
  for (int m : members) check_rank(*this, op.c_str(), "member", m);
  auto self = std::find(members.begin(), members.end(), rank_);
  MOE_COMM_REQUIRE(self != members.end(), *this, op.c_str(), "this rank is not in its own member list");
  Status st;
  if (!usable(op.c_str(), &st)) return st;

  std::unique_ptr<Communicator> group;
  st = do_split(sorted.front(), static_cast<int>(self - members.begin()), name, &group);
  if (!st) return record(st);
  // Agree that every rank's list is exactly the group it landed in.
  std::vector<int> listed;
  for (int m : members) listed.push_back(world_ranks_[m]);
  int64_t mismatch = group->world_ranks() == listed ? 0 : 1;
  st = allreduce(&mismatch, 1, ReduceOp::max);
  if (!st) return st;
  if (mismatch)
    return Status::error(where(op) + ": the ranks' member lists do not form consistent groups (this rank listed " +
                         "world ranks " + list_str(listed) + ", the ranks that share its smallest member are " +
                         list_str(group->world_ranks()) + ")");
  *out = std::move(group);
  return Status::ok();
}

Status Communicator::dup(std::string name, std::unique_ptr<Communicator>* out) {
  std::vector<int> all(size());
  for (int i = 0; i < size(); ++i) all[i] = i;
  return split(all, std::move(name), out);
}

Status make_groups(Communicator& world, int ep_size, Groups* out) {
  int P = world.size();
  if (ep_size < 1 || P % ep_size != 0)
    return Status::error(world.where("make_groups") + ": expert-parallel size " + std::to_string(ep_size) +
                         " does not divide the " + std::to_string(P) + " ranks");
  int r = world.rank(), g = r / ep_size, i = r % ep_size;
  std::vector<int> ep, dp;
  for (int k = 0; k < ep_size; ++k) ep.push_back(g * ep_size + k);
  for (int k = 0; k < P / ep_size; ++k) dp.push_back(k * ep_size + i);
  Groups groups;
  groups.ep_size = ep_size;
  groups.dp_size = P / ep_size;
  Status st = world.split(ep, "ep" + std::to_string(g), &groups.ep);
  if (!st) return st;
  st = world.split(dp, "dp" + std::to_string(i), &groups.dp);
  if (!st) return st;
  *out = std::move(groups);
  return Status::ok();
}

}  // namespace moe::comm
