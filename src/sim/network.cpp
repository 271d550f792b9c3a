// Flow-level network with incremental max-min fair sharing (network.h).
#include "sim/network.h"
#include "util/str_cat.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <utility>
#include <sstream>
#include <stdexcept>

namespace moe::sim {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// A link's fair share during water-filling, ordered by share, then link id (ties broken by id, so the
// order of fixing never depends on anything but the inputs).
using Share = std::pair<double, int>;  // (share, link)
using ShareAfter = std::greater<Share>;

std::vector<double> bandwidths(const Cluster& cluster) {
  std::vector<double> v;
  for (const Link& l : cluster.links()) v.push_back(l.bandwidth);
  return v;
}

std::vector<double> latencies(const Cluster& cluster) {
  std::vector<double> v;
  for (const Link& l : cluster.links()) v.push_back(l.latency);
  return v;
}

}  // namespace

Network::Network(const Cluster& cluster) : Network(bandwidths(cluster), latencies(cluster)) {}

Network::Network(std::vector<double> bandwidth, std::vector<double> latency) {
  if (bandwidth.size() != latency.size()) {
    throw std::logic_error(str_cat("sim::Network: ", bandwidth.size(), " bandwidths but ", latency.size(), " latencies"));
  }
  links_.resize(bandwidth.size());
  for (size_t l = 0; l < links_.size(); ++l) {
    if (!std::isfinite(bandwidth[l]) || bandwidth[l] <= 0 || !std::isfinite(latency[l]) || latency[l] < 0) {
      throw std::logic_error(str_cat("sim::Network: link ", l, " has bandwidth ", bandwidth[l], " and latency ", latency[l],
                                 " (need > 0 and >= 0)"));
    }
    links_[l].bandwidth = bandwidth[l];
    links_[l].latency = latency[l];
  }
  scratch_.assign(links_.size(), LinkScratch{});
}

int Network::start_flow(std::vector<int> path, double bytes) {
  double alpha = 0;
  for (int l : path) {
    if (l < 0 || l >= n_links()) throw std::logic_error(str_cat("sim::Network::start_flow: link ", l, " out of range"));
    alpha += links_[l].latency;
  }
  return start_flow(std::move(path), bytes, alpha);
}

int Network::start_flow(std::vector<int> path, double bytes, double alpha) {
  return start_flow(std::move(path), bytes, alpha, 1.0);
}

int Network::start_flow(std::vector<int> path, double bytes, double alpha, double weight) {
  if (!std::isfinite(weight) || !(weight > 0))
    throw std::logic_error(str_cat("sim::Network::start_flow: weight (", weight, ") must be finite and > 0"));
  if (!std::isfinite(bytes) || bytes < 0 || !std::isfinite(alpha) || alpha < 0) {
    throw std::logic_error(
        str_cat("sim::Network::start_flow: bytes (", bytes, ") and alpha (", alpha, ") must be finite and >= 0"));
  }
  ++epoch_;
  for (int l : path) {
    if (l < 0 || l >= n_links()) throw std::logic_error(str_cat("sim::Network::start_flow: link ", l, " out of range"));
    if (scratch_[l].mark == epoch_)
      throw std::logic_error(str_cat("sim::Network::start_flow: link ", l, " twice in the path"));
    scratch_[l].mark = epoch_;
  }
  int id;
  if (!free_ids_.empty()) {
    id = free_ids_.back();
    free_ids_.pop_back();
  } else {
    id = static_cast<int>(flows_.size());
    flows_.emplace_back();
    hot_.emplace_back();
  }
  Flow& f = flows_[id];
  Hot& hot = hot_[id];
  hot.n_hops = static_cast<int>(path.size());
  f.long_path.clear();
  if (hot.n_hops > kInlineHops) f.long_path.resize(path.size());
  {
    std::span<Hop> hops = this->path(id);
    for (size_t i = 0; i < path.size(); ++i) hops[i] = {path[i], -1};
  }
  f.bytes_left = bytes;
  f.updated = now_;
  hot_[id].rate = 0;
  hot_[id].weight = weight;
  f.transferring = false;
  f.live = true;
  ++live_count_;
  if (alpha == 0 && bytes > 0 && hot.n_hops > 0) {
    begin_transfer(id);
  } else {
    f.event_time = now_ + alpha;
    events_.set(id, f.event_time);
  }
  return id;
}

void Network::begin_transfer(int id) {
  Flow& f = flows_[id];
  f.transferring = true;
  f.updated = now_;
  std::span<Hop> hops = path(id);
  for (size_t i = 0; i < hops.size(); ++i) {
    auto& list = links_[hops[i].link].flows;
    hops[i].slot = static_cast<int>(list.size());
    list.emplace_back(id, static_cast<int>(i));
  }
  // It gets a rate, and an end time in the event queue, at the next settle().
  mark_dirty(id);
  started_since_settle_ = true;
}

double Network::next_event_time() {
  settle();
  return events_.empty() ? kInf : events_.top_time();
}

std::vector<int> Network::advance(double t) {
  const double next = next_event_time();
  if (!(t >= now_) || t > next) {
    throw std::logic_error(
        str_cat("sim::Network::advance: t (", t, ") must be in [now (", now_, "), next event (", next, ")]"));
  }
  now_ = t;
  std::vector<int> ended;  // popped in (time, id) order, and every popped time is t: ascending ids
  while (!events_.empty() && events_.top_time() <= t) {
    const int id = events_.top();
    events_.pop();
    Flow& f = flows_[id];
    if (f.transferring) {
      for (const Hop& h : path(id)) {
        // Swap-remove from the link's list; the flow moved into the hole learns its new slot.
        auto& list = links_[h.link].flows;
        const auto last = list.back();
        list[h.slot] = last;
        path(last.first)[last.second].slot = h.slot;
        list.pop_back();
      }
      mark_dirty(id);
      min_ended_level_ = std::min(min_ended_level_, hot_[id].rate / hot_[id].weight);
      ended.push_back(id);
    } else if (f.bytes_left == 0 || hot_[id].n_hops == 0) {
      ended.push_back(id);
    } else {
      begin_transfer(id);  // its start latency is over
    }
  }
  for (int id : ended) {
    Flow& f = flows_[id];
    f.live = false;
    f.transferring = false;
    hot_[id].rate = 0;
    f.long_path.clear();
    hot_[id].n_hops = 0;
    --live_count_;
  }
  // Freed last-first, so the smallest ended id is reused first.
  for (auto it = ended.rbegin(); it != ended.rend(); ++it) free_ids_.push_back(*it);
  return ended;
}

void Network::check_flow(const char* fn, int flow) const {
  if (!live(flow)) throw std::logic_error(str_cat("sim::Network::", fn, ": flow ", flow, " is not live"));
}

double Network::rate(int flow) {
  check_flow("rate", flow);
  settle();
  return hot_[flow].rate;
}

double Network::link_bytes(int link) const {
  const LinkState& l = links_.at(link);
  return l.carried + l.load * (now_ - l.load_since);
}

double Network::link_load(int link) {
  settle();
  return links_.at(link).load;
}

void Network::mark_dirty(int id) {
  for (const Hop& h : path(id)) {
    LinkState& l = links_[h.link];
    if (!l.dirty) {
      l.dirty = true;
      dirty_links_.push_back(h.link);
    }
  }
}

void Network::settle() {
  if (dirty_links_.empty()) return;
  ++epoch_;
  // Flows below `floor` keep their rates. When flows only ended since the last settle, that is every
  // flow slower than the slowest that ended: in water-filling, removing a flow of rate r changes
  // nothing below level r (the links it crossed only gain share, the others are untouched until then).
  // A flow that starts transferring can change flows of any rate, so then nothing is frozen.
  // (With weights, "rate" reads "level", rate / weight: water-filling raises levels evenly.)
  const double floor = started_since_settle_ ? 0.0 : min_ended_level_;
  started_since_settle_ = false;
  min_ended_level_ = kInf;

  // The region: every link reachable from a dirty link through flows not frozen, and those flows.
  // Regions that no dirty link reaches face the same capacities as before and keep their rates.
  region_links_.clear();
  region_flows_.clear();
  for (int l : dirty_links_) {
    links_[l].dirty = false;
    if (scratch_[l].mark != epoch_) {
      scratch_[l].mark = epoch_;
      region_links_.push_back(l);
    }
  }
  dirty_links_.clear();
  // Water-filling (below) starts from what the frozen flows leave of each link; that is summed in
  // the same pass, as a flow on a region link is in the region exactly when it is not below `floor`.
  Hot* const hot = hot_.data();
  const uint64_t epoch = epoch_;
  std::vector<Share>& heap = share_heap_;  // (share, link): ties by link id
  heap.clear();
  for (size_t i = 0; i < region_links_.size(); ++i) {
    const int l = region_links_[i];
    double cap = links_[l].bandwidth;
    double frozen_load = 0;
    int unfixed = 0;
    double unfixed_weight = 0;
    for (const auto& [f, hop] : links_[l].flows) {
      Hot& h = hot[f];
      if (h.mark != epoch) {
        if (floor > 0 && h.rate / h.weight < floor) {
          cap -= h.rate;
          frozen_load += h.rate;
          continue;
        }
        h.mark = epoch;
        region_flows_.push_back(f);
        for (const Hop& hp : path(f)) {
          if (scratch_[hp.link].mark != epoch) {
            scratch_[hp.link].mark = epoch;
            region_links_.push_back(hp.link);
          }
        }
      }
      ++unfixed;
      unfixed_weight += h.weight;
    }
    LinkScratch& ls = scratch_[l];
    ls.cap_left = cap;
    ls.new_load = frozen_load;
    ls.unfixed = unfixed;
    ls.unfixed_weight = unfixed_weight;
    if (unfixed > 0) heap.push_back({std::max(0.0, cap / unfixed_weight), l});
  }

  // Water-filling over the region, on what the frozen flows leave of each link: repeatedly take the
  // link with the smallest fair share (capacity left over its flows not yet fixed), fix those flows at
  // that share and take it out of the other links they cross. Fixing flows at the smallest share never
  // lowers another link's share, so a link's key in the heap is a lower bound of its share: a popped
  // link whose share has grown since is pushed back with it, and a link is processed only when its key
  // is its share and the smallest (ties by link id). That takes each flow to its max-min rate with one
  // heap entry per link, not one per update.
  std::make_heap(heap.begin(), heap.end(), ShareAfter());
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), ShareAfter());
    const int l = heap.back().second;
    const double key = heap.back().first;
    heap.pop_back();
    if (scratch_[l].unfixed == 0) continue;
    const double share = std::max(0.0, scratch_[l].cap_left / scratch_[l].unfixed_weight);
    if (share != key) {
      heap.push_back({share, l});
      std::push_heap(heap.begin(), heap.end(), ShareAfter());
      continue;
    }
    for (const auto& [f, hop] : links_[l].flows) {
      Hot& h = hot[f];
      if (h.mark != epoch || h.fixed == epoch) continue;
      h.fixed = epoch;
      const double w = h.weight;
      h.new_rate = w * share;
      for (const Hop& hp : path(f)) {
        LinkScratch& ls = scratch_[hp.link];
        ls.cap_left -= w * share;
        ls.new_load += w * share;
        --ls.unfixed;
        ls.unfixed_weight -= w;
      }
    }
  }

  // Apply: links account the bytes carried at their old load; flows whose rate changed account their
  // progress at the old rate and get a new end time; links take their load from water-filling (their
  // frozen flows' rates plus the rates fixed on them).
  for (int l : region_links_) {
    LinkState& link = links_[l];
    link.carried += link.load * (now_ - link.load_since);
    link.load_since = now_;
  }
  for (int id : region_flows_) {
    Hot& h = hot[id];
    const double r = h.new_rate;
    if (r == h.rate) continue;
    Flow& f = flows_[id];
    f.bytes_left = std::max(0.0, f.bytes_left - h.rate * (now_ - f.updated));
    f.updated = now_;
    h.rate = r;
    f.event_time = r > 0 ? now_ + f.bytes_left / r : kInf;
    events_.set(id, f.event_time);
  }
  for (int l : region_links_) links_[l].load = scratch_[l].new_load;
  rates_computed_ += region_flows_.size();
}

// A 4-ary heap: half the depth of a binary one, and a node's children share a cache line or two.
void Network::EventQueue::up(size_t i, Entry e) {
  while (i > 0) {
    const size_t parent = (i - 1) / 4;
    if (!less(e, heap_[parent])) break;
    place(i, heap_[parent]);
    i = parent;
  }
  place(i, e);
}

void Network::EventQueue::down(size_t i, Entry e) {
  const size_t n = heap_.size();
  while (true) {
    const size_t first = 4 * i + 1;
    if (first >= n) break;
    size_t child = first;
    const size_t end = std::min(first + 4, n);
    for (size_t c = first + 1; c < end; ++c) {
      if (less(heap_[c], heap_[child])) child = c;
    }
    if (!less(heap_[child], e)) break;
    place(i, heap_[child]);
    i = child;
  }
  place(i, e);
}

void Network::EventQueue::set(int flow, double time) {
  if (flow >= static_cast<int>(pos_.size())) pos_.resize(flow + 1, -1);
  const Entry e{time, flow};
  if (pos_[flow] < 0) {
    heap_.push_back(e);
    up(heap_.size() - 1, e);
  } else {
    const size_t i = static_cast<size_t>(pos_[flow]);
    if (i > 0 && less(e, heap_[(i - 1) / 4])) {
      up(i, e);
    } else {
      down(i, e);
    }
  }
}

void Network::EventQueue::pop() {
  pos_[heap_.front().flow] = -1;
  const Entry last = heap_.back();
  heap_.pop_back();
  if (heap_.empty()) return;
  down(0, last);
}

}  // namespace moe::sim
