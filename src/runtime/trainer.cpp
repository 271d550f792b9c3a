#include "runtime/trainer.h"

namespace moe {

Status run_training(const TrainConfig& cfg) { return Status::error("train: not built yet"); }

}  // namespace moe
