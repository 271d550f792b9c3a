// MoeLayer: composes the phases router -> layout -> dispatch -> experts -> combine (see moe_layer.h).
#include "moe/moe_layer.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>

#include "comm/communicator.h"
#include "moe/combine.h"
#include "moe/experts.h"
#include "moe/layout.h"
#include "moe/router.h"
#include "tensor/ops.h"
#include "util/str_cat.h"

namespace moe {

namespace {
const MoeConfig& validated(const MoeConfig& c, int64_t max_tokens) {
  auto fail = [](const std::string& m) { throw std::invalid_argument("MoeLayer config: " + m); };
  if (c.d_model <= 0) fail("d_model (" + std::to_string(c.d_model) + ") must be > 0");
  if (c.d_ffn <= 0) fail("d_ffn (" + std::to_string(c.d_ffn) + ") must be > 0");
  if (c.n_experts <= 0) fail("n_experts (" + std::to_string(c.n_experts) + ") must be > 0");
  if (c.top_k < 1 || c.top_k > c.n_experts)
    fail("top_k (" + std::to_string(c.top_k) + ") must be in [1, n_experts = " + std::to_string(c.n_experts) + "]");
  if (!(c.capacity_factor >= 0.0f)) fail("capacity_factor must be >= 0 (0 = dropless)");
  if (!c.router_bias.empty() && static_cast<int64_t>(c.router_bias.size()) != c.n_experts)
    fail("router_bias must be empty or hold n_experts values");
  if (max_tokens <= 0 || max_tokens * c.top_k > INT32_MAX) fail("max_tokens out of range");
  return c;
}

ExpertShape expert_shape(const MoeConfig& c) { return ExpertShape{c.n_experts, c.d_model, c.d_ffn, c.activation}; }
}  // namespace

MoeLayer::MoeLayer(const std::string& prefix, const MoeConfig& cfg, int64_t max_tokens)
    : cfg_(validated(cfg, max_tokens)),
      max_tokens_(max_tokens),
      router_(prefix + "router.weight", {cfg.n_experts, cfg.d_model}),
      w1_(prefix + "w1", {cfg.n_experts, cfg.d_ffn, cfg.d_model}),
      w2_(prefix + "w2", {cfg.n_experts, cfg.d_model, cfg.d_ffn}),
      w3_(prefix + "w3", cfg.activation == Activation::swiglu
                             ? std::vector<int64_t>{cfg.n_experts, cfg.d_ffn, cfg.d_model}
                             : std::vector<int64_t>{0}) {
  const int64_t N = max_tokens, C = cfg.d_model, F = cfg.d_ffn, E = cfg.n_experts, K = cfg.top_k;
  const int64_t NK = N * K;
  const bool swiglu = cfg.activation == Activation::swiglu;
  routing_reserve(routing_, N, K, E);
  layout_scratch_.resize(layout_scratch_size(E, K));
  logits_.resize({N, E});
  probs_.resize({N, E});
  dprobs_.resize({N, E});
  dlogits_.resize({N, E});
  lse_.resize({N});
  load_frac_.resize({E});
  mean_prob_.resize({E});
  xp_.resize({NK, C});
  outp_.resize({NK, C});
  dout_p_.resize({NK, C});
  dxp_.resize({NK, C});
  h1_.resize({NK, F});
  act_.resize({NK, F});
  dact_.resize({NK, F});
  dh_.resize({NK, F});
  if (swiglu) {
    h3_.resize({NK, F});
    dh3_.resize({NK, F});
  }
  row_weight_.resize({NK});
  dgate_.resize({NK});
}

std::vector<Param*> MoeLayer::params() {
  std::vector<Param*> p{&router_, &w1_, &w2_};
  if (cfg_.activation == Activation::swiglu) p.push_back(&w3_);
  return p;
}

void MoeLayer::forward(float* y, const float* x, int64_t N) {
  if (N < 0 || N > max_tokens_)
    throw std::logic_error("MoeLayer::forward: REQUIRES 0 <= N (" + std::to_string(N) + ") <= max_tokens (" +
                           std::to_string(max_tokens_) + ")");
  const int64_t C = cfg_.d_model, E = cfg_.n_experts, K = cfg_.top_k;
  x_ = x;
  n_ = N;
  if (ep_) return forward_ep(y, x, N);
  // router: gate choices and weights, then the losses (f_e counts choices before dropping)
  router_forward(logits_.data(), probs_.data(), routing_, x, router_.value.data(), N, C, E, K, cfg_.renormalize,
                 cfg_.router_bias.empty() ? nullptr : cfg_.router_bias.data());
  if (balanced_gate_) balance_routing(N);
  RouterLosses l = router_loss_forward(lse_.data(), load_frac_.data(), mean_prob_.data(), logits_.data(),
                                       probs_.data(), routing_, N, E);
  aux_loss_ = l.aux;
  z_loss_ = l.z;
  // layout: expert-contiguous rows, capacity dropping in global order
  layout_build(routing_, expert_capacity(cfg_.capacity_factor, N, K, E), layout_scratch_.data());
  // dispatch -> experts -> combine
  dispatch_forward(xp_.data(), x, routing_, C);
  experts_forward(outp_.data(), h1_.data(), h3_.data(), act_.data(), xp_.data(), routing_.expert_offset.data(),
                  w1_.value.data(), w2_.value.data(), w3_.value.data(), expert_shape(cfg_));
  combine_forward(y, row_weight_.data(), outp_.data(), routing_, C);
  expert_rows_ = routing_.rows();
}

void MoeLayer::backward(float* dx, const float* dy) {
  if (!x_) throw std::logic_error("MoeLayer::backward: REQUIRES forward() first");
  if (ep_) return backward_ep(dx, dy);
  const int64_t N = n_, C = cfg_.d_model, E = cfg_.n_experts;
  combine_backward(dout_p_.data(), dgate_.data(), dy, outp_.data(), routing_, C);
  experts_backward(dxp_.data(), w1_.grad.data(), w2_.grad.data(), w3_.grad.data(), dact_.data(), dh_.data(),
                   dh3_.data(), dout_p_.data(), xp_.data(), h1_.data(), h3_.data(), act_.data(),
                   routing_.expert_offset.data(), w1_.value.data(), w2_.value.data(), w3_.value.data(),
                   expert_shape(cfg_));
  dispatch_backward(dx, dxp_.data(), routing_, C);
  router_backward(dx, router_.grad.data(), dprobs_.data(), dlogits_.data(), dgate_.data(), routing_, probs_.data(),
                  lse_.data(), load_frac_.data(), x_, router_.value.data(), N, C, E, cfg_.renormalize,
                  cfg_.aux_loss_weight, cfg_.z_loss_weight);
}

// ---- expert parallelism -------------------------------------------------------------------------
//
// One data path for every strategy. The experts' placement (plan::LayerPlacement) says which ranks
// hold which experts this step; EP is the placement in which each expert has one holder, its owner
// (rank e / El at first). Forward on rank `me` of the ep group (P ranks):
//   gate (local tokens) -> ep_gate_sync: allgather of per-(k,e) choice counts, allreduce of prob
//   sums, lse^2 sum and token count -> ep_dispatch: global aux, z and capacity; layout with `prior`
//   (rows expert-major); every rank's kept rows per expert from the synced counts, so the dispatch
//   plan (rows[s][e][d], plan::dispatch_plan) and every exchange size are known without another
//   collective; my rows put destination-major (a no-op when each destination's experts are
//   contiguous and ascending, as under EP's first placement)
//   -> ep_dispatch_a2a: alltoallv of the rows -> ep_experts: source-major -> held-expert-major,
//   GEMM chains, back -> ep_combine_a2a: alltoallv back -> ep_combine: expert-major, gate-weighted
//   sum. Backward runs the same exchanges in reverse. Rows of one expert arrive ordered by source
//   rank, then by token: the global token order, as in the single-process layout. Row permutations
//   run in the compute phases only; the *_a2a phases only exchange.

void MoeLayer::set_expert_parallel(comm::Communicator* ep, comm::Communicator* batch) {
  if (!batch) batch = ep;
  if (!ep || batch->size() == 1) {
    ep_ = batch_ = nullptr;
    return;
  }
  const int64_t P = ep->size(), E = cfg_.n_experts, K = cfg_.top_k;
  if (E % P != 0)
    throw std::invalid_argument("expert parallelism: n_experts (" + std::to_string(E) +
                                ") must be a multiple of the ranks in the expert-parallel group (" +
                                std::to_string(P) + ")");
  if (batch->size() % P != 0) throw std::logic_error("MoeLayer::set_expert_parallel: REQUIRES ep size | batch size");
  if (ep_) throw std::logic_error("MoeLayer::set_expert_parallel: REQUIRES one call per layer");
  ep_ = ep;
  batch_ = batch;
  const int64_t El = E / P, rows = P * max_tokens_ * K;  // at most every group rank's every assignment
  // Keep only my experts' weights: rows [e0, e0 + El) of w1, w2, w3 (their gradients restart at 0).
  // A group of one rank keeps them all: nothing is sharded.
  const int64_t e0 = ep->rank() * El;
  for (Param* p : {&w1_, &w2_, &w3_}) {
    if (p->value.numel() == 0 || P == 1) continue;  // w3 without SwiGLU
    std::vector<int64_t> shape = p->value.shape();
    const int64_t per_expert = static_cast<int64_t>(p->value.numel()) / shape[0];
    Tensor mine(std::vector<int64_t>{El, shape[1], shape[2]});
    std::copy(p->value.data() + e0 * per_expert, p->value.data() + (e0 + El) * per_expert, mine.data());
    p->value = std::move(mine);
    p->grad.resize({El, shape[1], shape[2]});
    p->shard_begin = e0;
    p->full_dim0 = E;
  }
  // Which batch rank each ep rank is: the synced counts are per batch rank, the exchanges per ep rank.
  const int64_t my_batch_rank = batch->rank();
  batch_rank_of_ep_.assign(P, 0);
  throw_if_error(ep->allgather(&my_batch_rank, 1, batch_rank_of_ep_.data()));
  owners_ = placement_ = held_ = plan::even_placement(static_cast<int>(E), static_cast<int>(P));
  owned_ = owners_.experts_owned_by(ep->rank());
  nodes_.node_of_rank.assign(P, 0);
  local_counts_.assign(K * E, 0);
  all_counts_.assign(batch->size() * K * E, 0);
  stats_.assign(E + 2, 0.0);
  prior_.assign(E * K, 0);
  size_received_buffers(rows);
}

void MoeLayer::forward_ep(float* y, const float* x, int64_t N) {
  // In one call (evaluation, tests) tokens go to the replicas held now: a step's planned replicas are
  // gathered by the runtime's materialize ops, not here.
  placement_ = held_;
  using Clock = std::chrono::steady_clock;
  const Clock::time_point t0 = Clock::now();
  ep_gate(x, N);
  ep_gate_sync();
  const Clock::time_point t1 = Clock::now();
  ep_dispatch(&own_exchange_);
  ep_dispatch_a2a(own_exchange_);
  const Clock::time_point t2 = Clock::now();
  ep_experts(&own_exchange_);
  const Clock::time_point t3 = Clock::now();
  ep_combine_a2a(own_exchange_);
  ep_combine(own_exchange_, y);
  const auto s = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
  forward_seconds_.gate += s(t1 - t0);
  forward_seconds_.exchange += s(t2 - t1) + s(Clock::now() - t3);
  forward_seconds_.experts += s(t3 - t2);
}

void MoeLayer::backward_ep(float* dx, const float* dy) {
  ep_combine_bwd(own_exchange_, dy);
  ep_combine_a2a_bwd(own_exchange_);
  ep_experts_bwd(own_exchange_);
  ep_reduce_replica_grads();
  ep_dispatch_a2a_bwd(own_exchange_);
  ep_gate_bwd(own_exchange_, dx);
}

void MoeLayer::balance_routing(int64_t N) {
  const int64_t E = cfg_.n_experts, K = cfg_.top_k;
  const int64_t shift = batch_ ? static_cast<int64_t>(batch_->rank()) * N : 0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      routing_.expert[n * K + k] = static_cast<int32_t>((n * K + k + shift) % E);
      routing_.weight[n * K + k] = 1.0f / static_cast<float>(K);
    }
}

void MoeLayer::ep_gate(const float* x, int64_t N) {
  if (N < 0 || N > max_tokens_ || !ep_) throw std::logic_error("MoeLayer::ep_gate: REQUIRES expert parallel, N <= max");
  const int64_t C = cfg_.d_model, E = cfg_.n_experts, K = cfg_.top_k;
  x_ = x;
  n_ = N;
  router_forward(logits_.data(), probs_.data(), routing_, x, router_.value.data(), N, C, E, K, cfg_.renormalize,
                 cfg_.router_bias.empty() ? nullptr : cfg_.router_bias.data());
  if (balanced_gate_) balance_routing(N);
  RouterLosses local = router_loss_forward(lse_.data(), load_frac_.data(), mean_prob_.data(), logits_.data(),
                                           probs_.data(), routing_, N, E);
  std::fill(local_counts_.begin(), local_counts_.end(), 0);
  for (int64_t a = 0; a < N * K; ++a) ++local_counts_[(a % K) * E + routing_.expert[a]];
  for (int64_t e = 0; e < E; ++e) stats_[e] = static_cast<double>(mean_prob_[e]) * N;
  stats_[E] = static_cast<double>(local.z) * N;
  stats_[E + 1] = static_cast<double>(N);
}

void MoeLayer::ep_gate_sync(std::vector<double>* sum_also) {
  const int64_t E = cfg_.n_experts, K = cfg_.top_k;
  throw_if_error(batch_->allgather(local_counts_.data(), K * E, all_counts_.data()));
  if (!sum_also || sum_also->empty()) {
    throw_if_error(batch_->allreduce(stats_.data(), E + 2));
    return;
  }
  std::vector<double> both(stats_.begin(), stats_.begin() + E + 2);
  both.insert(both.end(), sum_also->begin(), sum_also->end());
  throw_if_error(batch_->allreduce(both.data(), static_cast<int64_t>(both.size())));
  std::copy_n(both.begin(), E + 2, stats_.begin());
  std::copy(both.begin() + E + 2, both.end(), sum_also->begin());
}

void MoeLayer::ep_dispatch(TokenExchange* ex) {
  const int64_t C = cfg_.d_model, E = cfg_.n_experts, K = cfg_.top_k, R = batch_->size(), me = batch_->rank();
  const int64_t Ng = static_cast<int64_t>(stats_[E + 1]);
  loss_tokens_ = Ng;
  double aux = 0;
  for (int64_t e = 0; e < E; ++e) {
    int64_t chosen = 0;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t k = 0; k < K; ++k) chosen += all_counts_[(r * K + k) * E + e];
    const double f = Ng ? static_cast<double>(chosen) / static_cast<double>(Ng * K) : 0.0;
    load_frac_[e] = static_cast<float>(f);
    mean_prob_[e] = Ng ? static_cast<float>(stats_[e] / Ng) : 0.0f;
    aux += f * (Ng ? stats_[e] / Ng : 0.0);
    // Kept assignments before mine in the global order: every rank's earlier choices, then the
    // same choice on earlier ranks (the single-process order of layout.h).
    for (int64_t k = 0; k < K; ++k) {
      int64_t before = 0;
      for (int64_t r = 0; r < R; ++r)
        for (int64_t k2 = 0; k2 < k; ++k2) before += all_counts_[(r * K + k2) * E + e];
      for (int64_t r = 0; r < me; ++r) before += all_counts_[(r * K + k) * E + e];
      prior_[e * K + k] = before;
    }
  }
  aux_loss_ = static_cast<float>(E * aux);
  z_loss_ = Ng ? static_cast<float>(stats_[E] / Ng) : 0.0f;
  layout_build(routing_, expert_capacity(cfg_.capacity_factor, Ng, K, E), layout_scratch_.data(), prior_.data());
  dispatch_forward(xp_.data(), x_, routing_, C);
  plan_exchange(ex);
  expert_rows_ = ex->received_rows;
  if (!ex->send_in_place) to_send_order(*ex, xs_.data(), xp_.data());
}

void MoeLayer::set_router_bias(std::vector<float> bias) {
  if (!bias.empty() && static_cast<int64_t>(bias.size()) != cfg_.n_experts)
    throw std::invalid_argument("MoeLayer::set_router_bias: " + std::to_string(bias.size()) + " values, E is " +
                                std::to_string(cfg_.n_experts));
  cfg_.router_bias = std::move(bias);
}

void MoeLayer::set_padded_exchange(bool on) {
  if (on && (!ep_ || gather_))
    throw std::logic_error("MoeLayer::set_padded_exchange: REQUIRES expert parallel without placements");
  padded_ = on;
}

void MoeLayer::to_send_order(const TokenExchange& ex, float* dst, const float* src) {
  const int64_t C = cfg_.d_model, n = routing_.rows();
  if (!ex.padded) return gather_rows(dst, src, ex.send_perm.data(), n, C);
  std::fill(dst, dst + ex.send_rows * C, 0.0f);
  for (int64_t i = 0; i < n; ++i) std::copy(src + i * C, src + (i + 1) * C, dst + ex.inv_send_perm[i] * C);
}

void MoeLayer::size_received_buffers(int64_t rows) {
  const int64_t C = cfg_.d_model, F = cfg_.d_ffn;
  for (Tensor* t : {&xr_, &xe_, &ye_, &yr_, &dr_, &de_, &dxe_, &dxr_}) t->resize({rows, C});
  for (Tensor* t : {&h1_, &act_, &dact_, &dh_}) t->resize({rows, F});
  if (cfg_.activation == Activation::swiglu)
    for (Tensor* t : {&h3_, &dh3_}) t->resize({rows, F});
}

// Doubled at least: a padded exchange's slots creep up over the steps, and each growth reallocates and
// zeroes the received rows' buffers (tens of MB, page faults included: 20-100 ms in one dispatch on 2
// ranks). Grown to the exact size, every small rise paid that again (most steps of a 12-step run).
void MoeLayer::grow_exchange_buffers(int64_t received_rows, int64_t sent_rows) {
  const int64_t C = cfg_.d_model;
  const int64_t held_rows = static_cast<int64_t>(xr_.numel()) / C;
  if (held_rows < received_rows) size_received_buffers(std::max(received_rows, 2 * held_rows));
  const int64_t send_rows = static_cast<int64_t>(xs_.numel()) / C;
  if (send_rows < sent_rows) xs_.resize({std::max(sent_rows, 2 * send_rows), C});
}

// Every rank sends each expert of the ep group ex->slots rows (its kept rows first, then zeros),
// experts of one destination ascending; each rank receives that many rows per held expert from every
// source.
void MoeLayer::plan_padded_exchange(TokenExchange* ex, const std::vector<std::vector<int64_t>>& kept) {
  const int64_t C = cfg_.d_model, P = ep_->size();
  ex->padded = true;
  ex->slots = 0;
  for (const std::vector<int64_t>& row : kept)
    for (int64_t k : row) ex->slots = std::max(ex->slots, k);
  const int64_t n = routing_.rows();
  ex->inv_send_perm.resize(n);
  int64_t pos = 0;
  for (int64_t d = 0; d < P; ++d) {
    const int64_t first = pos;
    for (int e : owners_.experts_owned_by(static_cast<int>(d))) {
      for (int64_t j = 0; j < kept[ep_->rank()][e]; ++j)
        ex->inv_send_perm[routing_.expert_offset[e] + j] = static_cast<int32_t>(pos + j);
      pos += ex->slots;
    }
    ex->send_counts[d] = (pos - first) * C;
    ex->send_displs[d] = first * C;
  }
  ex->send_rows = pos;
  ex->send_in_place = false;
  const int64_t per_source = static_cast<int64_t>(owned_.size()) * ex->slots;
  for (int64_t s = 0; s < P; ++s) {
    ex->recv_counts[s] = per_source * C;
    ex->recv_displs[s] = s * per_source * C;
  }
  ex->received_rows = P * per_source;
  grow_exchange_buffers(ex->received_rows, ex->send_rows);
}

void MoeLayer::plan_exchange(TokenExchange* ex) {
  const int64_t C = cfg_.d_model, E = cfg_.n_experts, P = ep_->size(), me = ep_->rank();
  ex->rank = static_cast<int>(me);
  ex->ranks = static_cast<int>(P);
  ex->row_floats = C;
  ex->placement = placement_;
  ex->padded = false;
  ex->slots = 0;
  ex->send_counts.assign(P, 0), ex->send_displs.assign(P, 0), ex->recv_counts.assign(P, 0), ex->recv_displs.assign(P, 0);
  ex->held_order.clear(), ex->local_offset.clear(), ex->perm.clear(), ex->inv_perm.clear();
  // Kept rows of every ep rank per expert (routed_counts is per batch rank).
  const std::vector<std::vector<int64_t>> kept_by_batch_rank = routed_counts();
  std::vector<std::vector<int64_t>> kept(P);
  for (int64_t s = 0; s < P; ++s) kept[s] = kept_by_batch_rank[batch_rank_of_ep_[s]];
  for (int64_t e = 0; e < E; ++e)
    if (kept[me][e] != routing_.tokens_per_expert[e])
      throw std::logic_error(str_cat("MoeLayer: rank ", me, " keeps ", routing_.tokens_per_expert[e],
                                     " rows of expert ", e, ", the synced counts say ", kept[me][e]));
  if (padded_) return plan_padded_exchange(ex, kept);
  ex->rows = plan::dispatch_plan(placement_, nodes_, kept, dispatch_rule_);
  const auto& rows = ex->rows;
  // My rows destination-major: experts ascending within a destination, expert e's rows split over its
  // destinations in ascending rank order.
  const int64_t n = routing_.rows();
  ex->send_perm.resize(n);
  ex->inv_send_perm.resize(n);
  ex->send_in_place = true;
  ex->send_rows = n;
  int64_t i = 0;
  for (int64_t d = 0; d < P; ++d) {
    const int64_t first = i;
    for (int64_t e = 0; e < E; ++e) {
      int64_t pos = routing_.expert_offset[e];
      for (int64_t d2 = 0; d2 < d; ++d2) pos += rows[me][e][d2];
      for (int64_t j = 0; j < rows[me][e][d]; ++j, ++i) {
        ex->send_perm[i] = static_cast<int32_t>(pos + j);
        ex->inv_send_perm[pos + j] = static_cast<int32_t>(i);
        ex->send_in_place = ex->send_in_place && pos + j == i;
      }
    }
    ex->send_counts[d] = (i - first) * C;
    ex->send_displs[d] = first * C;
  }
  if (i != n) throw std::logic_error("MoeLayer: the dispatch plan does not cover this rank's rows");
  if (!ex->send_in_place) grow_exchange_buffers(0, n);
  int64_t recv_rows = 0;
  for (int64_t s = 0; s < P; ++s) {
    int64_t from_s = 0;
    for (int64_t e = 0; e < E; ++e) from_s += rows[s][e][me];
    ex->recv_counts[s] = from_s * C;
    ex->recv_displs[s] = recv_rows * C;
    recv_rows += from_s;
  }
  ex->received_rows = recv_rows;
}

void MoeLayer::ep_dispatch_a2a(const TokenExchange& ex) {
  const float* send = ex.send_in_place ? xp_.data() : xs_.data();
  throw_if_error(ep_->alltoallv(send, ex.send_counts, ex.send_displs, xr_.data(), ex.recv_counts, ex.recv_displs));
}

void MoeLayer::ep_dispatch_a2a(const TokenExchange& ex, int chunk, int n_chunks) {
  if (n_chunks == 1) return ep_dispatch_a2a(ex);
  std::vector<int64_t> sc, sd, rc, rd;
  ex.chunk_counts(chunk, n_chunks, &sc, &sd, &rc, &rd);
  const float* send = ex.send_in_place ? xp_.data() : xs_.data();
  throw_if_error(ep_->alltoallv(send, sc, sd, xr_.data(), rc, rd));
}

void MoeLayer::order_received_rows(TokenExchange* ex) {
  const int64_t C = cfg_.d_model, P = ep_->size(), me = ep_->rank(), rows = ex->received_rows;
  // Held experts in compute order: owned ascending, then the replica slots in gather order.
  ex->held_order.assign(owned_.begin(), owned_.end());
  ex->held_order.insert(ex->held_order.end(), replica_expert_.begin(), replica_expert_.end());
  const int64_t H = static_cast<int64_t>(ex->held_order.size());
  ex->perm.resize(rows);
  ex->inv_perm.resize(rows);
  ex->local_offset.assign(H + 1, 0);
  int64_t i = 0;
  for (int64_t h = 0; h < H; ++h) {
    const int e = ex->held_order[h];
    ex->local_offset[h] = i;
    for (int64_t s = 0; s < P; ++s) {
      int64_t src = ex->recv_displs[s] / C;
      if (ex->padded) {  // slots rows per held expert from each source, padding included
        src += h * ex->slots;
        for (int64_t j = 0; j < ex->slots; ++j, ++i) {
          ex->perm[i] = static_cast<int32_t>(src + j);
          ex->inv_perm[src + j] = static_cast<int32_t>(i);
        }
        continue;
      }
      for (int e2 = 0; e2 < e; ++e2) src += ex->rows[s][e2][me];
      for (int64_t j = 0; j < ex->rows[s][e][me]; ++j, ++i) {
        ex->perm[i] = static_cast<int32_t>(src + j);
        ex->inv_perm[src + j] = static_cast<int32_t>(i);
      }
    }
  }
  ex->local_offset[H] = i;
  if (i != rows) throw std::logic_error(str_cat("MoeLayer: rank ", me, " received rows of experts it does not hold"));
}

void MoeLayer::ep_experts(TokenExchange* ex) {
  const int64_t C = cfg_.d_model, F = cfg_.d_ffn, rows = ex->received_rows;
  order_received_rows(ex);
  const int64_t El = static_cast<int64_t>(owned_.size()), H = static_cast<int64_t>(ex->held_order.size());
  gather_rows(xe_.data(), xr_.data(), ex->perm.data(), rows, C);
  const bool swiglu = cfg_.activation == Activation::swiglu;
  experts_forward(ye_.data(), h1_.data(), swiglu ? h3_.data() : nullptr, act_.data(), xe_.data(),
                  ex->local_offset.data(), w1_.value.data(), w2_.value.data(), swiglu ? w3_.value.data() : nullptr,
                  ExpertShape{El, C, F, cfg_.activation});
  if (H > El)  // the replicas, from their slots
    experts_forward(ye_.data(), h1_.data(), swiglu ? h3_.data() : nullptr, act_.data(), xe_.data(),
                    ex->local_offset.data() + El, rw1_.data(), rw2_.data(), swiglu ? rw3_.data() : nullptr,
                    ExpertShape{H - El, C, F, cfg_.activation});
  gather_rows(yr_.data(), ye_.data(), ex->inv_perm.data(), rows, C);
}

int64_t MoeLayer::ep_experts(TokenExchange* ex, int chunk, int n_chunks) {
  if (n_chunks == 1) {
    ep_experts(ex);
    return ex->received_rows;
  }
  if (chunk < 0 || chunk >= n_chunks) throw std::logic_error(str_cat("MoeLayer::ep_experts: chunk ", chunk, " of ", n_chunks));
  if (chunk == 0) order_received_rows(ex);
  const int64_t C = cfg_.d_model, F = cfg_.d_ffn;
  const int64_t El = static_cast<int64_t>(owned_.size()), H = static_cast<int64_t>(ex->held_order.size());
  const std::vector<int> chunk_of = plan::exchange_chunks(ex->placement, n_chunks)[ep_->rank()];
  const bool swiglu = cfg_.activation == Activation::swiglu;
  int64_t rows = 0;
  for (int64_t h = 0; h < H; ++h) {
    if (chunk_of[ex->held_order[h]] != chunk) continue;
    const int64_t lo = ex->local_offset[h], hi = ex->local_offset[h + 1];
    gather_rows(xe_.data() + lo * C, xr_.data(), ex->perm.data() + lo, hi - lo, C);
    // One expert: owned ones are rows h of w1_, w2_, w3_; replicas slot h - El of rw1_, rw2_, rw3_.
    const int64_t slot = h < El ? h : h - El;
    const float* w1 = (h < El ? w1_.value.data() : rw1_.data()) + slot * F * C;
    const float* w2 = (h < El ? w2_.value.data() : rw2_.data()) + slot * C * F;
    const float* w3 = swiglu ? (h < El ? w3_.value.data() : rw3_.data()) + slot * F * C : nullptr;
    experts_forward(ye_.data(), h1_.data(), swiglu ? h3_.data() : nullptr, act_.data(), xe_.data(),
                    ex->local_offset.data() + h, w1, w2, w3, ExpertShape{1, C, F, cfg_.activation});
    for (int64_t i = lo; i < hi; ++i)
      std::copy(ye_.data() + i * C, ye_.data() + (i + 1) * C, yr_.data() + static_cast<int64_t>(ex->perm[i]) * C);
    rows += hi - lo;
  }
  return rows;
}

void MoeLayer::ep_combine_a2a(const TokenExchange& ex) {
  float* recv = ex.send_in_place ? outp_.data() : xs_.data();
  throw_if_error(ep_->alltoallv(yr_.data(), ex.recv_counts, ex.recv_displs, recv, ex.send_counts, ex.send_displs));
}

void MoeLayer::ep_combine(const TokenExchange& ex, float* y) {
  const int64_t C = cfg_.d_model;
  if (!ex.send_in_place) gather_rows(outp_.data(), xs_.data(), ex.inv_send_perm.data(), routing_.rows(), C);
  combine_forward(y, row_weight_.data(), outp_.data(), routing_, C);
}

void MoeLayer::ep_combine_bwd(const TokenExchange& ex, const float* dy) {
  if (!x_) throw std::logic_error("MoeLayer::ep_combine_bwd: REQUIRES forward first");
  const int64_t C = cfg_.d_model;
  combine_backward(dout_p_.data(), dgate_.data(), dy, outp_.data(), routing_, C);
  if (!ex.send_in_place) to_send_order(ex, xs_.data(), dout_p_.data());
}

void MoeLayer::ep_combine_a2a_bwd(const TokenExchange& ex) {
  const float* send = ex.send_in_place ? dout_p_.data() : xs_.data();
  throw_if_error(ep_->alltoallv(send, ex.send_counts, ex.send_displs, dr_.data(), ex.recv_counts, ex.recv_displs));
}

void MoeLayer::ep_experts_bwd(const TokenExchange& ex) {
  const int64_t C = cfg_.d_model, F = cfg_.d_ffn, rows = ex.received_rows;
  const int64_t El = static_cast<int64_t>(owned_.size()), H = static_cast<int64_t>(ex.held_order.size());
  const bool swiglu = cfg_.activation == Activation::swiglu;
  gather_rows(de_.data(), dr_.data(), ex.perm.data(), rows, C);
  experts_backward(dxe_.data(), w1_.grad.data(), w2_.grad.data(), swiglu ? w3_.grad.data() : nullptr, dact_.data(),
                   dh_.data(), swiglu ? dh3_.data() : nullptr, de_.data(), xe_.data(), h1_.data(),
                   swiglu ? h3_.data() : nullptr, act_.data(), ex.local_offset.data(), w1_.value.data(),
                   w2_.value.data(), swiglu ? w3_.value.data() : nullptr, ExpertShape{El, C, F, cfg_.activation});
  if (H > El)  // the replicas' gradients go to their slots (ep_reduce_replica_grads sends them home)
    experts_backward(dxe_.data(), rg1_.data(), rg2_.data(), swiglu ? rg3_.data() : nullptr, dact_.data(), dh_.data(),
                     swiglu ? dh3_.data() : nullptr, de_.data(), xe_.data(), h1_.data(),
                     swiglu ? h3_.data() : nullptr, act_.data(), ex.local_offset.data() + El, rw1_.data(),
                     rw2_.data(), swiglu ? rw3_.data() : nullptr, ExpertShape{H - El, C, F, cfg_.activation});
  gather_rows(dxr_.data(), dxe_.data(), ex.inv_perm.data(), rows, C);
}

void MoeLayer::ep_dispatch_a2a_bwd(const TokenExchange& ex) {
  float* recv = ex.send_in_place ? dxp_.data() : xs_.data();
  throw_if_error(ep_->alltoallv(dxr_.data(), ex.recv_counts, ex.recv_displs, recv, ex.send_counts, ex.send_displs));
}

void MoeLayer::ep_gate_bwd(const TokenExchange& ex, float* dx) {
  const int64_t N = n_, C = cfg_.d_model, E = cfg_.n_experts;
  if (!ex.send_in_place) gather_rows(dxp_.data(), xs_.data(), ex.inv_send_perm.data(), routing_.rows(), C);
  dispatch_backward(dx, dxp_.data(), routing_, C);
  router_backward(dx, router_.grad.data(), dprobs_.data(), dlogits_.data(), dgate_.data(), routing_, probs_.data(),
                  lse_.data(), load_frac_.data(), x_, router_.value.data(), N, C, E, cfg_.renormalize,
                  cfg_.aux_loss_weight, cfg_.z_loss_weight, loss_tokens_);
}

}  // namespace moe
