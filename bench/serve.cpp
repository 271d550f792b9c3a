// moe bench serve: `moe serve` on 2 MPI ranks driven over HTTP by a trace of real-text requests whose
// domains are skewed: 80% continue windows of the Python documentation (the corpus the model was
// trained on), 20% windows of the GPL-3 text (/usr/share/common-licenses, on every Debian system), so
// the routers see two kinds of text in unequal shares. `moe bench cluster-serve` runs the same on 2
// emulated hosts (root; bench/emulated_cluster.h), the client in the fabric's namespace.
//
// Two workloads, each its own table: "chat" (short prompts, 48 new tokens: decode steps of a few rows,
// bound by reading expert weights) and "long prompts" (96-120 prompt bytes, 8 new tokens, 32 slots per
// rank: prefill steps of hundreds of rows, where an expert's work grows with its tokens and a hot expert
// makes its rank the slowest: the batches Lina's replicas are for).
//
// Per workload, first a closed loop (clients sending their next request when the last one is answered)
// finds ep's throughput; then for every schedule (ideal, ep, lina, lina-no-estimate, lina-no-phase2;
// --repeats interleaved rounds) a fresh server gets the same Poisson arrivals at 70% of it, the load a
// serving system is sized for (or at --rates CHAT,LONG, without the closed loop: that throughput moved
// 162-242 req/s between runs on one machine, so runs sat at different distances from saturation), and
// the client measures each request's latency (arrival to last token) and time to first token
// (streamed); the server's /metrics gives Lina's estimation accuracy, phase-2 re-plans, replicas and
// the expert weights moved.
//
// The model: $MOE_BENCH_CHECKPOINT if set, else one trained here for 300 steps on 2 ranks (about 5
// minutes): the default model widened to C256 F1024, so that its experts, F = 4C as GPT-MoE's, carry
// about two thirds of a token's FLOPs, as in the Lina paper's models. The default model (C128 F256)
// spends ~2 us a token in an expert, too little for an even load to show in a serving step
// (docs/serving.md). It trains with --router-skew 1.5 (a fixed Zipf-shaped bias on every router) and a
// weak balancing loss (--aux-loss-weight 0.001), so a few experts are hot at serving, as in the traces
// of the Lina paper: at the end of training the busiest expert of a layer draws 1.7-3.0x the mean
// (measured 2026-11-27; the default model's 2.7-3.9x). With the default balancing loss the same
// training ends at 1.2-1.6x, and with none the router collapses onto 2 experts.
#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench.h"
#include "bench/emulated_cluster.h"
#include "bench/report.h"
#include "bench/serve_workload.h"
#include "model/data.h"
#include "runtime/train_config.h"
#include "util/quantile.h"
#include "util/shell.h"

namespace moe::bench {

namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kHotExperts = "--router-skew 1.5 --aux-loss-weight 0.001";  // see the top of the file
constexpr const char* kBenchModel = "--d-model 256 --d-ffn 1024";                  // likewise
constexpr double kRoundSeconds = 15;  // a schedule's arrivals in one round

}  // namespace

const std::vector<Workload>& serve_workloads() {
  static const std::vector<Workload> w = {{"chat", 32, 64, 48, 8, 8}, {"long prompts", 96, 120, 8, 32, 32}};
  return w;
}

bool workload_selected(const Workload& w, const BenchOptions& opt) {
  return w.name.find(opt.only) != std::string::npos;
}

bool some_workload_matches(const BenchOptions& opt, const char* bench) {
  if (std::any_of(serve_workloads().begin(), serve_workloads().end(),
                  [&](const Workload& w) { return workload_selected(w, opt); }))
    return true;
  std::fprintf(stderr, "moe bench %s: no workload's name contains \"%s\" (chat, long prompts)\n", bench,
               opt.only.c_str());
  return false;
}

const std::vector<std::string>& serve_schedules() {
  static const std::vector<std::string> s = {"ideal", "ep", "lina", "lina-no-estimate", "lina-no-phase2"};
  return s;
}

Status make_prompts(const Workload& w, int64_t continuation_bytes, std::vector<Prompt>* out) {
  DataOptions o;
  o.seq_len = w.prompt_max;
  o.suffix = kDefaultCorpusSuffix;
  TextDataset docs;
  if (Status s = TextDataset::open(kDefaultCorpus, o, &docs); !s) return s;
  std::ifstream f("/usr/share/common-licenses/GPL-3", std::ios::binary);
  std::stringstream gpl;
  gpl << f.rdbuf();
  const std::string other = gpl.str();
  if (other.size() < 1000) return Status::error("bench serve: /usr/share/common-licenses/GPL-3 is missing");
  const size_t extra = static_cast<size_t>(continuation_bytes);
  std::mt19937_64 rng(7);
  const std::vector<uint8_t>& val = docs.val_data();
  for (int i = 0; i < 400; ++i) {
    const size_t len = w.prompt_min + rng() % (w.prompt_max - w.prompt_min + 1);
    Prompt p;
    p.other_domain = i % 5 == 4;
    if (p.other_domain) {
      const size_t at = rng() % (other.size() - len - extra);
      p.text = other.substr(at, len);
      p.continuation = other.substr(at + len, extra);
    } else {
      const size_t at = rng() % (val.size() - len - extra);
      p.text.assign(val.begin() + at, val.begin() + at + len);
      p.continuation.assign(val.begin() + at + len, val.begin() + at + len + extra);
    }
    out->push_back(std::move(p));
  }
  return Status::ok();
}

std::string bench_checkpoint(const ScratchDir& scratch) {
  if (const char* given = std::getenv("MOE_BENCH_CHECKPOINT"); given && *given) {
    if (std::filesystem::exists(std::filesystem::path(given) / "state.json")) return given;
    std::fprintf(stderr, "bench serve: MOE_BENCH_CHECKPOINT=%s is not a checkpoint folder (no state.json)\n", given);
    return "";
  }
  const std::string checkpoint = (scratch.path() / "ck").string();
  std::fprintf(stderr, "bench serve: training the bench's model (%s %s) for 300 steps on 2 ranks "
                       "(set MOE_BENCH_CHECKPOINT to skip)\n", kBenchModel, kHotExperts);
  const std::string cmd = std::string(kMpirunEnv) + "mpirun -n 2 " + self_exe("moe") + " train --steps 300 " +
                          kBenchModel + " " + kHotExperts +
                          " --log-every 50 --eval-batches 4 --threads 1 --checkpoint-dir " + checkpoint + " >&2";
  if (std::system(cmd.c_str()) != 0) {
    std::fprintf(stderr, "bench serve: training failed\n");
    return "";
  }
  return checkpoint;
}

namespace {

// Where the server's 2 ranks run and how the client reaches rank 0.
struct Place {
  std::string bench;   // the report's name: serve, cluster-serve
  std::string where;   // the ranks, for the report's title
  std::string launch;  // the command line before `serve ...`: mpirun of this moe on 2 ranks
  std::string listen;  // --host of moe serve
  std::string host;    // the address the client connects to
};

// `moe serve` with `schedule` in the background, its stderr to `log`; stopped by SIGTERM when the
// returned process goes out of scope.
BackgroundProcess start_server(const Place& at, const std::string& checkpoint, const std::string& schedule,
                               const Workload& w, const std::string& log) {
  return BackgroundProcess(at.launch + " serve --checkpoint " + checkpoint + " --schedule " + schedule + " --host " +
                               at.listen + " --port 0 --threads 1 --slots-per-rank " + std::to_string(w.slots_per_rank),
                           log);
}

// The port of a started server (0: it did not start, its log printed).
int wait_for_port(BackgroundProcess& server, const Place& at, const std::string& what, const std::string& log) {
  const int port = server.wait_for_int_after("listening on http://" + at.listen + ":", 120);
  if (port == 0) {
    std::fprintf(stderr, "bench serve: the %s server did not start; its log:\n", what.c_str());
    (void)std::system(("cat " + log + " >&2").c_str());
  }
  return port;
}

struct Outcome {
  double latency_s = 0, first_token_s = 0;
  int64_t tokens = 0;
  bool ok = false;
  int status = 0;  // HTTP status, or minus httplib's error code
};

// One streamed request; latency from `sent` (its scheduled arrival in the open loop).
Outcome send(const std::string& host, int port, const Prompt& p, int64_t max_tokens, uint64_t seed, Clock::time_point sent) {
  httplib::Client c(host, port);
  c.set_read_timeout(300, 0);
  const nlohmann::json body{{"prompt", p.text}, {"max_tokens", max_tokens}, {"temperature", 0.8},
                            {"seed", seed},     {"stream", true}};
  Outcome o;
  std::string received;
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    if (o.first_token_s == 0 && std::string(data, n).find("\"text\":\"") != std::string::npos)
      o.first_token_s = std::chrono::duration<double>(Clock::now() - sent).count();
    received.append(data, n);
    return true;
  };
  auto res = c.send(req);
  o.latency_s = std::chrono::duration<double>(Clock::now() - sent).count();
  o.ok = res && res->status == 200 && received.find("[DONE]") != std::string::npos;
  o.status = res ? res->status : -static_cast<int>(res.error());
  o.tokens = max_tokens;
  return o;
}

double quantile(const std::vector<double>& v, double q) { return v.empty() ? std::nan("") : nearest_rank_quantile(v, q); }

double metric(const std::string& text, const std::string& name) {
  const size_t at = text.find("\n" + name + " ");
  return at == std::string::npos ? std::nan("") : std::atof(text.c_str() + at + name.size() + 2);
}

// One workload's table: ep's closed-loop throughput, then every schedule on the same Poisson trace at
// 70% of it (or at fixed_rate when > 0, without the closed loop), opt.repeats rounds interleaved.
// Returns false when a server did not start.
bool run_workload(const Place& at, const std::string& checkpoint, const Workload& w, double fixed_rate,
                  const BenchOptions& opt, const std::string& log, Report& report) {
  std::vector<Prompt> prompts;
  if (Status s = make_prompts(w, 0, &prompts); !s) {
    std::fprintf(stderr, "bench serve: %s\n", s.message().c_str());
    return false;
  }
  const std::vector<std::string>& schedules = opt.schedules.empty() ? serve_schedules() : opt.schedules;
  const size_t ep = std::find(schedules.begin(), schedules.end(), "ep") - schedules.begin();
  const size_t ideal = std::find(schedules.begin(), schedules.end(), "ideal") - schedules.begin();

  // Closed loop on ep: w.clients back to back for 8 s, for the throughput the open loop is sized by.
  double closed_rate = 0;
  if (fixed_rate <= 0) {
    const std::string closed_log = log + ".closed";
    BackgroundProcess server = start_server(at, checkpoint, "ep", w, closed_log);  // ep's throughput sizes every schedule's load
    const int port = wait_for_port(server, at, "ep", closed_log);
    if (port == 0) return false;
    std::atomic<int> next{0};
    std::mutex mu;
    std::vector<Outcome> closed;
    const Clock::time_point t0 = Clock::now();
    std::vector<std::thread> clients;
    for (int c = 0; c < w.clients; ++c)
      clients.emplace_back([&] {
        while (Clock::now() - t0 < std::chrono::seconds(8)) {
          const int i = next.fetch_add(1);
          Outcome o = send(at.host, port, prompts[i % prompts.size()], w.max_tokens, i, Clock::now());
          std::lock_guard<std::mutex> l(mu);
          closed.push_back(o);
        }
      });
    for (auto& t : clients) t.join();
    closed_rate = closed.size() / std::chrono::duration<double>(Clock::now() - t0).count();
  }

  // Open loop, every schedule on the same Poisson trace at that rate, rounds interleaved. Each round
  // starts one schedule further on, so no schedule always follows the same one (ideal saturates and
  // its server's teardown lands on whatever runs next).
  const double rate = fixed_rate > 0 ? fixed_rate : 0.7 * closed_rate;
  struct Result {
    std::vector<double> latency, first_token;  // every round's requests
    std::vector<double> round_p50, round_p95;  // each round's own quantiles
    int64_t requests = 0, failed = 0;
    double estimated = 0, accurate = 0, replans = 0, replicas = 0, cached = 0, layer_forwards = 0, gathered = 0;
    double busiest_rows = 0, mean_rows = 0;
    double forwards = 0, fwd_total = 0, fwd_gate = 0, fwd_exchange = 0, fwd_experts = 0, fwd_schedule = 0;  // rank 0's
    double busiest_expert_s = 0, mean_expert_s = 0;
  };
  std::vector<Result> results(schedules.size());
  for (int round = 0; round < opt.repeats; ++round)
    for (size_t j = 0; j < schedules.size(); ++j) {
      const size_t k = (j + static_cast<size_t>(round)) % schedules.size();
      std::fprintf(stderr, "bench serve: %s, round %d, %s\n", w.name.c_str(), round + 1, schedules[k].c_str());
      const std::string server_log = log + "." + std::to_string(round) + "." + schedules[k];
      BackgroundProcess server = start_server(at, checkpoint, schedules[k], w, server_log);
      const int port = wait_for_port(server, at, schedules[k], server_log);
      if (port == 0) return false;
      std::mt19937_64 rng(11);
      std::exponential_distribution<double> gap(rate);
      std::mutex mu;
      std::vector<Outcome> open;
      const Clock::time_point t1 = Clock::now();
      std::vector<std::thread> clients;
      double arrival = 0;
      for (int i = 0; arrival < kRoundSeconds; ++i, arrival += gap(rng)) {
        const Clock::time_point when = t1 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(arrival));
        std::this_thread::sleep_until(when);
        clients.emplace_back([&, i, when] {
          Outcome o = send(at.host, port, prompts[(1000 + i) % prompts.size()], w.max_tokens, 1000 + i, when);
          std::lock_guard<std::mutex> l(mu);
          open.push_back(o);
        });
      }
      for (auto& t : clients) t.join();
      httplib::Client c(at.host, port);
      auto metrics = c.Get("/metrics");
      const std::string m = metrics ? metrics->body : "";
      Result& r = results[k];
      std::vector<double> this_round;
      for (const Outcome& o : open) {
        ++r.requests;
        if (!o.ok) {
          if (r.failed++ == 0) std::fprintf(stderr, "bench serve: a %s request failed (status %d)\n", schedules[k].c_str(), o.status);
          continue;
        }
        r.latency.push_back(1e3 * o.latency_s), r.first_token.push_back(1e3 * o.first_token_s);
        this_round.push_back(1e3 * o.latency_s);
      }
      r.round_p50.push_back(quantile(this_round, 0.5));
      r.round_p95.push_back(quantile(this_round, 0.95));
      std::fprintf(stderr, "bench serve: %s, round %d, %s: p50 %.0f ms, p95 %.0f ms\n", w.name.c_str(), round + 1,
                   schedules[k].c_str(), r.round_p50.back(), r.round_p95.back());
      r.layer_forwards += metric(m, "moe_moe_layer_forwards_total");
      r.estimated += metric(m, "moe_schedule_estimates_total");
      r.accurate += metric(m, "moe_schedule_estimates_accurate_total");
      r.replans += metric(m, "moe_schedule_replans_total");
      r.replicas += metric(m, "moe_schedule_replicas_total");
      r.cached += metric(m, "moe_schedule_cached_total");
      r.gathered += metric(m, "moe_schedule_gathered_bytes_total");
      r.busiest_rows += metric(m, "moe_expert_rows_busiest_rank_total");
      r.mean_rows += metric(m, "moe_expert_rows_mean_rank_total");
      r.forwards += metric(m, "moe_forwards_total");
      r.fwd_total += metric(m, "moe_forward_seconds_total");
      r.fwd_gate += metric(m, "moe_forward_gate_seconds_total");
      r.fwd_exchange += metric(m, "moe_forward_exchange_seconds_total");
      r.fwd_experts += metric(m, "moe_forward_experts_seconds_total");
      r.fwd_schedule += metric(m, "moe_forward_schedule_seconds_total");
      r.busiest_expert_s += metric(m, "moe_expert_seconds_busiest_rank_total");
      r.mean_expert_s += metric(m, "moe_expert_seconds_mean_rank_total");
    }

  char load[64];
  if (fixed_rate > 0)
    std::snprintf(load, sizeof load, "--rates");
  else
    std::snprintf(load, sizeof load, "70%% of ep's closed-loop %.1f", closed_rate);
  char title[192];
  std::snprintf(title, sizeof title,
                "%s: %d-%d prompt bytes, %lld new tokens, %d slots per rank; Poisson arrivals at %.1f req/s (%s)",
                w.name.c_str(), w.prompt_min, w.prompt_max, static_cast<long long>(w.max_tokens), w.slots_per_rank, rate,
                load);
  report.table(title, {{"schedule", "", 0, 18}, {"requests", "", 0}, {"failed", "", 0}, {"latency p50", "ms", 0},
                       {"p95", "ms", 0}, {"p95 rounds min", "ms", 0}, {"p95 rounds max", "ms", 0}, {"p99 all", "ms", 0},
                       {"p50 / ideal", "x", 2}, {"p95 / ideal", "x", 2}, {"p95 / ep", "x", 2},
                       {"p95 / ep median round", "x", 2}, {"p95 / ep rounds min", "x", 2},
                       {"p95 / ep rounds max", "x", 2}, {"rounds below ep", "", 0}, {"sign test p", "", 4},
                       {"first token p95", "ms", 0}, {"imbalance", "x", 2}, {"estimate right", "%", 0},
                       {"re-planned", "%", 0}, {"replicas", "", 2}, {"cached", "", 2}, {"gathered", "MB", 1}});
  // p50 and p95: the median over the rounds of each round's quantile, so one disturbed round (this
  // machine is shared) moves a figure less than a quantile over every round's requests would.
  auto median = [](const std::vector<double>& v) { return quantile(v, 0.5); };
  const double nan = std::nan("");
  const double ideal_p50 = ideal < schedules.size() ? median(results[ideal].round_p50) : nan;
  const double ideal_p95 = ideal < schedules.size() ? median(results[ideal].round_p95) : nan;
  const double ep_p95 = median(results[ep].round_p95);
  for (size_t k = 0; k < schedules.size(); ++k) {
    const Result& r = results[k];
    const double p50 = median(r.round_p50), p95 = median(r.round_p95);
    PairedRounds paired = paired_rounds(r.round_p95, results[ep].round_p95);  // against ep, round by round
    if (k == ep) paired = {nan, nan, 0, nan, nan};
    report.row({schedules[k], r.requests, r.failed, p50, p95, *std::min_element(r.round_p95.begin(), r.round_p95.end()),
                *std::max_element(r.round_p95.begin(), r.round_p95.end()), quantile(r.latency, 0.99), p50 / ideal_p50,
                p95 / ideal_p95, p95 / ep_p95, paired.median, paired.lowest, paired.highest, paired.below, paired.sign_p,
                quantile(r.first_token, 0.95),
                r.mean_rows > 0 ? r.busiest_rows / r.mean_rows : nan,
                r.estimated > 0 ? 100 * r.accurate / r.estimated : nan, r.estimated > 0 ? 100 * r.replans / r.estimated : nan,
                r.layer_forwards > 0 ? r.replicas / r.layer_forwards : nan,
                r.layer_forwards > 0 ? r.cached / r.layer_forwards : nan, r.gathered / 1e6});
  }

  // Where the serving steps' time went, on rank 0 (its /metrics): the same arrivals for every
  // schedule, so a schedule that evens the experts' load shortens rank 0's wait in the exchange (and
  // the busier rank's experts), and what the schedule costs shows in its own column.
  report.table(w.name + ": where the forwards spent their time (ms per forward over the rounds; rank 0's stages, "
                        "every rank's experts)",
               {{"schedule", "", 0, 18}, {"forwards", "", 0}, {"forward", "ms", 3}, {"experts", "ms", 3},
                {"exchange", "ms", 3}, {"gate", "ms", 3}, {"schedule", "ms", 3}, {"other", "ms", 3},
                {"forward / ep", "x", 2}, {"experts busiest rank", "ms", 3}, {"experts mean rank", "ms", 3},
                {"time imbalance", "x", 2}});
  const double ep_forward = results[ep].forwards > 0 ? results[ep].fwd_total / results[ep].forwards : nan;
  for (size_t k = 0; k < schedules.size(); ++k) {
    const Result& r = results[k];
    const double per = r.forwards > 0 ? 1e3 / r.forwards : std::nan("");
    const double other = r.fwd_total - r.fwd_gate - r.fwd_exchange - r.fwd_experts - r.fwd_schedule;
    report.row({schedules[k], r.forwards, r.fwd_total * per, r.fwd_experts * per, r.fwd_exchange * per,
                r.fwd_gate * per, r.fwd_schedule * per, other * per, r.fwd_total * per / 1e3 / ep_forward,
                r.busiest_expert_s * per, r.mean_expert_s * per,
                r.mean_expert_s > 0 ? r.busiest_expert_s / r.mean_expert_s : std::nan("")});
  }
  return true;
}

// Enters the network namespace at `path` on the calling thread (and the threads it starts after) for
// its lifetime, then returns to the one it was in.
class NetnsGuard {
 public:
  explicit NetnsGuard(const std::string& path) {
    home_ = ::open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
    const int target = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    entered_ = home_ >= 0 && target >= 0 && ::setns(target, CLONE_NEWNET) == 0;
    if (target >= 0) ::close(target);
  }
  ~NetnsGuard() {
    if (entered_) (void)::setns(home_, CLONE_NEWNET);
    if (home_ >= 0) ::close(home_);
  }
  bool entered() const { return entered_; }

 private:
  int home_ = -1;
  bool entered_ = false;
};

int serve_on(const Place& at, const BenchOptions& opt, const ScratchDir& scratch, const std::string& checkpoint) {
  BenchOptions shown = opt;  // the header's threads: each server rank's (start_server's --threads 1)
  shown.threads = 1;
  Report report(at.bench,
                "moe serve on " + at.where + " (1 thread each), streamed requests of real text (80% Python docs, 20% GPL-3), temperature 0.8; " +
                    std::to_string(opt.repeats) + " interleaved rounds of 15 s per schedule and workload",
                shown, /*uses_gemm=*/false);
  const std::string log = (scratch.path() / "serve.log").string();
  for (size_t i = 0; i < serve_workloads().size(); ++i) {
    const Workload& w = serve_workloads()[i];
    if (!workload_selected(w, opt)) continue;
    const double fixed_rate = opt.rates.empty() ? 0 : opt.rates[i];
    if (!run_workload(at, checkpoint, w, fixed_rate, opt, log + "." + std::to_string(w.slots_per_rank), report)) return 1;
  }
  report.note("latency: from the request's scheduled send to its last streamed event (client side); p50, p95: the median "
              "over the rounds of each round's quantile, with the rounds' lowest and highest p95; p99 all and first token "
              "p95 (to the first event with text): over every round's requests");
  report.note("estimate right: MoE layer forwards whose phase-1 estimate had the gate's top-k experts (Lina's accuracy); "
              "re-planned: those with a phase-2 re-plan; replicas: extra expert copies per MoE layer forward; cached: "
              "replicas held but unused by the plan (the replica cache, --replica-cache) per MoE layer forward; "
              "gathered: expert weights rank 0 sent and received for them (the schedule's /metrics)");
  report.note("p95 / ep rounds: each round's p95 over ep's in the same round (rounds interleave the schedules, each "
              "round starting one schedule further on), their median, lowest and highest; rounds below ep: how many "
              "of them are under 1; sign test p: the chance of at least that many by chance alone, were the schedule "
              "as likely above ep's p95 as below (2^-n for all n of n); imbalance: the busiest "
              "rank's expert rows over the ranks' mean, summed over MoE layer forwards (what a replica evens out)");
  report.note("where the time went: rank 0's wall time in model forwards (one per serving step) split into its "
              "experts' computation, the token exchange (layout, both all-to-alls, combine: waiting for a busier rank "
              "shows here), the gate (router and its statistics exchange), the schedule's own work (Lina's estimate, "
              "plans, placements, waits for weight gathers) and the rest (attention, dense layers, norms, logits); "
              "experts busiest / mean rank: every rank's expert time in each MoE layer (sent with its logits), the "
              "slowest rank's at each layer summed over the forward's layers, and the ranks' mean likewise; time "
              "imbalance: their ratio, what the step waits for (each layer's exchange waits for its slowest rank; rows "
              "cost unequally: imbalance above counts rows)");
  report.note("ideal: ep with a perfectly balanced gate (every expert the same load; its text is meaningless), the "
              "reference the other schedules are normalised by, as in the Lina paper");
  report.note(std::getenv("MOE_BENCH_CHECKPOINT") && *std::getenv("MOE_BENCH_CHECKPOINT")
                  ? std::string("model: $MOE_BENCH_CHECKPOINT")
                  : std::string("model: the default model at ") + kBenchModel +
                        " (experts F = 4C, about two thirds of the FLOPs), trained here for 300 steps on 2 ranks with " +
                        kHotExperts + " (a few experts hot)");
  return report.finish(0);
}

}  // namespace

int serve(const BenchOptions& opt) {
  if (!some_workload_matches(opt, "serve")) return 2;
  const ScratchDir scratch("moe_bench_serve_");
  const std::string checkpoint = bench_checkpoint(scratch);
  if (checkpoint.empty()) return 1;
  const Place local{"serve", "2 local ranks", std::string(kMpirunEnv) + "mpirun -n 2 " + self_exe("moe"), "127.0.0.1",
                    "127.0.0.1"};
  return serve_on(local, opt, scratch, checkpoint);
}

int cluster_serve(const BenchOptions& opt) {
  if (!some_workload_matches(opt, "cluster-serve")) return 2;
  const ScratchDir scratch("moe_bench_serve_");
  const std::string checkpoint = bench_checkpoint(scratch);
  if (checkpoint.empty()) return 1;
  const EmulatedCluster cluster("moebench", "1gbit");
  if (!cluster.up()) {
    std::fprintf(stderr, "moe bench cluster-serve: %s\n", cluster.why().c_str());
    return 1;
  }
  // The client runs where mpirun does, in the fabric's namespace; rank 0 listens on host 0's NIC.
  const NetnsGuard fabric(cluster.fabric_netns_path());
  if (!fabric.entered()) {
    std::fprintf(stderr, "moe bench cluster-serve: cannot enter the namespace %s: %s\n",
                 cluster.fabric_netns_path().c_str(), std::strerror(errno));
    return 1;
  }
  const Place hosts{"cluster-serve", "2 emulated hosts x 1 rank (1 Gbit/s)", cluster.command("run -- " + self_exe("moe")),
                    "0.0.0.0", cluster.host_address(0)};
  return serve_on(hosts, opt, scratch, checkpoint);
}

}  // namespace moe::bench
