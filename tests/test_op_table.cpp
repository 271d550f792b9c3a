// The op-table harness (tests/op_table.h), in the manner of ggml's test-backend-ops: every row is run
// in the same modes, so a new op is covered by adding one row there.
//   value     the kernel's output against the row's double-precision reference, |got - ref| <= atol +
//             rtol |ref|, and every output finite (a NaN/Inf check apart from the tolerance);
//   gradient  the row's backward against central finite differences of sum(out * R) (R fixed random),
//             for every differentiable input, every entry probed;
//   accumulate the backward run on gradients pre-filled with P gives P + what it gives on zeros.
// Each check prints the row, the input, and its max errors, so a drift shows before it fails.
// tests/test_ops.cpp keeps what a table cannot say: GEMM's every transpose and padding, top-k ties,
// determinism across thread counts, extreme inputs, AdamW's closed form.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "grad_check.h"
#include "op_table.h"

namespace moe::testing {
namespace {

class OpTable : public ::testing::TestWithParam<OpRow> {};

std::vector<float> random_like(int64_t n, uint64_t seed) {
  std::vector<float> v(n);
  fill_normal(v.data(), static_cast<size_t>(n), seed);
  return v;
}

// Gradients of sum(out * R) with respect to every float input: zeros (or `pre`) plus the backward.
std::vector<std::vector<float>> grads_of(const OpRow& row, const OpInputs& in, const std::vector<float>& R,
                                         std::vector<std::vector<float>> pre = {}) {
  std::vector<std::vector<float>> g = pre;
  if (g.empty())
    for (const FloatInput& f : row.floats) g.emplace_back(f.size, 0.0f);
  std::vector<float*> ptrs;
  for (size_t k = 0; k < row.floats.size(); ++k) ptrs.push_back(row.floats[k].differentiable ? g[k].data() : nullptr);
  row.backward(in, R.data(), ptrs);
  return g;
}

TEST_P(OpTable, ValueMatchesTheReference) {
  const OpRow& row = GetParam();
  const OpInputs in = make_inputs(row);
  std::vector<float> out(row.out_size, std::nanf(""));
  std::vector<double> ref(row.out_size);
  row.forward(in, out.data());
  row.reference(in, ref.data());
  double max_abs = 0, worst = 0;
  size_t worst_i = 0;
  bool finite = true;
  for (size_t i = 0; i < out.size(); ++i) {
    finite = finite && std::isfinite(out[i]);
    const double d = std::fabs(out[i] - ref[i]);
    max_abs = std::max(max_abs, d);
    const double ratio = d / (row.atol + row.rtol * std::fabs(ref[i]) + 1e-300);
    if (ratio > worst) worst = ratio, worst_i = i;
  }
  std::printf("[value] %-18s n=%-5lld max_abs=%.2e  (atol %.0e, rtol %.0e)\n", row.name.c_str(),
              static_cast<long long>(row.out_size), max_abs, row.atol, row.rtol);
  EXPECT_TRUE(finite) << row.name << ": non-finite output";
  EXPECT_LE(worst, 1.0) << row.name << ": worst at " << worst_i << " got " << out[worst_i] << " ref " << ref[worst_i];
}

TEST_P(OpTable, GradientMatchesFiniteDifferences) {
  const OpRow& row = GetParam();
  OpInputs in = make_inputs(row);
  const std::vector<float> R = random_like(row.out_size, 777);
  const std::vector<std::vector<float>> g = grads_of(row, in, R);
  std::vector<float> out(row.out_size);
  for (size_t k = 0; k < row.floats.size(); ++k) {
    if (!row.floats[k].differentiable) continue;
    auto loss = [&] {
      row.forward(in, out.data());
      double s = 0;
      for (size_t i = 0; i < out.size(); ++i) s += static_cast<double>(out[i]) * R[i];
      return s;
    };
    const GradCheckResult r =
        check_gradient(loss, in.f[k].data(), g[k].data(), g[k].size(), row.eps, /*max_checks=*/g[k].size());
    std::printf("[grad ] %-18s d%-7s checked=%-4zu max_abs=%.2e max_rel=%.2e  (tol %.0e)\n", row.name.c_str(),
                row.floats[k].name.c_str(), r.checked, r.max_abs_err, r.max_rel_err, row.grad_tol);
    EXPECT_TRUE(r.finite) << row.name << " d" << row.floats[k].name << ": non-finite gradient";
    EXPECT_EQ(r.checked, g[k].size());
    EXPECT_LE(r.max_rel_err, row.grad_tol) << row.name << " d" << row.floats[k].name;
  }
}

TEST_P(OpTable, BackwardAccumulates) {
  const OpRow& row = GetParam();
  const OpInputs in = make_inputs(row);
  const std::vector<float> R = random_like(row.out_size, 778);
  const std::vector<std::vector<float>> zero = grads_of(row, in, R);
  std::vector<std::vector<float>> pre;
  for (size_t k = 0; k < row.floats.size(); ++k) pre.push_back(random_like(row.floats[k].size, 900 + k));
  const std::vector<std::vector<float>> acc = grads_of(row, in, R, pre);
  for (size_t k = 0; k < row.floats.size(); ++k) {
    if (!row.floats[k].differentiable) continue;
    double worst = 0;
    for (size_t i = 0; i < acc[k].size(); ++i) {
      const double want = static_cast<double>(pre[k][i]) + zero[k][i];
      worst = std::max(worst, std::fabs(acc[k][i] - want) / (1e-6 * (std::fabs(pre[k][i]) + std::fabs(zero[k][i])) + 1e-7));
    }
    EXPECT_LE(worst, 1.0) << row.name << " d" << row.floats[k].name << ": backward does not accumulate";
  }
}

INSTANTIATE_TEST_SUITE_P(Cpu, OpTable, ::testing::ValuesIn(op_table()),
                         [](const ::testing::TestParamInfo<OpRow>& info) { return info.param.name; });

// The table is what the harness covers: a row dropped by mistake fails here.
TEST(OpTableRows, CoverEveryDifferentiableKernel) {
  std::vector<std::string> names;
  for (const OpRow& r : op_table()) names.push_back(r.name);
  for (const char* op : {"linear", "gelu", "swiglu", "softmax", "layernorm", "rmsnorm", "attention", "embedding",
                         "cross_entropy", "gather_rows", "scatter_add_rows"})
    EXPECT_NE(std::find(names.begin(), names.end(), op), names.end()) << op;
}

}  // namespace
}  // namespace moe::testing
