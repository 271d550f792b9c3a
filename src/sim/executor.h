// The simulator's StepGraph executor: runs one StepGraph per rank (the same ops, per-rank sizes) on a
// modeled cluster (cluster.h), with exactly the runtime's semantics (graph/step_graph.h,
// runtime/executor.h), and writes the runtime's timeline type, so runtime::breakdown() and
// runtime::write_chrome_trace() give the same metrics and the same trace format as a real run.
//
// Semantics, per rank:
//   * the compute stream and each communication lane are FIFOs: an op starts after its stream
//     predecessor ended and after all its dependencies ended;
//   * priority across lanes: a communication op does not start while a communication op of higher
//     priority on another lane of the same rank is running or ready (heads its lane, deps ended);
//   * a compute op takes sim::op_time(device, flops, bytes) (compute.h), times
//     op_time_factor(device, u) where the device has op_time_quantiles (u: a pseudo-random draw of the
//     step's index, the rank and the op, independent per rank and op); on a cluster of CPU ranks
//     (ClusterSpec::cpu_cores > 0) that is its work in seconds of its threads running alone, and a
//     pool of C cores is shared (processor sharing, as the OS scheduler time-slices threads) among
//     the compute ops' threads and the lanes moving data between hosts of its ranks. The pools: one
//     per node of C = cpu_cores / nodes when ClusterSpec::cpu_nodes_pinned, else one of
//     C = cpu_cores for all. A communication op whose collective spans more than one node is one
//     thread from the moment its collective started (every member reached it) until the member's part
//     ended. While n compute ops and k such lanes of a pool run, every thread gets
//     s = min(1, C / (n * cpu_threads_per_device + k * cpu_threads_per_transfer)) of a core (a lane
//     counts as cpu_threads_per_transfer threads, 1 unless measured): compute ops progress at s of their
//     speed alone, and those lanes' device links (their copies in and out) carry s of their
//     bandwidth; the NICs keep theirs (at 1 Gbit/s the cap, not the share, bounds a transfer alone). While
//     a compute op runs in its pool such a lane moves at most the NIC's bandwidth over
//     cpu_transfer_slowdown (1 unless measured): a transfer beside compute was measured 1.3-1.5x
//     slower at 1 Gbit/s and about 4x at 10 Gbit/s, far more than its thread's share says. The
//     kernel's TCP path and the emulated NICs are CPU work done beside the compute, not after it
//     (measured: docs/sim.md, "Transfers between hosts are CPU work").
//     Communication within a host takes no share from compute: the runtime's lanes poll with
//     sched_yield, which hands the core to any runnable compute thread. Those lanes get what the
//     threads above leave in their pool: with k of its ranks polling a running communication op,
//     each gets min(1, max(0, C - demand) / k) of a core, and its device links (the copies into and
//     out of it) carry that share of their bandwidth; so a transfer stalls while compute fills every
//     core, and 4 ranks exchanging on 2 idle cores copy at half speed;
//   * a collective op is "reached" on a rank when that rank may start it: it is then running there, as
//     a blocking call is. Its flows start when every member of its group has reached it (the group:
//     world, ep = consecutive world ranks [g*G, (g+1)*G), dp = the ranks with the same rank % G, as
//     comm::Groups defines them), and it ends on member i when member i's part ended
//     (Collectives::take_member_ends). Except on a cluster that sends eagerly
//     (ClusterSpec::eager_bytes > 0): an alltoallv (not a sparse schedule, not aggregated) between
//     nodes starts when its first member reaches it, and each member's eager sends start when it
//     reaches it, one after another in its posting order, and are done on it at once (collectives.h,
//     CollectiveSpec::reached), as MPI's eager protocol hands them to the kernel; on a CPU cluster
//     its members' lanes count as moving data between hosts from when the last member reached it (a
//     lane waiting for late peers moves nothing; docs/sim.md, "Eager sends").
// What the collective moves, from the members' Op::cost (bytes this rank sends):
//   alltoallv, sendrecv: the p x p matrix of the members' peer_bytes (group rank order); a member with
//     no peer_bytes spreads cost.bytes evenly over the other members.
//   sparse_allgather, sparse_reduce_scatter: with a SparseSchedule for the op (run_step's `sparse`),
//     the rounds of its comm::SparsePlan exactly as comm::sparse_allgather / sparse_reduce_scatter run
//     them (collectives.h, "rounds": per member one blocking call per active round, alpha per round,
//     forwarded chunks after they arrived); the members' peer_bytes must equal comm::peer_bytes of the
//     plan (else an error: graph and schedule disagree). Without a schedule: the peer_bytes as one
//     direct exchange, an approximation that ignores the rounds' serialisation (a rank receiving h
//     chunks pays one alpha instead of h) and forwarding (a chunk wanted by many ranks leaves its
//     owner that many times instead of spreading along a tree).
//   allreduce, reduce_scatter, broadcast (root 0), reduce (root 0): the largest member's cost.bytes;
//   allgather: the sum of the members' cost.bytes (each sends its contribution).
// Steps run back to back: step k+1 starts on every rank when the last op of step k ended on any rank
// (the runtime's per-step metrics and gradient-norm reductions synchronise the ranks there). The
// optimizer is not part of the EP graph (ep_builder.h) and is not modeled.
//
// Critical path, per step: from the op that ended last (any rank), walk back through whichever
// predecessor ended last: a dependency, the stream predecessor, or, for a collective, the
// predecessors on the member that reached it last. Each op on the path is charged the time from its
// predecessor's end to its own end (so waiting for a priority gate is charged to the waiting op), and
// the charges sum to the step time exactly.
//
// Units: seconds inside; timelines in ns as the runtime's. Determinism: the op times' draws are a hash
// of (step, rank, op), ties are broken by (rank, op id); the same inputs give the same results bit for
// bit. Thread safety: none.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "comm/sparse_collectives.h"
#include "graph/step_graph.h"
#include "runtime/executor.h"
#include "sim/cluster.h"
#include "sim/collectives.h"
#include "util/status.h"

namespace moe::sim {

// How a sparse collective op moves its chunks: the plan the runtime executes (its ranks are the op's
// group member indices) and the bytes of one chunk. Used for every instance of the op's group (the
// placement strategies have a single ep group of every rank).
struct SparseSchedule {
  comm::SparsePlan plan;    // plan.num_ranks == 0: none (the op runs as a direct exchange)
  int64_t chunk_bytes = 0;
};

struct ExecutorConfig {
  int ranks = 1;                     // world size
  int ep_size = 1;                   // ranks per expert-parallel group; divides ranks
  std::vector<int> device_of_rank;   // rank -> cluster device, distinct; empty: rank r on device r
  bool hierarchical_allreduce = false;  // allreduce over several nodes: the hierarchical algorithm
  bool aggregate_flows = false;      // CollectiveSpec::aggregate for every collective (collectives.h)
};

// Categories of the critical path, in report order.
const std::vector<std::string>& path_categories();  // "compute", "all-to-all", "allreduce", ...
// The category of an op: "compute" for compute ops, else by kind ("all-to-all" for the token
// exchanges, "allreduce" for grad_allreduce, "gate sync", "sparse collectives", "other comm").
std::string path_category(graph::OpKind kind);

struct PathOp {
  int rank = 0, op = 0;
  double charged_s = 0;  // end of this op minus the end of its predecessor on the path
};

struct StepResult {
  double start_s = 0, end_s = 0;  // simulated time since the executor was made
  // Per rank, the runtime's type: start_ns = the step's start since the executor was made, spans since
  // then; wall_ns = that rank's last op end.
  std::vector<runtime::StepTimeline> timelines;
  std::vector<std::pair<std::string, double>> critical_path_s;  // by path_categories(), seconds
  std::vector<PathOp> critical_path;                            // from the step's start to its end
  std::vector<double> link_bytes;                               // by link id: bytes carried this step
  int64_t flows = 0;                                            // transfers started this step
  int64_t rates_computed = 0;  // flow rates the network recomputed this step (its cost, network.h)
  double seconds() const { return end_s - start_s; }
};

struct LinkUse {
  int link = -1;
  std::string name;     // Cluster::link_name
  double bytes = 0;
  double utilisation = 0;  // bytes / (bandwidth * seconds)
};
// The `n` most utilised links (ties by link id) given bytes per link over `seconds`.
std::vector<LinkUse> top_links(const Cluster& cluster, const std::vector<double>& link_bytes, double seconds,
                               int n);

class StepExecutor {
 public:
  // REQUIRES (std::logic_error): ranks >= 1, ep_size divides ranks, device_of_rank empty (then ranks
  // <= cluster devices) or of `ranks` distinct devices in range. The cluster outlives the executor.
  StepExecutor(const Cluster& cluster, ExecutorConfig cfg);

  // Runs one step of graphs[r] on rank r, starting when the previous step ended. Errors: graphs.size()
  // != ranks, a graph that fails validate(), graphs that differ in structure (ops, kinds, streams,
  // collectives, groups, deps), a collective whose members' sizes cannot form one (peer_bytes of the
  // wrong length), a sparse schedule of the wrong size or disagreeing with the ops' peer_bytes, or a
  // deadlock (names a stuck op). *out is overwritten. sparse: empty, or one entry per op id (entries
  // of other ops ignored).
  Status run_step(const std::vector<graph::StepGraph>& graphs, StepResult* out,
                  const std::vector<SparseSchedule>& sparse = {});

  double now() const { return colls_.now(); }
  const ExecutorConfig& config() const { return cfg_; }
  const Cluster& cluster() const { return cluster_; }

  // Group of `g` that rank r is in, its member index there, and the group's members in ring order.
  int group_index(graph::Group g, int rank) const;
  int member_index(graph::Group g, int rank) const;
  std::vector<int> members(graph::Group g, int group_index) const;

 private:
  const Cluster& cluster_;
  ExecutorConfig cfg_;
  Collectives colls_;
  int64_t flows_started_ = 0;
  int64_t steps_run_ = 0;  // steps that ran to the end: the step index of op_time_factor's draws
};

}  // namespace moe::sim
