// Sliding-window load prediction: a ring of the last w steps and their running integer sum.
#include "plan/load_predictor.h"

#include <algorithm>

#include "plan/detail.h"

namespace moe::plan {

using detail::violated;

LoadPredictor::LoadPredictor(int n_layers, int n_experts, int window)
    : n_layers_(n_layers), n_experts_(n_experts), window_(window) {
  if (n_layers < 1 || n_experts < 1 || window < 1)
    violated("LoadPredictor", "needs n_layers, n_experts and window >= 1");
  sum_.assign(n_layers, std::vector<int64_t>(n_experts, 0));
  history_.reserve(window);
}

void LoadPredictor::observe(const std::vector<std::vector<int64_t>>& counts) {
  detail::require_counts("LoadPredictor::observe", counts, n_layers_, n_experts_);
  const size_t slot = static_cast<size_t>(steps_ % window_);
  if (history_.size() < static_cast<size_t>(window_)) {
    history_.push_back(counts);
  } else {
    // The ring is full: the step leaving the window leaves the sum.
    for (int l = 0; l < n_layers_; ++l)
      for (int e = 0; e < n_experts_; ++e) sum_[l][e] -= history_[slot][l][e];
    history_[slot] = counts;
  }
  for (int l = 0; l < n_layers_; ++l)
    for (int e = 0; e < n_experts_; ++e) sum_[l][e] += counts[l][e];
  ++steps_;
}

std::vector<double> LoadPredictor::predict(int layer) const {
  if (layer < 0 || layer >= n_layers_) violated("LoadPredictor::predict", "layer out of range");
  if (steps_ == 0) return std::vector<double>(n_experts_, 1.0);
  const double n = static_cast<double>(std::min<int64_t>(steps_, window_));
  std::vector<double> out(n_experts_);
  for (int e = 0; e < n_experts_; ++e) out[e] = static_cast<double>(sum_[layer][e]) / n;
  return out;
}

}  // namespace moe::plan
