#include "runtime/trainer.h"

#include <omp.h>

#include <csignal>
#include <cstdlib>
#include <stdexcept>
#include <thread>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <memory>
#include <numeric>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/mpi_communicator.h"
#include "comm/topology.h"
#include "graph/ep_builder.h"
#include "model/checkpoint.h"
#include "model/data.h"
#include "model/model.h"
#include "model/optimizer.h"
#include "moe/experts.h"
#include "runtime/cpu_threads.h"
#include "runtime/ep_step_bodies.h"
#include "runtime/executor.h"
#include "runtime/sharded_checkpoint.h"
#include "plan/hecate.h"
#include "runtime/strategy.h"
#include "runtime/trace.h"
#include "tensor/ops.h"
#include "util/str_cat.h"

namespace moe {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// This process's place among the ranks of the job (one rank when not started by mpirun).
struct Ranks {
  std::unique_ptr<comm::MpiSession> session;
  std::unique_ptr<comm::Communicator> world;
  comm::Groups groups;  // ep: one copy of every expert; dp: the replicas of my experts
  // The allreduce lane's own communicators (the all-to-all lane uses the MoE layers' ep group and
  // the world; the main thread uses the world between steps).
  std::unique_ptr<comm::Communicator> grad_world, grad_dp;
  std::unique_ptr<comm::Communicator> gather;  // the gather lane's (placement strategies)
  comm::Topology topology;
  runtime::ThreadPlan threads;  // this rank's compute threads (runtime/cpu_threads.h)
  int rank = 0, size = 1;
  bool lead() const { return rank == 0; }
  // Sum over ranks (identity with one rank).
  Status sum(double* x, int64_t n) { return world ? world->allreduce(x, n) : Status::ok(); }
  Status sum(int64_t* x, int64_t n) { return world ? world->allreduce(x, n) : Status::ok(); }
};

// Fault injection for the failure tests: MOE_FAULT=<kind>:<rank>:<step> makes that rank, in the middle
// of that (1-based) step (when its first expert computation starts, while the other ranks exchange
// tokens), die by SIGKILL (kill), fail with an error (error), or stop responding without dying (hang).
// Nothing happens without the variable.
struct Fault {
  std::string kind;
  int rank = -1;
  int64_t step = -1;
};
Fault fault_from_env() {
  Fault f;
  const char* v = std::getenv("MOE_FAULT");
  if (!v) return f;
  std::string s(v);
  size_t a = s.find(':'), b = s.rfind(':');
  if (a == std::string::npos || a == b) return f;
  f.kind = s.substr(0, a);
  f.rank = std::atoi(s.substr(a + 1, b - a - 1).c_str());
  f.step = std::atoll(s.substr(b + 1).c_str());
  return f;
}
Status inject(const Fault& f, int rank, int64_t step) {
  if (f.rank != rank || f.step != step) return Status::ok();
  if (f.kind == "kill") std::raise(SIGKILL);
  if (f.kind == "hang") std::this_thread::sleep_for(std::chrono::hours(1));
  if (f.kind == "error") return Status::error("injected fault (MOE_FAULT) at step " + std::to_string(step));
  return Status::ok();
}

bool started_by_mpirun() {
  return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMIX_RANK") || std::getenv("PMI_RANK");
}

// Mean cross-entropy over the first eval_batches validation batches (the same windows every time),
// each rank evaluating its rows of every batch.
Status evaluate(Model& model, const TextDataset& ds, Ranks& ranks, int64_t B, int64_t batches, double* out) {
  const int64_t T = ds.seq_len(), Bl = B / ranks.size;
  std::vector<int32_t> tokens(B * T), targets(B * T);
  double sum = 0;
  for (int64_t i = 0; i < batches; ++i) {
    ds.val_batch(i, B, tokens.data(), targets.data());
    const int64_t first = ranks.rank * Bl * T;
    sum += model.forward(tokens.data() + first, targets.data() + first, Bl);
  }
  if (Status s = ranks.sum(&sum, 1); !s) return s;
  *out = sum / static_cast<double>(batches * ranks.size);
  return Status::ok();
}

// Every rank must run the same configuration on the same data; says which rank differs and in what
// (each config key is hashed apart, so the message can name the keys).
Status check_same_everywhere(Ranks& ranks, const TrainConfig& cfg, const TextDataset& ds) {
  if (!ranks.world) return Status::ok();
  json flat = cfg.to_json().flatten();  // {"/lr": ..., "/model/n_experts": ...}, keys sorted
  std::vector<std::string> keys;
  std::vector<int64_t> mine{static_cast<int64_t>(ds.content_hash()), ds.total_bytes(),
                            static_cast<int64_t>(flat.size())};
  for (auto& [key, value] : flat.items()) {
    const std::string text = key + "=" + value.dump();
    keys.push_back(key.substr(1));
    mine.push_back(static_cast<int64_t>(fnv1a64(text.data(), text.size())));
  }
  // The key count first: a rank with other keys (another moe version) cannot be compared key by key.
  const int64_t n = static_cast<int64_t>(mine.size());
  std::vector<int64_t> sizes(ranks.size);
  if (Status s = ranks.world->allgather(&n, 1, sizes.data()); !s) return s;
  for (int r = 1; r < ranks.size; ++r)
    if (sizes[r] != sizes[0])
      return Status::error("rank " + std::to_string(r) + " runs a different moe build than rank 0 (" +
                           std::to_string(sizes[r] - 3) + " vs " + std::to_string(sizes[0] - 3) + " config keys)");
  std::vector<int64_t> all(n * ranks.size);
  if (Status s = ranks.world->allgather(mine.data(), n, all.data()); !s) return s;
  for (int r = 1; r < ranks.size; ++r) {
    const int64_t* theirs = all.data() + r * n;
    std::string differ;
    for (int64_t k = 3; k < n; ++k) {
      if (theirs[k] == all[k]) continue;
      if (!differ.empty()) differ += ", ";
      differ += keys[k - 3];
    }
    if (!differ.empty())
      return Status::error("rank " + std::to_string(r) + " has a different configuration than rank 0: " +
                           differ + " (same flags and --config file on every rank?)");
    if (theirs[0] != all[0] || theirs[1] != all[1])
      return Status::error("rank " + std::to_string(r) + " read different data than rank 0 (" +
                           std::to_string(theirs[1]) + " vs " + std::to_string(all[1]) + " bytes, content hash " +
                           hex64(static_cast<uint64_t>(theirs[0])) + " vs " + hex64(static_cast<uint64_t>(all[0])) +
                           ")");
  }
  return Status::ok();
}

// Entry i of every pair in a rank-major [ranks][2] allgather result.
std::vector<double> per_rank(const std::vector<double>& pairs, size_t i) {
  std::vector<double> out;
  for (size_t r = 0; 2 * r + i < pairs.size(); ++r) out.push_back(pairs[2 * r + i]);
  return out;
}

// One GEMM kernel for the whole job (the two round differently, so ranks running different kernels
// would drift apart): --gemm when it names one; else the resumed checkpoint's; else MOE_GEMM; else
// rank 0 times both on this run's expert shapes (tensor/ops.h: medians of interleaved rounds, oneDNN
// on near-ties). Rank 0's decision is broadcast and pinned on every rank.
Status choose_gemm(const TrainConfig& cfg, const json& resumed_state, Ranks& ranks) {
  std::string name, why;
  if (cfg.gemm != "auto") {
    name = cfg.gemm, why = "--gemm " + cfg.gemm;
  } else if (resumed_state.contains("gemm") && resumed_state["gemm"].is_string()) {
    name = resumed_state["gemm"].get<std::string>(), why = "as in checkpoint " + cfg.resume;
  } else if (const char* env = std::getenv("MOE_GEMM"); env && *env) {
    name = env, why = "forced by MOE_GEMM";
  } else if (ranks.lead()) {
    // One expert's GEMMs at the balanced rows per expert.
    const int64_t rows = std::max<int64_t>(1, cfg.batch_size * cfg.model.seq_len * cfg.model.top_k / cfg.model.n_experts);
    const GemmRates rates = measure_gemm_backends(expert_gemm_shapes(rows, cfg.model.d_model, cfg.model.d_ffn), 7);
    name = pick_gemm_backend(rates);
    why = describe_gemm_rates(rates) + " on this run's expert shapes";
  }
  if (!name.empty() && name != "onednn" && name != "openblas")
    return Status::error("gemm: '" + name + "' (" + why + ") is not onednn or openblas");
  int64_t onednn = name == "onednn";
  if (ranks.world)
    if (Status s = ranks.world->broadcast(&onednn, 1, 0); !s) return s;
  pin_gemm_backend(onednn ? "onednn" : "openblas", ranks.lead() ? why : "rank 0's choice");
  return Status::ok();
}

Status train(const TrainConfig& cfg, Ranks& ranks) {
  const int64_t B = cfg.batch_size, T = cfg.model.seq_len;
  if (B % ranks.size != 0)
    return Status::error("config: batch_size (" + std::to_string(B) + ") must be a multiple of the ranks (" +
                         std::to_string(ranks.size) + ")");
  const int64_t Bl = B / ranks.size;  // this rank's rows of each global batch

  // ---- data ----
  TextDataset ds;
  std::string data_path;
  if (Status s = open_training_data(cfg, &ds, &data_path); !s) return s;
  if (Status s = check_same_everywhere(ranks, cfg, ds); !s) return s;

  // ---- model and optimizer: replicated parameters are the same on every rank; expert weights are
  // divided among the ranks of an expert-parallel group (the largest that divides both the experts
  // and the ranks), whose copies the data-parallel groups keep in step ----
  Model model(cfg.model, Bl);
  const int64_t full_params = model.num_params();
  model.init(cfg.seed);
  runtime::Strategy strategy(cfg);
  int ep_size = 1;
  if (Status s = strategy.ep_size(ranks.size, &ep_size); !s) return s;
  if (ranks.world) {
    if (Status s = comm::detect_topology(*ranks.world, cfg.ranks_per_node, &ranks.topology); !s) return s;
    if (Status s = comm::make_groups(*ranks.world, ep_size, &ranks.groups); !s) return s;
    if (Status s = ranks.world->dup("world-grad", &ranks.grad_world); !s) return s;
    if (Status s = ranks.groups.dp->dup(ranks.groups.dp->name() + "-grad", &ranks.grad_dp); !s) return s;
    model.set_expert_parallel(ranks.groups.ep.get(), ranks.world.get());
    model.set_ce_grad_scale(1.0f / static_cast<float>(ranks.size));
    plan::Nodes nodes;
    for (int r = 0; r < ranks.size; ++r) nodes.node_of_rank.push_back(ranks.topology.node_of(r));
    if (strategy.uses_placements())
      if (Status s = ranks.groups.ep->dup(ranks.groups.ep->name() + "-gather", &ranks.gather); !s) return s;
    strategy.attach(model, nodes, ranks.gather.get());
  }
  // The step as data (graph/ep_builder.h), what each op does here, and the runtime that runs it.
  graph::EpStepOptions gopt;
  gopt.world = ranks.size;
  gopt.ep_size = ep_size;
  gopt.batch = Bl;
  gopt.allreduce_micro_bytes = cfg.allreduce_micro_kb * 1024;
  strategy.configure(&gopt);
  graph::EpStep step_graph = graph::build_ep_step(cfg.model, gopt);
  runtime::PlacementHooks hooks;
  hooks.place = [&](int64_t l) { return strategy.place(l); };
  hooks.rematerialize = gopt.rematerialize;
  runtime::EpStepBodies bodies(model, step_graph, {ranks.grad_world.get(), ranks.grad_dp.get()}, hooks);
  const Fault fault = fault_from_env();
  int64_t current_step = 0;  // 1-based, for the fault injection
  const runtime::OpBody body = [&](graph::Op& op) {
    if ((op.kind == graph::OpKind::expert_fwd || op.kind == graph::OpKind::ffn_fwd) && op.layer == 0)
      if (Status s = inject(fault, ranks.rank, current_step); !s) return s;
    return bodies.run(op);
  };
  runtime::Executor executor;
  const AdamWConfig ocfg = adamw_config(cfg);
  AdamW opt(model.params(), ocfg);

  // ---- resume: everything is checked before anything is written ----
  int64_t start = 0;
  json resumed_state;
  if (!cfg.resume.empty()) {
    json state;
    if (Status s = runtime::load_sharded_checkpoint(cfg.resume, &opt, &state); !s) return s;
    if (Status s = check_resume(cfg, state, ds.content_hash(), &start); !s) return s;
    resumed_state = std::move(state);
  }
  if (Status s = choose_gemm(cfg, resumed_state, ranks); !s) return s;
  const int64_t end = cfg.stop_at_step > 0 ? cfg.stop_at_step : cfg.steps;
  if (end <= start)
    return Status::error("stop_at_step " + std::to_string(end) + " is not after the checkpoint's step " +
                         std::to_string(start));

  MetricsWriter metrics;
  if (ranks.lead())
    if (Status s = metrics.open(cfg.metrics, start > 0); !s) return s;
  // Only the lead rank speaks; the others run silently.
  auto say = [&](const char* fmt, auto... args) {
    if (!ranks.lead()) return;
    std::printf(fmt, args...);
    std::fflush(stdout);
  };

  say("moe train: %lld parameters (L%lld C%lld E%lld K%lld F%lld T%lld), %s %s\n",
      static_cast<long long>(full_params), (long long)cfg.model.n_layers, (long long)cfg.model.d_model,
      (long long)cfg.model.n_experts, (long long)cfg.model.top_k, (long long)cfg.model.d_ffn, (long long)T,
      cfg.model.activation.c_str(), cfg.model.norm.c_str());
  say("data: %s, %zu files, %.2f MB train / %.2f MB validation, unigram byte entropy %.4f nats\n",
      data_path.c_str(), ds.files().size(), ds.train_bytes() / 1e6, ds.val_bytes() / 1e6, ds.unigram_entropy());
  if (ranks.world) say("topology: %s\n", ranks.topology.describe().c_str());
  say("ranks: %d (expert-parallel groups of %d: %lld experts per rank, %d replicas of each; %lld of %lld sequences "
      "per rank per step)\n",
      ranks.size, ranks.groups.ep_size, (long long)(cfg.model.n_experts / ranks.groups.ep_size), ranks.groups.dp_size,
      (long long)Bl, (long long)B);
  if (ranks.world) {
    std::string detail;
    if (strategy.replica_slots() > 0)
      detail = str_cat(" (up to ", strategy.replica_slots(), " extra experts per rank and layer");
    if (!detail.empty() && strategy.gathers_behind_attention())
      detail += str_cat("; gathered behind attention: ",
                        cfg.overlap_degree >= 0 ? std::to_string(cfg.overlap_degree) : "from attention time",
                        cfg.rematerialize ? "; re-materialized for backward" : "");
    say("strategy: %s%s\n", cfg.strategy.c_str(), detail.empty() ? "" : (detail + ")").c_str());
  }
  say("gemm: %s\n", gemm_backend().c_str());
  const char* wait_policy = std::getenv("OMP_WAIT_POLICY");
  say("threads: %s%s%s\n", ranks.threads.describe().c_str(), wait_policy ? "; OMP_WAIT_POLICY=" : "",
      wait_policy ? wait_policy : "");
  say("batch %lld x %lld tokens; %lld steps\n", (long long)B, (long long)T, (long long)cfg.steps);
  if (start > 0) say("resume: from %s at step %lld\n", cfg.resume.c_str(), (long long)start);

  // The ranks of rank 0's expert-parallel group each write their part of the checkpoint, rank 0
  // finishes it and every rank learns whether it succeeded (all ranks then return the same Status).
  auto save = [&](int64_t step) -> Status {
    json state{{"step", step},
               {"data_hash", hex64(ds.content_hash())},
               {"gemm", gemm_backend_name()},
               {"identity", resume_identity(cfg)},
               {"config", cfg.to_json()},
               {"ranks", ranks.size}};
    const bool writes = ranks.rank < ranks.groups.ep_size;  // the expert-parallel group of rank 0
    Status s = runtime::save_sharded_checkpoint(cfg.checkpoint_dir, opt, ranks.groups.ep.get(), writes, state);
    int64_t failed = s ? 0 : 1;
    if (Status c = ranks.sum(&failed, 1); !c) return c;
    if (failed && s) return Status::error("checkpoint: rank 0 could not write " + cfg.checkpoint_dir);
    return s;
  };

  // The trace covers steps (start, start + trace_steps], timed from one epoch for all ranks: rank 0's
  // moment on the realtime clock, which the ranks of one machine share exactly and machines share to
  // NTP's accuracy. (Each rank taking its own epoch after a barrier leaves them apart by the barrier's
  // exit skew: milliseconds when the ranks oversubscribe the cores, which misplaces a collective's
  // members against each other.) Each rank holds the epoch on its steady clock, which the runtime's
  // timelines use.
  std::vector<runtime::TraceRecord> trace_records;
  const int64_t trace_end = std::min(end, start + cfg.trace_steps);
  int64_t trace_epoch_ns = 0;
  if (!cfg.trace.empty()) {
    auto ns = [](auto t) { return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count(); };
    int64_t epoch_realtime_ns = ns(std::chrono::system_clock::now());
    if (ranks.world)
      if (Status s = ranks.world->broadcast(&epoch_realtime_ns, 1, 0); !s) return s;
    const int64_t steady_now = ns(Clock::now()), realtime_now = ns(std::chrono::system_clock::now());
    trace_epoch_ns = steady_now - (realtime_now - epoch_realtime_ns);
  }
  auto write_trace = [&]() -> Status {
    std::vector<int64_t> mine = runtime::flatten(trace_records), all = mine;
    if (ranks.world) {
      int64_t n = static_cast<int64_t>(mine.size());
      std::vector<int64_t> counts(ranks.size), displs(ranks.size);
      if (Status s = ranks.world->allgather(&n, 1, counts.data()); !s) return s;
      for (int r = 1; r < ranks.size; ++r) displs[r] = displs[r - 1] + counts[r - 1];
      all.assign(displs.back() + counts.back(), 0);
      if (Status s = ranks.world->allgatherv(mine.data(), n, all.data(), counts, displs); !s) return s;
    }
    Status s = ranks.lead() ? runtime::write_chrome_trace(cfg.trace, step_graph.graph, runtime::unflatten(all),
                                                          ranks.size)
                            : Status::ok();
    int64_t failed = s ? 0 : 1;
    if (Status c = ranks.sum(&failed, 1); !c) return c;
    if (failed && s) return Status::error("trace: rank 0 could not write " + cfg.trace);
    return s;
  };

  std::vector<int32_t> tokens(Bl * T), targets(Bl * T);
  std::vector<int64_t> load_buf;
  // Experts Hecate gathers behind each attention (Alg. 1's t): fixed, or from the last step's
  // measured attention time, decided by rank 0 so every rank plans the same (invariant 2).
  int overlap_degree = cfg.overlap_degree >= 0 ? static_cast<int>(cfg.overlap_degree) : 0;
  double last_val = std::nan("");
  double window_loss = 0, window_seconds = 0, window_exposed_ms = 0;
  int64_t window_steps = 0;
  for (int64_t step = start; step < end; ++step) {
    current_step = step + 1;
    auto t0 = Clock::now();
    ds.batch_rows(step, B, ranks.rank * Bl, Bl, tokens.data(), targets.data());
    model.zero_grad();
    model.begin_step(tokens.data(), targets.data(), Bl);
    const int overlap_used = overlap_degree;
    strategy.before_step(overlap_used);
    // Forward, backward and the gradient sums (each rank's gradients are its share of the global
    // batch's, Model::set_ce_grad_scale, so their sum is the whole batch's).
    runtime::StepTimeline timeline;
    if (Status s = executor.run(step_graph.graph, body, &timeline); !s) return s;
    if (!cfg.trace.empty() && step < trace_end) {
      runtime::append_records(&trace_records, step_graph.graph, timeline, ranks.rank, step + 1, trace_epoch_ns);
      if (step + 1 == trace_end) {
        if (Status s = write_trace(); !s) return s;
        say("trace: steps %lld-%lld of %d rank(s) written to %s\n", (long long)(start + 1), (long long)trace_end,
            ranks.size, cfg.trace.c_str());
      }
    }
    // Where the step's time went, averaged over ranks.
    const runtime::StepBreakdown br = runtime::breakdown(step_graph.graph, timeline);
    double attn_ms = 0;  // mean attn_fwd op
    int n_attn = 0;
    for (const graph::Op& op : step_graph.graph.ops)
      if (op.kind == graph::OpKind::attn_fwd && timeline.spans[op.id].end_ns >= 0) {
        attn_ms += 1e-6 * static_cast<double>(timeline.spans[op.id].end_ns - timeline.spans[op.id].start_ns);
        ++n_attn;
      }
    if (n_attn) attn_ms /= n_attn;
    // The MoE layers' share of the step on this rank (gate_fwd .. combine_fwd and combine_bwd ..
    // gate_bwd of every MoE block, waits included) and its expert GEMMs (expert_fwd + expert_bwd).
    double rank_times[2] = {0, 0};  // moe_ms, expert_ms
    {
      std::vector<int64_t> first(cfg.model.n_layers * 2, -1), last(cfg.model.n_layers * 2, -1);
      for (const graph::Op& op : step_graph.graph.ops) {
        const runtime::OpSpan& sp = timeline.spans[op.id];
        if (op.layer < 0 || sp.end_ns < 0 || op.stream != graph::kComputeStream) continue;
        if (op.kind == graph::OpKind::expert_fwd || op.kind == graph::OpKind::expert_bwd)
          rank_times[1] += 1e-6 * static_cast<double>(sp.end_ns - sp.start_ns);
        const bool fwd = op.kind == graph::OpKind::gate_fwd || op.kind == graph::OpKind::place ||
                         op.kind == graph::OpKind::dispatch_fwd || op.kind == graph::OpKind::expert_fwd ||
                         op.kind == graph::OpKind::combine_fwd;
        const bool bwd = op.kind == graph::OpKind::combine_bwd || op.kind == graph::OpKind::expert_bwd ||
                         op.kind == graph::OpKind::gate_bwd;
        if (!fwd && !bwd) continue;
        const size_t i = op.layer * 2 + (bwd ? 1 : 0);
        first[i] = first[i] < 0 ? sp.start_ns : std::min(first[i], sp.start_ns);
        last[i] = std::max(last[i], sp.end_ns);
      }
      for (size_t i = 0; i < first.size(); ++i)
        if (first[i] >= 0) rank_times[0] += 1e-6 * static_cast<double>(last[i] - first[i]);
    }
    std::vector<double> all_rank_times(rank_times, rank_times + 2);
    if (ranks.world) {
      all_rank_times.assign(2 * ranks.size, 0);
      if (Status s = ranks.world->allgather(rank_times, 2, all_rank_times.data()); !s) return s;
    }
    double times[6] = {br.compute_ms, br.exposed_comm_ms, br.comm_ms, br.allreduce_ms, br.allreduce_hidden_ms, attn_ms};
    if (Status s = ranks.sum(times, 6); !s) return s;
    for (double& t : times) t /= ranks.size;
    double loss = model.cross_entropy();
    if (ranks.world) {
      if (Status s = ranks.sum(&loss, 1); !s) return s;
      loss /= ranks.size;
    }
    if (!std::isfinite(loss) || !std::isfinite(model.moe_loss()))
      return Status::error("training diverged: loss is " + std::to_string(loss) + " at step " +
                           std::to_string(step + 1) + " (try a lower --lr)");
    Status norm_status;
    auto sum_over_shards = [&](double x) {
      if (ranks.world && norm_status) norm_status = ranks.groups.ep->allreduce(&x, 1);
      return x;
    };
    double grad_norm = opt.clip_grad_norm(
        cfg.grad_clip > 0 ? static_cast<float>(cfg.grad_clip) : std::numeric_limits<float>::infinity(),
        sum_over_shards);
    if (!norm_status) return norm_status;
    float lr = lr_at(step, cfg.steps, cfg.warmup_steps, static_cast<float>(cfg.lr), static_cast<float>(cfg.min_lr));
    opt.step(lr);
    double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    window_loss += loss;
    window_seconds += seconds;
    window_exposed_ms += times[1];
    ++window_steps;

    const int64_t done = step + 1;
    if (cfg.overlap_degree < 0 && strategy.uses_placements()) {
      int64_t t = plan::overlap_degree(times[5] * 1e-3, cfg.link_gbs * 1e9, strategy.expert_bytes());
      if (ranks.world)
        if (Status s = ranks.world->broadcast(&t, 1, 0); !s) return s;
      overlap_degree = static_cast<int>(t);
    }
    std::vector<LayerLoad> loads = model.load_stats();
    // Global load: kept assignments per expert summed over ranks; rows each rank's experts ran.
    const int64_t E = cfg.model.n_experts;
    load_buf.assign(loads.size() * (E + 1), 0);
    std::vector<int64_t> rows_mine(loads.size()), rows_all(loads.size() * ranks.size);
    for (size_t i = 0; i < loads.size(); ++i) {
      std::copy(loads[i].tokens_per_expert.begin(), loads[i].tokens_per_expert.end(), load_buf.begin() + i * (E + 1));
      load_buf[i * (E + 1) + E] = loads[i].dropped;
      rows_mine[i] = model.moe_layer(loads[i].layer)->expert_rows();
    }
    if (Status s = ranks.sum(load_buf.data(), static_cast<int64_t>(load_buf.size())); !s) return s;
    if (ranks.world) {
      if (Status s = ranks.world->allgather(rows_mine.data(), static_cast<int64_t>(rows_mine.size()), rows_all.data());
          !s)
        return s;
    } else {
      rows_all = rows_mine;
    }
    // What the strategy moved and held: extra replicas (the same plan on every rank), sparse-collective
    // bytes (sent + received, summed over ranks) and per-rank memory (the largest rank's).
    int64_t replicas = 0, sparse_bytes = 0;
    for (const LayerLoad& ll : loads) {
      MoeLayer* moe = model.moe_layer(ll.layer);
      if (!moe->placements_enabled()) continue;
      for (const std::vector<int>& r : moe->placement().replicas) replicas += static_cast<int64_t>(r.size()) - 1;
      sparse_bytes += moe->take_sparse_bytes();
    }
    int64_t param_bytes = 0;
    for (const Param* p : opt.params()) param_bytes += static_cast<int64_t>(p->value.numel() * sizeof(float));
    std::vector<int64_t> memory{param_bytes, model.replica_memory().peak()};
    model.replica_memory().reset_peak();
    if (ranks.world) {
      std::vector<int64_t> all(2 * ranks.size);
      if (Status s = ranks.world->allgather(memory.data(), 2, all.data()); !s) return s;
      for (int r = 0; r < ranks.size; ++r)
        for (int i = 0; i < 2; ++i) memory[i] = std::max(memory[i], all[2 * r + i]);
      if (Status s = ranks.sum(&sparse_bytes, 1); !s) return s;
    }
    std::vector<std::vector<int64_t>> global_loads;
    json per_layer_tokens = json::array(), per_layer_imbalance = json::array(), per_layer_dropped = json::array();
    json per_layer_rank_tokens = json::array(), per_layer_rank_imbalance = json::array();
    for (size_t i = 0; i < loads.size(); ++i) {
      loads[i].tokens_per_expert.assign(load_buf.begin() + i * (E + 1), load_buf.begin() + i * (E + 1) + E);
      loads[i].dropped = load_buf[i * (E + 1) + E];
      per_layer_tokens.push_back(loads[i].tokens_per_expert);
      global_loads.push_back(loads[i].tokens_per_expert);
      per_layer_imbalance.push_back(imbalance(loads[i].tokens_per_expert));
      per_layer_dropped.push_back(loads[i].dropped);
      std::vector<int64_t> per_rank(ranks.size);
      for (int r = 0; r < ranks.size; ++r) per_rank[r] = rows_all[r * loads.size() + i];
      per_layer_rank_tokens.push_back(per_rank);
      per_layer_rank_imbalance.push_back(imbalance(per_rank));
    }
    // The strategy learns this step's loads, then re-shards when due (Hecate's Alg. 2, SmartMoE).
    strategy.observe(global_loads);
    int experts_moved = 0;
    try {
      experts_moved = strategy.reshard(opt, done);
    } catch (const std::runtime_error& e) {
      return Status::error(std::string("re-sharding: ") + e.what());
    }
    metrics.write({{"step", done},
                   {"loss", loss},
                   {"aux_loss", model.aux_loss()},
                   {"z_loss", model.z_loss()},
                   {"lr", lr},
                   {"grad_norm", grad_norm},
                   {"step_ms", seconds * 1e3},
                   {"tokens_per_s", B * T / seconds},
                   {"compute_ms", times[0]},
                   {"exposed_comm_ms", times[1]},
                   {"comm_ms", times[2]},
                   {"allreduce_ms", times[3]},
                   {"allreduce_hidden_ms", times[4]},
                   {"load_imbalance", per_layer_imbalance},
                   {"tokens_per_rank", per_layer_rank_tokens},
                   {"rank_imbalance", per_layer_rank_imbalance},
                   {"dropped", per_layer_dropped},
                   {"tokens_per_expert", per_layer_tokens},
                   {"strategy", cfg.strategy},
                   {"gemm", gemm_backend_name()},
                   {"threads", ranks.threads.threads},
                   // per rank: MoE layers' time and expert GEMM time (see above)
                   {"moe_ms_per_rank", per_rank(all_rank_times, 0)},
                   {"expert_ms_per_rank", per_rank(all_rank_times, 1)},
                   {"replicas", replicas},
                   {"overlap_degree", overlap_used},
                   {"calibrations", strategy.take_calibrations()},
                   {"experts_moved", experts_moved},
                   {"sparse_bytes", sparse_bytes},
                   // Per rank (the largest): parameters held, their gradients (the same size) and
                   // AdamW's two moments, plus the peak of materialized replicas (weights + grads).
                   {"memory_bytes",
                    {{"params", memory[0]},
                     {"grads", memory[0]},
                     {"optimizer", 2 * memory[0]},
                     {"replicas_peak", memory[1]}}}});

    if (done % cfg.log_every == 0 || done == end) {
      // aux per MoE layer: 1.0 is a perfectly balanced router, whatever the layer count.
      std::string rank_load;
      if (ranks.world) {
        // The slowest rank sets the pace: its expert rows over the mean, worst layer; and the share of
        // the step the compute stream waited on communication.
        double worst = 1;
        for (const auto& r : per_layer_rank_imbalance) worst = std::max(worst, r.get<double>());
        char buf[64];
        std::snprintf(buf, sizeof buf, "  ranks max/mean %.2f  comm %2.0f%%", worst,
                      100.0 * window_exposed_ms / (1e3 * window_seconds));
        rank_load = buf;
      }
      say("step %5lld/%lld  loss %.4f  aux/layer %.3f  lr %.2e  |g| %.2f  %7.0f tok/s  load max/mean %s%s\n",
          (long long)done, (long long)cfg.steps, window_loss / window_steps,
          model.aux_loss() / std::max<size_t>(1, loads.size()), lr, grad_norm, window_steps * B * T / window_seconds,
          load_imbalance_line(loads).c_str(), rank_load.c_str());
      window_loss = window_seconds = window_exposed_ms = 0;
      window_steps = 0;
    }

    if (Status s = evaluate_and_checkpoint(
            cfg, done, end, cfg.eval_batches * B, ranks.lead(), metrics,
            [&](double* loss) { return evaluate(model, ds, ranks, B, cfg.eval_batches, loss); }, save, &last_val);
        !s)
      return s;
  }

  say("%s", training_end_message(cfg, end, last_val, ds.unigram_entropy()).c_str());
  return Status::ok();
}

}  // namespace

double imbalance(const std::vector<int64_t>& tokens_per_expert) {
  if (tokens_per_expert.empty()) return 1.0;
  int64_t total = std::accumulate(tokens_per_expert.begin(), tokens_per_expert.end(), int64_t{0});
  if (total == 0) return 1.0;
  int64_t mx = *std::max_element(tokens_per_expert.begin(), tokens_per_expert.end());
  return static_cast<double>(mx) * tokens_per_expert.size() / total;
}

Status open_training_data(const TrainConfig& cfg, TextDataset* ds, std::string* path) {
  DataOptions dopt;
  dopt.seq_len = cfg.model.seq_len;
  dopt.val_fraction = cfg.val_fraction;
  dopt.seed = cfg.seed;
  *path = cfg.data;
  if (path->empty()) {
    *path = kDefaultCorpus;
    dopt.suffix = kDefaultCorpusSuffix;
  }
  return TextDataset::open(*path, dopt, ds);
}

AdamWConfig adamw_config(const TrainConfig& cfg) {
  AdamWConfig o;
  o.lr = static_cast<float>(cfg.lr);
  o.beta1 = static_cast<float>(cfg.beta1);
  o.beta2 = static_cast<float>(cfg.beta2);
  o.weight_decay = static_cast<float>(cfg.weight_decay);
  o.grad_clip = static_cast<float>(cfg.grad_clip);
  return o;
}

std::string load_imbalance_line(const std::vector<LayerLoad>& loads) {
  std::string out;
  for (size_t i = 0; i < loads.size(); ++i) {
    char buf[16];
    std::snprintf(buf, sizeof buf, "%s%.2f", i ? " " : "", imbalance(loads[i].tokens_per_expert));
    out += buf;
  }
  return out;
}

Status MetricsWriter::open(const std::string& path, bool append) {
  if (path.empty()) return Status::ok();
  out_.open(path, append ? std::ios::app : std::ios::trunc);
  if (!out_) return Status::error("metrics: cannot open " + path + " for writing");
  return Status::ok();
}

void MetricsWriter::write(const json& j) {
  if (!out_.is_open()) return;
  out_ << j.dump() << '\n';
  out_.flush();
}

Status evaluate_and_checkpoint(const TrainConfig& cfg, int64_t done, int64_t end, int64_t windows, bool speak,
                               MetricsWriter& metrics, const std::function<Status(double*)>& evaluate,
                               const std::function<Status(int64_t)>& save, double* last_val) {
  const bool last = done == end;
  if ((cfg.eval_every > 0 && done % cfg.eval_every == 0) || (last && done == cfg.steps)) {
    const auto e0 = Clock::now();
    if (Status s = evaluate(last_val); !s) return s;
    const double es = std::chrono::duration<double>(Clock::now() - e0).count();
    if (speak) {
      std::printf("step %5lld/%lld  validation loss %.4f  (%lld windows, %.1f s)\n", (long long)done,
                  (long long)cfg.steps, *last_val, (long long)windows, es);
      std::fflush(stdout);
    }
    metrics.write({{"step", done}, {"val_loss", *last_val}});
  }
  if (!cfg.checkpoint_dir.empty() && ((cfg.checkpoint_every > 0 && done % cfg.checkpoint_every == 0) || last)) {
    if (Status s = save(done); !s) return s;
    if (speak) {
      std::printf("checkpoint: step %lld written to %s\n", (long long)done, cfg.checkpoint_dir.c_str());
      std::fflush(stdout);
    }
  }
  return Status::ok();
}

std::string training_end_message(const TrainConfig& cfg, int64_t end, double last_val, double h) {
  char buf[256];
  if (end < cfg.steps) {
    std::snprintf(buf, sizeof buf, "stopped at step %lld of %lld%s\n", (long long)end, (long long)cfg.steps,
                  cfg.checkpoint_dir.empty() ? "" : "; resume with --resume <checkpoint-dir>");
  } else {
    std::snprintf(buf, sizeof buf, "validation loss %.4f nats; unigram byte entropy %.4f nats; %.1f%% below\n", last_val,
                  h, 100.0 * (h - last_val) / h);
  }
  return buf;
}

std::string hex64(uint64_t x) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(x));
  return buf;
}

json resume_identity(const TrainConfig& c) {
  json j = c.to_json();
  for (const char* k : {"data", "metrics", "checkpoint_dir", "checkpoint_every", "resume", "stop_at_step", "log_every",
                        "eval_every", "eval_batches", "threads", "gemm", "comm_timeout_s", "ranks_per_node", "allreduce_micro_kb",
                        "trace", "trace_steps", "strategy", "rematerialize", "replica_slots", "replica_memory_mb", "overlap_degree",
                        "load_window", "link_gbs", "gemm_gflops", "reshard_every", "device", "dtype"})
    j.erase(k);
  return j;
}

Status check_resume(const TrainConfig& cfg, const json& state, uint64_t data_hash, int64_t* start) {
  try {
    *start = state.at("step").get<int64_t>();
    if (state.at("data_hash").get<std::string>() != hex64(data_hash))
      return Status::error("resume: checkpoint " + cfg.resume + " was trained on different data (corpus hash " +
                           state.at("data_hash").get<std::string>() + ", this corpus " + hex64(data_hash) + ")");
    json was = state.at("identity"), now = resume_identity(cfg);
    for (auto& [key, value] : now.items())
      if (!was.contains(key) || was[key] != value)
        return Status::error("resume: checkpoint " + cfg.resume + " has " + key + " = " +
                             (was.contains(key) ? was[key].dump() : "(absent)") + ", this run has " + value.dump());
  } catch (const json::exception& e) {
    return Status::error("resume: " + cfg.resume + "/state.json is incomplete: " + e.what());
  }
  if (*start >= cfg.steps)
    return Status::error("resume: checkpoint " + cfg.resume + " is at step " + std::to_string(*start) +
                         ", nothing left of " + std::to_string(cfg.steps) + " steps");
  return Status::ok();
}

Status run_training(const TrainConfig& cfg) {
  if (cfg.device != "cpu")
    return Status::error("run_training trains on the CPU; device " + cfg.device + " runs through cuda/train.h");
  Ranks ranks;
  if (started_by_mpirun()) {
    if (Status s = comm::MpiSession::start(&ranks.session); !s) return s;
    // The runtime's communication lanes call MPI from their own threads at the same time.
    if (std::string(ranks.session->thread_level_name()) != "MPI_THREAD_MULTIPLE")
      return Status::error(std::string("comm: this MPI library provides only ") + ranks.session->thread_level_name() +
                           "; moe needs MPI_THREAD_MULTIPLE for its communication threads");
    const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(cfg.comm_timeout_s * 1000));
    if (Status s = ranks.session->world(&ranks.world, timeout); !s) return s;
    ranks.rank = ranks.world->rank();
    ranks.size = ranks.world->size();
    if (ranks.size == 1) ranks.world.reset();  // one rank: the single-process path, no collectives
  }
  // Threads: as asked (--threads, else OMP_NUM_THREADS), else this rank's CPUs shared among the ranks
  // whose CPUs overlap its own.
  if (Status s = runtime::plan_rank_threads(runtime::thread_request(cfg.threads), ranks.world.get(), &ranks.threads);
      !s) {
    if (ranks.size > 1) comm::abort_job(s);
    return s;
  }
  omp_set_num_threads(ranks.threads.threads);
  set_gemm_threads(ranks.threads.threads);
  Status s;
  try {
    s = train(cfg, ranks);
  } catch (const std::exception& e) {
    s = Status::error(e.what());
  }
  // A rank that fails while others may sit in a collective must take the job down, or they hang.
  if (!s && ranks.size > 1) comm::abort_job(s);
  return s;
}

}  // namespace moe
