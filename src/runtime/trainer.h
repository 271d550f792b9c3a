// The single-process training loop behind `moe train`: data, model, optimizer, progress line,
// validation, metrics (JSON lines) and checkpoints with exact resume.
#pragma once

#include "runtime/train_config.h"
#include "util/status.h"

namespace moe {

// Trains per cfg, printing progress to stdout. REQUIRES: cfg.validate() ok.
// Errors a user can cause (missing data, bad checkpoint) come back as a Status; nothing written is
// left half-written (checkpoints are atomic, metrics lines are flushed whole).
Status run_training(const TrainConfig& cfg);

}  // namespace moe
