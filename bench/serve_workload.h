// What bench serve, cluster-serve and serve-replay send their servers (serve.cpp): real-text prompts
// whose domains are skewed, in two workloads, and the model they serve.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/bench.h"
#include "util/status.h"

namespace moe::bench {

struct Prompt {
  std::string text;
  std::string continuation;  // the bytes that follow text in its source (make_prompts' continuation_bytes)
  bool other_domain = false;
};

// Prompts of [prompt_min, prompt_max] bytes, max_tokens new tokens each, to a server with
// slots_per_rank sequences per rank; `clients` requests in flight find the closed-loop throughput.
struct Workload {
  std::string name;
  int prompt_min = 0, prompt_max = 0;
  int64_t max_tokens = 0;
  int slots_per_rank = 0;
  int clients = 0;
};
// chat (32-64 prompt bytes, 48 new tokens, 8 slots per rank) and long prompts (96-120, 8, 32).
const std::vector<Workload>& serve_workloads();
// Whether --only (opt.only) selects w: its name contains the text (every workload when empty).
bool workload_selected(const Workload& w, const BenchOptions& opt);
// False, said on stderr as "moe bench <bench>: ...", where opt.only leaves no workload.
bool some_workload_matches(const BenchOptions& opt, const char* bench);
// The serving benches' schedules, all of `moe serve --schedule`'s, in their tables' order: ideal, ep, lina,
// lina-no-estimate, lina-no-phase2 (serve::schedule_name's names; serve-replay parses them).
const std::vector<std::string>& serve_schedules();

// 400 prompts of w's lengths: windows of the Python docs' validation split and, one in five, of the
// GPL-3, each with the continuation_bytes that follow it in its text (the same prompts whatever
// continuation_bytes is). Errors: a corpus that cannot be read.
Status make_prompts(const Workload& w, int64_t continuation_bytes, std::vector<Prompt>* out);

// The checkpoint the serving benches serve: $MOE_BENCH_CHECKPOINT, else the bench's model trained into
// `scratch` on 2 ranks (about 5 minutes; empty on failure, said on stderr).
std::string bench_checkpoint(const ScratchDir& scratch);

}  // namespace moe::bench
