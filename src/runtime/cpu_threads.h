// How many compute threads a rank runs: from the CPUs the process may really use (its affinity mask,
// which a batch scheduler's cgroup, taskset, `mpirun --bind-to core` or an emulated host of
// `moe cluster` narrows), shared among the ranks of the job whose masks overlap on the same machine.
// std::thread::hardware_concurrency() counts the whole machine whatever the mask says: on an emulated
// cluster it put 2 threads per rank on 1 core per rank and ran ~15x slower.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "plan/placement.h"
#include "util/status.h"

namespace moe::runtime {

// The CPUs one rank may run on, and which machine they belong to (two ranks share CPUs only when
// both facts match: emulated hosts of one machine share its kernel's boot id).
struct RankCpus {
  static constexpr int kWords = 16;  // CPUs 0..1023
  uint64_t machine = 0;              // hash of the kernel's boot id (hostname where it cannot be read)
  uint64_t mask[kWords] = {};        // bit c: CPU c is in the affinity mask
  int count() const;
  bool overlaps(const RankCpus& other) const;  // same machine and a CPU in common
};

// This process's RankCpus (sched_getaffinity). Never fails: without an affinity mask it reports every
// online CPU.
RankCpus this_process_cpus();

// The decision for one rank.
struct ThreadPlan {
  int threads = 1;       // compute threads (OpenMP, OpenBLAS) for this rank
  int cpus = 1;          // CPUs in this rank's mask
  int sharing = 1;       // ranks (this one included) whose masks overlap this one's
  std::string asked_by;  // what set threads ("--threads", "OMP_NUM_THREADS"); empty: the mask
  // More compute threads on this rank's CPUs than CPUs: threads x sharing > cpus with threads > 1.
  bool oversubscribed() const { return threads > 1 && static_cast<int64_t>(threads) * sharing > cpus; }
  // "1 per rank (2 CPUs in this rank's set, 2 ranks share them)"
  std::string describe() const;
};

// What asked for a thread count: --threads (the config's "threads") when > 0, else OMP_NUM_THREADS
// when set, else nothing (0).
struct ThreadRequest {
  int threads = 0;
  std::string asked_by;
};
ThreadRequest thread_request(int config_threads);

// Pure: rank `me`'s plan among `all` ranks. A request takes that many threads; none takes
// max(1, cpus / sharing). REQUIRES: 0 <= me < all.size(), request.threads >= 0.
ThreadPlan plan_threads(const ThreadRequest& request, const std::vector<RankCpus>& all, int me);

// The job's ranks that take turns on shared cores, for the planners (plan::CorePools): ranks whose masks
// overlap, directly or through another rank's, form a pool, whose CPUs (the union of their masks) run
// CPUs / (the most threads one of its ranks runs) of its ranks at full speed at once. Empty where every
// pool has CPUs for all its ranks' threads. Pure. REQUIRES: threads [all.size()], each >= 1.
plan::CorePools core_pools(const std::vector<RankCpus>& all, const std::vector<int>& threads);

// Collective over `world` (null: one process): every rank's RankCpus are all-gathered and each rank
// plans its own threads; *pools (when not null) gets the job's core_pools (empty with one process).
// Errors: a communication failure.
Status plan_rank_threads(const ThreadRequest& request, comm::Communicator* world, ThreadPlan* out,
                         plan::CorePools* pools = nullptr);

// The same decision from what a process knows before MPI starts: its mask and the ranks mpirun
// started on its host (OMPI_COMM_WORLD_LOCAL_SIZE), assumed to share the mask. Used to choose
// OpenMP's wait policy, which libgomp reads once when it loads (see cli/train_command.cpp).
ThreadPlan plan_threads_before_mpi(const ThreadRequest& request);

}  // namespace moe::runtime
