// Which node (host) each rank runs on: what decides whether two ranks talk through shared memory
// or the network, and what a hierarchical all-to-all or a node-aware placement groups by.
#pragma once

#include <string>
#include <vector>

#include "comm/communicator.h"
#include "util/status.h"

namespace moe::comm {

// A map from the ranks of a group (0..world_size()-1) to nodes (0..n_nodes()-1). Nodes are
// numbered in the order of their lowest rank; a node's ranks have local ranks 0, 1, ... in rank
// order. Immutable after construction; safe to share between threads.
class Topology {
 public:
  Topology() : Topology(std::vector<int>{0}) {}  // one rank on one node
  // REQUIRES: node_of_rank non-empty; its values are 0..n-1, each used, numbered by first appearance.
  explicit Topology(std::vector<int> node_of_rank);
  // world_size ranks, rank r on node r / ranks_per_node. REQUIRES: ranks_per_node divides world_size.
  static Topology uniform(int world_size, int ranks_per_node);

  int world_size() const { return static_cast<int>(node_of_.size()); }
  int n_nodes() const { return static_cast<int>(ranks_of_node_.size()); }
  int node_of(int rank) const { return node_of_.at(rank); }
  int local_rank(int rank) const { return local_rank_.at(rank); }
  const std::vector<int>& ranks_of_node(int node) const { return ranks_of_node_.at(node); }
  // Ranks on the largest node (on every node when uniform()).
  int ranks_per_node() const { return ranks_per_node_; }
  bool uniform() const;  // every node has ranks_per_node() ranks
  bool same_node(int a, int b) const { return node_of(a) == node_of(b); }
  std::string describe() const;  // "2 nodes x 2 ranks", "3 nodes (2, 1, 1 ranks)"

 private:
  std::vector<int> node_of_, local_rank_;
  std::vector<std::vector<int>> ranks_of_node_;
  int ranks_per_node_ = 0;
};

// Collective over comm (an MPI communicator, usually the world): the nodes of its ranks, from
// MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) (ranks that can share memory are on one node).
// ranks_per_node > 0 overrides what MPI says: rank r is on node r / ranks_per_node, so one machine
// can stand in for several nodes (--ranks-per-node). Errors: ranks_per_node does not divide
// comm.size() (the same error on every rank, before communicating), or an MPI error.
// REQUIRES: comm is an MpiCommunicator.
Status detect_topology(Communicator& comm, int ranks_per_node, Topology* out);

}  // namespace moe::comm
