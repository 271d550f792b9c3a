// `moe serve`: an HTTP completions endpoint over a checkpoint (src/serve/server.h).
#include <cstdio>

#include "cli/commands.h"
#include "cli/launch.h"
#include "serve/server.h"

namespace moe::cli {

CLI::App* add_serve_command(CLI::App& app, ServeFlags* f) {
  CLI::App* c = app.add_subcommand(
      "serve", "serve a checkpoint over HTTP (POST /v1/completions, GET /metrics), batching requests continuously");
  serve::ServeConfig& s = f->cfg;
  c->add_option("--host", s.host, "address to listen on");
  c->add_option("--port", s.port, "port (0: any free one, printed)");
  c->add_option("--slots-per-rank", s.slots_per_rank, "sequences each rank runs at once");
  c->add_option("--max-queue", s.max_queue, "requests that may wait for a slot (more: 503)");
  add_inference_options(c, &f->cfg.run, &f->ranks);
  return c;
}

int run_serve(ServeFlags& f) {
  if (Status s = f.cfg.validate(); !s) {
    std::fprintf(stderr, "moe serve: %s\n", s.message().c_str());
    return 2;
  }
  if (int code = run_under_mpirun(f.argv, f.ranks, "moe serve"); code >= 0) return code;
  if (Status s = serve::run_serve(f.cfg); !s) {
    std::fprintf(stderr, "moe serve: %s\n", s.message().c_str());
    return 1;
  }
  return 0;
}

}  // namespace moe::cli
