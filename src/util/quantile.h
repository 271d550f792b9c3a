// The nearest-rank quantile: one definition for the simulator's step-time percentiles, the server's
// /metrics latency summaries and the serving benchmark's table.
#pragma once

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

namespace moe {

// The smallest value with at least a fraction q of the values at or below it (q = 0: the minimum).
// REQUIRES: v not empty, 0 <= q <= 1 (std::logic_error).
inline double nearest_rank_quantile(std::vector<double> v, double q) {
  if (v.empty() || !(q >= 0.0 && q <= 1.0)) throw std::logic_error("nearest_rank_quantile: REQUIRES values, 0 <= q <= 1");
  std::sort(v.begin(), v.end());
  const double rank = std::ceil(q * static_cast<double>(v.size()));
  return v[static_cast<size_t>(std::clamp(rank, 1.0, static_cast<double>(v.size()))) - 1];
}

}  // namespace moe
