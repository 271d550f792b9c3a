// Start here: `moe report`, one self-contained HTML page (inline SVG, no script, no network) drawn from
// the JSON lines of `moe train --metrics` (and optionally its Chrome trace and a `moe sim --metrics`
// prediction). Several runs on one page compare them: every time-series chart draws one line per run.
//
// Use:
//   std::vector<report::Run> runs(paths.size());
//   for (...) if (Status s = report::read_run(paths[i], &runs[i]); !s) ...;   // "run.jsonl:17: ..."
//   report::Page page{runs, trace_or_null, sim_or_null, "title"};
//   if (Status s = report::write_report(page, "report.html"); !s) ...;          // atomic: all or nothing
//
// Errors are returned as Status and name the file and line. A field a run lacks (an older run, one
// process, a GPU run) is not an error: its chart is left out and the page says what is missing.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "util/status.h"

namespace moe::report {

// One training step's line of a metrics file. A number the line lacks is NaN, a list it lacks is
// empty; Run::present says which fields appeared at all.
struct StepRecord {
  int64_t step = 0;
  double loss = 0, step_ms = 0, tokens_per_s = 0;
  double compute_ms = 0, exposed_comm_ms = 0, comm_ms = 0;  // mean over ranks
  double replicas = 0, experts_moved = 0, sparse_bytes = 0;
  std::vector<std::vector<double>> tokens_per_expert;  // [MoE layer][expert]
  std::vector<std::vector<double>> tokens_per_rank;    // [MoE layer][rank]: expert rows each rank ran
  std::vector<double> rank_imbalance;                  // [MoE layer]: busiest rank / mean
  std::vector<double> load_imbalance;                  // [MoE layer]: busiest expert / mean
  std::vector<double> dropped;                         // [MoE layer]: assignments dropped by capacity
};

// One metrics file (moe train --metrics, or moe sim --metrics for a prediction).
struct Run {
  std::string path;
  std::string label;     // the legend's name: the file's name without .jsonl unless set otherwise
  std::string strategy;  // from the lines' "strategy" (empty if none)
  bool simulated = false;                 // lines carry "simulated": true (moe sim)
  std::vector<StepRecord> steps;          // ascending step; a step written twice (a resumed run) keeps its last line
  std::vector<std::pair<int64_t, double>> val_loss;  // (step, validation loss), ascending step
  double unigram_entropy = 0;             // NaN when no validation line carries it
  std::set<std::string> present;          // every training field name seen in at least one line
};

// Reads a metrics file. Lines with "val_loss" are validations; lines with "step" and any of loss /
// step_ms are steps; other lines (checkpoint errors) are skipped. Errors, each naming "path:line":
// a line that is not JSON (or is cut off: the file ends mid-line), not an object, a known field of
// the wrong type or shape; and a file that cannot be read or has no step line at all.
Status read_run(const std::string& path, Run* out);

// The spans of one traced step of `moe train --trace` (Chrome trace JSON): per rank, per stream.
struct Span {
  double start_ms = 0, end_ms = 0;  // from the step's earliest span on any rank
  std::string name;
  bool communication = false;
};
struct Trace {
  std::string path;
  int64_t step = 0;                                      // which step is drawn: the last one traced
  std::vector<std::string> stream_names;                 // by thread id
  std::map<int, std::map<int, std::vector<Span>>> spans; // [rank][stream] in start order
};
// Reads a trace and keeps its last traced step (the first ones include warm-up). Errors: not JSON,
// no "traceEvents", no complete ("X") event with args.step.
Status read_trace(const std::string& path, Trace* out);

struct Page {
  std::vector<Run> runs;    // at least one
  const Trace* trace = nullptr;  // optional: one step's timeline (of the first run)
  const Run* simulated = nullptr;  // optional: predicted step time against the first run's measured
  std::string title = "moe report";
};

// The page as XHTML-compatible HTML5 (parses as XML): a summary table, then one <figure> per chart,
// each with id "chart-<kind>[-...]" and data-chart="<kind>"; a chart whose fields no run has is a
// <p class="missing" data-missing="<kind>"> saying so instead. Kinds: loss, throughput, step-time,
// expert-heatmap and rank-heatmap (per run and MoE layer), rank-imbalance, dropped, replicas,
// experts-moved, sparse-bytes, sim-vs-measured (with a prediction), timeline (with a trace).
std::string render_html(const Page& page);

// render_html written to `path` atomically (a temp file renamed): after an error, `path` is as it was.
Status write_report(const Page& page, const std::string& path);

}  // namespace moe::report
