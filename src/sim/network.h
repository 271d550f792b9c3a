// The simulator's network: an event-driven, flow-level model of bytes moving over directed links
// (a Cluster's, or any list of links). A flow is `bytes` over a path of links. It starts at now(),
// spends its start latency alpha (by default the sum of its links' latencies) without using bandwidth,
// then transfers at the rate max-min fair sharing gives it: on every link the flows crossing it share
// its bandwidth, and no flow can go faster without slowing one that is no faster than it. It ends when
// its bytes have crossed. collectives.h builds collectives on top of this.
//
// Rates change only when a flow starts transferring or ends, and only for the flows connected to it
// (transitively, through shared links); when flows only ended, only for those at least as fast as the
// slowest that ended (slower ones cannot gain: see settle()). Only that region is recomputed, lazily,
// once for all the changes made at the same simulated time. The result equals recomputing every flow
// from scratch (up to rounding); tests/test_sim_network.cpp checks it on random flow sets. Cost per
// event: the region's flows times their path lengths, times a log for the event queue.
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
  int start_flow(std::vector<int> path, double bytes);
  int start_flow(std::vector<int> path, double bytes, double alpha);
  // Weighted: the flow stands for `weight` equal flows (an aggregate of several transfers,
  // collectives.h), so on a shared link it gets `weight` shares of the max-min fair share (weighted
  // max-min fairness: rates are weight times a level that water-filling raises evenly). REQUIRES:
  // weight finite and > 0 (std::logic_error).
  int start_flow(std::vector<int> path, double bytes, double alpha, double weight);

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
  // What settle() reads of a flow for every link it crosses, packed in one cache line's worth
  // (by flow id): its rate, weight, and settle()'s scratch. Marks compare to `epoch_`.
  // The path lives here too when it is short (most are), so settle() finds it in the same lines.
  struct alignas(64) Hot {
    double rate = 0;
    double weight = 1;  // shares of a link's fair share (see start_flow)
    double new_rate = 0;
    uint64_t mark = 0;   // in settle()'s region
    uint64_t fixed = 0;  // rate fixed by water-filling
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
  };

  // Min-heap of live flows by (event_time, id), indexed by flow id so an entry can move. Entries carry
  // their time, so comparisons read only the heap.
  class EventQueue {
   public:
    bool empty() const { return heap_.empty(); }
    int top() const { return heap_.front().flow; }
    double top_time() const { return heap_.front().time; }
    void set(int flow, double time);  // insert or move
    void pop();

   private:
    struct Entry {
      double time;
      int flow;
    };
    static bool less(const Entry& a, const Entry& b) {
      return a.time < b.time || (a.time == b.time && a.flow < b.flow);
    }
    void up(size_t i, Entry e);
    void down(size_t i, Entry e);
    void place(size_t i, const Entry& e) {
      heap_[i] = e;
      pos_[e.flow] = static_cast<int>(i);
    }
    std::vector<Entry> heap_;
    std::vector<int> pos_;  // by flow id; -1 when absent
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
    uint64_t mark = 0;     // in the region (or seen by start_flow's check)
    double cap_left = 0;   // capacity not yet given to a flow
    double unfixed_weight = 0;  // of its flows not fixed yet
    double new_load = 0;   // the sum of the rates set on it
    int unfixed = 0;       // its flows not fixed yet
  };
  std::vector<LinkScratch> scratch_;  // by link
  std::vector<int> region_links_, region_flows_;
  std::vector<std::pair<double, int>> share_heap_;  // water-filling's heap: (share, link)
  // Since the last settle(): whether a flow started transferring, the smallest level of those that ended.
  bool started_since_settle_ = false;
  double min_ended_level_ = std::numeric_limits<double>::infinity();  // rate / weight
};

}  // namespace moe::sim
