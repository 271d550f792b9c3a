// moe bench serve: `moe serve` on 2 MPI ranks driven over HTTP by a trace of real-text requests whose
// domains are skewed: 80% continue windows of the Python documentation (the corpus the model was
// trained on), 20% windows of the GPL-3 text (/usr/share/common-licenses, on every Debian system), so
// the routers see two kinds of text in unequal shares.
//
// First a closed loop (8 clients, each sending its next request when the last one is answered) finds
// ep's throughput; then for every schedule (ideal, ep, lina, lina-no-estimate, lina-no-phase2; --repeats
// interleaved rounds) a fresh server gets the same Poisson arrivals at 70% of it, the load a serving
// system is sized for, and the client measures each request's latency (arrival to last token) and time
// to first token (streamed); the server's /metrics gives Lina's estimation accuracy, phase-2 re-plans,
// replicas and the expert weights moved.
//
// The model: $MOE_BENCH_CHECKPOINT if set, else the default model trained here for 200 steps on 2
// ranks (about 2 minutes).
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
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
#include "bench/report.h"
#include "model/data.h"
#include "runtime/train_config.h"
#include "util/quantile.h"
#include "util/shell.h"

namespace moe::bench {

namespace {

using Clock = std::chrono::steady_clock;
const char* const kMpiEnv = "env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 ";

struct Prompt {
  std::string text;
  bool other_domain = false;
};

// 400 prompts of 32-64 bytes: windows of the Python docs' validation split and, one in five, of the GPL-3.
Status make_prompts(std::vector<Prompt>* out) {
  DataOptions o;
  o.seq_len = 64;
  o.suffix = kDefaultCorpusSuffix;
  TextDataset docs;
  if (Status s = TextDataset::open(kDefaultCorpus, o, &docs); !s) return s;
  std::ifstream f("/usr/share/common-licenses/GPL-3", std::ios::binary);
  std::stringstream gpl;
  gpl << f.rdbuf();
  const std::string other = gpl.str();
  if (other.size() < 1000) return Status::error("bench serve: /usr/share/common-licenses/GPL-3 is missing");
  std::mt19937_64 rng(7);
  const std::vector<uint8_t>& val = docs.val_data();
  for (int i = 0; i < 400; ++i) {
    const size_t len = 32 + rng() % 33;
    Prompt p;
    p.other_domain = i % 5 == 4;
    if (p.other_domain) {
      const size_t at = rng() % (other.size() - len);
      p.text = other.substr(at, len);
    } else {
      const size_t at = rng() % (val.size() - len);
      p.text.assign(val.begin() + at, val.begin() + at + len);
    }
    out->push_back(std::move(p));
  }
  return Status::ok();
}

constexpr const char* kListening = "listening on http://127.0.0.1:";  // moe serve's line; the port follows

// `moe serve` on 2 ranks with `schedule` in the background, its stderr to `log`; stopped by SIGTERM
// when the returned process goes out of scope.
BackgroundProcess start_server(const std::string& checkpoint, const std::string& schedule, const std::string& log) {
  return BackgroundProcess(std::string(kMpiEnv) + "mpirun -n 2 " + self_exe("moe") + " serve --checkpoint " + checkpoint +
                               " --schedule " + schedule + " --port 0 --threads 1 --slots-per-rank 8",
                           log);
}

struct Outcome {
  double latency_s = 0, first_token_s = 0;
  int64_t tokens = 0;
  bool ok = false;
  int status = 0;  // HTTP status, or minus httplib's error code
};

// One streamed request; latency from `sent` (its scheduled arrival in the open loop).
Outcome send(int port, const Prompt& p, int64_t max_tokens, uint64_t seed, Clock::time_point sent) {
  httplib::Client c("127.0.0.1", port);
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

}  // namespace

int serve(const BenchOptions& opt) {
  const ScratchDir scratch("moe_bench_serve_");
  std::string checkpoint = std::getenv("MOE_BENCH_CHECKPOINT") ? std::getenv("MOE_BENCH_CHECKPOINT") : "";
  if (checkpoint.empty()) {
    checkpoint = (scratch.path() / "ck").string();
    std::fprintf(stderr, "bench serve: training the default model for 200 steps on 2 ranks (set MOE_BENCH_CHECKPOINT to skip)\n");
    const std::string cmd = std::string(kMpiEnv) + "mpirun -n 2 " + self_exe("moe") +
                            " train --steps 200 --log-every 50 --eval-batches 4 --threads 1 --checkpoint-dir " +
                            checkpoint + " >&2";
    if (std::system(cmd.c_str()) != 0) {
      std::fprintf(stderr, "bench serve: training failed\n");
      return 1;
    }
  }
  std::vector<Prompt> prompts;
  if (Status s = make_prompts(&prompts); !s) {
    std::fprintf(stderr, "bench serve: %s\n", s.message().c_str());
    return 1;
  }
  constexpr int64_t kMaxTokens = 48;
  const std::vector<std::string> schedules = {"ideal", "ep", "lina", "lina-no-estimate", "lina-no-phase2"};
  Report report("serve",
                "moe serve on 2 ranks (1 thread each, 8 slots per rank), streamed requests of 32-64 prompt bytes "
                "(80% Python docs, 20% GPL-3) and " + std::to_string(kMaxTokens) + " new tokens, temperature 0.8; " +
                    std::to_string(opt.repeats) + " interleaved rounds",
                opt, /*uses_gemm=*/false);
  const std::string log = (scratch.path() / "serve.log").string();

  // Closed loop on ep: 8 clients back to back for 8 s, for the throughput the open loop is sized by.
  double closed_rate = 0;
  {
    BackgroundProcess server = start_server(checkpoint, "ep", log + ".closed");  // ep's throughput sizes every schedule's load
    const int port = server.wait_for_int_after(kListening, 120);
    if (port == 0) {
      std::fprintf(stderr, "bench serve: the server did not start; its log:\n");
      (void)std::system(("cat " + log + ".closed >&2").c_str());
      return 1;
    }
    std::atomic<int> next{0};
    std::mutex mu;
    std::vector<Outcome> closed;
    const Clock::time_point t0 = Clock::now();
    std::vector<std::thread> clients;
    for (int c = 0; c < 8; ++c)
      clients.emplace_back([&] {
        while (Clock::now() - t0 < std::chrono::seconds(8)) {
          const int i = next.fetch_add(1);
          Outcome o = send(port, prompts[i % prompts.size()], kMaxTokens, i, Clock::now());
          std::lock_guard<std::mutex> l(mu);
          closed.push_back(o);
        }
      });
    for (auto& t : clients) t.join();
    closed_rate = closed.size() / std::chrono::duration<double>(Clock::now() - t0).count();
  }

  // Open loop, every schedule on the same Poisson trace at 70% of ep's throughput, rounds interleaved.
  const double rate = 0.7 * closed_rate;
  struct Result {
    std::vector<double> latency, first_token;
    int64_t requests = 0, failed = 0;
    double estimated = 0, accurate = 0, replans = 0, replicas = 0, layer_forwards = 0, gathered = 0;
  };
  std::vector<Result> results(schedules.size());
  for (int round = 0; round < opt.repeats; ++round)
    for (size_t k = 0; k < schedules.size(); ++k) {
      std::fprintf(stderr, "bench serve: round %d, %s\n", round + 1, schedules[k].c_str());
      BackgroundProcess server = start_server(checkpoint, schedules[k], log + "." + std::to_string(round) + "." + schedules[k]);
      const int port = server.wait_for_int_after(kListening, 120);
      if (port == 0) {
        std::fprintf(stderr, "bench serve: the %s server did not start; its log:\n", schedules[k].c_str());
        (void)std::system(("cat " + log + "." + std::to_string(round) + "." + schedules[k] + " >&2").c_str());
        return 1;
      }
      std::mt19937_64 rng(11);
      std::exponential_distribution<double> gap(rate);
      std::mutex mu;
      std::vector<Outcome> open;
      const Clock::time_point t1 = Clock::now();
      std::vector<std::thread> clients;
      double at = 0;
      for (int i = 0; at < 15.0; ++i, at += gap(rng)) {
        const Clock::time_point when = t1 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(at));
        std::this_thread::sleep_until(when);
        clients.emplace_back([&, i, when] {
          Outcome o = send(port, prompts[(1000 + i) % prompts.size()], kMaxTokens, 1000 + i, when);
          std::lock_guard<std::mutex> l(mu);
          open.push_back(o);
        });
      }
      for (auto& t : clients) t.join();
      httplib::Client c("127.0.0.1", port);
      auto metrics = c.Get("/metrics");
      const std::string m = metrics ? metrics->body : "";
      Result& r = results[k];
      for (const Outcome& o : open) {
        ++r.requests;
        if (!o.ok) {
          if (r.failed++ == 0) std::fprintf(stderr, "bench serve: a %s request failed (status %d)\n", schedules[k].c_str(), o.status);
          continue;
        }
        r.latency.push_back(1e3 * o.latency_s), r.first_token.push_back(1e3 * o.first_token_s);
      }
      r.layer_forwards += metric(m, "moe_moe_layer_forwards_total");
      r.estimated += metric(m, "moe_schedule_estimates_total");
      r.accurate += metric(m, "moe_schedule_estimates_accurate_total");
      r.replans += metric(m, "moe_schedule_replans_total");
      r.replicas += metric(m, "moe_schedule_replicas_total");
      r.gathered += metric(m, "moe_schedule_gathered_bytes_total");
    }

  char title[96];
  std::snprintf(title, sizeof title, "Poisson arrivals at %.1f req/s (70%% of ep's closed-loop %.1f)", rate, closed_rate);
  report.table(title, {{"schedule", "", 0, 18}, {"requests", "", 0}, {"failed", "", 0}, {"latency p50", "ms", 0},
                       {"p95", "ms", 0}, {"p99", "ms", 0}, {"p50 / ideal", "x", 2}, {"p95 / ideal", "x", 2}, {"first token p95", "ms", 0},
                       {"estimate right", "%", 0}, {"re-planned", "%", 0}, {"replicas", "", 2}, {"gathered", "MB", 1}});
  const double ideal_p50 = quantile(results[0].latency, 0.5), ideal_p95 = quantile(results[0].latency, 0.95);
  for (size_t k = 0; k < schedules.size(); ++k) {
    const Result& r = results[k];
    const double nan = std::nan("");
    const double p95 = quantile(r.latency, 0.95);
    report.row({schedules[k], r.requests, r.failed, quantile(r.latency, 0.5), p95, quantile(r.latency, 0.99),
                quantile(r.latency, 0.5) / ideal_p50, p95 / ideal_p95, quantile(r.first_token, 0.95), r.estimated > 0 ? 100 * r.accurate / r.estimated : nan,
                r.estimated > 0 ? 100 * r.replans / r.estimated : nan,
                r.layer_forwards > 0 ? r.replicas / r.layer_forwards : nan, r.gathered / 1e6});
  }
  report.note("latency: from the request's scheduled send to its last streamed event; first token: to the first event "
              "with text (client side, over every round)");
  report.note("estimate right: MoE layer forwards whose phase-1 estimate had the gate's top-k experts (Lina's accuracy); "
              "re-planned: those with a phase-2 re-plan; replicas: extra expert copies per MoE layer forward; gathered: "
              "expert weights rank 0 sent and received for them (the schedule's /metrics)");
  report.note("ideal: ep with a perfectly balanced gate (every expert the same load; its text is meaningless), the "
              "reference the other schedules are normalised by, as in the Lina paper");
  return report.finish(0);
}

}  // namespace moe::bench
