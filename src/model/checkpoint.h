// Checkpoints: a directory that is complete or absent.
//
//   <dir>/model.safetensors      every parameter under its docs/model.md name (loadable by PyTorch);
//                                metadata "format": "moe" and, when the caller's state has
//                                config.model, "model_config": that object as JSON text
//   <dir>/optimizer.safetensors  AdamW moments as "<name>.m" and "<name>.v"; metadata "step"
//   <dir>/state.json             the caller's state (step, config, data position, ...) plus
//                                "optimizer_step", "parts" and "files": {file: {"bytes", "fnv1a64"}}
//                                (FNV-1a 64 of the file's bytes, 16 hex digits)
// Written into <dir>.tmp-<id>, every file fsynced, then moved into place: an older checkpoint at
// <dir> is swapped out in one atomic rename (renameat2 RENAME_EXCHANGE; where the file system
// lacks it, moved aside first) and deleted after. So a crash leaves the old checkpoint or the new
// one, never a mix; a leftover <dir>.tmp-<id> or <dir>.old-<pid> is garbage from a crash.
//
// Written by several ranks (each owning some rows of the expert tensors, Param::sharded), a
// checkpoint has n > 1 parts instead of the two files above: part p is
//   <dir>/model-<p>-of-<n>.safetensors, <dir>/optimizer-<p>-of-<n>.safetensors
// written by the rank that owns it. Part 0 also holds every replicated parameter. A sharded tensor's
// rows are stored under its own name, and the file's metadata "rows" is a JSON object with, per such
// tensor, [first, full_rows] (rows [first, first + rows): EP's consecutive shards) or {"full":
// full_rows, "rows": [r0, r1, ...]} (the listed rows in that order: experts after a re-sharding,
// Param::shard_rows; a part holding none of a tensor's rows omits it). Every row of the whole tensor
// comes from exactly one part. load_checkpoint joins them, so a checkpoint loads whatever the rank
// count and strategy that wrote it.
#pragma once

#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/optimizer.h"
#include "model/safetensors.h"
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

// The checkpoint's state.json (what it was trained with: "config", "step", "gemm", ...), read
// without touching the tensors. Errors: no such folder, no state.json, not a JSON object.
Status read_checkpoint_state(const std::string& dir, nlohmann::json* state);

// The whole weights of a checkpoint (parts joined), checked like load_checkpoint's (sizes,
// checksums, parts covering every row once); errors name the file or tensor.
Status read_checkpoint_weights(const std::string& dir, std::map<std::string, LoadedTensor>* weights);

// ---- A checkpoint written by several ranks (the protocol save_checkpoint runs alone) ----
// 1. The lead rank calls begin_checkpoint: a fresh, empty staging folder (on a file system every
//    writing rank sees) named by checkpoint_staging_dir(dir, id), id being the same on every rank.
// 2. Each writing rank p of n calls write_checkpoint_part: its rows of every sharded parameter of
//    opt, with their moments, and (with_replicated, part 0) every other parameter too.
// 3. Once every part succeeded, the lead calls finish_checkpoint: reads the parts back for their
//    sizes and checksums, writes state.json, moves the folder into place (replacing an older one as
//    save_checkpoint does). If any part failed, the lead calls abandon_checkpoint instead.
// Errors name the folder or file; nothing at dir changes before finish_checkpoint succeeds.
std::string checkpoint_staging_dir(const std::string& dir, int64_t id);
Status begin_checkpoint(const std::string& dir, const std::string& staging);
Status write_checkpoint_part(const std::string& staging, int part, int n_parts, const AdamW& opt, bool with_replicated,
                             const nlohmann::json& state);
Status finish_checkpoint(const std::string& dir, const std::string& staging, int n_parts, const AdamW& opt,
                         const nlohmann::json& state);
void abandon_checkpoint(const std::string& staging);

}  // namespace moe
