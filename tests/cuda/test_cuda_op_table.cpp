// The op table (tests/op_table.h) on the GPU: every row that has a CUDA kernel, in f32, in the same
// modes as on the CPU (tests/test_op_table.cpp): value against the row's double-precision reference
// (cuda/ops.h's f32 policy, |gpu - ref| <= 1e-4 max(1, |ref|), NaN/Inf apart), gradient against
// central finite differences of the GPU's own forward, and the accumulate rule. A row gets its GPU
// run by adding one adapter below (the kernels, uploads and downloads); every row has one.
// Without a GPU (no device or no driver: CI, the CPU machines) every test skips, saying why.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "../grad_check.h"
#include "../op_table.h"
#include "cuda/device.h"
#include "cuda/ops.h"

namespace moe::cuda {
namespace {

using moe::testing::OpInputs;
using moe::testing::OpRow;
using Vec = std::vector<float>;

// Uploads and downloads for one run; buffers freed with it.
class Gpu {
 public:
  explicit Gpu(Context& ctx) : ctx_(ctx) {}
  float* floats(const Vec& host) {
    bufs_.emplace_back();
    EXPECT_TRUE(bufs_.back().allocate(std::max<size_t>(1, host.size()) * 4).is_ok());
    EXPECT_TRUE(copy_to_device(ctx_, bufs_.back().get(), host.data(), host.size() * 4).is_ok());
    return bufs_.back().as<float>();
  }
  float* zeros(size_t n) { return floats(Vec(n, 0.0f)); }
  int32_t* ints(const std::vector<int32_t>& host) {
    bufs_.emplace_back();
    EXPECT_TRUE(bufs_.back().allocate(std::max<size_t>(1, host.size()) * 4).is_ok());
    EXPECT_TRUE(copy_to_device(ctx_, bufs_.back().get(), host.data(), host.size() * 4).is_ok());
    return bufs_.back().as<int32_t>();
  }
  void to_host(float* dst, const float* dev, size_t n) {
    EXPECT_TRUE(ctx_.synchronize().is_ok());
    EXPECT_TRUE(copy_to_host(ctx_, dst, dev, n * 4).is_ok());
  }
  Context& ctx() { return ctx_; }

 private:
  Context& ctx_;
  std::vector<DeviceBuffer> bufs_;
};

// A row's kernels on the GPU: forward writes out (host, out_size floats); backward accumulates into the
// host gradients (uploaded, run, downloaded).
struct Adapter {
  std::function<void(Gpu&, const OpRow&, const OpInputs&, float* out)> forward;
  std::function<void(Gpu&, const OpRow&, const OpInputs&, const float* dout, const std::vector<float*>& grads)> backward;
};

// For combine_rows: each of N destination rows' source rows r (index[r] == n) in increasing r, as
// token_rows [N,K] with K the most sources any row has, -1 where a row has fewer.
struct SourceRows {
  int64_t K = 1;
  std::vector<int32_t> rows;  // [N,K]
  // weight [N,K]: per_source[r] at each source, 0 at the -1 entries
  Vec weights(const Vec& per_source) const {
    Vec w(rows.size(), 0.0f);
    for (size_t nk = 0; nk < rows.size(); ++nk)
      if (rows[nk] >= 0) w[nk] = per_source[rows[nk]];
    return w;
  }
};
SourceRows sources_of(const std::vector<int32_t>& index, int64_t N) {
  std::vector<std::vector<int32_t>> by_row(N);
  for (size_t r = 0; r < index.size(); ++r) by_row[index[r]].push_back(static_cast<int32_t>(r));
  SourceRows s;
  for (const auto& v : by_row) s.K = std::max<int64_t>(s.K, static_cast<int64_t>(v.size()));
  s.rows.assign(N * s.K, -1);
  for (int64_t n = 0; n < N; ++n)
    for (size_t k = 0; k < by_row[n].size(); ++k) s.rows[n * s.K + k] = by_row[n][k];
  return s;
}

// Shapes come from the row's dims.
std::map<std::string, Adapter> adapters() {
  const DType f32 = DType::f32;
  std::map<std::string, Adapter> a;
  auto ok = [](const Status& s) { EXPECT_TRUE(s.is_ok()) << s.message(); };
  a["gelu"] = {[=](Gpu& g, const OpRow& row, const OpInputs& in, float* out) {
                 const int64_t n = row.dims.at("n");
                 float* y = g.zeros(n);
                 ok(gelu_forward(g.ctx(), f32, y, g.floats(in.f[0]), n));
                 g.to_host(out, y, n);
               },
               [=](Gpu& g, const OpRow& row, const OpInputs& in, const float* dout, const std::vector<float*>& gr) {
                 const int64_t n = row.dims.at("n");
                 float* dx = g.floats(Vec(gr[0], gr[0] + n));
                 ok(gelu_backward(g.ctx(), f32, dx, g.floats(Vec(dout, dout + n)), g.floats(in.f[0]), n));
                 g.to_host(gr[0], dx, n);
               }};
  a["swiglu"] = {[=](Gpu& g, const OpRow& row, const OpInputs& in, float* out) {
                   const int64_t n = row.dims.at("n");
                   float* y = g.zeros(n);
                   ok(swiglu_forward(g.ctx(), f32, y, g.floats(in.f[0]), g.floats(in.f[1]), n));
                   g.to_host(out, y, n);
                 },
                 [=](Gpu& g, const OpRow& row, const OpInputs& in, const float* dout, const std::vector<float*>& gr) {
                   const int64_t n = row.dims.at("n");
                   float *dg = g.floats(Vec(gr[0], gr[0] + n)), *du = g.floats(Vec(gr[1], gr[1] + n));
                   ok(swiglu_backward(g.ctx(), f32, dg, du, g.floats(Vec(dout, dout + n)), g.floats(in.f[0]),
                                      g.floats(in.f[1]), n));
                   g.to_host(gr[0], dg, n);
                   g.to_host(gr[1], du, n);
                 }};
  a["linear"] = {[=](Gpu& g, const OpRow& row, const OpInputs& in, float* out) {
                   const int64_t N = row.dims.at("N"), IC = row.dims.at("IC"), OC = row.dims.at("OC");
                   float* y = g.zeros(N * OC);
                   ok(linear_forward(g.ctx(), f32, y, g.floats(in.f[0]), g.floats(in.f[1]), N, IC, OC));
                   g.to_host(out, y, N * OC);
                 },
                 [=](Gpu& g, const OpRow& row, const OpInputs& in, const float* dout, const std::vector<float*>& gr) {
                   const int64_t N = row.dims.at("N"), IC = row.dims.at("IC"), OC = row.dims.at("OC");
                   float *dx = g.floats(Vec(gr[0], gr[0] + N * IC)), *dw = g.floats(Vec(gr[1], gr[1] + OC * IC));
                   ok(linear_backward(g.ctx(), f32, dx, dw, g.floats(Vec(dout, dout + N * OC)), g.floats(in.f[0]),
                                      g.floats(in.f[1]), N, IC, OC));
                   g.to_host(gr[0], dx, N * IC);
                   g.to_host(gr[1], dw, OC * IC);
                 }};
  a["softmax"] = {[=](Gpu& g, const OpRow& row, const OpInputs& in, float* out) {
                    const int64_t N = row.dims.at("N"), D = row.dims.at("D");
                    float* y = g.zeros(N * D);
                    ok(softmax_forward(g.ctx(), f32, y, g.floats(in.f[0]), N, D));
                    g.to_host(out, y, N * D);
                  },
                  [=](Gpu& g, const OpRow& row, const OpInputs& in, const float* dout, const std::vector<float*>& gr) {
                    const int64_t N = row.dims.at("N"), D = row.dims.at("D");
                    float* y = g.zeros(N * D);
                    ok(softmax_forward(g.ctx(), f32, y, g.floats(in.f[0]), N, D));
                    float* dx = g.floats(Vec(gr[0], gr[0] + N * D));
                    ok(softmax_backward(g.ctx(), f32, dx, g.floats(Vec(dout, dout + N * D)), y, N, D));
                    g.to_host(gr[0], dx, N * D);
                  }};
  a["layernorm"] = {[=](Gpu& g, const OpRow& row, const OpInputs& in, float* out) {
                      const int64_t N = row.dims.at("N"), C = row.dims.at("C");
                      float *y = g.zeros(N * C), *mean = g.zeros(N), *rstd = g.zeros(N);
                      ok(layernorm_forward(g.ctx(), f32, y, mean, rstd, g.floats(in.f[0]), g.floats(in.f[1]),
                                           g.floats(in.f[2]), N, C, 1e-5f));
                      g.to_host(out, y, N * C);
                    },
                    [=](Gpu& g, const OpRow& row, const OpInputs& in, const float* dout, const std::vector<float*>& gr) {
                      const int64_t N = row.dims.at("N"), C = row.dims.at("C");
                      float *y = g.zeros(N * C), *mean = g.zeros(N), *rstd = g.zeros(N);
                      float *x = g.floats(in.f[0]), *w = g.floats(in.f[1]);
                      ok(layernorm_forward(g.ctx(), f32, y, mean, rstd, x, w, g.floats(in.f[2]), N, C, 1e-5f));
                      float *dx = g.floats(Vec(gr[0], gr[0] + N * C)), *dw = g.floats(Vec(gr[1], gr[1] + C)),
                            *db = g.floats(Vec(gr[2], gr[2] + C));
                      ok(layernorm_backward(g.ctx(), f32, dx, dw, db, g.floats(Vec(dout, dout + N * C)), x, w, mean,
                                            rstd, N, C));
                      g.to_host(gr[0], dx, N * C);
                      g.to_host(gr[1], dw, C);
                      g.to_host(gr[2], db, C);
                    }};
  a["rmsnorm"] = {[=](Gpu& g, const OpRow& row, const OpInputs& in, float* out) {
                    const int64_t N = row.dims.at("N"), C = row.dims.at("C");
                    float *y = g.zeros(N * C), *rstd = g.zeros(N);
                    ok(rmsnorm_forward(g.ctx(), f32, y, rstd, g.floats(in.f[0]), g.floats(in.f[1]), N, C, 1e-5f));
                    g.to_host(out, y, N * C);
                  },
                  [=](Gpu& g, const OpRow& row, const OpInputs& in, const float* dout, const std::vector<float*>& gr) {
                    const int64_t N = row.dims.at("N"), C = row.dims.at("C");
                    float *y = g.zeros(N * C), *rstd = g.zeros(N), *x = g.floats(in.f[0]), *w = g.floats(in.f[1]);
                    ok(rmsnorm_forward(g.ctx(), f32, y, rstd, x, w, N, C, 1e-5f));
                    float *dx = g.floats(Vec(gr[0], gr[0] + N * C)), *dw = g.floats(Vec(gr[1], gr[1] + C));
                    ok(rmsnorm_backward(g.ctx(), f32, dx, dw, g.floats(Vec(dout, dout + N * C)), x, w, rstd, N, C));
                    g.to_host(gr[0], dx, N * C);
                    g.to_host(gr[1], dw, C);
                  }};
  // The scatter-adds (gather_rows' adjoint, scatter_add_rows) run on the GPU as the MoE combine does
  // them: combine_rows, the gather form, with every destination row's sources listed in row order.
  a["gather_rows"] = {[=](Gpu& g, const OpRow& row, const OpInputs& in, float* out) {
                        const int64_t R = row.dims.at("R"), C = row.dims.at("C");
                        float* y = g.zeros(R * C);
                        ok(gather_rows(g.ctx(), f32, y, g.floats(in.f[0]), g.ints(in.i[0]), R, C));
                        g.to_host(out, y, R * C);
                      },
                      [=](Gpu& g, const OpRow& row, const OpInputs& in, const float* dout, const std::vector<float*>& gr) {
                        const int64_t N = row.dims.at("N"), R = row.dims.at("R"), C = row.dims.at("C");
                        const SourceRows src = sources_of(in.i[0], N);
                        float* dx = g.floats(Vec(gr[0], gr[0] + N * C));
                        ok(combine_rows(g.ctx(), f32, dx, g.floats(Vec(dout, dout + R * C)), g.ints(src.rows),
                                        g.floats(Vec(src.rows.size(), 1.0f)), N, src.K, C, /*accumulate=*/true));
                        g.to_host(gr[0], dx, N * C);
                      }};
  a["scatter_add_rows"] = {
      [=](Gpu& g, const OpRow& row, const OpInputs& in, float* out) {
        const int64_t N = row.dims.at("N"), C = row.dims.at("C");
        const SourceRows src = sources_of(in.i[0], N);
        float* y = g.zeros(N * C);
        ok(combine_rows(g.ctx(), f32, y, g.floats(in.f[0]), g.ints(src.rows), g.floats(src.weights(in.f[1])), N, src.K,
                        C, /*accumulate=*/false));
        g.to_host(out, y, N * C);
      },
      [=](Gpu& g, const OpRow& row, const OpInputs& in, const float* dout, const std::vector<float*>& gr) {
        // combine_rows_backward overwrites d rows and accumulates d weight per (n, k): both go through
        // zeroed buffers and are added into the host gradients by row.
        const int64_t N = row.dims.at("N"), R = row.dims.at("R"), C = row.dims.at("C");
        const SourceRows src = sources_of(in.i[0], N);
        float *drows = g.zeros(R * C), *dweight = g.zeros(src.rows.size());
        ok(combine_rows_backward(g.ctx(), f32, drows, dweight, g.floats(Vec(dout, dout + N * C)), g.floats(in.f[0]),
                                 g.ints(src.rows), g.floats(src.weights(in.f[1])), N, src.K, C));
        Vec dr(R * C), dw(src.rows.size());
        g.to_host(dr.data(), drows, dr.size());
        g.to_host(dw.data(), dweight, dw.size());
        for (int64_t i = 0; i < R * C; ++i) gr[0][i] += dr[i];
        for (size_t nk = 0; nk < src.rows.size(); ++nk)
          if (src.rows[nk] >= 0) gr[1][src.rows[nk]] += dw[nk];
      }};
  a["attention"] = {[=](Gpu& g, const OpRow& row, const OpInputs& in, float* out) {
                      const int64_t B = row.dims.at("B"), T = row.dims.at("T"), C = row.dims.at("C"), NH = row.dims.at("NH");
                      float *y = g.zeros(B * T * C), *pre = g.zeros(B * NH * T * T), *att = g.zeros(B * NH * T * T);
                      ok(attention_forward(g.ctx(), f32, y, pre, att, g.zeros(4 * B * T * C), g.floats(in.f[0]), B, T, C,
                                           NH));
                      g.to_host(out, y, B * T * C);
                    },
                    [=](Gpu& g, const OpRow& row, const OpInputs& in, const float* dout, const std::vector<float*>& gr) {
                      const int64_t B = row.dims.at("B"), T = row.dims.at("T"), C = row.dims.at("C"), NH = row.dims.at("NH");
                      const int64_t TT = B * NH * T * T;
                      float *y = g.zeros(B * T * C), *pre = g.zeros(TT), *att = g.zeros(TT), *qkv = g.floats(in.f[0]);
                      ok(attention_forward(g.ctx(), f32, y, pre, att, g.zeros(4 * B * T * C), qkv, B, T, C, NH));
                      float* dqkv = g.floats(Vec(gr[0], gr[0] + 3 * B * T * C));
                      ok(attention_backward(g.ctx(), f32, dqkv, g.zeros(TT), g.zeros(TT), g.zeros(8 * B * T * C),
                                            g.floats(Vec(dout, dout + B * T * C)), qkv, att, B, T, C, NH));
                      g.to_host(gr[0], dqkv, 3 * B * T * C);
                    }};
  a["embedding"] = {[=](Gpu& g, const OpRow& row, const OpInputs& in, float* out) {
                      const int64_t B = row.dims.at("B"), T = row.dims.at("T"), C = row.dims.at("C");
                      float* y = g.zeros(B * T * C);
                      ok(embedding_forward(g.ctx(), f32, y, g.ints(in.i[0]), g.floats(in.f[0]), g.floats(in.f[1]), B, T, C));
                      g.to_host(out, y, B * T * C);
                    },
                    [=](Gpu& g, const OpRow& row, const OpInputs& in, const float* dout, const std::vector<float*>& gr) {
                      const int64_t B = row.dims.at("B"), T = row.dims.at("T"), C = row.dims.at("C"), V = row.dims.at("V");
                      float *dwte = g.floats(Vec(gr[0], gr[0] + V * C)), *dwpe = g.floats(Vec(gr[1], gr[1] + T * C));
                      // the tokens go as a host array (ops.h: grouped by token on the host)
                      ok(embedding_backward(g.ctx(), f32, dwte, dwpe, g.floats(Vec(dout, dout + B * T * C)),
                                            in.i[0].data(), B, T, C));
                      g.to_host(gr[0], dwte, V * C);
                      g.to_host(gr[1], dwpe, T * C);
                    }};
  // out[0] = the mean of the GPU's per-row losses (the mean is the caller's, ops.h).
  a["cross_entropy"] = {[=](Gpu& g, const OpRow& row, const OpInputs& in, float* out) {
                          const int64_t N = row.dims.at("N"), V = row.dims.at("V");
                          float *probs = g.zeros(N * V), *losses = g.zeros(N);
                          ok(cross_entropy_forward(g.ctx(), f32, probs, losses, g.floats(in.f[0]), g.ints(in.i[0]), N, V));
                          Vec l(N);
                          g.to_host(l.data(), losses, N);
                          double sum = 0;
                          for (float v : l) sum += v;
                          out[0] = static_cast<float>(sum / static_cast<double>(N));
                        },
                        [=](Gpu& g, const OpRow& row, const OpInputs& in, const float* dout, const std::vector<float*>& gr) {
                          const int64_t N = row.dims.at("N"), V = row.dims.at("V");
                          float *probs = g.zeros(N * V), *losses = g.zeros(N);
                          int32_t* targets = g.ints(in.i[0]);
                          ok(cross_entropy_forward(g.ctx(), f32, probs, losses, g.floats(in.f[0]), targets, N, V));
                          float* dlogits = g.floats(Vec(gr[0], gr[0] + N * V));
                          ok(cross_entropy_backward(g.ctx(), f32, dlogits, probs, targets, N, V, dout[0]));
                          g.to_host(gr[0], dlogits, N * V);
                        }};
  return a;
}

class CudaOpTable : public ::testing::TestWithParam<OpRow> {
 protected:
  void SetUp() override {
    if (device_count() == 0) GTEST_SKIP() << device_summary();
    ASSERT_TRUE(Context::create(0, &ctx_).is_ok());
    const auto all = adapters();
    auto it = all.find(GetParam().name);
    if (it == all.end()) GTEST_SKIP() << GetParam().name << ": no CUDA kernel in the table yet";
    adapter_ = it->second;
  }
  std::unique_ptr<Context> ctx_;
  Adapter adapter_;
};

TEST_P(CudaOpTable, ValueMatchesTheReference) {
  const OpRow& row = GetParam();
  const OpInputs in = moe::testing::make_inputs(row);
  Gpu gpu(*ctx_);
  Vec out(row.out_size, std::nanf(""));
  std::vector<double> ref(row.out_size);
  adapter_.forward(gpu, row, in, out.data());
  row.reference(in, ref.data());
  double worst = 0;
  size_t non_finite = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i])) ++non_finite;
    worst = std::max(worst, std::fabs(out[i] - ref[i]) / std::max(1.0, std::fabs(ref[i])));
  }
  std::printf("[value] %-18s f32 n=%-5lld max diff %.2e\n", row.name.c_str(), static_cast<long long>(row.out_size), worst);
  EXPECT_EQ(non_finite, 0u) << row.name;
  EXPECT_LE(worst, 1e-4) << row.name;
}

TEST_P(CudaOpTable, GradientMatchesFiniteDifferences) {
  const OpRow& row = GetParam();
  if (!adapter_.backward) GTEST_SKIP() << row.name << ": no CUDA backward in the table";
  OpInputs in = moe::testing::make_inputs(row);
  Gpu gpu(*ctx_);
  Vec R(row.out_size);
  moe::testing::fill_normal(R.data(), R.size(), 777);
  std::vector<Vec> grads;
  std::vector<float*> ptrs;
  for (const auto& f : row.floats) grads.emplace_back(f.size, 0.0f);
  for (size_t k = 0; k < grads.size(); ++k) ptrs.push_back(row.floats[k].differentiable ? grads[k].data() : nullptr);
  adapter_.backward(gpu, row, in, R.data(), ptrs);
  Vec out(row.out_size);
  for (size_t k = 0; k < row.floats.size(); ++k) {
    if (!row.floats[k].differentiable) continue;
    auto loss = [&] {
      Gpu g(*ctx_);
      adapter_.forward(g, row, in, out.data());
      double s = 0;
      for (size_t i = 0; i < out.size(); ++i) s += static_cast<double>(out[i]) * R[i];
      return s;
    };
    const moe::testing::GradCheckResult r =
        moe::testing::check_gradient(loss, in.f[k].data(), grads[k].data(), grads[k].size(), row.eps, grads[k].size());
    std::printf("[grad ] %-18s f32 d%-7s max_rel=%.2e  (tol %.0e)\n", row.name.c_str(), row.floats[k].name.c_str(),
                r.max_rel_err, 2 * row.grad_tol);
    EXPECT_TRUE(r.finite) << row.name;
    // The GPU's f32 reductions run in another order than the CPU's: twice the row's CPU tolerance.
    EXPECT_LE(r.max_rel_err, 2 * row.grad_tol) << row.name << " d" << row.floats[k].name;
  }
}

// The accumulate rule: the GPU backward on gradients pre-filled with P gives P + what it gives on zeros.
TEST_P(CudaOpTable, BackwardAccumulates) {
  const OpRow& row = GetParam();
  if (!adapter_.backward) GTEST_SKIP() << row.name << ": no CUDA backward in the table";
  const OpInputs in = moe::testing::make_inputs(row);
  Vec R(row.out_size);
  moe::testing::fill_normal(R.data(), R.size(), 778);
  auto grads_from = [&](bool prefilled) {
    std::vector<Vec> grads;
    std::vector<float*> ptrs;
    for (size_t k = 0; k < row.floats.size(); ++k) {
      grads.emplace_back(row.floats[k].size, 0.0f);
      if (prefilled) moe::testing::fill_normal(grads[k].data(), grads[k].size(), 900 + k);
    }
    for (size_t k = 0; k < grads.size(); ++k) ptrs.push_back(row.floats[k].differentiable ? grads[k].data() : nullptr);
    Gpu gpu(*ctx_);
    adapter_.backward(gpu, row, in, R.data(), ptrs);
    return grads;
  };
  const std::vector<Vec> zero = grads_from(false), acc = grads_from(true);
  for (size_t k = 0; k < row.floats.size(); ++k) {
    if (!row.floats[k].differentiable) continue;
    Vec pre(row.floats[k].size);
    moe::testing::fill_normal(pre.data(), pre.size(), 900 + k);
    double worst = 0;
    for (size_t i = 0; i < pre.size(); ++i) {
      const double want = static_cast<double>(pre[i]) + zero[k][i];
      worst = std::max(worst, std::fabs(acc[k][i] - want) / (1e-6 * (std::fabs(pre[i]) + std::fabs(zero[k][i])) + 1e-7));
    }
    EXPECT_LE(worst, 1.0) << row.name << " d" << row.floats[k].name << ": backward does not accumulate";
  }
}

INSTANTIATE_TEST_SUITE_P(Gpu, CudaOpTable, ::testing::ValuesIn(moe::testing::op_table()),
                         [](const ::testing::TestParamInfo<OpRow>& info) { return info.param.name; });

}  // namespace
}  // namespace moe::cuda
