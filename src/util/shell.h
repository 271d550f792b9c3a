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

// Put before a command that starts mpirun: lets Open MPI run as root and start more ranks than cores
// (other MPIs ignore these variables). Ends with a space.
inline constexpr const char* kMpirunEnv =
    "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 ";

// Runs `command` (any shell syntax: it runs as `(command) 2>&1`) and waits for it. Blocks; no timeout
// of its own (put `timeout` in the command).
ShellResult run_shell(const std::string& command);

// This process's executable (/proc/self/exe), or `fallback` when it cannot be read. Where the file was
// replaced while this process runs (a rebuild), the new file's path, said once on stderr: the link
// then reads "PATH (deleted)", which a shell command line would choke on.
std::string self_exe(const std::string& fallback);
// The executable's path from /proc/self/exe's target: `target` without the " (deleted)" Linux
// appends once the file was replaced or removed. *replaced (optional): whether it was there.
std::string executable_path(const std::string& target, bool* replaced = nullptr);

// A command started in the background (`exec COMMAND 2>LOG` through /bin/sh, so the pid is the
// command's own), for the tests and benchmarks that drive a server: wait for a line in its log, read
// the log, stop it with SIGTERM. The destructor stops it if it still runs. Thread safety: none.
class BackgroundProcess {
 public:
  // log: its stderr, truncated first (text read from an older process's log would mislead).
  BackgroundProcess(const std::string& command, const std::string& log);
  ~BackgroundProcess();
  BackgroundProcess(const BackgroundProcess&) = delete;
  BackgroundProcess& operator=(const BackgroundProcess&) = delete;
  bool started() const { return pid_ > 0; }
  std::string log() const;
  // The integer right after the first `marker` in the log, waiting for it up to timeout_s; 0 when it
  // never came or the process ended first. E.g. the port of "listening on http://127.0.0.1:PORT".
  int wait_for_int_after(const std::string& marker, double timeout_s);
  // SIGTERM, then the exit status (128 + signal when a signal ended it); SIGKILL and -1 when it has not
  // ended after grace_s. When it had already ended: that exit status.
  int stop(double grace_s);

 private:
  std::string log_;
  int pid_ = -1;
  int exit_code_ = -1;
};

// Replaces this process with args[0] (found on PATH like execvp) run with args, stdout flushed first.
// Returns only if that failed (errno says why). REQUIRES: args non-empty.
void exec_command(std::vector<std::string> args);

}  // namespace moe
