#include <cstdio>

#include "cli/commands.h"

namespace moe::cli {

CLI::App* add_bench_command(CLI::App& app, BenchFlags* f) {
  CLI::App* c = app.add_subcommand("bench", "run a benchmark and print its table");
  c->add_option("name", f->name, "benchmark: moe-layer")->required()->check(CLI::IsMember({"moe-layer"}));
  c->add_option("--threads", f->threads, "compute threads");
  c->add_option("--repeats", f->repeats, "timed repetitions (the median is reported)");
  c->add_flag("--skip-torch", f->skip_torch, "do not run the PyTorch peer");
  return c;
}

int run_bench(const BenchFlags& f) {
  std::fprintf(stderr, "moe bench: %s not built yet\n", f.name.c_str());
  return 1;
}

}  // namespace moe::cli
