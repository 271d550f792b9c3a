// run_shell: see shell.h.
#include "util/shell.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>

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

std::string self_exe(const std::string& fallback) {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, n) : fallback;
}

void exec_command(std::vector<std::string> args) {
  std::vector<char*> c_args;
  for (std::string& a : args) c_args.push_back(a.data());
  c_args.push_back(nullptr);
  std::fflush(stdout);
  execvp(c_args[0], c_args.data());
}

}  // namespace moe
