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
  c->add_option("--checkpoint", s.checkpoint, "checkpoint folder (moe train --checkpoint-dir)")->required();
  c->add_option("--host", s.host, "address to listen on");
  c->add_option("--port", s.port, "port (0: any free one, printed)");
  c->add_option("--slots-per-rank", s.slots_per_rank, "sequences each rank runs at once");
  c->add_option("--max-queue", s.max_queue, "requests that may wait for a slot (more: 503)");
  c->add_option("--ranks", f->ranks, "spread the experts over N ranks started with mpirun (or run under mpirun yourself)")
      ->check(CLI::NonNegativeNumber);
  c->add_option("--schedule", s.schedule, "where experts run across ranks: ep, lina, lina-no-estimate, lina-no-phase2, or ideal (a balanced gate: a latency reference, not text)");
  c->add_option("--threads", s.threads, "compute threads per rank (0: as moe train decides)");
  c->add_option("--gemm", s.gemm, "GEMM kernel: onednn or openblas (default: the checkpoint's)");
  c->add_option("--comm-timeout", s.comm_timeout_s, "seconds a collective may take before the job stops");
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
