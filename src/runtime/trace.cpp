// Chrome trace JSON: the event format is documented in "Trace Event Format" (Google); Perfetto and
// chrome://tracing read "X" (complete) events with ts/dur in microseconds and "M" metadata events
// that name processes and threads.
#include "runtime/trace.h"

#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

#include "model/safetensors.h"

namespace moe::runtime {

using json = nlohmann::json;

void append_records(std::vector<TraceRecord>* out, const graph::StepGraph& g, const StepTimeline& t, int64_t rank,
                    int64_t step, int64_t epoch_ns) {
  if (t.spans.size() != g.ops.size()) throw std::logic_error("append_records: the timeline is not of this graph");
  const int64_t shift = t.start_ns - epoch_ns;
  for (const graph::Op& op : g.ops) {
    const OpSpan& s = t.spans[op.id];
    if (s.start_ns < 0 || s.end_ns < 0) continue;
    out->push_back({rank, step, op.id, s.start_ns + shift, s.end_ns + shift, op.cost.bytes});
  }
}

std::vector<int64_t> flatten(const std::vector<TraceRecord>& records) {
  std::vector<int64_t> flat;
  flat.reserve(records.size() * TraceRecord::kFields);
  for (const TraceRecord& r : records) flat.insert(flat.end(), {r.rank, r.step, r.op, r.start_ns, r.end_ns, r.bytes});
  return flat;
}

std::vector<TraceRecord> unflatten(const std::vector<int64_t>& flat) {
  if (flat.size() % TraceRecord::kFields != 0)
    throw std::logic_error("unflatten: size is not a multiple of TraceRecord::kFields");
  std::vector<TraceRecord> records;
  records.reserve(flat.size() / TraceRecord::kFields);
  for (size_t i = 0; i < flat.size(); i += TraceRecord::kFields)
    records.push_back({flat[i], flat[i + 1], flat[i + 2], flat[i + 3], flat[i + 4], flat[i + 5]});
  return records;
}

Status write_chrome_trace(const std::string& path, const graph::StepGraph& g, const std::vector<TraceRecord>& records,
                          int n_ranks) {
  json events = json::array();
  for (int rank = 0; rank < n_ranks; ++rank) {
    std::string process = "rank ";
    process += std::to_string(rank);
    events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank}, {"tid", 0}, {"args", {{"name", process}}}});
    for (size_t s = 0; s < g.streams.size(); ++s)
      events.push_back({{"name", "thread_name"},
                        {"ph", "M"},
                        {"pid", rank},
                        {"tid", s},
                        {"args", {{"name", g.streams[s].name}}}});
  }
  for (const TraceRecord& r : records) {
    if (r.op < 0 || r.op >= static_cast<int64_t>(g.ops.size()) || r.rank < 0 || r.rank >= n_ranks) {
      std::string msg = "write_chrome_trace: record of op ";
      msg += std::to_string(r.op) + " on rank " + std::to_string(r.rank) + " is not of this graph and world";
      throw std::logic_error(msg);
    }
    const graph::Op& op = g.ops[r.op];
    events.push_back({{"name", g.op_name(op)},
                      {"cat", graph::is_communication(op.kind) ? "communication" : "compute"},
                      {"ph", "X"},
                      {"pid", r.rank},
                      {"tid", op.stream},
                      {"ts", static_cast<double>(r.start_ns) / 1e3},
                      {"dur", static_cast<double>(r.end_ns - r.start_ns) / 1e3},
                      {"args",
                       {{"kind", graph::op_kind_name(op.kind)},
                        {"layer", op.layer},
                        {"micro", op.micro},
                        {"n_micro", op.n_micro},
                        {"priority", op.priority},
                        {"bytes", r.bytes},
                        {"step", r.step},
                        {"collective", graph::collective_name(op.collective)},
                        {"group", graph::group_name(op.group)}}}});
  }
  const json trace = {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
  std::string text;
  try {
    text = trace.dump();
  } catch (const json::exception& e) {  // a label or stream name that is not UTF-8
    return Status::error("trace " + path + ": " + e.what());
  }
  text += '\n';
  if (Status s = write_file_atomic(path, text); !s) return Status::error("trace " + path + ": " + s.message());
  return Status::ok();
}

}  // namespace moe::runtime
