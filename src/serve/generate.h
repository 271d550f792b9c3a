// `moe generate`: a prompt's continuation from a checkpoint, streamed as it is produced, on one
// process or over the ranks mpirun started (the experts spread over them, the sequence on rank 0).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

#include "serve/job.h"
#include "serve/sampler.h"
#include "util/status.h"

namespace moe::serve {

struct GenerateConfig {
  InferenceOptions run;
  std::string prompt;
  int64_t max_tokens = 200;
  SamplingParams sampling;
  Status validate() const;  // errors name the flag
};

// Runs the generation: rank 0 writes the continuation's bytes to `out` as each is produced (flushed)
// and a summary line to stderr. Under mpirun every rank calls it; alone it is one process.
// A model whose context (seq_len) fills up keeps generating from its last seq_len / 2 tokens
// (recomputed: the positions are learned, so the cache cannot be shifted).
Status run_generate(const GenerateConfig& cfg, std::FILE* out);

}  // namespace moe::serve
