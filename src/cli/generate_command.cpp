// `moe generate`: a prompt's continuation from a checkpoint (src/serve/generate.h).
#include <cstdio>

#include "cli/commands.h"
#include "cli/launch.h"
#include "serve/generate.h"

namespace moe::cli {

CLI::App* add_generate_command(CLI::App& app, GenerateFlags* f) {
  CLI::App* c = app.add_subcommand("generate", "continue a prompt with a trained checkpoint (text streamed to stdout)");
  serve::GenerateConfig& g = f->cfg;
  c->add_option("--prompt", g.prompt, "text to continue (bytes; at most the model's seq_len)")->required();
  c->add_option("--max-tokens", g.max_tokens, "tokens (bytes) to generate");
  c->add_option("--temperature", g.sampling.temperature, "sampling temperature (0: greedy)");
  c->add_option("--top-k", g.sampling.top_k, "sample among the k most likely tokens (0: all)");
  c->add_option("--top-p", g.sampling.top_p, "then among the smallest set of probability >= p (1: all)");
  c->add_option("--seed", g.sampling.seed, "sampling seed (the same tokens for the same seed, on any rank count)");
  add_inference_options(c, &f->cfg.run, &f->ranks);
  return c;
}

int run_generate(GenerateFlags& f) {
  if (Status s = f.cfg.validate(); !s) {
    std::fprintf(stderr, "moe generate: %s\n", s.message().c_str());
    return 2;
  }
  if (int code = run_under_mpirun(f.argv, f.ranks, "moe generate"); code >= 0) return code;
  if (Status s = serve::run_generate(f.cfg, stdout); !s) {
    std::fprintf(stderr, "moe generate: %s\n", s.message().c_str());
    return 1;
  }
  return 0;
}

}  // namespace moe::cli
