// `moe train --device cuda` (train.h): runtime/trainer.cpp's loop with the step on one GPU.
#include "cuda/train.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cuda/device.h"
#include "cuda/gpu_model.h"
#include "cuda/gpu_optimizer.h"
#include "model/data.h"
#include "model/model.h"
#include "model/optimizer.h"
#include "runtime/sharded_checkpoint.h"
#include "runtime/trainer.h"
#include "strategy/strategy.h"

namespace moe::cuda {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// The ranks mpirun (OpenMPI, MPICH, MVAPICH) started this job with; 1 without mpirun.
int launched_ranks() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"})
    if (const char* v = std::getenv(var)) return std::max(1, std::atoi(v));
  return 1;
}

// Mean cross-entropy over the first `batches` validation batches (the CPU loop's windows).
Status evaluate(GpuModel& model, const TextDataset& ds, int64_t B, int64_t batches, double* out) {
  const int64_t T = ds.seq_len();
  std::vector<int32_t> tokens(B * T), targets(B * T);
  double sum = 0;
  for (int64_t i = 0; i < batches; ++i) {
    ds.val_batch(i, B, tokens.data(), targets.data());
    double loss = 0;
    if (Status s = model.forward(tokens.data(), targets.data(), B, &loss); !s) return s;
    sum += loss;
  }
  *out = sum / static_cast<double>(batches);
  return Status::ok();
}

Status train(const TrainConfig& cfg) {
  const int64_t B = cfg.batch_size, T = cfg.model.seq_len;

  // ---- data (as the CPU loop) ----
  TextDataset ds;
  std::string data_path;
  if (Status s = open_training_data(cfg, &ds, &data_path); !s) return s;

  // ---- the host copy of model and optimizer: initialization, checkpoints in and out ----
  moe::Model host(cfg.model, B);
  host.init(cfg.seed);
  const AdamWConfig ocfg = adamw_config(cfg);
  AdamW host_opt(host.params(), ocfg);
  int64_t start = 0;
  if (!cfg.resume.empty()) {
    json state;
    if (Status s = runtime::load_sharded_checkpoint(cfg.resume, &host_opt, &state); !s) return s;
    if (Status s = check_resume(cfg, state, ds.content_hash(), &start); !s) return s;
  }
  const int64_t end = cfg.stop_at_step > 0 ? cfg.stop_at_step : cfg.steps;
  if (end <= start)
    return Status::error("stop_at_step " + std::to_string(end) + " is not after the checkpoint's step " +
                         std::to_string(start));

  // ---- the GPU copy, which trains ----
  std::unique_ptr<Context> ctx;
  if (Status s = Context::create(0, &ctx); !s) return s;
  std::unique_ptr<GpuModel> model;
  const DType dt = cfg.dtype == "bf16" ? DType::bf16 : DType::f32;  // validate() allows these two
  if (Status s = GpuModel::create(*ctx, cfg.model, B, dt, &model); !s) return s;
  if (Status s = model->load_weights(host); !s) return s;
  std::unique_ptr<GpuAdamW> opt;
  if (Status s = GpuAdamW::create(*ctx, *model, ocfg, &opt); !s) return s;
  if (Status s = opt->load_state(host_opt); !s) return s;

  MetricsWriter metrics;
  if (Status s = metrics.open(cfg.metrics, start > 0); !s) return s;
  auto say = [](const char* fmt, auto... args) {
    std::printf(fmt, args...);
    std::fflush(stdout);
  };
  say("moe train: %lld parameters (L%lld C%lld E%lld K%lld F%lld T%lld), %s %s\n",
      static_cast<long long>(model->num_params()), (long long)cfg.model.n_layers, (long long)cfg.model.d_model,
      (long long)cfg.model.n_experts, (long long)cfg.model.top_k, (long long)cfg.model.d_ffn, (long long)T,
      cfg.model.activation.c_str(), cfg.model.norm.c_str());
  say("data: %s, %zu files, %.2f MB train / %.2f MB validation, unigram byte entropy %.4f nats\n",
      data_path.c_str(), ds.files().size(), ds.train_bytes() / 1e6, ds.val_bytes() / 1e6, ds.unigram_entropy());
  say("device: cuda: %s; %s; one rank, every expert on this GPU\n", device_summary(ctx->device()).c_str(),
      dt == DType::f32 ? "dtype f32 (storage and arithmetic), TF32 off"
                       : "dtype bf16 (mixed precision: bf16 weight copies and activations, f32 arithmetic, master "
                         "weights, gradients, AdamW and MoE router)");
  say("gemm: cuBLAS; batch %lld x %lld tokens; %lld steps\n", (long long)B, (long long)T, (long long)cfg.steps);
  if (start > 0) say("resume: from %s at step %lld\n", cfg.resume.c_str(), (long long)start);

  // Checkpoints: the GPU's weights and moments into the host copies, then the CPU writer (one part).
  auto save = [&](int64_t step) -> Status {
    if (Status s = model->store_weights(&host); !s) return s;
    if (Status s = opt->store_state(&host_opt); !s) return s;
    const json state{{"step", step},
                     {"data_hash", hex64(ds.content_hash())},
                     {"identity", resume_identity(cfg)},
                     {"config", cfg.to_json()},
                     {"ranks", 1},
                     {"device", "cuda"}};
    return runtime::save_sharded_checkpoint(cfg.checkpoint_dir, host_opt, nullptr, true, state);
  };

  std::vector<int32_t> tokens(B * T), targets(B * T);
  double last_val = std::nan("");
  double window_loss = 0, window_seconds = 0;
  int64_t window_steps = 0;
  for (int64_t step = start; step < end; ++step) {
    const auto t0 = Clock::now();
    ds.batch_rows(step, B, 0, B, tokens.data(), targets.data());
    double loss = 0;
    if (Status s = model->zero_grad(); !s) return s;
    if (Status s = model->forward(tokens.data(), targets.data(), B, &loss); !s) return s;
    if (Status s = model->backward(); !s) return s;
    if (!std::isfinite(loss) || !std::isfinite(model->moe_loss()))
      return Status::error("training diverged: loss is " + std::to_string(loss) + " at step " +
                           std::to_string(step + 1) + " (try a lower --lr)");
    double grad_norm = 0;
    if (Status s = opt->clip_grad_norm(cfg.grad_clip > 0 ? static_cast<float>(cfg.grad_clip)
                                                         : std::numeric_limits<float>::infinity(),
                                       &grad_norm);
        !s)
      return s;
    const float lr =
        lr_at(step, cfg.steps, cfg.warmup_steps, static_cast<float>(cfg.lr), static_cast<float>(cfg.min_lr));
    if (Status s = opt->step(lr); !s) return s;
    if (Status s = ctx->synchronize(); !s) return s;
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    window_loss += loss;
    window_seconds += seconds;
    ++window_steps;

    const int64_t done = step + 1;
    const std::vector<LayerLoad> loads = model->load_stats();
    json per_layer_tokens = json::array(), per_layer_imbalance = json::array(), per_layer_dropped = json::array();
    for (const LayerLoad& ll : loads) {
      per_layer_tokens.push_back(ll.tokens_per_expert);
      per_layer_imbalance.push_back(imbalance(ll.tokens_per_expert));
      per_layer_dropped.push_back(ll.dropped);
    }
    metrics.write({{"step", done},
                   {"loss", loss},
                   {"aux_loss", model->aux_loss()},
                   {"z_loss", model->z_loss()},
                   {"lr", lr},
                   {"grad_norm", grad_norm},
                   {"step_ms", seconds * 1e3},
                   {"tokens_per_s", static_cast<double>(B * T) / seconds},
                   {"load_imbalance", per_layer_imbalance},
                   {"dropped", per_layer_dropped},
                   {"tokens_per_expert", per_layer_tokens},
                   {"device", "cuda"},
                   {"dtype", dtype_name(dt)}});

    if (done % cfg.log_every == 0 || done == end) {
      say("step %5lld/%lld  loss %.4f  aux/layer %.3f  lr %.2e  |g| %.2f  %7.0f tok/s %s  load max/mean %s\n",
          (long long)done, (long long)cfg.steps, window_loss / window_steps,
          model->aux_loss() / static_cast<double>(std::max<size_t>(1, loads.size())), lr, grad_norm,
          static_cast<double>(window_steps * B * T) / window_seconds, dtype_name(dt),
          load_imbalance_line(loads).c_str());
      window_loss = window_seconds = 0;
      window_steps = 0;
    }

    if (Status s = evaluate_and_checkpoint(
            cfg, done, end, cfg.eval_batches * B, ds.unigram_entropy(), true, metrics,
            [&](double* loss) { return evaluate(*model, ds, B, cfg.eval_batches, loss); }, save, &last_val);
        !s)
      return s;
  }

  say("%s", training_end_message(cfg, end, last_val, ds.unigram_entropy()).c_str());
  return Status::ok();
}

}  // namespace

Status train_on_gpu(const TrainConfig& cfg) {
  if (cfg.device != "cuda") return Status::error("train_on_gpu: device is " + cfg.device + ", not cuda");
  if (const int ranks = launched_ranks(); ranks > 1)
    return Status::error("device cuda trains on one GPU with one rank, but this job has " + std::to_string(ranks) +
                         " ranks (run it without mpirun and without --ranks)");
  if (strategy::places_experts(cfg.strategy))
    return Status::error("device cuda trains on one GPU with one rank: strategy must be ep, not " + cfg.strategy);
  if (device_count() == 0) return Status::error("device cuda: " + device_summary(0));  // "no CUDA device: ..."
  try {
    return train(cfg);
  } catch (const std::exception& e) {
    return Status::error(e.what());
  }
}

}  // namespace moe::cuda
