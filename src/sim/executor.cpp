// The StepGraph executor on a modeled cluster (executor.h): a discrete-event loop over compute op ends
// (a heap) and the collectives' events (collectives.h). Only ranks where an op ended are re-examined
// for ops that may start, which keeps a step of thousands of ranks linear in its ops.
#include "sim/executor.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <queue>
#include <stdexcept>

#include "sim/compute.h"
#include "util/str_cat.h"

namespace moe::sim {

namespace {

using graph::Collective;
using graph::Group;
using graph::OpKind;

constexpr double kInf = std::numeric_limits<double>::infinity();

CollectiveKind kind_of(Collective c) {
  switch (c) {
    case Collective::allreduce: return CollectiveKind::allreduce;
    case Collective::allgather: return CollectiveKind::allgather;
    case Collective::reduce_scatter: return CollectiveKind::reduce_scatter;
    case Collective::broadcast: return CollectiveKind::broadcast;
    case Collective::reduce: return CollectiveKind::reduce;
    default: return CollectiveKind::alltoallv;  // alltoallv, sendrecv, the sparse collectives, none
  }
}

bool same_structure(const graph::StepGraph& a, const graph::StepGraph& b) {
  if (a.ops.size() != b.ops.size() || a.streams.size() != b.streams.size()) return false;
  for (size_t i = 0; i < a.ops.size(); ++i) {
    const graph::Op &x = a.ops[i], &y = b.ops[i];
    if (x.kind != y.kind || x.stream != y.stream || x.collective != y.collective || x.group != y.group ||
        x.priority != y.priority || x.deps != y.deps)
      return false;
  }
  return true;
}

// A uniform draw in [0, 1) for op `op` of rank r in step `step`: splitmix64 of the three, so every
// (step, rank, op) gets its own draw, independent of the order events are processed in.
double op_draw(int64_t step, int r, int op) {
  uint64_t x = static_cast<uint64_t>(step) * 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(r) * 0xC2B2AE3D27D4EB4Full ^
               static_cast<uint64_t>(op) * 0x165667B19E3779F9ull;
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<double>(x >> 11) * 0x1.0p-53;
}

}  // namespace

const std::vector<std::string>& path_categories() {
  static const std::vector<std::string> c = {"compute",   "all-to-all",         "allreduce",
                                             "gate sync", "sparse collectives", "other comm"};
  return c;
}

std::string path_category(OpKind kind) {
  if (!graph::is_communication(kind)) return "compute";
  switch (kind) {
    case OpKind::dispatch_a2a:
    case OpKind::combine_a2a:
    case OpKind::combine_a2a_bwd:
    case OpKind::dispatch_a2a_bwd: return "all-to-all";
    case OpKind::grad_allreduce: return "allreduce";
    case OpKind::gate_sync: return "gate sync";
    case OpKind::materialize:
    case OpKind::materialize_placed:
    case OpKind::rematerialize:
    case OpKind::replica_grad_reduce: return "sparse collectives";
    default: return "other comm";
  }
}

std::vector<LinkUse> top_links(const Cluster& cluster, const std::vector<double>& link_bytes, double seconds,
                               int n) {
  std::vector<LinkUse> all;
  for (int l = 0; l < static_cast<int>(link_bytes.size()) && l < cluster.n_links(); ++l) {
    if (link_bytes[l] <= 0) continue;
    LinkUse u;
    u.link = l;
    u.bytes = link_bytes[l];
    u.utilisation = seconds > 0 ? link_bytes[l] / (cluster.links()[l].bandwidth * seconds) : 0;
    all.push_back(u);
  }
  std::stable_sort(all.begin(), all.end(),
                   [](const LinkUse& a, const LinkUse& b) { return a.utilisation > b.utilisation; });
  if (static_cast<int>(all.size()) > n) all.resize(std::max(0, n));
  for (LinkUse& u : all) u.name = cluster.link_name(u.link);
  return all;
}

StepExecutor::StepExecutor(const Cluster& cluster, ExecutorConfig cfg)
    : cluster_(cluster), cfg_(std::move(cfg)), colls_(cluster) {
  if (cfg_.ranks < 1 || cfg_.ep_size < 1 || cfg_.ranks % cfg_.ep_size != 0)
    throw std::logic_error(str_cat("sim::StepExecutor: ep_size (", cfg_.ep_size, ") must divide ranks (", cfg_.ranks,
                                   ") and both be >= 1"));
  if (cfg_.device_of_rank.empty()) {
    if (cfg_.ranks > cluster.n_devices())
      throw std::logic_error(str_cat("sim::StepExecutor: ", cfg_.ranks, " ranks on a cluster of ", cluster.n_devices(),
                                     " devices"));
    for (int r = 0; r < cfg_.ranks; ++r) cfg_.device_of_rank.push_back(r);
  }
  if (static_cast<int>(cfg_.device_of_rank.size()) != cfg_.ranks)
    throw std::logic_error("sim::StepExecutor: device_of_rank needs one device per rank");
  std::vector<char> used(cluster.n_devices(), 0);
  for (int d : cfg_.device_of_rank) {
    if (d < 0 || d >= cluster.n_devices() || used[d])
      throw std::logic_error(str_cat("sim::StepExecutor: device ", d, " out of range or used twice"));
    used[d] = 1;
  }
}

int StepExecutor::group_index(Group g, int rank) const {
  switch (g) {
    case Group::ep: return rank / cfg_.ep_size;
    case Group::dp: return rank % cfg_.ep_size;
    default: return 0;
  }
}

int StepExecutor::member_index(Group g, int rank) const {
  switch (g) {
    case Group::ep: return rank % cfg_.ep_size;
    case Group::dp: return rank / cfg_.ep_size;
    default: return rank;
  }
}

std::vector<int> StepExecutor::members(Group g, int gi) const {
  std::vector<int> m;
  switch (g) {
    case Group::ep:
      for (int i = 0; i < cfg_.ep_size; ++i) m.push_back(gi * cfg_.ep_size + i);
      break;
    case Group::dp:
      for (int r = gi; r < cfg_.ranks; r += cfg_.ep_size) m.push_back(r);
      break;
    default:
      for (int r = 0; r < cfg_.ranks; ++r) m.push_back(r);
  }
  return m;
}

Status StepExecutor::run_step(const std::vector<graph::StepGraph>& graphs, StepResult* out,
                              const std::vector<SparseSchedule>& sparse) {
  const int R = cfg_.ranks;
  if (static_cast<int>(graphs.size()) != R)
    return Status::error(str_cat("sim: ", graphs.size(), " graphs for ", R, " ranks"));
  for (int r = 0; r < R; ++r) {
    // Validating every rank's graph is most of the set-up cost at thousands of ranks; the structure
    // check below makes rank 0's validation hold for all (costs are checked when used).
    if (r == 0) {
      if (Status s = graphs[0].validate(); !s) return Status::error(str_cat("sim: rank 0's graph: ", s.message()));
    } else if (!same_structure(graphs[0], graphs[r])) {
      return Status::error(str_cat("sim: rank ", r, "'s graph differs in structure from rank 0's"));
    }
  }
  const graph::StepGraph& g0 = graphs[0];
  const int n_ops = static_cast<int>(g0.ops.size());
  if (!sparse.empty() && static_cast<int>(sparse.size()) != n_ops)
    return Status::error(str_cat("sim: ", sparse.size(), " sparse schedules for a graph of ", n_ops, " ops"));
  auto schedule_of = [&](int op) -> const SparseSchedule* {
    const graph::Collective c = g0.ops[op].collective;
    if (sparse.empty() || (c != Collective::sparse_allgather && c != Collective::sparse_reduce_scatter)) return nullptr;
    return sparse[op].plan.num_ranks > 0 ? &sparse[op] : nullptr;
  };
  const int n_streams = static_cast<int>(g0.streams.size());
  std::vector<std::vector<int>> stream_ops(n_streams);
  std::vector<int> stream_pred(n_ops, -1);  // the op before it on its stream
  for (const graph::Op& op : g0.ops) {
    if (!stream_ops[op.stream].empty()) stream_pred[op.id] = stream_ops[op.stream].back();
    stream_ops[op.stream].push_back(op.id);
  }

  auto at = [n_ops](int r, int op) { return static_cast<size_t>(r) * n_ops + op; };
  std::vector<graph::OpState> state(static_cast<size_t>(R) * n_ops, graph::OpState::waiting);
  std::vector<double> t_start(state.size(), -1), t_end(state.size(), -1);
  std::vector<size_t> head(static_cast<size_t>(R) * n_streams, 0);
  // Per collective op and group instance: members arrived, the last to arrive, the collective id.
  auto n_groups = [&](Group g) { return g == Group::ep ? R / cfg_.ep_size : g == Group::dp ? cfg_.ep_size : 1; };
  std::vector<size_t> inst_base(n_ops + 1, 0);
  for (int i = 0; i < n_ops; ++i)
    inst_base[i + 1] = inst_base[i] + (graph::is_communication(g0.ops[i].kind) ? n_groups(g0.ops[i].group) : 0);
  std::vector<int> arrived(inst_base[n_ops], 0), last_arrival(inst_base[n_ops], -1);
  std::vector<std::pair<int, int>> coll_inst;  // by collective id: (op, group index)
  std::vector<int> inst_coll(inst_base[n_ops], -1);  // by instance: its collective id once started

  const double t0 = colls_.now();
  const int64_t flows0 = colls_.transfers_started();
  const uint64_t rates0 = colls_.network().rates_computed();
  std::vector<double> bytes0(cluster_.n_links());
  for (int l = 0; l < cluster_.n_links(); ++l) bytes0[l] = colls_.network().link_bytes(l);

  struct ComputeEnd {
    double t;
    int rank, op;
    uint32_t version;  // processor sharing: an end computed before the last change of the share is stale
    bool operator>(const ComputeEnd& o) const {
      if (t != o.t) return t > o.t;
      return rank != o.rank ? rank > o.rank : op > o.op;
    }
  };
  std::priority_queue<ComputeEnd, std::vector<ComputeEnd>, std::greater<ComputeEnd>> compute_ends;
  // Processor sharing of a CPU cluster's cores (executor.h), per pool of cores (one per node when
  // the nodes are pinned, else one for the machine): the compute ops running, each with its work left
  // (seconds alone), and the lanes moving data between hosts, progressing at their pool's `share`
  // since `share_since`. When a share changes, every running op's end is pushed again under a new
  // version; the old entries are skipped.
  const int cpu_cores = cluster_.spec().cpu_cores;
  const bool pinned = cpu_cores > 0 && cluster_.spec().cpu_nodes_pinned && cluster_.n_nodes() > 1;
  const int n_pools = pinned ? cluster_.n_nodes() : 1;
  const double pool_cores = cpu_cores > 0 ? static_cast<double>(cpu_cores) / n_pools : 0;
  std::vector<int> pool_of(R, 0);
  if (pinned)
    for (int r = 0; r < R; ++r) pool_of[r] = cluster_.node_of(cfg_.device_of_rank[r]);
  struct Sharing {
    int rank, op;
    double work;
  };
  std::vector<Sharing> sharing;
  std::vector<uint32_t> version(cpu_cores > 0 ? state.size() : 0, 0);
  // Per rank: running communication ops (reached), and those of them moving data between hosts.
  std::vector<int> polling(cpu_cores > 0 ? R : 0, 0), across(cpu_cores > 0 ? R : 0, 0);
  std::vector<char> op_across(cpu_cores > 0 ? state.size() : 0, 0);  // by (rank, op): counted in `across`
  std::vector<double> share(n_pools, 1.0);  // per pool: the share of a core each thread gets
  double share_since = t0;
  auto demands = [&]() {  // per pool: compute threads running plus lanes moving data between hosts
    std::vector<double> d(n_pools, 0.0);
    for (const Sharing& x : sharing) d[pool_of[x.rank]] += cluster_.spec().cpu_threads_per_device;
    for (int r = 0; r < static_cast<int>(across.size()); ++r)
      d[pool_of[r]] += across[r] * cluster_.spec().cpu_threads_per_transfer;
    return d;
  };
  auto share_at = [&](double demand) { return demand > pool_cores ? pool_cores / demand : 1.0; };
  auto progress_sharing = [&](double now) {  // every running op's work done since share_since
    for (Sharing& x : sharing) x.work = std::max(0.0, x.work - (now - share_since) * share[pool_of[x.rank]]);
    share_since = now;
  };
  // The links' shares (executor.h): a rank's device links (its copies in and out) at its lanes'
  // share, its pool's share while one moves data between hosts; the NICs and switches keep theirs.
  std::vector<std::vector<int>> rank_links(cpu_cores > 0 && R > 1 ? R : 0);
  for (int r = 0; r < static_cast<int>(rank_links.size()); ++r) {
    const int d = cfg_.device_of_rank[r], other = cfg_.device_of_rank[r == 0 ? 1 : 0];
    for (int l : {cluster_.route(d, other).front(), cluster_.route(other, d).back()}) rank_links[r].push_back(l);
  }
  std::vector<double> link_bandwidth;  // by link: what it carries now
  if (!rank_links.empty())
    for (const auto& link : cluster_.links()) link_bandwidth.push_back(link.bandwidth);
  auto set_link_bandwidth = [&](int l, double bandwidth) {
    if (link_bandwidth[l] == bandwidth) return;
    link_bandwidth[l] = bandwidth;
    colls_.set_link_bandwidth(l, bandwidth);
  };
  // A lane between hosts while compute runs in its pool moves at most the NIC's bandwidth over the
  // measured slowdown (ClusterSpec::cpu_transfer_slowdown).
  const double slowdown = cpu_cores > 0 ? cluster_.spec().cpu_transfer_slowdown : 1.0;
  const double nic_bandwidth = cluster_.spec().node.nic_port.bandwidth;
  auto update_links = [&]() {
    if (rank_links.empty()) return;
    // Lanes within a host get the cores of their pool that the threads above leave, at most one each.
    const std::vector<double> demand = demands();
    std::vector<int> within(n_pools, 0), computing(n_pools, 0);
    for (int r = 0; r < R; ++r) within[pool_of[r]] += polling[r] > 0 && across[r] == 0;
    for (const Sharing& x : sharing) ++computing[pool_of[x.rank]];
    for (int r = 0; r < R; ++r) {
      const int q = pool_of[r];
      const double within_share =
          within[q] > 0 ? std::min(1.0, std::max(0.0, pool_cores - demand[q]) / within[q]) : 1.0;
      for (int l : rank_links[r]) {
        double bandwidth = cluster_.links()[l].bandwidth * (across[r] > 0 ? share[q] : within_share);
        if (across[r] > 0 && computing[q] > 0 && slowdown > 1)
          bandwidth = std::min(bandwidth, nic_bandwidth / slowdown);
        set_link_bandwidth(l, bandwidth);
      }
    }
  };
  // After the ops or lanes of a pool changed: new shares; the ends of the ops whose share changed
  // pushed again, and the end of the op just added (`added`: the last in `sharing`).
  auto requeue_sharing = [&](double now, bool added) {
    const std::vector<double> demand = demands();
    std::vector<char> changed(n_pools, 0);
    for (int q = 0; q < n_pools; ++q) {
      const double s = share_at(demand[q]);
      changed[q] = s != share[q];
      share[q] = s;
    }
    for (size_t i = 0; i < sharing.size(); ++i) {
      const Sharing& x = sharing[i];
      if (changed[pool_of[x.rank]] || (added && i + 1 == sharing.size()))
        compute_ends.push({now + x.work / share[pool_of[x.rank]], x.rank, x.op, ++version[at(x.rank, x.op)]});
    }
  };
  auto shares_stale = [&]() {
    const std::vector<double> demand = demands();
    for (int q = 0; q < n_pools; ++q)
      if (share_at(demand[q]) != share[q]) return true;
    return false;
  };
  std::vector<char> dirty(R, 1);
  std::vector<int> dirty_list(R);
  for (int r = 0; r < R; ++r) dirty_list[r] = r;
  size_t n_ended = 0;
  const size_t n_total = static_cast<size_t>(R) * n_ops;
  const DeviceSpec& device = cluster_.device();
  std::vector<double> op_speed(n_ops, 1.0);  // by op id: the device's kind_speed of its kind (the same on every rank)
  if (!device.op_kind_speed.empty())
    for (int op = 0; op < n_ops; ++op) op_speed[op] = kind_speed(device, graph::op_kind_name(g0.ops[op].kind));

  auto head_op = [&](int r, int s) -> int {
    const size_t h = head[static_cast<size_t>(r) * n_streams + s];
    return h < stream_ops[s].size() ? stream_ops[s][h] : -1;
  };
  // The runtime's rule (graph::may_start) on rank r's copy of the graph's state.
  auto may_start = [&](int r, int op) {
    auto state_of = [&](int i) { return state[at(r, i)]; };
    auto head_of = [&](int s) { return head_op(r, s); };
    return graph::may_start(g0, op, state_of, head_of);
  };
  auto end_op = [&](int r, int op, double t) {
    if (cpu_cores > 0 && g0.ops[op].stream != 0) {
      --polling[r];
      if (op_across[at(r, op)]) --across[r];
    }
    state[at(r, op)] = graph::OpState::ended;
    t_end[at(r, op)] = t;
    ++head[static_cast<size_t>(r) * n_streams + g0.ops[op].stream];
    ++n_ended;
    if (!dirty[r]) {
      dirty[r] = 1;
      dirty_list.push_back(r);
    }
  };
  auto take_member_ends = [&]() {
    for (const MemberEnded& m : colls_.take_member_ends()) {
      const auto [op, gi] = coll_inst[m.collective];
      const Group grp = g0.ops[op].group;
      // members(grp, gi)[m.member], without building the list.
      const int r = grp == Group::ep ? gi * cfg_.ep_size + m.member : grp == Group::dp ? gi + m.member * cfg_.ep_size : m.member;
      end_op(r, op, m.time);
    }
  };
  Status error = Status::ok();
  // An alltoallv between nodes of a cluster that sends eagerly starts when its first member reaches
  // it (ClusterSpec::eager_bytes): the others reach it later (Collectives::reach).
  auto eager_alltoallv = [&](int op, int gi) {
    const graph::Op& o = g0.ops[op];
    if (cluster_.spec().eager_bytes <= 0 || cfg_.aggregate_flows || schedule_of(op) ||
        kind_of(o.collective) != CollectiveKind::alltoallv)
      return false;
    const std::vector<int> mem = members(o.group, gi);
    for (int r : mem)
      if (cluster_.node_of(cfg_.device_of_rank[r]) != cluster_.node_of(cfg_.device_of_rank[mem[0]])) return true;
    return false;
  };
  // `first`: the member that reached it, when it starts before the others (eager_alltoallv); -1: all have.
  auto start_collective = [&](int op, int gi, int first) {
    const graph::Op& o = g0.ops[op];
    const std::vector<int> mem = members(o.group, gi);
    const int p = static_cast<int>(mem.size());
    CollectiveSpec spec;
    if (first >= 0) {
      spec.reached.assign(p, 0);
      spec.reached[std::find(mem.begin(), mem.end(), first) - mem.begin()] = 1;
      spec.eager_bytes = cluster_.spec().eager_bytes;
    }
    spec.kind = kind_of(o.collective);
    spec.aggregate = cfg_.aggregate_flows;
    for (int r : mem) spec.devices.push_back(cfg_.device_of_rank[r]);
    if (const SparseSchedule* sch = schedule_of(op)) {
      if (sch->plan.num_ranks != p) {
        error = Status::error(str_cat("sim: ", g0.op_name(o), ": sparse plan over ", sch->plan.num_ranks,
                                      " ranks for a group of ", p));
        return;
      }
      // The graph's costs and the schedule must describe the same exchange.
      const std::vector<int64_t> want = comm::peer_bytes(sch->plan, sch->chunk_bytes);
      for (int i = 0; i < p; ++i) {
        const std::vector<int64_t>& have = graphs[mem[i]].ops[op].cost.peer_bytes;
        if (static_cast<int>(have.size()) != p ||
            !std::equal(have.begin(), have.end(), want.begin() + static_cast<size_t>(i) * p)) {
          error = Status::error(str_cat("sim: rank ", mem[i], " ", g0.op_name(o),
                                        ": peer_bytes differ from its sparse plan's"));
          return;
        }
      }
      spec.kind = CollectiveKind::rounds;
      spec.rounds.resize(sch->plan.rounds.size());
      for (size_t k = 0; k < sch->plan.rounds.size(); ++k)
        for (const comm::ChunkTransfer& t : sch->plan.rounds[k])
          spec.rounds[k].push_back({t.src, t.dst, static_cast<double>(sch->chunk_bytes)});
    } else if (spec.kind == CollectiveKind::alltoallv) {
      spec.peer_bytes.assign(static_cast<size_t>(p) * p, 0.0);
      for (int i = 0; i < p; ++i) {
        const graph::Cost& c = graphs[mem[i]].ops[op].cost;
        if (c.peer_bytes.empty()) {
          for (int j = 0; j < p; ++j)
            if (j != i && p > 1) spec.peer_bytes[static_cast<size_t>(i) * p + j] = static_cast<double>(c.bytes) / (p - 1);
        } else if (static_cast<int>(c.peer_bytes.size()) == p) {
          for (int j = 0; j < p; ++j) spec.peer_bytes[static_cast<size_t>(i) * p + j] = static_cast<double>(c.peer_bytes[j]);
        } else {
          error = Status::error(str_cat("sim: rank ", mem[i], " ", g0.op_name(o), ": peer_bytes has ",
                                        c.peer_bytes.size(), " entries for a group of ", p));
          return;
        }
      }
    } else {
      double bytes = 0;
      for (int r : mem) {
        const double b = static_cast<double>(graphs[r].ops[op].cost.bytes);
        bytes = spec.kind == CollectiveKind::allgather ? bytes + b : std::max(bytes, b);
      }
      spec.bytes = bytes;
    }
    bool spans_nodes = false;
    for (int d : spec.devices) spans_nodes = spans_nodes || cluster_.node_of(d) != cluster_.node_of(spec.devices[0]);
    // Hierarchical only when the members spread evenly over several nodes; else the flat ring.
    spec.hierarchical = spec.kind == CollectiveKind::allreduce && cfg_.hierarchical_allreduce && spans_nodes;
    if (spec.hierarchical) {
      std::vector<int> per_node(cluster_.n_nodes(), 0);
      for (int d : spec.devices) ++per_node[cluster_.node_of(d)];
      int k = 0;
      for (int c : per_node) {
        if (c == 0) continue;
        if (k != 0 && c != k) spec.hierarchical = false;
        k = c;
      }
    }
    // Across hosts, every member's lane now moves data until its part ends; an eager alltoallv's lanes
    // from when the last member reaches it (reach_collective).
    if (cpu_cores > 0 && spans_nodes && first < 0)
      for (int r : mem) op_across[at(r, op)] = 1, ++across[r];
    const int id = colls_.start(spec);
    if (id >= static_cast<int>(coll_inst.size())) coll_inst.resize(id + 1, {-1, -1});
    coll_inst[id] = {op, gi};
    inst_coll[inst_base[op] + gi] = id;
    take_member_ends();
  };
  // Member r reaches an eager alltoallv started before it. The kernel's transfer work is charged to
  // the lanes of the members still in it from when the last member reached it (executor.h): a lane
  // that waits for late peers moves nothing, and charging it from its arrival was measured to
  // over-predict (docs/sim.md, "Eager sends").
  auto reach_collective = [&](int op, int gi, int r) {
    const std::vector<int> mem = members(g0.ops[op].group, gi);
    colls_.reach(inst_coll[inst_base[op] + gi], static_cast<int>(std::find(mem.begin(), mem.end(), r) - mem.begin()));
    if (cpu_cores > 0 && arrived[inst_base[op] + gi] == static_cast<int>(mem.size()))
      for (int q : mem)
        if (state[at(q, op)] == graph::OpState::running) op_across[at(q, op)] = 1, ++across[q];
    take_member_ends();
  };
  auto start_op = [&](int r, int op) {
    const graph::Op& o = graphs[r].ops[op];
    const double now = colls_.now();
    state[at(r, op)] = graph::OpState::running;
    t_start[at(r, op)] = now;
    if (o.stream == 0) {
      const double alone = op_time(device, o.cost.flops, static_cast<double>(o.cost.bytes), op_speed[op]) *
                           op_time_factor(device, op_draw(steps_run_, r, op));
      if (cpu_cores > 0) {
        progress_sharing(now);
        sharing.push_back({r, op, alone});
        requeue_sharing(now, /*added=*/true);
      } else {
        compute_ends.push({now + alone, r, op, 0});
      }
      return;
    }
    if (cpu_cores > 0) ++polling[r];
    const int gi = group_index(o.group, r);
    const size_t k = inst_base[op] + gi;
    ++arrived[k];
    last_arrival[k] = r;
    const int p = o.group == Group::ep ? cfg_.ep_size : o.group == Group::dp ? R / cfg_.ep_size : R;
    if (eager_alltoallv(op, gi)) {
      if (arrived[k] == 1) start_collective(op, gi, r);
      else reach_collective(op, gi, r);
    } else if (arrived[k] == p) {
      start_collective(op, gi, -1);
    }
  };

  while (true) {
    // Ops that may start now, on the ranks where something ended (ascending ranks: deterministic).
    std::sort(dirty_list.begin(), dirty_list.end());
    std::vector<int> todo;
    todo.swap(dirty_list);
    for (int r : todo) dirty[r] = 0;
    for (int r : todo) {
      for (int s = 0; s < n_streams; ++s) {
        const int op = head_op(r, s);
        if (op >= 0 && may_start(r, op)) start_op(r, op);
        if (!error) return error;
      }
    }
    if (!dirty_list.empty()) continue;  // members without transfers ended at once
    if (n_ended == n_total) break;
    if (cpu_cores > 0) {  // lanes started or stopped: new shares for compute and links
      if (shares_stale()) {
        progress_sharing(colls_.now());
        requeue_sharing(colls_.now(), /*added=*/false);
      }
      update_links();
    }
    const double t = std::min(compute_ends.empty() ? kInf : compute_ends.top().t, colls_.next_event_time());
    if (t == kInf) {
      for (int r = 0; r < R; ++r)
        for (int op = 0; op < n_ops; ++op)
          if (state[at(r, op)] == graph::OpState::running)
            return Status::error(str_cat("sim: deadlock: rank ", r, " waits in ", g0.op_name(g0.ops[op]),
                                         " for members of its group that never reach it"));
      return Status::error("sim: deadlock: no op can start");
    }
    colls_.advance(t);
    bool shared_ended = false;
    while (!compute_ends.empty() && compute_ends.top().t == t) {
      const ComputeEnd e = compute_ends.top();
      compute_ends.pop();
      if (cpu_cores > 0) {
        if (e.version != version[at(e.rank, e.op)]) continue;  // stale: the share changed after it was pushed
        if (!shared_ended) progress_sharing(t);
        shared_ended = true;
        std::erase_if(sharing, [&](const Sharing& x) { return x.rank == e.rank && x.op == e.op; });
      }
      end_op(e.rank, e.op, t);
    }
    if (shared_ended && !sharing.empty() && shares_stale()) requeue_sharing(t, /*added=*/false);
    take_member_ends();
  }

  for (int l = 0; l < static_cast<int>(link_bandwidth.size()); ++l)  // idle lanes between steps
    set_link_bandwidth(l, cluster_.links()[l].bandwidth);

  // Results.
  StepResult& res = *out;
  res = StepResult{};
  res.start_s = t0;
  res.end_s = t0;
  for (double e : t_end) res.end_s = std::max(res.end_s, e);
  auto ns = [](double s) { return static_cast<int64_t>(std::llround(s * 1e9)); };
  res.timelines.resize(R);
  for (int r = 0; r < R; ++r) {
    runtime::StepTimeline& tl = res.timelines[r];
    tl.start_ns = ns(t0);
    tl.spans.resize(n_ops);
    double last = t0;
    for (int op = 0; op < n_ops; ++op) {
      tl.spans[op].start_ns = ns(t_start[at(r, op)] - t0);
      tl.spans[op].end_ns = ns(t_end[at(r, op)] - t0);
      last = std::max(last, t_end[at(r, op)]);
    }
    tl.wall_ns = ns(last - t0);
  }
  res.link_bytes.resize(cluster_.n_links());
  for (int l = 0; l < cluster_.n_links(); ++l) res.link_bytes[l] = colls_.network().link_bytes(l) - bytes0[l];
  res.flows = colls_.transfers_started() - flows0;
  res.rates_computed = static_cast<int64_t>(colls_.network().rates_computed() - rates0);

  // Critical path.
  int cr = -1, cop = -1;
  for (int r = 0; r < R; ++r)
    for (int op = 0; op < n_ops; ++op)
      if (cr < 0 || t_end[at(r, op)] > t_end[at(cr, cop)]) cr = r, cop = op;
  std::vector<double> charged(path_categories().size(), 0.0);
  std::vector<PathOp> path;
  while (cr >= 0) {
    const graph::Op& o = g0.ops[cop];
    int from = cr;  // the rank whose predecessors held this op up: for a collective, the member that
                    // reached it last, unless this member's part ended before (an eager alltoallv's may)
    if (graph::is_communication(o.kind)) {
      const int last = last_arrival[inst_base[cop] + group_index(o.group, cr)];
      if (t_start[at(last, cop)] <= t_end[at(cr, cop)]) from = last;
    }
    int pr = -1, pop = -1;
    auto consider = [&](int op) {
      if (op >= 0 && (pr < 0 || t_end[at(from, op)] > t_end[at(pr, pop)])) pr = from, pop = op;
    };
    for (int d : o.deps) consider(d);
    consider(stream_pred[cop]);
    const double before = pr >= 0 ? t_end[at(pr, pop)] : t0;
    const double c = t_end[at(cr, cop)] - before;
    const std::string cat = path_category(o.kind);
    for (size_t i = 0; i < charged.size(); ++i)
      if (path_categories()[i] == cat) charged[i] += c;
    path.push_back({cr, cop, c});
    cr = pr;
    cop = pop;
  }
  std::reverse(path.begin(), path.end());
  res.critical_path = std::move(path);
  for (size_t i = 0; i < charged.size(); ++i) res.critical_path_s.emplace_back(path_categories()[i], charged[i]);
  ++steps_run_;
  return Status::ok();
}

}  // namespace moe::sim
