// Helpers of the benchmarks that run under mpirun (collectives.cpp, sparse_collectives.cpp).
#pragma once

#include <mpi.h>

#include <functional>

#include "util/status.h"

namespace moe::bench {

// Ends the job (every rank, through mpirun) when st is an error: a benchmark cannot go on after a
// failed collective.
void check(const Status& st);

// Seconds per call of `call`: after a barrier each rank times `iters` back-to-back calls; the slowest
// rank's mean (every rank returns the same value). Collective over `raw`.
double time_calls(MPI_Comm raw, int iters, const std::function<void()>& call);

}  // namespace moe::bench
