#include "serve/job.h"

#include <omp.h>

#include <chrono>

#include "model/checkpoint.h"
#include "runtime/cpu_threads.h"
#include "tensor/ops.h"

namespace moe::serve {

using json = nlohmann::json;

Status load_inference_model(const std::string& dir, int64_t max_batch, std::unique_ptr<Model>* model,
                            json* state_out) {
  json state;
  if (Status s = read_checkpoint_state(dir, &state); !s) return s;
  if (!state.contains("config") || !state["config"].is_object() || !state["config"].contains("model"))
    return Status::error("checkpoint " + dir + ": state.json has no config.model (not written by moe train?)");
  ModelConfig cfg;
  if (Status s = ModelConfig::from_json(state["config"]["model"], &cfg); !s)
    return Status::error("checkpoint " + dir + ": state.json's config.model: " + s.message());
  auto m = std::make_unique<Model>(cfg, max_batch);
  if (Status s = load_checkpoint(dir, m->params(), nullptr, nullptr); !s) return s;
  *model = std::move(m);
  if (state_out) *state_out = std::move(state);
  return Status::ok();
}

Status InferenceJob::start(const InferenceJobConfig& cfg) {
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
  json st;
  if (Status s = read_checkpoint_state(cfg.checkpoint, &st); !s) return s;
  ModelConfig mc;
  if (st.contains("config") && st["config"].is_object() && st["config"].contains("model"))
    (void)ModelConfig::from_json(st["config"]["model"], &mc);  // load_inference_model reports what is wrong
  max_rows = mc.seq_len + cfg.extra_rows;
  // The Model sizes its MoE layers' buffers by max_batch sequences of seq_len rows.
  const int64_t max_batch = (max_rows + mc.seq_len - 1) / mc.seq_len;
  if (Status s = load_inference_model(cfg.checkpoint, max_batch, &model, &state); !s) return s;
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
