// The report page (report.h): which charts, from which fields, in which order.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <tuple>

#include "model/safetensors.h"  // write_file_atomic
#include "report/report.h"
#include "report/svg.h"
#include "util/str_cat.h"

namespace moe::report {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Every field the page draws, and what it is for: a run without one is listed under "missing".
struct Field {
  const char* name;
  const char* used_for;
};
const Field kFields[] = {{"loss", "loss"},
                         {"val_loss", "validation loss"},
                         {"unigram_entropy", "the unigram entropy line"},
                         {"tokens_per_s", "tokens/s"},
                         {"step_ms", "step time"},
                         {"compute_ms", "the compute / communication split of the step"},
                         {"exposed_comm_ms", "the compute / communication split of the step"},
                         {"comm_ms", "hidden communication"},
                         {"tokens_per_expert", "the expert heatmaps"},
                         {"tokens_per_rank", "the rank heatmaps"},
                         {"rank_imbalance", "rank imbalance"},
                         {"dropped", "dropped tokens"},
                         {"replicas", "replicas"},
                         {"experts_moved", "moved experts"},
                         {"sparse_bytes", "sparse bytes"}};

bool has(const Run& r, const char* field) { return r.present.count(field) > 0; }

double median(std::vector<double> v) {
  v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return !std::isfinite(x); }), v.end());
  if (v.empty()) return kNaN;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A value per step of a run as a series (x = step).
Series series_of(const Run& r, const std::string& label, int style, const std::function<double(const StepRecord&)>& get) {
  Series s;
  s.label = label;
  s.style = style;
  for (const StepRecord& st : r.steps) {
    s.x.push_back(static_cast<double>(st.step));
    s.y.push_back(get(st));
  }
  return s;
}

double worst(const std::vector<double>& v) {
  double w = kNaN;
  for (double x : v)
    if (std::isfinite(x)) w = std::isfinite(w) ? std::max(w, x) : x;
  return w;
}
double total(const std::vector<double>& v) {
  if (v.empty()) return kNaN;
  double t = 0;
  for (double x : v) t += std::isfinite(x) ? x : 0;
  return t;
}
size_t layers_of(const Run& r, std::vector<double> StepRecord::*field) {
  size_t n = 0;
  for (const StepRecord& s : r.steps) n = std::max(n, (s.*field).size());
  return n;
}

std::string cell(double v, const char* fmt = "%.3g") {
  if (!std::isfinite(v)) return "–";
  char b[32];
  std::snprintf(b, sizeof b, fmt, v);
  return b;
}

std::string run_label(const Run& r) { return r.label; }

// A per-run chart of one scalar field, or the note saying no run has it.
std::string scalar_chart(const std::vector<Run>& runs, const char* field, const std::string& kind, const std::string& title,
                         const std::string& caption, const std::string& y_label, double scale,
                         double StepRecord::*member) {
  LineChart c{"chart-" + kind, kind, title, caption, "step", y_label, {}, {}, true};
  for (size_t i = 0; i < runs.size(); ++i)
    if (has(runs[i], field))
      c.series.push_back(series_of(runs[i], run_label(runs[i]), static_cast<int>(i),
                                   [&](const StepRecord& s) { return s.*member * scale; }));
  if (c.series.empty()) return missing_chart(kind, title, str_cat("no run has the field '", field, "'"));
  return line_chart(c);
}

// The binned columns of a heatmap: at most `most` columns, each the mean of consecutive steps.
Heatmap heatmap_of(const Run& r, std::vector<std::vector<double>> StepRecord::*field, size_t layer, const std::string& row_name,
                   size_t most = 1000) {
  Heatmap h;
  size_t rows = 0;
  for (const StepRecord& s : r.steps)
    if (layer < (s.*field).size()) rows = std::max(rows, (s.*field)[layer].size());
  for (size_t i = 0; i < rows; ++i) h.row_labels.push_back(str_cat(row_name, " ", i));
  h.values.assign(rows, {});
  const size_t n = r.steps.size(), bins = std::min(n, most);
  for (size_t b = 0; b < bins; ++b) {
    const size_t i0 = b * n / bins, i1 = (b + 1) * n / bins;
    double x = 0;
    std::vector<double> sum(rows, 0);
    std::vector<int> cnt(rows, 0);
    for (size_t i = i0; i < i1; ++i) {
      x += static_cast<double>(r.steps[i].step);
      const auto& t = r.steps[i].*field;
      if (layer >= t.size()) continue;
      for (size_t k = 0; k < t[layer].size(); ++k)
        if (std::isfinite(t[layer][k])) sum[k] += t[layer][k], ++cnt[k];
    }
    h.x.push_back(x / static_cast<double>(i1 - i0));
    for (size_t k = 0; k < rows; ++k) h.values[k].push_back(cnt[k] ? sum[k] / cnt[k] : kNaN);
  }
  return h;
}

size_t table_layers(const Run& r, std::vector<std::vector<double>> StepRecord::*field) {
  size_t n = 0;
  for (const StepRecord& s : r.steps) n = std::max(n, (s.*field).size());
  return n;
}

const char* kStyle = R"(
body { font-family: "DejaVu Sans", Arial, sans-serif; color: #111; max-width: 800px; margin: 16px auto; padding: 0 8px; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 28px; border-bottom: 1px solid #999; }
figure { margin: 18px 0; } figcaption { font-size: 13px; margin-bottom: 4px; }
svg text { font-size: 12px; fill: #111; font-family: "DejaVu Sans", Arial, sans-serif; }
svg .label { font-weight: bold; } svg .note { fill: #333; font-style: italic; }
svg .grid { stroke: #dddddd; stroke-width: 1; } svg .axis { stroke: #333; } svg .frame { fill: none; stroke: #333; }
table { border-collapse: collapse; font-size: 12px; } td, th { border: 1px solid #999; padding: 2px 6px; text-align: right; }
td:first-child, th:first-child { text-align: left; }
.missing { background: #fff4e0; border-left: 4px solid #8a4b00; padding: 6px 10px; font-size: 13px; }
.inputs { font-size: 12px; color: #333; }
)";

}  // namespace

std::string render_html(const Page& page) {
  const std::vector<Run>& runs = page.runs;
  std::string h = "<!DOCTYPE html>\n<html xmlns=\"http://www.w3.org/1999/xhtml\" lang=\"en\">\n<head>\n<meta charset=\"utf-8\"/>\n";
  h += str_cat("<title>", xml_escape(page.title), "</title>\n<style>", kStyle, "</style>\n</head>\n<body>\n");
  h += str_cat("<h1>", xml_escape(page.title), "</h1>\n<p class=\"inputs\">Drawn by <code>moe report</code> from ");
  for (size_t i = 0; i < runs.size(); ++i)
    h += str_cat(i ? ", " : "", "<code>", xml_escape(runs[i].path), "</code> (", runs[i].steps.size(), " steps", runs[i].strategy.empty() ? "" : str_cat(", ", xml_escape(runs[i].strategy)), ")");
  if (page.trace) h += str_cat("; trace <code>", xml_escape(page.trace->path), "</code>");
  if (page.simulated) h += str_cat("; prediction <code>", xml_escape(page.simulated->path), "</code>");
  h += ".</p>\n";

  // What is missing, said once at the top and again where a chart is left out.
  std::string missing;
  for (const Run& r : runs) {
    std::vector<std::string> lacks;
    std::set<std::string> affects;
    for (const Field& f : kFields)
      if (!has(r, f.name)) lacks.push_back(f.name), affects.insert(f.used_for);
    if (lacks.empty()) continue;
    std::string names, what;
    for (const std::string& n : lacks) names += (names.empty() ? "" : ", ") + n;
    for (const std::string& a : affects) what += (what.empty() ? "" : "; ") + a;
    missing += str_cat("<li><code>", xml_escape(r.label), "</code> has no ", xml_escape(names), " (not drawn for it: ",
                       xml_escape(what), ")</li>\n");
  }
  if (!missing.empty())
    h += str_cat("<div class=\"missing\" id=\"missing-fields\"><b>Missing fields</b> (an older or one-process run, a "
                 "GPU run or a simulation writes fewer): <ul>\n",
                 missing, "</ul></div>\n");

  // Summary: one row per run. Medians over the second half of the run: the first steps include the
  // warm-up (allocation, the cost model, the learning-rate ramp).
  h += "<h2>Summary</h2>\n<table id=\"summary\">\n<tr><th>run</th><th>strategy</th><th>steps</th>"
       "<th>loss, last 10 steps (nats)</th><th>last validation loss (nats)</th><th>step (ms)</th><th>tokens/s</th>"
       "<th>exposed comm (ms)</th><th>ranks max/mean</th><th>dropped / step</th><th>sparse MB / step</th></tr>\n";
  for (const Run& r : runs) {
    const size_t n = r.steps.size(), half = n / 2;
    std::vector<double> loss, step, tps, exposed, ranks, dropped, sparse;
    for (size_t i = 0; i < n; ++i) {
      const StepRecord& s = r.steps[i];
      if (i + 10 >= n) loss.push_back(s.loss);
      if (i < half && n > 1) continue;
      step.push_back(s.step_ms), tps.push_back(s.tokens_per_s), exposed.push_back(s.exposed_comm_ms);
      ranks.push_back(worst(s.rank_imbalance)), dropped.push_back(total(s.dropped)), sparse.push_back(s.sparse_bytes / 1e6);
    }
    double loss_mean = 0;
    int loss_n = 0;
    for (double l : loss)
      if (std::isfinite(l)) loss_mean += l, ++loss_n;
    h += str_cat("<tr><td>", xml_escape(r.label), "</td><td>", xml_escape(r.strategy.empty() ? "–" : r.strategy), "</td><td>",
                 n ? r.steps.back().step : 0, "</td><td>", cell(loss_n ? loss_mean / loss_n : kNaN, "%.4f"), "</td><td>",
                 cell(r.val_loss.empty() ? kNaN : r.val_loss.back().second, "%.4f"), "</td><td>", cell(median(step), "%.1f"),
                 "</td><td>", cell(median(tps), "%.0f"), "</td><td>", cell(median(exposed), "%.1f"), "</td><td>",
                 cell(median(ranks), "%.2f"), "</td><td>", cell(median(dropped), "%.0f"), "</td><td>",
                 cell(median(sparse), "%.2f"), "</td></tr>\n");
  }
  h += "</table>\n<p class=\"inputs\">Medians over the second half of each run's steps (the first include the warm-up); "
       "ranks max/mean: expert rows of the busiest rank over the mean, worst MoE layer.</p>\n";

  // --- Loss.
  h += "<h2>Loss</h2>\n";
  {
    LineChart c{"chart-loss", "loss", "Loss against step.",
                "Training loss per step (lines) and validation loss (markers alone), in nats per byte; the dotted line "
                "is the corpus's unigram byte entropy, the loss of a model that ignores context.",
                "step", "loss (nats)", {}, {}, false};
    std::set<double> entropies;
    for (size_t i = 0; i < runs.size(); ++i) {
      const Run& r = runs[i];
      if (has(r, "loss"))
        c.series.push_back(series_of(r, str_cat(r.label, " train"), static_cast<int>(i), [](const StepRecord& s) { return s.loss; }));
      if (!r.val_loss.empty()) {
        Series v;
        v.label = str_cat(r.label, " validation");
        v.style = static_cast<int>(i);
        v.points_only = true;
        for (auto [step, loss] : r.val_loss) v.x.push_back(static_cast<double>(step)), v.y.push_back(loss);
        c.series.push_back(v);
      }
      if (std::isfinite(r.unigram_entropy)) entropies.insert(r.unigram_entropy);
    }
    for (double e : entropies) c.hlines.push_back({str_cat("unigram entropy ", cell(e, "%.3f"), " nats"), e});
    h += c.series.empty() ? missing_chart("loss", "Loss", "no run has 'loss' or 'val_loss'") : line_chart(c);
  }

  // --- Speed.
  h += "<h2>Speed</h2>\n";
  h += scalar_chart(runs, "tokens_per_s", "throughput", "Throughput against step.",
                    "Tokens trained per second of wall time, whole job (all ranks).", "tokens/s", 1,
                    &StepRecord::tokens_per_s);
  for (size_t i = 0; i < runs.size(); ++i) {
    const Run& r = runs[i];
    const std::string id = runs.size() > 1 ? str_cat("chart-step-time-r", i) : "chart-step-time";
    const std::string title = str_cat("Step time of ", r.label, ".");
    if (!has(r, "step_ms")) {
      h += missing_chart("step-time", title, "the run has no 'step_ms'");
      continue;
    }
    StackedChart c;
    c.id = id, c.kind = "step-time", c.title = title, c.x_label = "step", c.y_label = "time per step (ms)";
    for (const StepRecord& s : r.steps) c.x.push_back(static_cast<double>(s.step));
    if (has(r, "compute_ms") && has(r, "exposed_comm_ms")) {
      std::vector<double> compute, exposed, rest;
      for (const StepRecord& s : r.steps) {
        compute.push_back(s.compute_ms), exposed.push_back(s.exposed_comm_ms);
        rest.push_back(std::max(0.0, s.step_ms - s.compute_ms - s.exposed_comm_ms));
      }
      c.layers = {{"compute", compute}, {"exposed communication", exposed}, {"rest of step (optimizer, host)", rest}};
      c.caption = "Stacked: the compute stream's busy time, the communication it waited for (exposed), and the rest of "
                  "the step's wall time; means over ranks.";
      if (has(r, "comm_ms")) {
        c.lines.push_back(series_of(r, "hidden communication (overlapped)", 0, [](const StepRecord& s) {
          return std::max(0.0, s.comm_ms - s.exposed_comm_ms);
        }));
        c.caption += " The line is hidden communication: time on the communication lanes the compute did not wait for "
                     "(all lanes summed, so it can exceed compute). It runs under compute, so it is drawn over the "
                     "stack, not in it.";
      }
    } else {
      std::vector<double> step;
      for (const StepRecord& s : r.steps) step.push_back(s.step_ms);
      c.layers = {{"step (no compute / communication split in this run)", step}};
      c.caption = "The run records the step's wall time only.";
    }
    h += stacked_chart(c);
  }
  if (page.simulated) {
    const Run& sim = *page.simulated;
    const Run& r = runs.front();
    LineChart c{"chart-sim-vs-measured", "sim-vs-measured",
                str_cat("Predicted against measured step time (", r.label, ")."), "", "step", "time per step (ms)", {}, {}, true};
    c.series.push_back(series_of(r, "measured step (wall)", 0, [](const StepRecord& s) { return s.step_ms; }));
    std::vector<double> measured_graph, predicted;
    if (has(r, "compute_ms") && has(r, "exposed_comm_ms"))
      c.series.push_back(series_of(r, "measured compute + exposed comm", 1,
                                   [](const StepRecord& s) { return s.compute_ms + s.exposed_comm_ms; }));
    c.series.push_back(series_of(sim, str_cat("predicted (", sim.label, ")"), 2, [](const StepRecord& s) { return s.step_ms; }));
    // The ratio over the steps both have, against what the simulator models: the step graph.
    std::map<int64_t, double> graph;
    for (const StepRecord& s : r.steps) graph[s.step] = s.compute_ms + s.exposed_comm_ms;
    std::vector<double> ratio;
    for (const StepRecord& s : sim.steps)
      if (graph.count(s.step) && graph[s.step] > 0) ratio.push_back(s.step_ms / graph[s.step]);
    c.caption = str_cat("The simulator models the step graph (compute and the communication it waits for), not the "
                        "optimizer, so compare the prediction with the middle line. Median predicted / measured over the ",
                        ratio.size(), " steps both have: ", cell(median(ratio), "%.3f"), ".");
    h += line_chart(c);
  }
  if (page.trace) {
    const Trace& t = *page.trace;
    Timeline tl;
    tl.id = "chart-timeline", tl.kind = "timeline", tl.x_label = "time from the step's first op (ms)";
    tl.title = str_cat("One step's ops on every rank and stream (step ", t.step, ", the last traced).");
    tl.caption = "Gaps on a rank's compute row while its communication rows are busy are communication the step waited "
                 "for (exposed); communication under compute ops is hidden.";
    for (const auto& [rank, streams] : t.spans)
      for (const auto& [stream, spans] : streams) {
        const std::string name =
            stream >= 0 && static_cast<size_t>(stream) < t.stream_names.size() && !t.stream_names[stream].empty()
                ? t.stream_names[stream]
                : str_cat("stream ", stream);
        tl.row_labels.push_back(str_cat("rank ", rank, " ", name));
        tl.rows.emplace_back();
        for (const Span& s : spans) tl.rows.back().push_back({s.start_ms, s.end_ms, s.communication, s.name});
      }
    h += timeline(tl);
  }

  // --- Routing: which ranks and layers are hot.
  h += "<h2>Routing</h2>\n";
  auto per_layer_or_run = [&](const char* field, std::vector<double> StepRecord::*member, const std::string& kind,
                              const std::string& title, const std::string& one_run_caption,
                              const std::string& many_runs_caption, const std::string& y_label, bool sum) {
    LineChart c{"chart-" + kind, kind, title, "", "step", y_label, {}, {}, !std::string(field).ends_with("imbalance")};
    if (runs.size() == 1 && has(runs[0], field)) {
      c.caption = one_run_caption;
      for (size_t l = 0; l < layers_of(runs[0], member); ++l)
        c.series.push_back(series_of(runs[0], str_cat("MoE layer ", l), static_cast<int>(l),
                                     [&](const StepRecord& s) { return l < (s.*member).size() ? (s.*member)[l] : kNaN; }));
    } else {
      c.caption = many_runs_caption;
      for (size_t i = 0; i < runs.size(); ++i)
        if (has(runs[i], field))
          c.series.push_back(series_of(runs[i], runs[i].label, static_cast<int>(i), [&](const StepRecord& s) {
            return sum ? total(s.*member) : worst(s.*member);
          }));
    }
    return c.series.empty() ? missing_chart(kind, title, str_cat("no run has the field '", field, "'")) : line_chart(c);
  };
  h += per_layer_or_run("rank_imbalance", &StepRecord::rank_imbalance, "rank-imbalance", "Rank imbalance against step.",
                        "Expert rows of the busiest rank over the mean, per MoE layer (1 = even; the step waits for the busiest rank).",
                        "Expert rows of the busiest rank over the mean, worst MoE layer of each step (1 = even).",
                        "busiest rank / mean (x)", false);
  h += per_layer_or_run("dropped", &StepRecord::dropped, "dropped", "Dropped tokens against step.",
                        "Token-expert assignments dropped by the capacity limit, per MoE layer (0 without --capacity-factor).",
                        "Token-expert assignments dropped by the capacity limit, all MoE layers.", "dropped assignments per step",
                        true);
  for (size_t i = 0; i < runs.size(); ++i) {
    const Run& r = runs[i];
    const std::string suffix = runs.size() > 1 ? str_cat("-r", i) : "";
    for (auto [field, member, kind, row, what] :
         {std::tuple{"tokens_per_expert", &StepRecord::tokens_per_expert, "expert-heatmap", "expert",
                     "Token-expert assignments each expert received (all ranks), per step"},
          std::tuple{"tokens_per_rank", &StepRecord::tokens_per_rank, "rank-heatmap", "rank",
                     "Expert rows each rank computed (replicas included), per step"}}) {
      if (!has(r, field)) {
        h += missing_chart(kind, str_cat(what, ", ", r.label), str_cat("the run has no '", field, "'"));
        continue;
      }
      for (size_t l = 0; l < table_layers(r, member); ++l) {
        Heatmap hm = heatmap_of(r, member, l, row);
        hm.id = str_cat("chart-", kind, suffix, "-l", l), hm.kind = kind;
        hm.title = str_cat(what, ": ", r.label, ", MoE layer ", l, ".");
        std::vector<double> imb;
        for (const StepRecord& s : r.steps) {
          if (l >= (s.*member).size() || (s.*member)[l].empty()) continue;
          const auto& v = (s.*member)[l];
          double sum = 0, mx = 0;
          for (double x : v) sum += x, mx = std::max(mx, x);
          if (sum > 0) imb.push_back(mx * static_cast<double>(v.size()) / sum);
        }
        hm.caption = str_cat("Brighter is more. Median busiest ", row, " / mean: ", cell(median(imb), "%.2f"),
                             r.steps.size() > 1000 ? "; columns average consecutive steps." : ".");
        hm.x_label = "step", hm.y_label = row, hm.value_label = "tokens per step";
        h += heatmap(hm);
      }
    }
  }

  // --- Placement strategies' work.
  h += "<h2>Placement</h2>\n";
  h += scalar_chart(runs, "replicas", "replicas", "Expert replicas against step.",
                    "Extra expert copies the strategy placed this step, all MoE layers and ranks (0 for ep, smartmoe).",
                    "replicas per step", 1, &StepRecord::replicas);
  h += scalar_chart(runs, "experts_moved", "experts-moved", "Moved experts against step.",
                    "Experts whose owner changed with their optimizer state (re-sharding), per step.", "experts moved", 1,
                    &StepRecord::experts_moved);
  h += scalar_chart(runs, "sparse_bytes", "sparse-bytes", "Sparse-collective bytes against step.",
                    "Bytes the sparse collectives moved (replica gathers and their gradients; sent + received, all ranks).",
                    "sparse collectives (MB per step)", 1e-6, &StepRecord::sparse_bytes);
  h += "</body>\n</html>\n";
  return h;
}

Status write_report(const Page& page, const std::string& path) {
  if (page.runs.empty()) return Status::error("report: no run to draw");
  if (Status s = write_file_atomic(path, render_html(page)); !s) return Status::error("report " + path + ": " + s.message());
  return Status::ok();
}

}  // namespace moe::report
