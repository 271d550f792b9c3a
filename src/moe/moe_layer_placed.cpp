// MoeLayer with placements (moe_layer.h, "placements"): experts held by more ranks than their owner.
//
// One step on rank `me` of the ep group (R ranks; W weight tensors per expert: w1, w2 (, w3)):
//   set_placement(P)          P from a planner (Hecate Alg. 1, FasterMoE shadowing), same on every rank
//   ep_materialize            SparseAllGather(held, P) of the W*E chunks (chunk w*E + e = tensor w of
//                             expert e): each new replica lands in a replica slot
//   gate, gate_sync, dispatch counts [R][E] of kept assignments from the synced counts, then
//                             rows[s][e][d] = dispatch_plan(P, nodes, counts): every rank knows every
//                             exchange size without another collective. My expert-major rows are
//                             re-ordered destination-major (experts ascending within a destination;
//                             expert e's rows split over its destinations in ascending rank order).
//   dispatch_a2a              alltoallv of those rows
//   experts                   received rows re-ordered expert-major over the held experts (owned
//                             ascending, then the replica slots), sources ascending within an expert:
//                             one GEMM chain per held expert, owned and replica weights apart
//   combine_a2a, combine      the way back, then un-permuted into expert-major order
//   backward                  the mirror image; replica weight gradients go to the slots' gradients,
//                             then ep_reduce_replica_grads: SparseReduceScatter(P, owners).
#include <algorithm>
#include <stdexcept>
#include <string>

#include "comm/communicator.h"
#include "comm/sparse_collectives.h"
#include "moe/experts.h"
#include "moe/layout.h"
#include "moe/moe_layer.h"
#include "tensor/ops.h"
#include "util/str_cat.h"

namespace moe {

namespace {

// The placement of W*E chunks where chunk w*E + e is held like expert e.
comm::Placement chunk_placement(const std::vector<std::vector<int>>& replicas, int W) {
  comm::Placement p;
  p.reserve(replicas.size() * W);
  for (int w = 0; w < W; ++w) p.insert(p.end(), replicas.begin(), replicas.end());
  return p;
}
}  // namespace

void ReplicaMemory::add(int64_t bytes) {
  const int64_t now = now_.fetch_add(bytes) + bytes;
  int64_t peak = peak_.load();
  while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
  }
}

void MoeLayer::enable_placements(const plan::Nodes& nodes, ReplicaMemory* memory, comm::Communicator* gather) {
  if (!ep_ || ep_->size() != batch_->size())
    throw std::logic_error("MoeLayer::enable_placements: REQUIRES expert parallel over one group of every batch rank");
  const int R = ep_->size();
  if (static_cast<int>(nodes.node_of_rank.size()) != R)
    throw std::logic_error(str_cat("MoeLayer::enable_placements: nodes has ", nodes.node_of_rank.size(),
                                   " ranks, the ep group ", R));
  if (!memory) throw std::logic_error("MoeLayer::enable_placements: REQUIRES a ReplicaMemory");
  if (!gather || gather->size() != R || gather->rank() != ep_->rank())
    throw std::logic_error("MoeLayer::enable_placements: REQUIRES a gather communicator over the ep group's ranks");
  gather_ = gather;
  placed_ = true;
  memory_ = memory;
  nodes_ = nodes;
  owners_ = plan::even_placement(static_cast<int>(cfg_.n_experts), R);
  placement_ = held_ = owners_;
  owned_ = owners_.experts_owned_by(ep_->rank());
  xs_.resize({max_tokens_ * cfg_.top_k, cfg_.d_model});
  local_offset_.reserve(cfg_.n_experts + 1);
}

void MoeLayer::set_placement(const plan::LayerPlacement& p) {
  if (!placed_) throw std::logic_error("MoeLayer::set_placement: REQUIRES enable_placements");
  if (Status s = p.validate(); !s) throw std::logic_error("MoeLayer::set_placement: " + s.message());
  if (p.n_ranks != owners_.n_ranks || p.owner != owners_.owner)
    throw std::logic_error("MoeLayer::set_placement: REQUIRES the owners of this layer's shards");
  for (int e = 0; e < p.n_experts(); ++e)
    if (!std::includes(p.replicas[e].begin(), p.replicas[e].end(), held_.replicas[e].begin(),
                       held_.replicas[e].end()))
      throw std::logic_error(str_cat("MoeLayer::set_placement: expert ", e,
                                     " loses a replica materialized this step (release_replicas first)"));
  placement_ = p;
}

int64_t MoeLayer::held_experts() const {
  return static_cast<int64_t>(owned_.size() + replica_expert_.size());
}

void MoeLayer::ensure_replica_slots(int64_t slots) {
  if (slots <= slot_capacity_ && rw1_.numel() > 0) return;
  const int64_t C = cfg_.d_model, F = cfg_.d_ffn, used = static_cast<int64_t>(replica_expert_.size());
  const bool swiglu = cfg_.activation == Activation::swiglu;
  const int64_t cap = std::max(slots, slot_capacity_);
  auto grow = [&](Tensor& t, std::vector<int64_t> shape) {
    Tensor bigger(shape);
    if (t.numel() > 0) std::copy(t.data(), t.data() + used * shape[1] * shape[2], bigger.data());
    t = std::move(bigger);
  };
  grow(rw1_, {cap, F, C});
  grow(rw2_, {cap, C, F});
  grow(rg1_, {cap, F, C});
  grow(rg2_, {cap, C, F});
  if (swiglu) {
    grow(rw3_, {cap, F, C});
    grow(rg3_, {cap, F, C});
  }
  slot_capacity_ = cap;
  const int64_t bytes = cap * F * C * (swiglu ? 6 : 4) * static_cast<int64_t>(sizeof(float));
  memory_->add(bytes - replica_bytes_);
  replica_bytes_ = bytes;
}

std::vector<float*> MoeLayer::chunk_pointers(bool grads) {
  const int64_t E = cfg_.n_experts, FC = cfg_.d_ffn * cfg_.d_model;
  const bool swiglu = cfg_.activation == Activation::swiglu;
  std::vector<Tensor*> owned{grads ? &w1_.grad : &w1_.value, grads ? &w2_.grad : &w2_.value};
  std::vector<Tensor*> slots{grads ? &rg1_ : &rw1_, grads ? &rg2_ : &rw2_};
  if (swiglu) {
    owned.push_back(grads ? &w3_.grad : &w3_.value);
    slots.push_back(grads ? &rg3_ : &rw3_);
  }
  const int64_t W = static_cast<int64_t>(owned.size());
  std::vector<float*> chunks(W * E, nullptr);
  for (int64_t w = 0; w < W; ++w) {
    for (size_t i = 0; i < owned_.size(); ++i) chunks[w * E + owned_[i]] = owned[w]->data() + static_cast<int64_t>(i) * FC;
    for (size_t s = 0; s < replica_expert_.size(); ++s)
      chunks[w * E + replica_expert_[s]] = slots[w]->data() + static_cast<int64_t>(s) * FC;
  }
  return chunks;
}

void MoeLayer::ep_materialize() {
  if (!placed_) throw std::logic_error("MoeLayer::ep_materialize: REQUIRES enable_placements");
  sparse_peer_bytes_.assign(ep_->size(), 0);
  if (held_.replicas == placement_.replicas) return;
  const int me = ep_->rank(), R = ep_->size();
  const int W = cfg_.activation == Activation::swiglu ? 3 : 2;
  const int64_t FC = cfg_.d_ffn * cfg_.d_model;
  // New replica slots on this rank, after the ones already held: first in the order of the slots
  // last released (a re-materialization for backward must reproduce the forward's order, which its
  // row layout assumes), then experts ascending.
  std::vector<int> fresh;
  auto wanted = [&](int e) {
    return placement_.holds(me, e) && !held_.holds(me, e) && std::find(fresh.begin(), fresh.end(), e) == fresh.end();
  };
  for (int e : released_order_)
    if (wanted(e)) fresh.push_back(e);
  for (int e = 0; e < placement_.n_experts(); ++e)
    if (wanted(e)) fresh.push_back(e);
  ensure_replica_slots(static_cast<int64_t>(replica_expert_.size() + fresh.size()));
  for (int e : fresh) {
    // Its gradient accumulates from zero in this step's backward.
    const int64_t s = static_cast<int64_t>(replica_expert_.size());
    for (Tensor* g : {&rg1_, &rg2_, &rg3_})
      if (g->numel() > 0) std::fill(g->data() + s * FC, g->data() + (s + 1) * FC, 0.0f);
    replica_expert_.push_back(e);
  }
  const comm::SparsePlan plan = comm::plan_sparse_allgather(chunk_placement(held_.replicas, W),
                                                            chunk_placement(placement_.replicas, W), R);
  const std::vector<float*> chunks = chunk_pointers(false);
  throw_if_error(comm::sparse_allgather(*gather_, plan, chunks, FC));
  const int64_t chunk_bytes = FC * static_cast<int64_t>(sizeof(float));
  sparse_bytes_ += comm::bytes_sent(plan, me, chunk_bytes) + comm::bytes_received(plan, me, chunk_bytes);
  const std::vector<int64_t> all = comm::peer_bytes(plan, chunk_bytes);
  std::copy(all.begin() + me * R, all.begin() + (me + 1) * R, sparse_peer_bytes_.begin());
  held_ = placement_;
}

void MoeLayer::ep_reduce_replica_grads() {
  if (!placed_) throw std::logic_error("MoeLayer::ep_reduce_replica_grads: REQUIRES enable_placements");
  sparse_peer_bytes_.assign(ep_->size(), 0);
  if (held_.replicas == owners_.replicas) return;
  const int me = ep_->rank(), R = ep_->size();
  const int W = cfg_.activation == Activation::swiglu ? 3 : 2;
  const int64_t FC = cfg_.d_ffn * cfg_.d_model;
  const comm::SparsePlan plan = comm::plan_sparse_reduce_scatter(chunk_placement(held_.replicas, W),
                                                                 chunk_placement(owners_.replicas, W), R);
  const std::vector<float*> chunks = chunk_pointers(true);
  throw_if_error(comm::sparse_reduce_scatter(*gather_, plan, chunks, FC, &reduce_scratch_));
  const int64_t chunk_bytes = FC * static_cast<int64_t>(sizeof(float));
  sparse_bytes_ += comm::bytes_sent(plan, me, chunk_bytes) + comm::bytes_received(plan, me, chunk_bytes);
  const std::vector<int64_t> all = comm::peer_bytes(plan, chunk_bytes);
  std::copy(all.begin() + me * R, all.begin() + (me + 1) * R, sparse_peer_bytes_.begin());
}

void MoeLayer::release_replicas(bool free_memory) {
  if (!placed_) return;
  held_ = owners_;
  released_order_ = std::move(replica_expert_);
  replica_expert_.clear();
  if (free_memory) {
    for (Tensor* t : {&rw1_, &rw2_, &rw3_, &rg1_, &rg2_, &rg3_}) *t = Tensor();
    slot_capacity_ = 0;
    memory_->add(-replica_bytes_);
    replica_bytes_ = 0;
  }
}

std::vector<Param*> MoeLayer::expert_params() {
  std::vector<Param*> p{&w1_, &w2_};
  if (cfg_.activation == Activation::swiglu) p.push_back(&w3_);
  return p;
}

int MoeLayer::reshard(const std::vector<int>& new_owner, const std::vector<std::pair<Tensor*, Tensor*>>& moments) {
  const int64_t E = cfg_.n_experts, FC = cfg_.d_ffn * cfg_.d_model;
  const int R = ep_ ? ep_->size() : 0;
  std::vector<Param*> params = expert_params();
  if (!placed_ || held_.replicas != owners_.replicas)
    throw std::logic_error("MoeLayer::reshard: REQUIRES placements enabled and no replica held");
  if (static_cast<int64_t>(new_owner.size()) != E || moments.size() != params.size())
    throw std::logic_error("MoeLayer::reshard: REQUIRES an owner per expert and moments per expert parameter");
  for (int o : new_owner)
    if (o < 0 || o >= R) throw std::logic_error("MoeLayer::reshard: an owner outside the ep group");
  for (size_t i = 0; i < params.size(); ++i)
    if (moments[i].first->numel() != params[i]->value.numel() || moments[i].second->numel() != params[i]->value.numel())
      throw std::logic_error("MoeLayer::reshard: moments of another shape than their parameter");
  const int me = ep_->rank();
  plan::LayerPlacement next;
  next.n_ranks = R;
  next.owner = new_owner;
  for (int64_t e = 0; e < E; ++e) next.replicas.push_back({new_owner[e]});
  const std::vector<int> next_owned = next.experts_owned_by(me);
  // Chunks (k, w, e): tensor k (value, first moment, second moment) of parameter w of expert e. The
  // move is a SparseAllGather from the old owner to {old, new}; then each rank keeps its new rows.
  const int64_t W = static_cast<int64_t>(params.size()), n_next = static_cast<int64_t>(next_owned.size());
  std::vector<Tensor*> old_t;
  std::vector<Tensor> new_t;
  for (int64_t w = 0; w < W; ++w)
    for (Tensor* t : {&params[w]->value, moments[w].first, moments[w].second}) {
      old_t.push_back(t);
      std::vector<int64_t> shape = t->shape();
      shape[0] = n_next;
      new_t.emplace_back(shape);
    }
  comm::Placement before, after;
  std::vector<float*> chunks;
  auto index_in = [](const std::vector<int>& v, int e) {
    return static_cast<int64_t>(std::lower_bound(v.begin(), v.end(), e) - v.begin());
  };
  for (size_t k = 0; k < old_t.size(); ++k)
    for (int64_t e = 0; e < E; ++e) {
      const int from = owners_.owner[e], to = new_owner[e];
      before.push_back({from});
      after.push_back(from == to ? std::vector<int>{from} : std::vector<int>{std::min(from, to), std::max(from, to)});
      float* p = nullptr;
      if (to == me) p = new_t[k].data() + index_in(next_owned, static_cast<int>(e)) * FC;
      if (from == me && to != me) p = old_t[k]->data() + index_in(owned_, static_cast<int>(e)) * FC;
      if (from == me && to == me)  // stays: copy it over here
        std::copy(old_t[k]->data() + index_in(owned_, static_cast<int>(e)) * FC,
                  old_t[k]->data() + (index_in(owned_, static_cast<int>(e)) + 1) * FC, p);
      chunks.push_back(p);
    }
  const comm::SparsePlan plan = comm::plan_sparse_allgather(before, after, R);
  throw_if_error(comm::sparse_allgather(*gather_, plan, chunks, FC));
  int moved = 0;
  for (int64_t e = 0; e < E; ++e) moved += owners_.owner[e] != new_owner[e] ? 1 : 0;
  for (size_t k = 0; k < old_t.size(); ++k) *old_t[k] = std::move(new_t[k]);
  for (Param* p : params) {
    p->grad = Tensor(p->value.shape());
    p->shard_rows.assign(next_owned.begin(), next_owned.end());
    p->shard_begin = 0;
    p->full_dim0 = E;
  }
  owners_ = placement_ = held_ = next;
  owned_ = next_owned;
  return moved;
}

int64_t MoeLayer::take_sparse_bytes() {
  const int64_t b = sparse_bytes_;
  sparse_bytes_ = 0;
  return b;
}

std::vector<std::vector<int64_t>> MoeLayer::routed_counts() const {
  if (!ep_) throw std::logic_error("MoeLayer::routed_counts: REQUIRES expert parallel");
  // Kept assignments of (rank r, choice k, expert e) in the global order of layout.h: capacity goes to
  // every rank's earlier choices first, then to the same choice on earlier ranks (as ep_dispatch).
  const int64_t E = cfg_.n_experts, K = cfg_.top_k, R = batch_->size();
  const int64_t Ng = static_cast<int64_t>(stats_[E + 1]);  // tokens of the global batch
  const int64_t capacity = expert_capacity(cfg_.capacity_factor, Ng, K, E);
  std::vector<std::vector<int64_t>> kept(R, std::vector<int64_t>(E, 0));
  for (int64_t e = 0; e < E; ++e) {
    int64_t before = 0;  // kept-or-not assignments of e ahead in the global order
    for (int64_t k = 0; k < K; ++k)
      for (int64_t r = 0; r < R; ++r) {
        const int64_t n = all_counts_[(r * K + k) * E + e];
        kept[r][e] += capacity < 0 ? n : std::clamp<int64_t>(capacity - before, 0, n);
        before += n;
      }
  }
  return kept;
}

void MoeLayer::placed_dispatch() {
  const int64_t C = cfg_.d_model, E = cfg_.n_experts, R = ep_->size(), me = ep_->rank();
  const std::vector<std::vector<int64_t>> kept = routed_counts();
  for (int64_t e = 0; e < E; ++e)
    if (kept[me][e] != routing_.tokens_per_expert[e])
      throw std::logic_error(str_cat("MoeLayer: rank ", me, " keeps ", routing_.tokens_per_expert[e],
                                     " rows of expert ", e, ", the synced counts say ", kept[me][e]));
  rows_ = plan::dispatch_plan(placement_, nodes_, kept);
  const int64_t n = routing_.rows();
  send_perm_.resize(n);
  inv_send_perm_.resize(n);
  int64_t i = 0;
  for (int64_t d = 0; d < R; ++d) {
    const int64_t first = i;
    for (int64_t e = 0; e < E; ++e) {
      int64_t pos = routing_.expert_offset[e];
      for (int64_t d2 = 0; d2 < d; ++d2) pos += rows_[me][e][d2];
      for (int64_t j = 0; j < rows_[me][e][d]; ++j, ++i) {
        send_perm_[i] = static_cast<int32_t>(pos + j);
        inv_send_perm_[pos + j] = static_cast<int32_t>(i);
      }
    }
    send_counts_[d] = (i - first) * C;
    send_displs_[d] = first * C;
  }
  if (i != n) throw std::logic_error("MoeLayer: the dispatch plan does not cover this rank's rows");
  gather_rows(xs_.data(), xp_.data(), send_perm_.data(), n, C);
  int64_t recv_rows = 0;
  for (int64_t s = 0; s < R; ++s) {
    int64_t from_s = 0;
    for (int64_t e = 0; e < E; ++e) from_s += rows_[s][e][me];
    recv_counts_[s] = from_s * C;
    recv_displs_[s] = recv_rows * C;
    recv_rows += from_s;
  }
  expert_rows_ = recv_rows;
}

void MoeLayer::placed_dispatch_a2a() {
  throw_if_error(ep_->alltoallv(xs_.data(), send_counts_, send_displs_, xr_.data(), recv_counts_, recv_displs_));
}

void MoeLayer::placed_experts() {
  const int64_t C = cfg_.d_model, F = cfg_.d_ffn, R = ep_->size(), me = ep_->rank();
  const int64_t El = static_cast<int64_t>(owned_.size()), H = held_experts(), rows = expert_rows_;
  // Held experts in compute order: owned ascending, then the replica slots.
  std::vector<int> held(owned_);
  held.reserve(H);
  held.insert(held.end(), replica_expert_.begin(), replica_expert_.end());
  perm_.resize(rows);
  inv_perm_.resize(rows);
  local_offset_.assign(H + 1, 0);
  int64_t i = 0;
  for (int64_t h = 0; h < H; ++h) {
    const int e = held[h];
    local_offset_[h] = i;
    for (int64_t s = 0; s < R; ++s) {
      int64_t src = recv_displs_[s] / C;
      for (int e2 = 0; e2 < e; ++e2) src += rows_[s][e2][me];
      for (int64_t j = 0; j < rows_[s][e][me]; ++j, ++i) {
        perm_[i] = static_cast<int32_t>(src + j);
        inv_perm_[src + j] = static_cast<int32_t>(i);
      }
    }
  }
  local_offset_[H] = i;
  if (i != rows) throw std::logic_error(str_cat("MoeLayer: rank ", me, " received rows of experts it does not hold"));
  gather_rows(xe_.data(), xr_.data(), perm_.data(), rows, C);
  const bool swiglu = cfg_.activation == Activation::swiglu;
  experts_forward(ye_.data(), h1_.data(), swiglu ? h3_.data() : nullptr, act_.data(), xe_.data(),
                  local_offset_.data(), w1_.value.data(), w2_.value.data(), swiglu ? w3_.value.data() : nullptr,
                  ExpertShape{El, C, F, cfg_.activation});
  if (H > El)
    experts_forward(ye_.data(), h1_.data(), swiglu ? h3_.data() : nullptr, act_.data(), xe_.data(),
                    local_offset_.data() + El, rw1_.data(), rw2_.data(), swiglu ? rw3_.data() : nullptr,
                    ExpertShape{H - El, C, F, cfg_.activation});
  gather_rows(yr_.data(), ye_.data(), inv_perm_.data(), rows, C);
}

void MoeLayer::placed_combine_a2a() {
  throw_if_error(ep_->alltoallv(yr_.data(), recv_counts_, recv_displs_, xs_.data(), send_counts_, send_displs_));
  gather_rows(outp_.data(), xs_.data(), inv_send_perm_.data(), routing_.rows(), cfg_.d_model);
}

void MoeLayer::placed_combine_a2a_bwd() {
  gather_rows(xs_.data(), dout_p_.data(), send_perm_.data(), routing_.rows(), cfg_.d_model);
  throw_if_error(ep_->alltoallv(xs_.data(), send_counts_, send_displs_, dr_.data(), recv_counts_, recv_displs_));
}

void MoeLayer::placed_experts_bwd() {
  const int64_t C = cfg_.d_model, F = cfg_.d_ffn;
  const int64_t El = static_cast<int64_t>(owned_.size()), H = held_experts(), rows = expert_rows_;
  const bool swiglu = cfg_.activation == Activation::swiglu;
  gather_rows(de_.data(), dr_.data(), perm_.data(), rows, C);
  experts_backward(dxe_.data(), w1_.grad.data(), w2_.grad.data(), swiglu ? w3_.grad.data() : nullptr, dact_.data(),
                   dh_.data(), swiglu ? dh3_.data() : nullptr, de_.data(), xe_.data(), h1_.data(),
                   swiglu ? h3_.data() : nullptr, act_.data(), local_offset_.data(), w1_.value.data(),
                   w2_.value.data(), swiglu ? w3_.value.data() : nullptr, ExpertShape{El, C, F, cfg_.activation});
  if (H > El)
    experts_backward(dxe_.data(), rg1_.data(), rg2_.data(), swiglu ? rg3_.data() : nullptr, dact_.data(), dh_.data(),
                     swiglu ? dh3_.data() : nullptr, de_.data(), xe_.data(), h1_.data(),
                     swiglu ? h3_.data() : nullptr, act_.data(), local_offset_.data() + El, rw1_.data(),
                     rw2_.data(), swiglu ? rw3_.data() : nullptr, ExpertShape{H - El, C, F, cfg_.activation});
  gather_rows(dxr_.data(), dxe_.data(), inv_perm_.data(), rows, C);
}

void MoeLayer::placed_dispatch_a2a_bwd() {
  throw_if_error(ep_->alltoallv(dxr_.data(), recv_counts_, recv_displs_, xs_.data(), send_counts_, send_displs_));
  gather_rows(dxp_.data(), xs_.data(), inv_send_perm_.data(), routing_.rows(), cfg_.d_model);
}

}  // namespace moe
