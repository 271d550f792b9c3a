// The simulator's compute model: how long one op takes on one device, from the FLOPs it performs and
// the bytes it moves through device memory. A roofline with an efficiency curve by op size, a speed
// per op kind and a fixed launch overhead; the figures of each device come from the cluster presets
// (cluster.h) or a cluster file, and the calibration fits them to a real run.
//
// Units: FLOPs, bytes, seconds; peaks in FLOP/s and bytes/s. Pure functions, safe from any thread.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace moe::sim {

// One accelerator.
struct DeviceSpec {
  std::string name;                  // "A100-SXM4-40GB"
  double peak_flops = 0;             // dense FP16/BF16 tensor-core peak, FLOP/s (> 0): what the model's GEMMs use
  double mem_bandwidth = 0;          // device memory, bytes/s (> 0)
  double launch_overhead = 0;        // s added to every op: kernel launch and stream synchronisation (>= 0)
  double max_efficiency = 1;         // fraction of peak_flops that large ops reach, in (0, 1]
  double half_efficiency_flops = 0;  // op size (FLOPs) at which efficiency is max_efficiency / 2 (>= 0)
  // Per compute op kind (graph::op_kind_name: "attn_fwd", "expert_bwd", ...), a factor on the FLOP
  // rate of that kind's ops (> 0); kinds not listed run at 1. Kernels of different kinds reach
  // different rates at the same FLOPs (on this CPU attention ~23-34 GFLOP/s, the expert GEMMs ~37-47), which
  // one curve by op size cannot tell apart. The presets list none (datasheets give one peak); a
  // calibration fits one per kind of the run it reads (calibrate.h).
  std::map<std::string, double, std::less<>> op_kind_speed;
  // How much one op's time varies from step to step: an op's time over its median, at the quantiles
  // (i + 0.5) / n of the calibration run's compute ops (ascending, each > 0; calibrate.h). On a shared
  // CPU one op of a step takes 0.7-0.8x to 1.2-1.4x of its median (10th and 90th percentiles), mostly
  // independently of the same op on another rank, and every exchange waits for the slower rank, so
  // ranks identical on average still wait for each other. Empty (the presets: a datasheet gives no
  // spread): every op takes its modeled time.
  std::vector<double> op_time_quantiles;

  bool operator==(const DeviceSpec&) const = default;
};

// The factor op_kind_speed gives ops of `kind`: its entry, else 1.
double kind_speed(const DeviceSpec& device, std::string_view kind);

// The factor on one op's modeled time that the draw u in [0, 1) gives: op_time_quantiles interpolated
// linearly at u (the first and last entries below and above their quantiles); 1 when the table is
// empty. REQUIRES: u in [0, 1] (std::logic_error).
double op_time_factor(const DeviceSpec& device, double u);

// Fraction of peak_flops an op of `flops` FLOPs reaches:
//   efficiency(f) = max_efficiency * f / (f + half_efficiency_flops).
// Small ops cannot fill the device (too few thread blocks, tails, fixed prologues), so efficiency grows
// with size and saturates at max_efficiency. The time this gives, f / (peak * efficiency(f)) =
// (f + half_efficiency_flops) / (peak * max_efficiency), is affine in f: a fixed cost plus a rate,
// the same alpha-beta form the link model uses, which is what a least-squares calibration can fit.
// REQUIRES: flops >= 0 and finite (std::logic_error). efficiency(0) is 0.
double efficiency(const DeviceSpec& device, double flops);

// Seconds for one op: max(compute, memory) + launch_overhead, where compute = flops / (peak_flops *
// efficiency(flops) * speed) (0 for flops = 0) and memory = bytes / mem_bandwidth (bytes read plus
// written); speed: the op's kind_speed. REQUIRES: flops, bytes >= 0 and finite, speed > 0 and finite;
// the device's figures as documented above (std::logic_error).
double op_time(const DeviceSpec& device, double flops, double bytes, double speed = 1);

}  // namespace moe::sim
