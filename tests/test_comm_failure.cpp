// Failure behaviour of a job (issue 3, invariant 3): a rank that stops or dies makes the others
// stop with an error naming it, within a bounded time; nothing hangs. Each test runs a child job,
// `mpirun -n N <this executable>` with MOE_COMM_HELPER=<case> (the helper tests at the bottom, which
// skip themselves otherwise), under a wall-clock bound, and checks its exit status and output.
// This executable itself runs as one process (no mpirun-ranks line).
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "comm/mpi_communicator.h"
#include "util/shell.h"

namespace moe::comm {
namespace {

const char* helper_case() { return std::getenv("MOE_COMM_HELPER"); }

struct JobResult {
  int exit_code = -1;  // -1: did not exit normally
  double seconds = 0;
  std::string output;  // stdout and stderr of mpirun and every rank
};

// Runs `mpirun -n ranks <this executable>` in helper mode `which`, stopped after bound_s seconds
// (exit code 124 then).
JobResult run_job(const std::string& which, int ranks, int bound_s) {
  std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  std::string cmd = std::string(moe::kMpirunEnv) + "MOE_COMM_HELPER=" + which +
                    " timeout -k 5 " + std::to_string(bound_s) + " " + MOE_MPIEXEC + " -n " + std::to_string(ranks) +
                    " " + self + " --gtest_filter=CommFailureHelper.Run --gtest_color=no 2>&1";
  JobResult r;
  auto t0 = std::chrono::steady_clock::now();
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, p)) r.output += buf;
  int status = pclose(p);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  return r;
}

TEST(CommFailure, RankThatSkipsACollectiveMakesThePeerAbortTheJobNamingOpAndRank) {
  if (helper_case()) GTEST_SKIP();
  // Rank 1 never calls the allreduce; rank 0 gives up after its 2 s timeout and aborts the job.
  JobResult r = run_job("skip", 2, 60);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.exit_code, 124) << "the wall-clock bound stopped the job: it hung\n" << r.output;
  EXPECT_GE(r.seconds, 1.9);
  EXPECT_LT(r.seconds, 20.0) << r.output;
  EXPECT_NE(r.output.find("moe: rank 0: allreduce on group 'world' did not complete within 2 s (waiting for rank 1; "
                          "a peer rank died or stopped?)"),
            std::string::npos)
      << r.output;
}

TEST(CommFailure, KilledRankMakesTheOthersExitNonZeroNamingIt) {
  if (helper_case()) GTEST_SKIP();
  // Rank 1 of 4 dies by SIGKILL in step 3 of a loop of allreduce + alltoallv steps.
  JobResult r = run_job("kill", 4, 60);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.exit_code, 124) << "the wall-clock bound stopped the job: it hung\n" << r.output;
  EXPECT_LT(r.seconds, 20.0) << r.output;  // the ranks' own timeout is 5 s; mpirun is usually faster
  bool named = r.output.find("process rank 1 with PID") != std::string::npos ||  // mpirun's report
               r.output.find("waiting for rank 1") != std::string::npos;        // a survivor's timeout
  EXPECT_TRUE(named) << r.output;
  EXPECT_EQ(r.output.find("step 9 done"), std::string::npos) << r.output;
}

// ---- the child job's ranks ----

void helper_skip(Communicator& world) {
  world.set_timeout(std::chrono::seconds(2));
  if (world.rank() == 1) {
    std::this_thread::sleep_for(std::chrono::seconds(30));  // stopped: ended by rank 0's abort
    return;
  }
  float x[4] = {1, 2, 3, 4};
  Status st = world.allreduce(x, 4);
  if (st) std::printf("rank 0: the allreduce completed without rank 1\n");
  abort_job(st);
}

void helper_kill(Communicator& world) {
  world.set_timeout(std::chrono::seconds(5));
  const int P = world.size(), r = world.rank();
  const int64_t n = 1 << 16;
  std::vector<float> grads(n, 1.0f), send(n * P, 1.0f), recv(n * P);
  std::vector<int64_t> counts(P, n), displs(P);
  for (int p = 0; p < P; ++p) displs[p] = p * n;
  for (int step = 0; step < 10; ++step) {
    if (step == 3 && r == 1) std::raise(SIGKILL);  // dies mid-step
    Status st = world.alltoallv(send.data(), counts, displs, recv.data(), counts, displs);
    if (st) st = world.allreduce(grads.data(), n);
    if (!st) abort_job(st);
    if (r == 0) std::printf("step %d done\n", step), std::fflush(stdout);
  }
}

TEST(CommFailureHelper, Run) {
  const char* which = helper_case();
  if (!which) GTEST_SKIP() << "runs only as a rank of the jobs the CommFailure tests start";
  std::unique_ptr<MpiSession> session;
  Status st = MpiSession::start(&session);
  if (!st) abort_job(st);
  std::unique_ptr<Communicator> world;
  st = session->world(&world);
  if (!st) abort_job(st);
  if (std::string(which) == "skip") helper_skip(*world);
  if (std::string(which) == "kill") helper_kill(*world);
}

}  // namespace
}  // namespace moe::comm
