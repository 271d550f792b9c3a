// Checkpoints: a directory that is complete or absent.
//
//   <dir>/model.safetensors      every parameter under its docs/model.md name (loadable by PyTorch);
//                                metadata "format": "moe" and, when the caller's state has
//                                config.model, "model_config": that object as JSON text
//   <dir>/optimizer.safetensors  AdamW moments as "<name>.m" and "<name>.v"; metadata "step"
//   <dir>/state.json             the caller's state (step, config, data position, ...) plus
//                                "optimizer_step" and "files": {file: {"bytes", "fnv1a64"}}
//                                (FNV-1a 64 of the file's bytes, 16 hex digits)
// Written into <dir>.tmp-<pid>, every file fsynced, then moved into place: an older checkpoint at
// <dir> is swapped out in one atomic rename (renameat2 RENAME_EXCHANGE; where the file system
// lacks it, moved aside first) and deleted after. So a crash leaves the old checkpoint or the new
// one, never a mix; a leftover <dir>.tmp-<pid> or <dir>.old-<pid> is garbage from a crash.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/optimizer.h"
#include "tensor/tensor.h"
#include "util/status.h"

namespace moe {

// Saves params, opt's moments and step, and `state` (a JSON object, or null for none) to `dir`.
// An existing `dir` is replaced only if it holds nothing but checkpoint files (so a mistyped
// --checkpoint-dir never deletes unrelated data); else, and on any I/O error, an error Status and
// the old `dir` is left as it was. Parent folders are created.
// REQUIRES: opt was built over params (same order); else throws std::logic_error.
Status save_checkpoint(const std::string& dir, const std::vector<Param*>& params, const AdamW& opt,
                       const nlohmann::json& state);

// Verifies sizes and checksums of both files, that every parameter is present with the same
// shape and that the checkpoint has no tensor the model lacks; only then copies values into params
// and moments and step into opt and returns the saved state (state may be null). With a null opt
// only the weights are loaded and optimizer.safetensors is not read. On error nothing is modified
// and the message names the file or the tensor, e.g.
//   "checkpoint ck: tensor blocks.0.moe.w1 has shape [4,32,16], the model expects [8,32,16]".
// REQUIRES: opt, if not null, was built over params (same order); else throws std::logic_error.
Status load_checkpoint(const std::string& dir, const std::vector<Param*>& params, AdamW* opt, nlohmann::json* state);

}  // namespace moe
