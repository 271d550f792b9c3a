// Calibration: fit the simulator's device and link figures to a real run (`moe train --ranks P
// --metrics M --trace T`, EP strategy, on one machine) and write them as a cluster file.
//
// Data: the trace's op durations (per rank, per step), the metrics' load (tokens_per_rank: the rows
// each rank's experts ran) and the model config of the run (the trace does not hold FLOPs). The
// run's global batch follows from the metrics (sum of tokens_per_expert = B * T * K when dropless).
// Each op contributes one point: the medians over the run's steps (per rank for compute ops), so a
// step the machine's other jobs slowed down does not pull the fit. Fits, by ordinary least squares:
//   compute ops with FLOPs > 0:  t = a + b * flops   ->  peak_flops = 1/b (max_efficiency 1),
//                                                        half_efficiency_flops = (a - launch) / b
//   compute ops with no FLOPs:   t = launch + bytes / mem_bandwidth
//   collectives (per step and op the shortest member duration: the member that arrived last waited
//   for nobody, so its duration is the transfer alone):
//     all-to-alls:  t = alpha + x / B, x = bytes sent to other ranks (the trace's bytes, which
//                   include the rows a rank keeps, times (P-1)/P: an approximation)
//     allreduce:    t = 2(P-1) alpha + x / B, x = 2(P-1)/P * S   (ring closed form)
//   jointly for alpha and 1/B. gate_sync is left out (its bytes are not recorded).
// Output: one node of max(P, 8) devices on one PCIe switch, each device link of bandwidth B and
// latency alpha / 2 (a device-to-device path crosses two), device figures as fitted. Figures that fit
// negative are clamped (and said so in the description).
#pragma once

#include <string>
#include <vector>

#include "model/config.h"
#include "sim/cluster.h"
#include "util/status.h"

namespace moe::sim {

struct LinearFit {
  double intercept = 0, slope = 0;
  double rms = 0;  // residual root mean square
  int n = 0;
};

struct CalibrationResult {
  ClusterSpec cluster;
  int ranks = 0;
  int64_t batch = 0;  // global sequences per step of the run
  LinearFit compute, memory_ops;
  double alpha = 0, bandwidth = 0;  // s, bytes/s
  double comm_rms = 0;
  int comm_points = 0;
  std::vector<std::string> notes;  // clamps and approximations applied
};

// run: a directory holding metrics.jsonl and trace.json, or "METRICS,TRACE". Errors name the file
// and what is missing (no compute ops, a trace of another model, ...).
Status calibrate(const std::string& run, const ModelConfig& model, CalibrationResult* out);
std::string describe(const CalibrationResult& r);  // the fit, as `moe sim --calibrate` prints it
Status write_cluster_file(const std::string& path, const ClusterSpec& spec);  // atomically

// Least squares of y on x (n >= 2 points with distinct x; else slope 0, intercept the mean).
LinearFit fit_line(const std::vector<double>& x, const std::vector<double>& y);

}  // namespace moe::sim
