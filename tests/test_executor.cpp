// The runtime honours the graph (src/runtime/executor.h): small hand-built graphs whose bodies only
// sleep are run, and their timelines and Chrome traces (written, then parsed back) must show that no
// op starts before its dependencies and its stream predecessor end, that a high-priority
// communication queued after a low-priority one starts first, that communication overlaps
// independent compute, and that a failing op stops the step without hanging. Orders are asserted,
// not durations: this machine is small and noisy.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "graph/step_graph.h"
#include "runtime/executor.h"
#include "runtime/trace.h"

namespace moe::runtime {
namespace {

using graph::Op;
using graph::Collective;
using graph::OpKind;
using graph::StepGraph;
using json = nlohmann::json;

// A span in microseconds, as the trace has it; timelines are converted to the same unit.
struct Span {
  bool ran = false;
  double start = 0, end = 0;
};
// Dependency ends and starts may coincide to the nanosecond; trace times are rounded doubles.
constexpr double kEpsUs = 1e-3;

int add_compute(StepGraph* g, std::vector<int> deps, std::string label) {
  Op op;
  op.kind = OpKind::custom;
  op.deps = std::move(deps);
  op.label = std::move(label);
  return g->add(std::move(op));
}

int add_comm(StepGraph* g, int stream, int priority, std::vector<int> deps, std::string label) {
  Op op;
  op.kind = OpKind::custom_comm;
  op.stream = stream;
  op.priority = priority;
  op.deps = std::move(deps);
  op.label = std::move(label);
  return g->add(std::move(op));
}

// A body that sleeps ms[op.id] milliseconds.
OpBody sleeper(std::vector<int> ms) {
  return [ms = std::move(ms)](Op& op) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms.at(op.id)));
    return Status::ok();
  };
}

std::vector<Span> spans_of(const StepTimeline& t) {
  std::vector<Span> spans(t.spans.size());
  for (size_t i = 0; i < spans.size(); ++i)
    if (t.spans[i].start_ns >= 0)
      spans[i] = {true, static_cast<double>(t.spans[i].start_ns) / 1e3, static_cast<double>(t.spans[i].end_ns) / 1e3};
  return spans;
}

std::string temp_path(const std::string& name) {
  std::string file = "moe_test_executor_";
  file += std::to_string(::getpid());
  file += '_';
  file += name;
  return (std::filesystem::temp_directory_path() / file).string();
}

// Writes the trace of one step (as rank `ranks - 1` of `ranks`, every rank with the same timeline),
// parses it back and returns rank 0's spans by op, checking the events' fields on the way.
std::vector<Span> spans_from_trace(const StepGraph& g, const StepTimeline& t, const std::string& name, int ranks = 1) {
  std::vector<TraceRecord> records;
  for (int r = 0; r < ranks; ++r) append_records(&records, g, t, r, /*step=*/7, t.start_ns);
  const std::string path = temp_path(name);
  const Status s = write_chrome_trace(path, g, unflatten(flatten(records)), ranks);
  EXPECT_TRUE(s) << s.message();
  std::ifstream in(path);
  const json trace = json::parse(in);
  std::filesystem::remove(path);

  std::map<std::string, int> by_name;
  for (const Op& op : g.ops) EXPECT_TRUE(by_name.emplace(g.op_name(op), op.id).second) << "names must be unique";
  EXPECT_EQ(trace.at("displayTimeUnit"), "ms");
  std::vector<Span> spans(g.ops.size());
  std::map<std::pair<int, int>, std::string> thread_names;
  std::map<int, std::string> process_names;
  for (const json& e : trace.at("traceEvents")) {
    if (e.at("ph") == "M") {
      const std::string what = e.at("args").at("name").get<std::string>();
      if (e.at("name") == "process_name") process_names[e.at("pid").get<int>()] = what;
      if (e.at("name") == "thread_name") thread_names[{e.at("pid").get<int>(), e.at("tid").get<int>()}] = what;
      continue;
    }
    EXPECT_EQ(e.at("ph"), "X");
    const int id = by_name.at(e.at("name").get<std::string>());
    const Op& op = g.ops[id];
    const json& args = e.at("args");
    EXPECT_EQ(e.at("tid"), op.stream);
    EXPECT_EQ(args.at("kind"), graph::op_kind_name(op.kind));
    EXPECT_EQ(args.at("layer"), op.layer);
    EXPECT_EQ(args.at("micro"), op.micro);
    EXPECT_EQ(args.at("n_micro"), op.n_micro);
    EXPECT_EQ(args.at("priority"), op.priority);
    EXPECT_EQ(args.at("bytes"), op.cost.bytes);
    EXPECT_EQ(args.at("step"), 7);
    EXPECT_EQ(args.at("collective"), graph::collective_name(op.collective));
    EXPECT_EQ(args.at("group"), graph::group_name(op.group));
    if (e.at("pid") != 0) continue;
    EXPECT_FALSE(spans[id].ran) << "one event per op and rank";
    const double ts = e.at("ts"), dur = e.at("dur");
    spans[id] = {true, ts, ts + dur};
  }
  for (int r = 0; r < ranks; ++r) {
    std::string want = "rank ";
    want += std::to_string(r);
    EXPECT_EQ(process_names[r], want);
    for (size_t s = 0; s < g.streams.size(); ++s)
      EXPECT_EQ((thread_names[{r, static_cast<int>(s)}]), g.streams[s].name);
  }
  return spans;
}

// Every op that ran started at or after the end of each dependency and of its stream predecessor.
void expect_honours_graph(const StepGraph& g, const std::vector<Span>& spans, const std::string& source) {
  std::vector<int> prev_on_stream(g.streams.size(), -1);
  for (const Op& op : g.ops) {
    const int prev = prev_on_stream[op.stream];
    prev_on_stream[op.stream] = op.id;
    const Span& s = spans[op.id];
    if (!s.ran) continue;
    const std::string name = source + ": " + g.op_name(op);
    EXPECT_LE(s.start, s.end) << name;
    for (int d : op.deps) {
      ASSERT_TRUE(spans[d].ran) << name << " ran before its dependency " << g.op_name(g.ops[d]);
      EXPECT_GE(s.start, spans[d].end - kEpsUs) << name << " started before its dependency "
                                                 << g.op_name(g.ops[d]) << " ended";
    }
    if (prev >= 0) {
      ASSERT_TRUE(spans[prev].ran) << name << " ran before its stream predecessor";
      EXPECT_GE(s.start, spans[prev].end - kEpsUs) << name << " started before " << g.op_name(g.ops[prev])
                                                    << ", before it on its stream, ended";
    }
  }
}

bool overlap(const Span& a, const Span& b) { return std::max(a.start, b.start) < std::min(a.end, b.end); }

// Aborts the test binary when a run() does not return in time: a hang must fail, not stall ctest.
class Watchdog {
 public:
  explicit Watchdog(std::chrono::seconds limit)
      : thread_([this, limit] {
          std::unique_lock<std::mutex> lock(mu_);
          if (!cv_.wait_for(lock, limit, [this] { return done_; })) {
            std::fprintf(stderr, "Executor::run did not return within %llds\n", static_cast<long long>(limit.count()));
            std::abort();
          }
        }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;  // last: starts after the members it uses
};

TEST(Executor, NoOpStartsBeforeItsDependenciesAndStreamPredecessorEnd) {
  StepGraph g;
  const int a2a = g.add_stream("a2a", true);
  const int ar = g.add_stream("allreduce", true);
  const int c0 = add_compute(&g, {}, "c0");
  const int send = add_comm(&g, a2a, 0, {c0}, "send");
  const int c1 = add_compute(&g, {}, "c1");  // after c0 by stream order only
  const int bucket = add_comm(&g, ar, 0, {c1}, "bucket");
  add_compute(&g, {send}, "c2");
  const int recv = add_comm(&g, a2a, 0, {bucket}, "recv");  // also after send on its lane
  add_compute(&g, {recv}, "c3");
  add_comm(&g, ar, 0, {}, "bucket2");  // after bucket by lane order only
  ASSERT_TRUE(g.validate()) << g.validate().message();

  Executor ex;
  StepTimeline t;
  Watchdog dog(std::chrono::seconds(30));
  const Status s = ex.run(g, sleeper({20, 20, 10, 15, 5, 10, 5, 5}), &t);
  ASSERT_TRUE(s) << s.message();
  ASSERT_EQ(t.spans.size(), g.ops.size());
  for (const OpSpan& span : t.spans) EXPECT_GE(span.start_ns, 0);
  int64_t last_end = 0;
  for (const OpSpan& span : t.spans) last_end = std::max(last_end, span.end_ns);
  EXPECT_GE(t.wall_ns, last_end);
  EXPECT_GT(t.start_ns, 0);
  expect_honours_graph(g, spans_of(t), "timeline");
  expect_honours_graph(g, spans_from_trace(g, t, "order.json", /*ranks=*/2), "trace");
}

// X (low) heads lane A, then B (low, id 2) is queued behind it; C (high, id 3) is on lane B. B and C
// both wait for the compute op K, which normally ends after X: when K ends both are ready at the same
// moment. (Should X end late, B becomes ready while C runs: the assertions hold all the same, and
// without priority B would still start before C ended.)
StepGraph priority_graph(int priority_of_c) {
  StepGraph g;
  const int lane_a = g.add_stream("allreduce", true);
  const int lane_b = g.add_stream("a2a", true);
  add_comm(&g, lane_a, 0, {}, "X");
  const int k = add_compute(&g, {}, "K");
  add_comm(&g, lane_a, 0, {k}, "B");
  add_comm(&g, lane_b, priority_of_c, {k}, "C");
  add_compute(&g, {}, "K2");  // compute right after K: takes no part in priority
  return g;
}
constexpr int kX = 0, kK = 1, kB = 2, kC = 3, kK2 = 4;
const std::vector<int> kPriorityMs = {5, 40, 30, 30, 10};

TEST(Executor, HighPriorityCommunicationQueuedAfterALowOneStartsFirst) {
  StepGraph g = priority_graph(/*priority_of_c=*/1);
  Executor ex;
  for (int rep = 0; rep < 2; ++rep) {
    StepTimeline t;
    Watchdog dog(std::chrono::seconds(30));
    const Status s = ex.run(g, sleeper(kPriorityMs), &t);
    ASSERT_TRUE(s) << s.message();
    std::string trace_name = "priority";
    trace_name += std::to_string(rep);
    for (const auto& [source, spans] :
         {std::pair{std::string("timeline"), spans_of(t)}, std::pair{std::string("trace"), spans_from_trace(g, t, trace_name)}}) {
      expect_honours_graph(g, spans, source);
      EXPECT_LT(spans[kC].start, spans[kB].start) << source << ": C (high) must start before B (low, smaller id)";
      // B was ready as soon as K ended, yet waited while C was ready and then running.
      EXPECT_GE(spans[kB].start, spans[kC].end - kEpsUs) << source;
      EXPECT_LT(spans[kK2].start, spans[kC].end) << source << ": compute is not held back by priority";
    }
  }
}

TEST(Executor, WithEqualPrioritiesTheSameLanesRunConcurrently) {
  // The control for the test above: the order there is the priority's doing, not the graph's.
  StepGraph g = priority_graph(/*priority_of_c=*/0);
  Executor ex;
  StepTimeline t;
  Watchdog dog(std::chrono::seconds(30));
  const Status s = ex.run(g, sleeper(kPriorityMs), &t);
  ASSERT_TRUE(s) << s.message();
  const std::vector<Span> spans = spans_of(t);
  expect_honours_graph(g, spans, "timeline");
  EXPECT_TRUE(overlap(spans[kB], spans[kC])) << "B and C on different lanes, equal priority: both start at K's end";
}

TEST(Executor, CommunicationOverlapsIndependentCompute) {
  StepGraph g;
  const int lane = g.add_stream("allreduce", true);
  add_compute(&g, {}, "backward");
  Op ar;
  ar.kind = OpKind::grad_allreduce;
  ar.collective = graph::Collective::allreduce;
  ar.group = graph::Group::dp;
  ar.stream = lane;
  ar.label = "bucket";
  ar.cost.bytes = 4096;
  g.add(ar);
  Executor ex;
  StepTimeline t;
  Watchdog dog(std::chrono::seconds(30));
  const Status s = ex.run(g, sleeper({50, 50}), &t);
  ASSERT_TRUE(s) << s.message();
  EXPECT_TRUE(overlap(spans_of(t)[0], spans_of(t)[1]));
  const std::vector<Span> traced = spans_from_trace(g, t, "overlap.json");
  EXPECT_TRUE(overlap(traced[0], traced[1]));
  const StepBreakdown b = breakdown(g, t);
  EXPECT_GE(b.compute_ms, 49.0);
  EXPECT_GE(b.allreduce_ms, 49.0);
  EXPECT_DOUBLE_EQ(b.comm_ms, b.allreduce_ms);
  // Both sleep 50 ms from the same moment: most of the allreduce hides behind the compute (all of it
  // but the lane thread's wake-up).
  EXPECT_GE(b.allreduce_hidden_ms, 0.5 * b.allreduce_ms);
  EXPECT_LE(b.allreduce_hidden_ms, b.allreduce_ms);
}

TEST(Executor, FailingOpIsNamedLaterOpsNeverStartAndTheExecutorRunsAgain) {
  StepGraph g;
  const int a2a = g.add_stream("a2a", true);
  const int ar = g.add_stream("allreduce", true);
  const int c0 = add_compute(&g, {}, "c0");
  Op boom;
  boom.kind = OpKind::custom_comm;
  boom.stream = a2a;
  boom.layer = 2;
  boom.label = "boom";
  boom.deps = {c0};
  const int failing = g.add(boom);
  const int waits_on_failed = add_compute(&g, {failing}, "c1");  // the compute thread must not wait forever
  const int running = add_comm(&g, ar, 0, {}, "long");
  const int behind_failed = add_comm(&g, a2a, 0, {}, "after boom");
  const int behind_running = add_comm(&g, ar, 0, {}, "after long");
  const int last_compute = add_compute(&g, {}, "c2");

  // "boom" fails while "long" runs on the other lane, so that run() has to wait for it.
  std::atomic<bool> long_started{false}, failing_now{false};
  auto wait_for = [](const std::atomic<bool>& flag) {
    for (int i = 0; i < 5000 && !flag; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  const OpBody body = [&](Op& op) {
    if (op.id == running) {
      long_started = true;
      wait_for(failing_now);
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
    } else if (op.id == failing) {
      wait_for(long_started);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      failing_now = true;
      return Status::error("injected failure");
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return Status::ok();
  };

  Executor ex;
  for (int rep = 0; rep < 2; ++rep) {  // the same failure again: no state leaks from the first run
    StepTimeline t;
    Status s;
    {
      Watchdog dog(std::chrono::seconds(30));
      s = ex.run(g, body, &t);
    }
    ASSERT_FALSE(s);
    EXPECT_EQ(s.message(), "L2 custom_comm boom: injected failure");
    for (int id : {waits_on_failed, behind_failed, behind_running, last_compute}) {
      EXPECT_EQ(t.spans[id].start_ns, -1) << g.op_name(g.ops[id]) << " started after the failure";
      EXPECT_EQ(t.spans[id].end_ns, -1) << g.op_name(g.ops[id]);
    }
    for (int id : {c0, failing, running}) EXPECT_GE(t.spans[id].end_ns, 0) << g.op_name(g.ops[id]);
    EXPECT_GE(t.spans[running].end_ns, t.spans[failing].end_ns) << "long was running at the failure";
    EXPECT_GE(t.wall_ns, t.spans[running].end_ns) << "run() returned before a running lane op ended";
    std::vector<TraceRecord> records;
    append_records(&records, g, t, 0, rep, t.start_ns);
    EXPECT_EQ(records.size(), 3u) << "ops that did not run are not in the trace";
    long_started = false;
    failing_now = false;
  }

  // Same executor, same lane threads: a graph without failures runs to the end.
  StepTimeline t;
  Watchdog dog(std::chrono::seconds(30));
  const Status s = ex.run(g, sleeper(std::vector<int>(g.ops.size(), 2)), &t);
  ASSERT_TRUE(s) << s.message();
  for (const OpSpan& span : t.spans) EXPECT_GE(span.end_ns, 0);
  expect_honours_graph(g, spans_of(t), "timeline after failures");
}

TEST(Executor, ThrowingBodiesAreErrorsNamingTheOp) {
  StepGraph g;
  const int lane = g.add_stream("a2a", true);
  const int k = add_compute(&g, {}, "k");
  const int after = add_comm(&g, lane, 0, {k}, "after k");
  Executor ex;
  StepTimeline t;
  Watchdog dog(std::chrono::seconds(30));
  Status s = ex.run(
      g, [&](Op& op) -> Status { throw std::runtime_error("bad shape"); }, &t);
  ASSERT_FALSE(s);
  EXPECT_EQ(s.message(), "custom k: bad shape");
  EXPECT_EQ(t.spans[after].start_ns, -1);

  // On a lane thread, where an escaping exception would terminate the process.
  s = ex.run(
      g,
      [&](Op& op) -> Status {
        if (op.id == after) throw std::runtime_error("peer vanished");
        return Status::ok();
      },
      &t);
  ASSERT_FALSE(s);
  EXPECT_EQ(s.message(), "custom_comm after k: peer vanished");
}

TEST(Executor, ComputeRunsOnTheCallerAndEachLaneOnItsOwnPersistentThread) {
  StepGraph g;
  const int a = g.add_stream("a", true);
  const int b = g.add_stream("b", true);
  add_compute(&g, {}, "c");
  add_comm(&g, a, 0, {}, "on a");
  add_comm(&g, b, 0, {}, "on b");
  add_comm(&g, a, 0, {}, "on a again");
  Executor ex;
  std::vector<std::vector<std::thread::id>> runs;
  for (int rep = 0; rep < 2; ++rep) {
    std::vector<std::thread::id> threads(g.ops.size());  // each body writes only its own element
    Watchdog dog(std::chrono::seconds(30));
    const Status s = ex.run(
        g,
        [&](Op& op) {
          threads[op.id] = std::this_thread::get_id();
          return Status::ok();
        },
        nullptr);
    ASSERT_TRUE(s) << s.message();
    runs.push_back(threads);
  }
  for (const auto& threads : runs) {
    EXPECT_EQ(threads[0], std::this_thread::get_id());
    EXPECT_NE(threads[1], std::this_thread::get_id());
    EXPECT_NE(threads[1], threads[2]);
    EXPECT_EQ(threads[1], threads[3]);
  }
  EXPECT_EQ(runs[0][1], runs[1][1]) << "lane threads are reused across runs";
  EXPECT_EQ(runs[0][2], runs[1][2]);
}

// Seeded random graphs: three lanes, random deps and priorities (within the builders' REQUIRES).
// Besides the graph's order, no communication op starts while one of higher priority on another lane
// runs (`ready` cannot be told from a timeline soundly; the tests above cover it).
TEST(Executor, RandomGraphsHonourDependenciesStreamsAndPriorities) {
  std::mt19937 rng(12345);
  Executor ex;
  for (int trial = 0; trial < 3; ++trial) {
    StepGraph g;
    for (const char* name : {"a2a", "allreduce", "gather"}) g.add_stream(name, true);
    std::vector<int> ms, lowest_comm_dep;
    for (int i = 0; i < 40; ++i) {
      std::vector<int> deps;
      int lowest = 3;
      for (int d = std::max(0, i - 6); d < i; ++d)
        if (rng() % 4 == 0) {
          deps.push_back(d);
          lowest = std::min({lowest, lowest_comm_dep[d], graph::is_communication(g.ops[d].kind) ? g.ops[d].priority : 3});
        }
      std::string label = "op";
      label += std::to_string(i);
      const int stream = static_cast<int>(rng() % 4);
      if (stream == 0)
        add_compute(&g, deps, label);
      else
        add_comm(&g, stream, std::min(lowest, static_cast<int>(rng() % 3)), deps, label);
      lowest_comm_dep.push_back(lowest);
      ms.push_back(static_cast<int>(rng() % 3));
    }
    ASSERT_TRUE(g.validate()) << g.validate().message();
    StepTimeline t;
    Watchdog dog(std::chrono::seconds(30));
    const Status s = ex.run(g, sleeper(ms), &t);
    ASSERT_TRUE(s) << s.message();
    expect_honours_graph(g, spans_of(t), "timeline");
    for (const Op& x : g.ops) {
      if (x.stream == 0) continue;
      for (const Op& y : g.ops) {
        if (y.stream == 0 || y.stream == x.stream || y.priority <= x.priority) continue;
        EXPECT_FALSE(t.spans[y.id].start_ns < t.spans[x.id].start_ns && t.spans[x.id].start_ns < t.spans[y.id].end_ns)
            << g.op_name(x) << " started while " << g.op_name(y) << " (higher priority) ran";
      }
    }
  }
}

TEST(Breakdown, MatchesAHandComputedTimeline) {
  StepGraph g;
  const int ar = g.add_stream("allreduce", true);
  const int a2a = g.add_stream("a2a", true);
  for (const char* c : {"c0", "c1", "c2"}) add_compute(&g, {}, c);
  Op reduce;
  reduce.kind = OpKind::grad_allreduce;
  reduce.stream = ar;
  reduce.label = "b0";
  g.add(reduce);
  add_comm(&g, a2a, 0, {}, "a2a");
  reduce.label = "b1";
  g.add(reduce);
  add_compute(&g, {}, "never ran");
  constexpr int64_t kMsNs = 1000000;
  StepTimeline t;
  t.wall_ns = 70 * kMsNs;
  t.spans = {{0, 10 * kMsNs},         {10 * kMsNs, 30 * kMsNs}, {50 * kMsNs, 60 * kMsNs},  // compute: 40
             {5 * kMsNs, 20 * kMsNs},                                                   // b0: 15, 15 hidden
             {30 * kMsNs, 50 * kMsNs},                                                  // a2a: 20
             {25 * kMsNs, 55 * kMsNs},                                                  // b1: 30, 5 + 5 hidden
             {-1, -1}};
  StepBreakdown b = breakdown(g, t);
  EXPECT_DOUBLE_EQ(b.wall_ms, 70);
  EXPECT_DOUBLE_EQ(b.compute_ms, 40);
  EXPECT_DOUBLE_EQ(b.exposed_comm_ms, 30);
  EXPECT_DOUBLE_EQ(b.comm_ms, 65);
  EXPECT_DOUBLE_EQ(b.allreduce_ms, 45);
  EXPECT_DOUBLE_EQ(b.allreduce_hidden_ms, 25);

  t.wall_ns = 30 * kMsNs;  // a wall shorter than the compute (impossible for one thread): clamped
  b = breakdown(g, t);
  EXPECT_DOUBLE_EQ(b.exposed_comm_ms, 0);

  t.spans.pop_back();
  EXPECT_THROW(breakdown(g, t), std::logic_error);
}

// The weights a rank sent in the step's sparse collectives and the time of the ops that sent them:
// an op that only received (0 bytes sent), another collective and an op that never ran are left out.
TEST(WeightTransfers, ARanksPartIsItsSparseOpsInGraphOrder) {
  StepGraph g;
  const int gather = g.add_stream("gather", true);
  auto sparse = [&](OpKind kind, Collective c, int64_t sent, int64_t received) {
    Op op;
    op.kind = kind;
    op.stream = gather;
    op.collective = c;
    op.cost.bytes = sent;
    op.cost.bytes_received = received;
    g.add(op);
  };
  sparse(OpKind::materialize, Collective::sparse_allgather, 3000000, 0);
  sparse(OpKind::grad_allreduce, Collective::allreduce, 5000000, 0);  // not a sparse collective
  sparse(OpKind::materialize_placed, Collective::sparse_allgather, 0, 2000000);
  sparse(OpKind::replica_grad_reduce, Collective::sparse_reduce_scatter, 7000000, 0);  // never ran
  constexpr int64_t kMsNs = 1000000;
  StepTimeline t;
  t.spans = {{0, 2 * kMsNs}, {0, 50 * kMsNs}, {2 * kMsNs, 9 * kMsNs}, {-1, -1}};
  const std::vector<SparseOpPart> parts = sparse_op_parts(g, t);
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_DOUBLE_EQ(parts[0].seconds, 2e-3);
  EXPECT_DOUBLE_EQ(parts[0].sent, 3e6);
  EXPECT_DOUBLE_EQ(parts[0].received, 0);
  EXPECT_DOUBLE_EQ(parts[1].seconds, 7e-3);
  EXPECT_DOUBLE_EQ(parts[1].sent, 0);
  EXPECT_DOUBLE_EQ(parts[1].received, 2e6);
  EXPECT_EQ(parts[2].seconds, -1);
  EXPECT_EQ(parts[2].sent, 0);
}

TEST(WeightTransfers, EachOpRunsAtTheRateOfTheRankThatWaitedLeast) {
  // Three ranks, four sparse ops:
  //  0: rank 0 sends 4 MB to rank 1. Rank 0 reached the op first and waited: 10 ms; rank 1 took 2
  //     ms: 2 GB/s. Rank 2, not in it, returned at once (0.1 ms): no participant.
  //  1: ranks 1 and 2 send 1 MB each to rank 0, which received its 2 MB in 1 ms (2 GB/s, one
  //     direction of its link); rank 1 took 4 ms, rank 2 2 ms: 2 GB/s.
  //  2: rank 2 would have sent 9 MB, but no rank ran it.
  //  3: ran everywhere, moved nothing.
  const std::vector<std::vector<SparseOpPart>> parts = {
      {{10e-3, 4e6, 0}, {1e-3, 0, 2e6}, {-1, 0, 0}, {1e-3, 0, 0}},
      {{2e-3, 0, 4e6}, {4e-3, 1e6, 0}, {-1, 0, 0}, {1e-3, 0, 0}},
      {{0.1e-3, 0, 0}, {2e-3, 1e6, 0}, {-1, 0, 0}, {1e-3, 0, 0}},
  };
  const WeightTransfers w = weight_transfers(parts);
  EXPECT_DOUBLE_EQ(w.bytes, 6e6);
  EXPECT_DOUBLE_EQ(w.seconds, 4e6 / 2e9 + 2e6 / 2e9);
  // (Read as the senders' time, waits included, it was 6 MB in 16 ms: 0.375 GB/s.)
  EXPECT_EQ(weight_transfers({}).bytes, 0);
  EXPECT_THROW(weight_transfers({parts[0], {parts[1][0]}}), std::logic_error);
}

TEST(Trace, RecordsRoundTripAndAFailedWriteLeavesNothing) {
  StepGraph g;
  const int lane = g.add_stream("a2a", true);
  add_compute(&g, {}, "c");
  add_comm(&g, lane, 0, {0}, "x");
  g.ops[1].cost.bytes = 123;
  StepTimeline t;
  t.start_ns = 5000;
  t.wall_ns = 100;
  t.spans = {{0, 40}, {-1, -1}};
  std::vector<TraceRecord> records;
  append_records(&records, g, t, /*rank=*/3, /*step=*/2, /*epoch_ns=*/1000);
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0].rank, 3);
  EXPECT_EQ(records[0].step, 2);
  EXPECT_EQ(records[0].op, 0);
  EXPECT_EQ(records[0].start_ns, 4000);
  EXPECT_EQ(records[0].end_ns, 4040);
  t.spans[1] = {50, 90};
  append_records(&records, g, t, 1, 2, 1000);
  ASSERT_EQ(records.size(), 3u);
  EXPECT_EQ(records[2].bytes, 123);

  const std::vector<int64_t> flat = flatten(records);
  ASSERT_EQ(flat.size(), records.size() * TraceRecord::kFields);
  const std::vector<TraceRecord> back = unflatten(flat);
  ASSERT_EQ(back.size(), records.size());
  for (size_t i = 0; i < back.size(); ++i) EXPECT_EQ(flatten({back[i]}), flatten({records[i]}));
  EXPECT_THROW(unflatten(std::vector<int64_t>(TraceRecord::kFields + 1)), std::logic_error);
  EXPECT_THROW(write_chrome_trace(temp_path("bad.json"), g, records, /*n_ranks=*/2), std::logic_error);  // rank 3

  // A folder where the file should go: the rename fails, the temporary is removed.
  const std::string dir = temp_path("is_a_folder");
  std::filesystem::create_directories(dir);
  const Status s = write_chrome_trace(dir, g, unflatten(flatten({records[1], records[2]})), 2);
  EXPECT_FALSE(s);
  EXPECT_NE(s.message().find(dir), std::string::npos) << s.message();
  EXPECT_FALSE(std::filesystem::exists(dir + ".tmp"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace moe::runtime
