// `moe cluster ...`: the emulated cluster of issue 7 (docs/cluster.md). The work is done by
// scripts/cluster.sh (namespaces, veth, bridge, tc and Open MPI's launch are all command-line
// tools); this subcommand finds that script and runs it with the arguments as given, so
// `moe cluster up --nodes 2` and `scripts/cluster.sh up --nodes 2` are the same command.
//
// Finding the script: $MOE_CLUSTER_SCRIPT if set, else <source dir>/scripts/cluster.sh, the source
// directory being compiled in (MOE_SOURCE_DIR, set by src/CMakeLists.txt for the moe target), so a
// build finds its own checkout's script wherever the binary is run from.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "util/shell.h"
#include "util/str_cat.h"

#ifndef MOE_SOURCE_DIR
#define MOE_SOURCE_DIR ""
#endif

namespace moe::cli {

std::string cluster_script() {
  if (const char* s = std::getenv("MOE_CLUSTER_SCRIPT"); s && *s) return s;
  return str_cat(MOE_SOURCE_DIR, "/scripts/cluster.sh");
}

CLI::App* add_cluster_command(CLI::App& app, ClusterFlags* f) {
  CLI::App* c = app.add_subcommand(
      "cluster",
      "an emulated cluster on this machine (root): network namespaces as hosts, capped links; "
      "moe cluster up|down|status|run|cut|heal|kill|shape|check, see docs/cluster.md");
  // Everything after `cluster` belongs to the script, options and `-- command` included.
  c->prefix_command();
  c->allow_extras();
  (void)f;
  return c;
}

int run_cluster(const CLI::App& cmd, ClusterFlags& f) {
  f.args = cmd.remaining();
  const std::string script = cluster_script();
  if (!std::filesystem::exists(script)) {
    std::fprintf(stderr, "moe cluster: cannot find %s (set MOE_CLUSTER_SCRIPT to scripts/cluster.sh of a moe checkout)\n",
                 script.c_str());
    return 1;
  }
  // `moe cluster run -- moe train ...`: the script runs this very binary for `moe` when no moe is on PATH.
  if (const std::string self = self_exe(""); !self.empty()) setenv("MOE_BIN", self.c_str(), 0);
  std::vector<std::string> args{"bash", script};
  args.insert(args.end(), f.args.begin(), f.args.end());
  exec_command(std::move(args));
  std::fprintf(stderr, "%s\n", str_cat("moe cluster: cannot run bash ", script, ": ", std::strerror(errno)).c_str());
  return 1;
}

}  // namespace moe::cli
