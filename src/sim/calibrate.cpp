// Least-squares calibration of the device and link figures from a real run (calibrate.h).
#include "sim/calibrate.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <stdexcept>
#include <tuple>

#include <nlohmann/json.hpp>

#include "graph/ep_builder.h"
#include "model/safetensors.h"
#include "sim/compute.h"
#include "util/str_cat.h"

namespace moe::sim {

namespace {

using json = nlohmann::json;

// The value at size / 2 of the sorted values (the upper median): every median of this fit.
// REQUIRES: v non-empty.
double upper_median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

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

// Processor sharing of a CPU machine's cores among the compute ops of all ranks, as the executor
// models it (executor.h): over any interval where n compute ops run, each gets
// min(1, cores / (n * threads)) of its threads' speed alone. work(a, b) is the time alone that an op
// running over [a, b] received. cores == 0: no sharing (work = b - a).
class CoreShare {
 public:
  CoreShare(const std::vector<std::pair<double, double>>& spans, int cores, int threads) {
    if (cores <= 0) return;
    std::vector<std::pair<double, int>> edges;
    for (const auto& [a, b] : spans) edges.push_back({a, +1}), edges.push_back({b, -1});
    std::sort(edges.begin(), edges.end());
    int n = 0;
    for (const auto& [t, d] : edges) {
      n += d;
      const double demand = static_cast<double>(n) * threads;
      t_.push_back(t);
      share_.push_back(demand > cores ? cores / demand : 1.0);
    }
  }
  double work(double a, double b) const {
    if (t_.empty()) return b - a;
    // share_[i] holds over [t_[i], t_[i + 1]); before the first edge nothing runs.
    size_t i = std::upper_bound(t_.begin(), t_.end(), a) - t_.begin();
    double w = 0, t = a;
    double s = i == 0 ? 1.0 : share_[i - 1];
    for (; t < b; ++i) {
      const double next = i < t_.size() ? std::min(t_[i], b) : b;
      w += (next - t) * s;
      t = next;
      if (i < t_.size()) s = share_[i];
    }
    return w;
  }

 private:
  std::vector<double> t_, share_;
};

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

void fit_memory_ops(const std::vector<double>& bytes, const std::vector<double>& t, double* launch,
                    double* bandwidth, std::vector<std::string>* notes) {
  *launch = 0;
  *bandwidth = 1e15;
  if (bytes.empty()) {
    notes->push_back("no FLOP-less ops: launch 0, memory bandwidth 1e15 B/s");
    return;
  }
  const LinearFit f = fit_line(bytes, t);
  const double t_min = *std::min_element(t.begin(), t.end());
  if (f.slope > 0 && f.intercept >= 0 && f.intercept <= t_min) {
    *launch = f.intercept;
    *bandwidth = 1 / f.slope;
    return;
  }
  // No usable line (the ops are too alike in size, or differ in kind more than in bytes): no fixed
  // cost, and the bandwidth that reproduces their total time.
  const double sb = std::accumulate(bytes.begin(), bytes.end(), 0.0), st = std::accumulate(t.begin(), t.end(), 0.0);
  if (sb > 0 && st > 0) *bandwidth = sb / st;
  notes->push_back(str_cat("FLOP-less ops fit no line (t = ", f.intercept * 1e6, " us + bytes * ", f.slope * 1e9,
                           " ns/B): launch 0, bandwidth = their bytes / their time"));
}

double fit_compute_rate(const std::vector<double>& flops, const std::vector<double>& bytes, const std::vector<double>& t,
                        double launch, double mem_bandwidth) {
  // total(rate) = sum of launch + max(flops / rate, bytes / bandwidth): continuous and decreasing in
  // rate; bisect on log(rate) for total(rate) = sum of t.
  const double target = std::accumulate(t.begin(), t.end(), 0.0);
  auto total = [&](double rate) {
    double s = 0;
    for (size_t i = 0; i < flops.size(); ++i) s += launch + std::max(flops[i] / rate, bytes[i] / mem_bandwidth);
    return s;
  };
  double lo = 1, hi = 1e18;
  if (total(hi) >= target) return 0;  // memory and launch alone take longer than measured
  for (int it = 0; it < 200 && hi / lo > 1 + 1e-12; ++it) {
    const double mid = std::sqrt(lo * hi);
    (total(mid) > target ? lo : hi) = mid;
  }
  return std::sqrt(lo * hi);
}

double cpu_share(int ranks, int threads_per_rank, int cores) {
  if (ranks < 1 || threads_per_rank < 1 || cores < 1)
    throw std::logic_error("sim::cpu_share: ranks, threads per rank and cores must be >= 1");
  return std::max(1.0, static_cast<double>(ranks) * threads_per_rank / cores);
}

ClusterSpec shared_cores_cluster(const CalibrationResult& cal, int threads_per_rank, int cores) {
  ClusterSpec c = cal.cluster;
  c.cpu_cores = cores;
  c.cpu_threads_per_device = threads_per_rank;
  return c;
}

Status two_node_cluster(const CalibrationResult& cal, int ranks_per_node, LinkSpec nic, ClusterSpec* out) {
  if (ranks_per_node < 1) return Status::error("two_node_cluster: ranks per node must be >= 1");
  if (!(nic.bandwidth > 0) || !(nic.latency >= 0)) return Status::error("two_node_cluster: the NIC needs bandwidth > 0, latency >= 0");
  ClusterSpec c = cal.cluster;
  c.name = "calibrated-2-nodes";
  c.nodes = 2;
  NodeSpec& n = c.node;
  n.devices = ranks_per_node;
  n.device_switch.assign(ranks_per_node, 0);
  n.nic_switch = {0};
  n.nic_pcie = n.device_pcie;
  n.nic_pcie.latency = 0;  // the calibrated alpha is paid on the devices' links at either end
  n.nic_port = nic;
  c.fabric = FabricSpec{};
  // `moe cluster up` pins each emulated host to its own share of the CPUs when there is one per host.
  c.cpu_nodes_pinned = c.cpu_cores >= c.nodes;
  c.eager_bytes = 1 << 20;  // scripts/cluster.sh: btl_tcp_eager_limit
  if (Status s = c.validate(); !s) return Status::error(str_cat("two_node_cluster: ", s.message()));
  *out = std::move(c);
  return Status::ok();
}

Status calibrate(const std::string& run, const ModelConfig& model, CalibrationResult* out, CalibrationMachine machine) {
  return calibrate(std::vector<std::string>{run}, model, out, machine);
}

Status calibrate(const std::vector<std::string>& run_paths, const ModelConfig& model, CalibrationResult* out,
                 CalibrationMachine machine) {
  if (machine.cpu_cores < 0 || machine.threads_per_rank < 0)
    return Status::error(str_cat("calibrate: cpu cores (", machine.cpu_cores, ") and threads per rank (",
                                 machine.threads_per_rank, ") must be >= 0"));
  if (run_paths.empty()) return Status::error("calibrate: no run given");
  if (Status s = model.validate(); !s) return s;
  struct Run {
    std::string trace_path;
    std::vector<json> metrics;
    std::map<int64_t, json> by_step;
    json trace;
  };
  std::vector<Run> runs(run_paths.size());
  for (size_t ri = 0; ri < runs.size(); ++ri) {
    const std::string& run = run_paths[ri];
    Run& r = runs[ri];
    std::string metrics_path;
    if (const size_t comma = run.find(','); comma != std::string::npos) {
      metrics_path = run.substr(0, comma);
      r.trace_path = run.substr(comma + 1);
    } else {
      metrics_path = (std::filesystem::path(run) / "metrics.jsonl").string();
      r.trace_path = (std::filesystem::path(run) / "trace.json").string();
    }
    if (Status s = read_json_lines(metrics_path, &r.metrics); !s) return s;
    std::ifstream in(r.trace_path);
    if (!in) return Status::error(str_cat("calibrate: cannot read trace ", r.trace_path));
    try {
      in >> r.trace;
    } catch (const json::exception&) {
      return Status::error(str_cat("calibrate: ", r.trace_path, " is not JSON"));
    }
    if (!r.trace.is_object() || !r.trace.contains("traceEvents"))
      return Status::error(str_cat("calibrate: ", r.trace_path, " is not a Chrome trace of `moe train --trace`"));
    for (json& m : r.metrics) r.by_step[m.at("step").get<int64_t>()] = m;
  }
  const std::string& trace_path = runs[0].trace_path;
  const std::vector<json>& metrics = runs[0].metrics;

  CalibrationResult res;
  // Ranks and the global batch from the (first run's) metrics; every run must be of the same configuration.
  const json& first = metrics.front();
  const auto ranks_rows = first.at("tokens_per_rank").get<std::vector<std::vector<int64_t>>>();
  if (ranks_rows.empty()) return Status::error("calibrate: the metrics have no MoE layer");
  res.ranks = static_cast<int>(ranks_rows[0].size());
  res.runs = static_cast<int>(runs.size());
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
  for (size_t ri = 1; ri < runs.size(); ++ri) {
    const json& f = runs[ri].metrics.front();
    int64_t n = 0;
    for (int64_t c : f.at("tokens_per_expert").at(0).get<std::vector<int64_t>>()) n += c;
    if (f.at("tokens_per_rank").at(0).size() != static_cast<size_t>(P) || n != assignments)
      return Status::error(str_cat("calibrate: run ", run_paths[ri], " is not of the configuration of ", run_paths[0],
                                   " (ranks or batch differ): calibrate on runs of one configuration"));
  }
  // 0: the threads the run itself recorded (moe train writes "threads" in every step's metrics), or
  // for older runs the cores shared evenly, as moe train then sized them.
  if (machine.threads_per_rank == 0) {
    const json& f = metrics.front();
    machine.threads_per_rank = f.contains("threads") && f["threads"].is_number_integer()
                                   ? std::max(1, f["threads"].get<int>())
                                   : std::max(1, machine.cpu_cores / P);
  }
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

  // Samples per (op name, rank), over every step of every run: (flops or bytes, time alone); each
  // becomes one point of its medians, so a step the machine's other jobs slowed down does not pull the fit.
  // On a CPU machine whose cores the ranks' compute threads oversubscribed, an op's duration is its
  // time alone stretched by the sharing: the fit takes the time alone (CoreShare), as the executor
  // will stretch it again.
  std::map<std::pair<std::string, int>, std::vector<std::pair<double, double>>> flop_ops, byte_ops;
  // Compute spans by (run, rank), sorted: the sharing below, and which collectives overlapped compute.
  std::map<std::pair<size_t, int>, std::vector<std::pair<double, double>>> compute_spans;
  // Per (run, op name, rank), each step's time alone per FLOP (per byte for FLOP-less ops) after the
  // first step (its first-touch page faults are warm-up): how one op's time varies from step to step.
  std::map<std::tuple<size_t, std::string, int>, std::vector<std::pair<double, double>>> spread_samples;
  for (size_t ri = 0; ri < runs.size(); ++ri) {
    const Run& run = runs[ri];
    std::vector<std::pair<double, double>> all_compute;  // every rank's
    for (const json& e : run.trace.at("traceEvents")) {
      if (e.value("ph", "") != "X" || e.value("cat", "") != "compute") continue;
      const double ts = e.at("ts").get<double>() * 1e-6, te = ts + e.at("dur").get<double>() * 1e-6;
      all_compute.push_back({ts, te});
      compute_spans[{ri, e.at("pid").get<int>()}].push_back({ts, te});
    }
    const CoreShare core_share(all_compute, machine.cpu_cores, machine.threads_per_rank);
    for (const json& e : run.trace.at("traceEvents")) {
      if (e.value("ph", "") != "X" || e.value("cat", "") != "compute") continue;
      const json& a = e.at("args");
      const std::string name = e.at("name").get<std::string>();
      const double ts = e.at("ts").get<double>() * 1e-6;
      const double t = core_share.work(ts, ts + e.at("dur").get<double>() * 1e-6);
      const int64_t stp = a.at("step").get<int64_t>();
      const int rank = e.at("pid").get<int>();
      auto it = compute_ops.find(name);
      if (it == compute_ops.end())
        return Status::error(str_cat("calibrate: the trace's op \"", name, "\" is not in the EP graph of the model given"));
      const graph::Op& op = *it->second;
      double flops = op.cost.flops, bytes = static_cast<double>(op.cost.bytes);
      if (op.kind == graph::OpKind::expert_fwd || op.kind == graph::OpKind::expert_bwd) {
        auto m = run.by_step.find(stp);
        if (m == run.by_step.end() || op.layer < 0 || moe_index[op.layer] < 0) continue;
        const double rows = m->second.at("tokens_per_rank").at(moe_index[op.layer]).at(rank).get<double>();
        flops = (op.kind == graph::OpKind::expert_fwd ? 1 : 2) * 2 * mats * rows * model.d_model * model.d_ffn;
      }
      (flops > 0 ? flop_ops : byte_ops)[{name, rank}].emplace_back(flops > 0 ? flops : bytes, t);
      // An expert op that ran no rows has no rate per FLOP: left out rather than mixed in per byte.
      if (stp > 1 && (flops > 0 || op.cost.flops == 0))
        spread_samples[{ri, name, rank}].emplace_back(t, t / (flops > 0 ? flops : std::max(bytes, 1.0)));
    }
  }
  auto medians = [](const auto& groups, std::vector<double>* x, std::vector<double>* y) {
    for (const auto& [key, samples] : groups) {
      std::vector<double> a, b;
      for (const auto& [xi, yi] : samples) a.push_back(xi), b.push_back(yi);
      x->push_back(upper_median(std::move(a)));
      y->push_back(upper_median(std::move(b)));
    }
  };
  std::vector<double> cf, ct, cb, mb, mt;  // FLOP ops: flops, time, bytes; FLOP-less ops: bytes, time
  std::vector<std::string> ck;             // FLOP ops: kind
  for (const auto& [key, samples] : flop_ops) {
    std::vector<double> f, t;
    for (const auto& [fi, ti] : samples) f.push_back(fi), t.push_back(ti);
    cf.push_back(upper_median(std::move(f)));
    ct.push_back(upper_median(std::move(t)));
    const graph::Op& op = *compute_ops.at(key.first);
    cb.push_back(static_cast<double>(op.cost.bytes));
    ck.push_back(graph::op_kind_name(op.kind));
  }
  medians(byte_ops, &mb, &mt);
  if (cf.size() < 2) return Status::error(str_cat("calibrate: ", trace_path, " has too few compute ops to fit"));
  res.compute = fit_line(cf, ct);
  res.memory_ops = fit_line(mb, mt);
  double launch = 0, mem_bw = 0;
  fit_memory_ops(mb, mt, &launch, &mem_bw, &res.notes);
  double rate = fit_compute_rate(cf, cb, ct, launch, mem_bw);
  if (!(rate > 0)) {
    // The FLOP ops ran faster than the FLOP-less ops' launch and bandwidth allow (tiny ops).
    res.notes.push_back(str_cat("the FLOP ops took less than launch + bytes / ", mem_bw * 1e-9,
                                " GB/s: memory bandwidth 1e15 B/s"));
    mem_bw = 1e15;
    rate = fit_compute_rate(cf, cb, ct, launch, mem_bw);
  }
  if (!(rate > 0)) {
    res.notes.push_back(str_cat("the FLOP ops took less than the launch overhead ", launch * 1e6, " us: launch 0"));
    launch = 0;
    rate = fit_compute_rate(cf, cb, ct, launch, mem_bw);
  }
  if (!(rate > 0)) return Status::error("calibrate: the FLOP ops of this run took no time");
  DeviceSpec d;
  d.name = "calibrated";
  d.launch_overhead = launch;
  d.mem_bandwidth = mem_bw;
  d.peak_flops = rate;
  d.max_efficiency = 1;
  d.half_efficiency_flops = 0;
  {
    std::vector<std::vector<std::pair<double, double>>> groups;
    for (auto& [key, samples] : spread_samples) groups.push_back(std::move(samples));
    d.op_time_quantiles = op_time_spread(groups);
  }
  // Per kind, the rate at which that kind's ops sum to their measured time, as a factor on the rate.
  std::map<std::string, std::vector<size_t>> by_kind;
  for (size_t i = 0; i < ck.size(); ++i) by_kind[ck[i]].push_back(i);
  for (const auto& [kind, idx] : by_kind) {
    std::vector<double> f, b, t;
    for (size_t i : idx) f.push_back(cf[i]), b.push_back(cb[i]), t.push_back(ct[i]);
    const double kind_rate = fit_compute_rate(f, b, t, launch, mem_bw);
    if (kind_rate > 0)
      d.op_kind_speed[kind] = kind_rate / rate;
    else
      res.notes.push_back(str_cat(kind, " took less than launch + bytes / memory bandwidth: no speed of its own"));
  }
  {
    double ss = 0;
    for (size_t i = 0; i < cf.size(); ++i) ss += std::pow(ct[i] - op_time(d, cf[i], cb[i], kind_speed(d, ck[i])), 2);
    res.compute_model_rms = std::sqrt(ss / cf.size());
  }

  // Collectives: one point per op name, the medians over steps of the transfer time and of the bytes.
  // The transfer time of an instance: from the last member's arrival to the first member's end (no
  // member can end before everyone arrived; the first to end waited for nobody after that). Instances
  // during which any member's compute stream ran are left out when enough others remain: the runtime's
  // communication lanes poll on the cores that compute, so such a duration measures CPU contention, not
  // the link.
  struct Inst {
    double start = 0, end = 1e300;  // max member start, min member end (s)
    double bytes = 0;
    std::string kind;
    std::vector<std::pair<int, std::pair<double, double>>> members;  // rank, [start, end]
  };
  // Instances by (run, step, op name).
  std::map<std::tuple<size_t, int64_t, std::string>, Inst> insts;
  for (size_t ri = 0; ri < runs.size(); ++ri) {
    for (const json& e : runs[ri].trace.at("traceEvents")) {
      if (e.value("ph", "") != "X" || e.value("cat", "") == "compute") continue;
      const json& a = e.at("args");
      const double ts = e.at("ts").get<double>() * 1e-6, te = ts + e.at("dur").get<double>() * 1e-6;
      const int rank = e.at("pid").get<int>();
      const std::string kind = a.at("kind").get<std::string>();
      const bool a2a =
          kind == "dispatch_a2a" || kind == "combine_a2a" || kind == "dispatch_a2a_bwd" || kind == "combine_a2a_bwd";
      if (!a2a && kind != "grad_allreduce" && kind != "gate_sync") continue;
      Inst& in = insts[{ri, a.at("step").get<int64_t>(), e.at("name").get<std::string>()}];
      in.kind = kind;
      in.start = std::max(in.start, ts);
      in.end = std::min(in.end, te);
      // gate_sync records no bytes: the counts allgather's 8 K E bytes per member, as the simulator sizes it (load.h).
      in.bytes =
          kind == "gate_sync" ? 8.0 * model.top_k * model.n_experts : std::max(in.bytes, a.at("bytes").get<double>());
      in.members.push_back({rank, {ts, te}});
    }
  }
  for (auto& [r, spans] : compute_spans) std::sort(spans.begin(), spans.end());
  // Does a compute op of `rank` in run `ri` overlap (a, b)?
  auto busy = [&](size_t ri, int rank, double a, double b) {
    const auto& spans = compute_spans[{ri, rank}];
    auto it = std::lower_bound(spans.begin(), spans.end(), std::make_pair(b, b));
    while (it != spans.begin()) {
      --it;
      if (it->second > a) return true;
      if (it->first < a - 1.0) break;  // ops are far shorter than a second
    }
    return false;
  };
  std::map<std::string, std::tuple<std::vector<double>, std::vector<double>, std::string>> clean, all;
  for (const auto& [key, in] : insts) {
    if (static_cast<int>(in.members.size()) < 2) continue;
    const double t = std::max(0.0, in.end - in.start);
    bool contended = false;
    for (const auto& m : in.members)
      contended = contended || busy(std::get<0>(key), m.first, in.start, std::max(in.end, in.start));
    for (auto* dst : {&all, contended ? nullptr : &clean}) {
      if (!dst) continue;
      auto& [ts, bs, kind] = (*dst)[std::get<2>(key)];
      ts.push_back(t);
      bs.push_back(in.bytes);
      kind = in.kind;
    }
  }
  // A name's median needs a few instances: a name whose lanes are busy beside compute in all but one
  // step (a step's last gradient bucket, say) would otherwise enter the fit with that one instance,
  // and one stalled transfer (35 ms against 0.3, seen) turned a whole fit into alpha 3 ms and no slope.
  constexpr size_t kMinCleanInstances = 3;
  auto points = [&](const auto& by_name, size_t min_instances, std::vector<double>* u, std::vector<double>* v,
                    std::vector<double>* y) {
    for (auto& [name, c] : by_name) {
      const auto& [ts, bs, kind] = c;
      if (ts.size() < min_instances) continue;
      const double t = upper_median(ts), bytes = upper_median(bs);
      if (kind == "grad_allreduce") {
        u->push_back(2.0 * (P - 1));
        v->push_back(2.0 * (P - 1) / P * bytes);
      } else if (kind == "gate_sync") {  // ring allgather: P - 1 steps, each member's bytes per step
        u->push_back(P - 1.0);
        v->push_back((P - 1.0) * bytes);
      } else {
        u->push_back(1);
        v->push_back(bytes * (P - 1) / P);
      }
      y->push_back(t);
    }
  };
  std::vector<double> u, v, y;
  points(clean, kMinCleanInstances, &u, &v, &y);
  double alpha = 0, inv_bw = 0;
  if (y.size() < 3 || !solve2(u, v, y, &alpha, &inv_bw)) {
    res.notes.push_back(str_cat("only ", y.size(), " collective(s) ran with every member's cores free of compute in ",
                                kMinCleanInstances, " or more steps: fitted on all"));
    u.clear(), v.clear(), y.clear();
    points(all, 1, &u, &v, &y);
    if (y.size() < 2 || !solve2(u, v, y, &alpha, &inv_bw))
      return Status::error(str_cat("calibrate: ", trace_path, " has too few all-to-all / allreduce ops to fit"));
  }
  res.comm_points = static_cast<int>(y.size());
  res.comm_contended = static_cast<int>(all.size()) - res.comm_points;
  double ss = 0;
  for (size_t i = 0; i < y.size(); ++i) ss += std::pow(y[i] - alpha * u[i] - inv_bw * v[i], 2);
  res.comm_rms = std::sqrt(ss / y.size());
  if (alpha < 0) res.notes.push_back("alpha fitted negative: 0");
  if (!(inv_bw > 0)) res.notes.push_back("communication time does not grow with bytes: bandwidth 1e12 B/s");
  res.alpha = std::max(0.0, alpha);
  res.bandwidth = inv_bw > 0 ? 1 / inv_bw : 1e12;
  // The fitted transfers ran with no compute on their members, every rank's lane polling: on a CPU
  // machine of fewer cores than ranks each lane had cores / ranks of a core (executor.h), so the
  // links' own bandwidth is that much higher.
  if (machine.cpu_cores > 0 && P > machine.cpu_cores) {
    res.bandwidth *= static_cast<double>(P) / machine.cpu_cores;
    res.notes.push_back(str_cat("the transfers ran with ", P, " lanes on ", machine.cpu_cores,
                                " cores: bandwidth scaled by ", static_cast<double>(P) / machine.cpu_cores));
  }
  res.cores_share = machine.cpu_cores > 0 ? cpu_share(P, machine.threads_per_rank, machine.cpu_cores) : 1;

  ClusterSpec& c = res.cluster;
  c.cpu_cores = machine.cpu_cores;
  c.cpu_threads_per_device = machine.threads_per_rank;
  c.name = "calibrated";
  c.nodes = 1;
  NodeSpec& n = c.node;
  n.devices = std::max(P, kCalibratedNodeDevices);
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

std::vector<double> op_time_spread(const std::vector<std::vector<std::pair<double, double>>>& groups) {
  std::vector<double> rel;
  for (const std::vector<std::pair<double, double>>& samples : groups) {
    if (samples.size() < 3) continue;
    std::vector<double> t, per;
    for (const auto& [ti, pi] : samples) t.push_back(ti), per.push_back(pi);
    const double m = upper_median(per);
    if (upper_median(std::move(t)) < kSpreadMinSeconds || !(m > 0)) continue;
    for (const auto& [ti, pi] : samples) rel.push_back(pi / m);
  }
  if (rel.size() < static_cast<size_t>(kSpreadQuantiles)) return {};
  std::sort(rel.begin(), rel.end());
  std::vector<double> q(kSpreadQuantiles);
  for (int i = 0; i < kSpreadQuantiles; ++i)
    q[i] = rel[std::min(rel.size() - 1, static_cast<size_t>((i + 0.5) / kSpreadQuantiles * rel.size()))];
  return q;
}

std::string describe(const CalibrationResult& r) {
  std::string s = r.runs == 1 ? str_cat("calibration of a ", r.ranks, "-rank run, batch ", r.batch, " sequences\n")
                              : str_cat("calibration of ", r.runs, " runs of ", r.ranks, " ranks, batch ", r.batch,
                                        " sequences\n");
  s += str_cat("  compute ops (", r.compute.n, "):  least squares t = ", r.compute.intercept * 1e6, " us + flops / ",
               1e-9 / r.compute.slope, " GFLOP/s (rms ", r.compute.rms * 1e6, " us; not used: see calibrate.h)\n");
  s += str_cat("  no-FLOP ops (", r.memory_ops.n, "):  least squares t = ", r.memory_ops.intercept * 1e6, " us + bytes / ",
               r.memory_ops.slope > 0 ? 1e-9 / r.memory_ops.slope : 0.0, " GB/s   (rms ", r.memory_ops.rms * 1e6, " us)\n");
  s += str_cat("  collectives (", r.comm_points, ", ", r.comm_contended, " left out: overlapped compute):  alpha ",
               r.alpha * 1e6, " us, bandwidth ", r.bandwidth * 1e-9, " GB/s   (rms ", r.comm_rms * 1e6, " us)\n");
  const DeviceSpec& d = r.cluster.node.device;
  s += str_cat("  device: rate ", d.peak_flops * 1e-9, " GFLOP/s (keeps the ops' total time), launch ",
               d.launch_overhead * 1e6, " us, memory ", d.mem_bandwidth * 1e-9, " GB/s\n");
  if (!d.op_kind_speed.empty()) {
    s += "  per op kind, GFLOP/s (each keeps its ops' total time):";
    for (const auto& [kind, speed] : d.op_kind_speed) s += str_cat(" ", kind, " ", d.peak_flops * speed * 1e-9);
    s += str_cat("  (rms ", r.compute_model_rms * 1e6, " us per op)\n");
  } else {
    s += str_cat("  (rms ", r.compute_model_rms * 1e6, " us per op)\n");
  }
  if (!d.op_time_quantiles.empty())
    s += str_cat("  an op's time over its median from step to step: 10th percentile ", op_time_factor(d, 0.1),
                 ", 90th ", op_time_factor(d, 0.9), "\n");
  if (r.cluster.cpu_cores > 0)
    s += str_cat("  CPU ranks: ", r.cluster.cpu_threads_per_device, " compute thread(s) each on ", r.cluster.cpu_cores,
                 " shared cores (the run's oversubscription ", r.cores_share, "; op times reduced to time alone)\n");
  for (const std::string& n : r.notes) s += "  note: " + n + "\n";
  return s;
}

Status write_cluster_file(const std::string& path, const ClusterSpec& spec) {
  return write_file_atomic(path, spec.to_json().dump(2) + "\n");
}

}  // namespace moe::sim
