// Chrome trace JSON (the format Perfetto and chrome://tracing open) for StepGraph executions:
// a process per rank, a thread per stream, one complete event ("ph":"X") per op, named by
// StepGraph::op_name and carrying kind, layer, micro-op, priority and bytes as args. The runtime and
// the simulator both write it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "graph/step_graph.h"
#include "runtime/executor.h"
#include "util/status.h"

namespace moe::runtime {

// One op execution on one rank, in the compact form ranks send to the writer (all int64, so a rank's
// records travel as one allgatherv). Names are rebuilt from the graph, which every rank shares.
struct TraceRecord {
  int64_t rank = 0, step = 0, op = 0;
  int64_t start_ns = 0, end_ns = 0;  // since the trace's epoch on that rank
  int64_t bytes = 0;                 // the op's cost.bytes when it ran
  static constexpr int kFields = 6;
};

// Appends the records of one executed step (ops that did not run are skipped). epoch_ns: the steady
// clock time the trace counts from (the timeline's times are since timeline.start_ns).
// REQUIRES: t is a timeline of g (std::logic_error).
void append_records(std::vector<TraceRecord>* out, const graph::StepGraph& g, const StepTimeline& t, int64_t rank,
                    int64_t step, int64_t epoch_ns);

// Flattens records to int64 (TraceRecord::kFields per record) and back, for the gather to the writer.
// REQUIRES of unflatten: flat.size() a multiple of kFields (std::logic_error).
std::vector<int64_t> flatten(const std::vector<TraceRecord>& records);
std::vector<TraceRecord> unflatten(const std::vector<int64_t>& flat);

// Writes the trace of all records (any ranks, any steps) for graph g to path, atomically (temporary
// file + rename: the file is complete or absent). Times in microseconds. Error (naming path): cannot
// write, or a name that is not UTF-8. REQUIRES: every record's op is an op of g and its rank is in
// [0, n_ranks) (std::logic_error).
//
// The file: {"traceEvents": [...], "displayTimeUnit": "ms"}. Per rank a "process_name" metadata event
// ("rank N", pid N) and per stream a "thread_name" one (the stream's name, tid = stream index); per
// record a complete event {"ph":"X", "pid": rank, "tid": stream, "ts", "dur" (us), "name": op_name,
// "cat": "compute" | "communication", "args": {kind, layer, micro, n_micro, priority, bytes, step,
// collective, group}}.
Status write_chrome_trace(const std::string& path, const graph::StepGraph& g, const std::vector<TraceRecord>& records,
                          int n_ranks);

}  // namespace moe::runtime
