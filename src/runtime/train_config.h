// TrainConfig: everything `moe train` needs, from a JSON file and/or flags, validated before any work.
//
// JSON layout (every key optional; unknown keys are errors):
//   { "steps": 600, "batch_size": 16, "lr": 0.003, ..., "model": { <ModelConfig keys> } }
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "model/config.h"
#include "util/status.h"

namespace moe {

// The default corpus: the Python 3.11 documentation sources, installed by scripts/setup.sh from
// Debian's python3.11-doc. Real English text with code, about 11 MB.
inline constexpr const char* kDefaultCorpus = "/usr/share/doc/python3.11/html/_sources";
inline constexpr const char* kDefaultCorpusSuffix = ".rst.txt";

struct TrainConfig {
  ModelConfig model;
  std::string data;               // text file or folder; empty = the default corpus
  int64_t steps = 1000;           // optimizer steps in the whole run (a resumed run continues to it)
  int64_t batch_size = 16;        // sequences of model.seq_len tokens per step (the global batch)
  double lr = 3e-3;               // peak learning rate
  double min_lr = 3e-4;           // cosine decay floor
  int64_t warmup_steps = 50;
  double weight_decay = 0.1;
  double grad_clip = 1.0;         // global L2 norm; 0 disables
  double beta1 = 0.9, beta2 = 0.95;
  uint64_t seed = 1337;           // weights and batch order
  double val_fraction = 0.05;     // held-out share of the corpus
  int64_t log_every = 25;         // progress line every N steps
  int64_t eval_every = 250;       // validation loss every N steps (and at the end); 0 = only at the end
  int64_t eval_batches = 16;
  std::string metrics;            // JSON-lines file; empty = none
  std::string checkpoint_dir;     // where checkpoints go; empty = none
  int64_t checkpoint_every = 0;   // also every N steps; the final one is always written if dir set
  std::string resume;             // checkpoint directory to resume from
  int64_t stop_at_step = 0;       // stop early at this step (checkpoint written), schedule unchanged; 0 = run to steps
  // A non-finite loss or gradient (found on every rank, named: step, parameter, rank): "stop" before
  // the optimizer, with an error (the last checkpoint is kept as it was), or "skip" the step's
  // optimizer update and go on (at most 10 steps in a row, then stop).
  std::string on_nonfinite = "stop";
  // A checkpoint that cannot be written (disk full, a file-size limit, a read-only folder): "stop"
  // with its error, or "continue" training and try again at the next checkpoint. Either way the
  // previous checkpoint is kept as it was (checkpoints are installed whole or not at all).
  std::string on_checkpoint_error = "stop";
  int threads = 0;                // compute threads per rank; 0 = this rank's CPUs (its affinity mask)
                                  // shared among the ranks whose masks overlap on this machine
  std::string gemm = "auto";      // GEMM kernel: "onednn", "openblas", or "auto" (rank 0 measures both,
                                  // every rank uses its choice; a resumed run keeps its checkpoint's)
  double comm_timeout_s = 60;     // a collective not done by then fails, naming the rank and operation
  int ranks_per_node = 0;         // ranks per node for the topology; 0 = as MPI finds them (shared memory)
  int64_t allreduce_micro_kb = 256;  // gradient allreduce micro-op size (KiB); 0 = one op per bucket
  std::string trace;              // Chrome trace JSON of the first trace_steps steps, all ranks; empty = none
  int64_t trace_steps = 5;
  // Where experts live during a step (strategy/strategy.h; --strategy help lists them): "ep" (static expert parallelism),
  // "hecate" (FSSDP: sparse materialization of the predicted-hot experts behind attention, and
  // heterogeneous re-sharding), "fastermoe" (shadow the hottest experts on every rank after the
  // gate), "smartmoe" (swap experts between ranks every reshard_every steps) or "flexmoe" (replicas
  // re-planned when the ranks' balance drifts or every reshard_every steps). Every strategy computes
  // the same mathematics; only speed differs.
  std::string strategy = "ep";
  bool rematerialize = false;     // hecate: free replicas after forward, gather them again for backward
  int64_t replica_slots = -1;     // hecate: extra experts a rank may hold per layer (-1: experts per rank);
                                  // flexmoe: its reserved slots per rank and layer (-1: 1)
  double replica_memory_mb = 0;   // hecate: per-rank budget for one layer's replicas (weights + gradient
                                  // buffers), MiB; > 0 sets the slots (Alg. 1's m) instead of replica_slots
  int64_t overlap_degree = -1;    // hecate: experts gathered behind attention (-1: from measured attention time)
  int64_t load_window = 5;        // hecate: steps of the sliding-window load prediction
  double link_gbs = 0;            // GB/s the planners assume for moving expert weights (0: measured)
  double gemm_gflops = 0;         // GFLOP/s the planners assume for expert GEMMs (0: measured)
  int64_t link_refresh_every = 100;  // placement strategies: links measured again every N steps (0: never)
  // Ranks that take turns on shared CPU cores, for the planners: "measured" (from the ranks' affinity
  // masks: runtime::core_pools) or "none" (every rank priced as computing on cores of its own).
  std::string shared_cores = "measured";
  int64_t reshard_every = 100;    // hecate (Alg. 2), smartmoe: re-shard experts every N steps (0: never)
  // Where the model trains: "cpu" (this process's cores; any rank count and strategy) or "cuda" (one
  // GPU, one rank, strategy ep: cuda/train.h). Checkpoints are the same files either way, so a run
  // may move between them on --resume.
  std::string device = "cpu";
  // Storage of weights and activations on device cuda: "f32", or "bf16" (mixed precision: bf16
  // copies of the weights and bf16 activations for forward and backward, f32 master weights,
  // gradients and AdamW state, so checkpoints are the same files: cuda/gpu_model.h). The CPU model is
  // f32 only.
  std::string dtype = "f32";

  // Every field and combination; the message names the key and value.
  Status validate() const;
  nlohmann::json to_json() const;
  // Applies the keys present in `j` over *out's current values (so flags can then override).
  // Unknown keys and wrong types are errors naming the key; *out is unchanged on error.
  static Status merge_json(const nlohmann::json& j, TrainConfig* out);
  // Reads and merges a JSON file; errors name the file (missing, unreadable, malformed JSON).
  static Status merge_file(const std::string& path, TrainConfig* out);
};

}  // namespace moe
