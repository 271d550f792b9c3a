#include "bench/report.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <stdexcept>

#include "bench/bench.h"
#include "runtime/cpu_threads.h"
#include "tensor/ops.h"

#ifndef MOE_BUILD_TYPE
#define MOE_BUILD_TYPE "unknown"
#endif

namespace moe::bench {
namespace {

std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown CPU";
}

std::string isa() {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f")) return "AVX-512";
  if (__builtin_cpu_supports("avx2")) return "AVX2";
  return "x86-64";
#else
  return "non-x86";
#endif
}

std::string utc_now() {
  const std::time_t t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M UTC", &tm);
  return buf;
}

}  // namespace

Report::Report(const std::string& bench, const std::string& what, const BenchOptions& opt, bool uses_gemm)
    : json_(opt.json) {
  char host[256] = "unknown";
  gethostname(host, sizeof host - 1);
  const int cpus = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)), mine = runtime::this_process_cpus().count();
  const std::string gemm = uses_gemm ? gemm_backend_name() : "";
  doc_ = {{"bench", bench},
          {"what", what},
          {"machine", {{"host", host}, {"cpu", cpu_model_name()}, {"isa", isa()}, {"cpus", cpus}, {"cpus_in_set", mine}}},
          {"run",
           {{"threads", opt.threads},
            {"repeats", opt.repeats},
            {"gemm", gemm.empty() ? nlohmann::json() : nlohmann::json(gemm)},
            {"build", MOE_BUILD_TYPE},
            {"compiler", __VERSION__},
            {"date", utc_now()}}},
          {"tables", nlohmann::json::array()},
          {"notes", nlohmann::json::array()}};
  if (json_) return;
  std::printf("# moe bench %s: %s\n", bench.c_str(), what.c_str());
  std::printf("# machine  %s, %s, %s, %d CPUs (%d in this process's set)\n", host, cpu_model_name().c_str(),
              isa().c_str(), cpus, mine);
  std::printf("# run      %d thread(s), %s%s build (gcc %s), %s\n", opt.threads,
              gemm.empty() ? "" : ("GEMM " + gemm + ", ").c_str(), MOE_BUILD_TYPE, __VERSION__, utc_now().c_str());
  std::fflush(stdout);
}

void Report::table(const std::string& title, std::vector<Column> columns) {
  columns_ = std::move(columns);
  nlohmann::json cols = nlohmann::json::array();
  for (const Column& c : columns_) cols.push_back({{"name", c.name}, {"unit", c.unit}, {"precision", c.precision}});
  doc_["tables"].push_back({{"title", title}, {"columns", cols}, {"rows", nlohmann::json::array()}});
  widths_.clear();
  std::string header;
  for (size_t i = 0; i < columns_.size(); ++i) {
    const Column& c = columns_[i];
    const std::string h = c.unit.empty() ? c.name : c.name + " (" + c.unit + ")";
    // Labels (first column) left-aligned and wide; figures right-aligned, at least 9 wide.
    const int w = std::max<int>({static_cast<int>(h.size()), i == 0 ? 24 : 9, c.width});
    widths_.push_back(w);
    char buf[256];
    std::snprintf(buf, sizeof buf, left_aligned(i) ? (i == 0 ? "%-*s" : " %-*s") : " %*s", w, h.c_str());
    header += buf;
  }
  if (json_) return;
  std::printf("\n## %s\n%s\n", title.c_str(), header.c_str());
  std::fflush(stdout);
}

bool Report::left_aligned(size_t i) const {
  return i == 0 || (i + 1 == columns_.size() && columns_[i].unit.empty());
}

std::string Report::cell_text(const Cell& c, const Column& col) const {
  char buf[128];
  if (const std::string* s = std::get_if<std::string>(&c)) return *s;
  if (const int64_t* i = std::get_if<int64_t>(&c)) {
    std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(*i));
    return buf;
  }
  const double d = std::get<double>(c);
  if (!std::isfinite(d)) return "-";
  std::snprintf(buf, sizeof buf, "%.*f", col.precision, d);
  return buf;
}

void Report::row(const std::vector<Cell>& cells) {
  if (cells.size() != columns_.size())
    throw std::logic_error("bench::Report::row: " + std::to_string(cells.size()) + " cells for " +
                           std::to_string(columns_.size()) + " columns");
  nlohmann::json r = nlohmann::json::array();
  std::string line;
  for (size_t i = 0; i < cells.size(); ++i) {
    const Cell& c = cells[i];
    if (const std::string* s = std::get_if<std::string>(&c)) r.push_back(*s);
    else if (const int64_t* n = std::get_if<int64_t>(&c)) r.push_back(*n);
    else if (std::isfinite(std::get<double>(c))) r.push_back(std::get<double>(c));
    else r.push_back(nullptr);
    char buf[256];
    std::snprintf(buf, sizeof buf, left_aligned(i) ? (i == 0 ? "%-*s" : " %-*s") : " %*s", widths_[i],
                  cell_text(c, columns_[i]).c_str());
    line += buf;
  }
  doc_["tables"].back()["rows"].push_back(std::move(r));
  if (json_) return;
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

void Report::note(const std::string& line) {
  doc_["notes"].push_back(line);
  if (json_) return;
  std::printf("# %s\n", line.c_str());
  std::fflush(stdout);
}

bool Report::add_from(const nlohmann::json& doc) {
  if (!doc.is_object() || !doc.contains("tables") || !doc["tables"].is_array()) return false;
  try {
    for (const nlohmann::json& t : doc["tables"]) {
      std::vector<Column> cols;
      for (const nlohmann::json& c : t.at("columns"))
        cols.push_back({c.at("name").get<std::string>(), c.at("unit").get<std::string>(), c.value("precision", 2)});
      table(t.at("title").get<std::string>(), cols);
      for (const nlohmann::json& r : t.at("rows")) {
        std::vector<Cell> cells;
        for (const nlohmann::json& v : r) {
          if (v.is_string()) cells.emplace_back(v.get<std::string>());
          else if (v.is_number_integer()) cells.emplace_back(v.get<int64_t>());
          else if (v.is_number()) cells.emplace_back(v.get<double>());
          else cells.emplace_back(std::nan(""));
        }
        row(cells);
      }
    }
    for (const nlohmann::json& n : doc.value("notes", nlohmann::json::array())) note(n.get<std::string>());
  } catch (const std::exception&) {
    return false;
  }
  return true;
}

int Report::finish(int code) {
  doc_["exit_code"] = code;
  if (json_) std::printf("%s\n", doc_.dump(2).c_str());
  std::fflush(stdout);
  return code;
}

nlohmann::json child_document(const std::string& output) {
  const size_t at = output.find("\n{"), end = output.rfind('}');
  if (at == std::string::npos || end == std::string::npos || end < at)
    return nlohmann::json(nlohmann::json::value_t::discarded);
  return nlohmann::json::parse(output.substr(at + 1, end - at), nullptr, false);
}

}  // namespace moe::bench
