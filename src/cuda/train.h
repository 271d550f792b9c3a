// `moe train --device cuda`: the training loop of runtime/trainer.h on one GPU. The same data, schedule,
// progress lines (plus the dtype), metrics (the keys that mean something on one device, plus "device":
// "cuda" and "dtype") and checkpoints as a CPU run: the weights and AdamW moments live on the GPU
// (cuda::GpuModel, cuda::GpuAdamW) and are copied into a CPU moe::Model / moe::AdamW to be written by
// the CPU checkpoint code, and read back the same way on --resume. So a checkpoint written here
// resumes on the CPU and the other way round (state.json has no "gemm" entry: a CPU resume measures
// its own).
//
// One rank, strategy ep (no expert parallelism); TF32 off; storage cfg.dtype: f32, or bf16 mixed
// precision with f32 master weights, gradients and AdamW state (gpu_model.h), so the checkpoints
// are the same files whatever the dtype, and a run may change it on --resume.
#pragma once

#include "runtime/train_config.h"
#include "util/status.h"

namespace moe::cuda {

// Trains per cfg (cfg.device == "cuda") on GPU 0, printing progress to stdout. REQUIRES:
// cfg.validate() ok. Errors, each a Status: launched as more than one MPI rank, no CUDA device,
// and everything run_training reports (data, checkpoints, divergence).
Status train_on_gpu(const TrainConfig& cfg);

}  // namespace moe::cuda
