#include "serve/generate.h"

#include <omp.h>

#include <chrono>
#include <cstdio>
#include <vector>

#include "serve/engine.h"
#include "serve/job.h"
#include "serve/lockstep.h"
#include "serve/profile.h"
#include "tensor/ops.h"

namespace moe::serve {

Status GenerateConfig::validate() const {
  if (Status s = run.validate(); !s) return s;
  if (prompt.empty()) return Status::error("--prompt is empty: give at least one byte of text to continue");
  if (max_tokens < 1) return Status::error("--max-tokens (" + std::to_string(max_tokens) + ") must be >= 1");
  if (Status s = sampling.validate(); !s) return Status::error("--" + s.message());
  return Status::ok();
}

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

// The lead's loop: prefill the prompt, then one decode row per token (Sequence refills the context
// when it is full).
Status lead_generation(const GenerateConfig& cfg, Lockstep& ranks, const ModelConfig& mc, std::FILE* out) {
  const int64_t T = mc.seq_len, V = mc.vocab_size;
  Sequence seq;
  for (char c : cfg.prompt) seq.tokens.push_back(static_cast<uint8_t>(c));
  Sampler sampler(cfg.sampling, 0);
  std::vector<PlacedRow> rows;
  std::vector<float> logits;
  auto step = [&] {
    rows.clear();
    seq.add_rows(0, 0, &rows);
    return ranks.step(rows, &logits);
  };
  const Clock::time_point start = Clock::now();
  if (Status s = step(); !s) return s;
  const double prefill_ms = ms_since(start);
  int64_t refills = 0;
  const Clock::time_point decode_start = Clock::now();
  for (int64_t produced = 0;;) {
    const int32_t next = sampler.next(logits.data(), V);
    std::fputc(next, out);
    std::fflush(out);
    if (++produced == cfg.max_tokens) break;
    refills += seq.push(next, T);
    if (Status s = step(); !s) return s;
  }
  const double decode_ms = ms_since(decode_start);
  const ScheduleStats& st = ranks.engine().schedule_stats();
  if (ranks.engine().schedule() != Schedule::ep && st.layer_steps > 0)
    std::fprintf(stderr, "\nschedule %s: %lld MoE layer forwards, estimate accurate %lld of %lld, re-planned %lld, "
                 "%.2f replicas per layer forward (%.2f more held unused), %.1f MB of expert weights gathered on rank 0, busiest rank's expert rows %.2fx the mean",
                 schedule_name(ranks.engine().schedule()), static_cast<long long>(st.layer_steps),
                 static_cast<long long>(st.accurate), static_cast<long long>(st.estimated),
                 static_cast<long long>(st.replanned), static_cast<double>(st.replicas) / st.layer_steps,
                 static_cast<double>(st.cached) / st.layer_steps, st.gathered_bytes / 1e6,
                 st.mean_rank_rows > 0 ? st.busiest_rank_rows / st.mean_rank_rows : 1.0);
  std::fprintf(stderr,
               "\ngenerate: %lld tokens in %.2f s: prompt %zu tokens (prefill %.1f ms), decode %.1f tokens/s%s; "
               "%d rank(s), gemm %s, %d thread(s) per rank\n",
               static_cast<long long>(cfg.max_tokens), ms_since(start) / 1e3, cfg.prompt.size(), prefill_ms,
               cfg.max_tokens > 1 ? (cfg.max_tokens - 1) / (decode_ms / 1e3) : 0.0,
               refills ? (", context refilled " + std::to_string(refills) + "x").c_str() : "", ranks.ranks(),
               gemm_backend_name().c_str(), omp_get_max_threads());
  return ranks.finish();
}

}  // namespace

Status run_generate(const GenerateConfig& cfg, std::FILE* out) {
  if (Status s = cfg.validate(); !s) return s;
  InferenceJob job;
  try {
    if (Status s = job.start(cfg.run, 0); !s) return job.fail(s);
    const ModelConfig& mc = job.model->config();
    if (static_cast<int64_t>(cfg.prompt.size()) > mc.seq_len)
      return job.fail(Status::error("--prompt is " + std::to_string(cfg.prompt.size()) +
                                    " bytes; the model's context is " + std::to_string(mc.seq_len) +
                                    " (seq_len): shorten it"));
    InferenceEngine engine(*job.model, 1, mc.seq_len);
    std::unique_ptr<plan::PathProfile> profile;
    const std::string corpus = job.state["config"].value("data", std::string());
    if (Status s = start_schedule(engine, job.world.get(), cfg.run.schedule, corpus, cfg.run.replica_cache, &profile); !s) return job.fail(s);
    Lockstep ranks(engine, job.world.get());
    if (!ranks.lead()) return job.fail(ranks.follow());
    return job.fail(lead_generation(cfg, ranks, mc, out));
  } catch (const std::exception& e) {
    return job.fail(Status::error(e.what()));
  }
}

}  // namespace moe::serve
