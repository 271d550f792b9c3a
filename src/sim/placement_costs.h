// The placement strategies in the simulator (Hecate, FasterMoE, SmartMoE, FlexMoE): per step the
// placements the strategy objects of strategy/strategy.h decide (the very objects the trainer runs),
// fed the simulated loads, and the run-time sizes of their graphs
// (build_ep_step with the placement options, one ep group of every rank) exactly as MoeLayer
// (moe/moe_layer_replicas.cpp) and EpStepBodies (runtime/ep_step_bodies.cpp) record them.
//
// Per MoE layer l and step, the strategy (strategy/strategy.h) decides and the simulator applies:
//   before the step  planned = before_step(l, owners), or the owners when it plans nothing (Hecate's
//                    t comes from the attention time of the last observe, as in the trainer);
//   after the gate   placed = after_gate(l, owners, planned, counts), or planned;
//                    counts[r][e] = the step's load (the kept assignments, what routed_counts gives);
//   after the step   observe(the global loads, the attn_fwd time the compute model gives that op),
//                    then reshard(steps, owners): the owners it re-assigns
//                    (Alg. 2, SmartMoE's swaps, FlexMoE's re-plans);
//   sizes            dispatch / combine all-to-alls from rows = plan::dispatch_plan(placed, nodes,
//                    counts) (float32 rows of C), expert FLOPs from the rows a rank receives, the sparse
//                    ops' peer bytes from their comm::SparsePlan over W*E chunks of F*C floats.
// Cost-model inputs the runtime measures at start-up (runtime/measure_costs.h) come from the modeled
// cluster's datasheet figures here: bandwidth = placement_bandwidth(), overlap_bandwidth =
// overlap_bandwidth() (both PlacementOptions::link_gbs when set), the links from cluster_links(); the
// GEMM rate = the device's rate on the balanced expert_fwd op (compute.h's efficiency curve). After
// each simulated step the weights bandwidth follows that step's sparse collectives, as the trainer's
// (strategy::observe_weight_transfers over runtime::weight_transfers of every rank's timeline).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/sparse_collectives.h"
#include "graph/ep_builder.h"
#include "model/config.h"
#include "plan/placement.h"
#include "sim/cluster.h"
#include "sim/executor.h"
#include "sim/load.h"
#include "sim/simulate.h"

namespace moe::sim {

// One MoE layer's placements during one step and what follows from them.
struct LayerStepPlacement {
  plan::LayerPlacement owners;   // the shards: even_placement(E, R)
  plan::LayerPlacement planned;  // gathered before the gate (Hecate's Alg. 1); owners without one
  plan::LayerPlacement placed;   // after place(l): the placement tokens are dispatched over
  std::vector<std::vector<std::vector<int64_t>>> rows;  // plan::dispatch_plan(placed, nodes, counts) [R][E][R]
  // The sparse collectives over W*E chunks (W = 2 weight matrices, 3 for SwiGLU; chunk w*E + e is
  // matrix w of expert e, held like expert e), as MoeLayer plans them:
  comm::SparsePlan gather;         // materialize:         SparseAllGather(owners, planned)
  comm::SparsePlan gather_placed;  // materialize_placed:  SparseAllGather(held, placed), held = planned
                                   //                      after a gather before the gate, else owners
  comm::SparsePlan regather;       // rematerialize:       SparseAllGather(owners, placed)
  comm::SparsePlan reduce;         // replica_grad_reduce: SparseReduceScatter(placed, owners)
  int64_t chunk_bytes = 0;         // 4 * F * C
};

// The above from the shards' owners now (even_placement(E, R) until a strategy re-shards) and the two
// placements, the tokens dispatched under `rule` (the strategy's, as the runtime's MoeLayer). counts
// [R][E]. REQUIRES: owners, planned and placed valid over R = opt.world ranks, planned and placed
// holding every owner's shard, placed's replicas ⊇ planned's, nodes of R ranks, counts [R][E]
// non-negative (std::logic_error from the planners otherwise).
LayerStepPlacement layer_step_placement(const ModelConfig& cfg, const graph::EpStepOptions& opt,
                                        plan::LayerPlacement owners, plan::LayerPlacement planned,
                                        plan::LayerPlacement placed, const plan::Nodes& nodes,
                                        const std::vector<std::vector<int64_t>>& counts,
                                        plan::DispatchRule rule = plan::DispatchRule::nearest);

// Writes into `g` (a graph of a strategy's step for opt for rank `rank`, opt with ep_size == world)
// the sizes the runtime records, from layers[i] for MoE layer i (a chunked dispatch and its
// expert_fwd chunks as in fill_ep_costs, the chunks over the placement `placed`):
//   dispatch_a2a, combine_a2a_bwd: peer_bytes[d] = 4 C sum_e rows[rank][e][d] (self included), bytes their sum;
//   combine_a2a, dispatch_a2a_bwd: peer_bytes[s] = 4 C sum_e rows[s][e][rank];
//   expert_fwd / expert_bwd: flops = passes * 2 * mats * (rows received) * C * F, bytes the builder's
//     balanced estimate scaled by rows / (N K) (as fill_ep_costs);
//   gate_sync: 8 K E bytes (as fill_ep_costs);
//   materialize, materialize_placed, rematerialize, replica_grad_reduce: peer_bytes = row `rank` of
//     comm::peer_bytes(plan, chunk_bytes), bytes their sum (MoeLayer::sparse_peer_bytes, EpStepBodies).
// REQUIRES: one entry of layers per MoE layer, each over opt.world ranks (std::logic_error).
void fill_placement_costs(const ModelConfig& cfg, const graph::EpStepOptions& opt,
                          const std::vector<LayerStepPlacement>& layers, int rank, graph::StepGraph* g);

// The executor's schedules for g's sparse ops (one entry per op id; none for other ops).
std::vector<SparseSchedule> sparse_schedules(const graph::StepGraph& g, const ModelConfig& cfg,
                                             const std::vector<LayerStepPlacement>& layers);

// Bytes/s a rank receives expert weights at on `cluster`, for the planners' cost models (Hecate's t,
// calibration, FasterMoE): with several nodes the per-device share of a node's NIC line rate (every
// rank gathers at once, through the node's NICs: the inter-node bandwidth the paper prescribes for t);
// on one node the slowest route from device 0 to another device.
double placement_bandwidth(const Cluster& cluster);
// Hecate's Alg. 1 bw on `cluster` (the paper: "the inter-node bandwidth" when inter-node links are much
// slower than intra-node ones): with several nodes a node's NIC line rate (all its NICs; a replica
// crosses into a node once and spreads inside it), on one node placement_bandwidth().
double overlap_bandwidth(const Cluster& cluster);
// The two link classes as alpha-beta, from the slowest route between devices 0 and 1..D-1 of node 0
// (intra) and from device 0 to the first device of node 1 (inter); bandwidth 0 where there is none.
void cluster_links(const Cluster& cluster, strategy::LinkCost* intra_node, strategy::LinkCost* inter_node);

// A registered strategy that places experts (strategy::places_experts; sim_strategies() offers every
// one). Errors: an unknown name, ep_size != ranks, n_experts not a multiple of the ranks, missing node
// map (named).
Status make_placement_strategy(const std::string& name, const StrategySetup& setup, std::unique_ptr<SimStrategy>* out);

}  // namespace moe::sim
