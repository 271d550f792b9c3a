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
    region_tag_.push_back(0);
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
  // Every event at t, in (time, id) order, and every such time is t: ascending ids. Handling them
  // adds no event (a flow that starts transferring gets its end time at the next settle()), so they
  // can be taken out at once.
  std::vector<int> ended;
  events_.pop_until(t, &due_);
  for (const int id : due_) {
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

void Network::set_bandwidth(int link, double bandwidth) {
  if (link < 0 || link >= n_links())
    throw std::logic_error(str_cat("sim::Network::set_bandwidth: link ", link, " out of range"));
  if (!std::isfinite(bandwidth) || bandwidth < 0)
    throw std::logic_error(str_cat("sim::Network::set_bandwidth: bandwidth (", bandwidth, ") must be finite and >= 0"));
  LinkState& l = links_[link];
  if (l.bandwidth == bandwidth) return;
  l.bandwidth = bandwidth;
  // Recomputed with nothing frozen, as after a start: a change of capacity can move flows of any rate.
  if (!l.dirty) {
    l.dirty = true;
    dirty_links_.push_back(link);
  }
  started_since_settle_ = true;
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
  if (++region_epoch_ == 0) {  // the 32-bit epoch wrapped: old tags could match again
    std::fill(region_tag_.begin(), region_tag_.end(), 0);
    region_epoch_ = 1;
  }
  // Flows below `floor` keep their rates. When flows only ended since the last settle, that is every
  // flow slower than the slowest that ended: in water-filling, removing a flow of rate r changes
  // nothing below level r (the links it crossed only gain share, the others are untouched until then).
  // A flow that starts transferring can change flows of any rate, so then nothing is frozen.
  // (With weights, "rate" reads "level", rate / weight: water-filling raises levels evenly.)
  // The floor sits a margin far above rounding below the slowest ended level: flows at that same
  // level (bottlenecked with an ended flow) can gain, and their levels, computed at other links or
  // divided by other weights, may come out a few ulps below it; freezing those would keep them slow
  // for good (seen: a flow left at a ninth of its max-min rate).
  const double floor = started_since_settle_ ? 0.0 : min_ended_level_ * (1 - 1e-9);
  started_since_settle_ = false;
  min_ended_level_ = kInf;

  // The region: every link reachable from a seed link through flows not frozen, and those flows.
  // Regions that no seed reaches face the same capacities as before and keep their rates. The seeds
  // are the dirty links, except, when flows only ended, those that had slack before (load below
  // bandwidth, with a margin far above rounding): such a link was no flow's bottleneck, so what the
  // ended flows free there lets no flow go faster. (The flows kept outside the region still have
  // their bottleneck links, saturated and unchanged; the region's flows stay at levels >= floor, as
  // their old rates remain feasible; so the result is max-min fair.) A slack link that the region
  // reaches anyway is recomputed with it; the others only update their load (slack_links_).
  region_links_.clear();
  region_flows_.clear();
  slack_links_.clear();
  r_links_.clear();
  r_flows_.clear();
  r_link_flows_.clear();
  r_flow_links_.clear();
  const uint64_t epoch = epoch_;
  // Marks a link as in the region and gives it its region index.
  auto add_link = [&](int l) {
    scratch_[l].mark = epoch;
    scratch_[l].index = static_cast<int>(region_links_.size());
    region_links_.push_back(l);
  };
  for (int l : dirty_links_) {
    links_[l].dirty = false;
    if (scratch_[l].mark != epoch) {
      if (floor > 0 && links_[l].load < links_[l].bandwidth * (1 - 1e-9)) {
        slack_links_.push_back(l);
        continue;
      }
      add_link(l);
    }
  }
  dirty_links_.clear();
  // One pass over the region links' flow lists finds the region and copies it into compact arrays
  // (r_*: by region index, links and flows in the order found, each link's flows in list order), so
  // that water-filling, which visits every (link, flow) pair again, stays in a few cache-resident
  // arrays instead of the network-wide ones. Water-filling starts from what the frozen flows leave of
  // each link; that is summed in the same pass, as a flow on a region link is in the region exactly
  // when it is not below `floor`.
  Hot* const hot = hot_.data();
  uint64_t* const tag = region_tag_.data();
  const uint64_t in_region = static_cast<uint64_t>(region_epoch_) << 32;
  std::vector<ShareKey>& heap = share_heap_;
  heap.clear();
  for (size_t i = 0; i < region_links_.size(); ++i) {
    const int l = region_links_[i];
    double cap = links_[l].bandwidth;
    double frozen_load = 0;
    int unfixed = 0;
    double unfixed_weight = 0;
    const int begin = static_cast<int>(r_link_flows_.size());
    for (const auto& [f, hop] : links_[l].flows) {
      int index;
      if ((tag[f] & ~uint64_t{0xffffffff}) == in_region) {
        index = static_cast<int>(tag[f] & 0xffffffff);
      } else {
        const Hot& h = hot[f];
        if (floor > 0 && h.rate / h.weight < floor) {
          cap -= h.rate;
          frozen_load += h.rate;
          continue;
        }
        index = static_cast<int>(region_flows_.size());
        tag[f] = in_region | static_cast<uint32_t>(index);
        region_flows_.push_back(f);
        const std::span<const Hop> hops = path(f);
        r_flows_.push_back({h.weight, 0, static_cast<int>(r_flow_links_.size()), static_cast<int>(hops.size()), false});
        for (const Hop& hp : hops) {
          if (scratch_[hp.link].mark != epoch) add_link(hp.link);
          r_flow_links_.push_back(scratch_[hp.link].index);
        }
      }
      r_link_flows_.push_back(index);
      ++unfixed;
      unfixed_weight += r_flows_[index].weight;
    }
    r_links_.push_back({cap, unfixed_weight, frozen_load, unfixed, begin, static_cast<int>(r_link_flows_.size())});
    if (unfixed > 0) heap.push_back({std::max(0.0, cap / unfixed_weight), l, static_cast<int>(i)});
  }

  // Water-filling over the region, on what the frozen flows leave of each link: repeatedly take the
  // link with the smallest fair share (capacity left over its flows not yet fixed), fix those flows at
  // that share and take it out of the other links they cross. Fixing flows at the smallest share never
  // lowers another link's share, so a link's key in the heap is a lower bound of its share: a popped
  // link whose share has grown since is pushed back with it, and a link is processed only when its key
  // is its share and the smallest (ties by link id). That takes each flow to its max-min rate with one
  // heap entry per link, not one per update.
  std::make_heap(heap.begin(), heap.end(), ShareKey::after);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), ShareKey::after);
    const ShareKey top = heap.back();
    heap.pop_back();
    RegionLink& rl = r_links_[top.index];
    if (rl.unfixed == 0) continue;
    const double share = std::max(0.0, rl.cap_left / rl.unfixed_weight);
    if (share != top.share) {
      heap.push_back({share, top.link, top.index});
      std::push_heap(heap.begin(), heap.end(), ShareKey::after);
      continue;
    }
    for (int k = rl.flows_begin; k < rl.flows_end; ++k) {
      RegionFlow& rf = r_flows_[r_link_flows_[k]];
      if (rf.fixed) continue;
      rf.fixed = true;
      const double w = rf.weight;
      rf.new_rate = w * share;
      for (int p = rf.links_begin; p < rf.links_begin + rf.n_links; ++p) {
        RegionLink& x = r_links_[r_flow_links_[p]];
        x.cap_left -= w * share;
        x.new_load += w * share;
        --x.unfixed;
        x.unfixed_weight -= w;
      }
    }
  }

  // Apply: links account the bytes carried at their old load and take their load from water-filling
  // (their frozen flows' rates plus the rates fixed on them); flows whose rate changed account their
  // progress at the old rate and get a new end time.
  for (size_t i = 0; i < region_links_.size(); ++i) {
    LinkState& link = links_[region_links_[i]];
    link.carried += link.load * (now_ - link.load_since);
    link.load_since = now_;
    link.load = r_links_[i].new_load;
  }
  // Many new end times at once (a collective's flows start or end together) are cheaper to place by
  // reordering the whole queue once than by moving each.
  const bool reorder = region_flows_.size() * 8 > static_cast<size_t>(events_.size());
  for (size_t j = 0; j < region_flows_.size(); ++j) {
    const int id = region_flows_[j];
    Hot& h = hot[id];
    const double r = r_flows_[j].new_rate;
    if (r == h.rate) continue;
    Flow& f = flows_[id];
    f.bytes_left = std::max(0.0, f.bytes_left - h.rate * (now_ - f.updated));
    f.updated = now_;
    h.rate = r;
    f.event_time = r > 0 ? now_ + f.bytes_left / r : kInf;
    if (reorder) {
      events_.set_unordered(id, f.event_time);
    } else {
      events_.set(id, f.event_time);
    }
  }
  if (reorder) events_.reorder();
  for (int l : slack_links_) {
    if (scratch_[l].mark == epoch) continue;  // recomputed in the region
    LinkState& link = links_[l];
    link.carried += link.load * (now_ - link.load_since);
    link.load_since = now_;
    double load = 0;
    for (const auto& [f, hop] : link.flows) load += hot[f].rate;
    link.load = load;
  }
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

void Network::EventQueue::set_unordered(int flow, double time) {
  if (flow >= static_cast<int>(pos_.size())) pos_.resize(flow + 1, -1);
  if (pos_[flow] < 0) {
    pos_[flow] = static_cast<int>(heap_.size());
    heap_.push_back({time, flow});
  } else {
    heap_[pos_[flow]].time = time;
  }
}

void Network::EventQueue::reorder() {
  // Floyd's heap construction: sift down every inner node, last first.
  for (size_t i = heap_.size() / 4 + 1; i-- > 0;) {
    if (i < heap_.size()) down(i, heap_[i]);
  }
}

void Network::EventQueue::pop_until(double t, std::vector<int>* out) {
  out->clear();
  if (heap_.empty() || heap_.front().time > t) return;
  // The entries with time <= t form a subtree at the root: find them without moving anything.
  taken_.clear();
  stack_.assign(1, 0);
  while (!stack_.empty()) {
    const size_t i = stack_.back();
    stack_.pop_back();
    if (heap_[i].time > t) continue;
    taken_.push_back(heap_[i]);
    for (size_t c = 4 * i + 1; c < std::min(4 * i + 5, heap_.size()); ++c) stack_.push_back(c);
  }
  std::sort(taken_.begin(), taken_.end(), [](const Entry& a, const Entry& b) { return less(a, b); });
  for (const Entry& e : taken_) out->push_back(e.flow);
  // Few: pop them one by one. Many: drop them and rebuild the heap from the rest.
  if (taken_.size() * 8 <= heap_.size()) {
    for (size_t k = 0; k < taken_.size(); ++k) pop();
    return;
  }
  size_t kept = 0;
  for (const Entry& e : heap_) {
    if (e.time > t) {
      place(kept++, e);
    } else {
      pos_[e.flow] = -1;
    }
  }
  heap_.resize(kept);
  reorder();
}

void Network::EventQueue::pop() {
  pos_[heap_.front().flow] = -1;
  const Entry last = heap_.back();
  heap_.pop_back();
  if (heap_.empty()) return;
  down(0, last);
}

}  // namespace moe::sim
