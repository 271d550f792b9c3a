// moe bench collectives: see bench.h. Run under mpirun: `mpirun -n 2 moe bench collectives`.
//
// Prints nccl-tests' table (https://github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md) for
// alltoallv with equal splits and for allreduce (sum, in place) on float32, sizes 1 KiB .. 64 MiB in
// steps of x4, and in the same run the reference: the same operation through MPI directly.
//   size    bytes each rank sends: alltoallv all its blocks together (size / n per peer, its own
//           block included); allreduce the whole vector
//   count   elements in it
//   time    microseconds per call: after a barrier each rank times `iters` back-to-back calls; the
//           slowest rank's mean counts; the median over --repeats rounds is printed
//   algbw   size / time, GB/s (1e9 bytes)
//   busbw   algbw x factor: the bytes each rank's link carries per byte of size, so that figures
//           compare across rank counts and with the hardware's bandwidth:
//             allreduce    2 (n-1) / n  (reduce-scatter + allgather: each sends and receives
//                                        (n-1)/n of the vector twice)
//             alltoall(v)  (n-1) / n    (the block a rank keeps moves no data)
//           With one rank busbw is 0.
//   #wrong  elements that differ from the exact expected values in one checked call after the timing,
//           summed over ranks (nccl-tests style: value = f(source rank, destination rank, index)).
// Reference ("raw"): MPI_Alltoall and MPI_Allreduce(MPI_IN_PLACE) called directly on a duplicate of
// MPI_COMM_WORLD, their rounds interleaved with ours. ours/raw = raw time / our time: 1.0 means the
// communicator (argument checks, non-blocking issue + polling against the timeout, and for allreduce
// its own point-to-point algorithm) costs nothing; the target is >= 0.9.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench.h"
#include "bench/report.h"
#include "bench/mpi_bench.h"
#include "comm/communicator.h"
#include "comm/mpi_communicator.h"
#include "comm/topology.h"

namespace moe::bench {
namespace {

constexpr int64_t kMinBytes = 1 << 10, kMaxBytes = 64 << 20;

// Exact in float and different for every (src, dst, i).
float pattern(int src, int dst, int64_t i) {
  return static_cast<float>((uint64_t(src) * 7919 + uint64_t(dst) * 104729 + uint64_t(i) * 31) % 16777213ull);
}

struct Side {
  double seconds = 0;
  int64_t wrong = 0;
};

std::string size_str(int64_t bytes) {
  if (bytes >= (1 << 20)) return std::to_string(bytes >> 20) + " MiB";
  return std::to_string(bytes >> 10) + " KiB";
}

struct Summary {
  std::vector<double> ratios;
  double best_ours = 0, best_raw = 0;
  int64_t best_ours_at = 0, best_raw_at = 0;
};

void print_header(Report& report, const std::string& title) {
  report.table(title, {{"size", "B"}, {"count", "elements"}, {"type", ""}, {"redop", ""}, {"ours time", "us", 1},
                       {"ours algbw", "GB/s"}, {"ours busbw", "GB/s"}, {"ours #wrong", ""}, {"raw time", "us", 1},
                       {"raw algbw", "GB/s"}, {"raw busbw", "GB/s"}, {"raw #wrong", ""}, {"raw time / ours time", "x"}});
}

void print_row(Report& report, int64_t bytes, int64_t count, const char* redop, double factor, const Side& ours,
               const Side& raw, Summary* sum) {
  double alg_o = bytes / ours.seconds / 1e9, alg_r = bytes / raw.seconds / 1e9;
  double ratio = raw.seconds / ours.seconds;
  report.row({std::to_string(bytes), count, std::string("float"), std::string(redop), ours.seconds * 1e6, alg_o,
              alg_o * factor, ours.wrong, raw.seconds * 1e6, alg_r, alg_r * factor, raw.wrong, ratio});
  sum->ratios.push_back(ratio);
  if (alg_o * factor > sum->best_ours) sum->best_ours = alg_o * factor, sum->best_ours_at = bytes;
  if (alg_r * factor > sum->best_raw) sum->best_raw = alg_r * factor, sum->best_raw_at = bytes;
}

void print_summary(Report& report, const std::string& what, const Summary& s) {
  double log_sum = 0, worst = 1e30;
  for (double r : s.ratios) log_sum += std::log(r), worst = std::min(worst, r);
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "%s: peak busbw ours %.2f GB/s at %s, raw MPI %.2f GB/s at %s; raw time / ours time: geometric mean "
                "%.2f, lowest %.2f (goal, not measured: >= 0.90)",
                what.c_str(), s.best_ours, size_str(s.best_ours_at).c_str(), s.best_raw,
                size_str(s.best_raw_at).c_str(), std::exp(log_sum / s.ratios.size()), worst);
  report.note(buf);
}

int iterations(int64_t bytes) { return static_cast<int>(std::clamp<int64_t>(kMaxBytes / bytes, 3, 500)); }

}  // namespace

int collectives(const BenchOptions& opt) {
  const MpiJob job = start_mpi_job();
  comm::Communicator* world = job.world.get();
  comm::Topology topo;
  check(comm::detect_topology(*world, 0, &topo));
  MPI_Comm raw;
  MPI_Comm_dup(MPI_COMM_WORLD, &raw);
  const int P = world->size(), r = world->rank();
  const bool root = r == 0;

  std::unique_ptr<Report> report;  // rank 0 prints
  if (root) {
    const std::string version = mpi_library_version();
    char what[512];
    std::snprintf(what, sizeof what,
                  "our collectives beside raw MPI, %d rank%s (%s), %s, %s; float32; median of %d rounds; busbw = "
                  "algbw x factor: allreduce 2(n-1)/n = %.2f, alltoallv (n-1)/n = %.2f",
                  P, P == 1 ? "" : "s", topo.describe().c_str(), version.c_str(), job.session->thread_level_name(),
                  opt.repeats, 2.0 * (P - 1) / P, double(P - 1) / P);
    report = std::make_unique<Report>("collectives", what, opt);
    if (P == 1) report->note("one rank moves no data: run it as `mpirun -n 2 moe bench collectives`");
  }

  std::vector<float> send(kMaxBytes / 4), recv(kMaxBytes / 4);
  std::vector<int64_t> counts(P), displs(P);

  // ---- alltoallv, equal splits ----
  Summary a2a;
  if (root) print_header(*report, "alltoallv, equal splits (ours: Communicator::alltoallv; raw: MPI_Alltoall)");
  for (int64_t bytes = kMinBytes; bytes <= kMaxBytes; bytes *= 4) {
    const int64_t per = bytes / 4 / P, count = per * P;
    for (int p = 0; p < P; ++p) counts[p] = per, displs[p] = p * per;
    auto ours = [&] { check(world->alltoallv(send.data(), counts, displs, recv.data(), counts, displs)); };
    auto mpi = [&] {
      MPI_Alltoall(send.data(), static_cast<int>(per), MPI_FLOAT, recv.data(), static_cast<int>(per), MPI_FLOAT, raw);
    };
    ours(), mpi();  // warm-up: first touch, connection set-up
    const int iters = iterations(bytes);
    std::vector<double> to, tr;
    for (int k = 0; k < opt.repeats; ++k) {
      to.push_back(time_calls(raw, iters, ours));
      tr.push_back(time_calls(raw, iters, mpi));
    }
    Side o{median(to)}, m{median(tr)};
    for (Side* side : {&o, &m}) {
      for (int p = 0; p < P; ++p)
        for (int64_t i = 0; i < per; ++i) send[p * per + i] = pattern(r, p, i);
      std::fill(recv.begin(), recv.begin() + count, -1.0f);
      side == &o ? ours() : mpi();
      int64_t wrong = 0;
      for (int p = 0; p < P; ++p)
        for (int64_t i = 0; i < per; ++i) wrong += recv[p * per + i] != pattern(p, r, i);
      MPI_Allreduce(&wrong, &side->wrong, 1, MPI_INT64_T, MPI_SUM, raw);
    }
    if (root) print_row(*report, count * 4, count, "none", double(P - 1) / P, o, m, &a2a);
  }
  if (root) print_summary(*report, "alltoallv", a2a);

  // ---- allreduce, sum, in place ----
  Summary ar;
  if (root) print_header(*report, "allreduce, sum, in place (ours: Communicator::allreduce; raw: MPI_Allreduce)");
  std::fill(send.begin(), send.end(), 0.0f);  // timed calls reduce zeros: no overflow, no denormals
  for (int64_t bytes = kMinBytes; bytes <= kMaxBytes; bytes *= 4) {
    const int64_t count = bytes / 4;
    auto ours = [&] { check(world->allreduce(send.data(), count)); };
    auto mpi = [&] { MPI_Allreduce(MPI_IN_PLACE, send.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, raw); };
    ours(), mpi();
    const int iters = iterations(bytes);
    std::vector<double> to, tr;
    for (int k = 0; k < opt.repeats; ++k) {
      to.push_back(time_calls(raw, iters, ours));
      tr.push_back(time_calls(raw, iters, mpi));
    }
    Side o{median(to)}, m{median(tr)};
    const int64_t tri = int64_t(P) * (P + 1) / 2;
    for (Side* side : {&o, &m}) {
      for (int64_t i = 0; i < count; ++i) send[i] = static_cast<float>((r + 1) * (i % 97));
      side == &o ? ours() : mpi();
      int64_t wrong = 0;
      for (int64_t i = 0; i < count; ++i) wrong += send[i] != static_cast<float>(tri * (i % 97));
      MPI_Allreduce(&wrong, &side->wrong, 1, MPI_INT64_T, MPI_SUM, raw);
    }
    std::fill(send.begin(), send.begin() + count, 0.0f);
    if (root) print_row(*report, bytes, count, "sum", 2.0 * (P - 1) / P, o, m, &ar);
  }
  if (root) print_summary(*report, "allreduce", ar);

  MPI_Comm_free(&raw);
  return root ? report->finish(0) : 0;
}

}  // namespace moe::bench
