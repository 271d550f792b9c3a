#include "runtime/trainer.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <memory>
#include <numeric>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/checkpoint.h"
#include "model/data.h"
#include "model/model.h"
#include "model/optimizer.h"
#include "tensor/ops.h"

namespace moe {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

std::string hex64(uint64_t x) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(x));
  return buf;
}

// max/mean of the kept assignments per expert: 1.0 is perfect balance, E is one expert taking all.
double imbalance(const std::vector<int64_t>& tokens_per_expert) {
  if (tokens_per_expert.empty()) return 1.0;
  int64_t total = std::accumulate(tokens_per_expert.begin(), tokens_per_expert.end(), int64_t{0});
  if (total == 0) return 1.0;
  int64_t mx = *std::max_element(tokens_per_expert.begin(), tokens_per_expert.end());
  return static_cast<double>(mx) * tokens_per_expert.size() / total;
}

// Mean cross-entropy over the first eval_batches validation batches (the same windows every time).
double evaluate(Model& model, const TextDataset& ds, int64_t B, int64_t batches, std::vector<int32_t>& tokens,
                std::vector<int32_t>& targets) {
  double sum = 0;
  for (int64_t i = 0; i < batches; ++i) {
    ds.val_batch(i, B, tokens.data(), targets.data());
    sum += model.forward(tokens.data(), targets.data(), B);
  }
  return sum / static_cast<double>(batches);
}

// The parts of the config a resumed run must share with the checkpoint for the result to be the run
// that never stopped. Paths, logging and the stop point may differ.
json resume_identity(const TrainConfig& c) {
  json j = c.to_json();
  for (const char* k : {"data", "metrics", "checkpoint_dir", "checkpoint_every", "resume", "stop_at_step", "log_every",
                        "eval_every", "eval_batches", "threads"})
    j.erase(k);
  return j;
}

// Appends whole JSON lines and flushes each, so a killed run leaves only complete lines.
class MetricsWriter {
 public:
  Status open(const std::string& path, bool append) {
    if (path.empty()) return Status::ok();
    out_.open(path, append ? std::ios::app : std::ios::trunc);
    if (!out_) return Status::error("metrics: cannot open " + path + " for writing");
    return Status::ok();
  }
  void write(const json& j) {
    if (!out_.is_open()) return;
    out_ << j.dump() << '\n';
    out_.flush();
  }

 private:
  std::ofstream out_;
};

}  // namespace

Status run_training(const TrainConfig& cfg) {
  if (cfg.threads > 0) omp_set_num_threads(cfg.threads);
  const int64_t B = cfg.batch_size, T = cfg.model.seq_len;

  // ---- data ----
  DataOptions dopt;
  dopt.seq_len = T;
  dopt.val_fraction = cfg.val_fraction;
  dopt.seed = cfg.seed;
  std::string data_path = cfg.data;
  if (data_path.empty()) {
    data_path = kDefaultCorpus;
    dopt.suffix = kDefaultCorpusSuffix;
  }
  TextDataset ds;
  if (Status s = TextDataset::open(data_path, dopt, &ds); !s) return s;

  // ---- model and optimizer ----
  Model model(cfg.model, B);
  model.init(cfg.seed);
  AdamWConfig ocfg;
  ocfg.lr = static_cast<float>(cfg.lr);
  ocfg.beta1 = static_cast<float>(cfg.beta1);
  ocfg.beta2 = static_cast<float>(cfg.beta2);
  ocfg.weight_decay = static_cast<float>(cfg.weight_decay);
  ocfg.grad_clip = static_cast<float>(cfg.grad_clip);
  AdamW opt(model.params(), ocfg);

  // ---- resume: everything is checked before anything is written ----
  int64_t start = 0;
  if (!cfg.resume.empty()) {
    json state;
    if (Status s = load_checkpoint(cfg.resume, model.params(), &opt, &state); !s) return s;
    try {
      start = state.at("step").get<int64_t>();
      if (state.at("data_hash").get<std::string>() != hex64(ds.content_hash()))
        return Status::error("resume: checkpoint " + cfg.resume + " was trained on different data (corpus hash " +
                             state.at("data_hash").get<std::string>() + ", this corpus " +
                             hex64(ds.content_hash()) + ")");
      json was = state.at("identity"), now = resume_identity(cfg);
      for (auto& [key, value] : now.items())
        if (!was.contains(key) || was[key] != value)
          return Status::error("resume: checkpoint " + cfg.resume + " has " + key + " = " +
                               (was.contains(key) ? was[key].dump() : "(absent)") + ", this run has " + value.dump());
    } catch (const json::exception& e) {
      return Status::error("resume: " + cfg.resume + "/state.json is incomplete: " + e.what());
    }
    if (start >= cfg.steps)
      return Status::error("resume: checkpoint " + cfg.resume + " is at step " + std::to_string(start) +
                           ", nothing left of " + std::to_string(cfg.steps) + " steps");
  }
  const int64_t end = cfg.stop_at_step > 0 ? cfg.stop_at_step : cfg.steps;
  if (end <= start)
    return Status::error("stop_at_step " + std::to_string(end) + " is not after the checkpoint's step " +
                         std::to_string(start));

  MetricsWriter metrics;
  if (Status s = metrics.open(cfg.metrics, start > 0); !s) return s;

  std::printf("moe train: %lld parameters (L%lld C%lld E%lld K%lld F%lld T%lld), %s %s\n",
              static_cast<long long>(model.num_params()), (long long)cfg.model.n_layers, (long long)cfg.model.d_model,
              (long long)cfg.model.n_experts, (long long)cfg.model.top_k, (long long)cfg.model.d_ffn, (long long)T,
              cfg.model.activation.c_str(), cfg.model.norm.c_str());
  std::printf("data: %s, %zu files, %.2f MB train / %.2f MB validation, unigram byte entropy %.4f nats\n",
              data_path.c_str(), ds.files().size(), ds.train_bytes() / 1e6, ds.val_bytes() / 1e6,
              ds.unigram_entropy());
  std::printf("gemm: %s; %d threads; batch %lld x %lld tokens; %lld steps\n", gemm_backend().c_str(),
              omp_get_max_threads(), (long long)B, (long long)T, (long long)cfg.steps);
  if (start > 0) std::printf("resume: from %s at step %lld\n", cfg.resume.c_str(), (long long)start);
  std::fflush(stdout);

  auto save = [&](int64_t step) -> Status {
    json state{{"step", step},
               {"data_hash", hex64(ds.content_hash())},
               {"identity", resume_identity(cfg)},
               {"config", cfg.to_json()}};
    return save_checkpoint(cfg.checkpoint_dir, model.params(), opt, state);
  };

  std::vector<int32_t> tokens(B * T), targets(B * T);
  double last_val = std::nan("");
  double window_loss = 0, window_seconds = 0;
  int64_t window_steps = 0;
  for (int64_t step = start; step < end; ++step) {
    auto t0 = Clock::now();
    ds.batch(step, B, tokens.data(), targets.data());
    model.zero_grad();
    double loss = model.forward(tokens.data(), targets.data(), B);
    if (!std::isfinite(loss) || !std::isfinite(model.moe_loss()))
      return Status::error("training diverged: loss is " + std::to_string(loss) + " at step " +
                           std::to_string(step + 1) + " (try a lower --lr)");
    model.backward();
    double grad_norm = opt.clip_grad_norm(cfg.grad_clip > 0 ? static_cast<float>(cfg.grad_clip)
                                                            : std::numeric_limits<float>::infinity());
    float lr = lr_at(step, cfg.steps, cfg.warmup_steps, static_cast<float>(cfg.lr), static_cast<float>(cfg.min_lr));
    opt.step(lr);
    double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    window_loss += loss;
    window_seconds += seconds;
    ++window_steps;

    const int64_t done = step + 1;
    std::vector<LayerLoad> loads = model.load_stats();
    json per_layer_tokens = json::array(), per_layer_imbalance = json::array(), per_layer_dropped = json::array();
    for (const LayerLoad& l : loads) {
      per_layer_tokens.push_back(l.tokens_per_expert);
      per_layer_imbalance.push_back(imbalance(l.tokens_per_expert));
      per_layer_dropped.push_back(l.dropped);
    }
    metrics.write({{"step", done},
                   {"loss", loss},
                   {"aux_loss", model.aux_loss()},
                   {"z_loss", model.z_loss()},
                   {"lr", lr},
                   {"grad_norm", grad_norm},
                   {"step_ms", seconds * 1e3},
                   {"tokens_per_s", B * T / seconds},
                   {"load_imbalance", per_layer_imbalance},
                   {"dropped", per_layer_dropped},
                   {"tokens_per_expert", per_layer_tokens}});

    if (done % cfg.log_every == 0 || done == end) {
      std::ostringstream load;
      for (size_t i = 0; i < loads.size(); ++i) {
        char buf[16];
        std::snprintf(buf, sizeof buf, "%s%.2f", i ? " " : "", imbalance(loads[i].tokens_per_expert));
        load << buf;
      }
      // aux per MoE layer: 1.0 is a perfectly balanced router, whatever the layer count.
      std::printf("step %5lld/%lld  loss %.4f  aux/layer %.3f  lr %.2e  |g| %.2f  %7.0f tok/s  load max/mean %s\n",
                  (long long)done, (long long)cfg.steps, window_loss / window_steps,
                  model.aux_loss() / std::max<size_t>(1, loads.size()), lr, grad_norm,
                  window_steps * B * T / window_seconds, load.str().c_str());
      std::fflush(stdout);
      window_loss = window_seconds = 0;
      window_steps = 0;
    }

    const bool last = done == end;
    if ((cfg.eval_every > 0 && done % cfg.eval_every == 0) || (last && done == cfg.steps)) {
      auto e0 = Clock::now();
      last_val = evaluate(model, ds, B, cfg.eval_batches, tokens, targets);
      double es = std::chrono::duration<double>(Clock::now() - e0).count();
      std::printf("step %5lld/%lld  validation loss %.4f  (%lld windows, %.1f s)\n", (long long)done,
                  (long long)cfg.steps, last_val, (long long)(cfg.eval_batches * B), es);
      std::fflush(stdout);
      metrics.write({{"step", done}, {"val_loss", last_val}});
    }
    if (!cfg.checkpoint_dir.empty() && ((cfg.checkpoint_every > 0 && done % cfg.checkpoint_every == 0) || last)) {
      if (Status s = save(done); !s) return s;
      std::printf("checkpoint: step %lld written to %s\n", (long long)done, cfg.checkpoint_dir.c_str());
      std::fflush(stdout);
    }
  }

  if (end < cfg.steps) {
    std::printf("stopped at step %lld of %lld%s\n", (long long)end, (long long)cfg.steps,
                cfg.checkpoint_dir.empty() ? "" : "; resume with --resume <checkpoint-dir>");
    return Status::ok();
  }
  const double h = ds.unigram_entropy();
  std::printf("validation loss %.4f nats; unigram byte entropy %.4f nats; %.1f%% below\n", last_val, h,
              100.0 * (h - last_val) / h);
  return Status::ok();
}

}  // namespace moe
