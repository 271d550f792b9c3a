// The `moe` command: train, generate, serve, bench, cluster, sim, report. Each subcommand validates everything before any work and
// exits non-zero with one clear message on bad input.
#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli/commands.h"
#include "tensor/ops.h"
#include "util/shell.h"

namespace {

// OpenBLAS reads its settings once, when it loads (before main). Where one of these is unset, re-run
// this same command with it set, before anything else starts; mpirun's ranks inherit them and do not
// re-run. Returns only if it did not re-run.
// - OPENBLAS_CORETYPE, where OpenBLAS fell back to an older kernel than this CPU's instruction set runs
//   (tensor/ops.h: openblas_core_for_isa); a core type the user set is kept.
// - OPENBLAS_THREAD_TIMEOUT=4: after a call OpenBLAS's workers poll (sched_yield) for 2^28 TSC cycles,
//   ~0.1 s, before they sleep, on the CPUs moe's OpenMP threads and transfers need between GEMMs; at 2^4
//   they sleep at once. `moe train --steps 20 --threads 2 --gemm openblas`: 570-585 -> 380-462 ms a
//   step (AVX2 AMD EPYC, 2026-11-27, 2 rounds); with oneDNN as the kernel OpenBLAS runs no GEMM.
void rerun_with_openblas_settings(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  args[0] = moe::self_exe("");
  if (args[0].empty()) return;
  std::vector<const char*> set;
  if (!std::getenv("OPENBLAS_CORETYPE"))
    if (const std::string core = moe::openblas_core_for_this_cpu(moe::openblas_kernel()); !core.empty())
      setenv("OPENBLAS_CORETYPE", core.c_str(), 1), set.push_back("OPENBLAS_CORETYPE");
  if (!std::getenv("OPENBLAS_THREAD_TIMEOUT"))
    setenv("OPENBLAS_THREAD_TIMEOUT", "4", 1), set.push_back("OPENBLAS_THREAD_TIMEOUT");
  if (set.empty()) return;
  moe::exec_command(std::move(args));
  for (const char* name : set) unsetenv(name);  // could not re-run: the environment says what OpenBLAS runs with
}

}  // namespace

int main(int argc, char** argv) {
  rerun_with_openblas_settings(argc, argv);
  // A write past a file-size limit (ulimit -f, a quota) then fails with EFBIG, which the checkpoint
  // writer reports and recovers from, instead of killing the process with SIGXFSZ mid-write.
  std::signal(SIGXFSZ, SIG_IGN);
  CLI::App app{"moe: Mixture-of-Experts training on real ranks (see README.md)"};
  app.require_subcommand(1);
  moe::cli::TrainFlags train;
  train.argv.assign(argv, argv + argc);
  CLI::App* train_cmd = moe::cli::add_train_command(app, &train);
  moe::cli::GenerateFlags generate;
  generate.argv.assign(argv, argv + argc);
  CLI::App* generate_cmd = moe::cli::add_generate_command(app, &generate);
  moe::cli::ServeFlags serve;
  serve.argv.assign(argv, argv + argc);
  CLI::App* serve_cmd = moe::cli::add_serve_command(app, &serve);
  moe::cli::BenchFlags bench;
  CLI::App* bench_cmd = moe::cli::add_bench_command(app, &bench);
  moe::cli::ClusterFlags cluster;
  CLI::App* cluster_cmd = moe::cli::add_cluster_command(app, &cluster);
  moe::cli::SimFlags sim;
  CLI::App* sim_cmd = moe::cli::add_sim_command(app, &sim);
  moe::cli::ReportFlags report;
  CLI::App* report_cmd = moe::cli::add_report_command(app, &report);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // Every bad flag or configuration exits 2 (a failure while running exits 1); --help exits 0.
    return app.exit(e) == 0 ? 0 : 2;
  }
  try {
    if (train_cmd->parsed()) return moe::cli::run_train(*train_cmd, train);
    if (generate_cmd->parsed()) return moe::cli::run_generate(generate);
    if (serve_cmd->parsed()) return moe::cli::run_serve(serve);
    if (bench_cmd->parsed()) return moe::cli::run_bench(bench);
    if (cluster_cmd->parsed()) return moe::cli::run_cluster(*cluster_cmd, cluster);
    if (sim_cmd->parsed()) return moe::cli::run_sim(sim);
    if (report_cmd->parsed()) return moe::cli::run_report(report);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
