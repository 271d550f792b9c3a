// `moe report` through the real binary, from a short real 2-rank Hecate run (metrics, trace) and the
// simulator's prediction of it: the page parses as XML and has one chart per item of the report; a
// malformed or cut-off metrics file is one error naming the line and writes nothing; a run with fewer
// fields draws what it has and says what is missing; headless Chromium renders the page without
// script errors into a screenshot that is not blank. The page checks are tests/report_check.py
// (Debian's python3, standard library only).
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "util/shell.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}
void write_file(const fs::path& p, const std::string& text) { std::ofstream(p, std::ios::binary) << text; }

moe::ShellResult run_moe(const std::string& args) { return moe::run_shell(std::string(MOE_BIN) + " " + args); }

// tests/report_check.py's JSON answer about a page or a screenshot.
json check(const std::string& what, const fs::path& file) {
  const moe::ShellResult r =
      moe::run_shell("/usr/bin/python3 " + std::string(MOE_TEST_DIR) + "/report_check.py " + what + " " + file.string());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return json::parse(r.output, nullptr, false);
}

std::map<std::string, int> count(const json& list) {
  std::map<std::string, int> n;
  if (list.is_array())
    for (const json& k : list) ++n[k.get<std::string>()];
  return n;
}

// One real run shared by every test of this file (a few seconds): 2 ranks, Hecate (so replicas and
// sparse bytes are not all zero), a tiny model with 2 MoE layers, validation every 4 steps, traced.
class ReportTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("moe_report_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    const std::string text = read_file(fs::path(MOE_TEST_DIR) / ".." / "docs" / "model.md");
    write_file(dir_ / "corpus.txt", text + text);
    const std::string model = "--seq-len 16 --d-model 16 --layers 2 --heads 2 --d-ffn 32 --experts 4 --top-k 2 ";
    train_ = run_moe("train --ranks 2 --strategy hecate --data " + (dir_ / "corpus.txt").string() + " " + model +
                     "--batch-size 4 --log-every 4 --eval-batches 2 --threads 1 --steps 12 --eval-every 4 --metrics " +
                     (dir_ / "run.jsonl").string() + " --trace " + (dir_ / "trace.json").string() + " --trace-steps 3");
    write_file(dir_ / "model.json",
               R"({"n_layers": 2, "d_model": 16, "n_heads": 2, "d_ffn": 32, "n_experts": 4, "top_k": 2, "seq_len": 16})");
    sim_ = run_moe("sim --cluster p3dn.24xlarge --ranks 2 --model " + (dir_ / "model.json").string() + " --load " +
                   (dir_ / "run.jsonl").string() + " --strategy hecate --steps 12 --batch 4 --metrics " +
                   (dir_ / "sim.jsonl").string());
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }
  void SetUp() override {
    ASSERT_EQ(train_.exit_code, 0) << train_.output;
    ASSERT_EQ(sim_.exit_code, 0) << sim_.output;
  }

  // The run's metrics lines, each passed through `edit` (return false to drop the line).
  static std::vector<json> lines() {
    std::vector<json> out;
    std::istringstream in(read_file(dir_ / "run.jsonl"));
    for (std::string line; std::getline(in, line);) out.push_back(json::parse(line));
    return out;
  }
  static std::string jsonl(const std::vector<json>& v) {
    std::string s;
    for (const json& j : v) s += j.dump() + "\n";
    return s;
  }
  // The full page of the real run, written to `out`.
  static moe::ShellResult full_report(const fs::path& out) {
    return run_moe("report " + (dir_ / "run.jsonl").string() + " --trace " + (dir_ / "trace.json").string() +
                   " --sim " + (dir_ / "sim.jsonl").string() + " --out " + out.string());
  }

  static fs::path dir_;
  static moe::ShellResult train_, sim_;
};
fs::path ReportTest::dir_;
moe::ShellResult ReportTest::train_, ReportTest::sim_;

TEST_F(ReportTest, OneChartPerItemAndWellFormed) {
  const fs::path out = dir_ / "report.html";
  const moe::ShellResult r = full_report(out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const json page = check("charts", out);
  ASSERT_TRUE(page.is_object()) << "report_check.py could not parse " << out;
  const std::map<std::string, int> charts = count(page["charts"]);
  // One of each item of the issue; the heatmaps once per MoE layer (2 here).
  const std::map<std::string, int> want{{"loss", 1},           {"throughput", 1},    {"step-time", 1},
                                        {"expert-heatmap", 2}, {"rank-heatmap", 2},  {"rank-imbalance", 1},
                                        {"dropped", 1},        {"replicas", 1},      {"experts-moved", 1},
                                        {"sparse-bytes", 1},   {"sim-vs-measured", 1}, {"timeline", 1}};
  EXPECT_EQ(charts, want) << page.dump();
  EXPECT_TRUE(page["missing"].empty()) << page.dump();
  EXPECT_EQ(page["duplicate_ids"], 0);
  EXPECT_EQ(page["scripts"], 0);
  EXPECT_GE(page["svgs"].get<int>(), 14);
  const std::string html = read_file(out);
  // Self-contained: nothing fetched (the only URLs are XML namespaces), the heatmaps inline.
  EXPECT_EQ(html.find("src=\"http"), std::string::npos);
  EXPECT_EQ(html.find("href=\"http"), std::string::npos);
  EXPECT_NE(html.find("href=\"data:image/png;base64,"), std::string::npos);
  // Axis labels carry units, the loss chart the unigram entropy line, and a legend names the run.
  for (const char* label : {"loss (nats)", "tokens/s", "time per step (ms)", "tokens per step", "unigram entropy",
                            "sparse collectives (MB per step)", "run train", "predicted (sim)"})
    EXPECT_NE(html.find(label), std::string::npos) << label;
}

TEST_F(ReportTest, SeveralRunsCompareOnOnePage) {
  fs::copy_file(dir_ / "run.jsonl", dir_ / "second.jsonl", fs::copy_options::overwrite_existing);
  const fs::path out = dir_ / "two.html";
  const moe::ShellResult r = run_moe("report " + (dir_ / "run.jsonl").string() + " " + (dir_ / "second.jsonl").string() +
                                     " --out " + out.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::map<std::string, int> charts = count(check("charts", out)["charts"]);
  EXPECT_EQ(charts.at("loss"), 1);          // both runs on one chart
  EXPECT_EQ(charts.at("step-time"), 2);     // one stack per run
  EXPECT_EQ(charts.at("expert-heatmap"), 4);  // per run and layer
  EXPECT_EQ(charts.count("timeline"), 0u);  // no trace given
  const std::string html = read_file(out);
  EXPECT_NE(html.find(">second train<"), std::string::npos);
}

TEST_F(ReportTest, MalformedLineIsOneErrorNamingItAndWritesNothing) {
  std::vector<json> v = lines();
  ASSERT_GE(v.size(), 5u);
  const fs::path out = dir_ / "bad.html";
  write_file(out, "the previous page");
  // Line 3 is not JSON.
  std::string text = v[0].dump() + "\n" + v[1].dump() + "\n{\"step\": 3, \"loss\": oops}\n" + jsonl({v.begin() + 3, v.end()});
  write_file(dir_ / "bad.jsonl", text);
  moe::ShellResult r = run_moe("report " + (dir_ / "bad.jsonl").string() + " --out " + out.string());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("moe report: " + (dir_ / "bad.jsonl").string() + ":3: not valid JSON"), std::string::npos)
      << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << "one line of error:\n" << r.output;
  EXPECT_EQ(read_file(out), "the previous page");
  // A field of the wrong type on line 2.
  v[1]["tokens_per_rank"] = "many";
  write_file(dir_ / "bad.jsonl", jsonl(v));
  r = run_moe("report " + (dir_ / "bad.jsonl").string() + " --out " + out.string());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("bad.jsonl:2: field 'tokens_per_rank' is string"), std::string::npos) << r.output;
  EXPECT_EQ(read_file(out), "the previous page");
}

TEST_F(ReportTest, TruncatedFileNamesItsLastLine) {
  const std::string text = read_file(dir_ / "run.jsonl");
  const size_t n_lines = std::count(text.begin(), text.end(), '\n');
  // Cut in the middle of the last line, as a run killed while writing leaves it.
  const size_t last_start = text.rfind('\n', text.size() - 2) + 1;
  write_file(dir_ / "cut.jsonl", text.substr(0, last_start + (text.size() - last_start) / 2));
  const fs::path out = dir_ / "cut.html";
  const moe::ShellResult r = run_moe("report " + (dir_ / "cut.jsonl").string() + " --out " + out.string());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("cut.jsonl:" + std::to_string(n_lines) + ": the file ends in the middle of this line"),
            std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(out));
  // Not a metrics file at all.
  write_file(dir_ / "empty.jsonl", "");
  EXPECT_NE(run_moe("report " + (dir_ / "empty.jsonl").string() + " --out " + out.string()).output.find("no training step"),
            std::string::npos);
}

// An older run (or one process, or a GPU run) wrote fewer fields: the page draws what they allow and
// says what is missing.
TEST_F(ReportTest, OldRunDrawsWhatItHasAndSaysWhatIsMissing) {
  std::vector<json> v = lines();
  for (json& j : v)
    for (const char* gone : {"tokens_per_rank", "rank_imbalance", "compute_ms", "exposed_comm_ms", "comm_ms", "replicas",
                             "experts_moved", "sparse_bytes", "unigram_entropy"})
      j.erase(gone);
  write_file(dir_ / "old.jsonl", jsonl(v));
  const fs::path out = dir_ / "old.html";
  const moe::ShellResult r = run_moe("report " + (dir_ / "old.jsonl").string() + " --out " + out.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const json page = check("charts", out);
  const std::map<std::string, int> charts = count(page["charts"]), missing = count(page["missing"]);
  for (const char* drawn : {"loss", "throughput", "step-time", "expert-heatmap", "dropped"})
    EXPECT_EQ(charts.count(drawn), 1u) << drawn << " in " << page.dump();
  for (const char* left_out : {"rank-heatmap", "rank-imbalance", "replicas", "experts-moved", "sparse-bytes"}) {
    EXPECT_EQ(charts.count(left_out), 0u) << left_out;
    EXPECT_EQ(missing.count(left_out), 1u) << left_out << " in " << page.dump();
  }
  const std::string note = page["missing_note"];
  for (const char* field : {"tokens_per_rank", "compute_ms", "sparse_bytes", "unigram_entropy"})
    EXPECT_NE(note.find(field), std::string::npos) << field << " not in: " << note;
  EXPECT_EQ(note.find("tokens_per_expert"), std::string::npos) << note;
}

// The page in a real browser: Debian's chromium, headless. No console errors, and the screenshot has
// the charts' ink (a blank or unstyled page is nearly all white and has few colours).
TEST_F(ReportTest, RendersInHeadlessChromium) {
  if (moe::run_shell("command -v chromium").exit_code != 0)
    GTEST_SKIP() << "chromium is not installed (scripts/setup.sh --test installs it)";
  const fs::path out = dir_ / "browser.html", png = dir_ / "shot.png";
  ASSERT_EQ(full_report(out).exit_code, 0);
  const moe::ShellResult r = moe::run_shell(
      "timeout 120 chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --user-data-dir=" +
      (dir_ / "chromium").string() + " --enable-logging=stderr --v=0 --window-size=820,4000 --screenshot=" + png.string() +
      " file://" + out.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("Uncaught"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find(":CONSOLE"), std::string::npos) << r.output;
  ASSERT_TRUE(fs::exists(png)) << r.output;
  const json shot = check("png", png);
  EXPECT_EQ(shot["width"], 820);
  EXPECT_GT(shot["non_white"].get<double>(), 0.08) << shot.dump();
  EXPECT_GT(shot["colours"].get<int>(), 100) << shot.dump();
}

}  // namespace
