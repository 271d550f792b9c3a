// What every inference command sets up on each rank before its first step: MPI (when mpirun started
// the process), the rank's compute threads, the checkpoint's model, the GEMM kernel, the experts
// spread over the ranks.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "comm/mpi_communicator.h"
#include "model/model.h"
#include "util/status.h"

namespace moe::serve {

// A checkpoint's model for inference: its config (state.json's config.model), a Model whose forward
// may take seq_len + extra_rows rows (*max_rows, may be null), the weights loaded and checked
// (load_checkpoint). *state: the checkpoint's state.json (may be null). Errors name the folder or file.
Status load_inference_model(const std::string& dir, int64_t extra_rows, std::unique_ptr<Model>* model,
                            nlohmann::json* state, int64_t* max_rows = nullptr);

// What every inference command (moe generate, moe serve) is given: the checkpoint and how its ranks
// run it.
struct InferenceOptions {
  std::string checkpoint;
  int threads = 0;              // compute threads per rank (0: as moe train decides)
  std::string gemm;             // "onednn" | "openblas"; empty: the checkpoint's kernel
  std::string schedule = "ep";  // where the experts run across ranks (engine.h Schedule)
  int replica_cache = -1;       // lina schedules: unused replicas a rank keeps per MoE layer (-1: as many
                                // experts as it owns; InferenceEngine::set_replica_cache)
  double comm_timeout_s = 60;
  Status validate() const;      // errors name the flag
};

struct InferenceJob {
  std::unique_ptr<comm::MpiSession> session;
  std::unique_ptr<comm::Communicator> world;  // null when the job is one process
  std::unique_ptr<Model> model;               // expert-parallel over world when there is one
  nlohmann::json state;                       // the checkpoint's state.json
  int64_t max_rows = 0;                       // rows of one forward on a rank: seq_len + extra_rows
  int threads = 1;
  int rank() const { return world ? world->rank() : 0; }
  int size() const { return world ? world->size() : 1; }

  // Collective over the ranks mpirun started (if any). extra_rows: rows one forward may take beyond a
  // whole prompt (load_inference_model). Errors: MPI, the checkpoint, experts that the ranks cannot
  // share evenly. On error a multi-rank job is in an unknown state: the caller ends it (fail()).
  Status start(const InferenceOptions& opt, int64_t extra_rows);
  // Returns s; when s is an error in a multi-rank job, ends the job (abort_job) so no rank hangs.
  Status fail(const Status& s);
};

}  // namespace moe::serve
