// `moe train` end to end through the real binary: bad input gets one clear message and a non-zero
// exit with nothing written; a tiny run trains; resume gives exactly the run that never stopped.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tensor/ops.h"
#include "util/shell.h"

namespace fs = std::filesystem;

namespace {

using Result = moe::ShellResult;

Result run_moe(const std::string& args) { return moe::run_shell(std::string(MOE_BIN) + " " + args); }

std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

void write_file(const fs::path& p, const std::string& text) { std::ofstream(p, std::ios::binary) << text; }

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("moe_cli_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    // A small real-text corpus: a few KB of English from this repository's own docs.
    std::string text = read_file(fs::path(MOE_TEST_DIR) / ".." / "docs" / "model.md");
    write_file(dir_ / "corpus.txt", text + text);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Flags for a model small enough to train a few steps in well under a second.
  std::string tiny() const {
    return "--data " + (dir_ / "corpus.txt").string() +
           " --seq-len 16 --d-model 16 --layers 2 --heads 2 --d-ffn 32 --experts 4 --top-k 2 --batch-size 4 "
           "--log-every 1 --eval-batches 2 --threads 1 ";
  }
  // The run must fail with exit != 0, print `needle`, and create no metrics file.
  void expect_rejected(const std::string& args, const std::string& needle) {
    fs::path metrics = dir_ / "m.jsonl";
    Result r = run_moe("train " + args + " --metrics " + metrics.string());
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(needle), std::string::npos) << "expected '" << needle << "' in:\n" << r.output;
    EXPECT_FALSE(fs::exists(metrics)) << "a rejected run wrote " << metrics;
    EXPECT_EQ(r.output.find("step "), std::string::npos) << "training started:\n" << r.output;
  }

  fs::path dir_;
};

TEST_F(CliTest, MalformedConfigFile) {
  write_file(dir_ / "bad.json", "{\"steps\": 10,");
  expect_rejected(tiny() + "--config " + (dir_ / "bad.json").string(), "not valid JSON");
}

TEST_F(CliTest, UnknownConfigKey) {
  write_file(dir_ / "c.json", R"({"stpes": 10})");
  expect_rejected(tiny() + "--config " + (dir_ / "c.json").string(), "unknown key 'stpes'");
}

TEST_F(CliTest, WrongTypeInConfig) {
  write_file(dir_ / "c.json", R"({"model": {"n_experts": "eight"}})");
  expect_rejected(tiny() + "--config " + (dir_ / "c.json").string(), "n_experts");
}

TEST_F(CliTest, ContradictoryConfig) {
  expect_rejected(tiny() + "--experts 2 --top-k 3", "top_k");
  expect_rejected(tiny() + "--d-model 30 --heads 4", "n_heads");
  expect_rejected(tiny() + "--shared-cores some", "shared_cores 'some' is not one of measured, none");
}

// bf16 is the GPU model's mixed precision; the CPU model is f32 only. Asked for on the CPU (by the
// flag, with the default device or an explicit one, or by the JSON config) it is one line naming
// the dtype and the device, and exit 2 like every config error; nothing trains.
TEST_F(CliTest, Bf16OnTheCpuRejected) {
  Result r = run_moe("train " + tiny() + "--steps 2 --dtype bf16 --device cpu");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(r.output, "moe train: config: dtype bf16 needs device cuda (device cpu computes and stores in f32 only)\n");
  expect_rejected(tiny() + "--dtype bf16", "dtype bf16 needs device cuda");
  write_file(dir_ / "c.json", R"({"dtype": "bf16"})");
  expect_rejected(tiny() + "--config " + (dir_ / "c.json").string(), "dtype bf16 needs device cuda");
  expect_rejected(tiny() + "--dtype fp16 --device cuda", "dtype 'fp16' is not one of f32, bf16");
}

// One exit status for every bad flag: 2, as a bad configuration (a failure while running exits 1),
// whether CLI11 or the command found it; --help exits 0.
TEST_F(CliTest, EveryBadFlagExits2) {
  for (const std::string args :
       {"train --nosuchflag", "train --steps -1", "bench nosuch", "report --nosuch", "generate", "serve --nosuch",
        "sim --cluster nowhere", "sim --cluster p4d.24xlarge --steps 0", "cluster nosuch", "cluster up --bogus",
        "bench serve --schedules lina", "bench serve --schedules ep,nosuch", "bench serve --only nosuch",
        "bench decode --schedules ep", "bench decode --in-flight 4", "bench serve-replay --only nosuch",
        "nosuchcommand"}) {
    const Result r = run_moe(args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    EXPECT_FALSE(r.output.empty()) << args << ": no message";
  }
  EXPECT_EQ(run_moe("train --help").exit_code, 0);
}

TEST_F(CliTest, MissingConfigFile) { expect_rejected(tiny() + "--config /nonexistent/c.json", "cannot open"); }

TEST_F(CliTest, MissingData) { expect_rejected(tiny() + "--data /nonexistent/corpus", "/nonexistent/corpus"); }

TEST_F(CliTest, EmptyData) {
  fs::create_directories(dir_ / "empty");
  expect_rejected(tiny() + "--data " + (dir_ / "empty").string(), "empty");
}

TEST_F(CliTest, MissingResumeCheckpoint) { expect_rejected(tiny() + "--resume " + (dir_ / "nope").string(), "nope"); }

TEST_F(CliTest, TrainsAndWritesMetrics) {
  fs::path metrics = dir_ / "m.jsonl";
  Result r = run_moe("train " + tiny() + "--steps 6 --metrics " + metrics.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("step     6/6"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("unigram byte entropy"), std::string::npos) << r.output;
  std::string m = read_file(metrics);
  int lines = 0;
  for (char c : m) lines += c == '\n';
  EXPECT_EQ(lines, 7) << m;  // 6 steps + the final validation
  EXPECT_NE(m.find("\"tokens_per_expert\""), std::string::npos);
}

// N steps in one go versus N/2, stop, resume, N/2: the final weights and optimizer state are
// bit-identical (same kernels, same thread count, data position = step).
TEST_F(CliTest, ResumeIsExact) {
  // The uninterrupted and the interrupted run are separate processes: pin one GEMM kernel for both
  // (each process otherwise picks by timing, and oneDNN and OpenBLAS round differently). The
  // resumed run itself takes the kernel from the checkpoint.
  ::setenv("MOE_GEMM", "onednn", 1);
  // A router skew whose order turns at step 4, where the run resumes: the resumed steps route by the
  // global step, as the uninterrupted run does.
  std::string common = tiny() + "--steps 8 --warmup-steps 2 --router-skew 1 --router-skew-drift 0.25 ";
  Result full = run_moe("train " + common + "--checkpoint-dir " + (dir_ / "full").string());
  ASSERT_EQ(full.exit_code, 0) << full.output;
  // Stop at step 4 of the same 8-step schedule (as a preempted job would), then resume to 8.
  Result stop = run_moe("train " + common + "--stop-at-step 4 --checkpoint-dir " + (dir_ / "part").string());
  ASSERT_EQ(stop.exit_code, 0) << stop.output;
  EXPECT_EQ(stop.output.find("step     5/8"), std::string::npos) << stop.output;
  Result resumed = run_moe("train " + common + "--resume " + (dir_ / "part").string() + " --checkpoint-dir " +
                           (dir_ / "resumed").string());
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resume:"), std::string::npos) << resumed.output;
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
    std::string a = read_file(dir_ / "full" / f), b = read_file(dir_ / "resumed" / f);
    ASSERT_FALSE(a.empty()) << f;
    EXPECT_TRUE(a == b) << f << " differs between the uninterrupted and the resumed run";
  }
  ::unsetenv("MOE_GEMM");
}

// Without MOE_GEMM, a resumed run adopts the checkpoint's GEMM kernel instead of measuring.
TEST_F(CliTest, ResumeUsesTheCheckpointsGemmKernel) {
  ::setenv("MOE_GEMM", "openblas", 1);
  Result first = run_moe("train " + tiny() + "--steps 4 --stop-at-step 2 --checkpoint-dir " + (dir_ / "ck").string());
  ::unsetenv("MOE_GEMM");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  Result resumed = run_moe("train " + tiny() + "--steps 4 --resume " + (dir_ / "ck").string());
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("gemm: openblas/"), std::string::npos) << resumed.output;
  EXPECT_NE(resumed.output.find("(as in checkpoint"), std::string::npos) << resumed.output;
}

TEST_F(CliTest, UnknownGemmKernelRejected) { expect_rejected(tiny() + "--gemm cublas --steps 2", "gemm 'cublas'"); }

// --gemm names the kernel; a resumed run keeps its checkpoint's unless --gemm says otherwise.
TEST_F(CliTest, GemmFlagPinsTheKernelAndOverridesTheCheckpoints) {
  Result first = run_moe("train " + tiny() + "--steps 4 --stop-at-step 2 --gemm openblas --checkpoint-dir " +
                         (dir_ / "ck").string() + " --metrics " + (dir_ / "m.jsonl").string());
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const size_t at = first.output.find("gemm: openblas/");
  ASSERT_NE(at, std::string::npos) << first.output;
  EXPECT_NE(first.output.find("(--gemm openblas)", at), std::string::npos) << first.output;
  EXPECT_NE(read_file(dir_ / "m.jsonl").find("\"gemm\":\"openblas\""), std::string::npos);
  // The line names OpenBLAS's kernel; where OpenBLAS would fall back to an older one than this CPU
  // runs, moe re-ran itself with the kernel of the CPU's instruction set (tensor/ops.h).
  const size_t core_at = at + std::string("gemm: openblas/").size();
  const std::string core = first.output.substr(core_at, first.output.find(',', core_at) - core_at);
  std::printf("OpenBLAS kernel: %s\n", core.c_str());
  if (!std::getenv("OPENBLAS_CORETYPE")) {
    EXPECT_EQ(moe::openblas_core_for_this_cpu(core), "")
        << "OpenBLAS runs " << core << ", older than this CPU's instruction set";
  }
  // Its workers sleep right after a call (moe set OPENBLAS_THREAD_TIMEOUT), or as the user said.
  const char* timeout = std::getenv("OPENBLAS_THREAD_TIMEOUT");
  const std::string polls = std::string(", workers poll 2^") + (timeout ? timeout : "4") + " cycles after a call (";
  EXPECT_EQ(first.output.find(polls, at), core_at + core.size()) << first.output;
  Result kept = run_moe("train " + tiny() + "--steps 4 --resume " + (dir_ / "ck").string());
  ASSERT_EQ(kept.exit_code, 0) << kept.output;
  EXPECT_NE(kept.output.find("gemm: openblas/"), std::string::npos) << kept.output;
  EXPECT_NE(kept.output.find("(as in checkpoint"), std::string::npos) << kept.output;
  Result told = run_moe("train " + tiny() + "--steps 4 --gemm onednn --resume " + (dir_ / "ck").string());
  ASSERT_EQ(told.exit_code, 0) << told.output;
  EXPECT_NE(told.output.find("gemm: onednn (--gemm onednn)"), std::string::npos) << told.output;
}

TEST_F(CliTest, CorruptedCheckpointRejected) {
  Result r = run_moe("train " + tiny() + "--steps 2 --checkpoint-dir " + (dir_ / "ck").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::string bytes = read_file(dir_ / "ck" / "model.safetensors");
  bytes[bytes.size() - 3] ^= 0x5a;
  write_file(dir_ / "ck" / "model.safetensors", bytes);
  expect_rejected(tiny() + "--steps 4 --resume " + (dir_ / "ck").string(), "checksum");
}

TEST_F(CliTest, TruncatedCheckpointRejected) {
  Result r = run_moe("train " + tiny() + "--steps 2 --checkpoint-dir " + (dir_ / "ck").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::string bytes = read_file(dir_ / "ck" / "model.safetensors");
  write_file(dir_ / "ck" / "model.safetensors", bytes.substr(0, bytes.size() / 2));
  expect_rejected(tiny() + "--steps 4 --resume " + (dir_ / "ck").string(), "model.safetensors");
}

TEST_F(CliTest, CheckpointOfAnotherShapeRejected) {
  Result r = run_moe("train " + tiny() + "--steps 2 --checkpoint-dir " + (dir_ / "ck").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_rejected(tiny() + "--experts 8 --steps 4 --resume " + (dir_ / "ck").string(), "blocks.0.moe");
}

// A checkpoint that cannot be written (here: past a 20 KiB file-size limit, as a full disk would stop
// it) gives one error naming the file and why, leaves no staging folder, and keeps the previous
// checkpoint loadable; with --on-checkpoint-error continue the run goes on and says so.
TEST_F(CliTest, AFailedCheckpointWriteKeepsThePreviousOne) {
  const fs::path ck = dir_ / "ck";
  const std::string args = tiny() + "--steps 4 --checkpoint-dir " + ck.string();
  Result first = run_moe("train " + args + " --stop-at-step 2");
  ASSERT_EQ(first.exit_code, 0) << first.output;
#if defined(__SANITIZE_THREAD__)
  // ThreadSanitizer's runtime writes a 512 KiB file in $TMPDIR at start-up and maps it over the shadow
  // of read-only data; the limit cuts it to 20 KiB and the first read of that shadow is a SIGBUS. With
  // no usable $TMPDIR it skips that mapping (moe itself does not use $TMPDIR).
  const std::string tmpdir = "TMPDIR=/nonexistent-moe-tmpdir ";
#else
  const std::string tmpdir;
#endif
  const std::string limited = "bash -c 'ulimit -f 20; " + tmpdir + std::string(MOE_BIN) + " train " + args +
                              " --resume " + ck.string();
  Result stop = moe::run_shell(limited + "'");
  EXPECT_NE(stop.exit_code, 0) << stop.output;
  EXPECT_NE(stop.output.find("File too large"), std::string::npos) << stop.output;
  EXPECT_NE(stop.output.find("the previous checkpoint in " + ck.string() + ", if any, is kept as it was"),
            std::string::npos)
      << stop.output;
  for (const auto& e : fs::directory_iterator(dir_))
    EXPECT_EQ(e.path().filename().string().find("ck.tmp"), std::string::npos) << "left behind: " << e.path();
  Result goes_on = moe::run_shell(limited + " --on-checkpoint-error continue'");
  EXPECT_EQ(goes_on.exit_code, 0) << goes_on.output;
  EXPECT_NE(goes_on.output.find("checkpoint: step 4 not written"), std::string::npos) << goes_on.output;
  EXPECT_NE(goes_on.output.find("training goes on"), std::string::npos) << goes_on.output;
  Result resumed = run_moe("train " + args + " --resume " + ck.string());  // step 2's checkpoint, intact
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("step     4/4"), std::string::npos) << resumed.output;
}

// A rebuild while `moe` runs (a bench, a server) replaces the file: /proc/self/exe then reads
// "PATH (deleted)", which the commands moe builds from it passed to /bin/sh as two words and a
// parenthesis ("Syntax error: "(" unexpected"). self_exe gives the path of the new file.
TEST(SelfExe, NamesTheNewFileWhereTheRunningOneWasReplaced) {
  bool replaced = true;
  EXPECT_EQ(moe::executable_path("/opt/moe/build/moe", &replaced), "/opt/moe/build/moe");
  EXPECT_FALSE(replaced);
  EXPECT_EQ(moe::executable_path("/opt/moe/build/moe (deleted)", &replaced), "/opt/moe/build/moe");
  EXPECT_TRUE(replaced);
  EXPECT_EQ(moe::executable_path(" (deleted)", &replaced), " (deleted)");  // a name, not a suffix
  EXPECT_FALSE(replaced);
  const std::string me = moe::self_exe("");
  EXPECT_TRUE(std::filesystem::exists(me)) << me;
}

// Every benchmark prints through bench/report.h: one header block, tables whose columns carry units,
// notes; --json the same as one document. `moe bench sim` is the quickest to run.
TEST(BenchReport, OneFormatInTextAndJson) {
  const Result text = moe::run_shell(std::string(MOE_BIN) + " bench sim --repeats 1 2>/dev/null");
  ASSERT_EQ(text.exit_code, 0) << text.output;
  for (const char* line : {"# moe bench sim: ", "\n# machine  ", "\n# run      ", " thread(s), ", "\n## one simulated step",
                           "step (ms)", "wall (ms)", "# goal (the project's, not measured here)"})
    EXPECT_NE(text.output.find(line), std::string::npos) << line << "\n" << text.output;
  const Result json = moe::run_shell(std::string(MOE_BIN) + " bench sim --repeats 1 --json 2>/dev/null");
  ASSERT_EQ(json.exit_code, 0) << json.output;
  const nlohmann::json doc = nlohmann::json::parse(json.output, nullptr, false);
  ASSERT_FALSE(doc.is_discarded()) << "not one JSON document:\n" << json.output;
  EXPECT_EQ(doc["bench"], "sim");
  EXPECT_FALSE(doc["machine"]["cpu"].get<std::string>().empty());
  EXPECT_GE(doc["machine"]["cpus"].get<int>(), 1);
  EXPECT_EQ(doc["run"]["repeats"], 1);
  EXPECT_EQ(doc["exit_code"], 0);
  ASSERT_EQ(doc["tables"].size(), 1u);
  const nlohmann::json& t = doc["tables"][0];
  ASSERT_EQ(t["rows"].size(), 5u);  // 32, 32 aggregated, 256, 1024, 4096 GPUs
  EXPECT_EQ(t["columns"][5]["name"], "step");
  EXPECT_EQ(t["columns"][5]["unit"], "ms");
  for (const nlohmann::json& row : t["rows"]) {
    ASSERT_EQ(row.size(), t["columns"].size());
    EXPECT_GT(row[5].get<double>(), 0) << "the simulated step";
    EXPECT_GT(row[6].get<double>(), 0) << "the measured wall time";
  }
  bool goal_labelled = false;
  for (const nlohmann::json& n : doc["notes"]) goal_labelled |= n.get<std::string>().find("not measured") != std::string::npos;
  EXPECT_TRUE(goal_labelled) << "the goal is a labelled note, not a column";
}

}  // namespace
