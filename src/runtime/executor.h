// Executes one rank's view of a StepGraph (src/graph/step_graph.h) on real threads: the compute
// stream on the calling thread, each communication lane on its own worker thread, with the graph's
// FIFO, dependency and priority semantics. What an op does is the caller's `OpBody`; the executor
// only decides when it runs and records when it did.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "graph/step_graph.h"
#include "util/status.h"

namespace moe::runtime {

// Runs one op. Called on the op's stream's thread: compute ops on the thread that called run(),
// communication ops on their lane's worker. May write the cost of ops that depend on it (sizes known
// only now). An error stops the step.
using OpBody = std::function<Status(graph::Op& op)>;

// When each op ran, in nanoseconds since the start of run() on this rank's steady clock.
struct OpSpan {
  int64_t start_ns = -1, end_ns = -1;  // -1: did not run (the step failed first)
};
struct StepTimeline {
  int64_t start_ns = 0;            // steady_clock at the start of run(), since its epoch
  int64_t wall_ns = 0;             // from the start of run() until every op ended
  std::vector<OpSpan> spans;       // [ops]
};

// Summary of a timeline: where the time of the step went.
struct StepBreakdown {
  double wall_ms = 0;
  double compute_ms = 0;          // sum of compute-stream op durations
  double exposed_comm_ms = 0;     // wall - compute: the compute stream waiting on communication
  double comm_ms = 0;             // sum of communication op durations (all lanes)
  double allreduce_ms = 0;        // grad_allreduce ops (sum)
  double allreduce_hidden_ms = 0; // part of allreduce_ms during which a compute op was running
};
StepBreakdown breakdown(const graph::StepGraph& g, const StepTimeline& t);
// The MoE layers' time on the compute stream: per MoE block, first start to last end of its forward
// ops (gate_fwd, place, dispatch_fwd, expert_fwd, combine_fwd) plus the same of its backward ops
// (combine_bwd, expert_bwd, gate_bwd), waits inside included. What the trainer's metrics call
// moe_ms_per_rank and the simulator predicts, from the same function. ms.
double moe_layer_ms(const graph::StepGraph& g, const StepTimeline& t);
// The expert GEMM ops' time on the compute stream (expert_fwd + expert_bwd), ms.
double expert_ms(const graph::StepGraph& g, const StepTimeline& t);
// One rank's part in a step's sparse collectives (the ops that move expert weights: replica gathers,
// replica gradients' reduce back to the owners), one entry per sparse op in graph order (every rank's
// graph has the same ops). seconds: the op's time on this rank, waits for its peers included; -1: it
// did not run. sent / received: the bytes of expert weights this rank sent and received in it.
struct SparseOpPart {
  double seconds = -1, sent = 0, received = 0;
  static constexpr int kFields = 3;  // as flattened for an allgather: seconds, sent, received
};
std::vector<SparseOpPart> sparse_op_parts(const graph::StepGraph& g, const StepTimeline& t);
// The expert weights the step's sparse collectives moved (bytes: sent, summed over ranks) and the
// seconds they took at the rate each op ran at; the planners' weights bandwidth follows bytes /
// seconds (strategy::observe_weight_transfers). An op's rate is that of its fastest participant (a
// rank that sent or received in it): the bytes it moved in one direction over its time. A rank's time
// includes its wait for the peers that reached the op later (on a step that is uneven across ranks,
// most of it), and that wait is the peers' lateness, not what the bytes cost; the rank that waited
// least shows the transfer. parts[r]: rank r's sparse_op_parts. REQUIRES: every parts[r] of the same
// size (std::logic_error).
struct WeightTransfers {
  double bytes = 0, seconds = 0;
};
WeightTransfers weight_transfers(const std::vector<std::vector<SparseOpPart>>& parts);

class Executor {
 public:
  Executor();
  ~Executor();  // joins the lane threads (REQUIRES: no run() in progress)
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Runs every op of g once and returns when all ended, or with the first error (whose message names
  // the op, e.g. "L1 dispatch_a2a: <body's message>"). After an error, ops not yet started never
  // start; run() still waits for ops already running on lanes, so bodies must return (communication
  // has its own timeout). Lane threads are created on first use and reused across calls.
  // REQUIRES: g.validate() ok; one run() at a time (std::logic_error). timeline may be null.
  Status run(graph::StepGraph& g, const OpBody& body, StepTimeline* timeline);

 private:
  struct Lane {
    int stream = 0;
    std::thread thread;
  };
  void lane_main(Lane* lane);
  bool may_start(int op) const;  // REQUIRES (these three): mu_ held
  void start_op(int op);
  void end_op(int op, int64_t end_ns, const Status& s);

  std::mutex mu_;
  std::condition_variable cv_;  // any op ended, a step started, or shutdown
  std::vector<std::unique_ptr<Lane>> lanes_;  // index = stream (lanes_[0] unused)
  bool shutdown_ = false;
  // State of the step in progress (guarded by mu_). graph_ is null between steps.
  graph::StepGraph* graph_ = nullptr;
  const OpBody* body_ = nullptr;
  StepTimeline* timeline_ = nullptr;
  std::chrono::steady_clock::time_point t0_;
  std::vector<graph::OpState> state_;  // per op
  std::vector<size_t> head_;    // per stream: position in stream_ops_ of its first op not ended
  std::vector<std::vector<int>> stream_ops_;  // per stream: its op ids in order
  size_t n_ended_ = 0;
  int running_lanes_ = 0;  // lane ops inside their body
  bool failed_ = false;
  Status error_;
};

}  // namespace moe::runtime
