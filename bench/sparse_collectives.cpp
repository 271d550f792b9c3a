// moe bench sparse-collectives: Hecate's SparseAllGather and SparseReduceScatter
// (src/comm/sparse_collectives.h) against the dense collectives they replace. Run under mpirun:
// `mpirun -n 2 moe bench sparse-collectives` (and -n 4); rank 0 prints.
//
// The layer: every rank owns K = 8 chunks (experts), C = 8 P in all, chunk sizes 64 KiB .. 16 MiB
// in steps of x4 (float32). The placement replicates lambda K of each rank's chunks onto every rank
// (Hecate's Alg. 1 with the hot experts spread over their owners), so a fraction lambda of the
// chunks needs new replicas, lambda = 0.125, 0.25, 0.5, 1; at lambda = 1 the sparse collective does
// the dense one's job. The reference, measured in the same run with rounds interleaved:
//   allgather        Communicator::allgather of every rank's K chunks (every rank gets all C)
//   reduce-scatter   Communicator::reduce_scatter of all C chunks (every rank gets the sums of its K)
// Columns:
//   chunk        bytes of one chunk
//   lambda       fraction of chunks with new replicas
//   moved/rank   bytes the busiest rank sends or receives (the larger), from the plan; the dense
//                collectives move (P-1) K chunks each way per rank
//   rounds       rounds of the plan (a rank moves at most one chunk each way per round)
//   time         microseconds per call: after a barrier each rank times `iters` back-to-back calls;
//                the slowest rank's mean counts; the median over --repeats rounds is printed
//   busbw        moved/rank / time, GB/s (1e9 bytes): what the busiest rank's link carries, so that
//                sparse and dense compare (dense: (P-1)/P of all chunks / time, nccl-tests' busbw)
//   #wrong       elements that differ from the exact expected values in one checked call after the
//                timing, summed over ranks (value = f(chunk, element); partial sums are small
//                integers, exact in any order)
//   sparse/dense sparse time / dense time; the bytes column next to it is sparse moved/rank over
//                dense moved/rank (= lambda): the time ratio the O(lambda S) volume predicts.
#include <mpi.h>

#include <algorithm>
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
#include "comm/sparse_collectives.h"
#include "comm/topology.h"

namespace moe::bench {
namespace {

constexpr int kChunksPerRank = 8;
constexpr int64_t kMinChunkBytes = 64 << 10, kMaxChunkBytes = 16 << 20;
constexpr double kLambdas[] = {0.125, 0.25, 0.5, 1.0};

int64_t sum_over_ranks(MPI_Comm raw, int64_t v) {
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_INT64_T, MPI_SUM, raw);
  return v;
}

// Exact in float and different for every (chunk, element).
float param(int64_t c, int64_t i) { return static_cast<float>((uint64_t(c) * 7919 + uint64_t(i) * 31) % 16777213ull); }
// Rank r's partial gradient: small integers, so every sum is exact whatever the order.
float partial(int r, int64_t c, int64_t i) { return static_cast<float>((r + 1) * ((c * 131 + i) % 1000)); }

std::string size_str(int64_t bytes) {
  std::string s;
  if (bytes >= (1 << 20)) s += std::to_string(bytes >> 20), s += " MiB";
  else s += std::to_string(bytes >> 10), s += " KiB";
  return s;
}

struct Sparse {
  double lambda = 0;
  comm::Placement p0, p1;
  comm::SparsePlan ag, rs;
  std::vector<double> ag_times, rs_times;
};

// Owners: chunk c on rank c / K; the first lambda K chunks of every rank go to every rank.
Sparse make_sparse(double lambda, int P) {
  Sparse s;
  s.lambda = lambda;
  const int C = P * kChunksPerRank, hot = static_cast<int>(lambda * kChunksPerRank);
  std::vector<int> everyone(P);
  for (int r = 0; r < P; ++r) everyone[r] = r;
  s.p0.resize(C), s.p1.resize(C);
  for (int c = 0; c < C; ++c) {
    s.p0[c] = {c / kChunksPerRank};
    s.p1[c] = c % kChunksPerRank < hot ? everyone : s.p0[c];
  }
  s.ag = comm::plan_sparse_allgather(s.p0, s.p1, P);
  s.rs = comm::plan_sparse_reduce_scatter(s.p1, s.p0, P);
  return s;
}

int64_t moved_per_rank(const comm::SparsePlan& plan, int64_t chunk_bytes) {
  int64_t m = 0;
  for (int r = 0; r < plan.num_ranks; ++r)
    m = std::max({m, comm::bytes_sent(plan, r, chunk_bytes), comm::bytes_received(plan, r, chunk_bytes)});
  return m;
}

void print_header(Report& report, const std::string& title) {
  report.table(title, {{"chunk", "B"}, {"lambda", "", 3}, {"moved / rank", "B"}, {"rounds", ""},
                       {"sparse time", "us", 1}, {"sparse busbw", "GB/s"}, {"sparse #wrong", ""},
                       {"dense time", "us", 1}, {"dense busbw", "GB/s"}, {"dense #wrong", ""},
                       {"sparse time / dense time", "x", 3}, {"sparse bytes / dense bytes", "x", 3}});
}

struct Row {
  int64_t chunk_bytes = 0, moved = 0, dense_moved = 0, wrong = 0, dense_wrong = 0;
  double lambda = 0, seconds = 0, dense_seconds = 0;
  size_t rounds = 0;
};

void print_row(Report& report, const Row& r) {
  report.row({std::to_string(r.chunk_bytes), r.lambda, r.moved, static_cast<int64_t>(r.rounds), r.seconds * 1e6,
              r.moved / r.seconds / 1e9, r.wrong, r.dense_seconds * 1e6, r.dense_moved / r.dense_seconds / 1e9,
              r.dense_wrong, r.seconds / r.dense_seconds, double(r.moved) / r.dense_moved});
}

// Per lambda: the geometric mean over chunk sizes of sparse/dense time, next to lambda.
void print_summary(Report& report, const std::vector<Row>& rows) {
  std::string line = "sparse time / dense time, geometric mean over chunk sizes (lambda, the bytes ratio, in brackets):";
  for (double lambda : kLambdas) {
    double log_sum = 0;
    int n = 0;
    for (const Row& r : rows)
      if (r.lambda == lambda) log_sum += std::log(r.seconds / r.dense_seconds), ++n;
    char buf[64];
    std::snprintf(buf, sizeof buf, "  %.3f (%.3f)", std::exp(log_sum / n), lambda);
    line += buf;
  }
  report.note(line);
}

int iterations(int64_t dense_bytes) {
  return static_cast<int>(std::clamp<int64_t>((int64_t(256) << 20) / dense_bytes, 2, 100));
}

}  // namespace

int sparse_collectives(const BenchOptions& opt) {
  const MpiJob job = start_mpi_job();
  comm::Communicator* world = job.world.get();
  comm::Topology topo;
  check(comm::detect_topology(*world, 0, &topo));
  MPI_Comm raw;  // timing barriers and result sums, apart from the measured traffic
  MPI_Comm_dup(MPI_COMM_WORLD, &raw);
  const int P = world->size(), r = world->rank(), K = kChunksPerRank, C = P * K;
  const bool root = r == 0;

  std::unique_ptr<Report> report;  // rank 0 prints
  if (root) {
    const std::string version = mpi_library_version();
    char what[512];
    std::snprintf(what, sizeof what,
                  "Hecate's sparse collectives beside the dense ones, %d rank%s (%s), %s, %s; float32; %d chunks per "
                  "rank, %d in all; median of %d rounds",
                  P, P == 1 ? "" : "s", topo.describe().c_str(), version.c_str(), job.session->thread_level_name(), K, C,
                  opt.repeats);
    report = std::make_unique<Report>("sparse-collectives", what, opt);
    if (P == 1) report->note("one rank moves no data: run it as `mpirun -n 2 moe bench sparse-collectives`");
  }

  std::vector<Sparse> sparse;
  for (double lambda : kLambdas) sparse.push_back(make_sparse(lambda, P));

  // all: every chunk, chunk c at c * n: the dense allgather's output and reduce_scatter's input,
  // and the sparse collectives' chunk buffers (a rank's chunks outside P1 are simply not touched).
  // mine: this rank's K chunks, the dense allgather's input and reduce_scatter's output.
  std::vector<float> all(C * (kMaxChunkBytes / 4)), mine(K * (kMaxChunkBytes / 4)), scratch;
  std::vector<float*> chunks(C);
  std::vector<Row> ag_rows, rs_rows;

  for (int64_t chunk_bytes = kMinChunkBytes; chunk_bytes <= kMaxChunkBytes; chunk_bytes *= 4) {
    const int64_t n = chunk_bytes / 4, dense_moved = int64_t(P - 1) * K * chunk_bytes;
    for (int c = 0; c < C; ++c) chunks[c] = all.data() + c * n;
    const int iters = iterations(int64_t(C) * chunk_bytes);

    // ---- timing, dense and sparse rounds interleaved; zeros keep in-place sums finite ----
    std::fill(all.begin(), all.begin() + C * n, 0.0f);
    std::fill(mine.begin(), mine.begin() + K * n, 0.0f);
    auto dense_ag = [&] { check(world->allgather(mine.data(), K * n, all.data())); };
    auto dense_rs = [&] { check(world->reduce_scatter(all.data(), mine.data(), K * n)); };
    dense_ag(), dense_rs();  // warm-up: first touch, connection set-up
    for (Sparse& s : sparse) {
      check(comm::sparse_allgather(*world, s.ag, chunks, n));
      check(comm::sparse_reduce_scatter(*world, s.rs, chunks, n, &scratch));
      s.ag_times.clear(), s.rs_times.clear();
    }
    std::vector<double> ag_dense_times, rs_dense_times;
    for (int k = 0; k < opt.repeats; ++k) {
      ag_dense_times.push_back(time_calls(raw, iters, dense_ag));
      rs_dense_times.push_back(time_calls(raw, iters, dense_rs));
      for (Sparse& s : sparse) {
        s.ag_times.push_back(time_calls(raw, iters, [&] { check(comm::sparse_allgather(*world, s.ag, chunks, n)); }));
        s.rs_times.push_back(time_calls(
            raw, iters, [&] { check(comm::sparse_reduce_scatter(*world, s.rs, chunks, n, &scratch)); }));
      }
    }

    // ---- one checked call each ----
    // Dense allgather: every chunk everywhere.
    for (int j = 0; j < K; ++j)
      for (int64_t i = 0; i < n; ++i) mine[j * n + i] = param(r * K + j, i);
    std::fill(all.begin(), all.begin() + C * n, -1.0f);
    dense_ag();
    int64_t wrong = 0;
    for (int c = 0; c < C; ++c)
      for (int64_t i = 0; i < n; ++i) wrong += all[c * n + i] != param(c, i);
    const int64_t ag_dense_wrong = sum_over_ranks(raw, wrong);
    // Dense reduce_scatter: every rank contributes to every chunk; this rank's K chunks are summed.
    for (int c = 0; c < C; ++c)
      for (int64_t i = 0; i < n; ++i) all[c * n + i] = partial(r, c, i);
    dense_rs();
    wrong = 0;
    for (int j = 0; j < K; ++j)
      for (int64_t i = 0; i < n; ++i) {
        float want = 0;
        for (int q = 0; q < P; ++q) want += partial(q, r * K + j, i);
        wrong += mine[j * n + i] != want;
      }
    const int64_t rs_dense_wrong = sum_over_ranks(raw, wrong);

    for (Sparse& s : sparse) {
      auto in_p1 = [&](int c) { return std::binary_search(s.p1[c].begin(), s.p1[c].end(), r); };
      // Sparse allgather: the owned chunks hold their values, the replicas arrive, the rest stays -1.
      for (int c = 0; c < C; ++c)
        for (int64_t i = 0; i < n; ++i) all[c * n + i] = c / K == r ? param(c, i) : -1.0f;
      check(comm::sparse_allgather(*world, s.ag, chunks, n));
      wrong = 0;
      for (int c = 0; c < C; ++c)
        for (int64_t i = 0; i < n; ++i) wrong += all[c * n + i] != (in_p1(c) ? param(c, i) : -1.0f);
      Row ag{chunk_bytes, moved_per_rank(s.ag, chunk_bytes), dense_moved, sum_over_ranks(raw, wrong), ag_dense_wrong,
             s.lambda, median(s.ag_times), median(ag_dense_times), s.ag.rounds.size()};
      // Sparse reduce-scatter: the ranks of P1[c] hold partials; the owner gets their sum.
      for (int c = 0; c < C; ++c)
        for (int64_t i = 0; i < n; ++i) all[c * n + i] = in_p1(c) ? partial(r, c, i) : -1.0f;
      check(comm::sparse_reduce_scatter(*world, s.rs, chunks, n, &scratch));
      wrong = 0;
      for (int c = 0; c < C; ++c) {
        if (c / K != r && in_p1(c)) continue;  // a non-owner's accumulator: unspecified
        for (int64_t i = 0; i < n; ++i) {
          float want = -1.0f;
          if (c / K == r) {
            want = 0;
            for (int q : s.p1[c]) want += partial(q, c, i);
          }
          wrong += all[c * n + i] != want;
        }
      }
      Row rs{chunk_bytes, moved_per_rank(s.rs, chunk_bytes), dense_moved, sum_over_ranks(raw, wrong), rs_dense_wrong,
             s.lambda, median(s.rs_times), median(rs_dense_times), s.rs.rounds.size()};
      ag_rows.push_back(ag), rs_rows.push_back(rs);
    }
  }

  if (root) {
    std::string title = "sparse_allgather vs the dense allgather of all chunks (Communicator::allgather); chunks ";
    title += size_str(kMinChunkBytes), title += " .. ", title += size_str(kMaxChunkBytes);
    print_header(*report, title);
    for (const Row& row : ag_rows) print_row(*report, row);
    print_summary(*report, ag_rows);
    print_header(*report, "sparse_reduce_scatter vs the dense reduce_scatter of all chunks (Communicator::reduce_scatter)");
    for (const Row& row : rs_rows) print_row(*report, row);
    print_summary(*report, rs_rows);
  }
  MPI_Comm_free(&raw);
  return root ? report->finish(0) : 0;
}

}  // namespace moe::bench
