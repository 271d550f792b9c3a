#include "runtime/train_config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <sstream>

#include <nlohmann/json.hpp>

#include "graph/ep_builder.h"
#include "strategy/strategy.h"

namespace moe {
namespace {

using json = nlohmann::json;

// Reads j[key] into *v when present, with a type check that names the key.
template <typename T>
Status read_key(const json& j, const char* key, T* v) {
  auto it = j.find(key);
  if (it == j.end()) return Status::ok();
  const json& x = *it;
  if constexpr (std::is_same_v<T, std::string>) {
    if (!x.is_string()) return Status::error(std::string("config: '") + key + "' must be a string");
    *v = x.get<std::string>();
  } else if constexpr (std::is_same_v<T, bool>) {
    if (!x.is_boolean()) return Status::error(std::string("config: '") + key + "' must be true or false");
    *v = x.get<bool>();
  } else if constexpr (std::is_integral_v<T>) {
    if (!x.is_number_integer()) return Status::error(std::string("config: '") + key + "' must be an integer");
    if constexpr (std::is_unsigned_v<T>) {
      if (x.is_number_unsigned() || x.get<int64_t>() >= 0) { *v = x.get<T>(); return Status::ok(); }
      return Status::error(std::string("config: '") + key + "' must be non-negative");
    } else {
      // In T's range first: get<T>() wraps, so "threads": 4294967297 would read as 1 thread.
      using limits = std::numeric_limits<T>;
      if (x.is_number_unsigned() ? x.get<uint64_t>() > static_cast<uint64_t>(limits::max())
                                 : x.get<int64_t>() < limits::min() || x.get<int64_t>() > limits::max())
        return Status::error(std::string("config: '") + key + "' (" + x.dump() + ") is out of range");
      *v = x.get<T>();
    }
  } else {
    if (!x.is_number()) return Status::error(std::string("config: '") + key + "' must be a number");
    *v = x.get<T>();
  }
  return Status::ok();
}

}  // namespace

Status TrainConfig::validate() const {
  auto fail = [](const std::string& m) { return Status::error("config: " + m); };
  if (Status s = model.validate(); !s) return s;
  if (steps < 1) return fail("steps (" + std::to_string(steps) + ") must be >= 1");
  if (batch_size < 1) return fail("batch_size (" + std::to_string(batch_size) + ") must be >= 1");
  if (!(lr > 0)) return fail("lr must be > 0");
  if (!(min_lr >= 0) || min_lr > lr) return fail("min_lr must be in [0, lr]");
  if (warmup_steps < 0) return fail("warmup_steps must be >= 0");
  if (!(weight_decay >= 0)) return fail("weight_decay must be >= 0");
  if (!(grad_clip >= 0)) return fail("grad_clip must be >= 0 (0 disables)");
  if (!(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1)) return fail("beta1 and beta2 must be in [0, 1)");
  if (!(val_fraction > 0 && val_fraction < 0.5)) return fail("val_fraction must be in (0, 0.5)");
  if (log_every < 1) return fail("log_every must be >= 1");
  if (eval_every < 0) return fail("eval_every must be >= 0");
  if (eval_batches < 1) return fail("eval_batches must be >= 1");
  if (checkpoint_every < 0) return fail("checkpoint_every must be >= 0");
  if (checkpoint_every > 0 && checkpoint_dir.empty()) return fail("checkpoint_every needs checkpoint_dir");
  if (threads < 0) return fail("threads must be >= 0");
  if (gemm != "auto" && gemm != "onednn" && gemm != "openblas")
    return fail("gemm '" + gemm + "' is not one of auto, onednn, openblas");
  if (!(comm_timeout_s > 0)) return fail("comm_timeout_s must be > 0");
  if (ranks_per_node < 0) return fail("ranks_per_node must be >= 0 (0: as MPI finds them)");
  if (allreduce_micro_kb < 0) return fail("allreduce_micro_kb must be >= 0 (0: no micro-ops)");
  if (trace_steps < 1) return fail("trace_steps must be >= 1");
  // What the strategy is and does, from the strategy itself (strategy/strategy.h).
  std::unique_ptr<strategy::Strategy> probe;
  strategy::Setup probe_setup;
  probe_setup.options.rematerialize = true;
  if (Status s = strategy::make(strategy, probe_setup, &probe); !s) return fail(s.message());
  graph::EpStepOptions graph_options;
  probe->configure(&graph_options);
  if (reshard_every < 0) return fail("reshard_every must be >= 0 (0: never)");
  if (link_refresh_every < 0) return fail("link_refresh_every must be >= 0 (0: never)");
  if (shared_cores != "measured" && shared_cores != "none")
    return fail("shared_cores '" + shared_cores + "' is not one of measured, none");
  if (on_nonfinite != "stop" && on_nonfinite != "skip")
    return fail("on_nonfinite '" + on_nonfinite + "' is not one of stop, skip");
  if (on_checkpoint_error != "stop" && on_checkpoint_error != "continue")
    return fail("on_checkpoint_error '" + on_checkpoint_error + "' is not one of stop, continue");
  if (device != "cpu" && device != "cuda") return fail("device '" + device + "' is not one of cpu, cuda");
  if (device == "cuda" && probe->uses_placements())
    return fail("device cuda trains on one GPU with one rank: strategy must be ep, not " + strategy);
  if (device == "cuda" && !trace.empty()) return fail("trace: not written with device cuda (CPU ranks only)");
  if (dtype != "f32" && dtype != "bf16") return fail("dtype '" + dtype + "' is not one of f32, bf16");
  if (dtype == "bf16" && device != "cuda")
    return fail("dtype bf16 needs device cuda (device " + device + " computes and stores in f32 only)");
  if (rematerialize && !graph_options.rematerialize)
    return fail("rematerialize: strategy " + strategy + " does not re-materialize replicas (hecate does)");
  if (replica_slots < -1) return fail("replica_slots must be >= 0 (-1: experts per rank)");
  if (!(replica_memory_mb >= 0) || !std::isfinite(replica_memory_mb))
    return fail("replica_memory_mb must be >= 0 (0: use replica_slots)");
  if (overlap_degree < -1) return fail("overlap_degree must be >= 0 (-1: from the measured attention time)");
  if (load_window < 1) return fail("load_window must be >= 1");
  if (!(link_gbs >= 0) || !std::isfinite(link_gbs)) return fail("link_gbs must be >= 0 (0: measured)");
  if (!(gemm_gflops >= 0) || !std::isfinite(gemm_gflops)) return fail("gemm_gflops must be >= 0 (0: measured)");
  if (stop_at_step < 0 || stop_at_step > steps)
    return fail("stop_at_step (" + std::to_string(stop_at_step) + ") must be in [0, steps]");
  namespace fs = std::filesystem;
  if (!metrics.empty()) {
    fs::path parent = fs::absolute(metrics).parent_path();
    if (!fs::is_directory(parent)) return fail("metrics: directory " + parent.string() + " does not exist");
  }
  if (!checkpoint_dir.empty()) {
    fs::path parent = fs::absolute(checkpoint_dir).parent_path();
    if (!fs::is_directory(parent)) return fail("checkpoint_dir: directory " + parent.string() + " does not exist");
  }
  if (!trace.empty()) {
    fs::path parent = fs::absolute(trace).parent_path();
    if (!fs::is_directory(parent)) return fail("trace: directory " + parent.string() + " does not exist");
  }
  if (!resume.empty() && !fs::is_directory(resume)) return fail("resume: no checkpoint directory " + resume);
  return Status::ok();
}

json TrainConfig::to_json() const {
  return json{{"data", data},
              {"steps", steps},
              {"batch_size", batch_size},
              {"lr", lr},
              {"min_lr", min_lr},
              {"warmup_steps", warmup_steps},
              {"weight_decay", weight_decay},
              {"grad_clip", grad_clip},
              {"beta1", beta1},
              {"beta2", beta2},
              {"seed", seed},
              {"val_fraction", val_fraction},
              {"log_every", log_every},
              {"eval_every", eval_every},
              {"eval_batches", eval_batches},
              {"metrics", metrics},
              {"checkpoint_dir", checkpoint_dir},
              {"checkpoint_every", checkpoint_every},
              {"resume", resume},
              {"stop_at_step", stop_at_step},
              {"threads", threads},
              {"gemm", gemm},
              {"comm_timeout_s", comm_timeout_s},
              {"ranks_per_node", ranks_per_node},
              {"allreduce_micro_kb", allreduce_micro_kb},
              {"trace", trace},
              {"trace_steps", trace_steps},
              {"strategy", strategy},
              {"rematerialize", rematerialize},
              {"replica_slots", replica_slots},
              {"replica_memory_mb", replica_memory_mb},
              {"overlap_degree", overlap_degree},
              {"load_window", load_window},
              {"link_gbs", link_gbs},
              {"gemm_gflops", gemm_gflops},
              {"link_refresh_every", link_refresh_every},
              {"shared_cores", shared_cores},
              {"on_nonfinite", on_nonfinite},
              {"on_checkpoint_error", on_checkpoint_error},
              {"reshard_every", reshard_every},
              {"device", device},
              {"dtype", dtype},
              {"model", model.to_json()}};
}

Status TrainConfig::merge_json(const json& j, TrainConfig* out) {
  if (!j.is_object()) return Status::error("config: top level must be a JSON object");
  TrainConfig c = *out;
  static const char* kKeys[] = {"data", "steps", "batch_size", "lr", "min_lr", "warmup_steps", "weight_decay",
                                "grad_clip", "beta1", "beta2", "seed", "val_fraction", "log_every", "eval_every",
                                "eval_batches", "metrics", "checkpoint_dir", "checkpoint_every", "resume",
                                "stop_at_step", "threads", "gemm", "comm_timeout_s", "ranks_per_node",
                                "allreduce_micro_kb", "trace", "trace_steps", "strategy", "rematerialize",
                                "replica_slots", "replica_memory_mb", "overlap_degree", "load_window", "link_gbs", "gemm_gflops",
                                "link_refresh_every", "shared_cores", "on_nonfinite",
                                "on_checkpoint_error", "reshard_every", "device", "dtype", "model"};
  for (auto it = j.begin(); it != j.end(); ++it) {
    bool known = false;
    for (const char* k : kKeys) known = known || it.key() == k;
    if (!known) return Status::error("config: unknown key '" + it.key() + "'");
  }
  Status s;
  if ((s = read_key(j, "data", &c.data)) && (s = read_key(j, "steps", &c.steps)) &&
      (s = read_key(j, "batch_size", &c.batch_size)) && (s = read_key(j, "lr", &c.lr)) &&
      (s = read_key(j, "min_lr", &c.min_lr)) && (s = read_key(j, "warmup_steps", &c.warmup_steps)) &&
      (s = read_key(j, "weight_decay", &c.weight_decay)) && (s = read_key(j, "grad_clip", &c.grad_clip)) &&
      (s = read_key(j, "beta1", &c.beta1)) && (s = read_key(j, "beta2", &c.beta2)) &&
      (s = read_key(j, "seed", &c.seed)) && (s = read_key(j, "val_fraction", &c.val_fraction)) &&
      (s = read_key(j, "log_every", &c.log_every)) && (s = read_key(j, "eval_every", &c.eval_every)) &&
      (s = read_key(j, "eval_batches", &c.eval_batches)) && (s = read_key(j, "metrics", &c.metrics)) &&
      (s = read_key(j, "checkpoint_dir", &c.checkpoint_dir)) &&
      (s = read_key(j, "checkpoint_every", &c.checkpoint_every)) && (s = read_key(j, "resume", &c.resume)) &&
      (s = read_key(j, "stop_at_step", &c.stop_at_step)) &&
      (s = read_key(j, "threads", &c.threads)) && (s = read_key(j, "gemm", &c.gemm)) && (s = read_key(j, "comm_timeout_s", &c.comm_timeout_s)) &&
      (s = read_key(j, "ranks_per_node", &c.ranks_per_node)) &&
      (s = read_key(j, "allreduce_micro_kb", &c.allreduce_micro_kb)) && (s = read_key(j, "trace", &c.trace)) &&
      (s = read_key(j, "trace_steps", &c.trace_steps)) && (s = read_key(j, "strategy", &c.strategy)) &&
      (s = read_key(j, "rematerialize", &c.rematerialize)) && (s = read_key(j, "replica_slots", &c.replica_slots)) &&
      (s = read_key(j, "replica_memory_mb", &c.replica_memory_mb)) &&
      (s = read_key(j, "overlap_degree", &c.overlap_degree)) && (s = read_key(j, "load_window", &c.load_window)) &&
      (s = read_key(j, "link_gbs", &c.link_gbs)) && (s = read_key(j, "gemm_gflops", &c.gemm_gflops)) &&
      (s = read_key(j, "link_refresh_every", &c.link_refresh_every)) &&
      (s = read_key(j, "shared_cores", &c.shared_cores)) &&
      (s = read_key(j, "on_nonfinite", &c.on_nonfinite)) &&
      (s = read_key(j, "on_checkpoint_error", &c.on_checkpoint_error)) && (s = read_key(j, "reshard_every", &c.reshard_every)) && (s = read_key(j, "device", &c.device)) &&
      (s = read_key(j, "dtype", &c.dtype))) {
  }
  if (!s) return s;
  if (auto it = j.find("model"); it != j.end()) {
    // Model keys merge over the current model config, like the training keys.
    json merged = c.model.to_json();
    if (!it->is_object()) return Status::error("config: 'model' must be an object");
    for (auto m = it->begin(); m != it->end(); ++m) {
      if (!merged.contains(m.key())) return Status::error("config: unknown key 'model." + m.key() + "'");
      merged[m.key()] = *m;
    }
    if (Status ms = ModelConfig::from_json(merged, &c.model); !ms) return ms;
  }
  *out = c;
  return Status::ok();
}

Status TrainConfig::merge_file(const std::string& path, TrainConfig* out) {
  std::ifstream f(path);
  if (!f) return Status::error("config: cannot open '" + path + "'");
  std::stringstream ss;
  ss << f.rdbuf();
  json j = json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status::error("config: '" + path + "' is not valid JSON");
  Status s = merge_json(j, out);
  if (!s) return Status::error(s.message() + " (in " + path + ")");
  return s;
}

}  // namespace moe
