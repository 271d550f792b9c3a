// `moe serve`: expert-parallel inference behind an HTTP endpoint, with continuous batching.
//
// Rank 0 runs the HTTP server (cpp-httplib; one thread per open connection) and the scheduler loop
// on its main thread; every rank holds an InferenceEngine and follows rank 0's steps (lockstep.h).
// A request that arrives joins the running batch at the next step: its prompt is prefilled in the
// same forward as the other sequences' decode rows, then it decodes one token per step until
// max_tokens; its KV-cache slot is then free for the next request.
//
// Endpoints (OpenAI's completions shape, which client scripts already speak):
//   POST /v1/completions  {"prompt": str, "max_tokens": int (16), "temperature": num (1), "top_p": num (1),
//                          "top_k": int (0, an extension), "seed": int (the request's number), "stream": bool}
//        -> {"id", "object": "text_completion", "created", "model", "choices": [{"text", "index": 0,
//            "finish_reason": "length"}], "usage": {"prompt_tokens", "completion_tokens", "total_tokens"}}
//        stream: server-sent events "data: {...choices[0].text: the new text...}\n\n", then "data: [DONE]\n\n"
//        A malformed request: 400 {"error": {"message", "type": "invalid_request_error"}}.
//   GET /metrics   Prometheus text: requests, tokens, tokens/s, latency and time-to-first-token quantiles,
//                  and with a Lina schedule its estimation accuracy, re-plans and replicas
//   GET /health    200 "ok"
// Text is bytes (the model is byte-level): a stream holds back a UTF-8 character until all its bytes
// are out, and bytes that are not UTF-8 become U+FFFD in the JSON.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "serve/job.h"
#include "util/status.h"

namespace moe::serve {

struct ServeConfig {
  InferenceOptions run;
  std::string host = "127.0.0.1";
  int port = 8000;                // 0: any free port (printed)
  int64_t slots_per_rank = 8;     // sequences each rank holds at once
  int64_t max_queue = 256;        // requests waiting beyond that get 503
  Status validate() const;
};

// The rank a waiting prompt of `need` rows joins this step (the scheduler's admission): among the ranks
// with a free slot whose rows this step (`used`) leave room for it under max_rows, the one with the
// fewest rows this step, then the most free slots, then the lowest index; -1 when none has room. By
// rows first, so two prompts arriving together are prefilled on two ranks rather than one: a step
// lasts as long as its busiest rank. REQUIRES: used and free_slots of one size (the ranks).
int admission_rank(const std::vector<int64_t>& used, const std::vector<int64_t>& free_slots, int64_t need,
                   int64_t max_rows);

// Serves until SIGINT or SIGTERM (then finishes the running requests' HTTP answers with what they
// have, stops the ranks and returns ok). Under mpirun every rank calls it. Rank 0 prints
// "serve: listening on http://HOST:PORT" to stderr once it accepts connections.
Status run_serve(const ServeConfig& cfg);

}  // namespace moe::serve
