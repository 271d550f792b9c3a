// StepGraph building, checks and naming (src/graph/step_graph.h): what both executors rely on.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "graph/step_graph.h"

namespace moe::graph {
namespace {

Op compute_op(std::vector<int> deps = {}, std::string label = "") {
  Op op;
  op.kind = OpKind::custom;
  op.deps = std::move(deps);
  op.label = std::move(label);
  return op;
}

Op comm_op(int stream, int priority, std::vector<int> deps = {}, std::string label = "") {
  Op op;
  op.kind = OpKind::custom_comm;
  op.stream = stream;
  op.priority = priority;
  op.deps = std::move(deps);
  op.label = std::move(label);
  return op;
}

TEST(StepGraph, StartsWithTheComputeStreamAndNumbersOpsInOrder) {
  StepGraph g;
  ASSERT_EQ(g.streams.size(), 1u);
  EXPECT_FALSE(g.streams[0].communication);
  EXPECT_EQ(g.add_stream("a2a", true), 1);
  EXPECT_EQ(g.add(compute_op()), 0);
  EXPECT_EQ(g.add(comm_op(1, 0, {0})), 1);
  EXPECT_EQ(g.add(compute_op({0, 1})), 2);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(g.ops[i].id, i);
  EXPECT_TRUE(g.validate()) << g.validate().message();
}

TEST(StepGraph, AddRejectsForwardDepsBadStreamsAndKindsOnTheWrongStream) {
  StepGraph g;
  const int lane = g.add_stream("allreduce", true);
  g.add(compute_op());
  EXPECT_THROW(g.add(compute_op({1})), std::logic_error);   // itself
  EXPECT_THROW(g.add(compute_op({5})), std::logic_error);   // a later op
  EXPECT_THROW(g.add(compute_op({-1})), std::logic_error);
  Op bad_stream = compute_op();
  bad_stream.stream = 7;
  EXPECT_THROW(g.add(bad_stream), std::logic_error);
  bad_stream.stream = -1;
  EXPECT_THROW(g.add(bad_stream), std::logic_error);
  Op compute_on_lane = compute_op();
  compute_on_lane.stream = lane;
  EXPECT_THROW(g.add(compute_on_lane), std::logic_error);
  EXPECT_THROW(g.add(comm_op(0, 0)), std::logic_error);  // communication on the compute stream
  const int side = g.add_stream("side", false);
  Op compute_on_side = compute_op();
  compute_on_side.stream = side;
  EXPECT_THROW(g.add(compute_on_side), std::logic_error);  // compute only on stream 0
  EXPECT_THROW(g.add(comm_op(side, 0)), std::logic_error);
  EXPECT_EQ(g.ops.size(), 1u) << "a rejected op must not be appended";
  try {
    g.add(compute_op({3}, "late"));
    FAIL() << "no throw";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("custom late"), std::string::npos) << e.what();
  }
}

TEST(StepGraph, MicroOpsSplitCostExactlyAndChain) {
  StepGraph g;
  const int lane = g.add_stream("allreduce", true);
  const int a = g.add(compute_op());
  const int b = g.add(compute_op());
  Op op = comm_op(lane, 3, {a, b}, "blocks.0");
  op.kind = OpKind::grad_allreduce;
  op.collective = Collective::allreduce;
  op.group = Group::dp;
  op.layer = 2;
  op.cost.flops = 1e9 + 7;
  op.cost.bytes = 1003;
  op.cost.peer_bytes = {10, 7, 0, 5};
  const int n = 4;
  const int last = g.add_micro_ops(op, n);
  ASSERT_EQ(g.ops.size(), 2u + n);
  EXPECT_EQ(last, 2 + n - 1);

  double flops = 0;
  int64_t bytes = 0;
  std::vector<int64_t> peer(op.cost.peer_bytes.size(), 0);
  for (int k = 0; k < n; ++k) {
    const Op& m = g.ops[2 + k];
    EXPECT_EQ(m.micro, k);
    EXPECT_EQ(m.n_micro, n);
    EXPECT_EQ(m.kind, OpKind::grad_allreduce);
    EXPECT_EQ(m.stream, lane);
    EXPECT_EQ(m.priority, 3);
    EXPECT_EQ(m.layer, 2);
    EXPECT_EQ(m.label, "blocks.0");
    std::vector<int> want_deps = {a, b};
    if (k > 0) want_deps.push_back(2 + k - 1);
    EXPECT_EQ(m.deps, want_deps) << "micro-op " << k;
    EXPECT_EQ(m.cost.bytes, k < n - 1 ? 250 : 253);
    flops += m.cost.flops;
    bytes += m.cost.bytes;
    ASSERT_EQ(m.cost.peer_bytes.size(), peer.size());
    for (size_t j = 0; j < peer.size(); ++j) peer[j] += m.cost.peer_bytes[j];
  }
  EXPECT_EQ(g.ops[2].cost.peer_bytes, (std::vector<int64_t>{2, 1, 0, 1}));
  EXPECT_EQ(g.ops[2 + n - 1].cost.peer_bytes, (std::vector<int64_t>{4, 4, 0, 2}));
  EXPECT_DOUBLE_EQ(flops, op.cost.flops);
  EXPECT_EQ(bytes, op.cost.bytes);
  EXPECT_EQ(peer, op.cost.peer_bytes);
  EXPECT_TRUE(g.validate()) << g.validate().message();

  // n = 1 is the op itself; n < 1 is a programming error.
  const int whole = g.add_micro_ops(op, 1);
  EXPECT_EQ(g.ops[whole].cost.bytes, 1003);
  EXPECT_EQ(g.ops[whole].deps, (std::vector<int>{a, b}));
  EXPECT_EQ(g.ops[whole].n_micro, 1);
  EXPECT_THROW(g.add_micro_ops(op, 0), std::logic_error);
}

TEST(StepGraph, MicroRangeCoversEveryElementOnceInNearlyEqualParts) {
  for (int64_t count = 0; count <= 40; ++count) {
    for (int n = 1; n <= 12; ++n) {
      int64_t next = 0, prev_size = count + 1;
      for (int k = 0; k < n; ++k) {
        const Range r = micro_range(count, k, n);
        const int64_t size = r.end - r.begin;
        ASSERT_EQ(r.begin, next) << count << " over " << n << ", part " << k;
        ASSERT_TRUE(size == count / n || size == count / n + 1) << count << " over " << n << ", part " << k;
        ASSERT_LE(size, prev_size) << "the larger parts come first";
        next = r.end;
        prev_size = size;
      }
      ASSERT_EQ(next, count) << count << " over " << n;
    }
  }
  EXPECT_EQ(micro_range(10, 0, 4).end, 3);   // 3 3 2 2
  EXPECT_EQ(micro_range(10, 3, 4).begin, 8);
  EXPECT_EQ(micro_range(2, 4, 5).begin, 2);  // count < n: empty trailing parts
  EXPECT_EQ(micro_range(2, 4, 5).end, 2);
  EXPECT_THROW(micro_range(10, 4, 4), std::logic_error);
  EXPECT_THROW(micro_range(10, 0, 0), std::logic_error);
  EXPECT_THROW(micro_range(-1, 0, 1), std::logic_error);
}

TEST(StepGraph, OpNamesAreWhatTracesShow) {
  StepGraph g;
  Op op;
  op.kind = OpKind::dispatch_a2a;
  op.layer = 3;
  EXPECT_EQ(g.op_name(op), "L3 dispatch_a2a");
  op.kind = OpKind::grad_allreduce;
  op.layer = 0;
  op.micro = 1;
  op.n_micro = 4;
  op.label = "blocks.0";
  EXPECT_EQ(g.op_name(op), "L0 grad_allreduce 2/4 blocks.0");
  op.label.clear();
  EXPECT_EQ(g.op_name(op), "L0 grad_allreduce 2/4");
  Op embed;
  embed.kind = OpKind::embed_fwd;
  EXPECT_EQ(g.op_name(embed), "embed_fwd");
  Op custom;
  custom.label = "x";
  EXPECT_EQ(g.op_name(custom), "custom x");
  EXPECT_STREQ(op_kind_name(OpKind::attn_bwd), "attn_bwd");
  EXPECT_STREQ(collective_name(Collective::alltoallv), "alltoallv");
  EXPECT_STREQ(group_name(Group::ep), "ep");
  EXPECT_FALSE(is_communication(OpKind::custom));
  EXPECT_FALSE(is_communication(OpKind::optimizer));
  EXPECT_TRUE(is_communication(OpKind::gate_sync));
  EXPECT_TRUE(is_communication(OpKind::custom_comm));
}

// A small valid graph: compute 0 -> a2a 1 (priority 1) -> compute 2 -> allreduce 3 (priority 0).
StepGraph small_graph() {
  StepGraph g;
  const int a2a = g.add_stream("a2a", true);
  const int ar = g.add_stream("allreduce", true);
  g.add(compute_op({}, "c0"));
  g.add(comm_op(a2a, 1, {0}, "a2a"));
  g.add(compute_op({1}, "c1"));
  g.add(comm_op(ar, 0, {2}, "ar"));
  return g;
}

void expect_rejected(const StepGraph& g, const std::string& names) {
  const Status s = g.validate();
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find(names), std::string::npos) << s.message();
}

TEST(StepGraph, ValidateCatchesCorruptedGraphsAndNamesTheOp) {
  ASSERT_TRUE(small_graph().validate()) << small_graph().validate().message();

  StepGraph g = small_graph();
  g.ops[1].deps = {2};  // edited by hand to a later op
  expect_rejected(g, "custom_comm a2a");

  g = small_graph();
  g.ops[0].deps = {0};
  expect_rejected(g, "custom c0");

  g = small_graph();
  g.ops[2].stream = 9;
  expect_rejected(g, "custom c1");

  g = small_graph();
  g.ops[2].stream = 1;  // compute op on a communication lane
  expect_rejected(g, "custom c1");

  g = small_graph();
  g.ops[3].id = 7;
  expect_rejected(g, "custom_comm ar");

  g = small_graph();
  g.ops[3].micro = 2;  // of n_micro = 1
  expect_rejected(g, "custom_comm ar");

  g = small_graph();
  g.ops[3].cost.peer_bytes = {4, -1};
  expect_rejected(g, "custom_comm ar");

  g = small_graph();
  g.ops[0].collective = Collective::allreduce;
  expect_rejected(g, "custom c0");

  g = small_graph();
  g.streams[0].communication = true;
  EXPECT_FALSE(g.validate());
}

TEST(StepGraph, ValidateRejectsACommunicationWaitingOnALowerPriorityOne) {
  // The allreduce (priority 0) feeds a compute op that feeds an a2a of priority 1: the REQUIRES of
  // builders in step_graph.h.
  StepGraph g = small_graph();
  g.add(compute_op({3}, "c2"));
  g.add(comm_op(1, 1, {4}, "late a2a"));
  expect_rejected(g, "custom_comm late a2a");

  // Equal priority, or a lower one waiting on a higher one, is fine.
  g.ops.back().priority = 0;
  EXPECT_TRUE(g.validate()) << g.validate().message();
}

}  // namespace
}  // namespace moe::graph
