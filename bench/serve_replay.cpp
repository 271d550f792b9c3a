// moe bench serve-replay: the serving schedules on the same batches. bench serve measures what a user
// sees (each request's latency under Poisson arrivals), but there a schedule's speed feeds back into
// its batches: a server that falls behind gathers fuller steps, so two schedules never run the same
// forwards, and a round's latency moves with the machine's spells more than Lina moves it
// (docs/serving.md). Here every schedule runs the very same forwards, one after another within each
// step (each step starting one schedule further on), so what differs between them is only where
// their experts ran; per step their times are compared directly.
//
// The batches: bench serve's workloads and prompts (serve_workload.h), `clients` sequences in flight at
// once as in its closed loop, each new prompt placed as the server's scheduler places it
// (serve::admission_rank), each sequence fed its text's own continuation (teacher forcing), so every
// schedule's KV caches hold the same sequences whatever its logits. One model per schedule (a
// schedule's replicas live in its model's MoE layers), every one loaded from the same checkpoint.
//
// Runs on 2 ranks: started plainly it starts them (mpirun, like bench serve); `cluster-serve-replay`
// on 2 emulated hosts at 1 Gbit/s (root). The model: $MOE_BENCH_CHECKPOINT, else bench serve's.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/bench.h"
#include "bench/emulated_cluster.h"
#include "bench/mpi_bench.h"
#include "bench/report.h"
#include "bench/serve_workload.h"
#include "comm/mpi_communicator.h"
#include "serve/engine.h"
#include "serve/job.h"
#include "serve/lockstep.h"
#include "serve/profile.h"
#include "serve/server.h"
#include "util/shell.h"

namespace moe::bench {

namespace {

using Clock = std::chrono::steady_clock;
using serve::Schedule;

// serve_schedules(), as the engine's enum.
const std::vector<Schedule>& replay_schedules() {
  static const std::vector<Schedule> s = [] {
    std::vector<Schedule> parsed;
    for (const std::string& name : serve_schedules()) {
      Schedule one;
      if (!serve::parse_schedule(name, &one)) throw std::logic_error("serve_schedules: unknown schedule " + name);
      parsed.push_back(one);
    }
    return parsed;
  }();
  return s;
}
// ep's place in replay_schedules(): the reference every forward is compared with.
size_t ep_index() {
  const std::vector<Schedule>& s = replay_schedules();
  return static_cast<size_t>(std::find(s.begin(), s.end(), Schedule::ep) - s.begin());
}

// The forwards every schedule runs: `clients` sequences in flight, placed and batched as serve's
// scheduler does (server.cpp: running sequences first, then new prompts to admission_rank's choice
// while they fit the rank's rows), each fed its prompt's continuation. Deterministic: every rank
// builds the same batches.
class Batches {
 public:
  Batches(const std::vector<Prompt>& prompts, const Workload& w, int ranks, int64_t max_rows, int64_t T)
      : prompts_(prompts), w_(w), max_rows_(max_rows), T_(T), free_(ranks) {
    for (auto& slots : free_)
      for (int s = w.slots_per_rank - 1; s >= 0; --s) slots.push_back(s);
  }

  // The next forward's rows, every rank's.
  const std::vector<serve::PlacedRow>& next() {
    rows_.clear();
    scheduled_.clear();
    const size_t R = free_.size();
    std::vector<int64_t> used(R, 0), free_slots(R, 0);
    auto add = [&](size_t i) {
      used[running_[i].rank] += running_[i].seq.rows();
      scheduled_.push_back(i);
      running_[i].seq.add_rows(running_[i].rank, running_[i].slot, &rows_);
    };
    for (size_t i = 0; i < running_.size(); ++i)
      if (used[running_[i].rank] + running_[i].seq.rows() <= max_rows_) add(i);
    while (static_cast<int>(running_.size()) < w_.clients) {
      const Prompt& p = prompts_[next_prompt_ % prompts_.size()];
      for (size_t k = 0; k < R; ++k) free_slots[k] = static_cast<int64_t>(free_[k].size());
      const int best = serve::admission_rank(used, free_slots, static_cast<int64_t>(p.text.size()), max_rows_);
      if (best < 0) break;
      Running r{serve::Sequence{}, &p, best, free_[best].back(), 0};
      for (unsigned char c : p.text) r.seq.tokens.push_back(c);
      free_[best].pop_back();
      running_.push_back(std::move(r));
      ++next_prompt_;
      add(running_.size() - 1);
    }
    return rows_;
  }

  // After every schedule ran next()'s rows: each sequence that ran takes its text's next byte, and
  // those with max_tokens free their slots.
  void advance() {
    for (size_t i : scheduled_) {
      Running& r = running_[i];
      r.seq.push(static_cast<unsigned char>(r.prompt->continuation[r.produced]), T_);
      ++r.produced;
    }
    std::vector<Running> still;
    for (Running& r : running_) {
      if (r.produced >= w_.max_tokens) free_[r.rank].push_back(r.slot);
      else still.push_back(std::move(r));
    }
    running_.swap(still);
  }

 private:
  struct Running {
    serve::Sequence seq;
    const Prompt* prompt;
    int rank, slot;
    int64_t produced;
  };
  const std::vector<Prompt>& prompts_;
  const Workload& w_;
  int64_t max_rows_, T_;
  std::vector<std::vector<int>> free_;  // per rank, its free KV-cache slots
  std::vector<Running> running_;
  std::vector<size_t> scheduled_;  // running_ entries in rows_
  std::vector<serve::PlacedRow> rows_;
  size_t next_prompt_ = 0;
};

// One schedule's model and engine on this rank.
struct Contender {
  Schedule schedule;
  std::unique_ptr<Model> model;
  std::unique_ptr<serve::InferenceEngine> engine;
  std::vector<float> seconds;        // this rank's wall time of each timed forward
  std::vector<float> block_seconds;  // [forward][MoE block] this rank's expert time
};

constexpr int64_t kForwardsPerRound = 120;

// The ranks' part: every schedule on the same batches, one table per workload (rank 0 prints).
int replay_ranks_or_throw(const BenchOptions& opt) {
  const char* checkpoint = std::getenv("MOE_BENCH_CHECKPOINT");
  if (!checkpoint || !*checkpoint) {
    std::fprintf(stderr, "moe bench serve-replay: under mpirun it needs MOE_BENCH_CHECKPOINT (a checkpoint folder); "
                         "started without mpirun it finds or trains one and starts its ranks itself\n");
    return 2;
  }
  serve::InferenceOptions o;
  o.checkpoint = checkpoint;
  o.threads = 1;
  serve::InferenceJob job;
  int64_t most_slots = 0;
  for (const Workload& w : serve_workloads()) most_slots = std::max<int64_t>(most_slots, w.slots_per_rank);
  check(job.start(o, most_slots));
  comm::Communicator* world = job.world.get();
  if (!world || world->size() != 2) {
    std::fprintf(stderr, "moe bench serve-replay: runs on 2 ranks (got %d)\n", job.size());
    return 2;
  }
  job.model.reset();  // each schedule loads its own below
  const bool lead = world->rank() == 0;
  const int R = world->size();
  const std::string corpus = job.state["config"].value("data", std::string());
  std::unique_ptr<Report> report;
  if (lead) report = std::make_unique<Report>("serve-replay", "the ranks of moe bench serve-replay", opt);

  for (Workload w : serve_workloads()) {
    if (!workload_selected(w, opt)) continue;
    if (opt.in_flight > 0) w.clients = opt.in_flight;
    std::vector<Prompt> prompts;
    check(make_prompts(w, w.max_tokens, &prompts));
    std::vector<Contender> contenders;
    int64_t max_rows = 0;
    for (Schedule s : replay_schedules()) {
      Contender r{s, nullptr, nullptr, {}, {}};
      check(serve::load_inference_model(o.checkpoint, w.slots_per_rank, &r.model, nullptr, &max_rows));
      r.model->set_expert_parallel(world, world);
      r.engine = std::make_unique<serve::InferenceEngine>(*r.model, w.slots_per_rank, max_rows);
      contenders.push_back(std::move(r));
    }
    // One profile and one price for every Lina schedule, measured on ep's engine (serve's start-up).
    const size_t ep = ep_index();
    serve::InferenceEngine& ep_engine = *contenders[ep].engine;
    plan::PathProfile profile(ep_engine.moe_blocks(), ep_engine.config().n_experts);
    check(serve::profile_routing(ep_engine, world, corpus, 64, &profile));
    plan::LinaCost cost;
    check(serve::measure_lina_cost(ep_engine, world, &cost));
    for (Contender& r : contenders) {
      r.engine->set_schedule(r.schedule, &profile, world);
      if (r.schedule != Schedule::ep && r.schedule != Schedule::ideal) {
        r.engine->set_lina_cost(cost);
        r.engine->set_replica_cache(static_cast<int>(r.engine->config().n_experts / R));
      }
      r.engine->reset_counters();
    }

    const int64_t T = ep_engine.config().seq_len, V = ep_engine.config().vocab_size;
    const int64_t L = ep_engine.moe_blocks();
    Batches batches(prompts, w, R, max_rows, T);
    const int64_t warmup = serve::InferenceEngine::kRefitForwards, timed = opt.repeats * kForwardsPerRound;
    const size_t K = contenders.size();
    std::vector<serve::Row> mine;
    std::vector<float> logits;
    int64_t rows_total = 0;
    for (int64_t step = 0; step < warmup + timed; ++step) {
      const std::vector<serve::PlacedRow>& rows = batches.next();
      mine.clear();
      for (const serve::PlacedRow& p : rows)
        if (p.rank == world->rank()) mine.push_back(p.row);
      logits.resize(std::max<size_t>(1, mine.size()) * V);
      for (size_t j = 0; j < K; ++j) {
        Contender& r = contenders[(static_cast<size_t>(step) + j) % K];
        check(world->barrier());
        const Clock::time_point t0 = Clock::now();
        r.engine->forward(mine, logits.data());
        const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
        if (step < warmup) continue;
        r.seconds.push_back(static_cast<float>(dt));
        const std::vector<double>& b = r.engine->last_block_expert_seconds();
        for (double s : b) r.block_seconds.push_back(static_cast<float>(s));
      }
      if (step >= warmup) rows_total += static_cast<int64_t>(rows.size());
      batches.advance();
      if (step + 1 == warmup)
        for (Contender& r : contenders) r.engine->reset_counters();
      if (lead && (step + 1) % 100 == 0)
        std::fprintf(stderr, "bench serve-replay: %s, forward %lld of %lld\n", w.name.c_str(),
                     static_cast<long long>(step + 1), static_cast<long long>(warmup + timed));
    }

    // Every rank's times to every rank: a forward's time is its slowest rank's.
    struct Figures {
      std::vector<double> forward_s;  // per timed forward, the slowest rank's
      double busiest_experts = 0, mean_experts = 0;
    };
    std::vector<Figures> fig(K);
    for (size_t k = 0; k < K; ++k) {
      const Contender& r = contenders[k];
      std::vector<float> all_seconds(r.seconds.size() * R), all_blocks(r.block_seconds.size() * R);
      check(world->allgather(r.seconds.data(), static_cast<int64_t>(r.seconds.size()), all_seconds.data()));
      check(world->allgather(r.block_seconds.data(), static_cast<int64_t>(r.block_seconds.size()), all_blocks.data()));
      for (int64_t f = 0; f < timed; ++f) {
        double slowest = 0;
        std::vector<float> one(static_cast<size_t>(R * L));
        for (int q = 0; q < R; ++q) {
          slowest = std::max(slowest, static_cast<double>(all_seconds[q * timed + f]));
          for (int64_t l = 0; l < L; ++l) one[q * L + l] = all_blocks[(q * timed + f) * L + l];
        }
        fig[k].forward_s.push_back(slowest);
        const serve::BlockTimes bt = serve::expert_time_over_ranks(one, R);
        fig[k].busiest_experts += bt.busiest / timed;
        fig[k].mean_experts += bt.mean / timed;
      }
    }
    if (!lead) continue;
    char title[256];
    std::snprintf(title, sizeof title, "%s: %d-%d prompt bytes, %lld new tokens, %d slots per rank, %d in flight; "
                  "%.1f rows a forward", w.name.c_str(), w.prompt_min, w.prompt_max,
                  static_cast<long long>(w.max_tokens), w.slots_per_rank, w.clients,
                  static_cast<double>(rows_total) / static_cast<double>(timed));
    report->table(title, {{"schedule", ""},
                          {"forward median", "ms", 3},
                          {"forward mean", "ms", 3},
                          {"all forwards / ep", "x", 3},
                          {"median forward / ep's", "x", 3},
                          {"forwards faster than ep", "%", 1},
                          {"schedule", "ms", 3},
                          {"experts slowest rank", "ms", 3},
                          {"experts mean rank", "ms", 3},
                          {"time imbalance", "x", 3},
                          {"imbalance", "x", 3},
                          {"replicas / layer", "", 2},
                          {"gathered", "MB", 1},
                          {"estimate right", "%", 0},
                          {"re-planned", "%", 0}});
    const double ep_total = std::accumulate(fig[ep].forward_s.begin(), fig[ep].forward_s.end(), 0.0);
    for (size_t k = 0; k < K; ++k) {
      const Figures& f = fig[k];
      const serve::ScheduleStats& st = contenders[k].engine->schedule_stats();
      std::vector<double> ratio;
      int64_t faster = 0;
      for (int64_t i = 0; i < timed; ++i) {
        ratio.push_back(f.forward_s[i] / fig[ep].forward_s[i]);
        faster += f.forward_s[i] < fig[ep].forward_s[i];
      }
      const double total = std::accumulate(f.forward_s.begin(), f.forward_s.end(), 0.0);
      const double nan = std::nan("");
      const Schedule schedule = contenders[k].schedule;
      const bool lina = k != ep && schedule != Schedule::ideal;
      const bool estimates = schedule == Schedule::lina || schedule == Schedule::lina_no_phase2;
      const double layers = static_cast<double>(std::max<int64_t>(1, st.layer_steps));
      report->row({std::string(serve::schedule_name(schedule)), median(f.forward_s) * 1e3,
                   total / static_cast<double>(timed) * 1e3, total / ep_total, k == ep ? 1.0 : median(ratio),
                   k == ep ? nan : 100.0 * static_cast<double>(faster) / static_cast<double>(timed),
                   contenders[k].engine->stage_seconds().schedule / static_cast<double>(timed) * 1e3,
                   f.busiest_experts * 1e3, f.mean_experts * 1e3, f.busiest_experts / f.mean_experts,
                   st.mean_rank_rows > 0 ? static_cast<double>(st.busiest_rank_rows) / st.mean_rank_rows : nan,
                   lina ? static_cast<double>(st.replicas) / layers : nan,
                   lina ? static_cast<double>(st.gathered_bytes) / 1e6 : nan,
                   estimates && st.estimated > 0 ? 100.0 * static_cast<double>(st.accurate) / st.estimated : nan,
                   estimates ? 100.0 * static_cast<double>(st.replanned) / layers : nan});
    }
  }
  if (!lead) return 0;
  report->note("every schedule runs the same forwards (the rows of every rank), one after another in each step, each "
               "step starting one schedule further on; the first " +
               std::to_string(serve::InferenceEngine::kRefitForwards) +
               " forwards (a Lina curve's first refit) are not counted");
  report->note("forward: the slowest rank's wall time of the forward, after a barrier; all forwards / ep: their sum "
               "over ep's; median forward / ep's: the median over the forwards of each one's time over ep's on the same "
               "rows; forwards faster than ep: how many of them were");
  report->note("schedule: rank 0's time a forward in Lina's own work (estimate, plans, placing, waiting for a "
               "gather; serve::StageSeconds)");
  report->note("experts slowest / mean rank: per forward, each MoE layer's slowest rank's expert time summed over "
               "the layers, and the ranks' mean likewise (time imbalance: their ratio); imbalance: the busiest rank's "
               "expert rows over the ranks' mean; replicas, gathered (rank 0's weights sent and received), estimate "
               "right and re-planned as in bench serve");
  report->note("ideal computes another function (a balanced gate): its forwards are the same rows, not the same "
               "routing");
  return report->finish(0);
}

// A collective that failed inside a forward throws (naming the rank): end the whole job.
int replay_ranks(const BenchOptions& opt) {
  try {
    return replay_ranks_or_throw(opt);
  } catch (const std::exception& e) {
    comm::abort_job(Status::error(std::string("moe bench serve-replay: ") + e.what()));
  }
}

// Runs the ranks (`launch` + " bench serve-replay ...", their progress on our stderr) and prints their
// tables under this bench's header. Returns the exit code.
int report_ranks(const std::string& bench, const std::string& where, const std::string& launch,
                 const BenchOptions& opt) {
  BenchOptions shown = opt;  // the header's threads: each rank's
  shown.threads = 1;
  Report report(bench,
                "every serving schedule on the same forwards, on " + where + " (1 thread each): bench serve's "
                "workloads in closed loop, teacher-forced; " + std::to_string(opt.repeats * kForwardsPerRound) +
                " timed forwards per schedule and workload", shown);
  std::string cmd = launch + " bench serve-replay --json --repeats " + std::to_string(opt.repeats);
  if (!opt.only.empty()) {  // in single quotes, each ' in it as '\''
    std::string quoted = "'";
    for (char c : opt.only) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
    cmd += " --only " + quoted + "'";
  }
  if (opt.in_flight > 0) cmd += " --in-flight " + std::to_string(opt.in_flight);
  std::string out;  // the ranks' stdout: their report's JSON alone
  FILE* f = ::popen(cmd.c_str(), "r");
  if (!f) {
    std::fprintf(stderr, "moe bench %s: cannot start %s\n", bench.c_str(), cmd.c_str());
    return report.finish(1);
  }
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) out.append(buf, n);
  const int status = ::pclose(f);
  const bool given = std::getenv("MOE_BENCH_CHECKPOINT") && *std::getenv("MOE_BENCH_CHECKPOINT");
  if (status != 0 || !report.add_from(child_document("\n" + out))) {
    std::fprintf(stderr, "moe bench %s: the ranks failed (%s); their output:\n%s\n", bench.c_str(), cmd.c_str(),
                 out.c_str());
    return report.finish(1);
  }
  report.note(given ? "model: $MOE_BENCH_CHECKPOINT" : "model: bench serve's, trained here (bench/serve.cpp)");
  return report.finish(0);
}

}  // namespace

int serve_replay(const BenchOptions& opt) {
  if (!some_workload_matches(opt, "serve-replay")) return 2;
  if (comm::started_by_mpirun()) return replay_ranks(opt);
  const ScratchDir scratch("moe_bench_serve_replay_");
  const std::string checkpoint = bench_checkpoint(scratch);
  if (checkpoint.empty()) return 1;
  return report_ranks("serve-replay", "2 local ranks",
                      std::string(kMpirunEnv) + "MOE_BENCH_CHECKPOINT=" + checkpoint + " mpirun -n 2 " + self_exe("moe"),
                      opt);
}

int cluster_serve_replay(const BenchOptions& opt) {
  if (!some_workload_matches(opt, "cluster-serve-replay")) return 2;
  const ScratchDir scratch("moe_bench_serve_replay_");
  const std::string checkpoint = bench_checkpoint(scratch);
  if (checkpoint.empty()) return 1;
  const EmulatedCluster cluster("moebench", "1gbit");
  if (!cluster.up()) {
    std::fprintf(stderr, "moe bench cluster-serve-replay: %s\n", cluster.why().c_str());
    return 1;
  }
  // Open MPI's remote launch passes no environment of ours: the ranks get the checkpoint through env.
  return report_ranks("cluster-serve-replay", "2 emulated hosts x 1 rank (1 Gbit/s)",
                      cluster.command("run -- env MOE_BENCH_CHECKPOINT=" + checkpoint + " " + self_exe("moe")), opt);
}

}  // namespace moe::bench
