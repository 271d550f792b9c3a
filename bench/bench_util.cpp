// Helpers every benchmark uses: see bench.h.
#include <algorithm>
#include <cstdlib>
#include <string>

#include "bench/bench.h"
#include "bench/mpi_bench.h"
#include "comm/mpi_communicator.h"

namespace moe::bench {

std::string torch_peer_script() {
  if (const char* dir = std::getenv("MOE_BENCH_DIR")) return std::string(dir) + "/torch_moe_layer_peer.py";
  return std::string(MOE_SOURCE_DIR) + "/bench/torch_moe_layer_peer.py";
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void check(const Status& st) {
  if (!st) comm::abort_job(st);
}

double time_calls(MPI_Comm raw, int iters, const std::function<void()>& call) {
  MPI_Barrier(raw);
  double t0 = MPI_Wtime();
  for (int i = 0; i < iters; ++i) call();
  double t = (MPI_Wtime() - t0) / iters;
  MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, raw);
  return t;
}

}  // namespace moe::bench
