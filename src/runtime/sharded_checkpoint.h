// Checkpoints of a model whose expert weights are sharded over ranks (Param::sharded): written as
// the whole model, exactly the file a single process writes, so a run can resume with any rank
// count (or none).
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "model/optimizer.h"
#include "util/status.h"

namespace moe::runtime {

// Gathers every sharded parameter and its moments over `ep` (the ranks that together hold one copy
// of every shard; null or one rank: nothing is sharded) and, on the rank where `write` is true,
// saves the whole model with save_checkpoint (model/checkpoint.h). Collective over ep: every rank of
// it calls, whether it writes or not. Returns the writer's save status there, ok elsewhere.
Status save_sharded_checkpoint(const std::string& dir, const AdamW& opt, comm::Communicator* ep, bool write,
                               const nlohmann::json& state);

// Loads a whole-model checkpoint (model/checkpoint.h, every check of load_checkpoint) and keeps this
// rank's rows of each sharded parameter and of its moments. Not collective: each rank reads the
// files (across hosts they must be on a shared file system). On error nothing is modified.
Status load_sharded_checkpoint(const std::string& dir, AdamW* opt, nlohmann::json* state);

}  // namespace moe::runtime
