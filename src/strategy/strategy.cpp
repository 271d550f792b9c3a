// The Strategy defaults, the cost model, and the registry (strategy.h).
#include "strategy/strategy.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <utility>

#include "util/str_cat.h"

namespace moe::strategy {

// One line per strategy; each file defines its make_<name>.
std::unique_ptr<Strategy> make_ep(const Setup&);
std::unique_ptr<Strategy> make_hecate(const Setup&);
std::unique_ptr<Strategy> make_fastermoe(const Setup&);
std::unique_ptr<Strategy> make_smartmoe(const Setup&);
std::unique_ptr<Strategy> make_flexmoe(const Setup&);
std::unique_ptr<Strategy> make_deepspeed(const Setup&);

namespace {
std::vector<Registration>& mutable_registry() {
  static std::vector<Registration> r{
      {"ep", "static expert parallelism: expert e on rank e / (E / R); tokens go to their expert's rank", make_ep},
      {"hecate", "Hecate FSSDP: sharded experts, predicted-hot ones gathered behind attention, calibrated after the gate, re-sharded every --reshard-every steps", make_hecate},
      {"fastermoe", "FasterMoE shadowing: after each gate the hottest experts are broadcast to every rank", make_fastermoe},
      {"smartmoe", "SmartMoE: no replicas; every --reshard-every steps experts are swapped between ranks", make_smartmoe},
      {"flexmoe", "FlexMoE (reconstructed): persistent replicas of hot experts in --replica-slots slots, re-planned on imbalance", make_flexmoe},
      {"deepspeed", "DeepSpeed-MoE: ep's experts, a fixed-size all-to-all (every expert gets the same slots from every rank, zero-padded) and experts computing over every slot", make_deepspeed},
  };
  return r;
}
}  // namespace

const std::vector<Registration>& registry() { return mutable_registry(); }

Status add(const Registration& r) {
  if (!r.name || !*r.name || !r.make) return Status::error("strategy: a registration needs a name and a factory");
  if (find(r.name)) return Status::error(str_cat("strategy '", r.name, "' is registered already"));
  mutable_registry().push_back(r);
  return Status::ok();
}

const Registration* find(const std::string& name) {
  for (const Registration& r : registry())
    if (name == r.name) return &r;
  return nullptr;
}

std::string names() {
  std::string s;
  for (const Registration& r : registry()) s += (s.empty() ? "" : ", ") + std::string(r.name);
  return s;
}

std::string help() {
  std::string s;
  for (const Registration& r : registry()) {
    std::string n = r.name;
    n.resize(std::max<size_t>(n.size() + 1, 11), ' ');
    s += "  " + n + r.summary + "\n";
  }
  return s;
}

Status make(const std::string& name, const Setup& setup, std::unique_ptr<Strategy>* out) {
  const Registration* r = find(name);
  if (!r) return Status::error(str_cat("strategy '", name, "' is not one of ", names()));
  *out = r->make(setup);
  return Status::ok();
}

bool places_experts(const std::string& name) {
  std::unique_ptr<Strategy> probe;
  return make(name, Setup{}, &probe) && probe->uses_placements();
}

double expert_flops_per_token(const ModelConfig& model) {
  // Forward and backward: 3 GEMM passes over the expert's matrices.
  const double mats = model.activation == "swiglu" ? 3 : 2;
  return 3 * 2 * mats * static_cast<double>(model.d_model * model.d_ffn);
}

double row_exchange_bytes(const ModelConfig& model) {
  return 4.0 * static_cast<double>(model.d_model) * sizeof(float);
}

void set_gemm_rate(CostModel* c, const ModelConfig& model, double gemm_flops) {
  c->gemm_flops = gemm_flops;
  c->expert_seconds_per_token = expert_flops_per_token(model) / gemm_flops;
}

CostModel make_cost_model(const ModelConfig& model, double bandwidth, double gemm_flops) {
  CostModel c;
  const int64_t mats = model.activation == "swiglu" ? 3 : 2;
  c.bandwidth = c.network_bandwidth = c.overlap_bandwidth = bandwidth;
  c.expert_bytes = mats * model.d_model * model.d_ffn * static_cast<int64_t>(sizeof(float));
  set_gemm_rate(&c, model, gemm_flops);
  return c;
}

bool observe_weight_transfers(CostModel* c, double bytes, double seconds) {
  if (!(bytes > 0) || !(seconds > 0) || !std::isfinite(bytes / seconds)) return false;
  const double fastest_link = std::max(c->intra_node.bandwidth, c->inter_node.bandwidth);
  const double step_rate = fastest_link > 0 ? std::min(bytes / seconds, fastest_link) : bytes / seconds;
  c->bandwidth = c->bandwidth > 0 ? 0.5 * c->bandwidth + 0.5 * step_rate : step_rate;
  return true;
}

std::string describe(const CostModel& c) {
  char buf[160];
  std::string out;
  for (const auto& [name, l] : {std::pair{"intra", c.intra_node}, std::pair{"inter", c.inter_node}})
    if (l.bandwidth > 0) {
      std::snprintf(buf, sizeof buf, "%s %.3g GB/s %.0f us, ", name, l.bandwidth / 1e9, l.latency * 1e6);
      out += buf;
    }
  std::snprintf(buf, sizeof buf, "gemm %.0f GFLOP/s, weights at %.3g GB/s, t from %.3g GB/s", c.gemm_flops / 1e9,
                c.bandwidth / 1e9, c.overlap_bandwidth / 1e9);
  return out + buf;
}

Status Strategy::ep_size(const ModelConfig& model, int world, int* out) const {
  if (!uses_placements()) {
    *out = static_cast<int>(std::gcd<int64_t>(model.n_experts, world));
    return Status::ok();
  }
  if (world > 1 && model.n_experts % world != 0)
    return Status::error(str_cat("strategy ", name(), ": n_experts (", model.n_experts,
                                 ") must be a multiple of the ranks (", world, "): each rank owns the same number of expert shards"));
  *out = world;
  return Status::ok();
}

std::optional<plan::LayerPlacement> Strategy::before_step(int layer, const plan::LayerPlacement& owners) {
  (void)layer, (void)owners;
  return std::nullopt;
}

bool Strategy::after_gate(int layer, const plan::LayerPlacement& owners, const plan::LayerPlacement& in_force,
                          const std::vector<std::vector<int64_t>>& counts, plan::LayerPlacement* out) {
  (void)layer, (void)owners, (void)in_force, (void)counts, (void)out;
  return false;
}

int moe_layer_count(const ModelConfig& model) {
  int n = 0;
  for (int64_t l = 0; l < model.n_layers; ++l) n += model.is_moe_layer(l) ? 1 : 0;
  return std::max(1, n);
}

}  // namespace moe::strategy
