// Topology: see topology.h.
#include "comm/topology.h"

#include <algorithm>
#include <stdexcept>

#include "comm/mpi_communicator.h"

namespace moe::comm {

Topology::Topology(std::vector<int> node_of_rank) : node_of_(std::move(node_of_rank)) {
  if (node_of_.empty()) throw std::logic_error("topology: no ranks");
  local_rank_.resize(node_of_.size());
  for (size_t r = 0; r < node_of_.size(); ++r) {
    int node = node_of_[r];
    if (node < 0 || node > n_nodes())
      throw std::logic_error("topology: rank " + std::to_string(r) + " on node " + std::to_string(node) +
                             " (nodes must be numbered 0, 1, ... by their lowest rank)");
    if (node == n_nodes()) ranks_of_node_.emplace_back();
    local_rank_[r] = static_cast<int>(ranks_of_node_[node].size());
    ranks_of_node_[node].push_back(static_cast<int>(r));
  }
  for (const auto& ranks : ranks_of_node_) ranks_per_node_ = std::max(ranks_per_node_, static_cast<int>(ranks.size()));
}

Topology Topology::uniform(int world_size, int ranks_per_node) {
  if (world_size < 1 || ranks_per_node < 1 || world_size % ranks_per_node != 0)
    throw std::logic_error("topology: " + std::to_string(ranks_per_node) + " ranks per node do not divide " +
                           std::to_string(world_size) + " ranks");
  std::vector<int> node_of(world_size);
  for (int r = 0; r < world_size; ++r) node_of[r] = r / ranks_per_node;
  return Topology(std::move(node_of));
}

bool Topology::uniform() const {
  return std::all_of(ranks_of_node_.begin(), ranks_of_node_.end(),
                     [&](const std::vector<int>& v) { return static_cast<int>(v.size()) == ranks_per_node_; });
}

std::string Topology::describe() const {
  auto plural = [](int n, const char* w) { return std::to_string(n) + " " + w + (n == 1 ? "" : "s"); };
  if (uniform()) return plural(n_nodes(), "node") + " x " + plural(ranks_per_node_, "rank");
  std::string s = plural(n_nodes(), "node") + " (";
  for (int n = 0; n < n_nodes(); ++n) s += (n ? ", " : "") + std::to_string(ranks_of_node_[n].size());
  return s + " ranks)";
}

Status detect_topology(Communicator& comm, int ranks_per_node, Topology* out) {
  if (ranks_per_node > 0) {
    if (comm.size() % ranks_per_node != 0)
      return Status::error(comm.where("detect_topology") + ": --ranks-per-node " + std::to_string(ranks_per_node) +
                           " does not divide the " + std::to_string(comm.size()) + " ranks");
    *out = Topology::uniform(comm.size(), ranks_per_node);
    return Status::ok();
  }
  auto* mpi = dynamic_cast<MpiCommunicator*>(&comm);
  if (!mpi) throw std::logic_error(comm.where("detect_topology") + ": not an MPI communicator");
  // The lowest rank of each shared-memory node names it; everyone learns every rank's name.
  MPI_Comm node;
  int rc = MPI_Comm_split_type(mpi->mpi_comm(), MPI_COMM_TYPE_SHARED, comm.rank(), MPI_INFO_NULL, &node);
  if (rc != MPI_SUCCESS) return Status::error(comm.where("detect_topology") + ": MPI_Comm_split_type failed");
  MPI_Group group, parent;
  MPI_Comm_group(node, &group);
  MPI_Comm_group(mpi->mpi_comm(), &parent);
  int zero = 0, leader = -1;
  MPI_Group_translate_ranks(group, 1, &zero, parent, &leader);  // node rank 0 = lowest parent rank (key order)
  MPI_Group_free(&group);
  MPI_Group_free(&parent);
  MPI_Comm_free(&node);
  int64_t mine = leader;
  std::vector<int64_t> leaders(comm.size());
  Status st = comm.allgather(&mine, 1, leaders.data());
  if (!st) return st;
  std::vector<int64_t> seen;
  std::vector<int> node_of(comm.size());
  for (int r = 0; r < comm.size(); ++r) {
    auto it = std::find(seen.begin(), seen.end(), leaders[r]);
    node_of[r] = static_cast<int>(it - seen.begin());
    if (it == seen.end()) seen.push_back(leaders[r]);
  }
  *out = Topology(std::move(node_of));
  return Status::ok();
}

}  // namespace moe::comm
