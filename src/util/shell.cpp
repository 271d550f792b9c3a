// run_shell: see shell.h.
#include "util/shell.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string_view>
#include <thread>

extern char** environ;

namespace moe {

ShellResult run_shell(const std::string& command) {
  ShellResult r;
  FILE* p = popen(("(" + command + ") 2>&1").c_str(), "r");
  if (!p) return r;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) r.output.append(buf, n);
  const int st = pclose(p);
  r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : 128;
  return r;
}

std::string executable_path(const std::string& target, bool* replaced) {
  static constexpr std::string_view kDeleted = " (deleted)";
  const bool was = target.size() > kDeleted.size() && target.ends_with(kDeleted);
  if (replaced) *replaced = was;
  return was ? target.substr(0, target.size() - kDeleted.size()) : target;
}

std::string self_exe(const std::string& fallback) {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return fallback;
  bool replaced = false;
  const std::string path = executable_path(std::string(buf, n), &replaced);
  static std::atomic<bool> said{false};
  if (replaced && !said.exchange(true))
    std::fprintf(stderr, "moe: %s was replaced on disk while this process ran (rebuilt?); what it starts from now "
                         "on is the new file\n", path.c_str());
  return path;
}

namespace {
// A waitpid status as a shell reports it: the exit code, or 128 + the signal that ended it.
int exit_status(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status); }
}  // namespace

BackgroundProcess::BackgroundProcess(const std::string& command, const std::string& log) : log_(log) {
  std::ofstream(log, std::ios::trunc).flush();
  const std::string cmd = "exec " + command + " 2>" + log;
  const char* argv[] = {"/bin/sh", "-c", cmd.c_str(), nullptr};
  pid_t pid = -1;
  if (posix_spawn(&pid, "/bin/sh", nullptr, nullptr, const_cast<char* const*>(argv), environ) == 0) pid_ = pid;
}

BackgroundProcess::~BackgroundProcess() {
  if (pid_ > 0) stop(60);
}

std::string BackgroundProcess::log() const {
  std::ifstream f(log_);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

int BackgroundProcess::wait_for_int_after(const std::string& marker, double timeout_s) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (pid_ > 0) {
    const std::string text = log();
    const size_t at = text.find(marker);
    if (at != std::string::npos) return std::atoi(text.c_str() + at + marker.size());
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {  // ended (reaped here: stop() has nothing to stop)
      exit_code_ = exit_status(status);
      pid_ = -1;
      return 0;
    }
    if (std::chrono::steady_clock::now() > end) return 0;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return 0;
}

int BackgroundProcess::stop(double grace_s) {
  if (pid_ <= 0) return exit_code_;
  ::kill(pid_, SIGTERM);
  int status = 0;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(grace_s);
  while (std::chrono::steady_clock::now() < end) {
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return exit_status(status);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, &status, 0);
  pid_ = -1;
  return -1;
}

void exec_command(std::vector<std::string> args) {
  std::vector<char*> c_args;
  for (std::string& a : args) c_args.push_back(a.data());
  c_args.push_back(nullptr);
  std::fflush(stdout);
  execvp(c_args[0], c_args.data());
}

}  // namespace moe
