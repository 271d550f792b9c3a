// The MPI world of a test executable that runs under mpirun (or as a singleton): MPI started once
// before the first test and finalized after the last, the world communicator, and expert-parallel
// groups to run the checks on. Include it in exactly one file per test executable and register the
// environment once:
//   const ::testing::Environment* const g_env =
//       ::testing::AddGlobalTestEnvironment(new moe::comm::MpiTestEnvironment({1, 2, kWorldSize}));
// On ranks other than 0 only failures are printed, each line naming the rank.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "comm/mpi_communicator.h"

namespace moe::comm {

inline std::unique_ptr<MpiSession> g_session;
inline std::unique_ptr<Communicator> g_world;
inline std::vector<Groups> g_groups;             // make_groups for each requested EP size that divides the world
inline std::vector<Communicator*> g_all_groups;  // world, then each ep and dp group this rank is in

// An EP size in MpiTestEnvironment's list that stands for the world's size.
inline constexpr int kWorldSize = 0;

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, r.file_name() ? r.file_name() : "?",
                   r.line_number(), r.summary());
  }

 private:
  int rank_;
};

class MpiTestEnvironment : public ::testing::Environment {
 public:
  // ep_sizes: make_groups for each that divides the world size, once each (kWorldSize: the world).
  explicit MpiTestEnvironment(std::vector<int> ep_sizes = {}) : ep_sizes_(std::move(ep_sizes)) {}

  void SetUp() override {
    Status st = MpiSession::start(&g_session);
    if (!st) abort_job(st);
    // Short enough that a mismatched collective fails the test quickly instead of hanging it.
    st = g_session->world(&g_world, std::chrono::seconds(20));
    if (!st) abort_job(st);
    if (g_world->rank() != 0) {
      auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
      listeners.Append(new RankFailurePrinter(g_world->rank()));
    }
    g_all_groups.push_back(g_world.get());
    const int P = g_world->size();
    for (int ep : ep_sizes_) {
      if (ep == kWorldSize) ep = P;
      if (P % ep != 0) continue;
      bool seen = false;
      for (const Groups& g : g_groups) seen |= g.ep_size == ep;
      if (seen) continue;
      Groups groups;
      st = make_groups(*g_world, ep, &groups);
      if (!st) abort_job(st);
      g_groups.push_back(std::move(groups));
    }
    for (Groups& g : g_groups) g_all_groups.push_back(g.ep.get()), g_all_groups.push_back(g.dp.get());
  }
  void TearDown() override {
    g_all_groups.clear();
    g_groups.clear();
    g_world.reset();
    g_session.reset();  // MPI_Finalize: mpirun counts a rank that exits without it as failed
  }

 private:
  std::vector<int> ep_sizes_;
};

}  // namespace moe::comm
