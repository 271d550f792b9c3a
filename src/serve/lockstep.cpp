#include "serve/lockstep.h"

#include <algorithm>
#include <stdexcept>

namespace moe::serve {

namespace {

// The broadcast plan: [kind, n, then n x (rank, slot, pos, token, logits)].
enum Kind : int64_t { kStep = 1, kFinish = 2 };
constexpr int64_t kFields = 5;

}  // namespace

BlockTimes expert_time_over_ranks(std::span<const float> seconds, int ranks) {
  if (ranks < 1 || seconds.size() % static_cast<size_t>(ranks) != 0)
    throw std::logic_error("expert_time_over_ranks: REQUIRES seconds [ranks][blocks]");
  const size_t L = seconds.size() / static_cast<size_t>(ranks);
  BlockTimes t;
  for (size_t l = 0; l < L; ++l) {
    double most = 0, sum = 0;
    for (size_t r = 0; r < static_cast<size_t>(ranks); ++r) {
      most = std::max(most, static_cast<double>(seconds[r * L + l]));
      sum += seconds[r * L + l];
    }
    t.busiest += most;
    t.mean += sum / ranks;
  }
  return t;
}

void Sequence::add_rows(int rank, int slot, std::vector<PlacedRow>* out) const {
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (!prefill) {
    out->push_back({rank, {slot, static_cast<int32_t>(n - 1 - first), tokens.back(), true}});
    return;
  }
  for (int64_t i = first; i < n; ++i) out->push_back({rank, {slot, static_cast<int32_t>(i - first), tokens[i], i + 1 == n}});
}

bool Sequence::push(int32_t token, int64_t T) {
  tokens.push_back(token);
  prefill = static_cast<int64_t>(tokens.size()) - first > T;
  if (prefill) first = static_cast<int64_t>(tokens.size()) - T / 2;
  return prefill;
}

Lockstep::Lockstep(InferenceEngine& engine, comm::Communicator* world) : engine_(engine), world_(world) {
  if (world_ && world_->size() > 1) {
    rank_ = world_->rank();
    size_ = world_->size();
  } else {
    world_ = nullptr;
  }
}

void Lockstep::add_times(std::span<const float> expert_seconds) {
  const BlockTimes t = expert_time_over_ranks(expert_seconds, size_);
  times_.busiest_experts += t.busiest;
  times_.mean_experts += t.mean;
}

Status Lockstep::step(const std::vector<PlacedRow>& rows, std::vector<float>* logits) {
  if (!lead()) throw std::logic_error("Lockstep::step: REQUIRES the lead rank");
  if (world_) {
    message_.assign({kStep, static_cast<int64_t>(rows.size())});
    for (const PlacedRow& p : rows)
      message_.insert(message_.end(), {p.rank, p.row.slot, p.row.pos, p.row.token, p.row.logits ? 1 : 0});
    int64_t length = static_cast<int64_t>(message_.size());
    if (Status s = world_->broadcast(&length, 1, 0); !s) return s;
    if (Status s = world_->broadcast(message_.data(), length, 0); !s) return s;
  }
  return run(rows, logits);
}

Status Lockstep::finish() {
  if (!world_) return Status::ok();
  int64_t length = 2;
  message_.assign({kFinish, 0});
  if (Status s = world_->broadcast(&length, 1, 0); !s) return s;
  return world_->broadcast(message_.data(), length, 0);
}

Status Lockstep::follow() {
  if (lead()) throw std::logic_error("Lockstep::follow: REQUIRES a follower rank");
  std::vector<PlacedRow> rows;
  for (;;) {
    int64_t length = 0;
    if (Status s = world_->broadcast(&length, 1, 0); !s) return s;
    message_.resize(length);
    if (Status s = world_->broadcast(message_.data(), length, 0); !s) return s;
    if (message_[0] == kFinish) return Status::ok();
    rows.resize(message_[1]);
    for (int64_t i = 0; i < message_[1]; ++i) {
      const int64_t* f = message_.data() + 2 + i * kFields;
      rows[i] = {static_cast<int32_t>(f[0]),
                 {static_cast<int32_t>(f[1]), static_cast<int32_t>(f[2]), static_cast<int32_t>(f[3]), f[4] != 0}};
    }
    if (Status s = run(rows, nullptr); !s) return s;
  }
}

// Every rank runs its rows; the logits go to the lead in rank order, and the lead puts them back in
// the order of `rows`.
Status Lockstep::run(const std::vector<PlacedRow>& rows, std::vector<float>* logits) {
  const int64_t V = engine_.config().vocab_size;
  mine_.clear();
  std::vector<int64_t> logit_rows(size_, 0);
  for (const PlacedRow& p : rows) {
    if (p.rank < 0 || p.rank >= size_) throw std::logic_error("Lockstep: row placed on rank " + std::to_string(p.rank));
    if (p.rank == rank_) mine_.push_back(p.row);
    if (p.row.logits) ++logit_rows[p.rank];
  }
  my_logits_.resize(logit_rows[rank_] * V);
  engine_.forward(mine_, my_logits_.data());
  // Each rank's logits are followed by its expert seconds in each MoE block.
  const std::vector<double>& blocks = engine_.last_block_expert_seconds();
  const int64_t L = static_cast<int64_t>(blocks.size());
  const std::vector<float> expert_seconds(blocks.begin(), blocks.end());
  if (!world_) {
    if (logits) *logits = my_logits_;
    add_times(expert_seconds);
    return Status::ok();
  }
  my_logits_.insert(my_logits_.end(), expert_seconds.begin(), expert_seconds.end());
  std::vector<int64_t> counts(size_), displs(size_);
  int64_t total = 0;
  for (int r = 0; r < size_; ++r) counts[r] = logit_rows[r] * V + L, displs[r] = total, total += counts[r];
  std::vector<float> gathered(total);
  if (Status s = world_->allgatherv(my_logits_.data(), counts[rank_], gathered.data(), counts, displs); !s) return s;
  if (!logits) return Status::ok();
  std::vector<float> step(size_ * L);  // [R][L]
  for (int r = 0; r < size_; ++r) std::copy_n(gathered.data() + displs[r] + logit_rows[r] * V, L, step.data() + r * L);
  add_times(step);
  // Row order: the i-th logit row of rank r is at displs[r] + i * V.
  logits->resize(total - size_ * L);
  std::vector<int64_t> next(size_, 0);
  int64_t out = 0;
  for (const PlacedRow& p : rows) {
    if (!p.row.logits) continue;
    std::copy_n(gathered.data() + displs[p.rank] + next[p.rank]++ * V, V, logits->data() + out++ * V);
  }
  return Status::ok();
}

}  // namespace moe::serve
