// run_shell: a command line run to completion through /bin/sh, for the tests and benchmarks that drive
// `moe`, mpirun, python or scripts/cluster.sh as a user would.
#pragma once

#include <string>

namespace moe {

struct ShellResult {
  int exit_code = -1;  // the command's exit status; 128 when a signal ended it; -1 when it could not start
  std::string output;  // its stdout and stderr together, in the order written
};

// Runs `command` (any shell syntax: it runs as `(command) 2>&1`) and waits for it. Blocks; no timeout
// of its own (put `timeout` in the command).
ShellResult run_shell(const std::string& command);

}  // namespace moe
