// The trainer's cost model (strategy::CostModel): what every planner is told about this machine,
// measured at start-up instead of assumed. Per link class (ranks on one host; ranks on two hosts) an
// alpha-beta fit of exchange times over the world communicator, and the expert GEMM rate of the
// job's pinned kernel on this run's expert shapes. Every rank measures; the ranks then agree on one
// set (the mean over the ranks that measured a figure, from one allreduce, so the doubles are the
// same bits everywhere), because every rank must plan identically (invariant 2, docs/architecture.md).
//
// Thread safety: none; call between steps, from the training thread (the lanes idle).
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "model/config.h"
#include "plan/placement.h"
#include "strategy/strategy.h"
#include "util/status.h"

namespace moe::runtime {

// One timed message: `seconds` for `bytes` bytes to cross (an exchange of that many each way).
struct LinkSample {
  int64_t bytes = 0;
  double seconds = 0;
};

// Least-squares fit of seconds = latency + bytes / bandwidth. A negative fitted latency (noise on
// small messages) becomes 0 with the slope refitted through the origin. Errors: fewer than two
// distinct sizes, a non-positive or non-finite time, or a slope that is not positive.
Status fit_link_cost(const std::vector<LinkSample>& samples, strategy::LinkCost* out);

// What one rank measured, before the ranks agree. A link class this rank had no partner in has
// bandwidth 0.
struct RawCosts {
  strategy::LinkCost intra_node, inter_node;
  double gemm_flops = 0;
};

// The figures every rank plans with: each is the mean over the ranks that measured it (bandwidth > 0,
// gemm_flops > 0). Collective over world (null: one rank, *agreed = mine).
Status agree_costs(comm::Communicator* world, const RawCosts& mine, RawCosts* agreed);

// Measures this rank's RawCosts: exchanges (each rank sends and receives at once) with a partner on its
// own host and one on another host (ranks paired lowest-first, all pairs of a class at once, as the
// step's exchanges load the links together: two ranks of a host share its NIC), fitted by
// fit_link_cost (where the times fit no line, as on oversubscribed cores: the largest message's rate,
// the smallest one's time as latency), and the pinned GEMM kernel over expert_gemm_shapes(rows, C, F).
// Collective over world (null: the GEMM rate only). nodes: node of each world rank.
Status measure_costs(comm::Communicator* world, const plan::Nodes& nodes, const ModelConfig& model, int64_t rows,
                     RawCosts* out);

// The links alone (out's GEMM rate untouched), as measure_costs does; quick: two sizes (1 and 4 MiB),
// best of 2, no warm-up, for re-measuring during training (about 85 ms a class at 1 Gbit/s, 9 ms at
// 10 Gbit/s).
// Collective over world (null: nothing to measure).
Status measure_links(comm::Communicator* world, const plan::Nodes& nodes, bool quick, RawCosts* out);

// The planners' cost model from agreed figures: the expert weights arrive at the slowest link class
// the ranks span (inter-node when they span hosts), which is also Alg. 1's bw for Hecate's t.
// link_gbs / gemm_gflops > 0 override the measured bandwidths / GEMM rate.
// REQUIRES: raw.gemm_flops > 0 or gemm_gflops > 0.
strategy::CostModel cost_model_from(const ModelConfig& model, const RawCosts& raw, const plan::Nodes& nodes,
                                    double link_gbs, double gemm_gflops);

}  // namespace moe::runtime
