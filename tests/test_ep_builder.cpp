// The expert-parallel step graph (graph/ep_builder.h): which ops, on which lanes, in which order,
// and that its gradient buckets cover exactly the parameters a rank holds.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <stdexcept>

#include "graph/ep_builder.h"
#include "model/model.h"

namespace {

using moe::graph::Group;
using moe::graph::Op;
using moe::graph::OpKind;

moe::ModelConfig small_model() {
  moe::ModelConfig c;
  c.seq_len = 16;
  c.d_model = 16;
  c.n_layers = 3;
  c.n_heads = 2;
  c.d_ffn = 32;
  c.n_experts = 4;
  c.top_k = 2;
  c.dense_every_other = true;  // blocks 0, 2 MoE; block 1 dense
  return c;
}

const Op* find(const moe::graph::StepGraph& g, OpKind k, int layer, int micro = 0) {
  for (const Op& op : g.ops)
    if (op.kind == k && op.layer == layer && op.micro == micro) return &op;
  return nullptr;
}

TEST(EpBuilder, OneProcessIsComputeOnlyInModelOrder) {
  moe::graph::EpStep s = moe::graph::build_ep_step(small_model(), {1, 1, 4, 1 << 20});
  ASSERT_TRUE(s.graph.validate());
  EXPECT_EQ(s.graph.streams.size(), 1u);
  EXPECT_TRUE(s.buckets.empty());
  // (push_back one at a time: GCC 12 warns falsely on inserting lists into a vector of a 1-byte enum)
  std::vector<OpKind> want{OpKind::embed_fwd};
  for (int l = 0; l < 3; ++l) {
    want.push_back(OpKind::attn_fwd);
    want.push_back(OpKind::ffn_fwd);
  }
  want.push_back(OpKind::head_fwd);
  want.push_back(OpKind::head_bwd);
  for (int l = 2; l >= 0; --l) {
    want.push_back(OpKind::ffn_bwd);
    want.push_back(OpKind::attn_bwd);
  }
  want.push_back(OpKind::embed_bwd);
  ASSERT_EQ(s.graph.ops.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(s.graph.ops[i].kind, want[i]) << i;
}

TEST(EpBuilder, ExpertParallelPutsExchangesOnTheA2aLaneAndGradientsUnderBackward) {
  const moe::ModelConfig cfg = small_model();
  moe::graph::EpStep s = moe::graph::build_ep_step(cfg, {2, 2, 4, 4096});
  const auto& g = s.graph;
  ASSERT_TRUE(g.validate());
  ASSERT_EQ(g.streams.size(), 3u);
  EXPECT_TRUE(g.streams[moe::graph::kA2aStream].communication);
  // MoE blocks are split into phases with the exchanges on the all-to-all lane, chained in order.
  for (int l : {0, 2}) {
    SCOPED_TRACE(l);
    OpKind chain[] = {OpKind::attn_fwd,    OpKind::gate_fwd,    OpKind::gate_sync,  OpKind::dispatch_fwd,
                      OpKind::dispatch_a2a, OpKind::expert_fwd, OpKind::combine_a2a, OpKind::combine_fwd};
    int prev = -1;
    for (OpKind k : chain) {
      const Op* op = find(g, k, l);
      ASSERT_NE(op, nullptr) << moe::graph::op_kind_name(k);
      EXPECT_EQ(op->stream, moe::graph::is_communication(k) ? moe::graph::kA2aStream : 0);
      if (moe::graph::is_communication(k)) {
        EXPECT_EQ(op->priority, moe::graph::kA2aPriority);
      }
      if (prev >= 0) {
        EXPECT_EQ(op->deps, std::vector<int>{prev});
      }
      prev = op->id;
    }
    EXPECT_EQ(find(g, OpKind::dispatch_a2a, l)->group, Group::ep);
    EXPECT_EQ(find(g, OpKind::gate_sync, l)->group, Group::world);
  }
  EXPECT_NE(find(g, OpKind::ffn_fwd, 1), nullptr);  // the dense block stays whole
  // Block l's gradient allreduce starts after attn_bwd(l) and is queued before block l-1's backward,
  // so it can run under it; it never gates compute (no compute op depends on it).
  for (int l : {2, 1}) {
    const Op* ar = find(g, OpKind::grad_allreduce, l);
    ASSERT_NE(ar, nullptr);
    EXPECT_EQ(ar->stream, moe::graph::kAllreduceStream);
    EXPECT_LT(ar->priority, moe::graph::kA2aPriority);
    EXPECT_EQ(ar->deps, std::vector<int>{find(g, OpKind::attn_bwd, l)->id});
    EXPECT_LT(ar->id, find(g, OpKind::attn_bwd, l - 1)->id);
  }
  for (const Op& op : g.ops) {
    if (moe::graph::is_communication(op.kind)) continue;
    for (int d : op.deps) EXPECT_NE(g.ops[d].kind, OpKind::grad_allreduce) << g.op_name(op);
  }
  // One replica of each expert: expert gradients are complete on their owner, nothing to sum.
  for (const auto& b : s.buckets) EXPECT_EQ(b.group, Group::world) << b.label;
}

TEST(EpBuilder, BucketsCoverEveryParameterARankHoldsOnce) {
  const moe::ModelConfig cfg = small_model();
  moe::Model model(cfg, 1);
  int64_t dense = 0, experts = 0;
  std::set<std::string> names;
  for (moe::Param* p : model.params()) {
    (p->name.find(".moe.w") != std::string::npos ? experts : dense) += static_cast<int64_t>(p->value.numel());
    names.insert(p->name);
  }
  // 4 ranks in expert-parallel groups of 2: dense parameters over the world, each rank's half of the
  // experts over its dp group (the other replica).
  moe::graph::EpStep s = moe::graph::build_ep_step(cfg, {4, 2, 1, 1 << 10});
  int64_t world = 0, dp = 0;
  std::set<std::string> seen;
  for (const auto& b : s.buckets) {
    (b.group == Group::world ? world : dp) += b.elements;
    for (const std::string& n : b.params) {
      EXPECT_TRUE(names.count(n)) << n;
      EXPECT_TRUE(seen.insert(n).second) << n << " in two buckets";
    }
  }
  EXPECT_EQ(seen, names);
  EXPECT_EQ(world, dense);
  EXPECT_EQ(dp, experts / 2);
  // Micro-ops: ceil(bucket bytes / 1 KiB) of them, bytes summing to the bucket's.
  for (const auto& b : s.buckets) {
    int64_t bytes = 0, n = 0;
    for (const Op& op : s.graph.ops)
      if (op.kind == OpKind::grad_allreduce && op.label == b.label) bytes += op.cost.bytes, ++n;
    EXPECT_EQ(bytes, 4 * b.elements) << b.label;
    EXPECT_EQ(n, (4 * b.elements + 1023) / 1024) << b.label;
  }
}

TEST(EpBuilder, RejectsGroupsThatDoNotDivide) {
  EXPECT_THROW(moe::graph::build_ep_step(small_model(), {4, 3, 1, 0}), std::invalid_argument);
  EXPECT_THROW(moe::graph::build_ep_step(small_model(), {3, 3, 1, 0}), std::invalid_argument);  // 4 experts
  EXPECT_THROW(moe::graph::build_ep_step(small_model(), {2, 2, 0, 0}), std::invalid_argument);
}

}  // namespace

namespace {
// The kinds of a stream's ops for block `layer`, in FIFO order.
std::vector<OpKind> lane_kinds(const moe::graph::StepGraph& g, int stream, int layer) {
  std::vector<OpKind> k;
  for (const Op& op : g.ops)
    if (op.stream == stream && op.layer == layer) k.push_back(op.kind);
  return k;
}
bool depends_on(const Op& op, const Op* dep) {
  return dep && std::find(op.deps.begin(), op.deps.end(), dep->id) != op.deps.end();
}
}  // namespace

TEST(EpBuilder, ReplicaGathersRunOnTheirOwnLaneBesideTheExchanges) {
  moe::graph::EpStepOptions opt{4, 4, 2, 1 << 20};
  opt.gather_before_gate = opt.gather_after_gate = opt.rematerialize = true;
  moe::graph::EpStep s = moe::graph::build_ep_step(small_model(), opt);
  ASSERT_TRUE(s.graph.validate());
  ASSERT_EQ(s.graph.streams.size(), 4u);
  EXPECT_EQ(s.graph.streams[moe::graph::kGatherStream].name, "gather");
  std::vector<OpKind> gathers, exchanges;
  for (OpKind k : {OpKind::materialize, OpKind::materialize_placed, OpKind::rematerialize, OpKind::replica_grad_reduce})
    gathers.push_back(k);
  for (OpKind k : {OpKind::gate_sync, OpKind::dispatch_a2a, OpKind::combine_a2a, OpKind::combine_a2a_bwd,
                   OpKind::dispatch_a2a_bwd})
    exchanges.push_back(k);
  EXPECT_EQ(lane_kinds(s.graph, moe::graph::kGatherStream, 0), gathers);
  EXPECT_EQ(lane_kinds(s.graph, moe::graph::kA2aStream, 0), exchanges);
  EXPECT_TRUE(lane_kinds(s.graph, moe::graph::kGatherStream, 1).empty());  // the dense block
  for (const Op& op : s.graph.ops)
    if (op.stream == moe::graph::kGatherStream) {
      EXPECT_EQ(op.priority, moe::graph::kA2aPriority);
    }
  // The forward gather waits for nothing (it runs behind attn_fwd); expert_fwd waits for both gathers;
  // place runs after gate_sync and before dispatch; expert_bwd waits for the re-gather; the gradient
  // reduction waits for expert_bwd only.
  const Op* gather = find(s.graph, OpKind::materialize, 0);
  ASSERT_NE(gather, nullptr);
  EXPECT_TRUE(gather->deps.empty());
  EXPECT_EQ(gather->collective, moe::graph::Collective::sparse_allgather);
  const Op* expert = find(s.graph, OpKind::expert_fwd, 0);
  EXPECT_TRUE(depends_on(*expert, gather));
  EXPECT_TRUE(depends_on(*expert, find(s.graph, OpKind::materialize_placed, 0)));
  const Op* place = find(s.graph, OpKind::place, 0);
  ASSERT_NE(place, nullptr);
  EXPECT_TRUE(depends_on(*place, find(s.graph, OpKind::gate_sync, 0)));
  EXPECT_TRUE(depends_on(*place, gather));  // place rewrites the placement the gather reads
  EXPECT_TRUE(depends_on(*find(s.graph, OpKind::dispatch_fwd, 0), place));
  EXPECT_TRUE(depends_on(*find(s.graph, OpKind::expert_bwd, 0), find(s.graph, OpKind::rematerialize, 0)));
  const Op* reduce = find(s.graph, OpKind::replica_grad_reduce, 0);
  ASSERT_NE(reduce, nullptr);
  EXPECT_EQ(reduce->deps, std::vector<int>{find(s.graph, OpKind::expert_bwd, 0)->id});
  EXPECT_EQ(reduce->collective, moe::graph::Collective::sparse_reduce_scatter);
  // Without the options the graph has none of these ops (EP).
  moe::graph::EpStep ep = moe::graph::build_ep_step(small_model(), {4, 4, 2, 1 << 20});
  for (const Op& op : ep.graph.ops)
    EXPECT_TRUE(op.kind != OpKind::materialize && op.kind != OpKind::place && op.kind != OpKind::replica_grad_reduce);
}

TEST(EpBuilder, ReplicaGathersNeedOneExpertParallelGroup) {
  moe::graph::EpStepOptions opt{4, 2, 2, 1 << 20};
  opt.gather_before_gate = true;
  EXPECT_THROW(moe::graph::build_ep_step(small_model(), opt), std::invalid_argument);
}

// The pieces compose another step: a dispatch in three chunks, each expert_fwd chunk after its own
// exchange chunk, and the standard backward; the graph is valid and has EP's buckets.
TEST(StepBuilder, ChunkedDispatchPipelinesWithTheExperts) {
  const moe::ModelConfig cfg = small_model();
  const moe::graph::EpStepOptions opt{2, 2, 4, 4096};
  using moe::graph::StepBuilder;
  const moe::graph::EpStep s = StepBuilder(cfg, opt).compose([](StepBuilder& b, int64_t l, int x) {
    return b.combine(l, b.experts_forward(l, b.dispatch(l, b.gate(l, x), 3)));
  });
  const moe::graph::EpStep ep = moe::graph::build_ep_step(cfg, opt);
  ASSERT_EQ(s.buckets.size(), ep.buckets.size());
  for (size_t i = 0; i < s.buckets.size(); ++i) EXPECT_EQ(s.buckets[i].params, ep.buckets[i].params);
  for (int l : {0, 2}) {
    double flops = 0;
    for (int c = 0; c < 3; ++c) {
      const Op* a2a = find(s.graph, OpKind::dispatch_a2a, l, c);
      const Op* experts = find(s.graph, OpKind::expert_fwd, l, c);
      ASSERT_TRUE(a2a && experts) << "block " << l << " chunk " << c;
      EXPECT_EQ(a2a->n_micro, 3);
      EXPECT_EQ(experts->n_micro, 3);
      EXPECT_EQ(a2a->stream, moe::graph::kA2aStream);
      EXPECT_EQ(a2a->deps, std::vector<int>{find(s.graph, OpKind::dispatch_fwd, l)->id});
      EXPECT_EQ(experts->deps, std::vector<int>{a2a->id}) << "chunk " << c << " waits for its own exchange only";
      flops += experts->cost.flops;
    }
    EXPECT_DOUBLE_EQ(flops, find(ep.graph, OpKind::expert_fwd, l)->cost.flops);
    EXPECT_EQ(find(s.graph, OpKind::combine_a2a, l)->deps, std::vector<int>{find(s.graph, OpKind::expert_fwd, l, 2)->id});
  }
  EXPECT_THROW(moe::graph::StepBuilder(cfg, opt).dispatch(0, 0, 0), std::logic_error);
  EXPECT_THROW(moe::graph::StepBuilder(cfg, opt).ffn_forward(0, 0), std::logic_error);
}
