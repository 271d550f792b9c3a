// Checkpoints: a directory that is complete or absent.
//
//   <dir>/model.safetensors      every parameter under its docs/model.md name (loadable by PyTorch)
//   <dir>/optimizer.safetensors  AdamW moments as "<name>.m" and "<name>.v"
//   <dir>/state.json             the caller's state (step, config, data position, ...) plus
//                                "optimizer_step" and "files": {file: {"bytes", "fnv1a64"}}
// Written into <dir>.tmp-<pid>, every file fsynced, then renamed into place (an older checkpoint
// at <dir> is moved aside first and deleted after), so a crash leaves the old checkpoint, the new
// one, or none -- never a mix.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/optimizer.h"
#include "tensor/tensor.h"
#include "util/status.h"

namespace moe {

// REQUIRES: opt was built over the same params (same order).
Status save_checkpoint(const std::string& dir, const std::vector<Param*>& params, const AdamW& opt,
                       const nlohmann::json& state);

// Verifies sizes and checksums of both files, that every parameter is present with the same
// shape and that the checkpoint has no tensor the model lacks; only then copies values into params
// and moments into opt (opt may be null: weights only) and returns the caller's state (may be null).
// On error nothing is modified and the message names the file or the tensor, e.g.
//   "checkpoint ck: tensor blocks.0.moe.w1 has shape [4,32,16], the model expects [8,32,16]".
Status load_checkpoint(const std::string& dir, const std::vector<Param*>& params, AdamW* opt, nlohmann::json* state);

}  // namespace moe
