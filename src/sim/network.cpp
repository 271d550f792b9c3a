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
// How many flows ahead settle() and advance() prefetch a flow's state: enough to cover a miss to
// memory at the loops' pace (a guess, not tuned).
constexpr size_t kPrefetchAhead = 8;

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

int Network::start_flow(const std::vector<int>& path, double bytes) {
  double alpha = 0;
  for (int l : path) {
    if (l < 0 || l >= n_links()) throw std::logic_error(str_cat("sim::Network::start_flow: link ", l, " out of range"));
    alpha += links_[l].latency;
  }
  return start_flow(path, bytes, alpha);
}

int Network::start_flow(const std::vector<int>& path, double bytes, double alpha) {
  return start_flow(path, bytes, alpha, 1.0);
}

int Network::start_flow(const std::vector<int>& path, double bytes, double alpha, double weight) {
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
  return events_.top_time();
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
  for (size_t j = 0; j < due_.size(); ++j) {
    if (j + kPrefetchAhead < due_.size()) {  // as in settle()
      __builtin_prefetch(&flows_[due_[j + kPrefetchAhead]]);
      __builtin_prefetch(&hot_[due_[j + kPrefetchAhead]]);
    }
    const int id = due_[j];
    Flow& f = flows_[id];
    if (f.transferring) {
      const double rate = hot_[id].rate;
      for (const Hop& h : path(id)) {
        // The link's load drops by the flow's rate at once: a link with slack stays out of the next
        // settle(), which then has nothing to recompute there (settle() overwrites the others' load).
        LinkState& link = links_[h.link];
        link.carried += link.load * (now_ - link.load_since);
        link.load_since = now_;
        link.load = link.flows.size() == 1 ? 0.0 : link.load - rate;
        // Swap-remove from the link's list; the flow moved into the hole learns its new slot.
        auto& list = link.flows;
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
  // reaches anyway is recomputed with it; the others only had their load lowered by advance().
  region_links_.clear();
  region_flows_.clear();
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
      if (floor > 0 && links_[l].slack) continue;
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
  std::vector<ShareKey>& keys = share_keys_;
  keys.clear();
  for (size_t i = 0; i < region_links_.size(); ++i) {
    const int l = region_links_[i];
    double cap = links_[l].bandwidth;
    double frozen_load = 0;
    int unfixed = 0;
    double unfixed_weight = 0;
    const int begin = static_cast<int>(r_link_flows_.size());
    const std::vector<std::pair<int, int>>& list = links_[l].flows;
    for (size_t j = 0; j < list.size(); ++j) {
      // The flows' state lies at random ids, far apart: ask for the lines a few flows ahead, so that
      // their misses overlap instead of stalling the loop one after the other.
      if (j + kPrefetchAhead < list.size()) {
        const int ahead = list[j + kPrefetchAhead].first;
        __builtin_prefetch(&tag[ahead]);
        __builtin_prefetch(&hot[ahead]);
      }
      const int f = list[j].first;
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
    if (unfixed > 0) keys.push_back({std::max(0.0, cap / unfixed_weight), l, static_cast<int>(i)});
  }

  // Water-filling over the region, on what the frozen flows leave of each link: repeatedly take the
  // link with the smallest fair share (capacity left over its flows not yet fixed), fix those flows at
  // that share and take it out of the other links they cross. Fixing flows at the smallest share never
  // lowers another link's share, so a link's key is a lower bound of its share: a link taken whose
  // share has grown since goes back in with it, and a link is processed only when its key is its share
  // and the smallest (ties by link id). That takes each flow to its max-min rate with one key per link,
  // not one per update. The keys are sorted once, and those that go back in wait in a heap beside
  // them: most links' flows are all fixed elsewhere before their turn (4.6 M of the 6.3 M keys of
  // `moe bench sim`'s 4096-GPU step, and 1.1 M went back in), and a sorted array passes those over
  // far cheaper than a heap pops them.
  std::sort(keys.begin(), keys.end(), [](const ShareKey& a, const ShareKey& b) { return ShareKey::before(a, b); });
  std::vector<ShareKey>& later = share_heap_;
  const auto heap_order = [](const ShareKey& a, const ShareKey& b) { return ShareKey::before(b, a); };
  later.clear();
  size_t next = 0;
  while (next < keys.size() || !later.empty()) {
    ShareKey top;
    if (later.empty() || (next < keys.size() && ShareKey::before(keys[next], later.front()))) {
      top = keys[next++];
    } else {
      std::pop_heap(later.begin(), later.end(), heap_order);
      top = later.back();
      later.pop_back();
    }
    RegionLink& rl = r_links_[top.index];
    if (rl.unfixed == 0) continue;
    const double share = std::max(0.0, rl.cap_left / rl.unfixed_weight);
    if (share != top.share) {
      later.push_back({share, top.link, top.index});
      std::push_heap(later.begin(), later.end(), heap_order);
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
    link.slack = link.load < link.bandwidth * (1 - 1e-9);
  }
  for (size_t j = 0; j < region_flows_.size(); ++j) {
    if (j + kPrefetchAhead < region_flows_.size()) {
      const int ahead = region_flows_[j + kPrefetchAhead];
      __builtin_prefetch(&hot[ahead]);
      __builtin_prefetch(&flows_[ahead]);
    }
    const int id = region_flows_[j];
    Hot& h = hot[id];
    const double r = r_flows_[j].new_rate;
    if (r == h.rate) continue;
    Flow& f = flows_[id];
    f.bytes_left = std::max(0.0, f.bytes_left - h.rate * (now_ - f.updated));
    f.updated = now_;
    h.rate = r;
    f.event_time = r > 0 ? now_ + f.bytes_left / r : kInf;
    events_.set(id, f.event_time);
  }
  rates_computed_ += region_flows_.size();
}

void Network::EventQueue::set(int flow, double time) {
  const size_t leaf = static_cast<size_t>(flow);
  if (leaf >= n_) {  // grow to a power of two above `flow`, the leaves kept, the inner nodes rebuilt
    size_t n = std::max<size_t>(n_, 64);
    while (n <= leaf) n *= 2;
    std::vector<double> tree(2 * n, kInf);
    std::copy(tree_.begin() + n_, tree_.end(), tree.begin() + n);
    for (size_t i = n; i-- > 1;) tree[i] = std::min(tree[2 * i], tree[2 * i + 1]);
    tree_.swap(tree);
    n_ = n;
  }
  size_t i = n_ + leaf;
  tree_[i] = time;
  for (i /= 2; i >= 1; i /= 2) {
    const double m = std::min(tree_[2 * i], tree_[2 * i + 1]);
    if (m == tree_[i]) break;  // the tree above already holds the right minima
    tree_[i] = m;
  }
}

void Network::EventQueue::pop_until(double t, std::vector<int>* out) {
  out->clear();
  if (n_ == 0 || !(tree_[1] <= t) || !(t < kInf)) return;
  // Depth first, left child first: the leaves due come out by ascending id. Every inner node entered
  // has a due leaf below it, so the walk costs about the due leaves times the depth above them.
  taken_.clear();
  stack_.assign(1, 1);
  while (!stack_.empty()) {
    const size_t i = stack_.back();
    stack_.pop_back();
    if (!(tree_[i] <= t)) continue;
    if (i >= n_) {
      out->push_back(static_cast<int>(i - n_));
      tree_[i] = kInf;
      continue;
    }
    taken_.push_back(i);
    stack_.push_back(2 * i + 1);
    stack_.push_back(2 * i);
  }
  // Parents were entered before their children: recompute in reverse, children first.
  for (auto it = taken_.rbegin(); it != taken_.rend(); ++it) tree_[*it] = std::min(tree_[2 * *it], tree_[2 * *it + 1]);
}

}  // namespace moe::sim
