// `--ranks N` for any command: run this command line again under `mpirun -n N` (without --ranks), or,
// when mpirun already started this process, check that it started N.
#pragma once

#include <string>
#include <vector>

namespace moe::cli {

// Returns -1 when this process should go on with the command (no --ranks, --ranks 1, or the rank
// count mpirun started matches); else the exit code to return (mpirun could not start, or a
// mismatch), with one message naming `command` (e.g. "moe train") on stderr. On success of the
// re-run it does not return (the process becomes mpirun).
int run_under_mpirun(const std::vector<std::string>& argv, int ranks, const std::string& command);

}  // namespace moe::cli
