#include "runtime/cpu_threads.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <fstream>
#include <stdexcept>

#include "model/data.h"  // fnv1a64
#include "util/str_cat.h"

namespace moe::runtime {

int RankCpus::count() const {
  int n = 0;
  for (uint64_t w : mask) n += std::popcount(w);
  return n;
}

bool RankCpus::overlaps(const RankCpus& other) const {
  if (machine != other.machine) return false;
  for (int i = 0; i < kWords; ++i)
    if (mask[i] & other.mask[i]) return true;
  return false;
}

namespace {

uint64_t machine_id() {
  std::string id;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  if (!(f >> id) || id.empty()) {
    char host[256] = {};
    gethostname(host, sizeof host - 1);
    id = host;
  }
  return fnv1a64(id.data(), id.size());
}

}  // namespace

RankCpus this_process_cpus() {
  RankCpus r;
  r.machine = machine_id();
  cpu_set_t set;
  CPU_ZERO(&set);
  const int limit = std::min(CPU_SETSIZE, RankCpus::kWords * 64);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    for (int c = 0; c < limit; ++c)
      if (CPU_ISSET(c, &set)) r.mask[c / 64] |= uint64_t{1} << (c % 64);
  }
  if (r.count() == 0) {  // no mask to read: every online CPU
    const long n = std::clamp(sysconf(_SC_NPROCESSORS_ONLN), 1L, static_cast<long>(limit));
    for (long c = 0; c < n; ++c) r.mask[c / 64] |= uint64_t{1} << (c % 64);
  }
  return r;
}

ThreadRequest thread_request(int config_threads) {
  if (config_threads > 0) return {config_threads, "--threads"};
  if (const char* env = std::getenv("OMP_NUM_THREADS"); env && std::atoi(env) > 0)
    return {std::atoi(env), "OMP_NUM_THREADS"};
  return {};
}

ThreadPlan plan_threads(const ThreadRequest& request, const std::vector<RankCpus>& all, int me) {
  if (me < 0 || me >= static_cast<int>(all.size()) || request.threads < 0)
    throw std::logic_error("plan_threads: rank out of range or negative thread request");
  ThreadPlan p;
  p.cpus = std::max(1, all[me].count());
  p.sharing = 0;
  for (const RankCpus& other : all) p.sharing += all[me].overlaps(other) ? 1 : 0;
  p.sharing = std::max(1, p.sharing);
  if (request.threads > 0) p.asked_by = request.asked_by;
  p.threads = request.threads > 0 ? request.threads : std::max(1, p.cpus / p.sharing);
  return p;
}

std::string ThreadPlan::describe() const {
  std::string s = str_cat(threads, " per rank (", asked_by.empty() ? "" : asked_by + "; ", cpus, cpus == 1 ? " CPU" : " CPUs",
                          " in this rank's set");
  if (sharing > 1) s += str_cat(", ", sharing, " ranks share them");
  if (oversubscribed())
    s += str_cat("; oversubscribed: ", static_cast<int64_t>(threads) * sharing, " threads on ", cpus,
                 cpus == 1 ? " CPU" : " CPUs");
  return s + ")";
}

plan::CorePools core_pools(const std::vector<RankCpus>& all, const std::vector<int>& threads) {
  const int R = static_cast<int>(all.size());
  if (static_cast<int>(threads.size()) != R || std::any_of(threads.begin(), threads.end(), [](int t) { return t < 1; }))
    throw std::logic_error("core_pools: needs threads >= 1 for every rank");
  std::vector<int> root(R);  // union-find over overlapping masks
  for (int r = 0; r < R; ++r) root[r] = r;
  auto find = [&](int r) {
    while (root[r] != r) r = root[r] = root[root[r]];
    return r;
  };
  for (int a = 0; a < R; ++a)
    for (int b = a + 1; b < R; ++b)
      if (all[a].overlaps(all[b])) root[find(b)] = find(a);
  plan::CorePools pools;
  std::vector<int> id(R, -1), ranks, most_threads;
  std::vector<RankCpus> cpus;  // the union of each pool's masks
  for (int r = 0; r < R; ++r) {
    const int g = find(r);
    if (id[g] < 0) {  // a new pool, numbered in the order of its first rank
      id[g] = static_cast<int>(ranks.size());
      ranks.push_back(0);
      most_threads.push_back(1);
      cpus.push_back(all[r]);
    }
    const int p = id[g];
    pools.pool_of_rank.push_back(p);
    ++ranks[p];
    most_threads[p] = std::max(most_threads[p], threads[r]);
    for (int w = 0; w < RankCpus::kWords; ++w) cpus[p].mask[w] |= all[r].mask[w];
  }
  bool shared = false;
  for (size_t p = 0; p < ranks.size(); ++p) {
    pools.ranks_at_once.push_back(static_cast<double>(std::max(1, cpus[p].count())) / most_threads[p]);
    shared = shared || pools.ranks_at_once[p] < ranks[p];
  }
  return shared ? pools : plan::CorePools{};
}

Status plan_rank_threads(const ThreadRequest& request, comm::Communicator* world, ThreadPlan* out,
                         plan::CorePools* pools) {
  const RankCpus mine = this_process_cpus();
  if (pools) *pools = {};
  if (!world || world->size() == 1) {
    *out = plan_threads(request, {mine}, 0);
    return Status::ok();
  }
  // As int64 words: machine, then the mask.
  constexpr int64_t kLen = 1 + RankCpus::kWords;
  int64_t send[kLen];
  send[0] = static_cast<int64_t>(mine.machine);
  for (int i = 0; i < RankCpus::kWords; ++i) send[1 + i] = static_cast<int64_t>(mine.mask[i]);
  std::vector<int64_t> recv(kLen * world->size());
  if (Status s = world->allgather(send, kLen, recv.data()); !s) return s;
  std::vector<RankCpus> all(world->size());
  for (int r = 0; r < world->size(); ++r) {
    all[r].machine = static_cast<uint64_t>(recv[r * kLen]);
    for (int i = 0; i < RankCpus::kWords; ++i) all[r].mask[i] = static_cast<uint64_t>(recv[r * kLen + 1 + i]);
  }
  *out = plan_threads(request, all, world->rank());
  if (pools) {
    std::vector<int> threads;
    for (int r = 0; r < world->size(); ++r) threads.push_back(plan_threads(request, all, r).threads);
    *pools = core_pools(all, threads);
  }
  return Status::ok();
}

ThreadPlan plan_threads_before_mpi(const ThreadRequest& request) {
  const RankCpus mine = this_process_cpus();
  int local = 1;
  if (const char* v = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) local = std::max(1, std::atoi(v));
  return plan_threads(request, std::vector<RankCpus>(local, mine), 0);
}

}  // namespace moe::runtime
