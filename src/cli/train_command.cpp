#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "cli/commands.h"
#include "cli/launch.h"
#include "runtime/cpu_threads.h"
#include "runtime/trainer.h"
#include "strategy/strategy.h"
#include "util/shell.h"
#ifdef MOE_HAVE_CUDA
#include "cuda/train.h"
#endif

namespace moe::cli {
namespace {

// A flag's target field and how to copy it from the flag-parsed config into the final one.
struct Binding {
  CLI::Option* opt;
  std::function<void(const TrainConfig& from, TrainConfig* to)> apply;
};
std::vector<Binding>& bindings() {
  static std::vector<Binding> b;
  return b;
}

// (Not named `bind`: with a std::string member, argument-dependent lookup would pick std::bind.)
template <typename T>
void bind_flag(CLI::App* cmd, TrainFlags* f, const std::string& name, T TrainConfig::*field, const std::string& help) {
  CLI::Option* o = cmd->add_option(name, f->cfg.*field, help)->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  bindings().push_back({o, [field](const TrainConfig& from, TrainConfig* to) { to->*field = from.*field; }});
}
template <typename T>
void bind_model_flag(CLI::App* cmd, TrainFlags* f, const std::string& name, T ModelConfig::*field,
                const std::string& help) {
  // Given twice, a flag takes its last value (as when appending to a saved command line).
  CLI::Option* o =
      cmd->add_option(name, f->cfg.model.*field, help)->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  bindings().push_back(
      {o, [field](const TrainConfig& from, TrainConfig* to) { to->model.*field = from.model.*field; }});
}

// libgomp reads its wait policy once, when it loads: by default a thread that finishes its share of a
// parallel loop spins ~300k iterations before sleeping. With more compute threads than CPUs those
// spins take the CPU from the threads they wait for (2 ranks x 2 threads on 2 unbound CPUs: ~15x
// slower). So when this rank's threads cannot all have a CPU, re-run this same command with
// OMP_WAIT_POLICY=PASSIVE (unless the user chose a policy), before MPI starts. Passive waits cost
// ~7% where every thread has its own CPU, hence only then. Returns only if it did not re-run.
void wait_passively_if_oversubscribed(const TrainFlags& f, const TrainConfig& cfg) {
  if (std::getenv("OMP_WAIT_POLICY") || std::getenv("GOMP_SPINCOUNT")) return;
  if (!runtime::plan_threads_before_mpi(runtime::thread_request(cfg.threads)).oversubscribed()) return;
  std::vector<std::string> args = f.argv;
  args[0] = self_exe("");
  if (args[0].empty()) return;
  setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
  exec_command(std::move(args));
  unsetenv("OMP_WAIT_POLICY");  // could not re-run: go on with the default policy
}

}  // namespace

CLI::App* add_train_command(CLI::App& app, TrainFlags* f) {
  CLI::App* c = app.add_subcommand("train", "train a GPT-style MoE model on a text corpus");
  c->add_option("--config", f->config_file, "JSON config file (flags given here override it)");
  c->add_option("--ranks", f->ranks, "start N ranks on this machine with mpirun (or run under mpirun yourself)")
      ->check(CLI::NonNegativeNumber);
  bind_flag(c, f, "--data", &TrainConfig::data, "text file or folder (default: Python 3.11 docs sources)");
  bind_flag(c, f, "--steps", &TrainConfig::steps, "optimizer steps");
  bind_flag(c, f, "--batch-size", &TrainConfig::batch_size, "sequences per step");
  bind_flag(c, f, "--lr", &TrainConfig::lr, "peak learning rate");
  bind_flag(c, f, "--min-lr", &TrainConfig::min_lr, "final learning rate of the cosine decay");
  bind_flag(c, f, "--warmup-steps", &TrainConfig::warmup_steps, "linear warmup steps");
  bind_flag(c, f, "--weight-decay", &TrainConfig::weight_decay, "AdamW weight decay");
  bind_flag(c, f, "--grad-clip", &TrainConfig::grad_clip, "global gradient-norm clip (0: off)");
  bind_flag(c, f, "--seed", &TrainConfig::seed, "seed for weights and batch order");
  bind_flag(c, f, "--val-fraction", &TrainConfig::val_fraction, "held-out share of the corpus");
  bind_flag(c, f, "--log-every", &TrainConfig::log_every, "progress line every N steps");
  bind_flag(c, f, "--eval-every", &TrainConfig::eval_every, "validation every N steps (0: only at the end)");
  bind_flag(c, f, "--eval-batches", &TrainConfig::eval_batches, "validation batches");
  bind_flag(c, f, "--metrics", &TrainConfig::metrics, "write metrics as JSON lines to FILE");
  bind_flag(c, f, "--checkpoint-dir", &TrainConfig::checkpoint_dir, "write checkpoints to DIR");
  bind_flag(c, f, "--checkpoint-every", &TrainConfig::checkpoint_every, "checkpoint every N steps too");
  bind_flag(c, f, "--resume", &TrainConfig::resume, "resume from checkpoint DIR");
  bind_flag(c, f, "--stop-at-step", &TrainConfig::stop_at_step, "stop at step N with a checkpoint (schedule unchanged)");
  bind_flag(c, f, "--on-checkpoint-error", &TrainConfig::on_checkpoint_error,
            "a checkpoint that cannot be written (disk full, read-only): stop, or continue and try again at the "
            "next one; the previous checkpoint is kept either way");
  bind_flag(c, f, "--on-nonfinite", &TrainConfig::on_nonfinite,
            "a NaN or Inf in the loss or a gradient: stop (before the optimizer; the last checkpoint is kept) or skip "
            "the step's update (at most 10 in a row)");
  bind_flag(c, f, "--threads", &TrainConfig::threads, "compute threads per rank (0: OMP_NUM_THREADS if set, else this rank's CPUs shared among the ranks on them)");
  bind_flag(c, f, "--comm-timeout", &TrainConfig::comm_timeout_s,
            "seconds a collective may take before the job stops with an error naming the rank");
  bind_flag(c, f, "--ranks-per-node", &TrainConfig::ranks_per_node,
            "ranks per node (0: as MPI finds them); lets one machine stand in for several nodes");
  bind_flag(c, f, "--allreduce-micro-kb", &TrainConfig::allreduce_micro_kb,
            "gradient allreduce micro-op size in KiB, so all-to-alls overtake it (0: whole buckets)");
  bind_flag(c, f, "--strategy", &TrainConfig::strategy,
            "where experts live: " + strategy::names() + " (--strategy help: one line on each)");
  {
    CLI::Option* o = c->add_flag("--rematerialize", f->cfg.rematerialize,
                                 "hecate: free expert replicas after forward and gather them again for backward");
    bindings().push_back({o, [](const TrainConfig& from, TrainConfig* to) { to->rematerialize = from.rematerialize; }});
  }
  bind_flag(c, f, "--replica-slots", &TrainConfig::replica_slots,
            "hecate: extra experts a rank may hold per layer (-1: experts per rank); flexmoe: reserved slots (-1: 1)");
  bind_flag(c, f, "--replica-memory-mb", &TrainConfig::replica_memory_mb,
            "hecate: per-rank MiB for one layer's replicas and their gradients; sets the slots");
  bind_flag(c, f, "--overlap-degree", &TrainConfig::overlap_degree,
            "hecate: experts gathered behind attention (-1: from the measured attention time)");
  bind_flag(c, f, "--load-window", &TrainConfig::load_window, "hecate: steps of the load prediction window");
  bind_flag(c, f, "--link-gbs", &TrainConfig::link_gbs, "GB/s the planners assume for moving expert weights (default 0: measured at start-up)");
  bind_flag(c, f, "--gemm", &TrainConfig::gemm,
            "GEMM kernel: onednn, openblas, or auto (rank 0 times both; a resumed run keeps its checkpoint's)");
  bind_flag(c, f, "--gemm-gflops", &TrainConfig::gemm_gflops, "GFLOP/s the planners assume for expert GEMMs (default 0: measured at start-up)");
  bind_flag(c, f, "--shared-cores", &TrainConfig::shared_cores,
            "placement strategies: ranks that take turns on shared CPU cores, priced as such by the planners: measured "
            "(from the ranks' CPU masks) or none (each rank as on cores of its own)");
  bind_flag(c, f, "--link-refresh-every", &TrainConfig::link_refresh_every,
            "placement strategies: measure the links again every N steps, so a slow or shared link is noticed (0: never; default 100)");
  bind_flag(c, f, "--reshard-every", &TrainConfig::reshard_every,
            "hecate, smartmoe: move expert shards to new owners every N steps (0: never); flexmoe: re-plan at "
            "least every N steps");
  bind_flag(c, f, "--device", &TrainConfig::device,
            "cpu, or cuda: one GPU, one rank, strategy ep (checkpoints are the same files either way)");
  bind_flag(c, f, "--dtype", &TrainConfig::dtype,
            "f32, or bf16 with --device cuda: mixed precision (bf16 copies of the weights and bf16 activations; "
            "f32 master weights, gradients and AdamW, so the same checkpoints)");
  bind_flag(c, f, "--trace", &TrainConfig::trace, "write a Chrome trace (Perfetto) of all ranks to FILE");
  bind_flag(c, f, "--trace-steps", &TrainConfig::trace_steps, "steps the trace covers, from the first");
  bind_model_flag(c, f, "--seq-len", &ModelConfig::seq_len, "context length T");
  bind_model_flag(c, f, "--d-model", &ModelConfig::d_model, "model width C");
  bind_model_flag(c, f, "--layers", &ModelConfig::n_layers, "transformer blocks L");
  bind_model_flag(c, f, "--heads", &ModelConfig::n_heads, "attention heads");
  bind_model_flag(c, f, "--d-ffn", &ModelConfig::d_ffn, "expert hidden size F");
  bind_model_flag(c, f, "--experts", &ModelConfig::n_experts, "experts per MoE layer E");
  bind_model_flag(c, f, "--top-k", &ModelConfig::top_k, "experts per token K");
  bind_model_flag(c, f, "--activation", &ModelConfig::activation, "gelu | swiglu");
  bind_model_flag(c, f, "--norm", &ModelConfig::norm, "layernorm | rmsnorm");
  bind_model_flag(c, f, "--capacity-factor", &ModelConfig::capacity_factor, "expert capacity factor (0: dropless)");
  bind_model_flag(c, f, "--aux-loss-weight", &ModelConfig::aux_loss_weight, "load-balancing loss weight");
  bind_model_flag(c, f, "--router-skew", &ModelConfig::router_skew,
                  "fixed Zipf-shaped router bias s (0: none): reproducible expert imbalance");
  bind_model_flag(c, f, "--router-skew-drift", &ModelConfig::router_skew_drift,
                  "experts per step the skew's popularity order turns (0: fixed): a load that moves between steps");
  bind_model_flag(c, f, "--z-loss-weight", &ModelConfig::z_loss_weight, "router z-loss weight");
  CLI::Option* dense = c->add_flag("--dense-every-other", f->cfg.model.dense_every_other,
                                   "odd blocks use a dense FFN instead of MoE");
  bindings().push_back({dense, [](const TrainConfig& from, TrainConfig* to) {
                          to->model.dense_every_other = from.model.dense_every_other;
                        }});
  return c;
}

int run_train(const CLI::App& cmd, TrainFlags& f) {
  TrainConfig cfg;
  if (!f.config_file.empty()) {
    if (Status s = TrainConfig::merge_file(f.config_file, &cfg); !s) {
      std::fprintf(stderr, "moe train: %s\n", s.message().c_str());
      return 2;
    }
  }
  for (const Binding& b : bindings())
    if (b.opt->count() > 0) b.apply(f.cfg, &cfg);
  if (cfg.strategy == "help") {
    std::printf("moe train --strategy NAME, one of:\n%s", strategy::help().c_str());
    return 0;
  }
  if (Status s = cfg.validate(); !s) {
    std::fprintf(stderr, "moe train: %s\n", s.message().c_str());
    return 2;
  }
  if (cfg.device == "cuda" && f.ranks > 1) {
    std::fprintf(stderr, "moe train: --device cuda trains on one GPU with one rank, not --ranks %d\n", f.ranks);
    return 2;
  }
  if (cfg.device == "cuda" && cfg.model.router_bias_drifts()) {
    std::fprintf(stderr, "moe train: --router-skew-drift runs on the CPU path only, not --device cuda\n");
    return 2;
  }
  if (int code = run_under_mpirun(f.argv, f.ranks, "moe train"); code >= 0) return code;
  Status s;
  if (cfg.device == "cuda") {
#ifdef MOE_HAVE_CUDA
    s = cuda::train_on_gpu(cfg);
#else
    s = Status::error("--device cuda: this moe was built without CUDA (no nvcc when it was configured)");
#endif
  } else {
    wait_passively_if_oversubscribed(f, cfg);
    s = run_training(cfg);
  }
  if (!s) {
    std::fprintf(stderr, "moe train: %s\n", s.message().c_str());
    return 1;
  }
  return 0;
}

}  // namespace moe::cli
