// Executor: one mutex and one condition variable hold the whole schedule. Every thread (the caller
// for stream 0, one worker per communication lane) waits until its stream's head op may start, runs
// the body unlocked, and wakes everyone when it ends; may_start() is the graph's rule (graph::may_start).
#include "runtime/executor.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>

namespace moe::runtime {
namespace {

using Clock = std::chrono::steady_clock;

int64_t ns_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}

// A body that throws stops the step like one that returns an error (and must not kill a lane thread).
Status call_body(const OpBody& body, graph::Op& op) {
  try {
    return body(op);
  } catch (const std::exception& e) {
    return Status::error(e.what());
  } catch (...) {
    return Status::error("unknown exception");
  }
}

}  // namespace

StepBreakdown breakdown(const graph::StepGraph& g, const StepTimeline& t) {
  if (t.spans.size() != g.ops.size()) {
    std::string msg = "breakdown: the timeline has ";
    msg += std::to_string(t.spans.size()) + " spans for " + std::to_string(g.ops.size()) + " ops";
    throw std::logic_error(msg);
  }
  constexpr double kMs = 1e-6;
  StepBreakdown b;
  b.wall_ms = static_cast<double>(t.wall_ns) * kMs;
  std::vector<std::pair<int64_t, int64_t>> compute;  // spans of compute ops, merged below
  for (const graph::Op& op : g.ops) {
    const OpSpan& s = t.spans[op.id];
    if (s.start_ns < 0 || s.end_ns < 0) continue;
    const double ms = static_cast<double>(s.end_ns - s.start_ns) * kMs;
    if (graph::is_communication(op.kind)) {
      b.comm_ms += ms;
      if (op.kind == graph::OpKind::grad_allreduce) b.allreduce_ms += ms;
    } else {
      b.compute_ms += ms;
      compute.emplace_back(s.start_ns, s.end_ns);
    }
  }
  b.exposed_comm_ms = std::max(0.0, b.wall_ms - b.compute_ms);

  std::sort(compute.begin(), compute.end());
  std::vector<std::pair<int64_t, int64_t>> merged;
  for (const auto& c : compute) {
    if (!merged.empty() && c.first <= merged.back().second)
      merged.back().second = std::max(merged.back().second, c.second);
    else
      merged.push_back(c);
  }
  for (const graph::Op& op : g.ops) {
    const OpSpan& s = t.spans[op.id];
    if (op.kind != graph::OpKind::grad_allreduce || s.start_ns < 0 || s.end_ns < 0) continue;
    for (const auto& [begin, end] : merged) {
      const int64_t overlap = std::min(end, s.end_ns) - std::max(begin, s.start_ns);
      if (overlap > 0) b.allreduce_hidden_ms += static_cast<double>(overlap) * kMs;
    }
  }
  return b;
}

Executor::Executor() = default;

Executor::~Executor() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_ = true;
  }
  cv_.notify_all();
  for (auto& lane : lanes_)
    if (lane) lane->thread.join();
}

double moe_layer_ms(const graph::StepGraph& g, const StepTimeline& tl) {
  std::map<std::pair<int, int>, std::pair<int64_t, int64_t>> span;  // (layer, bwd) -> (first, last)
  for (const graph::Op& op : g.ops) {
    if (op.layer < 0 || op.stream != 0 /* the compute stream */) continue;
    const OpSpan& sp = tl.spans.at(op.id);
    if (sp.end_ns < 0) continue;
    const bool fwd = op.kind == graph::OpKind::gate_fwd || op.kind == graph::OpKind::place ||
                     op.kind == graph::OpKind::dispatch_fwd || op.kind == graph::OpKind::expert_fwd ||
                     op.kind == graph::OpKind::combine_fwd;
    const bool bwd = op.kind == graph::OpKind::combine_bwd || op.kind == graph::OpKind::expert_bwd ||
                     op.kind == graph::OpKind::gate_bwd;
    if (!fwd && !bwd) continue;
    auto [it, fresh] = span.try_emplace({op.layer, bwd ? 1 : 0}, sp.start_ns, sp.end_ns);
    if (!fresh) {
      it->second.first = std::min(it->second.first, sp.start_ns);
      it->second.second = std::max(it->second.second, sp.end_ns);
    }
  }
  double ms = 0;
  for (const auto& [key, fl] : span) ms += 1e-6 * static_cast<double>(fl.second - fl.first);
  return ms;
}

double expert_ms(const graph::StepGraph& g, const StepTimeline& t) {
  double ms = 0;
  for (const graph::Op& op : g.ops) {
    const OpSpan& sp = t.spans.at(op.id);
    if (op.stream != 0 /* the compute stream */ || sp.end_ns < 0) continue;
    if (op.kind == graph::OpKind::expert_fwd || op.kind == graph::OpKind::expert_bwd)
      ms += 1e-6 * static_cast<double>(sp.end_ns - sp.start_ns);
  }
  return ms;
}

std::vector<SparseOpPart> sparse_op_parts(const graph::StepGraph& g, const StepTimeline& t) {
  std::vector<SparseOpPart> parts;
  for (const graph::Op& op : g.ops) {
    if (op.collective != graph::Collective::sparse_allgather &&
        op.collective != graph::Collective::sparse_reduce_scatter)
      continue;
    const OpSpan& sp = t.spans.at(op.id);
    SparseOpPart p;
    if (sp.end_ns >= 0) {
      p.seconds = 1e-9 * static_cast<double>(sp.end_ns - sp.start_ns);
      p.sent = static_cast<double>(op.cost.bytes);
      p.received = static_cast<double>(op.cost.bytes_received);
    }
    parts.push_back(p);
  }
  return parts;
}

WeightTransfers weight_transfers(const std::vector<std::vector<SparseOpPart>>& parts) {
  WeightTransfers w;
  if (parts.empty()) return w;
  const size_t ops = parts[0].size();
  for (const auto& rank_parts : parts)
    if (rank_parts.size() != ops) throw std::logic_error("weight_transfers: REQUIRES every rank's parts of one size");
  for (size_t o = 0; o < ops; ++o) {
    double sent = 0, rate = 0;
    for (const auto& rank_parts : parts) {
      const SparseOpPart& p = rank_parts[o];
      if (p.seconds < 0) continue;
      sent += p.sent;
      const double moved = std::max(p.sent, p.received);
      if (moved > 0 && p.seconds > 0) rate = std::max(rate, moved / p.seconds);
    }
    if (sent <= 0 || rate <= 0) continue;
    w.bytes += sent;
    w.seconds += sent / rate;
  }
  return w;
}

bool Executor::may_start(int op) const {
  if (failed_) return false;
  auto state = [&](int i) { return state_[i]; };
  auto head = [&](int s) { return head_[s] < stream_ops_[s].size() ? stream_ops_[s][head_[s]] : -1; };
  return graph::may_start(*graph_, op, state, head);
}

void Executor::start_op(int op) {
  state_[op] = graph::OpState::running;
  timeline_->spans[op].start_ns = ns_since(t0_);
}

void Executor::end_op(int op, int64_t end_ns, const Status& s) {
  const graph::Op& o = graph_->ops[op];
  state_[op] = graph::OpState::ended;
  timeline_->spans[op].end_ns = end_ns;
  ++head_[o.stream];
  ++n_ended_;
  if (!s && !failed_) {
    failed_ = true;
    error_ = Status::error(graph_->op_name(o) + ": " + s.message());
  }
  cv_.notify_all();
}

void Executor::lane_main(Lane* lane) {
  const size_t stream = static_cast<size_t>(lane->stream);
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    int op = -1;
    cv_.wait(lock, [&] {
      if (shutdown_) return true;
      if (!graph_ || stream >= stream_ops_.size() || head_[stream] == stream_ops_[stream].size()) return false;
      op = stream_ops_[stream][head_[stream]];
      return may_start(op);
    });
    if (shutdown_) return;
    start_op(op);
    ++running_lanes_;
    graph::Op& o = graph_->ops[op];
    const OpBody& body = *body_;
    const Clock::time_point t0 = t0_;
    lock.unlock();
    const Status s = call_body(body, o);
    const int64_t end_ns = ns_since(t0);
    lock.lock();
    --running_lanes_;
    end_op(op, end_ns, s);
  }
}

Status Executor::run(graph::StepGraph& g, const OpBody& body, StepTimeline* timeline) {
  if (Status s = g.validate(); !s) throw std::logic_error("Executor::run: " + s.message());
  StepTimeline local;
  StepTimeline* tl = timeline ? timeline : &local;
  std::unique_lock<std::mutex> lock(mu_);
  if (graph_) throw std::logic_error("Executor::run: another run() is in progress");
  const size_t n_streams = g.streams.size();
  stream_ops_.assign(n_streams, {});
  for (const graph::Op& op : g.ops) stream_ops_[op.stream].push_back(op.id);
  head_.assign(n_streams, 0);
  state_.assign(g.ops.size(), graph::OpState::waiting);
  n_ended_ = 0;
  running_lanes_ = 0;
  failed_ = false;
  error_ = Status::ok();
  if (lanes_.size() < n_streams) lanes_.resize(n_streams);
  for (size_t s = 1; s < n_streams; ++s) {
    if (lanes_[s] || stream_ops_[s].empty()) continue;
    auto lane = std::make_unique<Lane>();
    lane->stream = static_cast<int>(s);
    lane->thread = std::thread(&Executor::lane_main, this, lane.get());  // waits for graph_ below
    lanes_[s] = std::move(lane);
  }
  tl->spans.assign(g.ops.size(), OpSpan{});
  tl->wall_ns = 0;
  graph_ = &g;
  body_ = &body;
  timeline_ = tl;
  t0_ = Clock::now();
  tl->start_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(t0_.time_since_epoch()).count();
  cv_.notify_all();

  for (int op : stream_ops_[0]) {
    cv_.wait(lock, [&] { return failed_ || may_start(op); });
    if (failed_) break;
    start_op(op);
    lock.unlock();
    const Status s = call_body(body, g.ops[op]);
    const int64_t end_ns = ns_since(t0_);
    lock.lock();
    end_op(op, end_ns, s);
  }
  cv_.wait(lock, [&] { return failed_ ? running_lanes_ == 0 : n_ended_ == g.ops.size(); });

  tl->wall_ns = ns_since(t0_);
  graph_ = nullptr;
  body_ = nullptr;
  timeline_ = nullptr;
  return error_;
}

}  // namespace moe::runtime
