// run_shell: a command line run to completion through /bin/sh, for the tests and benchmarks that drive
// `moe`, mpirun, python or scripts/cluster.sh as a user would; self_exe and exec_command, for the
// `moe` commands that start this binary again (under mpirun, on an emulated cluster).
#pragma once

#include <string>
#include <vector>

namespace moe {

struct ShellResult {
  int exit_code = -1;  // the command's exit status; 128 when a signal ended it; -1 when it could not start
  std::string output;  // its stdout and stderr together, in the order written
};

// Runs `command` (any shell syntax: it runs as `(command) 2>&1`) and waits for it. Blocks; no timeout
// of its own (put `timeout` in the command).
ShellResult run_shell(const std::string& command);

// This process's executable (/proc/self/exe), or `fallback` when it cannot be read.
std::string self_exe(const std::string& fallback);

// Replaces this process with args[0] (found on PATH like execvp) run with args, stdout flushed first.
// Returns only if that failed (errno says why). REQUIRES: args non-empty.
void exec_command(std::vector<std::string> args);

}  // namespace moe
