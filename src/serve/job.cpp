#include "serve/job.h"

#include <omp.h>

#include <algorithm>
#include <chrono>

#include "model/checkpoint.h"
#include "runtime/cpu_threads.h"
#include "tensor/ops.h"

namespace moe::serve {

using json = nlohmann::json;

Status load_inference_model(const std::string& dir, int64_t extra_rows, std::unique_ptr<Model>* model,
                            json* state_out, int64_t* max_rows) {
  json state;
  if (Status s = read_checkpoint_state(dir, &state); !s) return s;
  if (!state.contains("config") || !state["config"].is_object() || !state["config"].contains("model"))
    return Status::error("checkpoint " + dir + ": state.json has no config.model (not written by moe train?)");
  ModelConfig cfg;
  if (Status s = ModelConfig::from_json(state["config"]["model"], &cfg); !s)
    return Status::error("checkpoint " + dir + ": state.json's config.model: " + s.message());
  // The Model sizes its MoE layers' buffers by max_batch sequences of seq_len rows.
  const int64_t rows = cfg.seq_len + extra_rows;
  auto m = std::make_unique<Model>(cfg, (rows + cfg.seq_len - 1) / cfg.seq_len);
  if (Status s = load_checkpoint(dir, m->params(), nullptr, nullptr); !s) return s;
  // A drifting router skew serves as the last training step ran it (state "step": the steps done).
  if (cfg.router_bias_drifts()) {
    if (!state.contains("step") || !state["step"].is_number_integer() || state["step"].get<int64_t>() < 0)
      return Status::error("checkpoint " + dir + ": state.json has no step (needed: the router skew drifts)");
    m->set_router_step(std::max<int64_t>(0, state["step"].get<int64_t>() - 1));
  }
  *model = std::move(m);
  if (state_out) *state_out = std::move(state);
  if (max_rows) *max_rows = rows;
  return Status::ok();
}

Status InferenceOptions::validate() const {
  if (checkpoint.empty()) return Status::error("--checkpoint is required (a folder moe train --checkpoint-dir wrote)");
  if (!gemm.empty() && gemm != "onednn" && gemm != "openblas")
    return Status::error("--gemm '" + gemm + "' is not onednn or openblas");
  if (!(comm_timeout_s > 0)) return Status::error("--comm-timeout must be > 0 seconds");
  return Status::ok();
}

Status InferenceJob::start(const InferenceOptions& cfg, int64_t extra_rows) {
  if (comm::started_by_mpirun()) {
    if (Status s = comm::MpiSession::start(&session); !s) return s;
    const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(cfg.comm_timeout_s * 1000));
    if (Status s = session->world(&world, timeout); !s) return s;
    if (world->size() == 1) world.reset();
  }
  runtime::ThreadPlan plan;
  if (Status s = runtime::plan_rank_threads(runtime::thread_request(cfg.threads), world.get(), &plan); !s) return s;
  threads = plan.threads;
  omp_set_num_threads(threads);
  set_gemm_threads(threads);
  if (Status s = load_inference_model(cfg.checkpoint, extra_rows, &model, &state, &max_rows); !s) return s;
  const int64_t E = model->config().n_experts;
  if (E % size() != 0)
    return Status::error(std::to_string(size()) + " ranks cannot share the model's " + std::to_string(E) +
                         " experts evenly: use a rank count that divides it");
  // The kernel the model was trained with, so every rank of the job, and a rerun, computes alike.
  std::string gemm = cfg.gemm;
  if (gemm.empty()) gemm = state.value("gemm", std::string("onednn"));
  pin_gemm_backend(gemm, cfg.gemm.empty() ? "as in checkpoint " + cfg.checkpoint : "--gemm " + cfg.gemm);
  if (world) model->set_expert_parallel(world.get(), world.get());
  return Status::ok();
}

Status InferenceJob::fail(const Status& s) {
  if (!s && world) comm::abort_job(s);
  return s;
}

}  // namespace moe::serve
