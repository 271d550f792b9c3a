// `--ranks N` for any command, and the flags the inference commands share: run this command line again under `mpirun -n N` (without --ranks), or,
// when mpirun already started this process, check that it started N.
#pragma once

#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "serve/job.h"

namespace moe::cli {

// Returns -1 when this process should go on with the command (no --ranks, --ranks 1, or the rank
// count mpirun started matches); else the exit code to return (mpirun could not start, or a
// mismatch), with one message naming `command` (e.g. "moe train") on stderr. On success of the
// re-run it does not return (the process becomes mpirun).
int run_under_mpirun(const std::vector<std::string>& argv, int ranks, const std::string& command);

// The flags every inference command takes (moe generate, moe serve): --checkpoint, --ranks, --schedule,
// --threads, --gemm, --comm-timeout.
void add_inference_options(CLI::App* command, serve::InferenceOptions* opt, int* ranks);

}  // namespace moe::cli
