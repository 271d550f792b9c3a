#include "cli/launch.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "util/shell.h"

namespace moe::cli {

namespace {

// As root, OpenMPI wants an explicit permission; with more ranks than cores, oversubscription (both
// only for this job, through its environment).
int launch(const std::vector<std::string>& argv, int ranks, const std::string& command) {
  std::vector<std::string> args{"mpirun", "-n", std::to_string(ranks)};
  const unsigned cores = std::thread::hardware_concurrency();
  if (cores > 0 && static_cast<unsigned>(ranks) > cores) args.push_back("--oversubscribe");
  if (geteuid() == 0) {
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 0);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 0);
  }
  args.push_back(self_exe(argv.at(0)));
  for (size_t i = 1; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (a == "--ranks") {
      ++i;  // and its value
      continue;
    }
    if (a.rfind("--ranks=", 0) == 0) continue;
    args.push_back(a);
  }
  exec_command(std::move(args));
  std::fprintf(stderr, "%s: --ranks %d: cannot run mpirun (%s); scripts/setup.sh installs OpenMPI\n", command.c_str(),
               ranks, std::strerror(errno));
  return 1;
}

}  // namespace

int run_under_mpirun(const std::vector<std::string>& argv, int ranks, const std::string& command) {
  if (ranks <= 0) return -1;
  if (const char* size = std::getenv("OMPI_COMM_WORLD_SIZE")) {
    if (std::atoi(size) == ranks) return -1;
    std::fprintf(stderr, "%s: --ranks %d, but mpirun started %s ranks\n", command.c_str(), ranks, size);
    return 2;
  }
  if (ranks == 1) return -1;
  return launch(argv, ranks, command);
}

void add_inference_options(CLI::App* c, serve::InferenceOptions* opt, int* ranks) {
  c->add_option("--checkpoint", opt->checkpoint, "checkpoint folder (moe train --checkpoint-dir)")->required();
  c->add_option("--ranks", *ranks, "spread the experts over N ranks started with mpirun (or run under mpirun yourself)")
      ->check(CLI::NonNegativeNumber);
  c->add_option("--schedule", opt->schedule,
                "where experts run across ranks: ep, lina, lina-no-estimate, lina-no-phase2, or ideal (a balanced "
                "gate: a latency reference, not text)");
  c->add_option("--replica-cache", opt->replica_cache,
                "lina schedules: replicas of other ranks' experts a rank keeps per MoE layer while unused, bought by "
                "rent or buy (-1: as many as it owns; 0: only the current plan's)")
      ->check(CLI::Range(-1, 1 << 20));
  c->add_option("--threads", opt->threads, "compute threads per rank (0: as moe train decides)");
  c->add_option("--gemm", opt->gemm, "GEMM kernel: onednn or openblas (default: the checkpoint's)");
  c->add_option("--comm-timeout", opt->comm_timeout_s, "seconds a collective may take before the job stops");
}

}  // namespace moe::cli
