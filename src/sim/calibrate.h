// Calibration: fit the simulator's device and link figures to a real run (`moe train --ranks P
// --metrics M --trace T`, EP strategy, on one machine) and write them as a cluster file.
//
// Data: the trace's op durations (per rank, per step), the metrics' load (tokens_per_rank: the rows
// each rank's experts ran) and the model config of the run (the trace does not hold FLOPs). The
// run's global batch follows from the metrics (sum of tokens_per_expert = B * T * K when dropless).
// Each compute op contributes one point per rank: the medians over the run's steps, so a step the
// machine's other jobs slowed down does not pull the fit. The device's figures:
//   FLOP-less ops (embed, dispatch):  t = launch + bytes / mem_bandwidth by ordinary least squares;
//       where that line is unusable (slope <= 0, intercept < 0 or above the fastest such op) launch is
//       0 and mem_bandwidth their total bytes over their total time (fit_memory_ops);
//   ops with FLOPs:  peak_flops is the rate at which the simulator's op time, launch + max(flops /
//       peak, bytes / mem_bandwidth), sums to the measured time of these ops (fit_compute_rate);
//       max_efficiency 1, half_efficiency_flops 0. Where no rate can (the FLOP ops ran faster than
//       launch and memory alone allow: tiny ops), mem_bandwidth becomes 1e15 B/s, then launch 0 (with
//       notes). Then per op kind the same fit over that kind's ops alone gives its rate, recorded
//       as op_kind_speed[kind] = kind rate / peak_flops (compute.h): the kinds run at very different
//       rates (on this CPU attention ~23-34 GFLOP/s, the expert GEMMs ~37-47, the gate ~8), which no
//       curve of FLOPs can tell apart, while within one kind time is proportional to FLOPs (the
//       expert ops, whose size varies with the load: intercepts within +-0.4 ms). A kind whose ops
//       all ran faster than launch + bytes / mem_bandwidth gets no entry (a note); a kind whose ops
//       are all memory-bound gets the lowest rate that keeps them so. peak_flops stays the rate for
//       kinds the run did not have. The ordinary least squares line t = a + b * flops over all these
//       ops is reported too (`compute`): its intercept comes from the kinds' different rates, not
//       from a fixed cost, so it is not used.
//   spread: op_time_spread (below) of every compute op's time alone per step: how much one op's time
//     varies from step to step, which the executor draws from per rank and op (executor.h);
//   collectives: per instance (step, op; instances of one member are skipped) the transfer time
//     from the last member's arrival to the first member's end; instances during whose transfer time
//     a member's compute stream ran are left out (the runtime's lanes poll on the cores that compute:
//     their time is CPU contention, not the link), unless fewer than 3 op names would remain (then
//     all are used, with a note). Per op name the medians over steps of that time and of the bytes
//     are one point of
//     all-to-alls:  t = alpha + x / B, x = bytes sent to other ranks (the trace's bytes, which
//                   include the rows a rank keeps, times (P-1)/P: an approximation)
//     allreduce:    t = 2(P-1) alpha + x / B, x = 2(P-1)/P * S   (ring closed form, as the simulator
//                   runs it; the runtime uses recursive doubling up to 64 KiB)
//     gate_sync:    t = (P-1) alpha + x / B, x = (P-1) * 8 K E   (ring allgather of the counts; the
//                   trace records no bytes for it: the simulator's size, load.h)
//   jointly for alpha and 1/B by least squares.
// Output: one node of max(P, 8) devices on one PCIe switch, each device link of bandwidth B and
// latency alpha / 2 (a device-to-device path crosses two), device figures as fitted. Figures that fit
// negative are clamped (and said so in the notes).
// CPU ranks (machine.cpu_cores > 0: the run's ranks were processes of one machine with that many
// cores, each running machine.threads_per_rank compute threads): every compute op's time is first
// reduced to its time alone under the executor's processor sharing (executor.h; the trace shows which
// compute ops of all ranks ran at once), so a run that oversubscribed its cores fits the same device
// as one that did not; the cluster records the machine (ClusterSpec::cpu_cores) and cores_share how
// oversubscribed the run was (cpu_share). The links' bandwidth is fitted from transfers with every
// lane polling and no compute: with more ranks than cores, scaled up by ranks / cores (the lanes'
// share of a core then, executor.h).
//
// Predicting other configurations of the same machine from the result (shared_cores_cluster,
// two_node_cluster) is documented at those functions.
#pragma once

#include <string>
#include <utility>
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

// Devices of the fitted cluster's one node when the calibration ran fewer ranks: room to predict more
// ranks than were measured (bench sim-fidelity predicts 4 from a 2-rank run), as an 8-device node.
inline constexpr int kCalibratedNodeDevices = 8;

struct CalibrationResult {
  ClusterSpec cluster;
  int ranks = 0;
  int runs = 1;       // runs of the configuration fitted
  int64_t batch = 0;  // global sequences per step of the run
  LinearFit compute, memory_ops;  // ordinary least squares lines over the ops with / without FLOPs (reported)
  double compute_model_rms = 0;    // residual rms of the fitted device's op_time over the ops with FLOPs
  double alpha = 0, bandwidth = 0;  // s, bytes/s
  double comm_rms = 0;
  int comm_points = 0;     // op names in the collective fit
  int comm_contended = 0;  // op names left out of it (under 3 instances free of a member's compute)
  double cores_share = 1;  // cpu_share of the calibration run's ranks on its machine's cores (1: no CPU machine)
  std::vector<std::string> notes;  // clamps and approximations applied
};

// run: a directory holding metrics.jsonl and trace.json, or "METRICS,TRACE". Errors name the file
// and what is missing (no compute ops, a trace of another model, ...).
struct CalibrationMachine {
  int cpu_cores = 0;         // > 0: the ranks were CPU processes sharing this many cores; 0: accelerators
  int threads_per_rank = 1;  // the run's compute threads per rank (moe train --threads); 0: as the run
                             // recorded them (metrics "threads"), else max(1, cpu_cores / ranks)
};
Status calibrate(const std::string& run, const ModelConfig& model, CalibrationResult* out,
                 CalibrationMachine machine = {});
// The same over several runs of one configuration (same ranks and batch, else an error naming the
// run): every op's medians are over the steps of all of them, so one run's level, which on a shared
// machine moves by up to +-12% from run to run while its steps agree within +-3%, weighs 1/runs.
Status calibrate(const std::vector<std::string>& runs, const ModelConfig& model, CalibrationResult* out,
                 CalibrationMachine machine = {});
std::string describe(const CalibrationResult& r);  // the fit, as `moe sim --calibrate` prints it

// DeviceSpec::op_time_quantiles from compute op samples grouped by (run, op name, rank), each sample
// (time alone, time alone per FLOP, or per byte for FLOP-less ops) of one step after the run's first
// (its first-touch page faults are warm-up): every sample's time per unit over its group's median, for
// groups of at least 3 samples whose median time is at least kSpreadMinSeconds (a shorter op's spread
// is the clock's and the launch's, and it weighs little in a step), at the quantiles (i + 0.5) /
// kSpreadQuantiles. Empty when fewer than kSpreadQuantiles samples qualify.
inline constexpr int kSpreadQuantiles = 20;
inline constexpr double kSpreadMinSeconds = 1e-3;
std::vector<double> op_time_spread(const std::vector<std::vector<std::pair<double, double>>>& groups);

Status write_cluster_file(const std::string& path, const ClusterSpec& spec);  // atomically

// Least squares of y on x (n >= 2 points with distinct x; else slope 0, intercept the mean).
LinearFit fit_line(const std::vector<double>& x, const std::vector<double>& y);

// The FLOP-less ops' launch overhead and memory bandwidth (see the header comment); appends a note
// when it falls back to launch 0. No points: launch 0, bandwidth 1e15 B/s.
void fit_memory_ops(const std::vector<double>& bytes, const std::vector<double>& t, double* launch,
                    double* bandwidth, std::vector<std::string>* notes);
// The FLOP rate r with sum_i (launch + max(flops_i / r, bytes_i / mem_bandwidth)) = sum_i t_i, to a
// relative 1e-12; 0 when launch and memory alone exceed the measured total. REQUIRES: mem_bandwidth > 0.
double fit_compute_rate(const std::vector<double>& flops, const std::vector<double>& bytes, const std::vector<double>& t,
                        double launch, double mem_bandwidth);

// How much slower each thread runs when `ranks` ranks of `threads_per_rank` compute threads share
// `cores` cores: max(1, ranks * threads_per_rank / cores). REQUIRES: all >= 1 (std::logic_error).
double cpu_share(int ranks, int threads_per_rank, int cores);
// The calibrated cluster for ranks of `threads_per_rank` compute threads on `cores` cores of the
// machine of the calibration run: its cpu_cores and cpu_threads_per_device, so that the executor
// shares the cores among the compute ops running at each moment and gives the communication lanes
// what they leave (executor.h): a rank waiting in a collective leaves its share to the others, and
// the shared-memory copies, done by the ranks' own lanes, slow when the cores are busy.
ClusterSpec shared_cores_cluster(const CalibrationResult& cal, int threads_per_rank, int cores);
// The calibrated device and intra-node links on two nodes of `ranks_per_node` devices each, joined by
// one NIC per node of link `nic` (its bandwidth in payload bytes/s and latency: an emulated NIC's
// configured cap is its datasheet) through one non-blocking switch. A flow between the nodes crosses
// the device link at either end (latency alpha / 2 each, as calibrated) and both NIC ports. On a
// calibrated CPU machine of at least 2 cores each node's ranks get half of them (cpu_nodes_pinned),
// as `moe cluster up` pins its hosts. Messages between the nodes of up to 1 MiB go eagerly
// (ClusterSpec::eager_bytes), as the emulated cluster's MPI sends them (scripts/cluster.sh). Error:
// ranks_per_node < 1, or a NIC without bandwidth.
Status two_node_cluster(const CalibrationResult& cal, int ranks_per_node, LinkSpec nic, ClusterSpec* out);

}  // namespace moe::sim
