// Expert load prediction for the next step (Hecate §4.2): the mean of the last w steps' loads, per
// MoE layer and expert. Expert loads change smoothly over steps (the temporal locality Hecate and
// FlexMoE rely on), so a short window predicts the next step well and forgets old routing quickly.
#pragma once

#include <cstdint>
#include <vector>

namespace moe::plan {

class LoadPredictor {
 public:
  // REQUIRES: n_layers >= 1, n_experts >= 1, window >= 1 (std::logic_error). Hecate uses w = 5.
  LoadPredictor(int n_layers, int n_experts, int window = 5);

  // One step's loads. counts [L][E]: tokens (top-k assignments) routed to expert e of layer l, summed
  // over ranks. REQUIRES: shape [L][E], entries >= 0.
  void observe(const std::vector<std::vector<int64_t>>& counts);

  // Predicted load of each expert of layer l [E], in tokens per step: the mean over the last
  // min(steps_observed(), window) steps. Before any step: 1.0 for every expert, i.e. uniform (the
  // planners use loads relative to each other, and no expert deserves a replica before data exists).
  // Exact: the window's sums are kept as integers, so the result does not depend on the step count.
  // REQUIRES: layer in [0, L).
  std::vector<double> predict(int layer) const;

  int64_t steps_observed() const { return steps_; }
  int window() const { return window_; }

 private:
  int n_layers_, n_experts_, window_;
  int64_t steps_ = 0;
  std::vector<std::vector<std::vector<int64_t>>> history_;  // ring of the last window steps [w][L][E]
  std::vector<std::vector<int64_t>> sum_;                   // [L][E]: the sum over the ring
};

}  // namespace moe::plan
