// Lina's popularity-based inference scheduling (the Lina paper, Sec. 5.2), as pure functions.
//
// A token's path is its first-choice expert at each MoE layer it has passed. Profiling counts, for
// every MoE layer l and every path of the previous (up to) `path_length` MoE layers, which experts the
// tokens with that path chose at l. Before MoE layer l of a batch, each token's estimated
// distribution over l's experts is the profile of its path (the longest suffix of it seen at least
// kMinPathCount times, else layer l's marginal); Lina keeps that distribution's top-k experts and their
// probabilities, and the batch's popularity of expert e is the sum over its tokens (Eq. 1).
//
// Phase 1 (before the gate) gives each expert a number of expert slots proportional to its
// popularity (E slots in all: each of R ranks has E / R, as Lina's one expert per device when R == E);
// phase 2 (after the gate) re-plans with the real counts when the estimate's top-k experts differ from
// the real ones. Here an expert's owner always keeps it (the ranks' shards do not move), and an expert
// with more slots gets replicas on the ranks whose load is lowest, so unpopular experts share their
// owners' ranks and popular ones are spread: the paper's packing of unpopular experts onto few devices
// becomes "they keep their owner's slot". Deterministic: every rank computes the same plan.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <vector>

#include "plan/placement.h"

namespace moe::plan {

inline constexpr int64_t kMinPathCount = 8;  // a path of fewer profiled tokens backs off to a shorter one

class PathProfile {
 public:
  // moe_layers: L MoE layers; experts: E; path_length: previous layers a path spans (Lina's default 3).
  // REQUIRES: moe_layers >= 1, experts >= 1, path_length >= 1 (std::logic_error).
  PathProfile(int64_t moe_layers, int64_t experts, int path_length = 3);
  int64_t moe_layers() const { return L_; }
  int64_t experts() const { return E_; }
  int path_length() const { return path_length_; }
  int64_t tokens() const { return tokens_; }

  // One profiled token: first[l] its first choice at MoE layer l ([L]); chosen its top-k at each
  // layer, layer-major ([L*K]). REQUIRES: sizes L and a multiple of L, experts in range.
  void add(std::span<const int32_t> first, std::span<const int32_t> chosen);

  // The estimated distribution over MoE layer l's experts of a token whose first choices at the MoE
  // layers before l are `previous` (oldest first; only the last path_length are used): P(e | path) of
  // the longest suffix seen >= kMinPathCount times, else l's marginal, else uniform. p: [E], sums to 1.
  void distribution(int64_t l, std::span<const int32_t> previous, std::vector<double>* p) const;

  // Lina's Eq. 1 for a batch: sum over its tokens of P(e | path) restricted to each distribution's top
  // k experts (ties to the lower expert). paths: [N][path_len] row-major, token t's first choices at
  // the MoE layers before l (oldest first). Tokens whose last path_length choices agree share one
  // distribution, looked up once per call (a serving step's hundreds of tokens take a few dozen
  // paths). [E]. REQUIRES: path_len >= 1, paths.size() a multiple of it (std::logic_error).
  std::vector<double> estimate(int64_t l, std::span<const int32_t> paths, int64_t path_len, int64_t k) const;

 private:
  int64_t L_, E_;
  int path_length_;
  int64_t tokens_ = 0;
  int64_t K_ = 0;  // choices per token (set by the first add)
  // counts_[l][path] = [E] choices at l of the tokens whose last first-choices before l are `path`
  // (every suffix length 0..path_length, the empty path being the marginal).
  std::vector<std::map<std::vector<int32_t>, std::vector<int64_t>>> counts_;
};

// Expert slots per expert from popularity: round(E * pop_e / sum pop), at least 1 and at most R.
// REQUIRES: popularity [E] non-negative, R >= 1.
std::vector<int> lina_slots(const std::vector<double>& popularity, int n_ranks);

// What running and moving experts costs on these ranks, measured at start-up (serve/profile.h): the
// figures a priced placement weighs. A rank's time for a layer is the sum, over the experts it runs
// rows of, of expert_seconds(its share of the expert's tokens). expert_seconds is the expert kernel's
// measured time as a function of its rows, not a line: on a CPU it is nearly flat over the first few
// rows (the weights are read once, whatever the rows) and grows with the rows beyond, so a replica that
// splits a decode batch's few tokens saves its owner almost nothing while its new holder pays the
// whole read, and one that splits a prefill's hundreds saves about half the expert's time.
struct LinaCost {
  // The curve: one expert's forward at rows[i] rows took seconds[i]. rows ascending from >= 1;
  // seconds non-decreasing (the measurement takes a running maximum: more rows never cost less).
  std::vector<double> rows, seconds;
  double move_seconds = 0;  // one expert's weights gathered onto a rank that does not hold them
  // The spread (standard deviation) of a rank's time for one layer's experts around the curve, as the
  // runs measure it (LinaCurveFit); 0: none. Under it the plan weighs a rank by its expected time
  // among noisy ranks (lina_busiest_seconds).
  double noise_seconds = 0;
  // Linear between the points, from (0 rows, 0 s) to the first, beyond the last on the last segment's
  // slope (flat with one point). tokens may be fractional (an estimate's expected count).
  // REQUIRES: rows and seconds of one size >= 1 (std::logic_error).
  double expert_seconds(double tokens) const;
  // expert_seconds(tokens) as weights of two points: w_lo * seconds[lo] + w_hi * seconds[hi] (the
  // curve is linear in its seconds, which is what LinaCurveFit fits). REQUIRES: as expert_seconds.
  struct Weights {
    size_t lo = 0, hi = 0;
    double w_lo = 0, w_hi = 0;
  };
  Weights weights(double tokens) const;
  // A two-point curve, fixed + token_seconds x tokens at 1 and 2 tokens (tests, hand-made prices).
  static LinaCost affine(double fixed_seconds, double token_seconds, double move_seconds);
};

// LinaCost's curve refitted from the experts' own runs while serving (serve::InferenceEngine): a
// rank's time for one MoE layer's experts is the sum, over the experts it ran, of the curve at their
// rows, and that is linear in the curve's seconds, so the runs accumulate as the normal equations of a
// least-squares fit. Each rank adds its own runs; the sums are added over the ranks (sums(), then
// add_sums() on every rank), so that every rank fits the same curve. Thread safety: none.
class LinaCurveFit {
 public:
  // The curve's rows (LinaCost::rows). REQUIRES: non-empty, ascending, rows[0] > 0 (std::logic_error).
  explicit LinaCurveFit(std::vector<double> rows);
  // One run: the experts of a layer ran rows_of_each[i] rows each (0: not run) in `seconds` on a rank.
  // A run of no rows is not counted.
  void add(std::span<const int64_t> rows_of_each, double seconds);
  // [G*G + G + 2]: the runs' Gram matrix, right-hand side, sum of squared seconds and count since the
  // last clear().
  std::vector<double> sums() const;
  void clear();
  // Adds sums of the same rows' runs (other ranks', or one's own from before). REQUIRES: size as sums().
  void add_sums(std::span<const double> sums);
  // Multiplies every sum by keep (0..1): older runs weigh less.
  void decay(double keep);
  double runs() const { return runs_; }
  // The seconds at the rows that fit the runs in least squares, each point drawn towards the prior's
  // curve scaled to the runs' level (the one factor that fits them best) as if prior_weight runs had
  // measured it alone (so a point the runs never reach keeps the scaled prior's), then made
  // non-decreasing and positive; prior's move_seconds; noise_seconds the runs' root mean square
  // residual about the fit (prior's without runs). REQUIRES: prior.rows equal to rows,
  // prior_weight > 0 (std::logic_error).
  LinaCost fitted(const LinaCost& prior, double prior_weight) const;

 private:
  LinaCost shape_;              // rows, for LinaCost::weights
  std::vector<double> gram_;    // [G*G]
  std::vector<double> rhs_;     // [G]
  double squares_ = 0;          // sum of seconds^2
  double runs_ = 0;
};
// The busiest rank's time of placement p (LinaCost above): an expert's tokens split over its holders
// as DispatchRule::balanced splits them (balanced_shares), each holder that gets a share running at
// least one token (or all of them, when fewer: a token is not split).
// With cost.noise_seconds > 0 the expected time of the slowest rank, each rank that runs an expert
// taking its curve time plus independent normal noise of that spread (Clark's moments of the maximum
// of normals, folded rank by rank): a replica that lifts a second rank next to the busiest one
// lengthens the expected step by more than the few microseconds it takes off the busiest.
double lina_busiest_seconds(const LayerPlacement& p, const std::vector<double>& popularity, const LinaCost& cost);

// The placement for slots: owners keep their experts; experts by descending slots (then popularity,
// then index) get replicas, one at a time, on the rank with the lowest load among those not holding
// them, a rank's load being the popularity of each expert it holds divided by that expert's holders.
// Priced (cost not null): a replica is kept only when it shortens the busiest rank's time
// (lina_busiest_seconds) by more than its move, which is free where `held` (the replicas the ranks
// hold from earlier steps; null: none) already has it; the expert's remaining slots are then dropped.
// Without a price every replica the slots ask for is gathered, whatever it saves: on small decode
// batches that moved ~1 GB/s of weights for nothing (docs/serving.md).
// foregone (optional, [R*E], rank-major, kept by the caller across steps): rent or buy, for callers
// that keep a bought replica while later steps do not use it (serve::InferenceEngine's replica cache).
// Such a replica serves every later step for free (inference weights never change), so one step's
// saving undersells a move; foregone[r*E+e] sums the savings refused so far for e on r, and a move is
// bought once this step's saving plus that sum exceeds it (the ski-rental rule: never more than twice
// the cost of the best choice in hindsight). The sum is reset where the replica is bought.
// REQUIRES: owners.validate() ok with no replicas beyond the owners; popularity [E]; held, if given,
// a valid placement of the same experts and ranks; foregone, if given, of size R*E.
LayerPlacement lina_placement(const std::vector<double>& popularity, const LayerPlacement& owners,
                              const LinaCost* cost = nullptr, const LayerPlacement* held = nullptr,
                              std::vector<double>* foregone = nullptr);

// The k experts with the highest value (ties to the lower index), ascending.
std::vector<int> top_experts(const std::vector<double>& value, int64_t k);

}  // namespace moe::plan
