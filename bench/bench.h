// Benchmarks behind `moe bench <name>`. Each prints a fixed table with the reference it is judged
// against measured in the same run (this machine's GEMM rate, a PyTorch peer) and the ratio:
// machines here are shared and noisy, ratios measured side by side are what hold. Every one prints
// through bench/report.h: one header block, the same column conventions, --json for machines.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "util/status.h"

namespace moe::sim {
struct SimRunConfig;
}

namespace moe::bench {

// Shared by the benchmarks (bench_util.cpp).
double median(std::vector<double> v);  // the upper median; 0 for no samples
// A figure measured once per round against the reference's figure of the same round (the rounds
// interleave the runs, so a slow spell of the machine weighs on both): the lowest, highest and (upper)
// median of the per-round ratios, and in how many rounds the figure was below the reference (n of n by
// chance alone: the sign test's p = 2^-n). NaN ratios for no rounds. REQUIRES: x and ref of the same size.
struct PairedRounds {
  double lowest = 0, highest = 0;
  int64_t below = 0;
  double median = 0;
  // The sign test's one-sided p: the chance of `below` or more of the rounds below the reference if
  // either were as likely to be lower (Binomial(rounds, 1/2)); 2^-n where all n are below.
  double sign_p = 1;
};
PairedRounds paired_rounds(const std::vector<double>& x, const std::vector<double>& ref);
// P(Binomial(n, 1/2) >= below): the sign test's one-sided p. REQUIRES: 0 <= below <= n.
double sign_test_p(int64_t below, int64_t n);
// bench/torch_moe_layer_peer.py: under $MOE_BENCH_DIR if set, else in the source tree moe was built from.
std::string torch_peer_script();
// A fresh directory under the temp directory ("<prefix><pid>"), removed with its contents when this
// goes out of scope, whatever happened in between.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& prefix);
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};
// The simulator's step graph time (compute + exposed communication, mean over ranks) of cfg replaying
// the load recorded in `metrics` (a moe train --metrics file): the median over steps first_step.. .
Status simulated_graph_ms(sim::SimRunConfig cfg, const std::string& metrics, size_t first_step, double* ms);

// Benchmarks that run `moe train` on the default corpus (Debian's python3-doc) check it first, so a
// machine without it gets one clear error instead of a failure per run. Prints
// "moe bench <name>: <why>" on stderr and returns false when the corpus cannot be opened.
bool default_corpus_ready(const char* bench_name);

struct BenchOptions {
  int threads = 2;
  int repeats = 5;         // timed repetitions per row; the median is reported
  bool skip_torch = false; // leave out the PyTorch peer rows
  bool json = false;       // the report as one JSON document (bench/report.h)
  std::string html;        // strategies, cluster-strategies: also draw their runs' metrics (moe report) here
  std::string only;        // cluster-strategies: only configurations whose name (2x1-1gbit-skew1.5) contains it;
                           // serve, cluster-serve, serve-replay, cluster-serve-replay: only the workloads
                           // whose name (chat, long prompts) does
  std::vector<std::string> schedules;  // serve, cluster-serve: the schedules to run (ep among them); empty: all
  int in_flight = 0;       // serve-replay, cluster-serve-replay: sequences in flight; 0: the workload's clients
  std::vector<double> rates;  // serve, cluster-serve: arrivals per second per workload (chat, long prompts);
                              // empty: 70% of ep's closed-loop throughput, measured first
  std::string keep;        // cluster-strategies: copy the runs' files and calibrated clusters to this folder
};
// The runs' metrics files as one `moe report` page at `path` (labels: the runs' names, one per file);
// says where on stderr. Returns false, saying why, when a file cannot be read or the page written.
bool write_html_report(const std::string& path, const std::string& title, const std::vector<std::string>& metrics,
                       const std::vector<std::string>& labels);

// d_model 512, d_ffn 2048, 8 experts, top-2, 4096 tokens: GEMM rate on the expert shapes per
// backend, the MoE layer forward and forward+backward, the expert GEMMs' share of the GEMM rate,
// and the PyTorch peer (bench/torch_moe_layer_peer.py). Returns the exit code.
int moe_layer(const BenchOptions& opt);

// bench/decode.cpp: the inference engine's decode step on one process (the default model and a
// larger one; 1, 4 and 16 sequences) against this machine's memory read bandwidth and GEMM rate, both
// measured in the same run: a decode step is bound by the bytes it reads. Returns the exit code.
int decode(const BenchOptions& opt);
// bench/serve_replay.cpp: every serving schedule on the same forwards (bench serve's workloads,
// teacher-forced, the schedules in turn within each step), per-forward times compared directly, on 2
// local ranks (serve_replay; under mpirun it is the ranks' part) or 2 emulated hosts at 1 Gbit/s
// (cluster_serve_replay, root). Returns the exit code.
int serve_replay(const BenchOptions& opt);
int cluster_serve_replay(const BenchOptions& opt);

// bench/serve.cpp: `moe serve` on 2 ranks driven over HTTP by real-text requests of two domains in
// unequal shares, in two workloads (chat: short prompts, decode-bound; long prompts: prefill-bound);
// per workload a closed loop finds ep's throughput, then every schedule (ep and Lina's variants, ideal)
// gets the same Poisson arrivals at 70% of it: latency and time to first token p50/p95/p99, Lina's
// estimation accuracy, re-plans and moved weights. Returns the exit code.
int serve(const BenchOptions& opt);
// The same on an emulated cluster of 2 hosts x 1 rank at 1 Gbit/s (root). Returns the exit code.
int cluster_serve(const BenchOptions& opt);

// nccl-tests' table (size, count, type, time, algbw, busbw, #wrong) for alltoallv (equal splits) and
// allreduce (sum, in place), 1 KiB .. 64 MiB, next to the same operations through MPI directly
// (MPI_Alltoall, MPI_Allreduce) and the ratio. Run under mpirun (-n 2, -n 4); rank 0 prints. The
// busbw factors are documented in bench/collectives.cpp. Returns the exit code.
int collectives(const BenchOptions& opt);

// Expert-parallel training on 2 MPI ranks against 1 process on the same global batch (default model
// and corpus): step time, exposed communication and how much of the gradient allreduce hides behind
// compute, from the runtime's timelines. Starts mpirun itself. Returns the exit code.
int ep_training(const BenchOptions& opt);

// Hecate's SparseAllGather / SparseReduceScatter next to the dense allgather / reduce_scatter, chunks
// 64 KiB .. 16 MiB, lambda 0.125 .. 1; under mpirun (-n 2, -n 4), rank 0 prints. Returns the exit code.
int sparse_collectives(const BenchOptions& opt);

// bench/transfer_cpu.cpp, under mpirun with one rank per host: the compute threads' worth of a host's
// cores one transfer between hosts takes (the simulator's ClusterSpec::cpu_threads_per_transfer), from
// a GEMM thread's rate alone and beside alltoallv rounds. Returns the exit code.
int transfer_cpu(const BenchOptions& opt);

// bench/cluster.cpp, on an emulated cluster (scripts/cluster.sh; needs root and network namespaces,
// else says so and returns 1): alltoallv across 2 hosts x 1 rank alone and with a concurrent
// allreduce on the same capped link (200 Mbit/s, 1 Gbit/s), next to the times the cap and max-min
// fair sharing predict; and `moe train` step time / exposed communication on 2 hosts x 1 rank at
// 100 Mbit/s, 1 Gbit/s, 10 Gbit/s next to 2 ranks on one host. Return the exit code.
int cluster_collectives(const BenchOptions& opt);
int cluster_ep_training(const BenchOptions& opt);
// bench/cluster_strategies.cpp, on an emulated cluster (root): every strategy on 2 hosts x 1 and x 2
// ranks, NIC 1 and 10 Gbit/s, router skew 1.5 and 0, in interleaved rounds: step time, ratio to ep,
// exposed communication, sparse bytes, rank imbalance, Hecate's t, and the simulator's prediction of
// each run (calibrated on a local run made first). Returns the exit code.
int cluster_strategies(const BenchOptions& opt);

// The training strategies (ep, hecate, hecate --rematerialize, fastermoe, smartmoe, flexmoe, deepspeed) on 2 MPI ranks with a
// skewed router, next to EP with an unskewed router: step time, MoE-layer time of the busiest rank,
// expert GEMM time max/mean, rank imbalance, sparse-collective bytes. Starts mpirun itself.
int strategies(const BenchOptions& opt);

// The simulator's speed (bench/sim.cpp): wall time to simulate one training step of a 12-layer,
// 64-expert GPT-MoE on 32, 256, 1024 and 4096 H100 GPUs, next to the goals. Returns the exit code.
int sim_speed(const BenchOptions& opt);

// The simulator's fidelity (bench/sim_fidelity.cpp): calibrate on real 2-rank runs (one per round,
// fitted together; and the first alone), predict 4 ranks, a larger batch, more experts and 2 emulated
// hosts x 1 rank at 1 Gbit/s (scripts/cluster.sh; skipped with the reason without root or namespaces),
// measure them for real in the same run; predicted vs measured step time, medians over `repeats` real
// runs of each configuration, the error on each configuration's fastest run, and per run its rank
// spread (slowest over fastest rank in attention, the same work on every rank: the host's noise in
// that run). Returns the exit code (1 when a real run failed).
int sim_fidelity(const BenchOptions& opt);

// The Hecate paper's setting in the simulator (bench/sim_strategies.cpp): GPT-MoE-S and BERT-MoE
// (its Table 1) on 16 and 32 V100s (p3dn.24xlarge) and 32 A100s (p4d.24xlarge), Zipf-drifting load
// (and a recorded `moe train --metrics` file from MOE_SIM_LOAD), strategies ep / fastermoe / hecate /
// hecate-rm: step time, MoE-layer time, speedup over EP, next to the paper's speedups. Returns the exit code.
int sim_strategies(const BenchOptions& opt);

// The GPU kernels on this machine's first GPU (bench/cuda/cuda_bench.cpp, CUDA builds only): dense
// bf16 GEMM rate, grouped expert GEMM vs a dense GEMM of the same FLOPs, the MoE layer forward+backward,
// each beside the simulator's H100 prediction. Exits 1 without a GPU.
int cuda_kernels(const BenchOptions& opt);

}  // namespace moe::bench
