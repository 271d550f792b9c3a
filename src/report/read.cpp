// Reading the report's inputs: metrics JSON lines and the Chrome trace (report.h).
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "report/report.h"
#include "util/str_cat.h"

namespace moe::report {
namespace {

using json = nlohmann::json;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// nlohmann's messages start "[json.exception.parse_error.101] parse error at line 1, column 9: ";
// the line is ours to name, so keep only what went wrong and where in the line.
std::string parse_problem(const json::parse_error& e) {
  std::string what = e.what();
  if (size_t p = what.find("] "); p != std::string::npos) what = what.substr(p + 2);
  if (size_t p = what.find("column "); p != std::string::npos) what = what.substr(p);
  return what;
}

const char* type_name(const json& v) { return v.type_name(); }

// A number, or null (nlohmann writes NaN and Inf as null: a skipped step's loss).
Status number(const json& j, const char* key, double* out) {
  const json& v = j.at(key);
  if (v.is_null()) {
    *out = kNaN;
    return Status::ok();
  }
  if (!v.is_number()) return Status::error(str_cat("field '", key, "' is ", type_name(v), ", expected a number"));
  *out = v.get<double>();
  return Status::ok();
}

Status numbers(const json& v, const char* key, std::vector<double>* out) {
  if (!v.is_array()) return Status::error(str_cat("field '", key, "' is ", type_name(v), ", expected a list of numbers"));
  out->clear();
  for (const json& x : v) {
    if (x.is_null()) {
      out->push_back(kNaN);
      continue;
    }
    if (!x.is_number())
      return Status::error(str_cat("field '", key, "' holds ", type_name(x), ", expected a list of numbers"));
    out->push_back(x.get<double>());
  }
  return Status::ok();
}

Status number_table(const json& v, const char* key, std::vector<std::vector<double>>* out) {
  if (!v.is_array())
    return Status::error(str_cat("field '", key, "' is ", type_name(v), ", expected a list per MoE layer"));
  out->clear();
  for (const json& row : v) {
    out->emplace_back();
    if (!row.is_array())
      return Status::error(str_cat("field '", key, "' holds ", type_name(row), ", expected a list per MoE layer"));
    if (Status s = numbers(row, key, &out->back()); !s) return s;
  }
  return Status::ok();
}

// One training line into *r; the fields it has are added to *present.
Status read_step(const json& j, StepRecord* r, std::set<std::string>* present) {
  if (!j.at("step").is_number_integer())
    return Status::error(str_cat("field 'step' is ", type_name(j.at("step")), ", expected an integer"));
  r->step = j.at("step").get<int64_t>();
  struct Scalar {
    const char* key;
    double StepRecord::*field;
  };
  static const Scalar scalars[] = {{"loss", &StepRecord::loss},
                                   {"step_ms", &StepRecord::step_ms},
                                   {"tokens_per_s", &StepRecord::tokens_per_s},
                                   {"compute_ms", &StepRecord::compute_ms},
                                   {"exposed_comm_ms", &StepRecord::exposed_comm_ms},
                                   {"comm_ms", &StepRecord::comm_ms},
                                   {"replicas", &StepRecord::replicas},
                                   {"experts_moved", &StepRecord::experts_moved},
                                   {"sparse_bytes", &StepRecord::sparse_bytes}};
  for (const Scalar& s : scalars) {
    r->*s.field = kNaN;
    if (!j.contains(s.key)) continue;
    if (Status st = number(j, s.key, &(r->*s.field)); !st) return st;
    present->insert(s.key);
  }
  struct List {
    const char* key;
    std::vector<double> StepRecord::*field;
  };
  static const List lists[] = {{"rank_imbalance", &StepRecord::rank_imbalance},
                               {"load_imbalance", &StepRecord::load_imbalance},
                               {"dropped", &StepRecord::dropped}};
  for (const List& l : lists) {
    if (!j.contains(l.key)) continue;
    if (Status st = numbers(j.at(l.key), l.key, &(r->*l.field)); !st) return st;
    present->insert(l.key);
  }
  struct Table {
    const char* key;
    std::vector<std::vector<double>> StepRecord::*field;
  };
  static const Table tables[] = {{"tokens_per_expert", &StepRecord::tokens_per_expert},
                                 {"tokens_per_rank", &StepRecord::tokens_per_rank}};
  for (const Table& t : tables) {
    if (!j.contains(t.key)) continue;
    if (Status st = number_table(j.at(t.key), t.key, &(r->*t.field)); !st) return st;
    present->insert(t.key);
  }
  return Status::ok();
}

}  // namespace

Status read_run(const std::string& path, Run* out) {
  *out = Run{};
  out->path = path;
  out->label = std::filesystem::path(path).filename().string();
  if (out->label.size() > 6 && out->label.ends_with(".jsonl")) out->label.resize(out->label.size() - 6);
  out->unigram_entropy = kNaN;
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::error(str_cat(path, ": cannot be read"));
  std::stringstream buf;
  buf << in.rdbuf();
  const std::string text = buf.str();
  if (in.bad()) return Status::error(str_cat(path, ": read failed"));

  std::map<int64_t, StepRecord> steps;  // a resumed run's file repeats steps: the last line wins
  std::map<int64_t, double> val;
  size_t pos = 0;
  for (int64_t line_no = 1; pos < text.size(); ++line_no) {
    size_t end = text.find('\n', pos);
    const bool unterminated = end == std::string::npos;
    if (unterminated) end = text.size();
    const std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    auto fail = [&](const std::string& why) { return Status::error(str_cat(path, ":", line_no, ": ", why)); };
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json j;
    try {
      j = json::parse(line);
    } catch (const json::parse_error& e) {
      if (unterminated)
        return fail(str_cat("the file ends in the middle of this line (", parse_problem(e),
                            "): was the run stopped while writing it?"));
      return fail(str_cat("not valid JSON: ", parse_problem(e)));
    }
    if (!j.is_object()) return fail(str_cat("a JSON ", type_name(j), ", expected one object per line"));
    if (j.contains("strategy")) {
      if (!j.at("strategy").is_string())
        return fail(str_cat("field 'strategy' is ", type_name(j.at("strategy")), ", expected a string"));
      out->strategy = j.at("strategy").get<std::string>();
    }
    if (j.contains("simulated") && j.at("simulated").is_boolean()) out->simulated = j.at("simulated").get<bool>();
    if (!j.contains("step")) continue;  // not a line of a step (nothing writes such lines today)
    if (j.contains("val_loss")) {
      double v = kNaN;
      if (Status s = number(j, "val_loss", &v); !s) return fail(s.message());
      if (!j.at("step").is_number_integer()) return fail("field 'step' is not an integer");
      val[j.at("step").get<int64_t>()] = v;
      if (j.contains("unigram_entropy")) {
        if (Status s = number(j, "unigram_entropy", &out->unigram_entropy); !s) return fail(s.message());
      }
      continue;
    }
    if (!j.contains("loss") && !j.contains("step_ms")) continue;  // e.g. a checkpoint error's line
    StepRecord r;
    if (Status s = read_step(j, &r, &out->present); !s) return fail(s.message());
    steps[r.step] = std::move(r);
  }
  if (steps.empty()) return Status::error(str_cat(path, ": no training step in the file (lines with \"step\" and "
                                                        "\"loss\" or \"step_ms\"): is it a moe train --metrics file?"));
  for (auto& [step, r] : steps) out->steps.push_back(std::move(r));
  for (auto& [step, v] : val) out->val_loss.emplace_back(step, v);
  if (!val.empty()) out->present.insert("val_loss");
  if (!std::isnan(out->unigram_entropy)) out->present.insert("unigram_entropy");
  return Status::ok();
}

Status read_trace(const std::string& path, Trace* out) {
  *out = Trace{};
  out->path = path;
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::error(str_cat(path, ": cannot be read"));
  json j;
  try {
    j = json::parse(in);
  } catch (const json::parse_error& e) {
    return Status::error(str_cat(path, ": not a Chrome trace (", parse_problem(e), ")"));
  }
  if (!j.is_object() || !j.contains("traceEvents") || !j.at("traceEvents").is_array())
    return Status::error(str_cat(path, ": no \"traceEvents\" list: not a moe train --trace file"));
  const json& events = j.at("traceEvents");
  int64_t last_step = std::numeric_limits<int64_t>::min();
  for (const json& e : events) {
    if (!e.is_object()) continue;
    if (e.value("ph", "") == "M" && e.value("name", "") == "thread_name" && e.contains("tid") &&
        e.at("tid").is_number_integer()) {
      const int tid = e.at("tid").get<int>();
      if (tid >= 0 && tid < 64) {
        if (out->stream_names.size() <= static_cast<size_t>(tid)) out->stream_names.resize(tid + 1);
        if (e.contains("args") && e.at("args").is_object() && e.at("args").contains("name") &&
            e.at("args").at("name").is_string())
          out->stream_names[tid] = e.at("args").at("name").get<std::string>();
      }
    }
    if (e.value("ph", "") == "X" && e.contains("args") && e.at("args").is_object() &&
        e.at("args").contains("step") && e.at("args").at("step").is_number_integer())
      last_step = std::max(last_step, e.at("args").at("step").get<int64_t>());
  }
  if (last_step == std::numeric_limits<int64_t>::min())
    return Status::error(str_cat(path, ": no op spans (\"X\" events with args.step) in the trace"));
  out->step = last_step;
  double t0 = std::numeric_limits<double>::infinity();
  for (const json& e : events) {
    if (!e.is_object() || e.value("ph", "") != "X" || !e.contains("args") || !e.at("args").is_object() ||
        !e.at("args").contains("step") || e.at("args").at("step") != last_step)
      continue;
    if (!e.contains("ts") || !e.at("ts").is_number() || !e.contains("dur") || !e.at("dur").is_number() ||
        !e.contains("pid") || !e.at("pid").is_number_integer() || !e.contains("tid") || !e.at("tid").is_number_integer())
      return Status::error(str_cat(path, ": an \"X\" event of step ", last_step, " lacks a numeric ts, dur, pid or tid"));
    Span s;
    s.start_ms = e.at("ts").get<double>() / 1e3;
    s.end_ms = s.start_ms + e.at("dur").get<double>() / 1e3;
    s.name = e.value("name", "");
    s.communication = e.value("cat", "") == "communication";
    t0 = std::min(t0, s.start_ms);
    out->spans[e.at("pid").get<int>()][e.at("tid").get<int>()].push_back(std::move(s));
  }
  for (auto& [rank, streams] : out->spans)
    for (auto& [stream, spans] : streams) {
      for (Span& s : spans) s.start_ms -= t0, s.end_ms -= t0;
      std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.start_ms < b.start_ms; });
    }
  return Status::ok();
}

}  // namespace moe::report
