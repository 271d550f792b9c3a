// Helpers of the benchmarks that run under mpirun (collectives.cpp, sparse_collectives.cpp,
// transfer_cpu.cpp, cluster.cpp's ranks).
#pragma once

#include <mpi.h>

#include <functional>
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "comm/mpi_communicator.h"
#include "util/status.h"

namespace moe::bench {

// Ends the job (every rank, through mpirun) when st is an error: a benchmark cannot go on after a
// failed collective.
void check(const Status& st);

// The job a benchmark runs in: its MPI session and the world communicator (ends the job when MPI
// cannot start).
struct MpiJob {
  std::unique_ptr<comm::MpiSession> session;
  std::unique_ptr<comm::Communicator> world;
};
MpiJob start_mpi_job();

// The MPI library's version up to its first comma or line end, e.g. "Open MPI v4.1.4".
std::string mpi_library_version();

// Seconds per call of `call`: after a barrier each rank times `iters` back-to-back calls; the slowest
// rank's mean (every rank returns the same value). Collective over `raw`.
double time_calls(MPI_Comm raw, int iters, const std::function<void()>& call);

}  // namespace moe::bench
