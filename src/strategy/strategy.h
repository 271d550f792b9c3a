// Start here for strategies. A training strategy decides where each MoE layer's experts live during
// a step: which rank owns each expert's shard (weights and optimizer state), which ranks hold a
// temporary replica, and which step-graph options its exchanges need. Every strategy computes the
// same mathematics (invariant 1, docs/architecture.md); they differ in which ranks run which tokens and in what
// moves over the network.
//
// One object per strategy, registered once (registry()): the trainer (runtime/strategy.h applies its
// decisions to the model's MoE layers) and the simulator (sim/placement_costs.cpp applies them to
// its modeled layers) run the same objects, fed the same kinds of input: the owners of each layer's
// shards, the loads of past steps (observe), this step's routed counts after the gate, and one cost
// model. The planners themselves are pure functions in src/plan.
//
// Order of calls in a step: before_step (per MoE layer) -> after_gate (per MoE layer, once its gate
// has run) -> observe (the step's global loads) -> reshard. Every rank holds the same Strategy state
// fed the same all-reduced loads, so every rank decides the same (invariant 2, docs/architecture.md).
// Thread safety: none; one thread calls a Strategy at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "graph/ep_builder.h"
#include "model/config.h"
#include "plan/placement.h"
#include "util/status.h"

namespace moe::strategy {

// One class of link, alpha-beta: a message of n bytes takes latency + n / bandwidth seconds.
struct LinkCost {
  double latency = 0;    // seconds (alpha)
  double bandwidth = 0;  // bytes/s (1 / beta); 0: no such link in this job
};

// What the planners know about the machine: measured at start-up by the trainer
// (runtime/measure_costs.h), from the topology preset's datasheet figures in the simulator.
struct CostModel {
  LinkCost intra_node, inter_node;      // between ranks of one host / of two hosts
  double bandwidth = 0;                 // bytes/s a rank receives expert weights at, in the steps
  // bytes/s between two ranks over the slowest link class they span, as the links measure (what token
  // rows cross at; bandwidth starts here, then follows the steps' own transfers:
  // observe_weight_transfers).
  double network_bandwidth = 0;
  // Hecate's Alg. 1 bw, for the overlap degree t: the inter-node bandwidth when the ranks span
  // nodes, else the uniform inter-device one.
  double overlap_bandwidth = 0;
  double gemm_flops = 0;                // FLOP/s of the expert GEMMs
  // True where moving weights takes the compute's own cores (CPU ranks: the copies and the TCP stack
  // run on them), so a transfer hidden behind the attention still costs time; false on GPUs, whose
  // transfers run beside the kernels.
  bool transfers_take_compute = false;
  int64_t expert_bytes = 0;             // one expert's weights (2 matrices, 3 with SwiGLU, f32)
  double expert_seconds_per_token = 0;  // one token through one expert, forward and backward
};
// Transfers of one replica's weights every step where they take the compute's cores
// (CostModel::transfers_take_compute): its gather, its gradients' reduce back to the owner and, with
// rematerialization, the backward's second gather. Every planner that prices replicas on CPU ranks
// charges this many.
inline int replica_transfers_per_step(bool rematerialize) { return rematerialize ? 3 : 2; }
// The cost model of `model`'s experts at these rates; network and overlap bandwidth = bandwidth, no links.
// REQUIRES: gemm_flops > 0.
CostModel make_cost_model(const ModelConfig& model, double bandwidth, double gemm_flops);
// FLOPs of one token through one of `model`'s experts, forward and backward (3 GEMM passes).
double expert_flops_per_token(const ModelConfig& model);
// Bytes one token's row moves between ranks in a step when its expert is elsewhere: dispatch and
// combine, forward and backward (4 exchanges of d_model floats).
double row_exchange_bytes(const ModelConfig& model);
// c's GEMM rate and what follows from it (expert_seconds_per_token); the rest of c is kept.
// REQUIRES: gemm_flops > 0.
void set_gemm_rate(CostModel* c, const ModelConfig& model, double gemm_flops);
// After a step whose sparse collectives sent `bytes` of expert weights in `seconds` (over every rank:
// runtime::weight_transfers, the same figures on every rank), c's weights bandwidth moves half-way to
// that rate, at most the fastest link's (no transfer outruns an idle link); a step that moved nothing
// leaves it. Start-up's figure is exchanges on links nothing else uses; this is what a replica's
// transfer costs on the lanes beside the step's compute, so the planners price replicas as they run.
// Returns whether c changed.
bool observe_weight_transfers(CostModel* c, double bytes, double seconds);
// "intra 9.8 GB/s 4 us, inter 0.118 GB/s 60 us, gemm 410 GFLOP/s, weights 1.2 GB/s, t from 0.118 GB/s"
std::string describe(const CostModel& c);

// What a step measured that a planner may use (the same on every rank: averaged over ranks).
struct StepTimes {
  double attention_seconds = 0;  // mean attn_fwd op of the step (0: not measured)
};

// The strategies' knobs (moe train's flags of the same names).
struct Options {
  bool rematerialize = false;        // hecate: free replicas after forward, gather again for backward
  int replica_slots = -1;            // hecate: extra experts per rank and layer (-1: experts per rank);
                                     // flexmoe: its reserved slots (-1: 1)
  int64_t replica_memory_bytes = 0;  // hecate: > 0 sets the slots from this budget per rank and layer
  int load_window = 5;               // hecate, flexmoe: steps of the load predictor's window
  int overlap_degree = -1;           // hecate: Alg. 1's t (-1: from the last step's attention time)
  int reshard_every = -1;            // hecate, smartmoe: re-shard every N steps (-1: 100; 0: never);
                                     // flexmoe: re-plan at least every N steps (-1 or 0: 50)
};

struct Setup {
  ModelConfig model;
  int world = 1;      // ranks of the (one) expert-parallel group placements span
  plan::Nodes nodes;  // node of each rank
  // Ranks that take turns on shared CPU cores (runtime/cpu_threads.h measures them; empty: none, as
  // on GPUs): every planner prices the busiest rank's expert work over them (plan::busiest_load).
  plan::CorePools cores{};
  // Ranks that cross the network through one NIC (plan::nic_pools; empty: one node, or a NIC per
  // rank): Hecate and SmartMoE price the rows over the slowest link at the busiest NIC.
  plan::CorePools nics{};
  Options options;
  CostModel cost;
};

class Strategy {
 public:
  virtual ~Strategy() = default;
  virtual const char* name() const = 0;
  // False for ep alone: no placements, no replicas, the layer's static shards.
  virtual bool uses_placements() const { return true; }
  // How the tokens routed to an expert are spread over the ranks holding it (plan::DispatchRule), in
  // the trainer and the simulator alike: Hecate's nearest replica by default; a strategy whose planner
  // prices an even split over an expert's holders says even.
  virtual plan::DispatchRule dispatch_rule() const { return plan::DispatchRule::nearest; }
  // The expert-parallel group size over `world` ranks. Default: strategies that place no experts use
  // the largest group that divides both the experts and the ranks (the other ranks hold data-parallel
  // copies); placement strategies one group of every rank, an error when n_experts is not a multiple
  // of world.
  virtual Status ep_size(const ModelConfig& model, int world, int* out) const;
  // Sets this strategy's graph options (gathers before / after the gate, re-materialization).
  virtual void configure(graph::EpStepOptions* opt) const { (void)opt; }
  // The graph of one step for one rank with more than one rank, from the options configure() set:
  // the trainer runs it, the simulator predicts it. Default: graph::build_ep_step, the standard
  // composition; a strategy with another step shape assembles graph/step_builder.h's pieces itself.
  virtual graph::EpStep build_step(const ModelConfig& model, const graph::EpStepOptions& opt) const {
    return graph::build_ep_step(model, opt);
  }

  // Before a step, MoE layer `layer` (0-based among MoE layers) whose shards live at `owners`: the
  // placement to gather before the gate, or nothing when this strategy plans none (the layer then
  // dispatches over its owners unless after_gate says otherwise).
  virtual std::optional<plan::LayerPlacement> before_step(int layer, const plan::LayerPlacement& owners);
  // After layer `layer`'s gate: true and *out set when tokens should go over another placement than
  // `in_force` (the one gathered before the gate). counts [R][E]: tokens each rank routed to each
  // expert this step.
  virtual bool after_gate(int layer, const plan::LayerPlacement& owners, const plan::LayerPlacement& in_force,
                          const std::vector<std::vector<int64_t>>& counts, plan::LayerPlacement* out);
  // After a step: every MoE layer's global tokens per expert [L][E] and the step's times (the same
  // on every rank).
  virtual void observe(const std::vector<std::vector<int64_t>>& loads, const StepTimes& times) {
    (void)loads, (void)times;
  }
  // The cost model refreshed from the run's own measurements (the trainer, between steps; the same
  // value on every rank). Strategies that copied figures into their planners override it.
  virtual void update_cost(const CostModel& cost) { (void)cost; }
  // After the optimizer of step `done` (1-based): the new owner of every expert of every MoE layer,
  // given the owners now, or an empty vector when nothing is due. The caller moves the shards.
  virtual std::vector<std::vector<int>> reshard(int64_t done, const std::vector<plan::LayerPlacement>& owners) {
    (void)done, (void)owners;
    return {};
  }

  // Hecate: whether before_step's gathers run behind the attention, t experts at a time.
  virtual bool gathers_behind_attention() const { return false; }
  // Hecate: the overlap degree t of the last before_step; 0 for strategies that use none.
  virtual int overlap_degree() const { return 0; }
  // Hecate: replica slots per rank and layer (Alg. 1's m); flexmoe: its reserved slots; else 0.
  virtual int replica_slots() const { return 0; }
  // Hecate: MoE layers whose calibration after the gate gathered, since the last call.
  int64_t take_calibrations() {
    const int64_t n = calibrations_;
    calibrations_ = 0;
    return n;
  }

 protected:
  int64_t calibrations_ = 0;
};

// MoE layers of `model`, at least 1 (the size of a strategy's load predictor).
int moe_layer_count(const ModelConfig& model);

// ---- the registry: every strategy, by name ----------------------------------------------------
struct Registration {
  const char* name;
  const char* summary;  // one line for --strategy help
  std::unique_ptr<Strategy> (*make)(const Setup&);
};
const std::vector<Registration>& registry();
// Registers one more strategy (a plugin; a test's own strategy): from then on find, make, help and
// `--strategy` know it, in the trainer and the simulator alike. name and summary must outlive its use
// (string literals). Errors: an empty or taken name, no factory. Not thread-safe: call before runs.
Status add(const Registration& r);
// The registration of `name`, or null.
const Registration* find(const std::string& name);
// "ep, hecate, fastermoe, smartmoe, flexmoe" (registration order).
std::string names();
// One line per strategy: "  hecate     <summary>".
std::string help();
// Errors: an unknown name (listing the known ones), or a setup the strategy cannot run (named).
Status make(const std::string& name, const Setup& setup, std::unique_ptr<Strategy>* out);
// Whether the registered strategy `name` places experts (every one but ep); false for unknown names.
bool places_experts(const std::string& name);

}  // namespace moe::strategy
