// The next token from a row's logits. Each request has its own generator, seeded from (seed,
// stream), so the tokens drawn depend only on the request and its logits: not on the rank that ran
// it, nor on the other requests batched with it.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "util/status.h"

namespace moe::serve {

struct SamplingParams {
  double temperature = 0.0;  // 0: greedy (the most likely token; ties to the lower id)
  int64_t top_k = 0;         // keep the k most likely tokens (0: all)
  double top_p = 1.0;        // then the smallest set whose probability reaches p (1: all)
  uint64_t seed = 0;
  // Errors name the field: temperature < 0 or not finite, top_k < 0, top_p not in (0, 1].
  Status validate() const;
};

// Thread safety: none; one per request.
class Sampler {
 public:
  // stream: tells the generators of one seed apart (the request's number in a server; 0 in generate).
  Sampler(const SamplingParams& p, uint64_t stream);
  // logits [V]. Softmax of logits / temperature (in double) over the tokens top_k and top_p keep,
  // then one draw by inverse CDF from a 53-bit uniform. REQUIRES: V >= 1, finite logits.
  int32_t next(const float* logits, int64_t V);

 private:
  SamplingParams p_;
  std::mt19937_64 rng_;
  std::vector<int32_t> order_;
  std::vector<double> prob_;
};

}  // namespace moe::serve
