// MoeLayer's replicas (moe_layer.h, "placements"): experts held this step by more ranks than their
// owner, and shards that change owner. The data path itself is moe_layer.cpp's, the same for every
// placement; here are the weights' movements around it:
//   set_placement(P)          P from a planner (Hecate Alg. 1, FasterMoE shadowing), same on every rank
//   ep_materialize            SparseAllGather(held, P) of the W*E chunks (chunk w*E + e = tensor w of
//                             expert e; W weight tensors per expert: w1, w2 (, w3)): each new replica
//                             lands in a replica slot
//   ep_reduce_replica_grads   after the experts' backward: SparseReduceScatter(P, owners) of the
//                             replica slots' gradients into the owners'
//   reshard                   between steps: shards and their AdamW moments to new owners
#include <algorithm>
#include <iterator>
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
  memory_ = memory;
  nodes_ = nodes;
}

void MoeLayer::set_placement(const plan::LayerPlacement& p) {
  if (!gather_) throw std::logic_error("MoeLayer::set_placement: REQUIRES enable_placements");
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

void MoeLayer::set_inference_placement(const plan::LayerPlacement& p) {
  if (!gather_) throw std::logic_error("MoeLayer::set_inference_placement: REQUIRES enable_placements");
  if (Status s = p.validate(); !s) throw std::logic_error("MoeLayer::set_inference_placement: " + s.message());
  if (p.n_ranks != owners_.n_ranks || p.owner != owners_.owner)
    throw std::logic_error("MoeLayer::set_inference_placement: REQUIRES the owners of this layer's shards");
  placement_ = p;
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

void MoeLayer::record_sparse_traffic(const comm::SparsePlan& plan, int64_t chunk_bytes) {
  const int me = ep_->rank(), R = ep_->size();
  sparse_received_bytes_ = comm::bytes_received(plan, me, chunk_bytes);
  sparse_bytes_ += comm::bytes_sent(plan, me, chunk_bytes) + sparse_received_bytes_;
  const std::vector<int64_t> all = comm::peer_bytes(plan, chunk_bytes);
  std::copy(all.begin() + me * R, all.begin() + (me + 1) * R, sparse_peer_bytes_.begin());
}

void MoeLayer::ep_materialize() {
  if (!gather_) throw std::logic_error("MoeLayer::ep_materialize: REQUIRES enable_placements");
  sparse_peer_bytes_.assign(ep_->size(), 0);
  sparse_received_bytes_ = 0;
  // What is held afterwards: the placement, and the replicas held now that it does not use (none in
  // training, where set_placement keeps every held replica; a cache in inference).
  plan::LayerPlacement target = placement_;
  for (int e = 0; e < target.n_experts(); ++e) {
    std::vector<int> both;
    std::set_union(held_.replicas[e].begin(), held_.replicas[e].end(), placement_.replicas[e].begin(),
                   placement_.replicas[e].end(), std::back_inserter(both));
    target.replicas[e] = std::move(both);
  }
  if (held_.replicas == target.replicas) return;
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
  const comm::SparsePlan plan = comm::plan_sparse_allgather(
      chunk_placement(held_.replicas, W), chunk_placement(target.replicas, W), R, nodes_.node_of_rank);
  const std::vector<float*> chunks = chunk_pointers(false);
  throw_if_error(comm::sparse_allgather(*gather_, plan, chunks, FC));
  record_sparse_traffic(plan, FC * static_cast<int64_t>(sizeof(float)));
  held_ = std::move(target);
}

void MoeLayer::ep_reduce_replica_grads() {
  sparse_peer_bytes_.assign(ep_->size(), 0);
  sparse_received_bytes_ = 0;
  if (held_.replicas == owners_.replicas) return;  // no replica: nothing to send home
  const int R = ep_->size();
  const int W = cfg_.activation == Activation::swiglu ? 3 : 2;
  const int64_t FC = cfg_.d_ffn * cfg_.d_model;
  const comm::SparsePlan plan = comm::plan_sparse_reduce_scatter(
      chunk_placement(held_.replicas, W), chunk_placement(owners_.replicas, W), R, nodes_.node_of_rank);
  const std::vector<float*> chunks = chunk_pointers(true);
  throw_if_error(comm::sparse_reduce_scatter(*gather_, plan, chunks, FC, &reduce_scratch_));
  record_sparse_traffic(plan, FC * static_cast<int64_t>(sizeof(float)));
}

void MoeLayer::retain_replicas(const plan::LayerPlacement& keep) {
  if (!gather_) throw std::logic_error("MoeLayer::retain_replicas: REQUIRES enable_placements");
  if (!keep.validate() || keep.owner != owners_.owner)
    throw std::logic_error("MoeLayer::retain_replicas: the placement must be valid and keep this layer's owners");
  const int me = ep_->rank();
  for (int e = 0; e < held_.n_experts(); ++e) {
    std::vector<int> both;
    std::set_intersection(held_.replicas[e].begin(), held_.replicas[e].end(), keep.replicas[e].begin(),
                          keep.replicas[e].end(), std::back_inserter(both));
    held_.replicas[e] = std::move(both);
  }
  // Compact this rank's slots, keeping their order (a step's row layout follows it).
  const int64_t FC = cfg_.d_ffn * cfg_.d_model;
  std::vector<int> kept;
  for (size_t s = 0; s < replica_expert_.size(); ++s) {
    if (!held_.holds(me, replica_expert_[s])) continue;
    const int64_t to = static_cast<int64_t>(kept.size());
    if (to != static_cast<int64_t>(s))
      for (Tensor* t : {&rw1_, &rw2_, &rw3_})
        if (t->numel() > 0) std::copy_n(t->data() + s * FC, FC, t->data() + to * FC);
    kept.push_back(replica_expert_[s]);
  }
  replica_expert_ = std::move(kept);
  placement_ = held_;
}

void MoeLayer::release_replicas(bool free_memory) {
  if (!gather_) return;
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
  if (!gather_ || held_.replicas != owners_.replicas)
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
  const comm::SparsePlan plan = comm::plan_sparse_allgather(before, after, R, nodes_.node_of_rank);
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

}  // namespace moe
