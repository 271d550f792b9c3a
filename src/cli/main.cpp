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

// OpenBLAS picks its kernel once, when it loads (before main). Where it fell back to an older kernel
// than this CPU's instruction set runs (tensor/ops.h: openblas_core_for_isa) and no core type is set,
// re-run this same command with OPENBLAS_CORETYPE set, before anything else starts; mpirun's ranks
// inherit it and do not re-run. Returns only if it did not re-run.
void rerun_with_openblas_kernel_for_isa(int argc, char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE")) return;  // the user's (or a parent moe's) choice
  const std::string core = moe::openblas_core_for_this_cpu(moe::openblas_kernel());
  if (core.empty()) return;
  std::vector<std::string> args(argv, argv + argc);
  args[0] = moe::self_exe("");
  if (args[0].empty()) return;
  setenv("OPENBLAS_CORETYPE", core.c_str(), 1);
  moe::exec_command(std::move(args));
  unsetenv("OPENBLAS_CORETYPE");  // could not re-run: go on with OpenBLAS's own kernel
}

}  // namespace

int main(int argc, char** argv) {
  rerun_with_openblas_kernel_for_isa(argc, argv);
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
    return app.exit(e);
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
