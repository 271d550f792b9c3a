// Roofline op time with an efficiency curve (compute.h).
#include "sim/compute.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace moe::sim {

namespace {

void require_amount(const char* fn, const char* what, double v) {
  if (!std::isfinite(v) || v < 0) {
    std::string m = fn;
    m += ": ";
    m += what;
    m += " must be finite and >= 0";
    throw std::logic_error(m);
  }
}

void require_device(const char* fn, const DeviceSpec& d) {
  const bool ok = std::isfinite(d.peak_flops) && d.peak_flops > 0 && std::isfinite(d.mem_bandwidth) &&
                  d.mem_bandwidth > 0 && std::isfinite(d.launch_overhead) && d.launch_overhead >= 0 &&
                  d.max_efficiency > 0 && d.max_efficiency <= 1 && std::isfinite(d.half_efficiency_flops) &&
                  d.half_efficiency_flops >= 0;
  if (!ok) {
    std::string m = fn;
    m += ": device '";
    m += d.name;
    m += "' has invalid figures (validate the cluster spec first)";
    throw std::logic_error(m);
  }
}

}  // namespace

double efficiency(const DeviceSpec& device, double flops) {
  require_amount("sim::efficiency", "flops", flops);
  if (flops == 0) return 0;
  return device.max_efficiency * flops / (flops + device.half_efficiency_flops);
}

double kind_speed(const DeviceSpec& device, std::string_view kind) {
  const auto it = device.op_kind_speed.find(kind);
  return it == device.op_kind_speed.end() ? 1.0 : it->second;
}

double op_time_factor(const DeviceSpec& device, double u) {
  if (!(u >= 0 && u <= 1)) throw std::logic_error("sim::op_time_factor: u must be in [0, 1]");
  const std::vector<double>& q = device.op_time_quantiles;
  if (q.empty()) return 1;
  const double x = u * static_cast<double>(q.size()) - 0.5;  // entry i sits at x = i
  if (x <= 0) return q.front();
  const size_t i = static_cast<size_t>(x);
  if (i + 1 >= q.size()) return q.back();
  const double f = x - static_cast<double>(i);
  return q[i] + f * (q[i + 1] - q[i]);
}

double op_time(const DeviceSpec& device, double flops, double bytes, double speed) {
  require_amount("sim::op_time", "flops", flops);
  require_amount("sim::op_time", "bytes", bytes);
  require_device("sim::op_time", device);
  if (!(std::isfinite(speed) && speed > 0)) throw std::logic_error("sim::op_time: speed must be finite and > 0");
  // The affine form of flops / (peak * efficiency(flops) * speed): no 0/0 at flops = 0.
  const double compute = flops == 0 ? 0.0
                                    : (flops + device.half_efficiency_flops) /
                                          (device.peak_flops * device.max_efficiency * speed);
  const double memory = bytes / device.mem_bandwidth;
  return std::max(compute, memory) + device.launch_overhead;
}

}  // namespace moe::sim
