// moe bench cluster-collectives, moe bench cluster-ep-training: see bench.h and docs/cluster.md.
//
// Both build an emulated cluster (scripts/cluster.sh, named "moebench": 2 hosts x 1 rank, each host's
// NIC capped by tc in both directions), run their job on it with `cluster.sh run`, and remove the
// cluster at the end. They need root and network namespaces: without them they say so and exit 1.
//
// cluster-collectives: alltoallv with equal splits, alone and with an allreduce running at the same
// time on another communicator (another thread) over the same link, at NIC caps of 200 Mbit/s and
// 1 Gbit/s. Each moves the same bytes each way across the link: alltoallv of S per rank sends S/2
// to the other host; the 2-rank allreduce (recursive halving + doubling) of V = S/2 sends V/2 in its
// reduce-scatter and V/2 in its allgather. Columns:
//   MiB/dir      payload bytes each host sends to the other in one call
//   cap ms       the time the cap predicts: payload x wire/payload bytes (Ethernet + IP + TCP headers
//                with timestamps, MTU 1500: 1514 / 1448) x 8 / cap
//   alone ms     median over --repeats calls (after a warm-up), the slower rank's time
//   /cap         alone / cap ms (1.00: the link runs at its cap)
//   shared ms    the same call while the other operation runs on the same link
//   /alone       shared / alone: the contention
//   fair ms      what max-min fair sharing of the cap predicts (both flows start together; a flow
//                finishes after its bytes plus as many of the other's as overlap it)
// cluster-ep-training: `moe train` (the default model and corpus) on 2 hosts x 1 rank at NIC caps of
// 100 Mbit/s, 1 Gbit/s and 10 Gbit/s, next to the same 2 ranks on one host (shared memory): the
// runtime's per-step metrics step_ms, compute_ms, exposed_comm_ms and comm_ms, medians after warm-up.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <mpi.h>
#include <nlohmann/json.hpp>

#include "bench/bench.h"
#include "bench/report.h"
#include "bench/emulated_cluster.h"
#include "bench/mpi_bench.h"
#include "comm/communicator.h"
#include "comm/mpi_communicator.h"
#include "util/shell.h"
#include "util/str_cat.h"

namespace moe::bench {
namespace {

constexpr const char* kCluster = "moebench";

// Prints why the bench cannot run when `cluster` is not up; returns cluster.up().
bool usable(const EmulatedCluster& cluster, const char* bench) {
  if (!cluster.up()) std::fprintf(stderr, "moe bench %s: %s\n", bench, cluster.why().c_str());
  return cluster.up();
}

// ---- cluster-collectives: the ranks' side (under `cluster.sh run`) ----

int collectives_ranks(const BenchOptions& opt) {
  MpiJob job = start_mpi_job();
  std::unique_ptr<comm::Communicator> a2a_comm = std::move(job.world), ar_comm;
  check(a2a_comm->dup("allreduce", &ar_comm));  // its own lane, as the runtime's allreduce has
  const int P = a2a_comm->size(), r = a2a_comm->rank();
  if (P != 2) {
    if (r == 0) std::fprintf(stderr, "moe bench cluster-collectives: runs on 2 ranks, got %d\n", P);
    return 1;
  }
  const char* bps_env = std::getenv("MOE_CLUSTER_NIC_BPS");
  const char* nic = std::getenv("MOE_CLUSTER_NIC");
  const double bps = bps_env ? std::atof(bps_env) : 0;
  if (bps <= 0) {
    if (r == 0) std::fprintf(stderr, "moe bench cluster-collectives: run by the bench itself (no MOE_CLUSTER_NIC_BPS)\n");
    return 1;
  }
  // ~0.5 s per call at the cap: long against scheduling noise, short enough for a few repeats.
  const int64_t per_dir = std::clamp<int64_t>(static_cast<int64_t>(bps / 8 * 0.5) >> 20, 1, 256) << 20;
  const int64_t a2a_count = per_dir / 4;  // floats per peer block: the block to the other host
  const int64_t ar_count = per_dir / 4;  // V = per_dir: its reduce-scatter and allgather send V/2 each
  std::vector<float> send(2 * a2a_count, 1.0f), recv(2 * a2a_count), grad(ar_count, 0.0f);
  std::vector<int64_t> counts{a2a_count, a2a_count}, displs{0, a2a_count};
  MPI_Comm raw;
  MPI_Comm_dup(MPI_COMM_WORLD, &raw);
  auto a2a = [&] { check(a2a_comm->alltoallv(send.data(), counts, displs, recv.data(), counts, displs)); };
  auto ar = [&] { check(ar_comm->allreduce(grad.data(), ar_count)); };
  using Clock = std::chrono::steady_clock;
  auto secs = [](Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); };
  // One round: the calls given run at once, one thread each, after a barrier; each one's time, the
  // slower rank's.
  auto round = [&](bool run_a2a, bool run_ar, double* t_a2a, double* t_ar) {
    MPI_Barrier(raw);
    double ta = 0, tr = 0;
    std::thread other;
    if (run_ar) other = std::thread([&] {
        auto t0 = Clock::now();
        ar();
        tr = secs(t0, Clock::now());
      });
    if (run_a2a) {
      auto t0 = Clock::now();
      a2a();
      ta = secs(t0, Clock::now());
    }
    if (other.joinable()) other.join();
    double t[2] = {ta, tr};
    MPI_Allreduce(MPI_IN_PLACE, t, 2, MPI_DOUBLE, MPI_MAX, raw);
    *t_a2a = t[0], *t_ar = t[1];
  };
  double dummy;
  round(true, true, &dummy, &dummy);  // warm-up: connections, first touch
  std::vector<double> a_alone, r_alone, a_shared, r_shared;
  for (int k = 0; k < opt.repeats; ++k) {
    double ta, tr;
    round(true, false, &ta, &dummy), a_alone.push_back(ta);
    round(false, true, &dummy, &tr), r_alone.push_back(tr);
    round(true, true, &ta, &tr), a_shared.push_back(ta), r_shared.push_back(tr);
  }
  MPI_Comm_free(&raw);
  if (r != 0) return 0;
  const double byte_s = bps / 8 / kWireFactor;  // payload bytes per second at the cap
  const double cap_s = per_dir / byte_s;
  // Max-min fair: both start together with the same bytes, so each gets half until both finish.
  const double fair_s = 2 * per_dir / byte_s;
  BenchOptions child = opt;
  child.json = true;  // the parent (cluster_collectives) reads the document
  Report report("cluster-collectives", "one emulated cluster run", child);
  char title[160];
  std::snprintf(title, sizeof title, "NIC cap %s (%.0f Mbit/s each way; payload %.1f MB/s after headers)",
                nic ? nic : "?", bps / 1e6, byte_s / 1e6);
  report.table(title, {{"operation", ""}, {"per direction", "MiB", 1}, {"at the cap", "ms", 1}, {"alone", "ms", 1},
                       {"alone / at the cap", "x"}, {"shared", "ms", 1}, {"shared / alone", "x"},
                       {"max-min fair", "ms", 1}});
  auto row = [&](const char* name, double alone, double shared) {
    report.row({std::string(name), per_dir / 1048576.0, cap_s * 1e3, alone * 1e3, alone / cap_s, shared * 1e3,
                shared / alone, fair_s * 1e3});
  };
  row("alltoallv (+ allreduce)", median(a_alone), median(a_shared));
  row("allreduce (+ alltoallv)", median(r_alone), median(r_shared));
  return report.finish(0);
}

// ---- cluster-ep-training: one `moe train` run's metrics ----

struct TrainRow {
  std::string name;
  bool ok = false;
  double step = 0, compute = 0, exposed = 0, comm = 0;
};

TrainRow train_row(const std::string& name, const std::string& launch, int steps, int warmup) {
  TrainRow row{name};
  const std::string metrics =
      std::filesystem::temp_directory_path() / str_cat("moe_bench_cluster_", getpid(), ".jsonl");
  std::filesystem::remove(metrics);
  std::string cmd = str_cat(launch, " ", self_exe("moe"), " train --steps ", steps, " --log-every ", steps,
                            " --eval-batches 1 --threads 1 --metrics ", metrics);
  const ShellResult r = run_shell(cmd);
  if (r.exit_code != 0) {
    std::fprintf(stderr, "moe bench cluster-ep-training: '%s' failed (exit %d):\n%s", cmd.c_str(), r.exit_code,
                 r.output.c_str());
    return row;
  }
  std::vector<double> step, compute, exposed, comm;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.contains("step_ms") || j["step"].get<int>() <= warmup) continue;
    step.push_back(j["step_ms"]), compute.push_back(j["compute_ms"]);
    exposed.push_back(j["exposed_comm_ms"]), comm.push_back(j["comm_ms"]);
  }
  std::filesystem::remove(metrics);
  row.ok = !step.empty();
  row.step = median(step), row.compute = median(compute), row.exposed = median(exposed), row.comm = median(comm);
  return row;
}

}  // namespace

int cluster_collectives(const BenchOptions& opt) {
  if (std::getenv("OMPI_COMM_WORLD_SIZE")) return collectives_ranks(opt);
  const EmulatedCluster cluster(kCluster, "200mbit");
  if (!usable(cluster, "cluster-collectives")) return 1;
  Report report("cluster-collectives",
                "2 emulated hosts x 1 rank (scripts/cluster.sh), float32, median of " + std::to_string(opt.repeats) +
                    " rounds; alltoallv and allreduce alone and at the same time on the same link, next to the times "
                    "the cap and max-min fair sharing predict",
                opt);
  int failed = 0;
  for (const char* nic : {"200mbit", "1gbit"}) {
    if (!cluster.shape(nic)) return report.finish(1);
    const std::string job = str_cat("run -- ", self_exe("moe"), " bench cluster-collectives --repeats ", opt.repeats);
    const ShellResult r = run_shell(cluster.command(job));
    const nlohmann::json doc = child_document(r.output);
    if (r.exit_code != 0 || !report.add_from(doc)) {
      std::fprintf(stderr, "moe bench cluster-collectives: cap %s: the job failed (exit %d):\n%s", nic, r.exit_code,
                   r.output.c_str());
      report.note(str_cat("cap ", nic, ": the job failed (exit ", r.exit_code, ")"));
      ++failed;
    }
  }
  return report.finish(failed ? 1 : 0);
}

int cluster_ep_training(const BenchOptions& opt) {
  const EmulatedCluster cluster(kCluster, "100mbit");
  if (!usable(cluster, "cluster-ep-training") || !default_corpus_ready("cluster-ep-training")) return 1;
  const int steps = 15, warmup = 3;
  Report report("cluster-ep-training",
                str_cat("moe train, default model and corpus, 2 ranks x 1 thread, ", steps, " steps (medians after ",
                        warmup, "); 2 emulated hosts x 1 rank at each NIC cap vs 2 ranks on one host"),
                opt);
  std::vector<TrainRow> rows;
  rows.push_back(train_row("1 host, shared memory",
                           "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -n 2 --bind-to none",
                           steps, warmup));
  for (const char* nic : {"100mbit", "1gbit", "10gbit"}) {
    if (!cluster.shape(nic)) return report.finish(1);
    rows.push_back(train_row(str_cat("2 hosts, NIC ", nic), cluster.command("run --"), steps, warmup));
  }
  report.table("runs", {{"run", ""}, {"step", "ms", 1}, {"compute", "ms", 1}, {"exposed comm", "ms", 1},
                       {"comm", "ms", 1}, {"step / 1-host step", "x"}});
  const double nan = std::nan("");
  int failed = 0;
  for (const TrainRow& r : rows) {
    if (!r.ok) {
      report.row({r.name + " (failed)", nan, nan, nan, nan, nan});
      ++failed;
      continue;
    }
    report.row({r.name, r.step, r.compute, r.exposed, r.comm, rows[0].ok ? r.step / rows[0].step : nan});
  }
  return report.finish(failed ? 1 : 0);
}

}  // namespace moe::bench
