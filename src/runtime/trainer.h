// The CPU training loop behind `moe train`, on one process or on every MPI rank of a job: data, model,
// optimizer, the strategy and its measured cost model, progress line, validation, metrics (JSON lines),
// traces and checkpoints with exact resume.
#pragma once

#include <cstdint>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/data.h"
#include "model/model.h"
#include "model/optimizer.h"
#include "runtime/train_config.h"
#include "util/status.h"

namespace moe {

// Trains per cfg on the CPU (cfg.device "cpu"; the GPU loop is cuda/train.h, which the `moe` command
// calls for "cuda"), printing progress to stdout. REQUIRES: cfg.validate() ok.
// Errors a user can cause (missing data, bad checkpoint) come back as a Status; nothing written is
// left half-written (checkpoints are atomic, metrics lines are flushed whole).
Status run_training(const TrainConfig& cfg);

// Shared with the GPU loop, so that a checkpoint moves between devices:
// 16 hex digits, as state.json writes the corpus hash ("data_hash").
std::string hex64(uint64_t x);
// The parts of the config a resumed run must share with the checkpoint ("identity" in state.json)
// for the result to be the run that never stopped; paths, logging, the stop point, the strategy and
// the device (speed only) may differ, and so may the dtype (a checkpoint holds the f32 master weights
// and moments whichever dtype trained them; bf16 changes the arithmetic's roundings, not the model).
nlohmann::json resume_identity(const TrainConfig& c);
// Checks a loaded checkpoint's state against this run (step below cfg.steps, same corpus hash, same
// identity) and returns its step in *start. Errors name the checkpoint and the key that differs.
Status check_resume(const TrainConfig& cfg, const nlohmann::json& state, uint64_t data_hash, int64_t* start);

// max/mean of the kept assignments per expert: 1.0 is perfect balance, E is one expert taking all
// (1.0 when there are none).
double imbalance(const std::vector<int64_t>& tokens_per_expert);

// The --metrics file: whole JSON lines, each flushed, so a killed run leaves only complete lines.
// An empty path writes nothing. Not thread-safe.
class MetricsWriter {
 public:
  Status open(const std::string& path, bool append);  // append: a resumed run continues the file
  void write(const nlohmann::json& j);

 private:
  std::ofstream out_;
};

// The run's corpus (cfg.data; the default corpus when empty) in windows of the model's seq_len, and its
// path in *path (for the start-up line).
Status open_training_data(const TrainConfig& cfg, TextDataset* ds, std::string* path);
// AdamW's settings from the run's config.
AdamWConfig adamw_config(const TrainConfig& cfg);
// The progress line's "load max/mean" field: imbalance() per MoE layer, "1.23 1.05 ...".
std::string load_imbalance_line(const std::vector<LayerLoad>& loads);

// What the training loops (CPU ranks and one GPU) do after step `done` of a run that stops after step
// `end`: every cfg.eval_every steps, and after the run's last step, evaluate(&loss) over `windows`
// validation windows, print the loss and record it (*last_val and the metrics, with the corpus's
// `unigram_entropy` beside it: the loss a model that ignores context reaches); every
// cfg.checkpoint_every steps, and when the run stops, save(done). On CPU ranks both are collective:
// every rank calls this, and only a rank with `speak` prints.
Status evaluate_and_checkpoint(const TrainConfig& cfg, int64_t done, int64_t end, int64_t windows,
                               double unigram_entropy, bool speak, MetricsWriter& metrics,
                               const std::function<Status(double*)>& evaluate,
                               const std::function<Status(int64_t)>& save, double* last_val);

// The last line(s) of a training run that stopped after step `end`: how to resume when it stopped
// early, else the final validation loss against the corpus's unigram entropy.
std::string training_end_message(const TrainConfig& cfg, int64_t end, double last_val, double unigram_entropy);

}  // namespace moe
