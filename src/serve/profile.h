// Lina's profiling stage: how the model routes real text, as the path profile its scheduling
// estimates from (plan/lina.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "plan/lina.h"
#include "serve/engine.h"
#include "util/status.h"

namespace moe::serve {

// Runs `windows` windows of seq_len tokens, spread evenly over the corpus's training split, through
// the engine (each rank its share, in KV-cache slot 0, so before any request), and adds every token's
// routing to *out on every rank (the routes are all-gathered in rank order, so the profiles are
// identical). Collective over world (null: one process). corpus / suffix as moe train's --data (empty:
// the default corpus). Errors: the corpus cannot be read, communication.
Status profile_routing(InferenceEngine& engine, comm::Communicator* world, const std::string& corpus,
                       int64_t windows, plan::PathProfile* out);

// What the lina schedules' priced placement weighs (plan::LinaCost), measured on these ranks: a
// link's alpha-beta (runtime/measure_costs.h) and an expert's forward time at 1, 2, 4, ... rows up to a
// prefill's rows per expert (InferenceEngine::measure_expert_seconds); the ranks agree on the mean, so
// every rank plans alike.
// Collective over world (null: one process, no move).
Status measure_lina_cost(InferenceEngine& engine, comm::Communicator* world, plan::LinaCost* out);

// Sets the engine's schedule by name (engine.h): for lina and lina-no-phase2 first profiles the
// corpus the checkpoint was trained on (its state.json's config.data; 64 windows) into *profile, which
// must outlive the engine; every lina schedule then prices its replicas (measure_lina_cost, printed
// by rank 0). Collective over world. Errors: an unknown name (listing the known ones),
// profiling's errors.
// replica_cache: InferenceEngine::set_replica_cache for the lina schedules (-1: the experts a rank owns).
Status start_schedule(InferenceEngine& engine, comm::Communicator* world, const std::string& name,
                      const std::string& corpus, int replica_cache, std::unique_ptr<plan::PathProfile>* profile);

}  // namespace moe::serve
