// Flow-level network with incremental max-min fair sharing (network.h).
#include "sim/network.h"
#include "util/str_cat.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>

namespace moe::sim {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// A link's fair share during water-filling, ordered by share, then link id (ties broken by id, so the
// order of fixing never depends on anything but the inputs).
struct Share {
  double share;
  int link;
};
struct ShareAfter {
  bool operator()(const Share& a, const Share& b) const {
    return a.share > b.share || (a.share == b.share && a.link > b.link);
  }
};

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
  link_mark_.assign(links_.size(), 0);
  cap_left_.assign(links_.size(), 0);
  unfixed_.assign(links_.size(), 0);
  unfixed_weight_.assign(links_.size(), 0.0);
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
    if (link_mark_[l] == epoch_)
      throw std::logic_error(str_cat("sim::Network::start_flow: link ", l, " twice in the path"));
    link_mark_[l] = epoch_;
  }
  int id;
  if (!free_ids_.empty()) {
    id = free_ids_.back();
    free_ids_.pop_back();
  } else {
    id = static_cast<int>(flows_.size());
    flows_.emplace_back();
    flow_mark_.push_back(0);
    flow_fixed_.push_back(0);
    new_rate_.push_back(0);
  }
  Flow& f = flows_[id];
  f.path.clear();
  for (int l : path) f.path.push_back({l, -1});
  f.bytes_left = bytes;
  f.updated = now_;
  f.rate = 0;
  f.weight = weight;
  f.transferring = false;
  f.live = true;
  ++live_count_;
  if (alpha == 0 && bytes > 0 && !f.path.empty()) {
    begin_transfer(id);
  } else {
    f.event_time = now_ + alpha;
    events_.set(id, flows_);
  }
  return id;
}

void Network::begin_transfer(int id) {
  Flow& f = flows_[id];
  f.transferring = true;
  f.updated = now_;
  for (size_t i = 0; i < f.path.size(); ++i) {
    auto& list = links_[f.path[i].link].flows;
    f.path[i].slot = static_cast<int>(list.size());
    list.emplace_back(id, static_cast<int>(i));
  }
  // It gets a rate, and an end time in the event queue, at the next settle().
  mark_dirty(f);
  started_since_settle_ = true;
}

double Network::next_event_time() {
  settle();
  return events_.empty() ? kInf : flows_[events_.top()].event_time;
}

std::vector<int> Network::advance(double t) {
  const double next = next_event_time();
  if (!(t >= now_) || t > next) {
    throw std::logic_error(
        str_cat("sim::Network::advance: t (", t, ") must be in [now (", now_, "), next event (", next, ")]"));
  }
  now_ = t;
  std::vector<int> ended;  // popped in (time, id) order, and every popped time is t: ascending ids
  while (!events_.empty() && flows_[events_.top()].event_time <= t) {
    const int id = events_.top();
    events_.pop(flows_);
    Flow& f = flows_[id];
    if (f.transferring) {
      for (const Hop& h : f.path) {
        // Swap-remove from the link's list; the flow moved into the hole learns its new slot.
        auto& list = links_[h.link].flows;
        const auto last = list.back();
        list[h.slot] = last;
        flows_[last.first].path[last.second].slot = h.slot;
        list.pop_back();
      }
      mark_dirty(f);
      min_ended_level_ = std::min(min_ended_level_, f.rate / f.weight);
      ended.push_back(id);
    } else if (f.bytes_left == 0 || f.path.empty()) {
      ended.push_back(id);
    } else {
      begin_transfer(id);  // its start latency is over
    }
  }
  for (int id : ended) {
    Flow& f = flows_[id];
    f.live = false;
    f.transferring = false;
    f.rate = 0;
    f.path.clear();
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
  return flows_[flow].rate;
}

double Network::link_bytes(int link) const {
  const LinkState& l = links_.at(link);
  return l.carried + l.load * (now_ - l.load_since);
}

double Network::link_load(int link) {
  settle();
  return links_.at(link).load;
}

void Network::mark_dirty(const Flow& f) {
  for (const Hop& h : f.path) {
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
    if (link_mark_[l] != epoch_) {
      link_mark_[l] = epoch_;
      region_links_.push_back(l);
    }
  }
  dirty_links_.clear();
  for (size_t i = 0; i < region_links_.size(); ++i) {
    for (const auto& [f, hop] : links_[region_links_[i]].flows) {
      if (flow_mark_[f] == epoch_ || flows_[f].rate / flows_[f].weight < floor) continue;
      flow_mark_[f] = epoch_;
      region_flows_.push_back(f);
      for (const Hop& h : flows_[f].path) {
        if (link_mark_[h.link] != epoch_) {
          link_mark_[h.link] = epoch_;
          region_links_.push_back(h.link);
        }
      }
    }
  }

  // Water-filling over the region, on what the frozen flows leave of each link: repeatedly take the
  // link with the smallest fair share (capacity left over its flows not yet fixed), fix those flows at
  // that share and take it out of the other links they cross. Fixing flows at the smallest share never
  // lowers another link's share, so a link's key in the heap is a lower bound of its share: a popped
  // link whose share has grown since is pushed back with it, and a link is processed only when its key
  // is its share and the smallest (ties by link id). That takes each flow to its max-min rate with one
  // heap entry per link, not one per update.
  std::vector<Share> heap;
  heap.reserve(region_links_.size());
  for (int l : region_links_) {
    cap_left_[l] = links_[l].bandwidth;
    unfixed_[l] = 0;
    unfixed_weight_[l] = 0;
    for (const auto& [f, hop] : links_[l].flows) {
      if (flow_mark_[f] == epoch_) {
        ++unfixed_[l];
        unfixed_weight_[l] += flows_[f].weight;
      } else {
        cap_left_[l] -= flows_[f].rate;
      }
    }
    if (unfixed_[l] > 0) heap.push_back({std::max(0.0, cap_left_[l] / unfixed_weight_[l]), l});
  }
  std::make_heap(heap.begin(), heap.end(), ShareAfter());
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), ShareAfter());
    const int l = heap.back().link;
    const double key = heap.back().share;
    heap.pop_back();
    if (unfixed_[l] == 0) continue;
    const double share = std::max(0.0, cap_left_[l] / unfixed_weight_[l]);
    if (share != key) {
      heap.push_back({share, l});
      std::push_heap(heap.begin(), heap.end(), ShareAfter());
      continue;
    }
    for (const auto& [f, hop] : links_[l].flows) {
      if (flow_mark_[f] != epoch_ || flow_fixed_[f] == epoch_) continue;
      flow_fixed_[f] = epoch_;
      const double w = flows_[f].weight;
      new_rate_[f] = w * share;
      for (const Hop& h : flows_[f].path) {
        cap_left_[h.link] -= w * share;
        --unfixed_[h.link];
        unfixed_weight_[h.link] -= w;
      }
    }
  }

  // Apply: links account the bytes carried at their old load; flows whose rate changed account their
  // progress at the old rate and get a new end time; links sum their flows' rates anew.
  for (int l : region_links_) {
    LinkState& link = links_[l];
    link.carried += link.load * (now_ - link.load_since);
    link.load_since = now_;
  }
  for (int id : region_flows_) {
    Flow& f = flows_[id];
    const double r = new_rate_[id];
    if (r == f.rate) continue;
    f.bytes_left = std::max(0.0, f.bytes_left - f.rate * (now_ - f.updated));
    f.updated = now_;
    f.rate = r;
    f.event_time = r > 0 ? now_ + f.bytes_left / r : kInf;
    events_.set(id, flows_);
  }
  for (int l : region_links_) {
    LinkState& link = links_[l];
    link.load = 0;
    for (const auto& [f, hop] : link.flows) link.load += flows_[f].rate;
  }
  rates_computed_ += region_flows_.size();
}

bool Network::EventQueue::less(int a, int b, const std::vector<Flow>& flows) const {
  const double ta = flows[a].event_time, tb = flows[b].event_time;
  return ta < tb || (ta == tb && a < b);
}

void Network::EventQueue::place(size_t i, int flow) {
  heap_[i] = flow;
  pos_[flow] = static_cast<int>(i);
}

void Network::EventQueue::up(size_t i, const std::vector<Flow>& flows) {
  const int f = heap_[i];
  while (i > 0) {
    const size_t parent = (i - 1) / 2;
    if (!less(f, heap_[parent], flows)) break;
    place(i, heap_[parent]);
    i = parent;
  }
  place(i, f);
}

void Network::EventQueue::down(size_t i, const std::vector<Flow>& flows) {
  const int f = heap_[i];
  const size_t n = heap_.size();
  while (true) {
    size_t child = 2 * i + 1;
    if (child >= n) break;
    if (child + 1 < n && less(heap_[child + 1], heap_[child], flows)) ++child;
    if (!less(heap_[child], f, flows)) break;
    place(i, heap_[child]);
    i = child;
  }
  place(i, f);
}

void Network::EventQueue::set(int flow, const std::vector<Flow>& flows) {
  if (flow >= static_cast<int>(pos_.size())) pos_.resize(flow + 1, -1);
  if (pos_[flow] < 0) {
    heap_.push_back(flow);
    pos_[flow] = static_cast<int>(heap_.size()) - 1;
    up(heap_.size() - 1, flows);
  } else {
    up(pos_[flow], flows);
    down(pos_[flow], flows);
  }
}

void Network::EventQueue::pop(const std::vector<Flow>& flows) {
  pos_[heap_.front()] = -1;
  const int last = heap_.back();
  heap_.pop_back();
  if (heap_.empty()) return;
  place(0, last);
  down(0, flows);
}

}  // namespace moe::sim
