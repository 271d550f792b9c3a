// run_shell: see shell.h.
#include "util/shell.h"

#include <sys/wait.h>

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

}  // namespace moe
