// moe bench transfer-cpu (under mpirun, one rank per host): how much of a host's cores one transfer
// between hosts takes from the compute beside it.
//
// On CPU ranks the kernel's TCP path (and an emulated NIC's shaping) runs on the cores the compute
// runs on, beside it (docs/sim.md, "Transfers between hosts are CPU work"). The simulator's executor
// counts a lane moving data between hosts as ClusterSpec::cpu_threads_per_transfer compute threads;
// this measures that figure instead of assuming it. Each round, on every rank:
//   compute alone    a thread runs the expert GEMM (default model's shape) back to back: rate_alone
//   exchange alone   the main thread runs alltoallv rounds of kBlockBytes per peer through moe's
//                    communicator (waiting as the runtime's lanes do): t_alone
//   both             the same exchange while the compute thread runs: t_both, and the GEMMs the thread
//                    finished between the exchange's start and end: rate_during
// share = rate_during / rate_alone is what processor sharing gives one compute thread beside w
// transfer threads, 1 / (1 + w), so w = 1 / share - 1 (0 where share >= 1). The ranks' w are averaged
// (they plan one cluster). t_both / t_alone is how much slower the transfer runs beside the compute
// (ClusterSpec::cpu_transfer_slowdown). The bytes a rank sends to other ranks over t_alone (mean over
// ranks) is the rate an exchange alone reaches: below the NIC's cap where the kernel's TCP work on
// these cores, not the cap, bounds it (the emulated 10 Gbit/s NIC). The table shows every round and
// the medians, which `moe bench cluster-strategies` and `sim-fidelity` read (--json) for their
// simulator's cluster.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <thread>
#include <vector>

#include "bench/bench.h"
#include "bench/mpi_bench.h"
#include "bench/report.h"
#include "comm/communicator.h"
#include "comm/mpi_communicator.h"
#include "model/config.h"
#include "tensor/ops.h"
#include "util/str_cat.h"

namespace moe::bench {
namespace {

using Clock = std::chrono::steady_clock;
double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

constexpr int64_t kBlockBytes = 1 << 20;  // per peer per alltoallv: the order of a step's exchanges
constexpr double kPhaseSeconds = 0.6;     // each phase alone takes about this long

// One GEMM of the default model's expert shape: rows x d_model -> d_ffn.
class ExpertGemm {
 public:
  ExpertGemm() : m_(512), k_(ModelConfig{}.d_model), n_(ModelConfig{}.d_ffn) {
    a_.assign(m_ * k_, 0.5f), b_.assign(k_ * n_, 0.25f), c_.assign(m_ * n_, 0.0f);
  }
  void run() { gemm(false, false, m_, n_, k_, 1.0f, a_.data(), k_, b_.data(), n_, 0.0f, c_.data(), n_); }

 private:
  int64_t m_, k_, n_;
  std::vector<float> a_, b_, c_;
};

}  // namespace

int transfer_cpu(const BenchOptions& opt) {
  const MpiJob job = start_mpi_job();
  comm::Communicator* world = job.world.get();
  const int P = world->size();
  const bool root = world->rank() == 0;
  set_gemm_threads(1);  // one compute thread, as moe train --threads 1 (the emulated cluster's setting)
  omp_set_num_threads(1);

  std::unique_ptr<Report> report;
  if (root) {
    report = std::make_unique<Report>(
        "transfer-cpu",
        str_cat("the compute a transfer between hosts displaces: one GEMM thread beside alltoallv rounds of ",
                kBlockBytes >> 20, " MiB per peer, ", P, " ranks; w = rate alone / rate beside - 1, mean over "
                "ranks; median of ", opt.repeats, " rounds"),
        opt, /*uses_gemm=*/true);
    if (P == 1)
      report->note("one rank moves no data: run it across hosts, e.g. `moe cluster run -- moe bench transfer-cpu`");
    report->table("rounds", {{"round", "", 0},
                             {"compute alone", "GEMM/s", 1},
                             {"compute beside the exchange", "GEMM/s", 1},
                             {"exchange alone", "ms", 1},
                             {"exchange beside the compute", "ms", 1},
                             {"exchange alone, each way", "GB/s", 3},
                             {"exchange beside / alone", "x"},
                             {"cpu threads per transfer w", "x"}});
  }
  std::vector<float> send(kBlockBytes / sizeof(float) * P, 1.0f), recv(send.size());
  const std::vector<int64_t> counts(P, kBlockBytes / static_cast<int64_t>(sizeof(float)));
  std::vector<int64_t> displs(P);
  for (int p = 0; p < P; ++p) displs[p] = p * counts[0];
  auto exchange = [&](int rounds) {
    for (int i = 0; i < rounds; ++i) check(world->alltoallv(send.data(), counts, displs, recv.data(), counts, displs));
  };

  ExpertGemm gemm_op;
  // Sizes: enough GEMMs and exchange rounds for kPhaseSeconds each, agreed (the slowest rank's).
  int64_t gemms = 1;
  for (auto t0 = Clock::now(); seconds(t0, Clock::now()) < 0.1; ++gemms) gemm_op.run();
  double per_gemm = 0.1 / static_cast<double>(gemms);
  int exchanges = 1;
  {
    check(world->barrier());
    const auto t0 = Clock::now();
    exchange(2);
    double per_exchange = seconds(t0, Clock::now()) / 2;
    double worst[2] = {per_gemm, per_exchange};
    check(world->allreduce(worst, 2, comm::ReduceOp::max));
    per_gemm = worst[0];
    gemms = std::max<int64_t>(1, static_cast<int64_t>(kPhaseSeconds / per_gemm));
    exchanges = std::max(1, static_cast<int>(kPhaseSeconds / worst[1]));
  }

  std::vector<double> ws, slowdowns, alone_gbs;
  for (int round = 0; round < opt.repeats; ++round) {
    check(world->barrier());
    auto t0 = Clock::now();
    for (int64_t i = 0; i < gemms; ++i) gemm_op.run();
    const double rate_alone = static_cast<double>(gemms) / seconds(t0, Clock::now());

    check(world->barrier());
    t0 = Clock::now();
    exchange(exchanges);
    const double t_alone = seconds(t0, Clock::now());

    // Both: the thread counts GEMMs with the time each ended; the exchange window picks its share.
    std::atomic<bool> stop{false};
    std::vector<Clock::time_point> ends;
    ends.reserve(static_cast<size_t>(4 * gemms + 16));
    std::thread compute([&] {
      omp_set_num_threads(1);  // per thread: OpenMP's thread count is a thread's own setting
      while (!stop.load(std::memory_order_relaxed)) {
        gemm_op.run();
        ends.push_back(Clock::now());
      }
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the thread is up and computing
    check(world->barrier());
    const auto x0 = Clock::now();
    exchange(exchanges);
    const auto x1 = Clock::now();
    stop = true;
    compute.join();
    const double t_both = seconds(x0, x1);
    const auto in_window =
        std::count_if(ends.begin(), ends.end(), [&](Clock::time_point t) { return t > x0 && t <= x1; });
    const double rate_during = static_cast<double>(in_window) / t_both;

    double mine[4] = {rate_alone, rate_during, t_alone, t_both};
    const double share = rate_during / rate_alone;
    double w = share >= 1 ? 0.0 : 1.0 / std::max(share, 1e-3) - 1.0;
    check(world->allreduce(mine, 4));
    check(world->allreduce(&w, 1));
    w /= P;
    ws.push_back(w);
    slowdowns.push_back(mine[3] / mine[2]);
    // Each rank sends P - 1 blocks to other ranks per exchange; t_alone averaged over the ranks.
    const double sent = static_cast<double>(exchanges) * static_cast<double>((P - 1) * kBlockBytes);
    alone_gbs.push_back(P > 1 ? sent / (mine[2] / P) / 1e9 : 0.0);
    if (root)
      report->row({static_cast<int64_t>(round + 1), mine[0] / P, mine[1] / P, 1e3 * mine[2] / P, 1e3 * mine[3] / P,
                   alone_gbs.back(), mine[3] / mine[2], w});
  }
  if (root) {
    report->table("result", {{"figure", "", 0, 36}, {"value", "x"}});
    report->row({std::string("cpu threads per transfer w (median)"), median(ws)});
    report->row({std::string("exchange beside / alone (median)"), median(slowdowns)});
    report->row({std::string("exchange alone GB/s each way (median)"), median(alone_gbs)});
    report->note("w: what the simulator's executor counts a lane moving data between hosts as "
                 "(ClusterSpec::cpu_threads_per_transfer); 0 where the transfer took nothing from the compute");
    report->note("exchange beside / alone: the simulator's ClusterSpec::cpu_transfer_slowdown (a lane between "
                 "hosts moves at most the NIC's bandwidth over it while compute runs on its host)");
    report->note("exchange alone: the most the simulator's NIC port carries (the cap, or this where lower)");
    return report->finish(0);
  }
  return 0;
}

}  // namespace moe::bench
