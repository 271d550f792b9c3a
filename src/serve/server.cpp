#include "serve/server.h"

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <deque>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "serve/engine.h"
#include "serve/job.h"
#include "serve/lockstep.h"
#include "serve/profile.h"
#include "serve/sampler.h"
#include "util/quantile.h"

namespace moe::serve {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

Status ServeConfig::validate() const {
  if (Status s = run.validate(); !s) return s;
  if (port < 0 || port > 65535) return Status::error("--port (" + std::to_string(port) + ") must be in [0, 65535]");
  if (slots_per_rank < 1) return Status::error("--slots-per-rank must be >= 1");
  if (max_queue < 1) return Status::error("--max-queue must be >= 1");
  return Status::ok();
}

namespace {

std::atomic<bool> g_stop{false};
void request_stop(int) { g_stop.store(true); }

// One completion request, shared by its HTTP handler (which waits on it) and the scheduler.
struct Request {
  uint64_t id = 0;
  std::vector<int32_t> prompt;
  int64_t max_tokens = 16;
  SamplingParams sampling;
  bool stream = false;
  Clock::time_point arrived;
  std::atomic<bool> cancelled{false};  // the client went away
  std::mutex mu;                       // guards the fields below
  std::condition_variable cv;
  std::string text;                    // the bytes generated so far
  bool done = false;
  std::string finish_reason;           // "length" | "stopped" (the server stopped first)
};

// What /metrics reports. Thread-safe.
class Metrics {
 public:
  void completed(double latency_s, double first_token_s) {
    std::lock_guard<std::mutex> l(mu_);
    ++requests_;
    if (latency_.size() == kKeep) latency_.pop_front(), first_token_.pop_front();
    latency_.push_back(latency_s);
    first_token_.push_back(first_token_s);
  }
  void tokens(int64_t n) {
    std::lock_guard<std::mutex> l(mu_);
    tokens_ += n;
    const Clock::time_point now = Clock::now();
    recent_.emplace_back(now, n);
    while (!recent_.empty() && now - recent_.front().first > kWindow) recent_.pop_front();
  }
  void rejected() { rejected_.fetch_add(1); }
  void set_load(int64_t running, int64_t waiting) { running_.store(running), waiting_.store(waiting); }
  void set_schedule(const ScheduleStats& s, const StageSeconds& stages, const Lockstep::RankTimes& times,
                    const std::optional<plan::LinaCost>& cost) {
    std::lock_guard<std::mutex> l(mu_);
    schedule_ = s;
    cost_ = cost;
    stages_ = stages;
    busiest_expert_s_ = times.busiest_experts;
    mean_expert_s_ = times.mean_experts;
  }

  std::string prometheus() {
    std::lock_guard<std::mutex> l(mu_);
    const Clock::time_point now = Clock::now();
    while (!recent_.empty() && now - recent_.front().first > kWindow) recent_.pop_front();
    int64_t in_window = 0;
    for (const auto& [t, n] : recent_) in_window += n;
    const double window_s = std::min(std::chrono::duration<double>(kWindow).count(),
                                     std::chrono::duration<double>(now - started_).count());
    std::string out;
    auto line = [&](const std::string& name, const std::string& type, const std::string& help, double v) {
      out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n" + name + " " + num(v) + "\n";
    };
    line("moe_requests_total", "counter", "Completed requests.", static_cast<double>(requests_));
    line("moe_requests_rejected_total", "counter", "Requests answered 4xx or 503.", static_cast<double>(rejected_.load()));
    line("moe_generated_tokens_total", "counter", "Tokens generated.", static_cast<double>(tokens_));
    line("moe_tokens_per_second", "gauge", "Tokens generated per second over the last 10 s.",
         window_s > 0 ? in_window / window_s : 0.0);
    line("moe_requests_running", "gauge", "Sequences in the running batch.", static_cast<double>(running_.load()));
    line("moe_requests_waiting", "gauge", "Requests queued for a slot.", static_cast<double>(waiting_.load()));
    line("moe_moe_layer_forwards_total", "counter", "MoE layer forwards (every rank runs each).",
         static_cast<double>(schedule_.layer_steps));
    line("moe_schedule_estimates_total", "counter", "MoE layer forwards planned from Lina's estimate (phase 1).",
         static_cast<double>(schedule_.estimated));
    line("moe_schedule_estimates_accurate_total", "counter", "... whose estimate had the gate's top-k experts.",
         static_cast<double>(schedule_.accurate));
    line("moe_schedule_replans_total", "counter", "Phase-2 re-plans after the gate.", static_cast<double>(schedule_.replanned));
    line("moe_schedule_replicas_total", "counter", "Extra expert replicas placed, summed over MoE layer forwards.",
         static_cast<double>(schedule_.replicas));
    line("moe_schedule_cached_total", "counter",
         "Replicas held but unused by the plan (the replica cache), summed over MoE layer forwards.",
         static_cast<double>(schedule_.cached));
    line("moe_expert_rows_busiest_rank_total", "counter",
         "Expert rows the busiest rank ran, summed over MoE layer forwards (over the mean's: the load imbalance).",
         static_cast<double>(schedule_.busiest_rank_rows));
    line("moe_expert_rows_mean_rank_total", "counter", "Expert rows per rank on average, summed likewise.",
         schedule_.mean_rank_rows);
    line("moe_schedule_gathered_bytes_total", "counter", "Expert weight bytes rank 0 sent and received for replicas.",
         static_cast<double>(schedule_.gathered_bytes));
    line("moe_forwards_total", "counter", "Model forwards on rank 0 (one per serving step, heartbeats included).",
         static_cast<double>(stages_.forwards));
    line("moe_forward_seconds_total", "counter", "Rank 0's wall time in model forwards.", stages_.total);
    line("moe_forward_gate_seconds_total", "counter",
         "... in the MoE layers' routers and their statistics exchange (waiting for other ranks included).",
         stages_.gate);
    line("moe_forward_exchange_seconds_total", "counter",
         "... in the MoE layers' token exchange: layout, both all-to-alls, combine (waiting for busier ranks included).",
         stages_.exchange);
    line("moe_forward_experts_seconds_total", "counter", "... in rank 0's expert computation.", stages_.experts);
    line("moe_forward_schedule_seconds_total", "counter",
         "... in the schedule's own work: Lina's estimate, plans, placements, waits for weight gathers.",
         stages_.schedule);
    line("moe_expert_seconds_busiest_rank_total", "counter",
         "Expert computation of the slowest rank in each MoE layer forward, summed (over the mean's: the imbalance "
         "in time each layer's exchange waits for).",
         busiest_expert_s_);
    line("moe_expert_seconds_mean_rank_total", "counter", "Expert computation per rank on average, summed likewise.",
         mean_expert_s_);
    if (cost_) {  // the lina schedules' price, as refitted from the experts' runs
      out += "# HELP moe_lina_expert_seconds One expert's time on a rank at `rows` rows, as Lina's planner prices it.\n"
             "# TYPE moe_lina_expert_seconds gauge\n";
      for (size_t j = 0; j < cost_->rows.size(); ++j)
        out += "moe_lina_expert_seconds{rows=\"" + num(cost_->rows[j]) + "\"} " + num(cost_->seconds[j]) + "\n";
      line("moe_lina_noise_seconds", "gauge", "Spread (standard deviation) of a rank's MoE layer expert time about it.",
           cost_->noise_seconds);
    }
    summary(&out, "moe_request_latency_seconds", "Arrival to last token, completed requests.", latency_);
    summary(&out, "moe_time_to_first_token_seconds", "Arrival to first token, completed requests.", first_token_);
    return out;
  }

 private:
  static constexpr size_t kKeep = 10000;  // the quantiles are over the last kKeep requests
  static constexpr auto kWindow = std::chrono::seconds(10);
  static std::string num(double v) {
    char b[64];
    std::snprintf(b, sizeof b, "%.6g", v);
    return b;
  }
  static void summary(std::string* out, const std::string& name, const std::string& help, const std::deque<double>& v) {
    *out += "# HELP " + name + " " + help + "\n# TYPE " + name + " summary\n";
    const std::vector<double> s(v.begin(), v.end());
    for (double q : {0.5, 0.95, 0.99}) {
      const double x = s.empty() ? 0.0 : nearest_rank_quantile(s, q);
      *out += name + "{quantile=\"" + num(q) + "\"} " + num(x) + "\n";
    }
    double sum = 0;
    for (double x : s) sum += x;
    *out += name + "_sum " + num(sum) + "\n" + name + "_count " + num(static_cast<double>(s.size())) + "\n";
  }

  std::mutex mu_;
  const Clock::time_point started_ = Clock::now();
  int64_t requests_ = 0, tokens_ = 0;
  std::atomic<int64_t> rejected_{0}, running_{0}, waiting_{0};
  std::deque<double> latency_, first_token_;
  std::deque<std::pair<Clock::time_point, int64_t>> recent_;
  ScheduleStats schedule_;
  std::optional<plan::LinaCost> cost_;  // the lina schedules' price (engine.h set_lina_cost)
  StageSeconds stages_;
  double busiest_expert_s_ = 0, mean_expert_s_ = 0;
};

// Requests handed from the HTTP threads to the scheduler.
class Inbox {
 public:
  explicit Inbox(int64_t capacity) : capacity_(capacity) {}
  bool push(std::shared_ptr<Request> r) {
    std::lock_guard<std::mutex> l(mu_);
    if (static_cast<int64_t>(queue_.size()) >= capacity_) return false;
    queue_.push_back(std::move(r));
    cv_.notify_one();
    return true;
  }
  // Waits up to `timeout` for a request when `wait`; then takes at most what is queued.
  std::deque<std::shared_ptr<Request>> take(bool wait, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> l(mu_);
    if (wait) cv_.wait_for(l, timeout, [&] { return !queue_.empty(); });
    std::deque<std::shared_ptr<Request>> out;
    out.swap(queue_);
    return out;
  }

 private:
  int64_t capacity_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Request>> queue_;
};

// The longest prefix of `s` from `from` that does not end inside a UTF-8 character.
size_t complete_utf8(const std::string& s, size_t from) {
  size_t end = s.size();
  // Look back at most 3 bytes for the lead byte of a character still missing bytes.
  for (size_t back = 1; back <= 3 && back <= end - from; ++back) {
    const unsigned char c = static_cast<unsigned char>(s[end - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: keep looking for its lead
    const size_t need = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 1;
    return need > back ? end - back : end;
  }
  return end;
}

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

json error_body(const std::string& message) {
  return {{"error", {{"message", message}, {"type", "invalid_request_error"}}}};
}

// A request's fields from its JSON body; errors name the field.
Status parse_request(const std::string& body, int64_t context, uint64_t id, Request* r) {
  json j;
  try {
    j = json::parse(body);
  } catch (const json::exception& e) {
    return Status::error(std::string("the body is not JSON: ") + e.what());
  }
  if (!j.is_object()) return Status::error("the body must be a JSON object");
  static const char* const known[] = {"prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stream", "model", "n"};
  for (const auto& [key, value] : j.items())
    if (std::find_if(std::begin(known), std::end(known), [&](const char* k) { return key == k; }) == std::end(known))
      return Status::error("unknown field '" + key + "'");
  if (!j.contains("prompt") || !j["prompt"].is_string()) return Status::error("'prompt' must be a string");
  const std::string prompt = j["prompt"].get<std::string>();
  if (prompt.empty()) return Status::error("'prompt' is empty");
  if (static_cast<int64_t>(prompt.size()) > context)
    return Status::error("'prompt' is " + std::to_string(prompt.size()) + " bytes; the model's context is " +
                         std::to_string(context));
  for (unsigned char c : prompt) r->prompt.push_back(c);
  auto number = [&](const char* key, auto* out, auto lo, auto hi) -> Status {
    if (!j.contains(key)) return Status::ok();
    using T = std::remove_pointer_t<decltype(out)>;
    if (std::is_integral_v<T> ? !j[key].is_number_integer() : !j[key].is_number())
      return Status::error(std::string("'") + key + "' must be " + (std::is_integral_v<T> ? "an integer" : "a number"));
    const T v = j[key].get<T>();
    if (!(v >= lo && v <= hi))
      return Status::error(std::string("'") + key + "' (" + j[key].dump() + ") must be in [" + std::to_string(lo) +
                           ", " + std::to_string(hi) + "]");
    *out = v;
    return Status::ok();
  };
  r->sampling.temperature = 1.0;  // OpenAI's default
  r->sampling.seed = id;
  int64_t n = 1;
  if (Status s = number("max_tokens", &r->max_tokens, int64_t{1}, int64_t{1} << 20); !s) return s;
  if (Status s = number("temperature", &r->sampling.temperature, 0.0, 100.0); !s) return s;
  if (Status s = number("top_p", &r->sampling.top_p, 1e-9, 1.0); !s) return s;
  if (Status s = number("top_k", &r->sampling.top_k, int64_t{0}, int64_t{1} << 20); !s) return s;
  if (Status s = number("n", &n, int64_t{1}, int64_t{1}); !s) return s;
  if (j.contains("seed")) {
    if (!j["seed"].is_number_unsigned()) return Status::error("'seed' must be a non-negative integer");
    r->sampling.seed = j["seed"].get<uint64_t>();
  }
  if (j.contains("stream")) {
    if (!j["stream"].is_boolean()) return Status::error("'stream' must be true or false");
    r->stream = j["stream"].get<bool>();
  }
  return Status::ok();
}

// A sequence in the running batch.
struct Running {
  std::shared_ptr<Request> req;
  int rank = 0, slot = 0;
  Sampler sampler;
  Sequence seq;
  int64_t produced = 0;
  Clock::time_point first_token;
};

}  // namespace

int admission_rank(const std::vector<int64_t>& used, const std::vector<int64_t>& free_slots, int64_t need,
                   int64_t max_rows) {
  if (used.size() != free_slots.size())
    throw std::logic_error("admission_rank: used and free_slots must have one entry per rank");
  int best = -1;
  for (int k = 0; k < static_cast<int>(used.size()); ++k) {
    if (free_slots[k] <= 0 || used[k] + need > max_rows) continue;
    if (best < 0 || used[k] < used[best] || (used[k] == used[best] && free_slots[k] > free_slots[best])) best = k;
  }
  return best;
}

namespace {

// The scheduler on rank 0: admits requests into free slots, runs one step of every running sequence
// per forward, hands each its token. Returns when g_stop is set.
class Scheduler {
 public:
  Scheduler(Lockstep& ranks, const InferenceEngine& engine, Inbox& inbox, Metrics& metrics, int64_t slots_per_rank)
      : ranks_(ranks), inbox_(inbox), metrics_(metrics), T_(engine.config().seq_len),
        V_(engine.config().vocab_size), max_rows_(engine.max_rows()) {
    free_.resize(ranks.ranks());
    for (auto& slots : free_)
      for (int64_t s = slots_per_rank - 1; s >= 0; --s) slots.push_back(static_cast<int>(s));
  }

  Status run() {
    while (!g_stop.load()) {
      const bool idle = running_.empty() && waiting_.empty();
      for (auto& r : inbox_.take(idle, std::chrono::milliseconds(200))) waiting_.push_back(std::move(r));
      if (Status s = step(); !s) return s;
    }
    for (Running& r : running_) finish(r, "stopped");
    for (auto& req : waiting_) finish_unstarted(*req);
    for (auto& req : inbox_.take(false, {})) finish_unstarted(*req);
    return ranks_.finish();
  }

 private:
  // This step's rows: every running sequence whose rows still fit its rank's budget (a decode row,
  // or a context refill), then waiting requests in arrival order, each to admission_rank's choice.
  // A sequence that does not fit waits a step.
  void plan() {
    rows_.clear();
    scheduled_.clear();
    std::vector<int64_t> used(free_.size(), 0), free_slots(free_.size(), 0);
    auto add = [&](size_t i) {
      const Running& r = running_[i];
      used[r.rank] += r.seq.rows();
      scheduled_.push_back(i);
      r.seq.add_rows(r.rank, r.slot, &rows_);
    };
    for (size_t i = 0; i < running_.size(); ++i)
      if (used[running_[i].rank] + running_[i].seq.rows() <= max_rows_) add(i);
    while (!waiting_.empty()) {
      std::shared_ptr<Request> req = waiting_.front();
      if (req->cancelled.load()) {
        waiting_.pop_front();
        continue;
      }
      for (size_t k = 0; k < free_.size(); ++k) free_slots[k] = static_cast<int64_t>(free_[k].size());
      const int best = admission_rank(used, free_slots, static_cast<int64_t>(req->prompt.size()), max_rows_);
      if (best < 0) break;
      waiting_.pop_front();
      running_.push_back(Running{req, best, free_[best].back(), Sampler(req->sampling, 0), Sequence{req->prompt}, 0, {}});
      free_[best].pop_back();
      add(running_.size() - 1);
    }
  }

  Status step() {
    plan();
    // With nothing to run this is a heartbeat: the other ranks wait in it instead of timing out.
    if (Status s = ranks_.step(rows_, &logits_); !s) return s;
    metrics_.set_schedule(ranks_.engine().schedule_stats(), ranks_.engine().stage_seconds(), ranks_.rank_times(),
                          ranks_.engine().lina_cost());
    for (size_t j = 0; j < scheduled_.size(); ++j) {
      Running& r = running_[scheduled_[j]];
      const int32_t next = r.sampler.next(logits_.data() + j * V_, V_);
      r.seq.push(next, T_);
      if (r.produced++ == 0) r.first_token = Clock::now();
      {
        std::lock_guard<std::mutex> l(r.req->mu);
        r.req->text.push_back(static_cast<char>(next));
      }
      r.req->cv.notify_all();
    }
    metrics_.tokens(static_cast<int64_t>(scheduled_.size()));
    // Finished or abandoned sequences free their slots for the next step.
    std::vector<Running> still;
    for (Running& r : running_) {
      if (r.produced >= r.req->max_tokens) finish(r, "length");
      else if (r.req->cancelled.load()) free_[r.rank].push_back(r.slot);
      else still.push_back(std::move(r));
    }
    running_.swap(still);
    metrics_.set_load(static_cast<int64_t>(running_.size()), static_cast<int64_t>(waiting_.size()));
    return Status::ok();
  }

  // Counted in /metrics before the answer goes out, so a client that reads /metrics after its answer
  // finds its request there.
  void finish(Running& r, const char* reason) {
    const Clock::time_point now = Clock::now();
    if (r.produced > 0)
      metrics_.completed(std::chrono::duration<double>(now - r.req->arrived).count(),
                         std::chrono::duration<double>(r.first_token - r.req->arrived).count());
    free_[r.rank].push_back(r.slot);
    {
      std::lock_guard<std::mutex> l(r.req->mu);
      r.req->done = true;
      r.req->finish_reason = reason;
    }
    r.req->cv.notify_all();
  }
  static void finish_unstarted(Request& req) {
    {
      std::lock_guard<std::mutex> l(req.mu);
      req.done = true;
      req.finish_reason = "stopped";
    }
    req.cv.notify_all();
  }

  Lockstep& ranks_;
  Inbox& inbox_;
  Metrics& metrics_;
  const int64_t T_, V_, max_rows_;
  std::vector<std::vector<int>> free_;  // free slots per rank
  std::deque<std::shared_ptr<Request>> waiting_;
  std::vector<Running> running_;
  std::vector<PlacedRow> rows_;
  std::vector<size_t> scheduled_;  // running_ indices in this step, in row order
  std::vector<float> logits_;
};

json completion_json(const Request& r, const std::string& text, const std::string& model, const char* finish) {
  json choice{{"text", text}, {"index", 0}, {"logprobs", nullptr}, {"finish_reason", finish ? json(finish) : json()}};
  return {{"id", "cmpl-" + std::to_string(r.id)},
          {"object", "text_completion"},
          {"created", static_cast<int64_t>(std::time(nullptr))},
          {"model", model},
          {"choices", json::array({choice})}};
}

void add_routes(httplib::Server& server, Inbox& inbox, Metrics& metrics, int64_t context, const std::string& model) {
  auto next_id = std::make_shared<std::atomic<uint64_t>>(1);
  server.Get("/health", [](const httplib::Request&, httplib::Response& res) { res.set_content("ok\n", "text/plain"); });
  server.Get("/metrics", [&metrics](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics.prometheus(), "text/plain; version=0.0.4");
  });
  server.Post("/v1/completions", [&inbox, &metrics, context, model, next_id](const httplib::Request& http,
                                                                              httplib::Response& res) {
    auto req = std::make_shared<Request>();
    req->id = next_id->fetch_add(1);
    req->arrived = Clock::now();
    if (Status s = parse_request(http.body, context, req->id, req.get()); !s) {
      metrics.rejected();
      res.status = 400;
      res.set_content(dump(error_body(s.message())), "application/json");
      return;
    }
    if (!inbox.push(req)) {
      metrics.rejected();
      res.status = 503;
      res.set_content(dump(error_body("the server's queue is full; retry later")), "application/json");
      return;
    }
    if (!req->stream) {
      std::unique_lock<std::mutex> l(req->mu);
      req->cv.wait(l, [&] { return req->done; });
      json body = completion_json(*req, req->text, model, req->finish_reason.c_str());
      const int64_t completion = static_cast<int64_t>(req->text.size());
      body["usage"] = {{"prompt_tokens", req->prompt.size()},
                       {"completion_tokens", completion},
                       {"total_tokens", static_cast<int64_t>(req->prompt.size()) + completion}};
      l.unlock();
      res.set_content(dump(body), "application/json");
      return;
    }
    // Stream: one event per batch of new text, whole UTF-8 characters only.
    auto sent = std::make_shared<size_t>(0);
    res.set_chunked_content_provider(
        "text/event-stream",
        [req, sent, model](size_t, httplib::DataSink& sink) {
          std::unique_lock<std::mutex> l(req->mu);
          req->cv.wait_for(l, std::chrono::milliseconds(500), [&] { return req->done || req->text.size() > *sent; });
          const size_t upto = req->done ? req->text.size() : complete_utf8(req->text, *sent);
          const std::string piece = req->text.substr(*sent, upto - *sent);
          const bool done = req->done;
          const std::string reason = req->finish_reason;
          l.unlock();
          std::string events;
          if (!piece.empty()) events += "data: " + dump(completion_json(*req, piece, model, nullptr)) + "\n\n";
          if (done) events += "data: " + dump(completion_json(*req, "", model, reason.c_str())) + "\n\ndata: [DONE]\n\n";
          if (!events.empty() && !sink.write(events.data(), events.size())) {
            req->cancelled.store(true);
            return false;
          }
          *sent = upto;
          if (done) sink.done();
          return true;
        },
        [req](bool success) {
          if (!success) req->cancelled.store(true);
        });
  });
  server.set_error_handler([](const httplib::Request&, httplib::Response& res) {
    if (res.body.empty()) res.set_content(dump(error_body("no such endpoint (POST /v1/completions, GET /metrics, GET /health)")), "application/json");
  });
}

}  // namespace

Status run_serve(const ServeConfig& cfg) {
  if (Status s = cfg.validate(); !s) return s;
  std::signal(SIGINT, request_stop);
  std::signal(SIGTERM, request_stop);
  InferenceJob job;
  try {
    // Rows of one forward on a rank: every slot decoding plus one whole prompt being prefilled.
    if (Status s = job.start(cfg.run, cfg.slots_per_rank); !s)
      return job.fail(s);
    const int64_t T = job.model->config().seq_len;
    InferenceEngine engine(*job.model, cfg.slots_per_rank, job.max_rows);
    std::unique_ptr<plan::PathProfile> profile;
    const std::string corpus = job.state["config"].value("data", std::string());
    if (Status s = start_schedule(engine, job.world.get(), cfg.run.schedule, corpus, cfg.run.replica_cache, &profile); !s) return job.fail(s);
    Lockstep ranks(engine, job.world.get());
    if (!ranks.lead()) return job.fail(ranks.follow());

    httplib::Server server;
    server.new_task_queue = [] { return new httplib::ThreadPool(64); };
    Inbox inbox(cfg.max_queue);
    Metrics metrics;
    add_routes(server, inbox, metrics, T, std::filesystem::path(cfg.run.checkpoint).filename().string());
    const int port = cfg.port == 0 ? server.bind_to_any_port(cfg.host) : (server.bind_to_port(cfg.host, cfg.port) ? cfg.port : -1);
    if (port < 0)
      return job.fail(Status::error("cannot listen on " + cfg.host + ":" + std::to_string(cfg.port) +
                                    " (in use, or not an address of this machine)"));
    std::thread http([&server] { server.listen_after_bind(); });
    std::fprintf(stderr, "serve: listening on http://%s:%d (%d rank(s), %lld slots per rank, context %lld, schedule %s)\n",
                 cfg.host.c_str(), port, ranks.ranks(), static_cast<long long>(cfg.slots_per_rank),
                 static_cast<long long>(T), schedule_name(engine.schedule()));
    Scheduler scheduler(ranks, engine, inbox, metrics, cfg.slots_per_rank);
    Status s = scheduler.run();
    server.stop();
    http.join();
    std::fprintf(stderr, "serve: stopped\n");
    return job.fail(s);
  } catch (const std::exception& e) {
    return job.fail(Status::error(e.what()));
  }
}

}  // namespace moe::serve
