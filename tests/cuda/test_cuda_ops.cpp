// Every CUDA kernel (src/cuda/ops.h) against the CPU reference kernel (tensor/ops.h), in f32 and in
// bf16 storage, ggml-style: same inputs, outputs compared with the tolerance policy of cuda/ops.h, and
// a NaN/Inf check apart from the tolerance. Each comparison prints its max difference (llm.c style).
//
// bf16: inputs (and the gradients a backward accumulates into) are rounded to bf16 on the host first,
// and the CPU reference runs on those rounded values, so the comparison measures the GPU's arithmetic,
// not the rounding of the inputs.
//
// Without a GPU (no device or no driver: this machine, CI) every test skips, saying why.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cuda/device.h"
#include "cuda/ops.h"
#include "tensor/ops.h"

namespace moe::cuda {
namespace {

using Vec = std::vector<float>;

// Round-to-nearest-even f32 -> bf16 bits, and back: what __float2bfloat16_rn does (finite inputs).
uint16_t to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float from_bf16_bits(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
Vec round_to(DType dt, Vec v) {
  if (dt == DType::bf16)
    for (float& x : v) x = from_bf16_bits(to_bf16_bits(x));
  return v;
}

Vec random_vec(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  Vec v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// Max allowed |gpu - cpu| / max(1, |cpu|): cuda/ops.h's policy.
double tolerance(DType dt) { return dt == DType::f32 ? 1e-4 : 1.0 / 64; }

class CudaOps : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    if (device_count() == 0) GTEST_SKIP() << device_summary();
    ASSERT_TRUE(Context::create(0, &ctx_).is_ok());
    dt_ = GetParam();
  }

  // Device copy of `host` in storage type dt_ (or f32 when as_f32).
  void* upload(const Vec& host, bool as_f32 = false) {
    const DType t = as_f32 ? DType::f32 : dt_;
    buffers_.emplace_back();
    DeviceBuffer& b = buffers_.back();
    EXPECT_TRUE(b.allocate(std::max<size_t>(1, host.size()) * dtype_size(t)).is_ok());
    if (t == DType::f32) {
      EXPECT_TRUE(copy_to_device(*ctx_, b.get(), host.data(), host.size() * 4).is_ok());
    } else {
      std::vector<uint16_t> bits(host.size());
      for (size_t i = 0; i < host.size(); ++i) bits[i] = to_bf16_bits(host[i]);
      EXPECT_TRUE(copy_to_device(*ctx_, b.get(), bits.data(), bits.size() * 2).is_ok());
    }
    return b.get();
  }
  float* upload_f32(const Vec& host) { return static_cast<float*>(upload(host, true)); }
  template <typename I>
  I* upload_ints(const std::vector<I>& host) {
    buffers_.emplace_back();
    EXPECT_TRUE(buffers_.back().allocate(std::max<size_t>(1, host.size()) * sizeof(I)).is_ok());
    EXPECT_TRUE(copy_to_device(*ctx_, buffers_.back().get(), host.data(), host.size() * sizeof(I)).is_ok());
    return buffers_.back().as<I>();
  }
  Vec download(const void* dev, size_t n, bool as_f32 = false) {
    EXPECT_TRUE(ctx_->synchronize().is_ok());
    Vec out(n);
    if (as_f32 || dt_ == DType::f32) {
      EXPECT_TRUE(copy_to_host(*ctx_, out.data(), dev, n * 4).is_ok());
    } else {
      std::vector<uint16_t> bits(n);
      EXPECT_TRUE(copy_to_host(*ctx_, bits.data(), dev, n * 2).is_ok());
      for (size_t i = 0; i < n; ++i) out[i] = from_bf16_bits(bits[i]);
    }
    return out;
  }
  Vec download_f32(const float* dev, size_t n) { return download(dev, n, true); }
  // Inputs as the GPU sees them (rounded to the storage type).
  Vec in(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) { return round_to(dt_, random_vec(n, seed, lo, hi)); }

  void expect_close(const std::string& what, const Vec& gpu, const Vec& cpu, double tol_scale = 1.0) {
    ASSERT_EQ(gpu.size(), cpu.size()) << what;
    size_t non_finite = 0, worst = 0;
    double max_rel = 0;
    for (size_t i = 0; i < gpu.size(); ++i) {
      if (!std::isfinite(gpu[i])) {
        ++non_finite;
        continue;
      }
      const double rel = std::fabs(double(gpu[i]) - cpu[i]) / std::max(1.0, std::fabs(double(cpu[i])));
      if (rel > max_rel) max_rel = rel, worst = i;
    }
    std::printf("  %-44s %-4s n %8zu  max diff %.3e (at %zu: gpu %.6g cpu %.6g)\n", what.c_str(), dtype_name(dt_),
                gpu.size(), max_rel, worst, gpu.empty() ? 0.0 : gpu[worst], cpu.empty() ? 0.0 : cpu[worst]);
    EXPECT_EQ(non_finite, 0u) << what << ": NaN or Inf in the GPU result";
    EXPECT_LE(max_rel, tolerance(dt_) * tol_scale) << what;
  }

  std::unique_ptr<Context> ctx_;
  DType dt_ = DType::f32;
  std::vector<DeviceBuffer> buffers_;  // everything uploaded, freed with the test (moves keep the device pointer)
};

TEST_P(CudaOps, GemmEveryTransposeWithBeta) {
  const int64_t M = 37, N = 53, K = 71;
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      const int64_t lda = ta ? M : K, ldb = tb ? K : N;
      Vec A = in(M * K, 1), B = in(K * N, 2), C = in(M * N, 3);
      void *dA = upload(A), *dB = upload(B), *dC = upload(C);
      ASSERT_TRUE(gemm(*ctx_, dt_, ta, tb, M, N, K, 0.5f, dA, lda, dB, ldb, 2.0f, dC, N).is_ok());
      moe::gemm(ta, tb, M, N, K, 0.5f, A.data(), lda, B.data(), ldb, 2.0f, C.data(), N);
      expect_close("gemm ta=" + std::to_string(ta) + " tb=" + std::to_string(tb), download(dC, M * N), C);
    }
}

TEST_P(CudaOps, LinearForwardBackward) {
  const int64_t N = 45, IC = 64, OC = 96;
  Vec x = in(N * IC, 1), w = in(OC * IC, 2), dy = in(N * OC, 3), dx = in(N * IC, 4), dw = in(OC * IC, 5);
  void *gx = upload(x), *gw = upload(w), *gdy = upload(dy), *gdx = upload(dx), *gdw = upload(dw);
  void* gy = upload(Vec(N * OC));
  ASSERT_TRUE(linear_forward(*ctx_, dt_, gy, gx, gw, N, IC, OC).is_ok());
  ASSERT_TRUE(linear_backward(*ctx_, dt_, gdx, gdw, gdy, gx, gw, N, IC, OC).is_ok());
  Vec y(N * OC);
  moe::linear_forward(y.data(), x.data(), w.data(), N, IC, OC);
  moe::linear_backward(dx.data(), dw.data(), dy.data(), x.data(), w.data(), N, IC, OC);
  expect_close("linear_forward", download(gy, y.size()), y);
  expect_close("linear_backward dinp", download(gdx, dx.size()), dx);
  expect_close("linear_backward dweight", download(gdw, dw.size()), dw);
}

TEST_P(CudaOps, GroupedExpertGemmMatchesPerExpertLinear) {
  // 6 experts, two of them with no rows: every way of running them must skip those.
  const int64_t E = 6, C = 64, F = 96;
  const std::vector<int64_t> off = {0, 13, 13, 40, 41, 41, 70};
  const int64_t R = off.back();
  Vec x = in(R * C, 1), w1 = in(E * F * C, 2), dh = in(R * F, 3);
  const Vec dw1_start = in(E * F * C, 5);
  void *gx = upload(x), *gw1 = upload(w1), *gdh = upload(dh);
  // The CPU reference: forward h = x w1[e]^T;  backward dx = dh w1[e];  dw1[e] += dh^T x
  Vec h(R * F), dx(R * C), dw1 = dw1_start;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = off[e], n = off[e + 1] - off[e];
    if (n == 0) continue;
    moe::linear_forward(h.data() + r0 * F, x.data() + r0 * C, w1.data() + e * F * C, n, C, F);
    moe::linear_backward(dx.data() + r0 * C, dw1.data() + e * F * C, dh.data() + r0 * F, x.data() + r0 * C,
                         w1.data() + e * F * C, n, C, F);
  }
  void* gh_loop = upload(Vec(R * F));
  ASSERT_TRUE(grouped_gemm_looped(*ctx_, dt_, true, gh_loop, gx, gw1, off.data(), E, C, F, 1.0f, 0.0f).is_ok());
  expect_close("grouped_gemm_looped forward", download(gh_loop, h.size()), h);
  // Each way grouped_gemm can run (Context lanes and chunk rows): the cuBLAS grouped call; 4 lanes;
  // chunks of 8 rows in one batched call (13 = 8 + 5, 27 = 3 x 8 + 3, 1, 29 = 3 x 8 + 5), the partial
  // ones padded, or (beta = 0) the last chunk overlapping the one before it, except the 1-row expert's.
  const struct {
    const char* name;
    int lanes, chunk_rows;
    bool overlap;
  } ways[] = {{"cuBLAS grouped call", 0, 0, false},
              {"4 lanes", 4, 0, false},
              {"8-row chunks, padded", 4, 8, false},
              {"8-row chunks, last one overlapping", 4, 8, true}};
  std::vector<Vec> chunked_forward;  // the two chunked ways' forward, bit for bit
  for (const auto& way : ways) {
    SCOPED_TRACE(way.name);
    ctx_->set_grouped_gemm_lanes(way.lanes);
    ctx_->set_grouped_gemm_chunk_rows(way.chunk_rows);
    ctx_->set_grouped_gemm_chunk_overlap(way.overlap);
    void *gh = upload(Vec(R * F)), *gdx = upload(Vec(R * C)), *gdw1 = upload(dw1_start);
    ASSERT_TRUE(grouped_gemm(*ctx_, dt_, true, gh, gx, gw1, off.data(), E, C, F, 1.0f, 0.0f).is_ok());
    ASSERT_TRUE(grouped_gemm(*ctx_, dt_, false, gdx, gdh, gw1, off.data(), E, F, C, 1.0f, 0.0f).is_ok());
    ASSERT_TRUE(grouped_gemm_weight_grad(*ctx_, dt_, gdw1, gdh, gx, off.data(), E, C, F, 1.0f, 1.0f).is_ok());
    if (way.lanes == 0) {  // the grouped call itself ran (not its per-expert fallback, same numbers)
      EXPECT_EQ(grouped_gemm_fallbacks(), 0) << "cublasGemmGroupedBatchedEx answered NOT_SUPPORTED for " << dtype_name(dt_);
    }
    const std::string tag = std::string(" (") + way.name + ")";
    expect_close(("grouped_gemm forward" + tag).c_str(), download(gh, h.size()), h);
    if (way.chunk_rows > 0) chunked_forward.push_back(download(gh, h.size()));
    expect_close(("grouped_gemm backward dx" + tag).c_str(), download(gdx, dx.size()), dx);
    expect_close(("grouped_gemm_weight_grad" + tag).c_str(), download(gdw1, dw1.size()), dw1);
    // beta = 1 accumulates into what Y holds (the MoE layer's SwiGLU backward does): h + h.
    ASSERT_TRUE(grouped_gemm(*ctx_, dt_, true, gh, gx, gw1, off.data(), E, C, F, 1.0f, 1.0f).is_ok());
    Vec twice = round_to(dt_, download(gh, h.size()));
    for (float& v : twice) v *= 0.5f;
    expect_close(("grouped_gemm beta=1, halved" + tag).c_str(), twice, h);
  }
  // The overlapping chunk runs the same kernel on the same rows as the padded one: same bits.
  ASSERT_EQ(chunked_forward.size(), 2u);
  EXPECT_EQ(chunked_forward[0], chunked_forward[1]) << "overlapping last chunk changed the forward's bits";
  ctx_->set_grouped_gemm_lanes(Context::kDefaultGroupedLanes);
  ctx_->set_grouped_gemm_chunk_rows(Context::kDefaultChunkRows);
  ctx_->set_grouped_gemm_chunk_overlap(true);
}

TEST_P(CudaOps, Elementwise) {
  const int64_t n = 1000;
  Vec x = in(n, 1, -4, 4), u = in(n, 2), dy = in(n, 3), acc = in(n, 4), acc2 = in(n, 5);
  void *gx = upload(x), *gu = upload(u), *gdy = upload(dy), *gacc = upload(acc), *gacc2 = upload(acc2);
  void* gy = upload(Vec(n));
  Vec y(n), a = acc, a2 = acc2;

  ASSERT_TRUE(gelu_forward(*ctx_, dt_, gy, gx, n).is_ok());
  moe::gelu_forward(y.data(), x.data(), n);
  expect_close("gelu_forward", download(gy, n), y);
  ASSERT_TRUE(gelu_backward(*ctx_, dt_, gacc, gdy, gx, n).is_ok());
  moe::gelu_backward(a.data(), dy.data(), x.data(), n);
  expect_close("gelu_backward (accumulating)", download(gacc, n), a);

  ASSERT_TRUE(swiglu_forward(*ctx_, dt_, gy, gx, gu, n).is_ok());
  moe::swiglu_forward(y.data(), x.data(), u.data(), n);
  expect_close("swiglu_forward", download(gy, n), y);
  a = round_to(dt_, download(gacc, n));  // the accumulator as the GPU now holds it
  ASSERT_TRUE(swiglu_backward(*ctx_, dt_, gacc, gacc2, gdy, gx, gu, n).is_ok());
  moe::swiglu_backward(a.data(), a2.data(), dy.data(), x.data(), u.data(), n);
  expect_close("swiglu_backward dgate", download(gacc, n), a);
  expect_close("swiglu_backward dup", download(gacc2, n), a2);

  Vec s = x;
  ASSERT_TRUE(add_inplace(*ctx_, dt_, gx, gu, n).is_ok());
  moe::add_inplace(s.data(), u.data(), n);
  expect_close("add_inplace", download(gx, n), s);
  s = round_to(dt_, s);
  ASSERT_TRUE(scale_inplace(*ctx_, dt_, gx, -0.75f, n).is_ok());
  moe::scale_inplace(s.data(), -0.75f, n);
  expect_close("scale_inplace", download(gx, n), s);
}

TEST_P(CudaOps, RouterSoftmaxAndTopK) {
  const int64_t N = 77, D = 64, K = 2;
  Vec x = in(N * D, 1, -3, 3), dy = in(N * D, 2), dx = in(N * D, 3);
  void *gx = upload(x), *gdy = upload(dy), *gdx = upload(dx), *gp = upload(Vec(N * D));
  ASSERT_TRUE(softmax_forward(*ctx_, dt_, gp, gx, N, D).is_ok());
  Vec p(N * D);
  moe::softmax_forward(p.data(), x.data(), N, D);
  const Vec gpu_p = download(gp, p.size());
  expect_close("softmax_forward", gpu_p, p);
  // Backward from the probabilities the GPU saved (rounded as stored), so both sides use the same.
  const Vec saved = round_to(dt_, gpu_p);
  ASSERT_TRUE(softmax_backward(*ctx_, dt_, gdx, gdy, gp, N, D).is_ok());
  moe::softmax_backward(dx.data(), dy.data(), saved.data(), N, D);
  expect_close("softmax_backward", download(gdx, dx.size()), dx);

  for (int64_t k : {int64_t{1}, K, int64_t{8}}) {
    Vec v(N * k);
    std::vector<int32_t> idx(N * k);
    moe::topk_forward(v.data(), idx.data(), x.data(), N, D, k);
    float* gv = upload_f32(Vec(N * k));
    int32_t* gi = upload_ints(std::vector<int32_t>(N * k, -7));
    ASSERT_TRUE(topk_forward(*ctx_, dt_, gv, gi, gx, N, D, k).is_ok());
    const Vec gpu_v = download_f32(gv, v.size());
    std::vector<int32_t> gpu_i(N * k);
    ASSERT_TRUE(copy_to_host(*ctx_, gpu_i.data(), gi, gpu_i.size() * 4).is_ok());
    EXPECT_EQ(gpu_i, idx) << "top-" << k << " indices";
    EXPECT_EQ(gpu_v, v) << "top-" << k << " values (copied, not computed: exact)";
  }
  EXPECT_FALSE(topk_forward(*ctx_, dt_, nullptr, nullptr, gx, N, D, 17).is_ok());
}

// The router's bias, aux and z pieces (router_loss.cu) against moe/router.cpp's arithmetic, and the
// gradient norm's sum of squares.
TEST_P(CudaOps, RouterLossPiecesAndSumOfSquares) {
  const int64_t N = 150, D = 12;
  Vec a = in(N * D, 1), v = random_vec(D, 2), logits = in(N * D, 3, -3, 3), dl = in(N * D, 4);
  void *ga = upload(a), *glogits = upload(logits), *gdl = upload(dl), *gprobs = upload(Vec(N * D));
  float* gv = upload_f32(v);
  // a[n,d] += 0.3 v[d]
  ASSERT_TRUE(add_row_vector(*ctx_, dt_, ga, gv, 0.3f, N, D).is_ok());
  for (int64_t i = 0; i < N * D; ++i) a[i] += 0.3f * v[i % D];
  expect_close("add_row_vector", download(ga, a.size()), a);
  // lse and the probabilities' column sums, from the GPU's softmax (as stored)
  ASSERT_TRUE(softmax_forward(*ctx_, dt_, gprobs, glogits, N, D).is_ok());
  const Vec probs = download(gprobs, N * D);
  float* glse = upload_f32(Vec(N));
  buffers_.emplace_back();
  ASSERT_TRUE(buffers_.back().allocate(D * sizeof(double)).is_ok());
  double* gsum = buffers_.back().as<double>();
  ASSERT_TRUE(router_stats_forward(*ctx_, dt_, glse, gsum, glogits, gprobs, N, D).is_ok());
  Vec lse(N);
  std::vector<double> sum(D, 0.0), gpu_sum(D);
  for (int64_t n = 0; n < N; ++n) {
    const float* l = logits.data() + n * D;
    float m = l[0];
    for (int64_t d = 1; d < D; ++d) m = std::max(m, l[d]);
    double s = 0;
    for (int64_t d = 0; d < D; ++d) s += std::exp(static_cast<double>(l[d]) - m);
    lse[n] = static_cast<float>(m + std::log(s));
    for (int64_t d = 0; d < D; ++d) sum[d] += probs[n * D + d];
  }
  expect_close("router_stats_forward lse", download_f32(glse, N), lse);
  ASSERT_TRUE(copy_to_host(*ctx_, gpu_sum.data(), gsum, D * sizeof(double)).is_ok());
  for (int64_t d = 0; d < D; ++d) EXPECT_NEAR(gpu_sum[d], sum[d], 1e-9 * std::max(1.0, sum[d])) << "column " << d;
  {
    // Column sums over several row chunks (512 rows each) and column tiles (32 columns each).
    const int64_t N2 = 1300, D2 = 40;
    void *gl2 = upload(in(N2 * D2, 6, -3, 3)), *gp2 = upload(Vec(N2 * D2));
    ASSERT_TRUE(softmax_forward(*ctx_, dt_, gp2, gl2, N2, D2).is_ok());
    const Vec p2 = download(gp2, N2 * D2);
    float* glse2 = upload_f32(Vec(N2));
    buffers_.emplace_back();
    ASSERT_TRUE(buffers_.back().allocate(D2 * sizeof(double)).is_ok());
    double* gsum2 = buffers_.back().as<double>();
    ASSERT_TRUE(router_stats_forward(*ctx_, dt_, glse2, gsum2, gl2, gp2, N2, D2).is_ok());
    std::vector<double> want(D2, 0.0), got(D2);
    for (int64_t i = 0; i < N2 * D2; ++i) want[i % D2] += p2[i];
    ASSERT_TRUE(copy_to_host(*ctx_, got.data(), gsum2, D2 * sizeof(double)).is_ok());
    for (int64_t d = 0; d < D2; ++d) EXPECT_NEAR(got[d], want[d], 1e-9 * std::max(1.0, want[d])) << "column " << d;
  }
  // dl[n,d] += (0.02 lse[n]) probs[n,d]
  ASSERT_TRUE(router_z_backward(*ctx_, dt_, gdl, glse, gprobs, 0.02f, N, D).is_ok());
  const Vec gpu_lse = download_f32(glse, N);
  for (int64_t i = 0; i < N * D; ++i) dl[i] += (0.02f * gpu_lse[i / D]) * probs[i];
  expect_close("router_z_backward", download(gdl, dl.size()), dl);
  // sum of squares in double
  // 5000: one chunk; 150000: three chunks of 65536, the last partial; 0: zero.
  for (int64_t n : {5000, 150000, 0}) {
    const Vec x = in(n, 5, -3, 3);
    void* gx = upload(n > 0 ? x : Vec(1));
    ASSERT_TRUE(sum_squares(*ctx_, dt_, gsum, gx, n).is_ok());
    double ss = 0, gpu_ss = -1;
    for (float e : x) ss += static_cast<double>(e) * e;
    ASSERT_TRUE(copy_to_host(*ctx_, &gpu_ss, gsum, sizeof(double)).is_ok());
    EXPECT_NEAR(gpu_ss, ss, 1e-12 * ss) << "sum_squares of " << n;
  }
}

TEST_P(CudaOps, LayerNormAndRmsNorm) {
  // The second shape: parameter gradients over several 512-row chunks and a partial 32-column tile.
  for (const auto& [N, C] : {std::pair<int64_t, int64_t>{33, 200}, std::pair<int64_t, int64_t>{1100, 70}}) {
    SCOPED_TRACE("N " + std::to_string(N) + " C " + std::to_string(C));
    Vec x = in(N * C, 1, -2, 2), w = in(C, 2, 0.5f, 1.5f), b = in(C, 3), dy = in(N * C, 4);
    Vec dx = in(N * C, 5), dw = in(C, 6), db = in(C, 7);
    void *gx = upload(x), *gw = upload(w), *gb = upload(b), *gdy = upload(dy), *gdx = upload(dx), *gdw = upload(dw),
         *gdb = upload(db), *gy = upload(Vec(N * C));
    float *gmean = upload_f32(Vec(N)), *grstd = upload_f32(Vec(N));
    Vec y(N * C), mean(N), rstd(N);
    ASSERT_TRUE(layernorm_forward(*ctx_, dt_, gy, gmean, grstd, gx, gw, gb, N, C, 1e-5f).is_ok());
    moe::layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, 1e-5f);
    expect_close("layernorm_forward", download(gy, y.size()), y);
    expect_close("layernorm_forward mean", download_f32(gmean, N), mean);
    expect_close("layernorm_forward rstd", download_f32(grstd, N), rstd);
    ASSERT_TRUE(layernorm_backward(*ctx_, dt_, gdx, gdw, gdb, gdy, gx, gw, gmean, grstd, N, C).is_ok());
    moe::layernorm_backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), mean.data(), rstd.data(), N, C);
    expect_close("layernorm_backward dinp", download(gdx, dx.size()), dx);
    expect_close("layernorm_backward dweight", download(gdw, C), dw);
    expect_close("layernorm_backward dbias", download(gdb, C), db);

    Vec dx2 = in(N * C, 8), dw2 = in(C, 9);
    void *gdx2 = upload(dx2), *gdw2 = upload(dw2);
    ASSERT_TRUE(rmsnorm_forward(*ctx_, dt_, gy, grstd, gx, gw, N, C, 1e-5f).is_ok());
    moe::rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5f);
    expect_close("rmsnorm_forward", download(gy, y.size()), y);
    ASSERT_TRUE(rmsnorm_backward(*ctx_, dt_, gdx2, gdw2, gdy, gx, gw, grstd, N, C).is_ok());
    moe::rmsnorm_backward(dx2.data(), dw2.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C);
    expect_close("rmsnorm_backward dinp", download(gdx2, dx2.size()), dx2);
    expect_close("rmsnorm_backward dweight", download(gdw2, C), dw2);
  }
}

TEST_P(CudaOps, CausalAttention) {
  const int64_t B = 2, T = 19, C = 48, NH = 4, BTC = B * T * C, BNTT = B * NH * T * T;
  Vec qkv = in(B * T * 3 * C, 1), dout = in(BTC, 2), dqkv = in(B * T * 3 * C, 3);
  void *gqkv = upload(qkv), *gdout = upload(dout), *gdqkv = upload(dqkv);
  void *gout = upload(Vec(BTC)), *gpre = upload(Vec(BNTT)), *gatt = upload(Vec(BNTT));
  void *gdatt = upload(Vec(BNTT)), *gdpre = upload(Vec(BNTT)), *scratch = upload(Vec(8 * BTC));
  ASSERT_TRUE(attention_forward(*ctx_, dt_, gout, gpre, gatt, scratch, gqkv, B, T, C, NH).is_ok());
  Vec out(BTC), pre(BNTT), att(BNTT), datt(BNTT), dpre(BNTT);
  moe::attention_forward(out.data(), pre.data(), att.data(), qkv.data(), B, T, C, NH);
  // bf16: scores and probabilities are each rounded once more than in any other op: twice the policy.
  const double chained = dt_ == DType::bf16 ? 2.0 : 1.0;
  expect_close("attention_forward out", download(gout, BTC), out, chained);
  const Vec gpu_att = download(gatt, BNTT);
  expect_close("attention_forward att", gpu_att, att, chained);
  // Backward from the GPU's saved probabilities on both sides.
  const Vec saved = round_to(dt_, gpu_att);
  ASSERT_TRUE(attention_backward(*ctx_, dt_, gdqkv, gdatt, gdpre, scratch, gdout, gqkv, gatt, B, T, C, NH).is_ok());
  moe::attention_backward(dqkv.data(), datt.data(), dpre.data(), dout.data(), qkv.data(), saved.data(), B, T, C, NH);
  expect_close("attention_backward dqkv", download(gdqkv, dqkv.size()), dqkv, chained);
}

TEST_P(CudaOps, EmbeddingAndCrossEntropy) {
  // C over the 256 threads of a token's block; few ids with gaps between them: many positions share
  // a row, and the u-th distinct token is not row u.
  const int64_t B = 3, T = 11, C = 300, V = 256, N = B * T;
  std::vector<int32_t> tokens(N), targets(N);
  std::mt19937 rng(9);
  for (auto& t : tokens) t = static_cast<int32_t>((rng() % 7) * 37 % V);
  for (auto& t : targets) t = static_cast<int32_t>(rng() % V);
  Vec wte = in(V * C, 1), wpe = in(T * C, 2), dout = in(N * C, 3);
  Vec dwte = random_vec(V * C, 4), dwpe = random_vec(T * C, 5);  // f32 accumulators
  int32_t *gtok = upload_ints(tokens), *gtgt = upload_ints(targets);
  void *gwte = upload(wte), *gwpe = upload(wpe), *gdout = upload(dout), *gout = upload(Vec(N * C));
  float *gdwte = upload_f32(dwte), *gdwpe = upload_f32(dwpe);
  ASSERT_TRUE(embedding_forward(*ctx_, dt_, gout, gtok, gwte, gwpe, B, T, C).is_ok());
  ASSERT_TRUE(embedding_backward(*ctx_, dt_, gdwte, gdwpe, gdout, tokens.data(), B, T, C).is_ok());
  Vec out(N * C);
  moe::embedding_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
  moe::embedding_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C);
  expect_close("embedding_forward", download(gout, out.size()), out);
  expect_close("embedding_backward dwte", download_f32(gdwte, dwte.size()), dwte);
  expect_close("embedding_backward dwpe", download_f32(gdwpe, dwpe.size()), dwpe);
  // Either gradient alone (the other null).
  ASSERT_TRUE(embedding_backward(*ctx_, dt_, gdwte, nullptr, gdout, tokens.data(), B, T, C).is_ok());
  ASSERT_TRUE(embedding_backward(*ctx_, dt_, nullptr, gdwpe, gdout, tokens.data(), B, T, C).is_ok());
  moe::embedding_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C);
  expect_close("embedding_backward dwte (alone)", download_f32(gdwte, dwte.size()), dwte);
  expect_close("embedding_backward dwpe (alone)", download_f32(gdwpe, dwpe.size()), dwpe);

  Vec logits = in(N * V, 6, -5, 5), dlogits = in(N * V, 7);
  void *glogits = upload(logits), *gdlogits = upload(dlogits);
  float *gprobs = upload_f32(Vec(N * V)), *glosses = upload_f32(Vec(N));
  ASSERT_TRUE(cross_entropy_forward(*ctx_, dt_, gprobs, glosses, glogits, gtgt, N, V).is_ok());
  Vec probs(N * V);
  const double mean_loss = moe::cross_entropy_forward(probs.data(), logits.data(), targets.data(), N, V);
  const Vec losses = download_f32(glosses, N);
  double gpu_mean = 0;
  for (float l : losses) gpu_mean += l;
  gpu_mean /= N;
  expect_close("cross_entropy_forward probs", download_f32(gprobs, probs.size()), probs);
  expect_close("cross_entropy_forward mean loss", Vec{static_cast<float>(gpu_mean)}, Vec{static_cast<float>(mean_loss)});
  ASSERT_TRUE(cross_entropy_backward(*ctx_, dt_, gdlogits, gprobs, gtgt, N, V, 1.0f).is_ok());
  moe::cross_entropy_backward(dlogits.data(), probs.data(), targets.data(), N, V, 1.0f);
  expect_close("cross_entropy_backward", download(gdlogits, dlogits.size()), dlogits);
}

TEST_P(CudaOps, PermuteAndGateScaledCombine) {
  // N tokens, top-K; rows in expert-contiguous order; one assignment dropped (-1).
  const int64_t N = 29, K = 2, C = 72, R = N * K - 1;
  std::vector<int32_t> token_rows(N * K), row_token(R);
  std::vector<int32_t> order(N * K);
  for (int64_t i = 0; i < N * K; ++i) order[i] = static_cast<int32_t>(i);
  std::shuffle(order.begin(), order.end(), std::mt19937(3));
  for (int64_t i = 0; i < N * K; ++i) {
    const int32_t r = order[i] < R ? order[i] : -1;  // assignment i -> row r (the last row index: dropped)
    token_rows[i] = r;
    if (r >= 0) row_token[r] = static_cast<int32_t>(i / K);
  }
  Vec x = in(N * C, 1), gate = random_vec(N * K, 2, 0, 1), dy = in(N * C, 3), y0 = in(N * C, 4);
  Vec dgate = random_vec(N * K, 5);
  int32_t *gtr = upload_ints(token_rows), *grt = upload_ints(row_token);
  float *ggate = upload_f32(gate), *gdgate = upload_f32(dgate);
  void *gx = upload(x), *grows = upload(Vec(R * C)), *gy = upload(y0), *gdy = upload(dy), *gdrows = upload(Vec(R * C));

  ASSERT_TRUE(gather_rows(*ctx_, dt_, grows, gx, grt, R, C).is_ok());
  Vec rows(R * C);
  moe::gather_rows(rows.data(), x.data(), row_token.data(), R, C);
  const Vec gpu_rows = download(grows, rows.size());
  EXPECT_EQ(gpu_rows, rows) << "gather_rows copies: exact";

  // combine (accumulating into y0) against the CPU's scatter_add_rows with the row weights
  Vec row_weight(R), y = y0;
  std::vector<int32_t> row_index(R);
  for (int64_t i = 0; i < N * K; ++i)
    if (token_rows[i] >= 0) row_weight[token_rows[i]] = gate[i], row_index[token_rows[i]] = static_cast<int32_t>(i / K);
  ASSERT_TRUE(combine_rows(*ctx_, dt_, gy, grows, gtr, ggate, N, K, C, true).is_ok());
  moe::scatter_add_rows(y.data(), rows.data(), row_index.data(), row_weight.data(), R, N, C);
  expect_close("combine_rows (accumulate)", download(gy, y.size()), y);

  ASSERT_TRUE(combine_rows_backward(*ctx_, dt_, gdrows, gdgate, gdy, grows, gtr, ggate, N, K, C).is_ok());
  Vec drows(R * C);
  for (int64_t i = 0; i < N * K; ++i) {
    const int32_t r = token_rows[i];
    if (r < 0) continue;
    double dot = 0;
    for (int64_t c = 0; c < C; ++c) {
      drows[r * C + c] = gate[i] * dy[(i / K) * C + c];
      dot += double(dy[(i / K) * C + c]) * rows[r * C + c];
    }
    dgate[i] += static_cast<float>(dot);
  }
  expect_close("combine_rows_backward drows", download(gdrows, drows.size()), drows);
  expect_close("combine_rows_backward dgate", download_f32(gdgate, dgate.size()), dgate);
}

TEST_P(CudaOps, AdamWMatchesCpuAndWritesTheStorageCopy) {
  const int64_t n = 777;
  Vec p = random_vec(n, 1), g = in(n, 2), m = random_vec(n, 3, 0, 0.1f), v = random_vec(n, 4, 0, 0.01f);
  float *gp = upload_f32(p), *gm = upload_f32(m), *gv = upload_f32(v);
  void *gg = upload(g), *gout = upload(Vec(n));
  for (int64_t t = 1; t <= 3; ++t) {
    ASSERT_TRUE(adamw_update(*ctx_, dt_, gp, gout, gg, gm, gv, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, t).is_ok());
    moe::adamw_update(p.data(), g.data(), m.data(), v.data(), n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, t);
  }
  expect_close("adamw param (f32 master)", download_f32(gp, n), p);
  expect_close("adamw m", download_f32(gm, n), m);
  expect_close("adamw v", download_f32(gv, n), v);
  expect_close("adamw param copy in storage type", download(gout, n), p);
}

TEST_P(CudaOps, SameInputsGiveSameBits) {
  // Deterministic: no float atomics anywhere, so two runs agree bit for bit.
  const int64_t N = 64, C = 128;
  Vec x = in(N * C, 1), w = in(C, 2), dy = in(N * C, 3);
  void *gx = upload(x), *gw = upload(w), *gdy = upload(dy);
  float* grstd = upload_f32(Vec(N));
  void* gy = upload(Vec(N * C));
  ASSERT_TRUE(rmsnorm_forward(*ctx_, dt_, gy, grstd, gx, gw, N, C, 1e-5f).is_ok());
  Vec first_dx, first_dw;
  for (int run = 0; run < 2; ++run) {
    void *gdx = upload(Vec(N * C)), *gdw = upload(Vec(C));
    ASSERT_TRUE(rmsnorm_backward(*ctx_, dt_, gdx, gdw, gdy, gx, gw, grstd, N, C).is_ok());
    const Vec dx = download(gdx, N * C), dw = download(gdw, C);
    if (run == 0) first_dx = dx, first_dw = dw;
    else EXPECT_TRUE(dx == first_dx && dw == first_dw) << "two runs differ";
  }
}

INSTANTIATE_TEST_SUITE_P(StorageTypes, CudaOps, ::testing::Values(DType::f32, DType::bf16),
                         [](const ::testing::TestParamInfo<DType>& i) { return std::string(dtype_name(i.param)); });

// Runs everywhere: what the backend says on a machine without a GPU is one clear line, not a crash.
TEST(CudaDevice, WithoutADeviceContextCreationFailsSayingWhy) {
  if (device_count() > 0) GTEST_SKIP() << "a GPU is present: " << device_summary();
  std::unique_ptr<Context> ctx;
  const Status s = Context::create(0, &ctx);
  EXPECT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("cannot use device 0"), std::string::npos) << s.message();
  EXPECT_EQ(ctx, nullptr);
  std::printf("  %s\n", s.message().c_str());
}

}  // namespace
}  // namespace moe::cuda
