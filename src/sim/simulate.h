// A whole simulated run, as `moe sim` and the benchmarks use it: a cluster, a model, a strategy (from
// a registry keyed by name, so another strategy plugs in without touching the CLI), a load source and
// a number of steps, run back to back on the StepExecutor (executor.h); per-step results summarised
// the way the runtime's metrics are.
//
// Strategies: a SimStrategy makes the graphs of every rank for one step from that step's load, in the
// strategy's own order of decisions (what the runtime plans before the step from past loads, it plans
// from past simulated loads; what it decides after the gate, from this step's load). Registered in
// sim_strategies() (simulate.cpp):
//   ep         expert parallelism (graph/ep_builder.h), costs by load.h's fill_ep_costs;
//   hecate     Hecate FSSDP (strategy/hecate.cpp): Alg. 1 before the step, calibration after the gate,
//              sparse collectives on the gather lane; PlacementOptions::rematerialize for Hecate-RM;
//   fastermoe  FasterMoE's shadowing after the gate;
//   smartmoe   SmartMoE's owner swaps every PlacementOptions::reshard_every steps, no replicas;
//   flexmoe    FlexMoE's persistent replicas, re-planned after every step. (placement_costs.h for these four.)
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "graph/ep_builder.h"
#include "model/config.h"
#include "runtime/trace.h"
#include "sim/cluster.h"
#include "sim/executor.h"
#include "sim/load.h"
#include "strategy/strategy.h"
#include "util/status.h"

namespace moe::sim {

// The placement strategies' options (as `moe train`'s flags of the same names; hecate / fastermoe).
struct PlacementOptions {
  bool rematerialize = false;  // hecate: free replicas after forward, gather again for backward
  int overlap_degree = -1;     // hecate: Alg. 1's t (-1: from the modeled attention time, as the trainer)
  int replica_slots = -1;      // hecate: m extra experts per rank and layer (-1: E / ranks)
  int load_window = 5;         // hecate: steps of the load predictor's window (>= 1)
  double link_gbs = 0;         // GB/s the planners' cost models assume (0: placement_bandwidth(cluster))
  // GB/s a replayed run's start-up measurement gave its planners (0: placement_bandwidth(cluster)): where
  // link_gbs is 0 the cost model starts from it and then follows the simulated steps, as the trainer's.
  double measured_link_gbs = 0;
  // hecate: Alg. 2 every N steps; smartmoe: its interval; flexmoe: its replan interval (-1: the
  // runtime's defaults, 100 / 100 / 50; 0: never, except flexmoe's balance trigger).
  int reshard_every = -1;
};

// What a strategy needs to build its graphs.
struct StrategySetup {
  ModelConfig model;
  int ranks = 1;
  int ep_size = 1;                  // ranks per expert-parallel group
  int64_t batch_per_rank = 1;       // sequences
  int64_t allreduce_micro_bytes = 256 << 10;
  // Placement strategies: their options, the node of each rank, the device (the compute model's
  // attention time and GEMM rate) and the links their cost models assume (cluster_links()).
  PlacementOptions placement;
  std::vector<int> node_of_rank;
  DeviceSpec device;
  double bandwidth = 0;          // bytes/s a rank receives expert weights at (placement_bandwidth)
  double overlap_bandwidth = 0;  // Hecate's Alg. 1 bw (overlap_bandwidth(cluster))
  strategy::LinkCost intra_node, inter_node;
  bool cpu_ranks = false;  // the cluster's devices are CPU processes sharing cores (ClusterSpec::cpu_cores > 0)
  plan::CorePools cores{};  // of those, the ranks that take turns on the same cores (sim_core_pools)
  plan::CorePools nics{};   // the ranks that cross the network through one NIC (sim_nic_pools)
};

// The ranks of a calibrated CPU cluster (cpu_cores > 0) that take turns on the same cores, as
// runtime::core_pools finds them on the machine: each node's on its cpu_cores / nodes cores when
// cpu_nodes_pinned, else all on all of them; empty for device clusters. node_of_rank [ranks].
plan::CorePools sim_core_pools(const ClusterSpec& cluster, const std::vector<int>& node_of_rank);

// The ranks (rank r on device r) that send and receive between nodes through one NIC
// (Cluster::nic_of), as plan::nic_pools groups them; empty on one node.
plan::CorePools sim_nic_pools(const Cluster& cluster, int ranks);

// What a placement strategy decided in the last step (zeros for EP).
struct PlacementStats {
  int64_t replicas = 0;       // extra replicas over all MoE layers, as the runtime's metrics count them
  int64_t calibrations = 0;   // hecate: MoE layers whose calibration gathered
  int overlap_degree = 0;     // hecate: the t used
  int64_t experts_moved = 0;  // shards whose owner changed after this step (hecate Alg. 2, smartmoe, flexmoe)
  double weights_gbs = 0;     // the weights bandwidth the planners priced this step's replicas at
};

class SimStrategy {
 public:
  virtual ~SimStrategy() = default;
  // The graphs of every rank for one step of `load` (same structure, per-rank sizes). *out is resized.
  // Called once per step, steps in order (a strategy may keep state across steps).
  virtual void step_graphs(const StepLoad& load, std::vector<graph::StepGraph>* out) = 0;
  // After step_graphs: the sparse collectives' schedules of that step (executor.h), one per op id, or
  // empty (sparse ops, if any, then run as direct exchanges).
  virtual const std::vector<SparseSchedule>& sparse_schedules() const {
    static const std::vector<SparseSchedule> none;
    return none;
  }
  virtual PlacementStats placement_stats() const { return {}; }
  // After the executor ran the graphs of step_graphs: their timelines [ranks] (what the trainer's
  // strategy learns from its own step's op times).
  virtual void after_step(const std::vector<graph::StepGraph>& graphs,
                          const std::vector<runtime::StepTimeline>& timelines) {
    (void)graphs, (void)timelines;
  }
};

struct StrategyInfo {
  std::string help;
  // Errors: a setup the strategy cannot run (named).
  std::function<Status(const StrategySetup&, std::unique_ptr<SimStrategy>*)> make;
};
std::map<std::string, StrategyInfo> sim_strategies();  // as registered now (strategy::add)

struct SimRunConfig {
  ClusterSpec cluster;
  ModelConfig model;
  std::string strategy = "ep";
  LoadSpec load;
  int steps = 1;
  int64_t batch = 0;       // sequences per step over all ranks; a multiple of ranks
  int ranks = 0;           // 0: every device of the cluster
  int ep_size = 0;         // 0: the largest divisor of ranks that divides n_experts
  int64_t allreduce_micro_bytes = 256 << 10;  // as moe train's default --allreduce-micro-kb 256
  enum class Aggregate { automatic, on, off };
  Aggregate aggregate = Aggregate::automatic;  // automatic: on above 64 ranks
  bool hierarchical_allreduce = false;
  bool keep_trace = false;  // collect trace records (all ranks, all steps)
  PlacementOptions placement;  // hecate, fastermoe
};

struct SimStepSummary {
  double step_ms = 0;
  runtime::StepBreakdown mean;  // fields averaged over ranks (as the runtime's metrics)
  std::vector<std::pair<std::string, double>> critical_path_ms;
  std::vector<std::vector<int64_t>> tokens_per_expert;  // [moe layer][e], summed over ranks
  std::vector<std::vector<int64_t>> tokens_per_rank;    // [moe layer][r], rows each rank's experts ran
  // The MoE layers' time per rank as the trainer's moe_ms_per_rank measures it: per MoE block the span
  // of its compute-stream ops gate_fwd .. combine_fwd (place included) plus combine_bwd .. gate_bwd,
  // waits inside included; and its mean and largest over ranks.
  std::vector<double> moe_ms_per_rank;
  double moe_ms = 0, moe_ms_max = 0;
  int64_t sparse_bytes = 0;  // sparse collectives: bytes sent + received, summed over ranks (as the trainer)
  PlacementStats placement;
  int64_t flows = 0;
  int64_t rates_computed = 0;
};

struct SimRunResult {
  int ranks = 0, ep_size = 0;
  bool aggregated = false;
  std::vector<SimStepSummary> steps;
  std::vector<double> link_bytes;  // over all steps
  double simulated_s = 0;          // sum of step times
  double wall_s = 0;               // host time the simulation took (set-up included)
  graph::StepGraph graph;          // rank 0's graph of the last step (names for the trace)
  std::vector<runtime::TraceRecord> trace;  // keep_trace: records, times since the first step's start
};

// Validates everything (cluster, model, strategy, load, sizes) before simulating; errors name the
// flag-level problem (e.g. "batch (6) must be a multiple of the ranks (4)").
Status resolve(SimRunConfig* cfg);  // fills ranks and ep_size defaults
Status simulate(SimRunConfig cfg, SimRunResult* out);

}  // namespace moe::sim
