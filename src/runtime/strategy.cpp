// Training strategies: see strategy.h.
#include "runtime/strategy.h"

#include <numeric>

#include "plan/baselines.h"
#include "plan/hecate.h"
#include "util/str_cat.h"

namespace moe::runtime {

Strategy::Strategy(const TrainConfig& cfg) : cfg_(cfg) {
  if (cfg_.strategy == "hecate" || cfg_.strategy == "smartmoe" || cfg_.strategy == "flexmoe") {
    // SmartMoE averages the loads since its last update: a window of reshard_every steps.
    const int64_t window = cfg_.strategy == "smartmoe" ? std::max<int64_t>(1, cfg_.reshard_every) : cfg_.load_window;
    int moe_layers = 0;
    for (int64_t l = 0; l < cfg_.model.n_layers; ++l) moe_layers += cfg_.model.is_moe_layer(l) ? 1 : 0;
    predictor_ = std::make_unique<plan::LoadPredictor>(std::max(1, moe_layers), static_cast<int>(cfg_.model.n_experts),
                                                       static_cast<int>(window));
  }
}

Status Strategy::ep_size(int world, int* out) const {
  const int64_t E = cfg_.model.n_experts;
  if (!uses_placements()) {
    *out = static_cast<int>(std::gcd<int64_t>(E, world));
    return Status::ok();
  }
  if (world > 1 && E % world != 0)
    return Status::error(str_cat("strategy ", cfg_.strategy, ": n_experts (", E, ") must be a multiple of the ranks (",
                                 world, "): each rank owns the same number of expert shards"));
  *out = world;
  return Status::ok();
}

void Strategy::configure(graph::EpStepOptions* opt) const {
  if (opt->world == 1) return;  // one process: nothing to place
  // smartmoe: placements without replicas; flexmoe: its persistent replicas, gathered each step.
  opt->gather_before_gate = cfg_.strategy == "hecate" || cfg_.strategy == "flexmoe";
  opt->rematerialize = cfg_.strategy == "hecate" && cfg_.rematerialize;
  // Hecate calibrates after the gate (a second gather, only when its cost model says it pays).
  opt->gather_after_gate = cfg_.strategy == "fastermoe" || cfg_.strategy == "hecate";
}

void Strategy::attach(Model& model, const plan::Nodes& nodes, comm::Communicator* gather) {
  nodes_ = nodes;
  if (uses_placements() && nodes.node_of_rank.size() > 1) model.enable_placements(nodes, gather);
}

int Strategy::replica_slots(int64_t n_experts, int world) const {
  // A replica costs its weights and, in backward, their gradient buffer (plan::memory_slots counts
  // weights only, so it is given half the budget).
  if (cfg_.replica_memory_mb > 0)
    return plan::memory_slots(static_cast<int64_t>(cfg_.replica_memory_mb * (1 << 20) / 2), expert_bytes());
  return cfg_.replica_slots >= 0 ? static_cast<int>(cfg_.replica_slots) : static_cast<int>(n_experts / world);
}

int64_t Strategy::expert_bytes() const {
  const int64_t mats = cfg_.model.activation == "swiglu" ? 3 : 2;
  return mats * cfg_.model.d_model * cfg_.model.d_ffn * static_cast<int64_t>(sizeof(float));
}

double Strategy::expert_seconds_per_token() const {
  // One token through one expert, forward and backward (3 GEMM passes), at the assumed GEMM rate.
  const double mats = cfg_.model.activation == "swiglu" ? 3 : 2;
  return 3 * 2 * mats * static_cast<double>(cfg_.model.d_model * cfg_.model.d_ffn) / (cfg_.gemm_gflops * 1e9);
}

void Strategy::before_step(Model& model, int overlap_degree) {
  if (cfg_.strategy == "flexmoe") {
    int i = 0;
    for (int64_t l = 0; l < model.n_blocks(); ++l) {
      MoeLayer* moe = model.moe_layer(l);
      if (!moe || !moe->placements_enabled()) continue;
      if (static_cast<int>(flex_placement_.size()) <= i) {
        flex_placement_.push_back(moe->owners());
        flex_since_.push_back(0);
      }
      moe->set_placement(flex_placement_[i++]);
    }
    return;
  }
  if (cfg_.strategy != "hecate") return;
  overlap_degree_ = overlap_degree;
  int i = 0;  // MoE layer index
  for (int64_t l = 0; l < model.n_blocks(); ++l) {
    MoeLayer* moe = model.moe_layer(l);
    if (!moe) continue;
    if (moe->placements_enabled()) {
      const plan::LayerPlacement& owners = moe->owners();
      const int m = replica_slots(moe->config().n_experts, owners.n_ranks);
      moe->set_placement(plan::sparse_materialize(owners, predictor_->predict(i), overlap_degree, m, nodes_));
    }
    ++i;
  }
}

Status Strategy::place(Model& model, int64_t layer) {
  MoeLayer* moe = model.moe_layer(layer);
  if (!moe || !moe->placements_enabled()) return Status::ok();
  const double expert_seconds_per_token = this->expert_seconds_per_token();
  if (cfg_.strategy == "hecate") {
    const plan::LayerPlacement& in_force = moe->placement();
    const plan::CalibrationModel cm{expert_seconds_per_token, cfg_.link_gbs * 1e9, expert_bytes()};
    const plan::Calibration c =
        plan::calibrate(in_force, moe->routed_counts(), overlap_degree_,
                        replica_slots(moe->config().n_experts, in_force.n_ranks), nodes_, cm);
    if (c.gather) {
      moe->set_placement(c.placement);
      ++calibrations_;
    }
    return Status::ok();
  }
  if (cfg_.strategy != "fastermoe") return Status::ok();
  plan::FasterMoeModel fm;
  fm.d_model = cfg_.model.d_model;
  fm.ffn_ratio = static_cast<double>(cfg_.model.d_ffn) / static_cast<double>(cfg_.model.d_model);
  fm.bytes_per_element = sizeof(float);
  fm.bandwidth = cfg_.link_gbs * 1e9;
  fm.gemm_flops = cfg_.gemm_gflops * 1e9;
  moe->set_placement(plan::fastermoe_plan(moe->owners(), moe->routed_counts(), fm));
  return Status::ok();
}

int Strategy::reshard(Model& model, AdamW& opt, int64_t done) {
  if (cfg_.strategy == "flexmoe") return flexmoe_replan(model, opt);
  if ((cfg_.strategy != "hecate" && cfg_.strategy != "smartmoe") || cfg_.reshard_every <= 0 ||
      done % cfg_.reshard_every != 0 || !predictor_)
    return 0;
  std::vector<MoeLayer*> layers;
  for (int64_t l = 0; l < model.n_blocks(); ++l)
    if (MoeLayer* m = model.moe_layer(l); m && m->placements_enabled()) layers.push_back(m);
  if (layers.empty()) return 0;
  std::vector<std::vector<double>> loads;
  for (size_t i = 0; i < layers.size(); ++i) loads.push_back(predictor_->predict(static_cast<int>(i)));
  std::vector<std::vector<int>> owners;
  if (cfg_.strategy == "hecate") {
    owners = plan::heterogeneous_sharding(loads, overlap_degree_, nodes_);
  } else {
    for (size_t i = 0; i < layers.size(); ++i) {
      const plan::SmartMoePlan p =
          plan::smartmoe_plan(layers[i]->owners().owner, layers[i]->owners().n_ranks, loads[i],
                              static_cast<int>(cfg_.reshard_every), plan::SmartMoeConfig{static_cast<int>(cfg_.reshard_every)});
      owners.push_back(p.owner);
    }
  }
  int moved = 0;
  for (size_t i = 0; i < layers.size(); ++i) moved += reshard_layer(*layers[i], opt, owners[i]);
  return moved;
}

int Strategy::reshard_layer(MoeLayer& moe, AdamW& opt, const std::vector<int>& owner) {
  if (owner == moe.owners().owner) return 0;  // applied only when shards change
  std::vector<std::pair<Tensor*, Tensor*>> moments;
  for (Param* p : moe.expert_params())
    for (size_t i = 0; i < opt.params().size(); ++i)
      if (opt.params()[i] == p) moments.push_back({&opt.m(i), &opt.v(i)});
  return moe.reshard(owner, moments);
}

int Strategy::flexmoe_replan(Model& model, AdamW& opt) {
  plan::FlexMoeConfig fc;
  fc.reserved_slots = cfg_.replica_slots >= 0 ? static_cast<int>(cfg_.replica_slots) : 1;
  fc.replan_interval = cfg_.reshard_every > 0 ? static_cast<int>(cfg_.reshard_every) : 50;
  fc.expert_seconds_per_token = expert_seconds_per_token();
  fc.expert_state_bytes = 3 * expert_bytes();  // weights + Adam's two moments
  fc.bandwidth = cfg_.link_gbs * 1e9;
  int moved = 0, i = 0;
  for (int64_t l = 0; l < model.n_blocks(); ++l) {
    MoeLayer* moe = model.moe_layer(l);
    if (!moe || !moe->placements_enabled() || i >= static_cast<int>(flex_placement_.size())) continue;
    ++flex_since_[i];
    const plan::FlexMoePlan p = plan::flexmoe_plan(flex_placement_[i], predictor_->predict(i), flex_since_[i], fc);
    if (p.replanned) {
      flex_since_[i] = 0;
      moved += reshard_layer(*moe, opt, p.placement.owner);
      flex_placement_[i] = p.placement;
    }
    ++i;
  }
  return moved;
}

void Strategy::observe(const std::vector<std::vector<int64_t>>& loads) {
  if (predictor_ && !loads.empty()) predictor_->observe(loads);
}

}  // namespace moe::runtime
