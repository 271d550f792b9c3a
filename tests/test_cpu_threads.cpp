// Threads per rank from the CPUs the ranks really have (runtime/cpu_threads.h): the pure planner on
// made-up masks, and this process's own mask against sched_getaffinity as taskset sets it.
#include <sched.h>

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "runtime/cpu_threads.h"
#include "util/shell.h"

namespace {

using moe::runtime::plan_threads;
using moe::runtime::RankCpus;
using moe::runtime::ThreadPlan;
using moe::runtime::ThreadRequest;

RankCpus cpus(uint64_t machine, std::vector<int> list) {
  RankCpus r;
  r.machine = machine;
  for (int c : list) r.mask[c / 64] |= uint64_t{1} << (c % 64);
  return r;
}

TEST(CpuThreads, RanksSharingOneMaskSplitIt) {
  // mpirun --bind-to none on one 2-CPU machine: both ranks see CPUs 0-1.
  std::vector<RankCpus> all{cpus(7, {0, 1}), cpus(7, {0, 1})};
  ThreadPlan p = plan_threads({}, all, 1);
  EXPECT_EQ(p.cpus, 2);
  EXPECT_EQ(p.sharing, 2);
  EXPECT_EQ(p.threads, 1);
  EXPECT_FALSE(p.oversubscribed());
  EXPECT_EQ(p.describe(), "1 per rank (2 CPUs in this rank's set, 2 ranks share them)");
}

TEST(CpuThreads, DisjointMasksEachUseTheirOwn) {
  // --bind-to socket on two 4-CPU sockets, or two emulated hosts with their own cpusets.
  std::vector<RankCpus> all{cpus(7, {0, 1, 2, 3}), cpus(7, {4, 5, 6, 7})};
  EXPECT_EQ(plan_threads({}, all, 0).threads, 4);
  EXPECT_EQ(plan_threads({}, all, 1).sharing, 1);
}

TEST(CpuThreads, OtherMachinesNeverShare) {
  // Two real hosts: the same CPU numbers on different machines.
  std::vector<RankCpus> all{cpus(1, {0, 1}), cpus(2, {0, 1}), cpus(2, {0, 1})};
  EXPECT_EQ(plan_threads({}, all, 0).threads, 2);
  EXPECT_EQ(plan_threads({}, all, 0).sharing, 1);
  EXPECT_EQ(plan_threads({}, all, 2).threads, 1);
  EXPECT_EQ(plan_threads({}, all, 2).sharing, 2);
}

TEST(CpuThreads, CorePoolsGroupTheRanksThatShareCores) {
  using moe::runtime::core_pools;
  // 4 ranks of one thread on a 2-CPU machine (mpirun --oversubscribe): one pool running 2 at once.
  moe::plan::CorePools p = core_pools(std::vector<RankCpus>(4, cpus(3, {0, 1})), {1, 1, 1, 1});
  EXPECT_EQ(p.pool_of_rank, (std::vector<int>{0, 0, 0, 0}));
  EXPECT_EQ(p.ranks_at_once, (std::vector<double>{2}));
  // 2 emulated hosts of one CPU each, 2 ranks a host.
  p = core_pools({cpus(3, {0}), cpus(3, {0}), cpus(3, {1}), cpus(3, {1})}, {1, 1, 1, 1});
  EXPECT_EQ(p.pool_of_rank, (std::vector<int>{0, 0, 1, 1}));
  EXPECT_EQ(p.ranks_at_once, (std::vector<double>{1, 1}));
  // Masks that overlap through a third rank's join one pool: 4 CPUs for ranks of 2 threads.
  p = core_pools({cpus(3, {0, 1}), cpus(3, {1, 2}), cpus(3, {2, 3})}, {2, 2, 2});
  EXPECT_EQ(p.pool_of_rank, (std::vector<int>{0, 0, 0}));
  EXPECT_EQ(p.ranks_at_once, (std::vector<double>{2}));
  // A CPU for every thread, or other machines: nothing shared.
  EXPECT_TRUE(core_pools({cpus(3, {0}), cpus(3, {1})}, {1, 1}).empty());
  EXPECT_TRUE(core_pools({cpus(1, {0}), cpus(2, {0})}, {1, 1}).empty());
  EXPECT_TRUE(core_pools(std::vector<RankCpus>(2, cpus(3, {0, 1})), {1, 1}).empty());
  EXPECT_THROW(core_pools({cpus(3, {0})}, {0}), std::logic_error);
}

TEST(CpuThreads, MoreRanksThanCpusGetOneThreadEach) {
  std::vector<RankCpus> all(4, cpus(3, {0, 1}));
  ThreadPlan p = plan_threads({}, all, 3);
  EXPECT_EQ(p.threads, 1);
  EXPECT_FALSE(p.oversubscribed());  // one thread cannot wait on a sibling
}

TEST(CpuThreads, AskedThreadsAreKeptAndOversubscriptionSaid) {
  std::vector<RankCpus> all{cpus(7, {0, 1}), cpus(7, {0, 1})};
  ThreadPlan p = plan_threads(ThreadRequest{2, "--threads"}, all, 0);
  EXPECT_EQ(p.threads, 2);
  EXPECT_TRUE(p.oversubscribed());
  EXPECT_EQ(p.describe(),
            "2 per rank (--threads; 2 CPUs in this rank's set, 2 ranks share them; oversubscribed: 4 threads on 2 CPUs)");
  EXPECT_FALSE(plan_threads(ThreadRequest{1, "--threads"}, all, 0).oversubscribed());
  EXPECT_THROW(plan_threads({}, all, 2), std::logic_error);
}

// This process's mask is what sched_getaffinity says, and a narrower one set by taskset is seen.
TEST(CpuThreads, ThisProcessReadsItsAffinityMask) {
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof set, &set), 0);
  EXPECT_EQ(moe::runtime::this_process_cpus().count(), CPU_COUNT(&set));
  // A run of `moe train` under taskset -c 0 reports one CPU.
  moe::ShellResult r = moe::run_shell(
      std::string("env -u OMP_NUM_THREADS taskset -c 0 ") + MOE_BIN + " train --data " MOE_TEST_DIR "/../docs/model.md --seq-len 16 "
      "--d-model 16 --layers 1 --heads 2 --d-ffn 32 --experts 4 --top-k 2 --batch-size 4 --steps 1 --eval-batches 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("threads: 1 per rank (1 CPU in this rank's set)"), std::string::npos) << r.output;
}

}  // namespace
