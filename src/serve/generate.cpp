#include "serve/generate.h"

#include <omp.h>

#include <chrono>
#include <cstdio>
#include <vector>

#include "comm/mpi_communicator.h"
#include "model/checkpoint.h"
#include "runtime/cpu_threads.h"
#include "serve/engine.h"
#include "serve/lockstep.h"
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

Status GenerateConfig::validate() const {
  if (checkpoint.empty()) return Status::error("--checkpoint is required (a folder moe train --checkpoint-dir wrote)");
  if (prompt.empty()) return Status::error("--prompt is empty: give at least one byte of text to continue");
  if (max_tokens < 1) return Status::error("--max-tokens (" + std::to_string(max_tokens) + ") must be >= 1");
  if (!gemm.empty() && gemm != "onednn" && gemm != "openblas")
    return Status::error("--gemm '" + gemm + "' is not onednn or openblas");
  if (Status s = sampling.validate(); !s) return Status::error("--" + s.message());
  if (!(comm_timeout_s > 0)) return Status::error("--comm-timeout must be > 0 seconds");
  return Status::ok();
}

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

// The lead's loop: prefill the prompt, then one decode row per token; when the context is full,
// prefill again from the last T / 2 tokens.
Status lead_generation(const GenerateConfig& cfg, Lockstep& ranks, const ModelConfig& mc, std::FILE* out) {
  const int64_t T = mc.seq_len, V = mc.vocab_size;
  std::vector<int32_t> tokens(cfg.prompt.begin(), cfg.prompt.end());
  for (int32_t& t : tokens) t = static_cast<uint8_t>(t);
  Sampler sampler(cfg.sampling, 0);
  std::vector<PlacedRow> rows;
  std::vector<float> logits;
  auto prefill_from = [&](int64_t first) {
    rows.clear();
    for (int64_t i = first; i < static_cast<int64_t>(tokens.size()); ++i)
      rows.push_back({0, {0, static_cast<int32_t>(i - first), tokens[i], i + 1 == static_cast<int64_t>(tokens.size())}});
    return ranks.step(rows, &logits);
  };
  const Clock::time_point start = Clock::now();
  if (Status s = prefill_from(0); !s) return s;
  const double prefill_ms = ms_since(start);
  int64_t first = 0, refills = 0;  // tokens[first] sits at position 0 of the cache
  const Clock::time_point decode_start = Clock::now();
  for (int64_t produced = 0;;) {
    const int32_t next = sampler.next(logits.data(), V);
    tokens.push_back(next);
    std::fputc(next, out);
    std::fflush(out);
    if (++produced == cfg.max_tokens) break;
    const int64_t pos = static_cast<int64_t>(tokens.size()) - 1 - first;
    if (pos < T) {
      rows.assign({{0, {0, static_cast<int32_t>(pos), next, true}}});
      if (Status s = ranks.step(rows, &logits); !s) return s;
    } else {
      first = static_cast<int64_t>(tokens.size()) - T / 2;
      ++refills;
      if (Status s = prefill_from(first); !s) return s;
    }
  }
  const double decode_ms = ms_since(decode_start);
  std::fprintf(stderr,
               "\ngenerate: %lld tokens in %.2f s: prompt %zu tokens (prefill %.1f ms), decode %.1f tokens/s%s; "
               "%d rank(s), gemm %s, %d thread(s) per rank\n",
               static_cast<long long>(cfg.max_tokens), ms_since(start) / 1e3, cfg.prompt.size(), prefill_ms,
               cfg.max_tokens > 1 ? (cfg.max_tokens - 1) / (decode_ms / 1e3) : 0.0,
               refills ? (", context refilled " + std::to_string(refills) + "x").c_str() : "", ranks.ranks(),
               gemm_backend_name().c_str(), omp_get_max_threads());
  return ranks.finish();
}

Status generate_on_ranks(const GenerateConfig& cfg, comm::Communicator* world, std::FILE* out) {
  const int size = world ? world->size() : 1;
  runtime::ThreadPlan threads;
  if (Status s = runtime::plan_rank_threads(runtime::thread_request(cfg.threads), world, &threads); !s) return s;
  omp_set_num_threads(threads.threads);
  set_gemm_threads(threads.threads);

  std::unique_ptr<Model> model;
  json state;
  if (Status s = load_inference_model(cfg.checkpoint, 1, &model, &state); !s) return s;
  const ModelConfig& mc = model->config();
  if (static_cast<int64_t>(cfg.prompt.size()) > mc.seq_len)
    return Status::error("--prompt is " + std::to_string(cfg.prompt.size()) + " bytes; the model's context is " +
                         std::to_string(mc.seq_len) + " (seq_len): shorten it");
  if (mc.n_experts % size != 0)
    return Status::error(std::to_string(size) + " ranks cannot share the model's " + std::to_string(mc.n_experts) +
                         " experts evenly: use a rank count that divides it");
  // The kernel the model was trained with (so every rank of the job, and a rerun, computes alike).
  std::string gemm = cfg.gemm;
  if (gemm.empty()) gemm = state.value("gemm", std::string("onednn"));
  pin_gemm_backend(gemm, cfg.gemm.empty() ? "as in checkpoint " + cfg.checkpoint : "--gemm " + cfg.gemm);
  if (world) model->set_expert_parallel(world, world);

  InferenceEngine engine(*model, 1, mc.seq_len);
  Lockstep ranks(engine, world);
  if (!ranks.lead()) return ranks.follow();
  return lead_generation(cfg, ranks, mc, out);
}

}  // namespace

Status run_generate(const GenerateConfig& cfg, std::FILE* out) {
  if (Status s = cfg.validate(); !s) return s;
  std::unique_ptr<comm::MpiSession> session;
  std::unique_ptr<comm::Communicator> world;
  if (comm::started_by_mpirun()) {
    if (Status s = comm::MpiSession::start(&session); !s) return s;
    const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(cfg.comm_timeout_s * 1000));
    if (Status s = session->world(&world, timeout); !s) return s;
    if (world->size() == 1) world.reset();
  }
  Status s;
  try {
    s = generate_on_ranks(cfg, world.get(), out);
  } catch (const std::exception& e) {
    s = Status::error(e.what());
  }
  // A rank that fails while the others sit in a collective must take the job down, or they hang.
  if (!s && world) comm::abort_job(s);
  return s;
}

}  // namespace moe::serve
