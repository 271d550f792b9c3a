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

// Writes a checkpoint of the whole model with the parts written by the ranks that own them
// (model/checkpoint.h, "Written by several ranks"): rank p of the expert-parallel group `ep` writes
// part p (its experts' rows, their moments, and on p = 0 every replicated parameter); ep rank 0
// finishes the checkpoint once every part is on disk, so it is complete or absent. Only the group
// that holds world rank 0 writes (`writes`); the other groups hold copies and return ok at once.
// Collective over ep in the writing group. Every rank of the group gets the same Status. Across
// hosts, `dir` must be on a file system every writing rank sees.
// With one rank (ep null or of size 1) or nothing sharded: save_checkpoint on the rank that writes.
Status save_sharded_checkpoint(const std::string& dir, const AdamW& opt, comm::Communicator* ep, bool writes,
                               const nlohmann::json& state);

// Loads a checkpoint written with any number of parts (model/checkpoint.h, every check of
// load_checkpoint) and keeps this rank's rows of each sharded parameter and of its moments. Not collective: each rank reads the
// files (across hosts they must be on a shared file system). On error nothing is modified.
Status load_sharded_checkpoint(const std::string& dir, AdamW* opt, nlohmann::json* state);

}  // namespace moe::runtime
