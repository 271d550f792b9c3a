// Collectives as dependency graphs of transfers, run as flows on the network (collectives.h).
#include "sim/collectives.h"
#include "util/str_cat.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace moe::sim {

namespace {

constexpr int kMaxPipelineChunks = 256;

// The transfers of one collective being built: member-to-member sends and "a before b" edges. ready[m]
// holds the transfers member m must have finished before it takes part in the next ring phase (the
// phases of the hierarchical allreduce).
struct Plan {
  struct Item {
    int src, dst;
    double bytes;
    double alpha_steps;
    double weight;
  };
  std::vector<Item> items;
  std::vector<std::pair<int, int>> edges;
  std::vector<std::vector<int>> ready;
  // Members besides src and dst whose part a transfer is (aggregated all-to-alls: the senders whose
  // bytes it carries): (transfer, member).
  std::vector<std::pair<int, int>> carried_for;

  explicit Plan(int members) : ready(members) {}
  int add(int src, int dst, double bytes, double alpha_steps = 1, double weight = 1) {
    items.push_back({src, dst, bytes, alpha_steps, weight});
    return static_cast<int>(items.size()) - 1;
  }
  void edge(int before, int after) { edges.emplace_back(before, after); }
  void after_ready(int member, int x) {
    for (int r : ready[member]) edge(r, x);
  }
};

// One ring phase over the members `ring` (in ring order): `steps` steps, in each of which every member
// sends `chunk` bytes to the next one. aggregate: one transfer per member of all steps (collectives.h).
void ring_phase(Plan* plan, const std::vector<int>& ring, int steps, double chunk, bool aggregate = false) {
  const int p = static_cast<int>(ring.size());
  if (p < 2 || steps == 0) return;
  if (aggregate) {
    std::vector<int> sent(p);
    for (int i = 0; i < p; ++i) {
      const int from = ring[i], to = ring[(i + 1) % p];
      sent[i] = plan->add(from, to, steps * chunk, steps);
      plan->after_ready(from, sent[i]);
      plan->after_ready(to, sent[i]);
    }
    for (int i = 0; i < p; ++i) plan->ready[ring[i]] = {sent[i], sent[(i + p - 1) % p]};
    return;
  }
  std::vector<int> prev(p), cur(p);
  for (int s = 0; s < steps; ++s) {
    for (int i = 0; i < p; ++i) {
      const int from = ring[i], to = ring[(i + 1) % p];
      const int x = plan->add(from, to, chunk);
      if (s == 0) {
        plan->after_ready(from, x);
        plan->after_ready(to, x);
      } else {
        plan->edge(prev[i], x);                // its own previous send
        plan->edge(prev[(i + p - 1) % p], x);  // the data it forwards
      }
      cur[i] = x;
    }
    std::swap(prev, cur);
  }
  for (int i = 0; i < p; ++i) plan->ready[ring[i]] = {prev[i], prev[(i + p - 1) % p]};
}

// A pipelined chain: chain[0] -> chain[1] -> ... in `chunks` chunks of `chunk` bytes each. A hop sends
// chunk c after its chunk c-1 and after chunk c arrived from upstream.
void chain_phase(Plan* plan, const std::vector<int>& chain, int chunks, double chunk) {
  const int hops = static_cast<int>(chain.size()) - 1;
  std::vector<int> prev(hops), cur(hops);  // by hop: the transfer of the previous / this chunk
  for (int c = 0; c < chunks; ++c) {
    for (int k = 0; k < hops; ++k) {
      const int x = plan->add(chain[k], chain[k + 1], chunk);
      if (c > 0) plan->edge(prev[k], x);
      if (k > 0) plan->edge(cur[k - 1], x);
      cur[k] = x;
    }
    std::swap(prev, cur);
  }
}

}  // namespace

const char* collective_kind_name(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::allreduce: return "allreduce";
    case CollectiveKind::allgather: return "allgather";
    case CollectiveKind::reduce_scatter: return "reduce_scatter";
    case CollectiveKind::alltoallv: return "alltoallv";
    case CollectiveKind::broadcast: return "broadcast";
    case CollectiveKind::reduce: return "reduce";
    case CollectiveKind::rounds: return "rounds";
  }
  return "?";
}

int pipeline_chunks(int hops, double bytes, double bandwidth, double alpha) {
  if (hops < 1 || !(bytes >= 0) || !(bandwidth > 0) || !(alpha >= 0) || !std::isfinite(bytes) ||
      !std::isfinite(alpha)) {
    throw std::logic_error(str_cat("sim::pipeline_chunks: hops (", hops, "), bytes (", bytes, "), bandwidth (", bandwidth,
                               "), alpha (", alpha, ") out of range"));
  }
  // One hop, or nothing to send: chunking only adds alphas.
  if (hops == 1 || bytes == 0) return 1;
  if (alpha == 0) return kMaxPipelineChunks;
  auto time = [&](int c) { return (c + hops - 1) * (alpha + bytes / (c * bandwidth)); };
  const double best = std::sqrt((hops - 1) * bytes / (bandwidth * alpha));
  if (!(best < kMaxPipelineChunks)) return kMaxPipelineChunks;
  const int lo = std::max(1, static_cast<int>(std::floor(best)));
  const int hi = std::min(kMaxPipelineChunks, lo + 1);
  return time(hi) < time(lo) ? hi : lo;
}

Collectives::Collectives(const Cluster& cluster) : cluster_(cluster), net_(cluster) {}

void Collectives::validate(const CollectiveSpec& spec) const {
  const char* kind = collective_kind_name(spec.kind);
  auto fail = [&](const std::string& what) {
    throw std::logic_error(str_cat("sim::Collectives::start(", kind, "): ", what));
  };
  const int p = static_cast<int>(spec.devices.size());
  if (p == 0) fail("no devices");
  std::vector<int> sorted = spec.devices;
  std::sort(sorted.begin(), sorted.end());
  if (sorted.front() < 0 || sorted.back() >= cluster_.n_devices()) {
    fail(str_cat("devices must be in [0, ", cluster_.n_devices(), ")"));
  }
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) fail("a device appears twice");
  if (!std::isfinite(spec.bytes) || spec.bytes < 0) fail(str_cat("bytes (", spec.bytes, ") must be finite and >= 0"));
  if (spec.kind == CollectiveKind::alltoallv) {
    if (static_cast<int64_t>(spec.peer_bytes.size()) != static_cast<int64_t>(p) * p) {
      fail(str_cat("peer_bytes has ", spec.peer_bytes.size(), " entries, need ", p, " x ", p));
    }
    for (double b : spec.peer_bytes) {
      if (!std::isfinite(b) || b < 0) fail(str_cat("peer_bytes entry ", b, " must be finite and >= 0"));
    }
  } else if (!spec.peer_bytes.empty()) {
    fail("peer_bytes is only for alltoallv");
  }
  if (!spec.reached.empty()) {
    if (spec.kind != CollectiveKind::alltoallv || spec.aggregate)
      fail("reached is only for alltoallv without aggregate");
    if (static_cast<int>(spec.reached.size()) != p)
      fail(str_cat("reached has ", spec.reached.size(), " entries, need ", p));
  }
  if (!std::isfinite(spec.eager_bytes) || spec.eager_bytes < 0)
    fail(str_cat("eager_bytes (", spec.eager_bytes, ") must be finite and >= 0"));
  if (spec.kind == CollectiveKind::rounds) {
    std::vector<int> sends(p), recvs(p);
    for (size_t k = 0; k < spec.rounds.size(); ++k) {
      std::fill(sends.begin(), sends.end(), 0);
      std::fill(recvs.begin(), recvs.end(), 0);
      for (const RoundTransfer& t : spec.rounds[k]) {
        if (t.src < 0 || t.src >= p || t.dst < 0 || t.dst >= p || t.src == t.dst)
          fail(str_cat("round ", k, ": transfer ", t.src, " -> ", t.dst, " must join two members in [0, ", p, ")"));
        if (!std::isfinite(t.bytes) || t.bytes < 0) fail(str_cat("round ", k, ": bytes (", t.bytes, ") must be finite and >= 0"));
        if (++sends[t.src] > 1 || ++recvs[t.dst] > 1)
          fail(str_cat("round ", k, ": a member sends or receives twice"));
      }
    }
  } else if (!spec.rounds.empty()) {
    fail("rounds is only for the rounds kind");
  }
  if ((spec.kind == CollectiveKind::broadcast || spec.kind == CollectiveKind::reduce) &&
      (spec.root < 0 || spec.root >= p)) {
    fail(str_cat("root (", spec.root, ") must be a member index in [0, ", p, ")"));
  }
  if (spec.hierarchical) {
    if (spec.kind != CollectiveKind::allreduce) fail("hierarchical is only for allreduce");
    std::vector<int> per_node(cluster_.n_nodes(), 0);
    for (int d : spec.devices) ++per_node[cluster_.node_of(d)];
    int k = 0;
    for (int c : per_node) {
      if (c == 0) continue;
      if (k != 0 && c != k) fail("hierarchical needs the same number of members on every node");
      k = c;
    }
  }
}

int Collectives::start(const CollectiveSpec& spec) {
  validate(spec);
  const int p = static_cast<int>(spec.devices.size());
  const double S = spec.bytes;
  Plan plan(p);
  std::vector<int> members(p);
  for (int i = 0; i < p; ++i) members[i] = i;

  switch (spec.kind) {
    case CollectiveKind::allreduce:
      if (S == 0) break;
      if (!spec.hierarchical) {
        ring_phase(&plan, members, 2 * (p - 1), S / p, spec.aggregate);
        break;
      }
      {
        // Members by node, nodes in order of first appearance, members in ring order.
        std::vector<int> node_order;
        std::vector<std::vector<int>> by_node(cluster_.n_nodes());
        for (int i = 0; i < p; ++i) {
          const int node = cluster_.node_of(spec.devices[i]);
          if (by_node[node].empty()) node_order.push_back(node);
          by_node[node].push_back(i);
        }
        const int m = static_cast<int>(node_order.size());
        const int k = p / m;
        const bool a = spec.aggregate;
        for (int node : node_order) ring_phase(&plan, by_node[node], k - 1, S / k, a);  // reduce-scatter
        for (int j = 0; j < k; ++j) {
          std::vector<int> ring;
          for (int node : node_order) ring.push_back(by_node[node][j]);
          ring_phase(&plan, ring, 2 * (m - 1), S / (static_cast<double>(k) * m), a);  // allreduce of a shard
        }
        for (int node : node_order) ring_phase(&plan, by_node[node], k - 1, S / k, a);  // allgather
      }
      break;
    case CollectiveKind::allgather:
    case CollectiveKind::reduce_scatter:
      if (S > 0) ring_phase(&plan, members, p - 1, S / p, spec.aggregate);
      break;
    case CollectiveKind::alltoallv:
      if (spec.aggregate) {
        // Members by node (nodes in order of first appearance); a node's bytes to a member of another
        // node leave from its member on the receiver's rail (collectives.h).
        std::vector<int> node_slot(cluster_.n_nodes(), -1);
        std::vector<std::vector<int>> by_node;
        std::vector<int> slot_of(p);
        for (int i = 0; i < p; ++i) {
          const int node = cluster_.node_of(spec.devices[i]);
          if (node_slot[node] < 0) {
            node_slot[node] = static_cast<int>(by_node.size());
            by_node.emplace_back();
          }
          slot_of[i] = node_slot[node];
          by_node[slot_of[i]].push_back(i);
        }
        std::vector<double> from_node(by_node.size());
        for (int j = 0; j < p; ++j) {
          std::fill(from_node.begin(), from_node.end(), 0.0);
          for (int i = 0; i < p; ++i) {
            const double b = spec.peer_bytes[static_cast<size_t>(i) * p + j];
            if (i == j || b <= 0) continue;
            if (slot_of[i] == slot_of[j]) {
              plan.add(i, j, b);
            } else {
              from_node[slot_of[i]] += b;
            }
          }
          const int rail = cluster_.local_index(spec.devices[j]);
          for (size_t n = 0; n < by_node.size(); ++n) {
            if (from_node[n] <= 0) continue;
            const std::vector<int>& there = by_node[n];
            int src = there[rail % there.size()];
            for (int m : there)
              if (cluster_.local_index(spec.devices[m]) == rail) src = m;
            // It stands for one flow per sender: that many shares where links are shared (network.h).
            int senders = 0;
            for (int i : there) senders += spec.peer_bytes[static_cast<size_t>(i) * p + j] > 0 ? 1 : 0;
            const int x = plan.add(src, j, from_node[n], 1, senders);
            for (int i : there)
              if (i != src && spec.peer_bytes[static_cast<size_t>(i) * p + j] > 0) plan.carried_for.emplace_back(x, i);
          }
        }
        break;
      }
      for (int i = 0; i < p; ++i) {
        for (int j = 0; j < p; ++j) {
          const double b = spec.peer_bytes[static_cast<size_t>(i) * p + j];
          if (i != j && b > 0) plan.add(i, j, b);
        }
      }
      break;
    case CollectiveKind::rounds: {
      // last[m]: member m's transfers of its latest active round (its blocking call there).
      std::vector<std::vector<int>> last(p), now_of(p);
      for (const std::vector<RoundTransfer>& round : spec.rounds) {
        std::vector<int> touched;
        for (const RoundTransfer& t : round) {
          if (t.bytes <= 0) continue;
          const int x = plan.add(t.src, t.dst, t.bytes);
          for (int m : {t.src, t.dst}) {
            for (int before : last[m]) plan.edge(before, x);
            if (now_of[m].empty()) touched.push_back(m);
            now_of[m].push_back(x);
          }
        }
        for (int m : touched) {
          last[m].swap(now_of[m]);
          now_of[m].clear();
        }
      }
      break;
    }
    case CollectiveKind::broadcast:
    case CollectiveKind::reduce: {
      if (S == 0 || p < 2) break;
      std::vector<int> chain;
      const int first = spec.kind == CollectiveKind::broadcast ? spec.root : spec.root + 1;
      for (int k = 0; k < p; ++k) chain.push_back((first + k) % p);
      // Chunks sized for the slowest hop as it is uncontended.
      double bandwidth = std::numeric_limits<double>::infinity(), alpha = 0;
      for (int k = 0; k + 1 < p; ++k) {
        const std::vector<int> path = cluster_.route(spec.devices[chain[k]], spec.devices[chain[k + 1]]);
        bandwidth = std::min(bandwidth, cluster_.path_bandwidth(path));
        alpha = std::max(alpha, cluster_.path_latency(path));
      }
      const int chunks = pipeline_chunks(p - 1, S, bandwidth, alpha);
      chain_phase(&plan, chain, chunks, S / chunks);
      break;
    }
  }

  int id;
  if (!free_ids_.empty()) {
    id = free_ids_.back();
    free_ids_.pop_back();
  } else {
    id = static_cast<int>(running_.size());
    running_.emplace_back();
  }
  ++in_flight_;
  Running& r = running_[id];
  r.start = now();
  r.devices = spec.devices;
  r.member_left.assign(p, 0);
  r.member_end.assign(p, now());
  // Transfers with their successors in CSR form (edges grouped by their first transfer).
  const int n = static_cast<int>(plan.items.size());
  r.transfers.assign(n, Transfer{});
  std::vector<int> offset(n + 1, 0);  // transfer x's successors start at offset[x]
  for (const auto& [before, after] : plan.edges) {
    ++offset[before + 1];
    ++r.transfers[after].deps_left;
  }
  for (int x = 0; x < n; ++x) offset[x + 1] += offset[x];
  r.successors.assign(plan.edges.size(), 0);
  std::vector<int> fill(offset.begin(), offset.end() - 1);
  for (const auto& [before, after] : plan.edges) r.successors[fill[before]++] = after;
  for (int x = 0; x < n; ++x) {
    Transfer& t = r.transfers[x];
    t.src = plan.items[x].src;
    t.dst = plan.items[x].dst;
    t.bytes = plan.items[x].bytes;
    t.alpha_steps = plan.items[x].alpha_steps;
    t.weight = plan.items[x].weight;
    t.succ_begin = offset[x];
    t.succ_end = offset[x + 1];
    ++r.member_left[t.src];
    ++r.member_left[t.dst];
    t.carried_begin = t.carried_end = 0;
  }
  // Carried-for members in CSR form (plan.carried_for is grouped by transfer, in order).
  r.carried.clear();
  for (size_t k = 0; k < plan.carried_for.size();) {
    const int x = plan.carried_for[k].first;
    r.transfers[x].carried_begin = static_cast<int>(r.carried.size());
    for (; k < plan.carried_for.size() && plan.carried_for[k].first == x; ++k) {
      r.carried.push_back(plan.carried_for[k].second);
      ++r.member_left[plan.carried_for[k].second];
    }
    r.transfers[x].carried_end = static_cast<int>(r.carried.size());
  }
  r.transfers_left = n;
  r.reached = spec.reached.empty() ? std::vector<char>(p, 1) : spec.reached;
  r.not_reached = static_cast<int>(std::count(r.reached.begin(), r.reached.end(), 0));
  if (spec.eager_bytes > 0 || r.not_reached > 0) {  // late members' transfers wait (eager: a late sender's)
    for (Transfer& t : r.transfers) {
      t.eager = t.bytes <= spec.eager_bytes && spec.eager_bytes > 0 &&
                cluster_.node_of(r.devices[t.src]) != cluster_.node_of(r.devices[t.dst]);
      t.deps_left += !r.reached[t.src] + (!t.eager && !r.reached[t.dst]);
    }
    if (spec.kind == CollectiveKind::alltoallv && !spec.aggregate) queue_eager_sends(&r);
  }
  r.end_together = spec.aggregate && n > 0 &&
                   (spec.kind == CollectiveKind::allreduce || spec.kind == CollectiveKind::allgather ||
                    spec.kind == CollectiveKind::reduce_scatter);
  for (int m = 0; m < p; ++m) {
    if (r.member_left[m] == 0 && r.reached[m]) member_ends_.push_back({id, m, now()});
  }
  if (n == 0) {
    if (r.not_reached == 0) finished_now_.push_back(id);
    return id;
  }
  for (int x = 0; x < n; ++x) {
    if (r.transfers[x].deps_left == 0) launch(id, x);
  }
  return id;
}

void Collectives::launch(int collective, int transfer) {
  const Running& r = running_[collective];
  const Transfer& t = r.transfers[transfer];
  cluster_.route(r.devices[t.src], r.devices[t.dst], &route_);
  // An eager send's bytes are copied into the kernel as it starts: past the sender's own link.
  if (t.eager) route_.erase(route_.begin());
  const double alpha = t.alpha_steps * cluster_.path_latency(route_);
  const int flow = net_.start_flow(route_, t.bytes, alpha, t.weight);
  ++transfers_started_;
  if (flow >= static_cast<int>(flow_owner_.size())) flow_owner_.resize(flow + 1, {-1, -1});
  flow_owner_[flow] = {collective, transfer};
  // Eager sends are done on their sender when the first starts (MPI completes them once the kernel
  // has their bytes), those queued behind it included.
  if (t.eager && !t.queued)
    for (int x = transfer; x >= 0; x = r.transfers[x].queued_next) transfer_done_on(collective, t.src, now());
}

// A sender's eager sends between nodes go out one after another in the order it posts them: the
// runtime's alltoallv posts to member + 1, + 2, ... (comm/mpi_communicator.cpp), and on the emulated
// cluster the kernel delivered two such messages to two ranks of another host mostly one after the
// other rather than side by side (docs/sim.md, "A sender's eager messages leave in order").
void Collectives::queue_eager_sends(Running* r) {
  const int p = static_cast<int>(r->devices.size());
  std::vector<std::vector<int>> by_sender(p);
  for (int x = 0; x < static_cast<int>(r->transfers.size()); ++x)
    if (r->transfers[x].eager) by_sender[r->transfers[x].src].push_back(x);
  for (int src = 0; src < p; ++src) {
    std::vector<int>& sends = by_sender[src];
    auto posted = [&](int x) { return (r->transfers[x].dst - src + p) % p; };
    std::sort(sends.begin(), sends.end(), [&](int a, int b) { return posted(a) < posted(b); });
    for (size_t k = 1; k < sends.size(); ++k) {
      r->transfers[sends[k - 1]].queued_next = sends[k];
      r->transfers[sends[k]].queued = true;
      ++r->transfers[sends[k]].deps_left;
    }
  }
}

void Collectives::transfer_done_on(int collective, int member, double t) {
  Running& r = running_[collective];
  if (--r.member_left[member] == 0 && !r.end_together && r.reached[member]) {
    r.member_end[member] = t;
    member_ends_.push_back({collective, member, t});
  }
}

double Collectives::next_event_time() {
  if (!finished_now_.empty()) return now();
  return net_.next_event_time();
}

std::vector<FinishedCollective> Collectives::advance(double t) {
  if (!finished_now_.empty() && t != now()) {
    throw std::logic_error(
        str_cat("sim::Collectives::advance: t (", t, ") skips collectives that finished at now (", now(), ")"));
  }
  const std::vector<int> ended_flows = net_.advance(t);
  // Owners first: the ended flows' ids are reused by the flows started below.
  std::vector<std::pair<int, int>> ended;
  ended.reserve(ended_flows.size());
  for (int f : ended_flows) ended.push_back(flow_owner_[f]);

  std::vector<int> done;
  done.swap(finished_now_);
  // Not a structured binding: the lambda below captures c, which clang before 16 cannot do with one.
  for (const std::pair<int, int>& owner : ended) {
    const int c = owner.first, x = owner.second;
    Running& r = running_[c];
    const Transfer& tr = r.transfers[x];
    --r.transfers_left;
    if (!tr.eager) transfer_done_on(c, tr.src, t);  // else done when it started (launch)
    transfer_done_on(c, tr.dst, t);
    for (int k = tr.carried_begin; k < tr.carried_end; ++k) transfer_done_on(c, r.carried[k], t);
    for (int s = tr.succ_begin; s < tr.succ_end; ++s) {
      const int next = r.successors[s];
      if (--r.transfers[next].deps_left == 0) launch(c, next);
    }
    if (tr.queued_next >= 0 && --r.transfers[tr.queued_next].deps_left == 0) launch(c, tr.queued_next);
    if (r.transfers_left == 0 && r.not_reached == 0) done.push_back(c);
  }
  std::sort(done.begin(), done.end());
  std::vector<FinishedCollective> finished;
  finished.reserve(done.size());
  for (int c : done) finished.push_back(finish(c));
  return finished;
}

void Collectives::reach(int collective, int member) {
  if (collective < 0 || collective >= static_cast<int>(running_.size()) || running_[collective].devices.empty())
    throw std::logic_error(str_cat("sim::Collectives::reach: collective ", collective, " is not running"));
  Running& r = running_[collective];
  if (member < 0 || member >= static_cast<int>(r.reached.size()) || r.reached[member])
    throw std::logic_error(str_cat("sim::Collectives::reach: member ", member, " is not one that has yet to reach it"));
  r.reached[member] = 1;
  --r.not_reached;
  const bool nothing_left = r.member_left[member] == 0;  // else its last transfer's end (or eager start) ends it
  for (int x = 0; x < static_cast<int>(r.transfers.size()); ++x) {
    Transfer& t = r.transfers[x];
    const int gates = (t.src == member) + (!t.eager && t.dst == member);
    if (gates > 0 && (t.deps_left -= gates) == 0) launch(collective, x);
  }
  if (nothing_left) {
    r.member_end[member] = now();
    member_ends_.push_back({collective, member, now()});
  }
  if (r.not_reached == 0 && r.transfers_left == 0) finished_now_.push_back(collective);
}

std::vector<MemberEnded> Collectives::take_member_ends() {
  std::vector<MemberEnded> out;
  out.swap(member_ends_);
  std::sort(out.begin(), out.end(), [](const MemberEnded& a, const MemberEnded& b) {
    if (a.time != b.time) return a.time < b.time;
    return a.collective != b.collective ? a.collective < b.collective : a.member < b.member;
  });
  return out;
}

FinishedCollective Collectives::finish(int collective) {
  Running& r = running_[collective];
  FinishedCollective f;
  f.id = collective;
  f.start = r.start;
  f.end = now();
  if (r.end_together) {
    for (int m = 0; m < static_cast<int>(r.member_end.size()); ++m) {
      r.member_end[m] = f.end;
      member_ends_.push_back({collective, m, f.end});
    }
  }
  f.member_end = std::move(r.member_end);
  r = Running{};
  free_ids_.push_back(collective);
  --in_flight_;
  return f;
}

}  // namespace moe::sim
