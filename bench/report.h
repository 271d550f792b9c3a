// One output format for every `moe bench` (as nccl-tests has one for every collective): a header
// block saying where and how the figures were measured, then fixed tables whose column names carry
// their units and whose ratio columns name what they compare, then notes. With --json the same
// content goes to stdout as one JSON document instead (progress stays on stderr):
//
//   # moe bench <name>: <what it measures>
//   # machine  <host>, <CPU model>, <ISA>, <n> CPUs (<m> in this process's set)
//   # run      <threads> thread(s), GEMM <kernel>, <build type> build (<compiler>), <UTC date>
//   ## <table title>
//   <col (unit)> <col (unit)> ...
//   <rows>
//   # <note>
//
//   {"bench": ..., "what": ..., "machine": {...}, "run": {...},
//    "tables": [{"title": ..., "columns": [{"name": ..., "unit": ...}], "rows": [[...], ...]}],
//    "notes": [...]}
//
// A column's unit is "" for labels; ratios are named "a / b" with unit "x". A figure that is not
// measured in the run (a goal, a paper's number) goes into a note that says so, never into a column
// beside measured ones. Missing cells are NaN (printed "-", JSON null).
// Thread safety: none. Only the printing rank of an MPI benchmark makes a Report.
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

namespace moe::bench {

struct BenchOptions;

struct Column {
  std::string name;
  std::string unit;    // "ms", "GB/s", "x" (a ratio), "" (a label or a count)
  int precision = 2;   // digits after the point for floating-point cells
  int width = 0;       // text width (0: the header's, at least 24 for the first column and 9 for others)
};
// Text layout: the first column, and a last column without a unit (a note), are left-aligned; the
// others right-aligned.
using Cell = std::variant<std::string, double, int64_t>;

class Report {
 public:
  // Prints the header block (text mode). uses_gemm: the run computes GEMMs here, so the header names
  // the kernel (asking for it may measure both backends once).
  Report(const std::string& bench, const std::string& what, const BenchOptions& opt, bool uses_gemm = false);
  Report(const Report&) = delete;
  Report& operator=(const Report&) = delete;

  // Starts a table (text: its title and column header line).
  void table(const std::string& title, std::vector<Column> columns);
  // One row of the current table; one cell per column (std::logic_error otherwise). Text: printed and
  // flushed at once, so a long benchmark shows its rows as they come.
  void row(const std::vector<Cell>& cells);
  // A line under the tables (text: "# " + line); measured-in-this-run or labelled as what it is.
  void note(const std::string& line);
  // The tables and notes of another Report's JSON document (a benchmark run as a child process with
  // --json, e.g. on an emulated cluster), added as if made here. False if doc is not such a document.
  bool add_from(const nlohmann::json& doc);
  // JSON mode: prints the document. Returns code.
  int finish(int code);

  bool json() const { return json_; }

 private:
  std::string cell_text(const Cell& c, const Column& col) const;
  bool left_aligned(size_t column) const;
  bool json_ = false;
  nlohmann::json doc_;
  std::vector<Column> columns_;
  std::vector<int> widths_;
};

// The JSON document a child `moe bench ... --json` printed among other output (mpirun's launch lines
// before it, MPI's messages possibly after): from its first line that opens with '{' to the last '}'.
// A discarded value (is_discarded()) when there is none.
nlohmann::json child_document(const std::string& output);

}  // namespace moe::bench
