// Issue 7: an emulated cluster on one machine (scripts/cluster.sh, `moe cluster`): network
// namespaces as hosts, veth pairs through a bridge, tc-capped NICs, Open MPI launching ranks through
// its rsh path. Needs root and network namespaces; without them every test skips, saying why.
//
// One cluster for the suite ("mt<pid>": 2 hosts x 1 rank, NICs capped at 200 Mbit/s), removed at the
// end whatever happens (the last test checks that `down` leaves nothing; TearDownTestSuite downs it
// again, which is a no-op then). The alltoall timing runs this executable as the job's ranks
// (MOE_CLUSTER_HELPER=alltoall, the helper test at the bottom, which skips itself otherwise).
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <sched.h>

#include <gtest/gtest.h>
#include <mpi.h>

#include "progress_losses.h"
#include "comm/communicator.h"
#include "comm/mpi_communicator.h"
#include "util/shell.h"

namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;
using moe::run_shell;
using moe::ShellResult;

const char* helper_case() { return std::getenv("MOE_CLUSTER_HELPER"); }

const std::string& cluster_name() {
  static const std::string name = "mt" + std::to_string(::getpid() % 1000000);
  return name;
}

// `cluster.sh --name <ours> ARGS`, bounded in time.
std::string cl(const std::string& args, int bound_s = 60) {
  return "timeout -k 5 " + std::to_string(bound_s) + " bash " + std::string(MOE_TEST_DIR) +
         "/../scripts/cluster.sh --name " + cluster_name() + " " + args;
}

std::set<std::string> words(const std::string& s) {
  std::set<std::string> w;
  std::istringstream in(s);
  for (std::string x; in >> x;) w.insert(x);
  return w;
}

// Interface names of the machine's own namespace.
std::set<std::string> host_links() { return words(run_shell("ip -o link show | awk -F': ' '{print $2}'").output); }

std::string pids_in(const std::string& ns) { return run_shell("ip netns pids " + ns).output; }

// A process that runs (a killed one may stay a zombie until its new parent, init, reaps it: dead).
bool alive(const std::string& pid) {
  for (int i = 0; i < 20; ++i) {
    FILE* f = std::fopen(("/proc/" + pid + "/status").c_str(), "r");
    if (!f) return false;
    char line[256];
    bool zombie = false;
    while (std::fgets(line, sizeof line, f))
      if (std::string(line).rfind("State:", 0) == 0) zombie = std::string(line).find('Z') != std::string::npos;
    std::fclose(f);
    if (zombie) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return true;
}

std::string tiny_model() {
  return std::string(" --data ") + MOE_TEST_DIR + "/../docs/model.md --seq-len 16 --d-model 16 --layers 2 --heads 2 "
         "--d-ffn 32 --experts 4 --batch-size 8 --eval-batches 2 --threads 1 --lr 1e-2 --top-k 2 ";
}

class ClusterEmulation : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (helper_case()) return;
    if (::geteuid() != 0) {
      skip_ = "not root: the emulated cluster needs root (network namespaces, tc)";
      return;
    }
    ShellResult check = run_shell(cl("check"));
    if (check.exit_code != 0) {
      skip_ = "no emulated cluster on this machine: " + check.output;
      return;
    }
    // Clusters of earlier runs of this test that were killed before their TearDown (a ctest
    // timeout): named mt<pid>, their process gone.
    std::error_code ec;
    for (const auto& e : fs::directory_iterator("/run/moe-cluster", ec)) {
      std::string n = e.path().filename().string();
      if (std::regex_match(n, std::regex("mt[0-9]+")) && !fs::exists("/proc/" + n.substr(2)))
        run_shell("timeout -k 5 60 bash " + std::string(MOE_TEST_DIR) + "/../scripts/cluster.sh --name " + n + " down");
    }
    links_before_ = host_links();
    run_shell(cl("down"));  // ours from an earlier run with the same pid, if any
    ShellResult up = run_shell(cl("up --nodes 2 --ranks-per-node 1 --nic 200mbit"));
    up_ok_ = up.exit_code == 0;
    up_out_ = up.output;
  }
  static void TearDownTestSuite() {
    if (up_ok_) run_shell(cl("down"));
  }
  void SetUp() override {
    if (helper_case()) GTEST_SKIP() << "a helper run";
    if (!skip_.empty()) GTEST_SKIP() << skip_;
    ASSERT_TRUE(up_ok_) << "cluster up failed:\n" << up_out_;
  }

  // Runs `cluster.sh run -- moe train ... --comm-timeout T` and applies `fault` (a cluster.sh verb
  // with its node) once step 100 is logged. Returns the job's exit code, output, and the seconds
  // from the fault to the job's end.
  struct FaultRun {
    int rc = -1;
    std::string out;
    double after_fault_s = -1;
  };
  static FaultRun run_with_fault(const std::string& fault, int comm_timeout_s) {
    FaultRun f;
    std::string cmd = cl("run -- " + std::string(MOE_BIN) + " train" + tiny_model() +
                             "--steps 1000000 --log-every 50 --comm-timeout " + std::to_string(comm_timeout_s),
                         60) +
                      " 2>&1";
    FILE* p = popen(cmd.c_str(), "r");
    if (!p) return f;
    Clock::time_point fault_at{};
    bool faulted = false;
    char buf[4096];
    while (std::fgets(buf, sizeof buf, p)) {
      f.out += buf;
      if (!faulted && std::string(buf).rfind("step   100/", 0) == 0) {
        faulted = true;
        ShellResult r = run_shell(cl(fault));
        fault_at = Clock::now();
        f.out += "[test] cluster.sh " + fault + ": " + r.output;
      }
    }
    int st = pclose(p);
    f.rc = WIFEXITED(st) ? WEXITSTATUS(st) : 128;
    if (faulted) f.after_fault_s = std::chrono::duration<double>(Clock::now() - fault_at).count();
    return f;
  }

  // Waits up to bound_s for host n1 to run nothing (a cut host's daemon ends once it is healed).
  static bool n1_idle(int bound_s) {
    for (int i = 0; i < bound_s * 10; ++i) {
      if (pids_in(cluster_name() + "-n1").find_first_not_of(" \n") == std::string::npos) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return false;
  }

  static inline std::string skip_, up_out_;
  static inline bool up_ok_ = false;
  static inline std::set<std::string> links_before_;
};

// Invariant 1 across emulated hosts: Open MPI sees two hosts (the topology line, from
// MPI_COMM_TYPE_SHARED), the ranks talk over TCP, and the losses equal one process's.
TEST_F(ClusterEmulation, TrainingOnTwoHostsEqualsOneProcess) {
  const std::string args = tiny_model() + "--steps 6 --warmup-steps 2 --log-every 1";
  ShellResult ref = run_shell("timeout -k 5 120 " + std::string(MOE_BIN) + " train" + args);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  ShellResult two = run_shell(cl("run -- " + std::string(MOE_BIN) + " train" + args, 120));
  ASSERT_EQ(two.exit_code, 0) << two.output;
  EXPECT_NE(two.output.find("topology: 2 nodes x 1 rank"), std::string::npos) << two.output;
  EXPECT_NE(two.output.find("ranks: 2"), std::string::npos) << two.output;
  auto a = progress_losses(ref.output), b = progress_losses(two.output);
  ASSERT_EQ(a.size(), 6u) << ref.output;
  ASSERT_EQ(a.size(), b.size()) << two.output;
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]));
  std::printf("  2 emulated hosts x 1 rank vs 1 process: 6 steps, max |loss diff| %.2e (final %.4f vs %.4f)\n", worst,
              a.back(), b.back());
  // The tolerance of test_distributed.cpp: the same float sums in a different order.
  EXPECT_LT(worst, 2e-4);
}

// Every host ACKs at once on the fabric (its route to the subnet has quickack): at 10 Gbit/s delayed
// ACKs stalled transfers up to 40 ms (docs/cluster.md, "TCP between the hosts").
TEST_F(ClusterEmulation, HostsAckAtOnce) {
  for (const char* host : {"-n0", "-n1"}) {
    ShellResult route = run_shell("ip -n " + cluster_name() + host + " route show dev eth0");
    ASSERT_EQ(route.exit_code, 0) << route.output;
    EXPECT_NE(route.output.find("quickack 1"), std::string::npos) << host << ": " << route.output;
  }
}

// Each emulated host has its own CPUs when the machine has enough (one per host at least), as a real
// host has: status lists them, and moe train without --threads sizes its threads from them, where it
// once ran every host's ranks with the whole machine's cores.
TEST_F(ClusterEmulation, EachHostGetsItsOwnCpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof set, &set), 0);
  const int cpus = CPU_COUNT(&set);
  ShellResult status = run_shell(cl("status"));
  ASSERT_EQ(status.exit_code, 0) << status.output;
  std::string model = tiny_model();
  model.replace(model.find("--threads 1 "), 12, "");
  // No thread request at all (ctest sets OMP_NUM_THREADS for the tests themselves).
  ShellResult r =
      run_shell("env -u OMP_NUM_THREADS " + cl("run -- " + std::string(MOE_BIN) + " train" + model + "--steps 2", 120));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  if (cpus < 2) {
    EXPECT_NE(status.output.find("CPUs all (shared)"), std::string::npos) << status.output;
    EXPECT_NE(r.output.find("threads: 1 per rank (1 CPU in this rank's set, 2 ranks share them)"), std::string::npos)
        << r.output;
    return;
  }
  const int per = cpus / 2;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(status.output, m, std::regex(cluster_name() + "-n0: .*CPUs ([0-9,]+)")))
      << status.output;
  const std::string list = m[1].str();
  EXPECT_EQ(std::count(list.begin(), list.end(), ',') + 1, per) << status.output;
  const std::string want = "threads: " + std::to_string(per) + " per rank (" + std::to_string(per) +
                           (per == 1 ? " CPU" : " CPUs") + " in this rank's set)";
  EXPECT_NE(r.output.find(want), std::string::npos) << "expected '" << want << "' in:\n" << r.output;
}

// The capped link is the bottleneck, and only it: an alltoallv across the two hosts takes the time
// the 200 Mbit/s cap predicts, not less than 85% of it (shared memory between the namespaces would be
// ~10x faster) and not more than 135% (a cap twice too tight would be 2x). The upper side has room for
// the machine: alone the ratio reads 1.01-1.05, inside a full ctest on a 2-vCPU AMD EPYC once 1.18.
TEST_F(ClusterEmulation, AlltoallRunsAtTheCap) {
  std::string self = fs::read_symlink("/proc/self/exe").string();
  ShellResult r = run_shell("MOE_CLUSTER_HELPER=alltoall " +
                cl("run -- " + self + " --gtest_filter=ClusterEmulationHelper.Run --gtest_color=no", 120));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex(R"(alltoall: ([0-9.]+) MiB each way, median ([0-9.]+) s, cap predicts ([0-9.]+) s)")))
      << r.output;
  double measured = std::stod(m[2]), predicted = std::stod(m[3]);
  std::printf("  alltoallv, %s MiB each way at 200 Mbit/s: %.3f s measured, %.3f s predicted, ratio %.3f\n",
              m[1].str().c_str(), measured, predicted, measured / predicted);
  EXPECT_GT(measured / predicted, 0.85) << r.output;
  // Under ThreadSanitizer every copy Open MPI makes goes through TSan's memcpy, so the time also
  // measures TSan (1.152 seen on a loaded 2-core machine): only "not faster than the cap" holds.
#if !defined(__SANITIZE_THREAD__)
  EXPECT_LT(measured / predicted, 1.35) << r.output;
#endif
  // status counts each host's TCP segments since up: at least one pass of the exchange's bytes, in
  // segments of at most 1,448 bytes (MTU 1500 less the IP and TCP headers with timestamps).
  ShellResult status = run_shell(cl("status"));
  ASSERT_EQ(status.exit_code, 0) << status.output;
  const double min_segments = std::stod(m[1]) * 1048576.0 / 1448.0;
  for (const char* host : {"-n0", "-n1"}) {
    std::smatch t;
    const std::regex line(cluster_name() + host +
                          R"(: [^\n]*\n +tcp since up: ([0-9]+) segments sent, ([0-9]+) retransmitted)");
    ASSERT_TRUE(std::regex_search(status.output, t, line)) << status.output;
    EXPECT_GE(std::stod(t[1]), min_segments) << status.output;
    EXPECT_LE(std::stod(t[2]), std::stod(t[1])) << status.output;
  }
}

// A host whose link is cut mid-step: rank 0's collective times out naming rank 1, and the job ends
// non-zero soon after (mpirun gives up on the cut-off daemon after ~3 s: cluster.sh's tcp_retries2).
TEST_F(ClusterEmulation, CutLinkEndsTheJobNamingTheLostRank) {
  const int timeout_s = 3;
  FaultRun f = run_with_fault("cut n1", timeout_s);
  run_shell(cl("heal n1"));
  std::printf("  cut n1: exit %d, %.1f s after the cut (comm timeout %d s)\n", f.rc, f.after_fault_s, timeout_s);
  ASSERT_GE(f.after_fault_s, 0) << "the job never reached step 100:\n" << f.out;
  EXPECT_NE(f.rc, 0) << f.out;
  EXPECT_NE(f.rc, 124) << "the test's wall-clock bound stopped the job: it hung\n" << f.out;
  EXPECT_NE(f.out.find("did not complete within 3 s (waiting for rank 1"), std::string::npos) << f.out;
  EXPECT_LT(f.after_fault_s, timeout_s + 15.0) << f.out;
  EXPECT_TRUE(n1_idle(15)) << "processes left on n1 after heal: " << pids_in(cluster_name() + "-n1");
}

// A host whose processes are killed mid-step: the job ends non-zero, naming rank 1.
TEST_F(ClusterEmulation, KilledHostEndsTheJobNamingTheLostRank) {
  const int timeout_s = 3;
  FaultRun f = run_with_fault("kill n1", timeout_s);
  std::printf("  kill n1: exit %d, %.1f s after the kill (comm timeout %d s)\n", f.rc, f.after_fault_s, timeout_s);
  ASSERT_GE(f.after_fault_s, 0) << "the job never reached step 100:\n" << f.out;
  EXPECT_NE(f.rc, 0) << f.out;
  EXPECT_NE(f.rc, 124) << "the test's wall-clock bound stopped the job: it hung\n" << f.out;
  bool named = f.out.find("process rank 1 with PID") != std::string::npos ||  // mpirun's report
               f.out.find("waiting for rank 1") != std::string::npos;        // the survivor's timeout
  EXPECT_TRUE(named) << f.out;
  EXPECT_LT(f.after_fault_s, timeout_s + 15.0) << f.out;
  EXPECT_TRUE(n1_idle(5)) << pids_in(cluster_name() + "-n1");
}

// `up` refuses a name already taken by a namespace it did not make, and leaves that namespace alone.
TEST_F(ClusterEmulation, RefusesToTouchWhatItDidNotMake) {
  const std::string other = cluster_name() + "x";
  const std::string foreign = other + "-n0";
  ASSERT_EQ(run_shell("ip netns add " + foreign).exit_code, 0);
  const std::string script = "timeout -k 5 30 bash " + std::string(MOE_TEST_DIR) + "/../scripts/cluster.sh --name ";
  ShellResult up = run_shell(script + other + " up --nodes 2");
  ShellResult down = run_shell(script + other + " down");
  std::string list = run_shell("ip netns list").output;
  run_shell("ip netns delete " + foreign);
  EXPECT_NE(up.exit_code, 0) << up.output;
  EXPECT_NE(up.output.find("was not made by this cluster; refusing"), std::string::npos) << up.output;
  EXPECT_EQ(down.exit_code, 0) << down.output;
  EXPECT_NE(words(list).count(foreign), 0u) << "the foreign namespace was removed:\n" << list;
  EXPECT_EQ(words(list).count(other + "-head"), 0u) << list;
}

// Last: `down` removes every namespace, link, file and process the cluster made, and again is a no-op.
TEST_F(ClusterEmulation, DownLeavesNothing) {
  const std::string n = cluster_name();
  // Something running on each host, as a job would leave behind.
  for (const char* host : {"-n0", "-n1"})
    run_shell("ip netns exec " + n + host + " sh -c 'sleep 600 >/dev/null 2>&1 &'");
  std::string pids = pids_in(n + "-n0") + " " + pids_in(n + "-n1");
  EXPECT_EQ(words(pids).size(), 2u) << pids;
  ShellResult down = run_shell(cl("down"));
  ASSERT_EQ(down.exit_code, 0) << down.output;
  for (const std::string& pid : words(pids)) EXPECT_FALSE(alive(pid)) << "process " << pid << " survived";
  std::string list = run_shell("ip netns list").output;
  for (const char* ns : {"-head", "-n0", "-n1"}) {
    EXPECT_EQ(words(list).count(n + ns), 0u) << list;
    EXPECT_FALSE(fs::exists("/etc/netns/" + n + ns));
  }
  EXPECT_FALSE(fs::exists("/run/moe-cluster/" + n));
  EXPECT_EQ(host_links(), links_before_) << "the machine's own links changed";
  ShellResult again = run_shell(cl("down"));
  EXPECT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find("nothing to do"), std::string::npos) << again.output;
}

// ---- the alltoall job's ranks ----

TEST(ClusterEmulationHelper, Run) {
  const char* which = helper_case();
  if (!which) GTEST_SKIP() << "runs only as a rank of the job AlltoallRunsAtTheCap starts";
  using namespace moe;
  std::unique_ptr<comm::MpiSession> session;
  Status st = comm::MpiSession::start(&session);
  if (!st) comm::abort_job(st);
  std::unique_ptr<comm::Communicator> world;
  if (st = session->world(&world); !st) comm::abort_job(st);
  const int P = world->size(), r = world->rank();
  const double bps = std::atof(std::getenv("MOE_CLUSTER_NIC_BPS") ? std::getenv("MOE_CLUSTER_NIC_BPS") : "0");
  ASSERT_EQ(P, 2);
  ASSERT_GT(bps, 0);
  // ~0.5 s at the cap: long against this machine's scheduling noise, short for the test's budget.
  const int64_t per_dir = std::max<int64_t>(1, static_cast<int64_t>(bps / 8 * 0.5) >> 20) << 20;
  const int64_t n = per_dir / 4;
  std::vector<float> send(2 * n, 1.0f), recv(2 * n);
  std::vector<int64_t> counts{n, n}, displs{0, n};
  std::vector<double> times;
  for (int k = 0; k < 6; ++k) {
    MPI_Barrier(MPI_COMM_WORLD);
    auto t0 = Clock::now();
    if (st = world->alltoallv(send.data(), counts, displs, recv.data(), counts, displs); !st) comm::abort_job(st);
    double t = std::chrono::duration<double>(Clock::now() - t0).count();
    MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    if (k > 0) times.push_back(t);  // the first one sets up the connection
  }
  std::sort(times.begin(), times.end());
  // Wire bytes per payload byte: Ethernet 14 + IP 20 + TCP 32 (with timestamps) per 1448 at MTU 1500.
  const double predicted = per_dir * (1514.0 / 1448.0) * 8 / bps;
  if (r == 0)
    std::printf("alltoall: %.1f MiB each way, median %.4f s, cap predicts %.4f s\n", per_dir / 1048576.0,
                times[times.size() / 2], predicted);
}

}  // namespace
