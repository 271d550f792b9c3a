// Least-squares calibration of the device and link figures from a real run (calibrate.h).
#include "sim/calibrate.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <tuple>

#include <nlohmann/json.hpp>

#include "graph/ep_builder.h"
#include "model/safetensors.h"
#include "util/str_cat.h"

namespace moe::sim {

namespace {

using json = nlohmann::json;

Status read_json_lines(const std::string& path, std::vector<json>* out) {
  std::ifstream in(path);
  if (!in) return Status::error(str_cat("calibrate: cannot read metrics ", path));
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      json j = json::parse(line);
      if (j.is_object() && j.contains("tokens_per_rank") && j.contains("step")) out->push_back(std::move(j));
    } catch (const json::exception& e) {
      return Status::error(str_cat("calibrate: ", path, " line ", n, ": not JSON"));
    }
  }
  if (out->empty()) return Status::error(str_cat("calibrate: ", path, " has no step lines of `moe train --metrics`"));
  return Status::ok();
}

// Solves the 2x2 least squares min sum (y - u a - v b)^2 for (a, b).
bool solve2(const std::vector<double>& u, const std::vector<double>& v, const std::vector<double>& y, double* a,
            double* b) {
  double uu = 0, uv = 0, vv = 0, uy = 0, vy = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    uu += u[i] * u[i], uv += u[i] * v[i], vv += v[i] * v[i], uy += u[i] * y[i], vy += v[i] * y[i];
  }
  const double det = uu * vv - uv * uv;
  if (!(std::fabs(det) > 1e-300)) return false;
  *a = (uy * vv - vy * uv) / det;
  *b = (uu * vy - uv * uy) / det;
  return true;
}

}  // namespace

LinearFit fit_line(const std::vector<double>& x, const std::vector<double>& y) {
  LinearFit f;
  f.n = static_cast<int>(x.size());
  if (x.empty()) return f;
  const double mx = std::accumulate(x.begin(), x.end(), 0.0) / f.n, my = std::accumulate(y.begin(), y.end(), 0.0) / f.n;
  double sxx = 0, sxy = 0;
  for (int i = 0; i < f.n; ++i) sxx += (x[i] - mx) * (x[i] - mx), sxy += (x[i] - mx) * (y[i] - my);
  f.slope = sxx > 0 ? sxy / sxx : 0;
  f.intercept = my - f.slope * mx;
  double ss = 0;
  for (int i = 0; i < f.n; ++i) ss += std::pow(y[i] - f.intercept - f.slope * x[i], 2);
  f.rms = std::sqrt(ss / f.n);
  return f;
}

Status calibrate(const std::string& run, const ModelConfig& model, CalibrationResult* out) {
  std::string metrics_path, trace_path;
  if (const size_t comma = run.find(','); comma != std::string::npos) {
    metrics_path = run.substr(0, comma);
    trace_path = run.substr(comma + 1);
  } else {
    metrics_path = (std::filesystem::path(run) / "metrics.jsonl").string();
    trace_path = (std::filesystem::path(run) / "trace.json").string();
  }
  if (Status s = model.validate(); !s) return s;
  std::vector<json> metrics;
  if (Status s = read_json_lines(metrics_path, &metrics); !s) return s;
  json trace;
  {
    std::ifstream in(trace_path);
    if (!in) return Status::error(str_cat("calibrate: cannot read trace ", trace_path));
    try {
      in >> trace;
    } catch (const json::exception&) {
      return Status::error(str_cat("calibrate: ", trace_path, " is not JSON"));
    }
  }
  if (!trace.is_object() || !trace.contains("traceEvents"))
    return Status::error(str_cat("calibrate: ", trace_path, " is not a Chrome trace of `moe train --trace`"));

  CalibrationResult res;
  // Ranks and the global batch from the metrics.
  std::map<int64_t, json> by_step;
  for (json& m : metrics) by_step[m.at("step").get<int64_t>()] = m;
  const json& first = metrics.front();
  const auto ranks_rows = first.at("tokens_per_rank").get<std::vector<std::vector<int64_t>>>();
  if (ranks_rows.empty()) return Status::error("calibrate: the metrics have no MoE layer");
  res.ranks = static_cast<int>(ranks_rows[0].size());
  const int P = res.ranks;
  int64_t assignments = 0;
  const auto first_counts = first.at("tokens_per_expert").get<std::vector<std::vector<int64_t>>>();
  if (first_counts.empty()) return Status::error("calibrate: the metrics have no tokens_per_expert");
  int64_t model_moe_layers = 0;
  for (int64_t b = 0; b < model.n_layers; ++b) model_moe_layers += model.is_moe_layer(b) ? 1 : 0;
  if (static_cast<int64_t>(first_counts.size()) != model_moe_layers ||
      static_cast<int64_t>(first_counts[0].size()) != model.n_experts)
    return Status::error(str_cat("calibrate: the run has ", first_counts.size(), " MoE layers of ", first_counts[0].size(),
                                 " experts, the model given (--model) ", model_moe_layers, " of ", model.n_experts));
  for (int64_t c : first_counts[0]) assignments += c;
  res.batch = assignments / (model.top_k * model.seq_len);
  if (P < 2 || res.batch < P || res.batch % P != 0)
    return Status::error(str_cat("calibrate: the run has ", P, " rank(s) and a batch of ", res.batch,
                                 " sequences (from tokens_per_expert and the model's top_k and seq_len): need >= 2 "
                                 "ranks of the model given with --model"));
  graph::EpStepOptions opt;
  opt.world = P;
  opt.ep_size = static_cast<int>(std::gcd<int64_t>(model.n_experts, P));
  opt.batch = res.batch / P;
  const graph::EpStep step = graph::build_ep_step(model, opt);
  std::map<std::string, const graph::Op*> compute_ops;
  for (const graph::Op& op : step.graph.ops)
    if (!graph::is_communication(op.kind)) compute_ops[step.graph.op_name(op)] = &op;
  std::vector<int> moe_index(model.n_layers, -1);
  for (int64_t b = 0, i = 0; b < model.n_layers; ++b)
    if (model.is_moe_layer(b)) moe_index[b] = static_cast<int>(i++);
  const double mats = model.activation == "swiglu" ? 3 : 2;

  // Samples per (op name, rank): (flops or bytes, time); each becomes one point of its medians, so
  // a step the machine's other jobs slowed down does not pull the fit.
  std::map<std::pair<std::string, int>, std::vector<std::pair<double, double>>> flop_ops, byte_ops;
  // Collective instances: (step, name) -> shortest duration and largest bytes.
  std::map<std::pair<int64_t, std::string>, std::tuple<double, double, std::string>> colls;
  for (const json& e : trace.at("traceEvents")) {
    if (e.value("ph", "") != "X") continue;
    const json& a = e.at("args");
    const std::string name = e.at("name").get<std::string>(), kind = a.at("kind").get<std::string>();
    const double t = e.at("dur").get<double>() * 1e-6;
    const int64_t stp = a.at("step").get<int64_t>();
    const int rank = e.at("pid").get<int>();
    if (e.value("cat", "") == "compute") {
      auto it = compute_ops.find(name);
      if (it == compute_ops.end())
        return Status::error(str_cat("calibrate: the trace's op \"", name, "\" is not in the EP graph of the model given"));
      const graph::Op& op = *it->second;
      double flops = op.cost.flops, bytes = static_cast<double>(op.cost.bytes);
      if (op.kind == graph::OpKind::expert_fwd || op.kind == graph::OpKind::expert_bwd) {
        auto m = by_step.find(stp);
        if (m == by_step.end() || op.layer < 0 || moe_index[op.layer] < 0) continue;
        const double rows = m->second.at("tokens_per_rank").at(moe_index[op.layer]).at(rank).get<double>();
        flops = (op.kind == graph::OpKind::expert_fwd ? 1 : 2) * 2 * mats * rows * model.d_model * model.d_ffn;
      }
      (flops > 0 ? flop_ops : byte_ops)[{name, rank}].emplace_back(flops > 0 ? flops : bytes, t);
      continue;
    }
    const bool a2a = kind == "dispatch_a2a" || kind == "combine_a2a" || kind == "dispatch_a2a_bwd" || kind == "combine_a2a_bwd";
    if (!a2a && kind != "grad_allreduce") continue;
    auto& c = colls[{stp, name}];
    auto& [tmin, bmax, k] = c;
    if (k.empty()) tmin = t, bmax = 0;
    tmin = std::min(tmin, t);
    bmax = std::max(bmax, a.at("bytes").get<double>());
    k = kind;
  }
  auto medians = [](const auto& groups, std::vector<double>* x, std::vector<double>* y) {
    for (const auto& [key, samples] : groups) {
      std::vector<double> a, b;
      for (const auto& [xi, yi] : samples) a.push_back(xi), b.push_back(yi);
      std::sort(a.begin(), a.end());
      std::sort(b.begin(), b.end());
      x->push_back(a[a.size() / 2]);
      y->push_back(b[b.size() / 2]);
    }
  };
  std::vector<double> cf, ct, mb, mt;  // compute: flops, time; memory ops: bytes, time
  medians(flop_ops, &cf, &ct);
  medians(byte_ops, &mb, &mt);
  if (cf.size() < 2) return Status::error(str_cat("calibrate: ", trace_path, " has too few compute ops to fit"));
  res.compute = fit_line(cf, ct);
  res.memory_ops = fit_line(mb, mt);

  DeviceSpec d;
  d.name = "calibrated";
  d.launch_overhead = std::max(0.0, res.memory_ops.intercept);
  if (res.memory_ops.intercept < 0) res.notes.push_back("launch overhead fitted negative: 0");
  d.mem_bandwidth = res.memory_ops.slope > 0 ? 1 / res.memory_ops.slope : 1e15;
  if (!(res.memory_ops.slope > 0)) res.notes.push_back("memory-bound ops show no bandwidth limit: 1e15 B/s");
  if (!(res.compute.slope > 0)) return Status::error("calibrate: compute time does not grow with FLOPs in this run");
  d.peak_flops = 1 / res.compute.slope;
  d.max_efficiency = 1;
  d.half_efficiency_flops = std::max(0.0, (res.compute.intercept - d.launch_overhead) / res.compute.slope);
  if (res.compute.intercept < d.launch_overhead) res.notes.push_back("compute intercept below the launch overhead: half-efficiency 0");

  // One point per op name: medians over steps of the shortest member duration and of the bytes.
  std::map<std::string, std::tuple<std::vector<double>, std::vector<double>, std::string>> by_name;
  for (const auto& [key, c] : colls) {
    auto& [ts, bs, kind] = by_name[key.second];
    ts.push_back(std::get<0>(c));
    bs.push_back(std::get<1>(c));
    kind = std::get<2>(c);
  }
  std::vector<double> u, v, y;
  for (auto& [name, c] : by_name) {
    auto& [ts, bs, kind] = c;
    std::sort(ts.begin(), ts.end());
    std::sort(bs.begin(), bs.end());
    const double tmin = ts[ts.size() / 2], bmax = bs[bs.size() / 2];
    if (kind == "grad_allreduce") {
      u.push_back(2.0 * (P - 1));
      v.push_back(2.0 * (P - 1) / P * bmax);
    } else {
      u.push_back(1);
      v.push_back(bmax * (P - 1) / P);
    }
    y.push_back(tmin);
  }
  double alpha = 0, inv_bw = 0;
  if (y.size() < 2 || !solve2(u, v, y, &alpha, &inv_bw))
    return Status::error(str_cat("calibrate: ", trace_path, " has too few all-to-all / allreduce ops to fit"));
  res.comm_points = static_cast<int>(y.size());
  double ss = 0;
  for (size_t i = 0; i < y.size(); ++i) ss += std::pow(y[i] - alpha * u[i] - inv_bw * v[i], 2);
  res.comm_rms = std::sqrt(ss / y.size());
  if (alpha < 0) res.notes.push_back("alpha fitted negative: 0");
  if (!(inv_bw > 0)) res.notes.push_back("communication time does not grow with bytes: bandwidth 1e12 B/s");
  res.alpha = std::max(0.0, alpha);
  res.bandwidth = inv_bw > 0 ? 1 / inv_bw : 1e12;

  ClusterSpec& c = res.cluster;
  c.name = "calibrated";
  c.nodes = 1;
  NodeSpec& n = c.node;
  n.devices = std::max(P, 8);
  n.device = d;
  n.sockets = 1;
  n.switch_socket = {0};
  n.switch_uplink = {res.bandwidth, 0};
  n.device_switch.assign(n.devices, 0);
  n.device_pcie = {res.bandwidth, res.alpha / 2};
  if (Status s = c.validate(); !s) return Status::error(str_cat("calibrate: the fitted cluster is invalid: ", s.message()));
  *out = std::move(res);
  return Status::ok();
}

std::string describe(const CalibrationResult& r) {
  std::string s = str_cat("calibration of a ", r.ranks, "-rank run, batch ", r.batch, " sequences\n");
  s += str_cat("  compute ops (", r.compute.n, "):  t = ", r.compute.intercept * 1e6, " us + flops / ",
               1e-9 / r.compute.slope, " GFLOP/s   (rms ", r.compute.rms * 1e6, " us)\n");
  s += str_cat("  no-FLOP ops (", r.memory_ops.n, "):  t = ", r.memory_ops.intercept * 1e6, " us + bytes / ",
               r.memory_ops.slope > 0 ? 1e-9 / r.memory_ops.slope : 0.0, " GB/s   (rms ", r.memory_ops.rms * 1e6, " us)\n");
  s += str_cat("  collectives (", r.comm_points, "):  alpha ", r.alpha * 1e6, " us, bandwidth ", r.bandwidth * 1e-9,
               " GB/s   (rms ", r.comm_rms * 1e6, " us)\n");
  const DeviceSpec& d = r.cluster.node.device;
  s += str_cat("  device: peak ", d.peak_flops * 1e-9, " GFLOP/s, half efficiency at ", d.half_efficiency_flops * 1e-6,
               " MFLOP, launch ", d.launch_overhead * 1e6, " us, memory ", d.mem_bandwidth * 1e-9, " GB/s\n");
  for (const std::string& n : r.notes) s += "  note: " + n + "\n";
  return s;
}

Status write_cluster_file(const std::string& path, const ClusterSpec& spec) {
  return write_file_atomic(path, spec.to_json().dump(2) + "\n");
}

}  // namespace moe::sim
