#include <algorithm>
#include <cstdio>

#include "bench/bench.h"
#include "bench/serve_workload.h"
#include "cli/commands.h"

namespace moe::cli {

CLI::App* add_bench_command(CLI::App& app, BenchFlags* f) {
  CLI::App* c = app.add_subcommand("bench", "run a benchmark and print its table (see bench/README.md)");
  c->add_option("name", f->name,
                "benchmark: moe-layer, decode, serve, serve-replay, collectives (under mpirun), ep-training, "
                "sparse-collectives (under mpirun), "
                "transfer-cpu (under mpirun, one rank per host), strategies, "
                "cluster-collectives, cluster-ep-training, cluster-strategies, cluster-serve, cluster-serve-replay "
                "(root: emulated cluster), sim, sim-fidelity, sim-strategies, "
                "cuda (GPU kernels; needs a CUDA build and a GPU)")
      ->required()
      ->check(CLI::IsMember({"moe-layer", "decode", "serve", "serve-replay", "collectives", "ep-training",
                             "sparse-collectives", "transfer-cpu", "strategies", "cluster-collectives",
                             "cluster-ep-training", "cluster-strategies", "cluster-serve", "cluster-serve-replay", "sim",
                             "sim-fidelity", "sim-strategies", "cuda"}));
  c->add_option("--threads", f->threads, "compute threads")->check(CLI::PositiveNumber);
  c->add_option("--repeats", f->repeats,
                "timed repetitions or interleaved rounds (the median is reported; default 5, cluster-strategies 2)")
      ->check(CLI::PositiveNumber);
  c->add_flag("--skip-torch", f->skip_torch, "do not run the PyTorch peer");
  c->add_flag("--json", f->json, "print the report as one JSON document (progress stays on stderr)");
  c->add_option("--report", f->html,
                "strategies, cluster-strategies: also write their runs' metrics as one moe report HTML page to FILE "
                "(cluster-strategies: one page per configuration, FILE's name with the configuration inserted)");
  c->add_option("--only", f->only,
                "cluster-strategies: only the configurations whose name contains TEXT (names such as 2x1-1gbit-skew1.5, "
                "2x2-10gbit-skew0); serve, cluster-serve, serve-replay, cluster-serve-replay: only the workloads "
                "whose name contains it (chat, long prompts)");
  c->add_option("--schedules", f->schedules,
                "serve, cluster-serve: only these schedules, ep among them (the reference), e.g. ep,lina for more "
                "rounds of the pair in the same time (default: ideal, ep, lina, lina-no-estimate, lina-no-phase2)")
      ->delimiter(',')
      ->check(CLI::IsMember(bench::serve_schedules()));
  c->add_option("--in-flight", f->in_flight,
                "serve-replay, cluster-serve-replay: sequences in flight at once (default: the workload's closed "
                "loop, 8 for chat and 32 for long prompts; bench serve's open loop at 70% load keeps fewer)")
      ->check(CLI::PositiveNumber);
  c->add_option("--keep", f->keep,
                "cluster-strategies: copy every run's metrics, the calibration runs and each configuration's "
                "calibrated cluster JSON to DIR, with runs.tsv saying which file is which run");
  c->add_option("--rates", f->rates,
                "serve, cluster-serve: Poisson arrivals per second for the two workloads, chat and long prompts (e.g. "
                "115,160), instead of 70% of ep's closed-loop throughput measured first: runs on different days then "
                "sit at the same load")
      ->delimiter(',')
      ->check(CLI::PositiveNumber);
  return c;
}

int run_bench(const BenchFlags& f) {
  if (!f.html.empty() && f.name != "strategies" && f.name != "cluster-strategies") {
    std::fprintf(stderr, "moe bench %s: --report is for strategies and cluster-strategies (the benches that train)\n",
                 f.name.c_str());
    return 2;
  }
  const bool serving = f.name == "serve" || f.name == "cluster-serve";
  const bool replay = f.name == "serve-replay" || f.name == "cluster-serve-replay";
  if (!f.only.empty() && f.name != "cluster-strategies" && !serving && !replay) {
    std::fprintf(stderr, "moe bench %s: --only is for cluster-strategies and the serving benches\n", f.name.c_str());
    return 2;
  }
  if (f.in_flight > 0 && !replay) {
    std::fprintf(stderr, "moe bench %s: --in-flight is for serve-replay and cluster-serve-replay\n", f.name.c_str());
    return 2;
  }
  if (!f.schedules.empty() && !serving) {
    std::fprintf(stderr, "moe bench %s: --schedules is for serve and cluster-serve\n", f.name.c_str());
    return 2;
  }
  if (!f.schedules.empty() && std::find(f.schedules.begin(), f.schedules.end(), "ep") == f.schedules.end()) {
    std::fprintf(stderr, "moe bench %s: --schedules must include ep, the reference every schedule is compared with\n",
                 f.name.c_str());
    return 2;
  }
  if (!f.keep.empty() && f.name != "cluster-strategies") {
    std::fprintf(stderr, "moe bench %s: --keep is for cluster-strategies\n", f.name.c_str());
    return 2;
  }
  if (!f.rates.empty() && f.name != "serve" && f.name != "cluster-serve") {
    std::fprintf(stderr, "moe bench %s: --rates is for serve and cluster-serve\n", f.name.c_str());
    return 2;
  }
  if (!f.rates.empty() && f.rates.size() != 2) {
    std::fprintf(stderr, "moe bench %s: --rates takes two rates, chat and long prompts (e.g. 115,160); got %zu\n",
                 f.name.c_str(), f.rates.size());
    return 2;
  }
  // cluster-strategies' rounds take minutes each, so it runs 2 unless told; a --repeats given is kept
  // whatever its value (5 included).
  const int repeats = f.repeats > 0 ? f.repeats : f.name == "cluster-strategies" ? 2 : 5;
  bench::BenchOptions opt{f.threads, repeats, f.skip_torch, f.json, f.html, f.only, f.schedules, f.in_flight,
                          f.rates, f.keep};
  if (f.name == "decode") return bench::decode(opt);
  if (f.name == "serve") return bench::serve(opt);
  if (f.name == "serve-replay") return bench::serve_replay(opt);
  if (f.name == "cluster-serve-replay") return bench::cluster_serve_replay(opt);
  if (f.name == "collectives") return bench::collectives(opt);
  if (f.name == "ep-training") return bench::ep_training(opt);
  if (f.name == "sparse-collectives") return bench::sparse_collectives(opt);
  if (f.name == "transfer-cpu") return bench::transfer_cpu(opt);
  if (f.name == "strategies") return bench::strategies(opt);
  if (f.name == "sim") return bench::sim_speed(opt);
  if (f.name == "sim-fidelity") return bench::sim_fidelity(opt);
  if (f.name == "sim-strategies") return bench::sim_strategies(opt);
  if (f.name == "cluster-collectives") return bench::cluster_collectives(opt);
  if (f.name == "cluster-ep-training") return bench::cluster_ep_training(opt);
  if (f.name == "cluster-strategies") return bench::cluster_strategies(opt);
  if (f.name == "cluster-serve") return bench::cluster_serve(opt);
  if (f.name == "cuda") {
#ifdef MOE_HAVE_CUDA
    return bench::cuda_kernels(opt);
#else
    std::fprintf(stderr, "moe bench cuda: this moe was built without CUDA (no nvcc when it was configured)\n");
    return 1;
#endif
  }
  return bench::moe_layer(opt);
}

}  // namespace moe::cli
