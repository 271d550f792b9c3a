#include "runtime/measure_costs.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <set>

#include "moe/experts.h"
#include "tensor/ops.h"
#include "util/str_cat.h"

namespace moe::runtime {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Message sizes of the exchanges: from latency-bound to bandwidth-bound on a 1 Gbit/s link. A quick
// re-measurement during training (measure_links, quick) uses the two largest, fewer times and with no
// warm-up: smaller messages fit in a shaper's or switch's burst allowance and would overstate the rate
// (1 MiB messages read 3.4 GB/s through the emulated cluster's 10 Gbit/s token bucket).
constexpr int64_t kSizes[] = {8 << 10, 128 << 10, 1 << 20, 4 << 20};
constexpr int64_t kQuickSizes[] = {1 << 20, 4 << 20};
constexpr int kRepeats = 5, kQuickRepeats = 2;
constexpr int kTag = 7301;

// Ranks paired lowest-first: partner[r] is the lowest unpaired rank above r that is on the same node
// (same_node) or on another node, or -1.
std::vector<int> pair_ranks(const plan::Nodes& nodes, bool same_node) {
  const int R = static_cast<int>(nodes.node_of_rank.size());
  std::vector<int> partner(R, -1);
  for (int r = 0; r < R; ++r) {
    if (partner[r] >= 0) continue;
    for (int s = r + 1; s < R; ++s)
      if (partner[s] < 0 && (nodes.node_of_rank[s] == nodes.node_of_rank[r]) == same_node) {
        partner[r] = s, partner[s] = r;
        break;
      }
  }
  return partner;
}

// The fastest of `repeats` exchanges of each size with `partner`: both ranks send and receive at
// once, as in a step's all-to-all, so while the pairs of a class measure, every rank keeps sending
// and the two ranks of a host share its NIC as they do in the step, whether or not the pairs stay in
// step with each other (ping-pongs did not: the pairs drifted apart and the fastest trip was one
// that had the link alone, a whole NIC per rank on 2 x 2).
Status exchange(comm::Communicator& world, int partner, const std::vector<int64_t>& sizes, int repeats,
                bool warm_up, std::vector<LinkSample>* out) {
  const size_t largest = *std::max_element(sizes.begin(), sizes.end()) / sizeof(float);
  std::vector<float> mine(largest, 1.0f), theirs(largest);
  for (int64_t bytes : sizes) {
    const int64_t n = bytes / static_cast<int64_t>(sizeof(float));
    double best = std::numeric_limits<double>::infinity();
    for (int i = warm_up ? 0 : 1; i <= repeats; ++i) {  // i == 0: warm-up (connection set-up, first touch)
      const auto t0 = Clock::now();
      if (Status s = world.sendrecv(mine.data(), n, partner, theirs.data(), n, partner, kTag); !s) return s;
      if (i > 0) best = std::min(best, seconds_since(t0));
    }
    out->push_back({bytes, best});
  }
  return Status::ok();
}

// When the times do not fit a line (ranks taking turns on oversubscribed cores make small messages
// as slow as large ones): the largest message's rate, and the smallest message's time as latency.
strategy::LinkCost rough_link_cost(const std::vector<LinkSample>& samples) {
  const auto [lo, hi] = std::minmax_element(samples.begin(), samples.end(),
                                            [](const LinkSample& a, const LinkSample& b) { return a.bytes < b.bytes; });
  return {lo->seconds, static_cast<double>(hi->bytes) / hi->seconds};
}

}  // namespace

Status fit_link_cost(const std::vector<LinkSample>& samples, strategy::LinkCost* out) {
  std::set<int64_t> sizes;
  double n = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const LinkSample& s : samples) {
    if (!(s.seconds > 0) || !std::isfinite(s.seconds) || s.bytes < 0)
      return Status::error(str_cat("cost model: a message of ", s.bytes, " bytes timed at ", s.seconds, " s"));
    const double x = static_cast<double>(s.bytes);
    sizes.insert(s.bytes);
    n += 1, sx += x, sy += s.seconds, sxx += x * x, sxy += x * s.seconds;
  }
  if (sizes.size() < 2) return Status::error("cost model: an alpha-beta fit needs two message sizes or more");
  double slope = (n * sxy - sx * sy) / (n * sxx - sx * sx);
  double latency = (sy - slope * sx) / n;
  if (latency < 0) latency = 0, slope = sxy / sxx;  // through the origin
  if (!(slope > 0) || !std::isfinite(slope))
    return Status::error("cost model: message times do not grow with size; no bandwidth to fit");
  out->latency = latency;
  out->bandwidth = 1.0 / slope;
  return Status::ok();
}

Status agree_costs(comm::Communicator* world, const RawCosts& mine, RawCosts* agreed) {
  // Sums and counts of each figure over the ranks that measured it.
  double v[9] = {0};
  auto put = [&](int i, const strategy::LinkCost& l) {
    if (!(l.bandwidth > 0)) return;
    v[i] = l.latency, v[i + 1] = l.bandwidth, v[i + 2] = 1;
  };
  put(0, mine.intra_node);
  put(3, mine.inter_node);
  if (mine.gemm_flops > 0) v[6] = mine.gemm_flops, v[7] = 1;
  if (world)
    if (Status s = world->allreduce(v, 9); !s) return s;
  auto mean_link = [&](int i) {
    return v[i + 2] > 0 ? strategy::LinkCost{v[i] / v[i + 2], v[i + 1] / v[i + 2]} : strategy::LinkCost{};
  };
  agreed->intra_node = mean_link(0);
  agreed->inter_node = mean_link(3);
  agreed->gemm_flops = v[7] > 0 ? v[6] / v[7] : 0;
  return Status::ok();
}

Status measure_links(comm::Communicator* world, const plan::Nodes& nodes, bool quick, RawCosts* out) {
  out->intra_node = out->inter_node = strategy::LinkCost{};
  if (!world) return Status::ok();
  if (static_cast<int>(nodes.node_of_rank.size()) != world->size())
    return Status::error("cost model: REQUIRES a node for every rank");
  const std::vector<int64_t> sizes = quick ? std::vector<int64_t>(std::begin(kQuickSizes), std::end(kQuickSizes))
                                           : std::vector<int64_t>(std::begin(kSizes), std::end(kSizes));
  for (bool same_node : {true, false}) {
    const int partner = pair_ranks(nodes, same_node)[world->rank()];
    if (partner >= 0) {
      std::vector<LinkSample> samples;
      if (Status s = exchange(*world, partner, sizes, quick ? kQuickRepeats : kRepeats, !quick, &samples); !s) return s;
      strategy::LinkCost& link = same_node ? out->intra_node : out->inter_node;
      if (!fit_link_cost(samples, &link)) link = rough_link_cost(samples);
    }
    if (Status s = world->barrier(); !s) return s;  // one class at a time
  }
  return Status::ok();
}

Status measure_costs(comm::Communicator* world, const plan::Nodes& nodes, const ModelConfig& model, int64_t rows,
                     RawCosts* out) {
  *out = RawCosts{};
  if (Status s = measure_links(world, nodes, /*quick=*/false, out); !s) return s;
  // The pinned kernel on the expert GEMMs of `rows` rows.
  out->gemm_flops =
      1e9 * measure_gemm_rate(expert_gemm_shapes(std::max<int64_t>(1, rows), model.d_model, model.d_ffn), 3);
  return Status::ok();
}

strategy::CostModel cost_model_from(const ModelConfig& model, const RawCosts& raw, const plan::Nodes& nodes,
                                    double link_gbs, double gemm_gflops) {
  const double gemm_flops = gemm_gflops > 0 ? gemm_gflops * 1e9 : raw.gemm_flops;
  // The slowest class the ranks span; one rank alone moves nothing, any positive figure will do.
  double bandwidth = nodes.n_nodes() > 1 ? raw.inter_node.bandwidth : raw.intra_node.bandwidth;
  if (link_gbs > 0) bandwidth = link_gbs * 1e9;
  if (!(bandwidth > 0)) bandwidth = 1e9;
  strategy::CostModel c = strategy::make_cost_model(model, bandwidth, gemm_flops);
  c.transfers_take_compute = true;  // this runtime's ranks are CPU processes
  c.intra_node = raw.intra_node;
  c.inter_node = raw.inter_node;
  return c;
}

}  // namespace moe::runtime
