// The calibration's fits (src/sim/calibrate.h) on synthetic runs with known figures: the FLOP-less
// ops' line and its fallback, the FLOP rate that keeps the ops' total time, the collective fit that
// leaves out instances overlapping compute, and the clusters derived for other configurations
// (oversubscribed cores, two nodes).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "graph/ep_builder.h"
#include "sim/calibrate.h"
#include "sim/cluster.h"
#include "sim/compute.h"

namespace {

namespace fs = std::filesystem;
using moe::sim::CalibrationResult;
using moe::sim::ClusterSpec;

TEST(SimCalibrate, MemoryOpsLineAndItsFallback) {
  std::vector<std::string> notes;
  double launch = -1, bw = -1;
  // An exact line: launch 10 us, 2 GB/s.
  moe::sim::fit_memory_ops({1e6, 2e6, 4e6}, {10e-6 + 0.5e-3, 10e-6 + 1e-3, 10e-6 + 2e-3}, &launch, &bw, &notes);
  EXPECT_NEAR(launch, 10e-6, 1e-12);
  EXPECT_NEAR(bw, 2e9, 1e-3 * 2e9);
  EXPECT_TRUE(notes.empty());
  // Time falling with bytes (ops of different kinds): no line; launch 0, bytes over time.
  moe::sim::fit_memory_ops({1e6, 1e6, 2e6, 2e6}, {300e-6, 300e-6, 100e-6, 100e-6}, &launch, &bw, &notes);
  EXPECT_EQ(launch, 0);
  EXPECT_NEAR(bw, 6e6 / 800e-6, 1);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].find("fit no line"), std::string::npos) << notes[0];
  // An intercept above the fastest op is not a launch overhead either.
  notes.clear();
  moe::sim::fit_memory_ops({1e6, 1.1e6, 1.2e6}, {1e-3, 1.1e-3, 1.3e-3}, &launch, &bw, &notes);
  EXPECT_GE(launch, 0);
  EXPECT_LE(launch, 1e-3);
  // None: defaults.
  notes.clear();
  moe::sim::fit_memory_ops({}, {}, &launch, &bw, &notes);
  EXPECT_EQ(launch, 0);
  EXPECT_EQ(bw, 1e15);
  EXPECT_EQ(notes.size(), 1u);
}

TEST(SimCalibrate, ComputeRateKeepsTheTotalTime) {
  // Two kinds at 30 and 90 GFLOP/s: the rate reproduces the sum, whatever the mix.
  const std::vector<double> flops = {2e8, 2e8, 5e8, 5e8}, bytes = {1e6, 1e6, 2e6, 2e6};
  const std::vector<double> t = {2e8 / 30e9, 2e8 / 30e9, 5e8 / 90e9, 5e8 / 90e9};
  const double launch = 5e-6, bw = 1e12;
  std::vector<double> tl = t;
  for (double& x : tl) x += launch;
  const double r = moe::sim::fit_compute_rate(flops, bytes, tl, launch, bw);
  EXPECT_NEAR(r, 14e8 / std::accumulate(t.begin(), t.end(), 0.0), 1e-6 * r);
  moe::sim::DeviceSpec d{"x", r, bw, launch, 1, 0, {}, {}};
  double sum = 0;
  for (size_t i = 0; i < flops.size(); ++i) sum += moe::sim::op_time(d, flops[i], bytes[i]);
  EXPECT_NEAR(sum, std::accumulate(tl.begin(), tl.end(), 0.0), 1e-9);
  // A memory-bound op counts at its memory time: the rate comes from the others.
  const double r2 = moe::sim::fit_compute_rate({1e9, 1e3}, {0, 1e6}, {1e9 / 50e9, 1e6 / 1e9}, 0, 1e9);
  EXPECT_NEAR(r2, 50e9, 1e-6 * 50e9);
  // Launch and memory alone exceed the measured time: 0.
  EXPECT_EQ(moe::sim::fit_compute_rate({1e9}, {1e9}, {1e-3}, 0, 1e9), 0);
}

TEST(SimCalibrate, CpuShare) {
  EXPECT_EQ(moe::sim::cpu_share(2, 1, 2), 1);
  EXPECT_EQ(moe::sim::cpu_share(4, 1, 2), 2);
  EXPECT_EQ(moe::sim::cpu_share(3, 2, 4), 1.5);
  EXPECT_EQ(moe::sim::cpu_share(1, 1, 16), 1);
  EXPECT_THROW(moe::sim::cpu_share(0, 1, 2), std::logic_error);
  EXPECT_THROW(moe::sim::cpu_share(1, 1, 0), std::logic_error);
}

CalibrationResult synthetic_result() {
  CalibrationResult cal;
  ClusterSpec& c = cal.cluster;
  c.name = "calibrated";
  c.node.devices = 8;
  c.node.device = {"calibrated", 50e9, 20e9, 1e-5, 1, 0, {}, {}};
  c.node.switch_socket = {0};
  c.node.switch_uplink = {4e9, 0};
  c.node.device_switch.assign(8, 0);
  c.node.device_pcie = {4e9, 10e-6};
  cal.alpha = 20e-6;
  cal.bandwidth = 4e9;
  return cal;
}

TEST(SimCalibrate, SharedCoresClusterRecordsTheMachine) {
  const CalibrationResult cal = synthetic_result();
  // The executor shares the cores (compute) and gives the lanes what compute leaves (links): the
  // cluster records cores and threads, its device and links are the calibrated ones.
  const ClusterSpec c = moe::sim::shared_cores_cluster(cal, 1, 2);
  EXPECT_EQ(c.cpu_cores, 2);
  EXPECT_EQ(c.cpu_threads_per_device, 1);
  EXPECT_EQ(c.node, cal.cluster.node);
  EXPECT_TRUE(c.validate());
}

TEST(SimCalibrate, TwoNodesJoinedAtTheNicsCap) {
  const CalibrationResult cal = synthetic_result();
  ClusterSpec c;
  ASSERT_TRUE(moe::sim::two_node_cluster(cal, 1, {119.6e6, 0}, &c));
  EXPECT_EQ(c.nodes, 2);
  EXPECT_EQ(c.node.devices, 1);
  EXPECT_EQ(c.node.device, cal.cluster.node.device);
  const moe::sim::Cluster cluster(c);
  const std::vector<int> path = cluster.route(0, 1);
  EXPECT_DOUBLE_EQ(cluster.path_bandwidth(path), 119.6e6);
  EXPECT_NEAR(cluster.path_latency(path), cal.alpha, 1e-15);  // alpha / 2 at either end, nothing added
  EXPECT_EQ(c.eager_bytes, 1 << 20);  // the emulated cluster's MPI sends up to 1 MiB eagerly
  // Two ranks per node: intra-node pairs keep the calibrated link.
  ASSERT_TRUE(moe::sim::two_node_cluster(cal, 2, {1e9, 5e-6}, &c));
  const moe::sim::Cluster c2(c);
  EXPECT_DOUBLE_EQ(c2.path_bandwidth(c2.route(0, 1)), 4e9);
  EXPECT_NEAR(c2.path_latency(c2.route(0, 2)), cal.alpha + 2 * 5e-6, 1e-15);
  EXPECT_FALSE(moe::sim::two_node_cluster(cal, 0, {1e9, 0}, &c));
  EXPECT_FALSE(moe::sim::two_node_cluster(cal, 1, {0, 0}, &c));
  // Accelerators: no cores to pin. CPU ranks: each node on its own half of the machine's cores, as
  // `moe cluster up` pins its hosts; with one core both share it.
  EXPECT_FALSE(c.cpu_nodes_pinned);
  CalibrationResult cpu = synthetic_result();
  cpu.cluster.cpu_cores = 2;
  ASSERT_TRUE(moe::sim::two_node_cluster(cpu, 2, {1e9, 0}, &c));
  EXPECT_TRUE(c.cpu_nodes_pinned);
  cpu.cluster.cpu_cores = 1;
  ASSERT_TRUE(moe::sim::two_node_cluster(cpu, 2, {1e9, 0}, &c));
  EXPECT_FALSE(c.cpu_nodes_pinned);
}

// The spread of op times: each group's samples over its median time per unit of work; groups of
// fewer than 3 samples or a median under 1 ms left out. Four groups whose time per unit runs at 0.5,
// 1, 1, 1, 2 of their medians (one at a larger size, whose time per unit is what varies) give the
// 20 quantiles four 0.5s, twelve 1s, four 2s; a short op that varies 3x and a pair change nothing.
TEST(SimCalibrate, OpTimeSpreadIsEachOpsTimeOverItsMedian) {
  std::vector<std::vector<std::pair<double, double>>> groups;
  for (double ms : {2.0, 3.0, 10.0, 40.0}) {
    std::vector<std::pair<double, double>> g;
    for (double f : {1.0, 0.5, 2.0, 1.0, 1.0}) g.emplace_back(ms * f * 1e-3, f * ms / 1e9);
    groups.push_back(g);
  }
  groups.push_back({{0.5e-3, 1}, {1.5e-3, 3}, {0.5e-3, 1}});  // median 0.5 ms: left out
  groups.push_back({{5e-3, 1}, {50e-3, 10}});                // 2 samples: left out
  std::vector<double> want(20, 1.0);
  for (int i = 0; i < 4; ++i) want[i] = 0.5, want[16 + i] = 2.0;
  EXPECT_EQ(moe::sim::op_time_spread(groups), want);
  groups.resize(3);  // 15 samples: too few for 20 quantiles
  EXPECT_TRUE(moe::sim::op_time_spread(groups).empty());
}

// A synthetic 2-rank run of a small model whose op times follow known figures: compute ops at one
// rate (launch + max(flops / rate, bytes / bw)), FLOP-less ops on a line, collectives on alpha + x / B;
// the gradient allreduces run during compute and take 5x their transfer time (contention).
class SyntheticRun : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("moe_sim_calibrate_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    model_.seq_len = 8;
    model_.d_model = 16;
    model_.n_layers = 2;
    model_.n_heads = 2;
    model_.d_ffn = 32;
    model_.n_experts = 4;
    model_.top_k = 2;
  }
  void TearDown() override { fs::remove_all(dir_); }

  // one_core: the two ranks' compute threads shared one core, so ops that ran at once took longer
  // than alone (processor sharing: both at half speed until the shorter ended).
  // attn_speed: attention ops (attn_fwd, attn_bwd) run at that factor of kRate.
  // stalled_tail: the last step's trailing allreduces run with no compute beside them, stalled 35 ms
  // (their names' one instance free of compute).
  void write_run(bool one_core = false, double attn_speed = 1, bool stalled_tail = false) {
    const int P = 2, steps = 3;
    const int64_t batch = 4, N = batch / P * model_.seq_len;
    moe::graph::EpStepOptions opt;
    opt.world = P;
    opt.ep_size = P;
    opt.batch = batch / P;
    const moe::graph::EpStep step = moe::graph::build_ep_step(model_, opt);
    nlohmann::json events = nlohmann::json::array();
    std::ofstream metrics(dir_ / "metrics.jsonl");
    for (int s = 1; s <= steps; ++s) {
      // Rows per rank per MoE layer: uneven, varying by step; the experts' counts sum to B T K.
      std::vector<std::vector<int64_t>> per_rank, per_expert;
      for (int64_t l = 0; l < model_.n_layers; ++l) {
        const int64_t total = N * P * model_.top_k, r0 = total / 2 + 4 * (s + l);
        per_rank.push_back({r0, total - r0});
        per_expert.push_back({r0 / 2, r0 - r0 / 2, (total - r0) / 2, total - r0 - (total - r0) / 2});
      }
      metrics << nlohmann::json{{"step", s}, {"tokens_per_rank", per_rank}, {"tokens_per_expert", per_expert}}.dump()
              << "\n";
      double t0 = s * 1.0;  // each step in its own second
      for (const moe::graph::Op& op : step.graph.ops) {
        const std::string kind = moe::graph::op_kind_name(op.kind), name = step.graph.op_name(op);
        if (!moe::graph::is_communication(op.kind)) {
          double alone[P];
          for (int r = 0; r < P; ++r) {
            double flops = op.cost.flops;
            if (op.kind == moe::graph::OpKind::expert_fwd || op.kind == moe::graph::OpKind::expert_bwd)
              flops = (op.kind == moe::graph::OpKind::expert_fwd ? 1 : 2) * 2 * 2 * double(per_rank[op.layer][r]) *
                      model_.d_model * model_.d_ffn;
            const double bytes = double(op.cost.bytes);
            const bool attention = op.kind == moe::graph::OpKind::attn_fwd || op.kind == moe::graph::OpKind::attn_bwd;
            const double rate = kRate * (attention ? attn_speed : 1);
            alone[r] = kLaunch + (flops > 0 ? std::max(flops / rate, bytes / kMemBw) : bytes / kMemBw);
          }
          for (int r = 0; r < P; ++r) {
            const double shorter = std::min(alone[0], alone[1]);
            const double t = one_core ? (alone[r] == shorter ? 2 * shorter : shorter + alone[r]) : alone[r];
            events.push_back(event(r, 0, t0, t, name, "compute", kind, s, op.cost.bytes));
          }
          // The allreduces queued so far run during this op, slowed by it.
          for (auto& [ar_name, ar_bytes] : pending_)
            for (int r = 0; r < P; ++r)
              events.push_back(event(r, 2, t0, 5 * allreduce_time(ar_bytes, P), ar_name, "communication",
                                     "grad_allreduce", s, ar_bytes));
          pending_.clear();
          t0 += 2e-3;
          continue;
        }
        if (op.kind == moe::graph::OpKind::grad_allreduce) {
          pending_.push_back({name, op.cost.bytes});
          if (s == 1) ++allreduce_names_;
          continue;
        }
        // Token exchanges and gate_sync: both members from t0, transfer time by the figures; the
        // exchange bytes differ per op so that the fit sees a slope.
        int64_t bytes = 0;
        double t = 0;
        if (op.kind == moe::graph::OpKind::gate_sync) {
          t = (P - 1) * kAlpha + (P - 1) * 8.0 * model_.top_k * model_.n_experts / kLinkBw;
        } else {
          bytes = 4096 * (1 + op.id % 7);
          t = kAlpha + bytes * (P - 1.0) / P / kLinkBw;
        }
        for (int r = 0; r < P; ++r) events.push_back(event(r, 1, t0, t + 1e-4 * r, name, "communication", kind, s, bytes));
        t0 += 2e-3;
      }
    }
    if (stalled_tail) {
      ASSERT_FALSE(pending_.empty());
      for (auto& [ar_name, ar_bytes] : pending_)
        for (int r = 0; r < P; ++r)
          events.push_back(event(r, 2, steps + 0.9, 35e-3, ar_name, "communication", "grad_allreduce", steps, ar_bytes));
    }
    std::ofstream(dir_ / "trace.json") << nlohmann::json{{"traceEvents", events}}.dump();
  }

  static double allreduce_time(int64_t bytes, int P) {
    return 2 * (P - 1) * kAlpha + 2.0 * (P - 1) / P * bytes / kLinkBw;
  }
  static nlohmann::json event(int pid, int tid, double ts, double dur, const std::string& name, const char* cat,
                              const std::string& kind, int step, int64_t bytes) {
    return {{"ph", "X"}, {"pid", pid}, {"tid", tid}, {"ts", ts * 1e6}, {"dur", dur * 1e6}, {"name", name}, {"cat", cat},
            {"args", {{"kind", kind}, {"step", step}, {"bytes", bytes}}}};
  }

  static constexpr double kRate = 40e9, kMemBw = 8e9, kLaunch = 20e-6, kAlpha = 30e-6, kLinkBw = 3e9;
  fs::path dir_;
  moe::ModelConfig model_;
  std::vector<std::pair<std::string, int64_t>> pending_;
  int allreduce_names_ = 0;
};

TEST_F(SyntheticRun, RecoversTheFiguresAndLeavesOutContendedCollectives) {
  write_run();
  CalibrationResult cal;
  const moe::Status s = moe::sim::calibrate(dir_.string(), model_, &cal);
  ASSERT_TRUE(s) << s.message();
  EXPECT_EQ(cal.ranks, 2);
  EXPECT_EQ(cal.batch, 4);
  const moe::sim::DeviceSpec& d = cal.cluster.node.device;
  EXPECT_NEAR(d.launch_overhead, kLaunch, 1e-9);
  EXPECT_NEAR(d.mem_bandwidth, kMemBw, 1e-3 * kMemBw);
  EXPECT_NEAR(d.peak_flops, kRate, 1e-3 * kRate);
  EXPECT_EQ(d.half_efficiency_flops, 0);
  EXPECT_LT(cal.compute_model_rms, 1e-8);
  // The allreduces overlapped compute: left out; the rest gives the link exactly (the first member
  // to end ended alpha + x / B after the last arrived).
  ASSERT_GE(allreduce_names_, 3);
  EXPECT_EQ(cal.comm_contended, allreduce_names_);
  EXPECT_NEAR(cal.alpha, kAlpha, 1e-9);
  EXPECT_NEAR(cal.bandwidth, kLinkBw, 1e-3 * kLinkBw);
  EXPECT_LT(cal.comm_rms, 1e-9);
  EXPECT_EQ(cal.cluster.node.device_pcie.bandwidth, cal.bandwidth);
  EXPECT_NEAR(cal.cluster.node.device_pcie.latency, kAlpha / 2, 1e-12);
  EXPECT_TRUE(cal.cluster.validate());
  EXPECT_NE(moe::sim::describe(cal).find("left out: overlapped compute"), std::string::npos);
}

// A name free of compute in only one step enters no fit: here that instance stalled 35 ms (as a
// transfer between two local ranks once did), which as a point of its own skewed the whole line.
TEST_F(SyntheticRun, AStalledTransferFreeOfComputeOnceDoesNotSkewTheLink) {
  write_run(/*one_core=*/false, /*attn_speed=*/1, /*stalled_tail=*/true);
  CalibrationResult cal;
  const moe::Status s = moe::sim::calibrate(dir_.string(), model_, &cal);
  ASSERT_TRUE(s) << s.message();
  EXPECT_EQ(cal.comm_contended, allreduce_names_);
  EXPECT_NEAR(cal.alpha, kAlpha, 1e-9);
  EXPECT_NEAR(cal.bandwidth, kLinkBw, 1e-3 * kLinkBw);
}

// Attention at a quarter of the other kinds' rate: each kind gets its own speed and the op times come
// out exactly. A kind is pinned down where its ops are compute-bound: attention (at a quarter) and
// head_bwd; in this tiny model the expert ops are memory-bound, which any rate above the lowest that
// keeps them so fits (fit_compute_rate then gives that lowest).
TEST_F(SyntheticRun, EachOpKindGetsItsOwnRate) {
  write_run(/*one_core=*/false, /*attn_speed=*/0.25);
  CalibrationResult cal;
  const moe::Status s = moe::sim::calibrate(dir_.string(), model_, &cal);
  ASSERT_TRUE(s) << s.message();
  const moe::sim::DeviceSpec& d = cal.cluster.node.device;
  EXPECT_LT(d.peak_flops, kRate);  // one rate for all: between the kinds'
  EXPECT_GT(d.peak_flops, kRate / 4);
  for (const char* kind : {"attn_fwd", "attn_bwd"}) EXPECT_NEAR(d.peak_flops * kind_speed(d, kind), kRate / 4, 1e-6 * kRate);
  EXPECT_NEAR(d.peak_flops * kind_speed(d, "head_bwd"), kRate, 1e-6 * kRate);
  for (const char* kind : {"expert_fwd", "expert_bwd", "head_fwd"}) EXPECT_TRUE(d.op_kind_speed.count(kind)) << kind;
  EXPECT_LT(cal.compute_model_rms, 1e-8);  // every op's time, with its kind's speed
  EXPECT_TRUE(cal.cluster.validate());
  EXPECT_NE(moe::sim::describe(cal).find("per op kind"), std::string::npos) << moe::sim::describe(cal);
}

// The same run on one core shared by both ranks: reduced to the time alone, the same device; the
// cluster records the machine.
TEST_F(SyntheticRun, OneSharedCoreGivesTheSameDevice) {
  write_run(/*one_core=*/true);
  CalibrationResult shared, ignored;
  ASSERT_TRUE(moe::sim::calibrate(dir_.string(), model_, &shared, {1, 1}));
  ASSERT_TRUE(moe::sim::calibrate(dir_.string(), model_, &ignored));
  const moe::sim::DeviceSpec& d = shared.cluster.node.device;
  EXPECT_NEAR(d.launch_overhead, kLaunch, 1e-9);
  EXPECT_NEAR(d.mem_bandwidth, kMemBw, 1e-3 * kMemBw);
  EXPECT_NEAR(d.peak_flops, kRate, 1e-3 * kRate);
  EXPECT_LT(shared.compute_model_rms, 1e-8);
  EXPECT_EQ(shared.cluster.cpu_cores, 1);
  EXPECT_EQ(shared.cluster.cpu_threads_per_device, 1);
  EXPECT_EQ(shared.cores_share, 2);
  EXPECT_NE(moe::sim::describe(shared).find("1 shared cores"), std::string::npos);
  // Taken as measured, the stretched times give a device slower by about the sharing.
  EXPECT_LT(ignored.cluster.node.device.peak_flops, 0.75 * kRate);
  EXPECT_EQ(ignored.cluster.cpu_cores, 0);
  // threads 0: as moe train resolves it (cores / ranks, at least 1).
  CalibrationResult resolved;
  ASSERT_TRUE(moe::sim::calibrate(dir_.string(), model_, &resolved, {4, 0}));
  EXPECT_EQ(resolved.cluster.cpu_threads_per_device, 2);
  EXPECT_FALSE(moe::sim::calibrate(dir_.string(), model_, &resolved, {-1, 1}));
}

// Several runs of one configuration fit together: identical runs give the figures of one; a run of
// another configuration is an error naming it.
TEST_F(SyntheticRun, SeveralRunsOfOneConfigurationFitTogether) {
  write_run();
  const fs::path second = dir_ / "second";
  fs::create_directories(second);
  fs::copy_file(dir_ / "metrics.jsonl", second / "metrics.jsonl");
  fs::copy_file(dir_ / "trace.json", second / "trace.json");
  CalibrationResult one, two;
  ASSERT_TRUE(moe::sim::calibrate(dir_.string(), model_, &one));
  const moe::Status s = moe::sim::calibrate(std::vector<std::string>{dir_.string(), second.string()}, model_, &two);
  ASSERT_TRUE(s) << s.message();
  EXPECT_EQ(two.runs, 2);
  EXPECT_EQ(two.cluster, one.cluster);
  EXPECT_NE(moe::sim::describe(two).find("calibration of 2 runs"), std::string::npos);
  // The second run with another batch: an error naming it.
  {
    std::ifstream in(dir_ / "metrics.jsonl");
    std::ofstream out(second / "metrics.jsonl");
    std::string line;
    while (std::getline(in, line)) {
      nlohmann::json j = nlohmann::json::parse(line);
      j["tokens_per_expert"][0][0] = j["tokens_per_expert"][0][0].get<int64_t>() + 8;
      out << j.dump() << "\n";
    }
  }
  const moe::Status bad = moe::sim::calibrate(std::vector<std::string>{dir_.string(), second.string()}, model_, &two);
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.message().find(second.string()), std::string::npos) << bad.message();
  EXPECT_FALSE(moe::sim::calibrate(std::vector<std::string>{}, model_, &two));
}

}  // namespace
