// The simulator's network: an event-driven, flow-level model of bytes moving over directed links
// (a Cluster's, or any list of links). A flow is `bytes` over a path of links. It starts at now(),
// spends its start latency alpha (by default the sum of its links' latencies) without using bandwidth,
// then transfers at the rate max-min fair sharing gives it: on every link the flows crossing it share
// its bandwidth, and no flow can go faster without slowing one that is no faster than it. It ends when
// its bytes have crossed. collectives.h builds collectives on top of this.
//
// Rates change only when a flow starts transferring or ends, and only for the flows connected to it
// (transitively, through shared links); when flows only ended, only for those at least as fast as the
// slowest that ended (slower ones cannot gain; equal up to rounding counts as as fast) and reached from
// a link that was saturated (a link with slack was nobody's bottleneck): see settle(). Only that region
// is recomputed, lazily,
// once for all the changes made at the same simulated time. The result equals recomputing every flow
// from scratch (up to rounding); tests/test_sim_network.cpp checks it on random flow sets. Cost per
// event: the region's flows times their path lengths, plus a sort of the region's links.
//
// Driving it (an executor's loop):
//   int f = net.start_flow(path, bytes);          // at net.now()
//   double t = std::min(net.next_event_time(), t_other);
//   for (int done : net.advance(t)) ...            // flows that ended at t; the clock is now t
//
// Determinism: no randomness, no iteration over unordered containers; simultaneous events are
// handled in flow-id order, and flow ids are reused in a fixed order. The same calls give the same
// results bit for bit.
// Units: seconds, bytes, bytes/s. Thread safety: none (one thread drives a Network).
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include "sim/cluster.h"

namespace moe::sim {

class Network {
 public:
  // The links of `cluster` (same ids).
  explicit Network(const Cluster& cluster);
  // Arbitrary links: bandwidth[l] (> 0) and latency[l] (>= 0) of link l. REQUIRES: equal sizes.
  Network(std::vector<double> bandwidth, std::vector<double> latency);

  int n_links() const { return static_cast<int>(links_.size()); }
  double now() const { return now_; }

  // Starts a flow of `bytes` over `path` (link ids in order) at now(); it starts transferring at
  // now() + alpha (at once when alpha is 0). The default alpha is the sum of the path's link
  // latencies. A flow with no bytes or an empty path ends at now() + alpha. Returns its id; the id
  // of an ended flow is reused by a later start_flow. REQUIRES: links in range, no link twice, bytes
  // and alpha finite and >= 0 (std::logic_error).
  int start_flow(const std::vector<int>& path, double bytes);
  int start_flow(const std::vector<int>& path, double bytes, double alpha);
  // Weighted: the flow stands for `weight` equal flows (an aggregate of several transfers,
  // collectives.h), so on a shared link it gets `weight` shares of the max-min fair share (weighted
  // max-min fairness: rates are weight times a level that water-filling raises evenly). REQUIRES:
  // weight finite and > 0 (std::logic_error).
  int start_flow(const std::vector<int>& path, double bytes, double alpha, double weight);

  // The time of the next event (a flow starting to transfer or ending); +inf when no flow is live.
  double next_event_time();
  // Moves the clock to t and returns the flows that ended at t, by ascending id (their ids become
  // free). REQUIRES: now() <= t <= next_event_time() (std::logic_error): events are never skipped.
  std::vector<int> advance(double t);

  // A live flow's current rate (0 while in its start latency). REQUIRES: the flow is live.
  double rate(int flow);
  bool live(int flow) const { return flow >= 0 && flow < static_cast<int>(flows_.size()) && flows_[flow].live; }
  int live_flows() const { return live_count_; }

  // Bytes link l has carried since the network was made, up to now(): utilisation over [t0, t1] is
  // the difference of two readings over (bandwidth * (t1 - t0)).
  double link_bytes(int link) const;
  // The sum of the rates of the flows on link l now.
  double link_load(int link);
  // Changes link l's bandwidth from now() on (a link whose capacity varies: on a CPU cluster, the
  // cores the ranks' communication lanes get, executor.h). The flows crossing it get new max-min rates
  // as when a flow starts; at 0 they stall (no end time) until it rises again. REQUIRES: l in range,
  // bandwidth finite and >= 0 (std::logic_error).
  void set_bandwidth(int link, double bandwidth);
  double bandwidth(int link) const { return links_.at(link).bandwidth; }

  // Flow rates recomputed so far, over all recomputations: what incremental recomputation saves.
  uint64_t rates_computed() const { return rates_computed_; }

 private:
  struct Hop {
    int link;
    int slot;  // this flow's index in the link's list while it transfers
  };
  static constexpr int kInlineHops = 10;
  struct Flow {
    std::vector<Hop> long_path;  // the path when it has more than kInlineHops links
    double bytes_left = 0;  // at `updated`
    double updated = 0;
    double event_time = 0;  // start of transfer while waiting, end while transferring
    bool transferring = false;
    bool live = false;
  };
  // What settle() reads of a flow when it finds it, packed together (by flow id): its rate, weight,
  // and its path when it is short (most are).
  struct alignas(64) Hot {
    double rate = 0;
    double weight = 1;  // shares of a link's fair share (see start_flow)
    int n_hops = 0;
    Hop hops[kInlineHops];
  };
  std::span<Hop> path(int id) {
    Hot& h = hot_[id];
    return {h.n_hops > kInlineHops ? flows_[id].long_path.data() : h.hops, static_cast<size_t>(h.n_hops)};
  }
  struct LinkState {
    double bandwidth = 0;
    double latency = 0;
    std::vector<std::pair<int, int>> flows;  // transferring flows: (flow id, index of this link in its path)
    double load = 0;                         // sum of their rates
    double carried = 0;                      // bytes carried up to load_since
    double load_since = 0;
    bool dirty = false;
    // At the last settle(), whether the link had slack (load below bandwidth, a margin far above
    // rounding): such a link was no flow's bottleneck (see settle()).
    bool slack = true;
  };

  // The live flows' event times, as a tournament tree over flow ids: leaf i holds flow i's time (+inf
  // when it has none), each inner node the minimum of its two children. A flow's time moves with a
  // walk up that stops at the first node whose minimum did not change, and the flows due at t come
  // out of one descent in id order, which is the (time, id) order events are handled in, as every due
  // time is t.
  class EventQueue {
   public:
    double top_time() const { return tree_.empty() ? std::numeric_limits<double>::infinity() : tree_[1]; }
    void set(int flow, double time);  // insert or move; +inf takes it out
    // Takes out every flow with time <= t (finite) and puts them in `out` by ascending id.
    void pop_until(double t, std::vector<int>* out);

   private:
    std::vector<double> tree_;  // [1, 2n): node i has children 2i and 2i+1; flow f is leaf n + f
    size_t n_ = 0;              // leaves, a power of two (0 before the first set)
    std::vector<size_t> stack_, taken_;  // pop_until()'s scratch: nodes to visit, inner nodes taken from
  };

  void check_flow(const char* fn, int flow) const;
  // The flow joins its links' lists; its links become dirty.
  void begin_transfer(int id);
  void mark_dirty(int id);
  // Recomputes the rates of the flows the changes since the last settle() can affect (max-min,
  // water-filling): see network.cpp.
  void settle();

  std::vector<LinkState> links_;
  std::vector<Flow> flows_;
  std::vector<Hot> hot_;  // by flow id
  std::vector<int> free_ids_;  // ended flows' ids, reused last-freed first
  int live_count_ = 0;
  EventQueue events_;
  std::vector<int> dirty_links_;
  double now_ = 0;
  uint64_t rates_computed_ = 0;

  // Scratch of settle(), kept to avoid allocating per event. Marks compare to `epoch_`.
  uint64_t epoch_ = 0;
  struct LinkScratch {
    uint64_t mark = 0;  // in the region (or seen by start_flow's check)
    int index = 0;      // its index in the region, when marked
  };
  std::vector<LinkScratch> scratch_;  // by link
  // By flow id: (region_epoch_ << 32) | its region index while in settle()'s region. settle() reads
  // it for every (link, flow) pair of the region; 8 bytes a flow stay in cache where Hot would not.
  std::vector<uint64_t> region_tag_;
  uint32_t region_epoch_ = 0;
  std::vector<int> region_links_, region_flows_;  // ids, by region index
  // The region in compact form: links and flows by region index, each link's flows and each flow's
  // links as region indices (CSR), and water-filling's state.
  struct RegionLink {
    double cap_left;        // capacity not yet given to a flow
    double unfixed_weight;  // of its flows not fixed yet
    double new_load;        // the sum of the rates set on it (frozen flows' included)
    int unfixed;            // its flows not fixed yet
    int flows_begin, flows_end;  // in r_link_flows_
  };
  struct RegionFlow {
    double weight;
    double new_rate;
    int links_begin, n_links;  // in r_flow_links_
    bool fixed;                // rate fixed by water-filling
  };
  std::vector<RegionLink> r_links_;
  std::vector<RegionFlow> r_flows_;
  std::vector<int> r_link_flows_, r_flow_links_;
  // Water-filling's key: a link's fair share, ordered by share, then link id (ties broken by id, so
  // the order of fixing never depends on anything but the inputs).
  struct ShareKey {
    double share;
    int link;
    int index;  // region index
    static bool before(const ShareKey& a, const ShareKey& b) {
      return a.share < b.share || (a.share == b.share && a.link < b.link);
    }
  };
  std::vector<ShareKey> share_keys_;  // every region link's first key, sorted
  std::vector<ShareKey> share_heap_;  // keys put back, a min-heap
  std::vector<int> due_;          // advance()'s scratch: the flows with an event at t
  // Since the last settle(): whether a flow started transferring, the smallest level of those that ended.
  bool started_since_settle_ = false;
  double min_ended_level_ = std::numeric_limits<double>::infinity();  // rate / weight
};

}  // namespace moe::sim
