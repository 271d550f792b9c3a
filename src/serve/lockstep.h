// The ranks of an inference job in lock-step: rank 0 (the lead) decides every forward's rows for
// every rank, broadcasts them, each rank runs its own rows through its InferenceEngine (the MoE
// layers exchange tokens among all ranks), and the rows' logits come back to the lead, which samples.
// So the lead alone holds the requests, the token histories and the samplers; the other ranks hold
// KV caches for the sequences placed on them and their share of the experts.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "comm/communicator.h"
#include "serve/engine.h"
#include "util/status.h"

namespace moe::serve {

struct PlacedRow {
  int32_t rank = 0;  // the rank whose KV cache holds the sequence
  Row row;
};

// One sequence as the lead runs it: its tokens and where its KV-cache slot stands. Its next step is
// either a prefill of tokens[first..] at positions 0.. (a new prompt, or a refill) or one decode row.
struct Sequence {
  std::vector<int32_t> tokens;  // prompt and generated
  int64_t first = 0;            // tokens[first] sits at position 0 of the slot's cache
  bool prefill = true;
  int64_t rows() const { return prefill ? static_cast<int64_t>(tokens.size()) - first : 1; }
  // Appends this sequence's next rows for (rank, slot); the last asks for logits.
  void add_rows(int rank, int slot, std::vector<PlacedRow>* out) const;
  // The sampled token. When the context (T positions) is full, the next step goes on from the last
  // T / 2 tokens, recomputed into the slot: the positions are learned, so the cache cannot be shifted.
  // Returns whether it refills.
  bool push(int32_t token, int64_t T);
};

// One step's expert time over the ranks, from every rank's seconds in each MoE block (seconds [R][L],
// rank-major): `busiest` sums over the blocks the slowest rank's, what the step waits for (every
// block's exchange waits for its slowest rank, and the slowest is not the same rank at every block);
// `mean` sums the ranks' mean likewise. REQUIRES: seconds.size() a multiple of ranks >= 1.
struct BlockTimes {
  double busiest = 0, mean = 0;
};
BlockTimes expert_time_over_ranks(std::span<const float> seconds, int ranks);

// Thread safety: none; the thread that runs the engine calls it (it owns `world`).
class Lockstep {
 public:
  // world: every rank of the job (null or of size 1: one process). Not owned; outlives this.
  Lockstep(InferenceEngine& engine, comm::Communicator* world);
  bool lead() const { return rank_ == 0; }
  int ranks() const { return size_; }
  const InferenceEngine& engine() const { return engine_; }

  // Lead: runs `rows` (each on its rank) and returns in *logits [n, V] the logits of the n rows with
  // row.logits, in the order given. An empty `rows` is a no-op step that keeps the followers
  // waiting (a heartbeat, so their collectives do not time out while the lead is idle).
  // REQUIRES: lead(); at most engine.max_rows() rows per rank.
  Status step(const std::vector<PlacedRow>& rows, std::vector<float>* logits);
  // Lead: tells the followers to return from follow(). Call once, at the end.
  Status finish();
  // Followers: run the lead's steps until finish(). REQUIRES: !lead().
  Status follow();

  // Lead: the expert time of the busiest rank and of the ranks' mean, summed over the steps
  // (expert_time_over_ranks of each; every rank's own clock, sent with its logits): busiest / mean is
  // the imbalance in time that a schedule leaves (rows cost unequally: a decode step's expert time is
  // mostly fixed per expert, whatever the rows).
  struct RankTimes {
    double busiest_experts = 0, mean_experts = 0;
  };
  const RankTimes& rank_times() const { return times_; }

 private:
  Status run(const std::vector<PlacedRow>& rows, std::vector<float>* logits);
  void add_times(std::span<const float> expert_seconds);  // one step's, every rank's ([R][L], rank-major)

  InferenceEngine& engine_;
  comm::Communicator* world_;
  int rank_ = 0, size_ = 1;
  std::vector<int64_t> message_;
  std::vector<Row> mine_;
  std::vector<float> my_logits_;
  RankTimes times_;
};

}  // namespace moe::serve
