#include "serve/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <future>
#include <numeric>
#include <stdexcept>
#include <string>

#include "moe/experts.h"
#include "tensor/ops.h"
#include "util/quantile.h"

namespace moe::serve {

struct InferenceEngine::Block {
  const Param *norm1_w = nullptr, *norm1_b = nullptr, *qkv_w = nullptr, *proj_w = nullptr;
  const Param *norm2_w = nullptr, *norm2_b = nullptr;
  MoeLayer* moe = nullptr;                                        // MoE block
  const Param *mlp_w1 = nullptr, *mlp_w2 = nullptr, *mlp_w3 = nullptr;  // dense block
};

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

const Param* find_param(const std::vector<Param*>& params, const std::string& name, bool required = true) {
  for (const Param* p : params)
    if (p->name == name) return p;
  if (required) throw std::logic_error("InferenceEngine: the model has no parameter " + name);
  return nullptr;
}

void add_rows(float* out, const float* a, const float* b, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

}  // namespace

InferenceEngine::InferenceEngine(Model& model, int64_t slots, int64_t max_rows)
    : model_(model), cfg_(model.config()), slots_(slots), max_rows_(max_rows) {
  const int64_t C = cfg_.d_model, F = cfg_.d_ffn, T = cfg_.seq_len, NH = cfg_.n_heads, L = cfg_.n_layers;
  if (slots < 1 || max_rows < 1 || max_rows > model.max_batch() * T)
    throw std::logic_error("InferenceEngine: REQUIRES slots >= 1 and 1 <= max_rows (" + std::to_string(max_rows) +
                           ") <= max_batch * seq_len (" + std::to_string(model.max_batch() * T) + ")");
  const std::vector<Param*> params = model.params();
  const bool layernorm = !cfg_.use_rmsnorm();
  wte_ = find_param(params, "wte.weight");
  wpe_ = find_param(params, "wpe.weight");
  normf_w_ = find_param(params, "norm_f.weight");
  normf_b_ = find_param(params, "norm_f.bias", layernorm);
  for (int64_t l = 0; l < L; ++l) {
    const std::string p = "blocks." + std::to_string(l) + ".";
    Block b;
    b.norm1_w = find_param(params, p + "norm1.weight");
    b.norm1_b = find_param(params, p + "norm1.bias", layernorm);
    b.qkv_w = find_param(params, p + "attn.qkv.weight");
    b.proj_w = find_param(params, p + "attn.proj.weight");
    b.norm2_w = find_param(params, p + "norm2.weight");
    b.norm2_b = find_param(params, p + "norm2.bias", layernorm);
    if (cfg_.is_moe_layer(l)) {
      b.moe = model.moe_layer(l);
    } else {
      b.mlp_w1 = find_param(params, p + "mlp.w1");
      b.mlp_w2 = find_param(params, p + "mlp.w2");
      b.mlp_w3 = find_param(params, p + "mlp.w3", cfg_.activation_kind() == Activation::swiglu);
    }
    blocks_.push_back(b);
    k_.emplace_back(std::vector<int64_t>{slots, T, C});
    v_.emplace_back(std::vector<int64_t>{slots, T, C});
  }
  const int64_t N = max_rows;
  x_.resize({N, C});
  ln_.resize({N, C});
  norm_mean_.resize({N});
  norm_rstd_.resize({N});
  qkv_.resize({N, 3 * C});
  atty_.resize({N, C});
  tmp_.resize({N, C});
  h1_.resize({N, F});
  h3_.resize({N, F});
  act_.resize({N, F});
  att_.resize({N, NH, T});
  last_.resize({N, C});
  loads_.assign(L, std::vector<int64_t>(cfg_.n_experts, 0));
  for (int64_t l = 0; l < L; ++l) n_moe_ += cfg_.is_moe_layer(l);
}

const char* schedule_name(Schedule s) {
  switch (s) {
    case Schedule::ep: return "ep";
    case Schedule::lina: return "lina";
    case Schedule::lina_no_estimate: return "lina-no-estimate";
    case Schedule::lina_no_phase2: return "lina-no-phase2";
    case Schedule::ideal: return "ideal";
  }
  return "?";
}

bool parse_schedule(const std::string& name, Schedule* out) {
  for (Schedule s : {Schedule::ep, Schedule::lina, Schedule::lina_no_estimate, Schedule::lina_no_phase2, Schedule::ideal})
    if (name == schedule_name(s)) return *out = s, true;
  return false;
}

void InferenceEngine::set_schedule(Schedule s, const plan::PathProfile* profile, comm::Communicator* world) {
  schedule_ = s;
  profile_ = profile;
  world_ = nullptr;
  for (const Block& b : blocks_)
    if (b.moe) b.moe->set_balanced_gate(s == Schedule::ideal);
  if (s == Schedule::ep || s == Schedule::ideal || !world || world->size() == 1) return;
  if ((s == Schedule::lina || s == Schedule::lina_no_phase2) &&
      (!profile || profile->moe_layers() != n_moe_ || profile->experts() != cfg_.n_experts))
    throw std::logic_error("InferenceEngine::set_schedule: lina needs a path profile of this model's MoE blocks");
  for (const Block& b : blocks_)
    if (b.moe && !b.moe->expert_parallel())
      throw std::logic_error("InferenceEngine::set_schedule: REQUIRES the model expert-parallel over world");
  world_ = world;
  const size_t RE = static_cast<size_t>(world->size()) * static_cast<size_t>(cfg_.n_experts);
  foregone_.assign(n_moe_, std::vector<double>(RE, 0.0));
  last_used_.assign(n_moe_, std::vector<int64_t>(RE, -1));
  plan::Nodes nodes;
  nodes.node_of_rank.assign(world->size(), 0);
  model_.enable_placements(nodes, world);
  // Lina's planner splits an expert's tokens over its replicas so as to level the ranks
  // (plan::lina_busiest_seconds): dispatch them so. Hecate's rule (own rank first) lets a replica
  // serve only its own rank's tokens.
  for (const Block& b : blocks_)
    if (b.moe) b.moe->set_dispatch_rule(plan::DispatchRule::balanced);
}

plan::LayerPlacement InferenceEngine::plan_block(int64_t m, const MoeLayer& moe, const std::vector<double>& popularity) {
  return plan::lina_placement(popularity, moe.owners(), cost_ ? &*cost_ : nullptr, &moe.held(),
                              replica_cache_ > 0 ? &foregone_[m] : nullptr);
}

void InferenceEngine::place(int64_t m, MoeLayer* moe, const plan::LayerPlacement& p) {
  const int R = p.n_ranks, E = p.n_experts();
  if (replica_cache_ == 0) {
    moe->retain_replicas(p);
    moe->set_placement(p);
  } else {
    // Keep p's replicas held now and, per rank, the replica_cache_ most recently used others.
    std::vector<int64_t>& last = last_used_[m];
    for (int e = 0; e < E; ++e)
      for (int r : p.replicas[e])
        if (r != p.owner[e]) last[static_cast<size_t>(r) * E + e] = forwards_;
    const plan::LayerPlacement& held = moe->held();
    plan::LayerPlacement keep = p;
    for (int r = 0; r < R; ++r) {
      std::vector<int> unused;  // experts r holds as a replica that p does not put there
      for (int e = 0; e < E; ++e)
        if (held.holds(r, e) && held.owner[e] != r && !p.holds(r, e)) unused.push_back(e);
      std::stable_sort(unused.begin(), unused.end(), [&](int a, int b) {
        return last[static_cast<size_t>(r) * E + a] > last[static_cast<size_t>(r) * E + b];
      });
      if (static_cast<int>(unused.size()) > replica_cache_) unused.resize(replica_cache_);
      for (int e : unused) {
        std::vector<int>& holders = keep.replicas[e];
        holders.insert(std::upper_bound(holders.begin(), holders.end(), r), r);
      }
    }
    moe->retain_replicas(keep);
    moe->set_inference_placement(p);
  }
  moe->ep_materialize();
  for (const auto& holders : p.replicas) stats_.replicas += static_cast<int64_t>(holders.size()) - 1;
  for (int e = 0; e < E; ++e)
    stats_.cached += static_cast<int64_t>(moe->held().replicas[e].size() - p.replicas[e].size());
  stats_.gathered_bytes += moe->take_sparse_bytes();
}

void InferenceEngine::set_lina_cost(const plan::LinaCost& cost) {
  cost_ = start_cost_ = cost;
  runs_.emplace(cost.rows);
  fitted_.emplace(cost.rows);
}

// Every kRefitForwards forwards (collective, as forward() is): the ranks' runs since the last refit
// summed, the older ones halved, the curve refitted with start-up's, scaled to the runs' level, as the
// prior (as if 16 runs had measured each of its points alone: plan::LinaCurveFit::fitted).
void InferenceEngine::refit_lina_cost() {
  if (!runs_ || !world_ || forwards_ % kRefitForwards != 0) return;
  std::vector<double> sums = runs_->sums();
  if (Status s = world_->allreduce(sums.data(), static_cast<int64_t>(sums.size())); !s)
    throw std::runtime_error("InferenceEngine: refitting Lina's cost: " + s.message());
  runs_->clear();
  fitted_->decay(0.5);
  fitted_->add_sums(sums);
  cost_ = fitted_->fitted(*start_cost_, 16);
}

bool InferenceEngine::estimates() const {
  return schedule_ == Schedule::lina || schedule_ == Schedule::lina_no_phase2;
}

// Lina's phase 1 for MoE block l (its m-th), before the block's attention: the batch's popularity as
// estimated at the previous MoE block's gate (next_estimate_) and the placement. A placement that
// gathers weights is started on another thread so that they move while this thread computes the
// attention (Lina moves experts behind computation); its weights are ready when the returned future
// is. One within the held replicas is placed here (a decode step of a few rows takes about a
// millisecond, and a thread's start and join cost a good part of it). estimate_ keeps the estimate
// for phase 2. No other thread uses the ranks' communicator meanwhile: the attention does not
// communicate.
std::future<void> InferenceEngine::start_phase1(int64_t l, int64_t m) {
  MoeLayer* moe = blocks_[l].moe;
  estimate_.clear();
  if (estimates() && m >= 1) {
    estimate_ = std::move(next_estimate_);
    next_estimate_.clear();
    if (replica_cache_ > 0) foregone_before_phase1_ = foregone_[m];
    plan::LayerPlacement p = plan_block(m, *moe, estimate_);
    ++stats_.estimated;
    bool gathers = false;
    for (int e = 0; e < p.n_experts() && !gathers; ++e)
      gathers = !std::includes(moe->held().replicas[e].begin(), moe->held().replicas[e].end(),
                               p.replicas[e].begin(), p.replicas[e].end());
    if (!gathers) {
      place(m, moe, p);
      return {};
    }
    return std::async(std::launch::async, [this, m, moe, p = std::move(p)] { place(m, moe, p); });
  }
  if (schedule_ == Schedule::lina_no_phase2) place(m, moe, moe->owners());
  return {};
}

// Lina's phase 2 around the gate (plan/lina.h), after phase 1's gather, then the exchange over the
// placement they chose. The gate's counts exchange also sums the next MoE block's estimate (Lina's
// Eq. 1 over each rank's rows, their paths now known up to this block's first choices), so phase 1
// of that block needs no collective of its own.
void InferenceEngine::scheduled_moe(int64_t l, int64_t m, int64_t N, std::future<void>* phase1) {
  MoeLayer* moe = blocks_[l].moe;
  const int64_t E = cfg_.n_experts, K = cfg_.top_k, stride = n_moe_ * K;
  Clock::time_point t = Clock::now();
  if (phase1->valid()) phase1->get();  // rethrows the gather's error
  last_stages_.schedule += seconds_since(t);
  const std::vector<double>& estimate = estimate_;
  t = Clock::now();
  moe->ep_gate(ln_.data(), N);
  last_stages_.gate += seconds_since(t);
  t = Clock::now();
  next_estimate_.clear();
  if (estimates() && m + 1 < n_moe_) {
    const std::vector<int32_t>& first = moe->routing().expert;  // [N*K], this block's choices
    std::vector<int32_t>& paths = paths_;  // [N][m+1]: each row's first choices up to this block
    paths.resize(N * (m + 1));
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t j = 0; j < m; ++j) paths[n * (m + 1) + j] = routes_[n * stride + j * K];
      paths[n * (m + 1) + m] = first[n * K];
    }
    next_estimate_ = profile_->estimate(m + 1, paths, m + 1, K);
  }
  last_stages_.schedule += seconds_since(t);
  t = Clock::now();
  moe->ep_gate_sync(&next_estimate_);
  last_stages_.gate += seconds_since(t);
  t = Clock::now();
  std::vector<double> actual(E, 0.0);
  for (const auto& rank_counts : moe->routed_counts())
    for (int64_t e = 0; e < E; ++e) actual[e] += static_cast<double>(rank_counts[e]);
  const bool accurate = !estimate.empty() && plan::top_experts(estimate, K) == plan::top_experts(actual, K);
  stats_.accurate += accurate;
  const bool replan = schedule_ == Schedule::lina_no_estimate || (schedule_ == Schedule::lina && !accurate);
  if (replan) {
    // Rent or buy counts one plan per forward: this one, not also the wrong estimate's before it.
    if (replica_cache_ > 0 && !estimate.empty()) foregone_[m] = foregone_before_phase1_;
    place(m, moe, plan_block(m, *moe, actual));
    stats_.replanned += !estimate.empty();  // the first MoE block has no estimate to re-plan
  }
  last_stages_.schedule += seconds_since(t);
  t = Clock::now();
  moe->ep_dispatch(&exchange_);
  moe->ep_dispatch_a2a(exchange_);
  last_stages_.exchange += seconds_since(t);
  t = Clock::now();
  moe->ep_experts(&exchange_);
  const double experts_seconds = seconds_since(t);
  last_stages_.experts += experts_seconds;
  if (runs_) {
    const std::vector<int64_t>& at = exchange_.local_offset;  // the rows each held expert just ran
    std::vector<int64_t> rows(at.size() - 1);
    for (size_t h = 0; h + 1 < at.size(); ++h) rows[h] = at[h + 1] - at[h];
    runs_->add(rows, experts_seconds);
  }
  t = Clock::now();
  moe->ep_combine_a2a(exchange_);
  moe->ep_combine(exchange_, tmp_.data());
  last_stages_.exchange += seconds_since(t);
}

// The rows every rank's experts ran in the MoE layer forward that used `ex` (its dispatch plan is
// every rank's, the same on each).
void InferenceEngine::count_rank_rows(const TokenExchange& ex) {
  const std::vector<int64_t> rows = plan::received_tokens(ex.rows);
  ++stats_.layer_steps;
  stats_.busiest_rank_rows += *std::max_element(rows.begin(), rows.end());
  stats_.mean_rank_rows += static_cast<double>(std::accumulate(rows.begin(), rows.end(), int64_t{0})) /
                           static_cast<double>(rows.size());
}

InferenceEngine::~InferenceEngine() = default;

std::vector<double> InferenceEngine::measure_expert_seconds(const std::vector<int64_t>& rows) const {
  if (rows.empty()) throw std::logic_error("InferenceEngine::measure_expert_seconds: REQUIRES rows");
  for (int64_t n : rows)
    if (n < 1) throw std::logic_error("InferenceEngine::measure_expert_seconds: REQUIRES rows >= 1");
  struct Expert {
    const float *w1, *w2, *w3;  // this expert's rows of the layer's [E,F,C], [E,C,F], [E,F,C]
    ExpertShape shape;          // E = 1
  };
  std::vector<Expert> experts;
  for (const Block& b : blocks_) {
    if (!b.moe) continue;
    const std::vector<Param*> w = b.moe->expert_params();
    const MoeConfig& c = b.moe->config();
    const int64_t FC = c.d_ffn * c.d_model;
    for (int64_t i = 0; i < w[0]->value.shape()[0]; ++i)
      experts.push_back({w[0]->value.data() + i * FC, w[1]->value.data() + i * FC,
                         w.size() > 2 ? w[2]->value.data() + i * FC : nullptr,
                         ExpertShape{1, c.d_model, c.d_ffn, c.activation}});
  }
  if (experts.empty()) return std::vector<double>(rows.size(), 0.0);
  const int64_t C = cfg_.d_model, F = cfg_.d_ffn, most = *std::max_element(rows.begin(), rows.end());
  const bool swiglu = experts[0].w3 != nullptr;
  std::vector<float> xp(most * C, 0.01f), out(most * C), h1(most * F), h3(swiglu ? most * F : 0), act(most * F);
  // Seconds per expert for n rows, every expert once.
  auto pass = [&](int64_t n) {
    const int64_t off[2] = {0, n};
    const Clock::time_point t = Clock::now();
    for (const Expert& e : experts)
      experts_forward(out.data(), h1.data(), swiglu ? h3.data() : nullptr, act.data(), xp.data(), off, e.w1, e.w2,
                      e.w3, e.shape);
    return seconds_since(t) / static_cast<double>(experts.size());
  };
  pass(most);  // warm-up
  std::vector<std::vector<double>> times(rows.size());
  for (int i = 0; i < 5; ++i)  // the sizes in turn, so a slow spell of the machine falls on all of them
    for (size_t j = 0; j < rows.size(); ++j) times[j].push_back(pass(rows[j]));
  std::vector<double> median(rows.size());
  for (size_t j = 0; j < rows.size(); ++j) median[j] = nearest_rank_quantile(times[j], 0.5);
  return median;
}

// Each row attends over its slot's cached positions 0..pos (attend_query): the training forward's
// mathematics, its values to float rounding.
void InferenceEngine::attention(int64_t l, std::span<const Row> rows) {
  const int64_t C = cfg_.d_model, NH = cfg_.n_heads, HS = C / NH, T = cfg_.seq_len;
  const int64_t N = static_cast<int64_t>(rows.size());
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
#pragma omp parallel for collapse(2) schedule(dynamic, 4) if (N * NH > 8)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < NH; ++h) {
      const Row& r = rows[n];
      const int64_t cache = static_cast<int64_t>(r.slot) * T * C + h * HS;  // position 0 of the slot, head h
      float* a = att_.data() + (n * NH + h) * T;
      attend_query(atty_.data() + n * C + h * HS, a, a, qkv_.data() + n * 3 * C + h * HS, k_[l].data() + cache,
                   v_[l].data() + cache, C, r.pos + 1, HS, scale);
    }
}

void InferenceEngine::forward(std::span<const Row> rows, float* logits) {
  const int64_t C = cfg_.d_model, F = cfg_.d_ffn, T = cfg_.seq_len, V = cfg_.vocab_size;
  const int64_t N = static_cast<int64_t>(rows.size());
  if (N > max_rows_)
    throw std::logic_error("InferenceEngine::forward: " + std::to_string(N) + " rows > max_rows " +
                           std::to_string(max_rows_));
  for (const Row& r : rows)
    if (r.slot < 0 || r.slot >= slots_ || r.pos < 0 || r.pos >= T || r.token < 0 || r.token >= V)
      throw std::logic_error("InferenceEngine::forward: row (slot " + std::to_string(r.slot) + ", pos " +
                             std::to_string(r.pos) + ", token " + std::to_string(r.token) + ") out of range");
  const bool rms = cfg_.use_rmsnorm();
  auto norm = [&](float* out, const float* in, const Param* w, const Param* b, int64_t n) {
    if (rms) rmsnorm_forward(out, norm_rstd_.data(), in, w->value.data(), n, C, kNormEps);
    else layernorm_forward(out, norm_mean_.data(), norm_rstd_.data(), in, w->value.data(), b->value.data(), n, C, kNormEps);
  };

  const Clock::time_point start = Clock::now();
  last_stages_ = {};
  block_experts_.assign(n_moe_, 0.0);
  // x[n] = wte[token] + wpe[pos]
  for (int64_t n = 0; n < N; ++n) {
    const float* te = wte_->value.data() + static_cast<int64_t>(rows[n].token) * C;
    const float* pe = wpe_->value.data() + static_cast<int64_t>(rows[n].pos) * C;
    float* x = x_.data() + n * C;
    for (int64_t i = 0; i < C; ++i) x[i] = te[i] + pe[i];
  }
  routes_.assign(N * n_moe_ * cfg_.top_k, 0);
  ++forwards_;
  int64_t m = 0;  // MoE blocks passed
  for (int64_t l = 0; l < static_cast<int64_t>(blocks_.size()); ++l) {
    const Block& b = blocks_[l];
    std::future<void> phase1;  // Lina's gather for this block's MoE layer, behind its attention
    if (b.moe && world_) {
      const Clock::time_point t = Clock::now();
      phase1 = start_phase1(l, m);
      last_stages_.schedule += seconds_since(t);
    }
    // h = x + proj(attention(qkv(norm1(x))))
    if (N > 0) {
      norm(ln_.data(), x_.data(), b.norm1_w, b.norm1_b, N);
      linear_forward(qkv_.data(), ln_.data(), b.qkv_w->value.data(), N, C, 3 * C);
      for (int64_t n = 0; n < N; ++n) {
        const int64_t at = (static_cast<int64_t>(rows[n].slot) * T + rows[n].pos) * C;
        std::copy_n(qkv_.data() + n * 3 * C + C, C, k_[l].data() + at);
        std::copy_n(qkv_.data() + n * 3 * C + 2 * C, C, v_[l].data() + at);
      }
      attention(l, rows);
      linear_forward(tmp_.data(), atty_.data(), b.proj_w->value.data(), N, C, C);
      add_rows(x_.data(), x_.data(), tmp_.data(), N * C);
      norm(ln_.data(), x_.data(), b.norm2_w, b.norm2_b, N);
    }
    // x = h + ffn(norm2(h)); the MoE layer is collective over the ranks, rows or not
    if (b.moe) {
      const double experts_before = last_stages_.experts;
      if (world_) {
        scheduled_moe(l, m, N, &phase1);
      } else {
        b.moe->forward(tmp_.data(), ln_.data(), N);
        const MoeLayer::ForwardSeconds s = b.moe->take_forward_seconds();
        last_stages_.gate += s.gate, last_stages_.exchange += s.exchange, last_stages_.experts += s.experts;
      }
      block_experts_[m] = last_stages_.experts - experts_before;
      if (b.moe->expert_parallel()) count_rank_rows(world_ ? exchange_ : b.moe->forward_exchange());
      const Routing& r = b.moe->routing();
      for (int64_t a = 0; a < N * r.K; ++a) ++loads_[l][r.expert[a]];
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < r.K; ++k) routes_[n * n_moe_ * r.K + m * r.K + k] = r.expert[n * r.K + k];
      ++m;
    } else if (N > 0) {
      linear_forward(h1_.data(), ln_.data(), b.mlp_w1->value.data(), N, C, F);
      if (b.mlp_w3) {
        linear_forward(h3_.data(), ln_.data(), b.mlp_w3->value.data(), N, C, F);
        swiglu_forward(act_.data(), h1_.data(), h3_.data(), N * F);
      } else {
        gelu_forward(act_.data(), h1_.data(), N * F);
      }
      linear_forward(tmp_.data(), act_.data(), b.mlp_w2->value.data(), N, F, C);
    }
    if (N > 0) add_rows(x_.data(), x_.data(), tmp_.data(), N * C);
  }
  // logits = norm_f(x) @ wte^T, for the rows that ask
  int64_t n_out = 0;
  for (int64_t n = 0; n < N; ++n)
    if (rows[n].logits) std::copy_n(x_.data() + n * C, C, last_.data() + (n_out++) * C);
  if (n_out > 0) {
    norm(ln_.data(), last_.data(), normf_w_, normf_b_, n_out);
    linear_forward(logits, ln_.data(), wte_->value.data(), n_out, C, V);
  }
  if (world_) {
    const Clock::time_point t = Clock::now();
    refit_lina_cost();
    last_stages_.schedule += seconds_since(t);
  }
  last_stages_.forwards = 1;
  last_stages_.total = seconds_since(start);
  stages_ += last_stages_;
}

std::vector<std::vector<int64_t>> InferenceEngine::take_expert_loads() {
  std::vector<std::vector<int64_t>> out = loads_;
  for (auto& layer : loads_) std::fill(layer.begin(), layer.end(), 0);
  return out;
}

}  // namespace moe::serve
