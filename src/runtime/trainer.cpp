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
#include "runtime/measure_costs.h"
#include "runtime/sharded_checkpoint.h"
#include "plan/placement.h"
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
  plan::CorePools cores;        // the job's ranks that take turns on shared cores (empty: none, or --shared-cores none)
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
// MOE_FAULT=nan:R:S: after step S's gradient sums, rank R's gradient of its first expert weight (or,
// without MoE layers, its first parameter) gets one NaN, as an overflow in a backward would leave it.
void inject_nan(const Fault& f, int rank, int64_t step, Model& model) {
  if (f.kind != "nan" || f.rank != rank || f.step != step) return;
  std::vector<Param*> params = model.params();
  Param* target = params.front();
  for (Param* p : params)
    if (p->name.find("moe.w1") != std::string::npos) {
      target = p;
      break;
    }
  target->grad.data()[0] = std::numeric_limits<float>::quiet_NaN();
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
// rank 0 times both on this run's expert shapes (tensor/ops.h: best of interleaved rounds, oneDNN
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

// What one step measured, averaged or gathered over the ranks (the metrics line and the progress line).
struct StepFigures {
  double loss = 0, grad_norm = 0, seconds = 0;
  bool skipped = false;  // a non-finite loss or gradient: the optimizer did not run (--on-nonfinite skip)
  float lr = 0;
  // Over ranks, mean: compute, exposed communication, communication, allreduce, its hidden part, and
  // the mean attn_fwd op (ms).
  double compute_ms = 0, exposed_comm_ms = 0, comm_ms = 0, allreduce_ms = 0, allreduce_hidden_ms = 0, attn_ms = 0;
  std::vector<double> moe_ms_per_rank, expert_ms_per_rank;
  runtime::WeightTransfers weights;  // over every rank (runtime::weight_transfers)
};

// The mean duration of the step's attn_fwd ops, ms (0 when none ran).
double mean_attention_ms(const graph::StepGraph& g, const runtime::StepTimeline& timeline) {
  double sum = 0;
  int n = 0;
  for (const graph::Op& op : g.ops)
    if (op.kind == graph::OpKind::attn_fwd && timeline.spans[op.id].end_ns >= 0) {
      sum += 1e-6 * static_cast<double>(timeline.spans[op.id].end_ns - timeline.spans[op.id].start_ns);
      ++n;
    }
  return n ? sum / n : 0.0;
}

// The step's expert-weight transfers over every rank (runtime::weight_transfers), from each rank's
// part in the sparse collectives gathered to all, so that every rank reads the same rate.
Status weights_moved(Ranks& ranks, const graph::StepGraph& g, const runtime::StepTimeline& timeline,
                     runtime::WeightTransfers* out) {
  const std::vector<runtime::SparseOpPart> mine = runtime::sparse_op_parts(g, timeline);
  constexpr size_t kF = runtime::SparseOpPart::kFields;
  const size_t n = kF * mine.size();
  std::vector<double> own;
  for (const runtime::SparseOpPart& p : mine) own.insert(own.end(), {p.seconds, p.sent, p.received});
  std::vector<double> all = own;
  if (ranks.world && n > 0) {
    all.resize(static_cast<size_t>(ranks.size) * n);
    if (Status s = ranks.world->allgather(own.data(), static_cast<int64_t>(n), all.data()); !s) return s;
  }
  std::vector<std::vector<runtime::SparseOpPart>> parts(n > 0 ? all.size() / n : 0, mine);
  for (size_t r = 0; r < parts.size(); ++r)
    for (size_t o = 0; o < mine.size(); ++o) {
      const double* x = &all[r * n + kF * o];
      parts[r][o] = {x[0], x[1], x[2]};
    }
  *out = runtime::weight_transfers(parts);
  return Status::ok();
}

// The cost model as the metrics record it (GB/s, us, GFLOP/s).
json cost_model_json(const strategy::CostModel& c) {
  return {{"intra_node_gbs", c.intra_node.bandwidth / 1e9}, {"intra_node_us", c.intra_node.latency * 1e6},
          {"inter_node_gbs", c.inter_node.bandwidth / 1e9}, {"inter_node_us", c.inter_node.latency * 1e6},
          {"weights_gbs", c.bandwidth / 1e9},               {"network_gbs", c.network_bandwidth / 1e9},
          {"overlap_gbs", c.overlap_bandwidth / 1e9},
          {"gemm_gflops", c.gemm_flops / 1e9}};
}

// "ranks 0 1 share cores running 1 at full speed, ranks 2 3 share cores running 1 at full speed"
std::string describe(const plan::CorePools& pools) {
  std::string out;
  for (size_t p = 0; p < pools.ranks_at_once.size(); ++p) {
    out += p ? ", ranks" : "ranks";
    for (size_t r = 0; r < pools.pool_of_rank.size(); ++r)
      if (pools.pool_of_rank[r] == static_cast<int>(p)) out += str_cat(" ", r);
    char at_once[32];
    std::snprintf(at_once, sizeof at_once, "%.3g", pools.ranks_at_once[p]);
    out += str_cat(" share cores running ", at_once, " at full speed");
  }
  return out;
}

struct StepLoads;

// One training run on this rank, phase by phase (train() below calls them in order). Every phase
// that communicates is collective: every rank calls it, in the same order.
class TrainingRun {
 public:
  TrainingRun(const TrainConfig& cfg, Ranks& ranks) : cfg_(cfg), ranks_(ranks), strategy_(cfg) {}

  Status set_up();           // data, model, groups, strategy, the step graph and its bodies, optimizer
  Status resume();           // the checkpoint (checked before anything is written), the GEMM kernel
  Status measure_costs();    // the planners' cost model, measured on this machine
  Status announce();         // the metrics file and the start-up lines
  Status start_trace();      // the trace's common epoch
  Status run_step(int64_t step, StepFigures* f);  // forward, backward, gradient sums, optimizer
  Status trace_step(int64_t step);                // the step's spans; the trace file after its last step
  Status after_step(int64_t step, const StepFigures& f);  // loads, strategy, metrics, progress
  Status evaluate_and_save(int64_t done);
  int64_t start() const { return start_; }
  int64_t end() const { return end_; }
  void finish();             // the last line

 private:
  Status gather_loads(StepLoads* out);
  void refresh_costs(const StepFigures& f, const StepLoads& l);
  Status refresh_links(int64_t done);
  Status check_finite(int64_t step, StepFigures* f);
  void write_metrics(int64_t done, const StepFigures& f, const StepLoads& l, int experts_moved,
                     double reshard_seconds);
  void print_progress(int64_t done, const StepFigures& f, const StepLoads& l);
  Status save(int64_t step);
  Status write_trace();
  void say(const char* fmt, auto... args) {
    if (!ranks_.lead()) return;  // only the lead rank speaks; the others run silently
    std::printf(fmt, args...);
    std::fflush(stdout);
  }

  const TrainConfig& cfg_;
  Ranks& ranks_;
  int64_t B_ = 0, T_ = 0, Bl_ = 0;  // global batch, sequence length, this rank's rows of each batch
  TextDataset ds_;
  std::string data_path_;
  std::unique_ptr<Model> model_;
  int64_t full_params_ = 0;
  runtime::Strategy strategy_;
  int ep_size_ = 1;
  plan::Nodes nodes_{{0}};  // node of each rank
  graph::EpStepOptions gopt_;
  graph::EpStep step_graph_;
  std::unique_ptr<runtime::EpStepBodies> bodies_;
  Fault fault_;
  int64_t current_step_ = 0;  // 1-based, for the fault injection
  runtime::OpBody body_;
  runtime::Executor executor_;
  std::unique_ptr<AdamW> opt_;
  int64_t start_ = 0, end_ = 0;
  json resumed_state_;
  MetricsWriter metrics_;
  std::vector<runtime::TraceRecord> trace_records_;
  int64_t trace_end_ = 0, trace_epoch_ns_ = 0;
  runtime::StepTimeline timeline_;
  std::vector<int32_t> tokens_, targets_;
  int overlap_used_ = 0;  // Hecate's t in this step
  double last_val_ = std::nan("");
  double window_loss_ = 0, window_seconds_ = 0, window_exposed_ms_ = 0;  // since the last progress line
  int64_t window_losses_ = 0;  // steps of the window with a finite loss (skipped ones have none)
  static constexpr int kMaxSkippedInARow = 10;
  int skipped_in_a_row_ = 0;
  int64_t skipped_steps_ = 0;
  int64_t window_steps_ = 0;
};

Status TrainingRun::set_up() {
  B_ = cfg_.batch_size, T_ = cfg_.model.seq_len;
  if (B_ % ranks_.size != 0)
    return Status::error("config: batch_size (" + std::to_string(B_) + ") must be a multiple of the ranks (" +
                         std::to_string(ranks_.size) + ")");
  Bl_ = B_ / ranks_.size;
  if (Status s = open_training_data(cfg_, &ds_, &data_path_); !s) return s;
  if (Status s = check_same_everywhere(ranks_, cfg_, ds_); !s) return s;

  // Replicated parameters are the same on every rank; expert weights are divided among the ranks of
  // an expert-parallel group (the largest that divides both the experts and the ranks), whose copies
  // the data-parallel groups keep in step.
  model_ = std::make_unique<Model>(cfg_.model, Bl_);
  full_params_ = model_->num_params();
  model_->init(cfg_.seed);
  if (Status s = strategy_.ep_size(ranks_.size, &ep_size_); !s) return s;
  if (ranks_.world) {
    if (Status s = comm::detect_topology(*ranks_.world, cfg_.ranks_per_node, &ranks_.topology); !s) return s;
    if (Status s = comm::make_groups(*ranks_.world, ep_size_, &ranks_.groups); !s) return s;
    if (Status s = ranks_.world->dup("world-grad", &ranks_.grad_world); !s) return s;
    if (Status s = ranks_.groups.dp->dup(ranks_.groups.dp->name() + "-grad", &ranks_.grad_dp); !s) return s;
    model_->set_expert_parallel(ranks_.groups.ep.get(), ranks_.world.get());
    model_->set_ce_grad_scale(1.0f / static_cast<float>(ranks_.size));
    nodes_.node_of_rank.clear();
    for (int r = 0; r < ranks_.size; ++r) nodes_.node_of_rank.push_back(ranks_.topology.node_of(r));
    if (strategy_.uses_placements())
      if (Status s = ranks_.groups.ep->dup(ranks_.groups.ep->name() + "-gather", &ranks_.gather); !s) return s;
    // The gradient and gather lanes wait behind compute: they sleep rather than take turns on the
    // compute's core (docs/strategies.md, "A wait mode per lane"). The all-to-all lane keeps polling.
    for (comm::Communicator* c : {ranks_.grad_world.get(), ranks_.grad_dp.get(), ranks_.gather.get()})
      if (c) c->set_wait_mode(comm::WaitMode::sleep);
    strategy_.attach(*model_, nodes_, ranks_.cores, ranks_.gather.get());
  }
  // The step as data (the strategy's graph), what each op does here, and the runtime that runs it.
  gopt_.world = ranks_.size;
  gopt_.ep_size = ep_size_;
  gopt_.batch = Bl_;
  gopt_.allreduce_micro_bytes = cfg_.allreduce_micro_kb * 1024;
  strategy_.configure(&gopt_);
  if (gopt_.padded_exchange)
    for (int64_t l = 0; l < model_->n_blocks(); ++l)
      if (MoeLayer* m = model_->moe_layer(l); m && m->expert_parallel()) m->set_padded_exchange(true);
  step_graph_ = strategy_.build_step(gopt_);
  runtime::PlacementHooks hooks;
  hooks.place = [this](int64_t l) { return strategy_.place(l); };
  hooks.rematerialize = gopt_.rematerialize;
  bodies_ = std::make_unique<runtime::EpStepBodies>(*model_, step_graph_,
                                                    runtime::GradComms{ranks_.grad_world.get(), ranks_.grad_dp.get()},
                                                    hooks);
  fault_ = fault_from_env();
  body_ = [this](graph::Op& op) {
    if ((op.kind == graph::OpKind::expert_fwd || op.kind == graph::OpKind::ffn_fwd) && op.layer == 0)
      if (Status s = inject(fault_, ranks_.rank, current_step_); !s) return s;
    return bodies_->run(op);
  };
  opt_ = std::make_unique<AdamW>(model_->params(), adamw_config(cfg_));
  tokens_.resize(Bl_ * T_);
  targets_.resize(Bl_ * T_);
  return Status::ok();
}

Status TrainingRun::resume() {
  if (!cfg_.resume.empty()) {
    json state;
    if (Status s = runtime::load_sharded_checkpoint(cfg_.resume, opt_.get(), &state); !s) return s;
    if (Status s = check_resume(cfg_, state, ds_.content_hash(), &start_); !s) return s;
    resumed_state_ = std::move(state);
  }
  if (Status s = choose_gemm(cfg_, resumed_state_, ranks_); !s) return s;
  end_ = cfg_.stop_at_step > 0 ? cfg_.stop_at_step : cfg_.steps;
  if (end_ <= start_)
    return Status::error("stop_at_step " + std::to_string(end_) + " is not after the checkpoint's step " +
                         std::to_string(start_));
  return Status::ok();
}

// Every rank measures, the ranks agree on one set (runtime/measure_costs.h), and the strategy plans
// with it from the first step. --link-gbs and --gemm-gflops override what they name.
Status TrainingRun::measure_costs() {
  const ModelConfig& m = cfg_.model;
  const int64_t rows = std::max<int64_t>(1, B_ * T_ * m.top_k / m.n_experts);  // balanced rows per expert
  runtime::RawCosts mine, agreed;
  if (Status s = runtime::measure_costs(ranks_.world.get(), nodes_, m, rows, &mine); !s) return s;
  if (Status s = runtime::agree_costs(ranks_.world.get(), mine, &agreed); !s) return s;
  strategy_.set_cost_model(runtime::cost_model_from(m, agreed, nodes_, cfg_.link_gbs, cfg_.gemm_gflops));
  return Status::ok();
}

Status TrainingRun::announce() {
  if (ranks_.lead())
    if (Status s = metrics_.open(cfg_.metrics, start_ > 0); !s) return s;
  const ModelConfig& m = cfg_.model;
  say("moe train: %lld parameters (L%lld C%lld E%lld K%lld F%lld T%lld), %s %s\n", (long long)full_params_,
      (long long)m.n_layers, (long long)m.d_model, (long long)m.n_experts, (long long)m.top_k, (long long)m.d_ffn,
      (long long)T_, m.activation.c_str(), m.norm.c_str());
  say("data: %s, %zu files, %.2f MB train / %.2f MB validation, unigram byte entropy %.4f nats\n",
      data_path_.c_str(), ds_.files().size(), ds_.train_bytes() / 1e6, ds_.val_bytes() / 1e6, ds_.unigram_entropy());
  if (ranks_.world) say("topology: %s\n", ranks_.topology.describe().c_str());
  say("ranks: %d (expert-parallel groups of %d: %lld experts per rank, %d replicas of each; %lld of %lld sequences "
      "per rank per step)\n",
      ranks_.size, ranks_.groups.ep_size, (long long)(m.n_experts / ranks_.groups.ep_size), ranks_.groups.dp_size,
      (long long)Bl_, (long long)B_);
  if (ranks_.world) {
    std::string detail;
    if (strategy_.replica_slots() > 0)
      detail = str_cat(" (up to ", strategy_.replica_slots(), " extra experts per rank and layer");
    if (!detail.empty() && strategy_.gathers_behind_attention())
      detail += str_cat("; gathered behind attention: ",
                        cfg_.overlap_degree >= 0 ? std::to_string(cfg_.overlap_degree) : "from attention time",
                        cfg_.rematerialize ? "; re-materialized for backward" : "");
    say("strategy: %s%s\n", cfg_.strategy.c_str(), detail.empty() ? "" : (detail + ")").c_str());
  }
  say("gemm: %s\n", gemm_backend().c_str());
  say("cost model: %s%s\n", strategy::describe(strategy_.cost_model()).c_str(),
      cfg_.link_gbs > 0 || cfg_.gemm_gflops > 0 ? " (with the --link-gbs / --gemm-gflops given)" : " (measured)");
  const char* wait_policy = std::getenv("OMP_WAIT_POLICY");
  say("threads: %s%s%s\n", ranks_.threads.describe().c_str(), wait_policy ? "; OMP_WAIT_POLICY=" : "",
      wait_policy ? wait_policy : "");
  if (!ranks_.cores.empty() && strategy_.uses_placements())
    say("cores: %s (the planners price the busiest rank's experts so)\n", describe(ranks_.cores).c_str());
  say("batch %lld x %lld tokens; %lld steps\n", (long long)B_, (long long)T_, (long long)cfg_.steps);
  if (start_ > 0) say("resume: from %s at step %lld\n", cfg_.resume.c_str(), (long long)start_);
  return Status::ok();
}

// The trace covers steps (start, start + trace_steps], timed from one epoch for all ranks: rank 0's
// moment on the realtime clock, which the ranks of one machine share exactly and machines share to
// NTP's accuracy. (Each rank taking its own epoch after a barrier leaves them apart by the barrier's
// exit skew: milliseconds when the ranks oversubscribe the cores, which misplaces a collective's
// members against each other.) Each rank holds the epoch on its steady clock, which the runtime's
// timelines use.
Status TrainingRun::start_trace() {
  trace_end_ = std::min(end_, start_ + cfg_.trace_steps);
  if (cfg_.trace.empty()) return Status::ok();
  auto ns = [](auto t) { return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count(); };
  int64_t epoch_realtime_ns = ns(std::chrono::system_clock::now());
  if (ranks_.world)
    if (Status s = ranks_.world->broadcast(&epoch_realtime_ns, 1, 0); !s) return s;
  const int64_t steady_now = ns(Clock::now()), realtime_now = ns(std::chrono::system_clock::now());
  trace_epoch_ns_ = steady_now - (realtime_now - epoch_realtime_ns);
  return Status::ok();
}

Status TrainingRun::write_trace() {
  std::vector<int64_t> mine = runtime::flatten(trace_records_), all = mine;
  if (ranks_.world) {
    int64_t n = static_cast<int64_t>(mine.size());
    std::vector<int64_t> counts(ranks_.size), displs(ranks_.size);
    if (Status s = ranks_.world->allgather(&n, 1, counts.data()); !s) return s;
    for (int r = 1; r < ranks_.size; ++r) displs[r] = displs[r - 1] + counts[r - 1];
    all.assign(displs.back() + counts.back(), 0);
    if (Status s = ranks_.world->allgatherv(mine.data(), n, all.data(), counts, displs); !s) return s;
  }
  Status s = ranks_.lead() ? runtime::write_chrome_trace(cfg_.trace, step_graph_.graph, runtime::unflatten(all),
                                                         ranks_.size)
                           : Status::ok();
  int64_t failed = s ? 0 : 1;
  if (Status c = ranks_.sum(&failed, 1); !c) return c;
  if (failed && s) return Status::error("trace: rank 0 could not write " + cfg_.trace);
  return s;
}

// The ranks of rank 0's expert-parallel group each write their part of the checkpoint, rank 0
// finishes it and every rank learns whether it succeeded (all ranks then return the same Status).
Status TrainingRun::save(int64_t step) {
  json state{{"step", step},
             {"data_hash", hex64(ds_.content_hash())},
             {"gemm", gemm_backend_name()},
             {"identity", resume_identity(cfg_)},
             {"config", cfg_.to_json()},
             {"ranks", ranks_.size}};
  const bool writes = ranks_.rank < ranks_.groups.ep_size;  // the expert-parallel group of rank 0
  Status s = runtime::save_sharded_checkpoint(cfg_.checkpoint_dir, *opt_, ranks_.groups.ep.get(), writes, state);
  int64_t failed = s ? 0 : 1;
  if (Status c = ranks_.sum(&failed, 1); !c) return c;
  if (failed && s) return Status::error("checkpoint: rank 0 could not write " + cfg_.checkpoint_dir);
  return s;
}

Status TrainingRun::run_step(int64_t step, StepFigures* f) {
  current_step_ = step + 1;
  const auto t0 = Clock::now();
  ds_.batch_rows(step, B_, ranks_.rank * Bl_, Bl_, tokens_.data(), targets_.data());
  model_->zero_grad();
  model_->set_router_step(step);
  model_->begin_step(tokens_.data(), targets_.data(), Bl_);
  strategy_.before_step();
  overlap_used_ = strategy_.overlap_degree();
  // Forward, backward and the gradient sums (each rank's gradients are its share of the global
  // batch's, Model::set_ce_grad_scale, so their sum is the whole batch's).
  timeline_ = runtime::StepTimeline();
  if (Status s = executor_.run(step_graph_.graph, body_, &timeline_); !s) return s;
  if (Status s = trace_step(step); !s) return s;
  // Where the step's time went, averaged over ranks; the MoE times per rank.
  const runtime::StepBreakdown br = runtime::breakdown(step_graph_.graph, timeline_);
  double rank_times[2] = {0, 0};  // moe_ms, expert_ms
  rank_times[0] = runtime::moe_layer_ms(step_graph_.graph, timeline_);
  rank_times[1] = runtime::expert_ms(step_graph_.graph, timeline_);
  std::vector<double> all_rank_times(rank_times, rank_times + 2);
  if (ranks_.world) {
    all_rank_times.assign(2 * ranks_.size, 0);
    if (Status s = ranks_.world->allgather(rank_times, 2, all_rank_times.data()); !s) return s;
  }
  f->moe_ms_per_rank = per_rank(all_rank_times, 0);
  f->expert_ms_per_rank = per_rank(all_rank_times, 1);
  double times[6] = {br.compute_ms,   br.exposed_comm_ms,     br.comm_ms,
                     br.allreduce_ms, br.allreduce_hidden_ms, mean_attention_ms(step_graph_.graph, timeline_)};
  if (Status s = ranks_.sum(times, 6); !s) return s;
  for (double& x : times) x /= ranks_.size;
  f->compute_ms = times[0], f->exposed_comm_ms = times[1], f->comm_ms = times[2];
  f->allreduce_ms = times[3], f->allreduce_hidden_ms = times[4], f->attn_ms = times[5];
  runtime::WeightTransfers moved;
  if (Status s = weights_moved(ranks_, step_graph_.graph, timeline_, &moved); !s) return s;
  f->weights = {moved.bytes, moved.seconds};
  f->loss = model_->cross_entropy();
  if (ranks_.world) {
    if (Status s = ranks_.sum(&f->loss, 1); !s) return s;
    f->loss /= ranks_.size;
  }
  inject_nan(fault_, ranks_.rank, step + 1, *model_);
  // The optimizer: expert shards' squared norms summed over the ep group (a non-finite gradient makes
  // the norm non-finite, and then nothing is scaled).
  Status norm_status;
  auto sum_over_shards = [&](double x) {
    if (ranks_.world && norm_status) norm_status = ranks_.groups.ep->allreduce(&x, 1);
    return x;
  };
  f->grad_norm = opt_->clip_grad_norm(
      cfg_.grad_clip > 0 ? static_cast<float>(cfg_.grad_clip) : std::numeric_limits<float>::infinity(),
      sum_over_shards);
  if (!norm_status) return norm_status;
  f->lr = lr_at(step, cfg_.steps, cfg_.warmup_steps, static_cast<float>(cfg_.lr), static_cast<float>(cfg_.min_lr));
  if (Status s = check_finite(step + 1, f); !s) return s;
  if (!f->skipped) opt_->step(f->lr);
  f->seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return Status::ok();
}

// A non-finite loss or gradient on any rank, before the optimizer: every rank learns which (the
// lowest rank's first parameter in params() order) and all decide alike (--on-nonfinite). The scan of
// the gradients runs only where this rank's loss or gradient norm is not finite.
Status TrainingRun::check_finite(int64_t step, StepFigures* f) {
  const std::vector<Param*> params = model_->params();
  const bool loss_bad = !std::isfinite(f->loss) || !std::isfinite(model_->moe_loss());
  double mine[2] = {-1, loss_bad ? 1.0 : 0.0};  // first parameter with a non-finite gradient; loss
  if (!std::isfinite(f->grad_norm))
    for (size_t i = 0; i < params.size() && mine[0] < 0; ++i) {
      const float* g = params[i]->grad.data();
      for (size_t k = 0; k < params[i]->grad.numel(); ++k)
        if (!std::isfinite(g[k])) {
          mine[0] = static_cast<double>(i);
          break;
        }
    }
  std::vector<double> all(mine, mine + 2);
  if (ranks_.world) {
    all.assign(2 * ranks_.size, 0);
    if (Status s = ranks_.world->allgather(mine, 2, all.data()); !s) return s;
  }
  std::string what;
  for (int r = 0; r < ranks_.size && what.empty(); ++r)
    if (all[2 * r] >= 0)
      what = "gradient of " + params[static_cast<size_t>(all[2 * r])]->name + " on rank " + std::to_string(r);
  for (int r = 0; r < ranks_.size && what.empty(); ++r)
    if (all[2 * r + 1] > 0) what = "loss (" + std::to_string(f->loss) + ", router losses " +
                                   std::to_string(model_->moe_loss()) + ") on rank " + std::to_string(r);
  if (what.empty()) {
    skipped_in_a_row_ = 0;
    return Status::ok();
  }
  if (cfg_.on_nonfinite == "skip" && skipped_in_a_row_ < kMaxSkippedInARow) {
    ++skipped_in_a_row_, ++skipped_steps_;
    f->skipped = true;
    say("step %lld skipped: non-finite %s; the optimizer did not run (--on-nonfinite skip)\n", (long long)step,
        what.c_str());
    return Status::ok();
  }
  return Status::error("step " + std::to_string(step) + ": non-finite " + what +
                       (skipped_in_a_row_ > 0 ? " after " + std::to_string(skipped_in_a_row_) + " skipped steps in a row" : "") +
                       "; stopped before the optimizer (the weights are those after step " + std::to_string(step - 1) +
                       ", the last checkpoint is kept as it was; try a lower --lr, or --on-nonfinite skip)");
}

Status TrainingRun::trace_step(int64_t step) {
  if (cfg_.trace.empty() || step >= trace_end_) return Status::ok();
  runtime::append_records(&trace_records_, step_graph_.graph, timeline_, ranks_.rank, step + 1, trace_epoch_ns_);
  if (step + 1 != trace_end_) return Status::ok();
  if (Status s = write_trace(); !s) return s;
  say("trace: steps %lld-%lld of %d rank(s) written to %s\n", (long long)(start_ + 1), (long long)trace_end_,
      ranks_.size, cfg_.trace.c_str());
  return Status::ok();
}

// The step's loads and what the strategy moved, over all ranks.
struct StepLoads {
  std::vector<LayerLoad> loads;  // per MoE layer: kept assignments per expert and drops, summed over ranks
  std::vector<int64_t> rows;     // [rank * layers + layer]: rows each rank's experts ran
  // [rank * layers * E + layer * E + e]: assignments each rank's tokens kept per expert (the exchange's
  // real shape, which the simulator replays; with one rank, the global counts)
  std::vector<int64_t> per_source;
  int64_t replicas = 0;          // extra replicas over all MoE layers (the same plan on every rank)
  int64_t sparse_bytes = 0;      // sparse collectives: sent + received, summed over ranks
  int64_t param_bytes = 0;       // the largest rank's parameters
  int64_t replicas_peak = 0;     // the largest rank's peak of materialized replicas (weights + grads)
  int64_t rows_of(int rank, size_t layer) const { return rows[rank * loads.size() + layer]; }
};

Status TrainingRun::gather_loads(StepLoads* out) {
  out->loads = model_->load_stats();
  std::vector<LayerLoad>& loads = out->loads;
  const size_t L = loads.size(), E = static_cast<size_t>(cfg_.model.n_experts), R = static_cast<size_t>(ranks_.size);
  // This rank's record, gathered from every rank in one allgather (the counts are integers, so summing
  // them here equals an allreduce): [L][E] kept assignments per expert, [L] drops, [L] expert rows,
  // then sparse bytes, parameter bytes and the replicas' peak.
  const size_t drops = L * E, rows = drops + L, sparse = rows + L, params = sparse + 1, peak = params + 1;
  const size_t n = peak + 1;
  std::vector<int64_t> mine(n, 0);
  for (size_t i = 0; i < L; ++i) {
    std::copy(loads[i].tokens_per_expert.begin(), loads[i].tokens_per_expert.end(), mine.begin() + i * E);
    mine[drops + i] = loads[i].dropped;
    MoeLayer* moe = model_->moe_layer(loads[i].layer);
    mine[rows + i] = moe->expert_rows();
    if (!moe->placements_enabled()) continue;
    for (const std::vector<int>& r : moe->placement().replicas) out->replicas += static_cast<int64_t>(r.size()) - 1;
    mine[sparse] += moe->take_sparse_bytes();
  }
  for (const Param* p : opt_->params()) mine[params] += static_cast<int64_t>(p->value.numel() * sizeof(float));
  mine[peak] = model_->replica_memory().peak();
  model_->replica_memory().reset_peak();

  std::vector<int64_t> all = mine;  // [R][n]
  if (ranks_.world) {
    all.resize(R * n);
    if (Status s = ranks_.world->allgather(mine.data(), static_cast<int64_t>(n), all.data()); !s) return s;
  }
  out->per_source.assign(R * L * E, 0);
  out->rows.assign(R * L, 0);
  for (LayerLoad& ll : loads) std::fill(ll.tokens_per_expert.begin(), ll.tokens_per_expert.end(), 0), ll.dropped = 0;
  for (size_t r = 0; r < R; ++r) {
    const int64_t* rec = all.data() + r * n;
    std::copy_n(rec, L * E, out->per_source.begin() + r * L * E);
    for (size_t i = 0; i < L; ++i) {
      for (size_t e = 0; e < E; ++e) loads[i].tokens_per_expert[e] += rec[i * E + e];
      loads[i].dropped += rec[drops + i];
      out->rows[r * L + i] = rec[rows + i];
    }
    out->sparse_bytes += rec[sparse];
    out->param_bytes = std::max(out->param_bytes, rec[params]);
    out->replicas_peak = std::max(out->replicas_peak, rec[peak]);
  }
  return Status::ok();
}

// The cost model's GEMM rate follows the expert ops: the FLOPs of the rows each rank's experts ran
// (forward and backward: 3 passes) over their measured time, mean over ranks (the same inputs, hence
// the same value, on every rank). Its weights bandwidth follows the step's sparse collectives.
void TrainingRun::refresh_costs(const StepFigures& f, const StepLoads& l) {
  const double per_row = strategy::expert_flops_per_token(cfg_.model);
  double rate = 0;
  int n = 0;
  for (int r = 0; r < ranks_.size; ++r) {
    int64_t rows = 0;
    for (size_t i = 0; i < l.loads.size(); ++i) rows += l.rows_of(r, i);
    const double ms = r < static_cast<int>(f.expert_ms_per_rank.size()) ? f.expert_ms_per_rank[r] : 0;
    if (rows > 0 && ms > 0) rate += per_row * static_cast<double>(rows) / (ms * 1e-3), ++n;
  }
  if (n > 0) strategy_.refresh_gemm_rate(rate / n);
  strategy_.refresh_weights_rate(f.weights.bytes, f.weights.seconds);
}

// Every --link-refresh-every steps, for the strategies whose planners price moving weights: the
// links measured again (quick exchanges, ~85 ms a link class at 1 Gbit/s, between steps) and folded
// into their cost model, so a link that slows or is shared is noticed. Collective; the same decision
// on every rank.
Status TrainingRun::refresh_links(int64_t done) {
  const int64_t every = cfg_.link_refresh_every;
  if (every <= 0 || done % every != 0 || !ranks_.world || !strategy_.uses_placements() || cfg_.link_gbs > 0)
    return Status::ok();
  runtime::RawCosts mine, agreed;
  if (Status s = runtime::measure_links(ranks_.world.get(), nodes_, /*quick=*/true, &mine); !s) return s;
  if (Status s = runtime::agree_costs(ranks_.world.get(), mine, &agreed); !s) return s;
  strategy_.refresh_links(agreed.intra_node, agreed.inter_node);
  return Status::ok();
}

void TrainingRun::write_metrics(int64_t done, const StepFigures& f, const StepLoads& l, int experts_moved,
                                double reshard_seconds) {
  json tokens = json::array(), imbalances = json::array(), dropped = json::array();
  json rank_tokens = json::array(), rank_imbalances = json::array(), per_source = json::array();
  const int64_t E = cfg_.model.n_experts, L = static_cast<int64_t>(l.loads.size());
  for (int64_t i = 0; i < L && ranks_.size > 1; ++i) {
    json layer = json::array();
    for (int r = 0; r < ranks_.size; ++r) {
      const auto at = l.per_source.begin() + (r * L + i) * E;
      layer.push_back(std::vector<int64_t>(at, at + E));
    }
    per_source.push_back(std::move(layer));
  }
  for (size_t i = 0; i < l.loads.size(); ++i) {
    tokens.push_back(l.loads[i].tokens_per_expert);
    imbalances.push_back(imbalance(l.loads[i].tokens_per_expert));
    dropped.push_back(l.loads[i].dropped);
    std::vector<int64_t> per_rank(ranks_.size);
    for (int r = 0; r < ranks_.size; ++r) per_rank[r] = l.rows_of(r, i);
    rank_tokens.push_back(per_rank);
    rank_imbalances.push_back(imbalance(per_rank));
  }
  metrics_.write({{"step", done},
                  {"loss", f.loss},
                  {"aux_loss", model_->aux_loss()},
                  {"z_loss", model_->z_loss()},
                  {"lr", f.lr},
                  {"grad_norm", f.grad_norm},
                  {"skipped", f.skipped},
                  {"step_ms", f.seconds * 1e3},
                  {"tokens_per_s", B_ * T_ / f.seconds},
                  {"compute_ms", f.compute_ms},
                  {"exposed_comm_ms", f.exposed_comm_ms},
                  {"comm_ms", f.comm_ms},
                  {"allreduce_ms", f.allreduce_ms},
                  {"allreduce_hidden_ms", f.allreduce_hidden_ms},
                  {"load_imbalance", imbalances},
                  {"tokens_per_rank", rank_tokens},
                  {"rank_imbalance", rank_imbalances},
                  {"dropped", dropped},
                  {"tokens_per_expert", tokens},
                  {"tokens_per_source", per_source},  // [layer][rank][expert]; [] with one rank
                  {"strategy", cfg_.strategy},
                  {"gemm", gemm_backend_name()},
                  {"threads", ranks_.threads.threads},
                  // per rank: MoE layers' time and expert GEMM time (runtime::moe_layer_ms, expert_ms)
                  {"moe_ms_per_rank", f.moe_ms_per_rank},
                  {"expert_ms_per_rank", f.expert_ms_per_rank},
                  {"replicas", l.replicas},
                  {"overlap_degree", overlap_used_},
                  {"cost_model", cost_model_json(strategy_.cost_model())},
                  {"calibrations", strategy_.take_calibrations()},
                  {"experts_moved", experts_moved},
                  {"reshard_ms", reshard_seconds * 1e3},  // moving them, after the step: not in step_ms
                  {"sparse_bytes", l.sparse_bytes},
                  // Per rank (the largest): parameters held, their gradients (the same size) and
                  // AdamW's two moments, plus the peak of materialized replicas (weights + grads).
                  {"memory_bytes",
                   {{"params", l.param_bytes},
                    {"grads", l.param_bytes},
                    {"optimizer", 2 * l.param_bytes},
                    {"replicas_peak", l.replicas_peak}}}});
}

// Every log_every steps and at the end: the window's mean loss and throughput, aux per MoE layer (1.0
// is a balanced router whatever the layer count), per-layer load; with ranks, the slowest rank's
// expert rows over the mean (worst layer) and the share of the window the compute stream waited.
void TrainingRun::print_progress(int64_t done, const StepFigures& f, const StepLoads& l) {
  if (done % cfg_.log_every != 0 && done != end_) return;
  std::string rank_load;
  if (ranks_.world) {
    double worst = 1;
    for (size_t i = 0; i < l.loads.size(); ++i) {
      std::vector<int64_t> per_rank(ranks_.size);
      for (int r = 0; r < ranks_.size; ++r) per_rank[r] = l.rows_of(r, i);
      worst = std::max(worst, imbalance(per_rank));
    }
    char buf[64];
    std::snprintf(buf, sizeof buf, "  ranks max/mean %.2f  comm %2.0f%%", worst,
                  100.0 * window_exposed_ms_ / (1e3 * window_seconds_));
    rank_load = buf;
  }
  char loss[32] = "skipped";  // every step of the window skipped (--on-nonfinite skip)
  if (window_losses_ > 0) std::snprintf(loss, sizeof loss, "%.4f", window_loss_ / window_losses_);
  say("step %5lld/%lld  loss %s  aux/layer %.3f  lr %.2e  |g| %.2f  %7.0f tok/s  load max/mean %s%s\n",
      (long long)done, (long long)cfg_.steps, loss,
      model_->aux_loss() / std::max<size_t>(1, l.loads.size()), f.lr, f.grad_norm,
      window_steps_ * B_ * T_ / window_seconds_, load_imbalance_line(l.loads).c_str(), rank_load.c_str());
  window_loss_ = window_seconds_ = window_exposed_ms_ = 0;
  window_steps_ = window_losses_ = 0;
}

// After the optimizer: the step's loads, the strategy's learning and re-sharding, metrics, progress.
Status TrainingRun::after_step(int64_t step, const StepFigures& f) {
  if (!f.skipped) window_loss_ += f.loss, ++window_losses_;
  window_seconds_ += f.seconds;
  window_exposed_ms_ += f.exposed_comm_ms;
  ++window_steps_;
  const int64_t done = step + 1;
  // What runs between steps (the loads' gather, a link refresh, re-sharding) is the run's time too:
  // counted in the window's throughput, as the steps are.
  const auto between_start = std::chrono::steady_clock::now();
  StepLoads l;
  if (Status s = gather_loads(&l); !s) return s;
  refresh_costs(f, l);
  if (Status s = refresh_links(done); !s) return s;
  std::vector<std::vector<int64_t>> global_loads;
  for (const LayerLoad& ll : l.loads) global_loads.push_back(ll.tokens_per_expert);
  strategy_.observe(global_loads, strategy::StepTimes{f.attn_ms * 1e-3});
  int experts_moved = 0;
  // Moving shards and their moments between steps is the strategy's cost as much as its steps are:
  // timed here, outside step_ms (reshard_ms).
  const auto reshard_start = std::chrono::steady_clock::now();
  try {
    experts_moved = strategy_.reshard(*opt_, done);  // when due (Hecate's Alg. 2, SmartMoE, FlexMoE)
  } catch (const std::runtime_error& e) {
    return Status::error(std::string("re-sharding: ") + e.what());
  }
  const auto between_end = std::chrono::steady_clock::now();
  const double reshard_seconds = std::chrono::duration<double>(between_end - reshard_start).count();
  window_seconds_ += std::chrono::duration<double>(between_end - between_start).count();
  write_metrics(done, f, l, experts_moved, reshard_seconds);
  print_progress(done, f, l);
  return Status::ok();
}

Status TrainingRun::evaluate_and_save(int64_t done) {
  return evaluate_and_checkpoint(
      cfg_, done, end_, cfg_.eval_batches * B_, ds_.unigram_entropy(), ranks_.lead(), metrics_,
      [&](double* loss) { return evaluate(*model_, ds_, ranks_, B_, cfg_.eval_batches, loss); },
      [&](int64_t step) { return save(step); }, &last_val_);
}

void TrainingRun::finish() {
  if (skipped_steps_ > 0)
    say("%lld step(s) skipped for a non-finite loss or gradient (--on-nonfinite skip)\n", (long long)skipped_steps_);
  say("%s", training_end_message(cfg_, end_, last_val_, ds_.unigram_entropy()).c_str());
}

Status train(const TrainConfig& cfg, Ranks& ranks) {
  TrainingRun run(cfg, ranks);
  if (Status s = run.set_up(); !s) return s;
  if (Status s = run.resume(); !s) return s;
  if (Status s = run.measure_costs(); !s) return s;
  if (Status s = run.announce(); !s) return s;
  if (Status s = run.start_trace(); !s) return s;
  for (int64_t step = run.start(); step < run.end(); ++step) {
    StepFigures figures;
    if (Status s = run.run_step(step, &figures); !s) return s;
    if (Status s = run.after_step(step, figures); !s) return s;
    if (Status s = run.evaluate_and_save(step + 1); !s) return s;
  }
  run.finish();
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

Status evaluate_and_checkpoint(const TrainConfig& cfg, int64_t done, int64_t end, int64_t windows,
                               double unigram_entropy, bool speak, MetricsWriter& metrics,
                               const std::function<Status(double*)>& evaluate,
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
    metrics.write({{"step", done}, {"val_loss", *last_val}, {"unigram_entropy", unigram_entropy}});
  }
  if (!cfg.checkpoint_dir.empty() && ((cfg.checkpoint_every > 0 && done % cfg.checkpoint_every == 0) || last)) {
    if (Status s = save(done); !s) {
      const std::string why = s.message() + " (the previous checkpoint in " + cfg.checkpoint_dir +
                              ", if any, is kept as it was)";
      if (cfg.on_checkpoint_error != "continue") return Status::error(why);
      if (speak) {
        std::printf("checkpoint: step %lld not written: %s; training goes on (--on-checkpoint-error continue)\n",
                    (long long)done, why.c_str());
        std::fflush(stdout);
      }
      metrics.write({{"step", done}, {"checkpoint_error", why}});
      return Status::ok();
    }
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
                        "eval_every", "eval_batches", "threads", "gemm", "comm_timeout_s", "ranks_per_node",
                        "allreduce_micro_kb", "trace", "trace_steps", "strategy", "rematerialize", "replica_slots",
                        "replica_memory_mb", "overlap_degree", "load_window", "link_gbs", "gemm_gflops",
                        "link_refresh_every", "shared_cores", "on_nonfinite", "on_checkpoint_error", "reshard_every",
                        "device", "dtype"})
    j.erase(k);
  return j;
}

Status check_resume(const TrainConfig& cfg, const json& state, uint64_t data_hash, int64_t* start) {
  try {
    // Typed first: get<int64_t>() of a float out of range (1e300) is undefined behaviour, not an exception.
    if (!state.at("step").is_number_integer() || state.at("step").get<int64_t>() < 0)
      return Status::error("resume: " + cfg.resume + "/state.json has a step that is not an integer >= 0");
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
  if (comm::started_by_mpirun()) {
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
  if (Status s = runtime::plan_rank_threads(runtime::thread_request(cfg.threads), ranks.world.get(), &ranks.threads,
                                            &ranks.cores);
      !s) {
    if (ranks.size > 1) comm::abort_job(s);
    return s;
  }
  if (cfg.shared_cores == "none") ranks.cores = {};
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
