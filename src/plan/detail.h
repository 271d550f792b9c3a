// Internal to src/plan: how planners reject inputs that violate their REQUIRES (programming errors,
// std::logic_error), the input checks several planners share, and one placement edit.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "plan/placement.h"

namespace moe::plan::detail {

// Throws std::logic_error("<where>: <what>").
[[noreturn]] inline void violated(const char* where, const std::string& what) {
  std::string message = where;
  message += ": ";
  message += what;
  throw std::logic_error(message);
}

// REQUIRES: p.validate() ok.
inline void require_valid(const char* where, const LayerPlacement& p) {
  const Status st = p.validate();
  if (!st) violated(where, st.message());
}

// REQUIRES: nodes maps exactly n_ranks ranks to ids >= 0.
inline void require_nodes(const char* where, const Nodes& nodes, int n_ranks) {
  if (static_cast<int>(nodes.node_of_rank.size()) != n_ranks) {
    std::string what = "nodes has ";
    what += std::to_string(nodes.node_of_rank.size());
    what += " ranks, the placement ";
    what += std::to_string(n_ranks);
    violated(where, what);
  }
  for (int id : nodes.node_of_rank)
    if (id < 0) violated(where, "negative node id");
}

// REQUIRES: counts is [n_ranks][n_experts], every entry >= 0.
inline void require_counts(const char* where, const std::vector<std::vector<int64_t>>& counts, int n_ranks,
                           int n_experts) {
  if (static_cast<int>(counts.size()) != n_ranks) violated(where, "counts must have one row per rank");
  for (const auto& row : counts) {
    if (static_cast<int>(row.size()) != n_experts) violated(where, "counts must have one column per expert");
    for (int64_t c : row)
      if (c < 0) violated(where, "negative token count");
  }
}

// REQUIRES: load has n_experts entries, each finite and >= 0.
inline void require_loads(const char* where, const std::vector<double>& load, int n_experts) {
  if (static_cast<int>(load.size()) != n_experts) violated(where, "load must have one entry per expert");
  for (double f : load)
    if (!std::isfinite(f) || f < 0) violated(where, "loads must be finite and non-negative");
}

// Adds rank to expert's replicas, keeping them ascending. REQUIRES: rank does not hold expert yet.
inline void add_replica(LayerPlacement& p, int expert, int rank) {
  auto& r = p.replicas[expert];
  r.insert(std::lower_bound(r.begin(), r.end(), rank), rank);
}

}  // namespace moe::plan::detail
