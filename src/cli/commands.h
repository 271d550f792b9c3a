// Subcommands of the `moe` command line. Flags map onto the config types of src/; the run_*
// functions return the process exit code.
#pragma once

#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "runtime/train_config.h"
#include "serve/generate.h"
#include "serve/server.h"
#include "sim/simulate.h"

namespace moe::cli {

// `moe train`: flags override the JSON of --config, which overrides the defaults.
struct TrainFlags {
  std::string config_file;
  TrainConfig cfg;  // flag targets; only flags actually given are applied over the JSON
  // --ranks N: start N ranks with mpirun on this machine (the command line re-run under mpirun);
  // 0 = this process is the job (alone, or one of the ranks mpirun started).
  int ranks = 0;
  std::vector<std::string> argv;  // the command line as given, for that re-run
};
CLI::App* add_train_command(CLI::App& app, TrainFlags* flags);
int run_train(const CLI::App& cmd, TrainFlags& flags);

// `moe generate` (src/cli/generate_command.cpp).
struct GenerateFlags {
  serve::GenerateConfig cfg;
  int ranks = 0;                   // as moe train's --ranks
  std::vector<std::string> argv;   // the command line, for the mpirun re-run
};
CLI::App* add_generate_command(CLI::App& app, GenerateFlags* flags);
int run_generate(GenerateFlags& flags);

// `moe serve` (src/cli/serve_command.cpp).
struct ServeFlags {
  serve::ServeConfig cfg;
  int ranks = 0;
  std::vector<std::string> argv;
};
CLI::App* add_serve_command(CLI::App& app, ServeFlags* flags);
int run_serve(ServeFlags& flags);

// `moe bench <name>`
struct BenchFlags {
  std::string name;
  int threads = 2;
  int repeats = 0;  // 0: the bench's own default (run_bench)
  bool skip_torch = false;
  bool json = false;
  std::string html;  // --report FILE (strategies, cluster-strategies)
  std::string only;  // --only TEXT (cluster-strategies and the serving benches)
  std::vector<double> rates;  // --rates CHAT,LONG (serve, cluster-serve)
  std::vector<std::string> schedules;  // --schedules A,B (serve, cluster-serve)
  int in_flight = 0;  // --in-flight N (serve-replay, cluster-serve-replay)
  std::string keep;  // --keep DIR (cluster-strategies)
};
CLI::App* add_bench_command(CLI::App& app, BenchFlags* flags);
int run_bench(const BenchFlags& flags);

// `moe cluster ...`: runs scripts/cluster.sh with the arguments (src/cli/cluster_command.cpp).
struct ClusterFlags {
  std::vector<std::string> args;  // everything after `cluster`
};
CLI::App* add_cluster_command(CLI::App& app, ClusterFlags* flags);
int run_cluster(const CLI::App& cmd, ClusterFlags& flags);
// The script `moe cluster` runs: $MOE_CLUSTER_SCRIPT, else scripts/cluster.sh of the source tree.
std::string cluster_script();

// `moe sim` (src/cli/sim_command.cpp): a simulated run on a modeled cluster, or --calibrate.
struct SimFlags {
  std::string cluster;             // preset name or cluster JSON file
  int nodes = 0;                   // 0: a preset's 1, a file's own
  std::string model;               // ModelConfig JSON (empty: the defaults)
  std::string strategy = "ep";
  std::string load = "uniform";
  int steps = 10;
  int64_t batch = 0;               // global sequences per step (0: 4 per rank)
  int ranks = 0;                   // 0: every device
  int ep_size = 0;                 // 0: largest divisor of ranks and experts
  int64_t allreduce_micro_kb = 256;
  std::string aggregate = "auto";
  bool hierarchical_allreduce = false;
  std::string trace, metrics;
  std::vector<std::string> calibrate;  // runs of one configuration
  std::string out;
  int cpu_cores = -1;    // --calibrate: cores the run's CPU ranks shared (-1: this machine's; 0: accelerators)
  int cpu_threads = 0;   // --calibrate: the run's --threads (0: as moe train resolves 0)
  sim::PlacementOptions placement;  // hecate, fastermoe
};
CLI::App* add_sim_command(CLI::App& app, SimFlags* flags);
int run_sim(const SimFlags& flags);

// `moe report` (src/cli/report_command.cpp): an HTML page of charts from metrics files.
struct ReportFlags {
  std::vector<std::string> metrics;  // one file per run; several compare runs on one page
  std::string trace, sim, out;
  std::string title = "moe report";
};
CLI::App* add_report_command(CLI::App& app, ReportFlags* flags);
int run_report(const ReportFlags& flags);

}  // namespace moe::cli
