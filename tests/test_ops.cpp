// The kernels of src/tensor/ops.h case by case; the uniform checks of every differentiable kernel are
// the op table's (tests/op_table.h, tests/test_op_table.cpp: one row per op). Here, in the spirit of
// ggml's test-backend-ops:
//  (1) value mode:    each forward against a naive double-precision reference written here
//                     (GEMM: every transpose combination, odd sizes, padded leading dimensions,
//                     alpha/beta, K = 0, M = N = 0, through gemm(), gemm_with("onednn") and
//                     gemm_with("openblas"));
//  (2) gradient mode: every backward against central finite differences (check_gradient of
//                     grad_check.h) of a double-precision loss sum(out * R) with a fixed random R,
//                     with an explicit tolerance per op; plus the ACCUMULATE contract (backward on a
//                     non-zero gradient buffer adds to it) and null gradient pointers being skipped;
//  (3) a NaN/Inf check kept apart from the tolerances (extreme logits, attention rows, ...);
//  (4) topk exactness including ties, K = 1 and K = D;
//  (5) scatter_add_rows (and the other column-block reductions) bit-identical for 1, 2 and 4
//      OpenMP threads with duplicate indices;
//  (6) adamw_update against its closed form over 3 steps (bias correction, weight decay);
//  (7) cross_entropy_forward against -log softmax[target] computed in double.
// Every check prints the op, the input, max abs err and max rel err, so regressions show a trend.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "grad_check.h"
#include "tensor/ops.h"

namespace moe {
namespace {

using moe::testing::all_finite;
using moe::testing::check_gradient;
using moe::testing::fill_normal;
using moe::testing::GradCheckResult;
using Vec = std::vector<float>;
using DVec = std::vector<double>;
using IVec = std::vector<int32_t>;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

Vec randn(size_t n, uint64_t seed, float std = 1.0f) {
  Vec v(n);
  fill_normal(v.data(), n, seed, std);
  return v;
}

IVec randint(size_t n, int32_t hi, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::uniform_int_distribution<int32_t> d(0, hi - 1);
  IVec v(n);
  for (auto& x : v) x = d(g);
  return v;
}

double weighted_sum(const float* out, const float* R, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; ++i) s += static_cast<double>(out[i]) * R[i];
  return s;
}

// ---- reporting ------------------------------------------------------------------------------------

// Value-mode tolerance: |got - ref| <= atol + rtol * |ref|.
struct Tol {
  double atol, rtol;
};

void expect_close(const std::string& op, const std::string& what, const float* got, const double* ref, size_t n,
                  Tol tol) {
  double max_abs = 0, max_rel = 0, worst = 0;
  size_t worst_i = 0;
  bool finite = true;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(got[i])) finite = false;
    double d = std::fabs(static_cast<double>(got[i]) - ref[i]);
    max_abs = std::max(max_abs, d);
    max_rel = std::max(max_rel, d / std::max(std::fabs(ref[i]), 1e-6));
    double ratio = d / (tol.atol + tol.rtol * std::fabs(ref[i]));
    if (ratio > worst) worst = ratio, worst_i = i;
  }
  std::printf("[value] %-26s %-8s n=%-5zu max_abs=%.2e max_rel=%.2e  (atol %.0e, rtol %.0e)\n", op.c_str(),
              what.c_str(), n, max_abs, max_rel, tol.atol, tol.rtol);
  EXPECT_TRUE(finite) << op << " " << what << ": non-finite output";
  EXPECT_LE(worst, 1.0) << op << " " << what << ": worst at " << worst_i << " got " << got[worst_i] << " ref "
                        << ref[worst_i];
}

void expect_close(const std::string& op, const std::string& what, const Vec& got, const DVec& ref, Tol tol) {
  ASSERT_EQ(got.size(), ref.size());
  expect_close(op, what, got.data(), ref.data(), got.size(), tol);
}

// Runs body() with `threads` OpenMP threads, restoring the previous setting.
template <typename F>
void with_threads(int threads, F&& body) {
  int before = omp_get_max_threads();
  omp_set_num_threads(threads);
  body();
  omp_set_num_threads(before);
}

// Finite-difference check of one input: `analytic` is the gradient of loss() w.r.t. x.
// Every entry is probed (the tensors here are small); `tol` bounds check_gradient's max_rel_err,
// which compares absolutely below |grad| = 1e-2.
// The probes run on one OpenMP thread: hundreds of tiny parallel regions stall for whole scheduler
// slices on a loaded 2-core machine (seconds per op). The analytic gradient under test was computed
// by the caller with the ambient thread count, so the threaded backward paths are still exercised.
void expect_grad(const std::string& op, const std::string& input, const std::function<double()>& loss, float* x,
                 const float* analytic, size_t n, double tol, float eps = 1e-2f) {
  GradCheckResult r;
  with_threads(1, [&] { r = check_gradient(loss, x, analytic, n, eps, /*max_checks=*/4096); });
  std::printf("[grad ] %-26s d%-7s checked=%-4zu max_abs=%.2e max_rel=%.2e  (tol %.0e)\n", op.c_str(),
              input.c_str(), r.checked, r.max_abs_err, r.max_rel_err, tol);
  EXPECT_TRUE(r.finite) << op << " d" << input << ": non-finite analytic or numeric gradient";
  EXPECT_EQ(r.checked, n);
  EXPECT_LE(r.max_rel_err, tol) << op << " d" << input;
}

// The ACCUMULATE contract: a backward run on a buffer pre-filled with P yields P + (the gradient it
// writes into a zeroed buffer), up to float rounding of that one addition (FMA contraction may
// fuse it).
void expect_accumulates(const std::string& op, const std::string& input, const Vec& P, const Vec& g_zero,
                        const Vec& g_pre) {
  ASSERT_EQ(P.size(), g_zero.size());
  ASSERT_EQ(P.size(), g_pre.size());
  double worst = 0, max_abs = 0;
  for (size_t i = 0; i < P.size(); ++i) {
    double want = static_cast<double>(P[i]) + g_zero[i];
    double d = std::fabs(g_pre[i] - want);
    max_abs = std::max(max_abs, d);
    worst = std::max(worst, d / (1e-6 * (std::fabs(P[i]) + std::fabs(g_zero[i])) + 1e-7));
  }
  std::printf("[accum] %-26s d%-7s max_abs=%.2e\n", op.c_str(), input.c_str(), max_abs);
  EXPECT_LE(worst, 1.0) << op << " d" << input << ": backward does not accumulate into a non-zero buffer";
}

// A gradient computed with the other gradient pointers null must equal the one computed with all.
void expect_same(const std::string& op, const std::string& what, const Vec& a, const Vec& b) {
  ASSERT_EQ(a.size(), b.size());
  double max_abs = 0;
  for (size_t i = 0; i < a.size(); ++i) max_abs = std::max(max_abs, std::fabs(static_cast<double>(a[i]) - b[i]));
  std::printf("[null ] %-26s %-8s max_abs=%.2e\n", op.c_str(), what.c_str(), max_abs);
  EXPECT_LE(max_abs, 1e-6) << op << " " << what;
}

bool bits_equal(const Vec& a, const Vec& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// ===================================================================================================
// GEMM
// ===================================================================================================

void run_gemm(const std::string& backend, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
              const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (backend == "gemm")
    gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  else
    gemm_with(backend, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

struct GemmStats {
  double max_abs = 0, max_rel = 0;  // rel: |err| / (|alpha| sum_k |a b| + |beta c|), the GEMM error bound
  int cases = 0, failures = 0;
  std::string first_failure;
};

// One GEMM case: operands padded to their leading dimension with NaN (a correct GEMM never reads
// them into the result), C's padding filled with a sentinel that must survive, and C itself NaN
// when beta == 0 (BLAS: C is not read then).
void gemm_case(const std::string& backend, bool ta, bool tb, int64_t M, int64_t N, int64_t K, int64_t pad,
               float alpha, float beta, uint64_t seed, GemmStats& st) {
  const int64_t rows_a = ta ? K : M, cols_a = ta ? M : K, lda = cols_a + pad;
  const int64_t rows_b = tb ? N : K, cols_b = tb ? K : N, ldb = cols_b + pad;
  const int64_t ldc = N + pad;
  const float kSentinel = 7777.0f;
  Vec A(std::max<int64_t>(1, rows_a * lda), kNaN), B(std::max<int64_t>(1, rows_b * ldb), kNaN);
  Vec C(std::max<int64_t>(1, M * ldc), kSentinel);
  Vec ra = randn(rows_a * cols_a, seed), rb = randn(rows_b * cols_b, seed + 1), rc = randn(M * N, seed + 2);
  for (int64_t i = 0; i < rows_a; ++i)
    for (int64_t j = 0; j < cols_a; ++j) A[i * lda + j] = ra[i * cols_a + j];
  for (int64_t i = 0; i < rows_b; ++i)
    for (int64_t j = 0; j < cols_b; ++j) B[i * ldb + j] = rb[i * cols_b + j];
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.0f ? kNaN : rc[i * N + j];
  const Vec C0 = C;

  run_gemm(backend, ta, tb, M, N, K, alpha, A.data(), lda, B.data(), ldb, beta, C.data(), ldc);

  bool ok = true;
  std::string why;
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < ldc; ++j) {
      float got = C[i * ldc + j];
      if (j >= N) {  // padding: untouched
        if (!(got == kSentinel)) ok = false, why = "wrote into C's padding";
        continue;
      }
      double acc = 0, bound = 0;
      for (int64_t k = 0; k < K; ++k) {
        double a = ta ? A[k * lda + i] : A[i * lda + k];
        double b = tb ? B[j * ldb + k] : B[k * ldb + j];
        acc += a * b;
        bound += std::fabs(a * b);
      }
      double ref = alpha * acc, c0 = beta == 0.0f ? 0.0 : C0[i * ldc + j];
      ref += beta * c0;
      bound = std::fabs(alpha) * bound + std::fabs(beta * c0);
      double err = std::fabs(got - ref);
      if (!std::isfinite(got)) {
        ok = false, why = "non-finite output";
        continue;
      }
      double rel = err / std::max(bound, 1e-30);
      st.max_abs = std::max(st.max_abs, err);
      st.max_rel = std::max(st.max_rel, rel);
      // Worst-case bound of a length-K float dot product plus the alpha/beta roundings.
      if (rel > 4.0 * (K + 3) * 5.96e-8 && err > 1e-30) ok = false, why = "error above the bound";
    }
  }
  ++st.cases;
  if (!ok) {
    if (st.failures++ == 0) {
      char buf[256];
      std::snprintf(buf, sizeof buf, "%s ta=%d tb=%d M=%lld N=%lld K=%lld pad=%lld alpha=%g beta=%g: %s",
                    backend.c_str(), ta, tb, (long long)M, (long long)N, (long long)K, (long long)pad, alpha, beta,
                    why.c_str());
      st.first_failure = buf;
    }
  }
}

const char* kGemmBackends[] = {"gemm", "onednn", "openblas"};

TEST(OpsValue, GemmAllTransposesOddSizesPaddedLdAlphaBeta) {
  std::printf("gemm() backend: %s\n", gemm_backend().c_str());
  const int64_t sizes[] = {1, 7, 33};
  const float ab[][2] = {{1.0f, 0.0f}, {0.5f, -1.5f}, {-2.0f, 1.0f}};
  for (const char* be : kGemmBackends) {
    GemmStats st;
    uint64_t seed = 100;
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb)
        for (int64_t M : sizes)
          for (int64_t N : sizes)
            for (int64_t K : sizes)
              for (int64_t pad : {0, 3})
                for (auto& p : ab) gemm_case(be, ta, tb, M, N, K, pad, p[0], p[1], seed += 3, st);
    // A few larger shapes so the libraries' blocked kernels (not only their edge paths) run.
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        gemm_case(be, ta, tb, 67, 129, 257, 5, 1.0f, 0.0f, seed += 3, st);
        gemm_case(be, ta, tb, 128, 96, 64, 0, 0.75f, 1.0f, seed += 3, st);
      }
    std::printf("[value] gemm/%-21s %-8s cases=%-4d max_abs=%.2e max_rel=%.2e  (rel to |alpha||A||B|+|beta C|, "
                "tol 4(K+3)u)\n",
                be, "C", st.cases, st.max_abs, st.max_rel);
    EXPECT_EQ(st.failures, 0) << st.failures << " failing cases; first: " << st.first_failure;
  }
}

TEST(OpsValue, GemmKZeroAndEmpty) {
  const int64_t M = 5, N = 7, pad = 2, ldc = N + pad;
  Vec A(64, 1.0f), B(64, 1.0f);
  for (const char* be : kGemmBackends) {
    for (float beta : {0.0f, 0.5f, 1.0f}) {
      // K == 0: C = beta * C (beta == 0 writes zeros even over NaN); padding untouched.
      Vec C = randn(M * ldc, 7);
      for (int64_t i = 0; i < M; ++i) {
        for (int64_t j = N; j < ldc; ++j) C[i * ldc + j] = 7777.0f;
        if (beta == 0.0f)
          for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = kNaN;
      }
      const Vec C0 = C;
      for (int ta = 0; ta < 2; ++ta)
        for (int tb = 0; tb < 2; ++tb) {
          C = C0;
          run_gemm(be, ta, tb, M, N, 0, 2.0f, A.data(), 4, B.data(), 4, beta, C.data(), ldc);
          for (int64_t i = 0; i < M; ++i)
            for (int64_t j = 0; j < ldc; ++j) {
              float want = j >= N ? 7777.0f : (beta == 0.0f ? 0.0f : beta * C0[i * ldc + j]);
              ASSERT_EQ(C[i * ldc + j], want) << be << " K=0 beta=" << beta << " at " << i << "," << j;
            }
        }
    }
    // M == 0 or N == 0: nothing written.
    Vec C(16, 3.0f);
    run_gemm(be, false, false, 0, 4, 3, 1.0f, A.data(), 3, B.data(), 4, 0.0f, C.data(), 4);
    run_gemm(be, false, false, 4, 0, 3, 1.0f, A.data(), 3, B.data(), 1, 0.0f, C.data(), 1);
    for (float c : C) ASSERT_EQ(c, 3.0f) << be << ": empty GEMM wrote C";
    std::printf("[value] gemm/%-21s K=0, M=0, N=0 exact\n", be);
  }
  EXPECT_THROW(gemm_with("cublas", false, false, 1, 1, 1, 1.0f, A.data(), 1, B.data(), 1, 0.0f, A.data(), 1),
               std::invalid_argument);
  const std::string why = gemm_backend();
  EXPECT_TRUE(why.rfind("onednn", 0) == 0 || why.rfind("openblas", 0) == 0) << why;
}

// The backend choice: OpenBLAS only when clearly faster, so noise around a tie cannot flip it.
TEST(OpsValue, GemmChoicePrefersOneDnnUnlessOpenBlasIsClearlyFaster) {
  GemmRates r;
  r.onednn_gflops = 100;
  for (double openblas : {50.0, 100.0, 113.0, 124.9}) {
    r.openblas_gflops = openblas, r.median_ratio = openblas / 100;
    EXPECT_EQ(pick_gemm_backend(r), "onednn") << openblas;
  }
  for (double openblas : {125.1, 150.0}) {
    r.openblas_gflops = openblas, r.median_ratio = openblas / 100;
    EXPECT_EQ(pick_gemm_backend(r), "openblas") << openblas;
    r.median_ratio = 1.2;  // faster at its best, not round by round
    EXPECT_EQ(pick_gemm_backend(r), "onednn") << openblas;
  }
}

// A disturbance that slows one backend for most rounds (seen: oneDNN at 65-70 GFLOP/s in 3 of 5
// rounds against its 190) must not hand the job to the other kernel.
TEST(OpsValue, GemmChoiceSurvivesADisturbedSeries) {
  const GemmRates r = gemm_rates_from_rounds({190, 67, 65, 70, 188}, {100, 101, 102, 99, 100}, "Cooperlake");
  EXPECT_EQ(r.onednn_gflops, 190);
  EXPECT_EQ(r.openblas_gflops, 102);
  EXPECT_EQ(r.rounds, 5);
  EXPECT_EQ(pick_gemm_backend(r), "onednn");
  // And a kernel that really is faster in every round still wins.
  const GemmRates faster = gemm_rates_from_rounds({90, 91, 92}, {130, 60, 128}, "Haswell");
  EXPECT_DOUBLE_EQ(faster.median_ratio, 128.0 / 92);
  EXPECT_EQ(pick_gemm_backend(faster), "openblas");
  // One fast round of OpenBLAS (its best 26% over oneDNN's, a neighbour went idle) does not make it
  // faster: it is slower in the other rounds, median ratio (0.80 + 0.85) / 2.
  const GemmRates burst = gemm_rates_from_rounds({72, 70, 68, 71}, {91, 56, 58, 57}, "SkylakeX");
  EXPECT_DOUBLE_EQ(burst.median_ratio, (57.0 / 71 + 58.0 / 68) / 2);
  EXPECT_EQ(pick_gemm_backend(burst), "onednn");
  EXPECT_THROW(gemm_rates_from_rounds({1, 2}, {1}, ""), std::invalid_argument);
  EXPECT_THROW(gemm_rates_from_rounds({}, {}, ""), std::invalid_argument);
}

// OpenBLAS's fallback kernel is replaced by the newest this instruction set runs; a kernel that
// already uses AVX2 is left alone, whatever the CPU (no model names, only the ISA).
TEST(OpsValue, OpenBlasCoreFollowsTheInstructionSetOnlyWhereItFellBack) {
  EXPECT_EQ(openblas_core_for_isa("Prescott", /*avx512=*/true, /*avx2_fma=*/true), "SkylakeX");
  EXPECT_EQ(openblas_core_for_isa("Prescott", false, true), "Haswell");
  EXPECT_EQ(openblas_core_for_isa("Nehalem", false, true), "Haswell");
  EXPECT_EQ(openblas_core_for_isa("Prescott", false, false), "");  // nothing better to run
  for (const char* fine : {"Haswell", "Zen", "SkylakeX", "Cooperlake", "SapphireRapids", "Excavator"})
    EXPECT_EQ(openblas_core_for_isa(fine, true, true), "") << fine;
}

TEST(OpsValue, GemmMeasurementTimesBothBackends) {
  const std::vector<GemmShape> shapes{{false, true, 64, 96, 32}, {true, false, 32, 96, 64}};
  const GemmRates r = measure_gemm_backends(shapes, 3);
  std::printf("gemm rates: %s\n", describe_gemm_rates(r).c_str());
  EXPECT_EQ(r.rounds, 3);
  EXPECT_GT(r.onednn_gflops, 0);
  EXPECT_GT(r.openblas_gflops, 0);
  EXPECT_TRUE(std::isfinite(r.onednn_gflops) && std::isfinite(r.openblas_gflops));
  EXPECT_FALSE(r.openblas_core.empty());
  EXPECT_THROW(measure_gemm_backends({}, 3), std::invalid_argument);
  EXPECT_THROW(measure_gemm_backends(shapes, 0), std::invalid_argument);
  // The kernel in use alone, timed the same way.
  const double rate = measure_gemm_rate(shapes, 3);
  EXPECT_TRUE(rate > 0 && std::isfinite(rate)) << rate;
  EXPECT_THROW(measure_gemm_rate({}, 3), std::invalid_argument);
  EXPECT_THROW(measure_gemm_rate(shapes, 0), std::invalid_argument);
  EXPECT_THROW(measure_gemm_backends({{false, false, 0, 4, 4}}, 1), std::invalid_argument);
}

// ===================================================================================================
// linear
// ===================================================================================================

TEST(Ops, Linear) {
  const int64_t N = 7, IC = 13, OC = 5;
  Vec inp = randn(N * IC, 1), w = randn(OC * IC, 2, 0.5f), out(N * OC), R = randn(N * OC, 3);
  linear_forward(out.data(), inp.data(), w.data(), N, IC, OC);
  DVec ref(N * OC);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < OC; ++o) {
      double s = 0;
      for (int64_t i = 0; i < IC; ++i) s += static_cast<double>(inp[n * IC + i]) * w[o * IC + i];
      ref[n * OC + o] = s;
    }
  expect_close("linear_forward", "out", out, ref, {1e-5, 1e-5});

  auto loss = [&] {
    linear_forward(out.data(), inp.data(), w.data(), N, IC, OC);
    return weighted_sum(out.data(), R.data(), out.size());
  };
  Vec dinp(N * IC), dw(OC * IC);
  linear_backward(dinp.data(), dw.data(), R.data(), inp.data(), w.data(), N, IC, OC);
  expect_grad("linear_backward", "inp", loss, inp.data(), dinp.data(), dinp.size(), 1e-3);
  expect_grad("linear_backward", "weight", loss, w.data(), dw.data(), dw.size(), 1e-3);

  Vec Pi = randn(dinp.size(), 4), Pw = randn(dw.size(), 5), ai = Pi, aw = Pw;
  linear_backward(ai.data(), aw.data(), R.data(), inp.data(), w.data(), N, IC, OC);
  expect_accumulates("linear_backward", "inp", Pi, dinp, ai);
  expect_accumulates("linear_backward", "weight", Pw, dw, aw);

  Vec only_i(dinp.size()), only_w(dw.size());
  linear_backward(only_i.data(), nullptr, R.data(), inp.data(), w.data(), N, IC, OC);
  linear_backward(nullptr, only_w.data(), R.data(), inp.data(), w.data(), N, IC, OC);
  linear_backward(nullptr, nullptr, R.data(), inp.data(), w.data(), N, IC, OC);
  expect_same("linear_backward", "dinp", only_i, dinp);
  expect_same("linear_backward", "dweight", only_w, dw);
}

// ===================================================================================================
// elementwise
// ===================================================================================================

TEST(Ops, AddScaleInplace) {
  const int64_t n = 1001;  // odd: SIMD tails
  Vec a = randn(n, 1), b = randn(n, 2), a0 = a;
  add_inplace(a.data(), b.data(), n);
  DVec ref(n);
  for (int64_t i = 0; i < n; ++i) ref[i] = static_cast<double>(a0[i]) + b[i];
  expect_close("add_inplace", "a", a, ref, {0, 1.2e-7});
  a = a0;
  scale_inplace(a.data(), -1.75f, n);
  for (int64_t i = 0; i < n; ++i) ref[i] = -1.75 * a0[i];
  expect_close("scale_inplace", "a", a, ref, {0, 1.2e-7});
}

double gelu_ref(double x) {
  const double k = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}
double gelu_grad_ref(double x) {
  const double k = std::sqrt(2.0 / M_PI);
  double u = k * (x + 0.044715 * x * x * x), th = std::tanh(u);
  return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * k * (1.0 + 3.0 * 0.044715 * x * x);
}

TEST(Ops, Gelu) {
  const int64_t n = 203;
  Vec x = randn(n, 11, 2.0f);
  const float specials[] = {0.0f, 1e-30f, -1e-30f, 3.0f, -3.0f, 6.0f, -6.0f, 12.0f, -12.0f, 0.5f, -0.5f};
  for (size_t i = 0; i < std::size(specials); ++i) x[i] = specials[i];
  Vec out(n), R = randn(n, 12);
  gelu_forward(out.data(), x.data(), n);
  DVec ref(n), dref(n);
  for (int64_t i = 0; i < n; ++i) ref[i] = gelu_ref(x[i]), dref[i] = gelu_grad_ref(x[i]) * R[i];
  expect_close("gelu_forward", "out", out, ref, {2e-7, 2e-6});

  Vec dx(n);
  gelu_backward(dx.data(), R.data(), x.data(), n);
  // atol: gelu' = 0.5(1 + tanh) + ... cancels for x < -2, so float leaves ~1e-6 absolute error.
  expect_close("gelu_backward(analytic)", "inp", dx, dref, {5e-6, 1e-5});
  auto loss = [&] {
    gelu_forward(out.data(), x.data(), n);
    return weighted_sum(out.data(), R.data(), n);
  };
  // tol: the central difference's own truncation error (eps^2/6 times gelu's third derivative)
  // is ~3e-3 relative near x = 0; the analytic comparison above is the tight check.
  expect_grad("gelu_backward", "inp", loss, x.data(), dx.data(), n, 5e-3);

  Vec P = randn(n, 13), acc = P;
  gelu_backward(acc.data(), R.data(), x.data(), n);
  expect_accumulates("gelu_backward", "inp", P, dx, acc);

  // The in-place variant: d holds dout on entry and dinp on return (overwrites, by contract).
  Vec d = R;
  gelu_backward_inplace(d.data(), x.data(), n);
  expect_close("gelu_backward_inplace", "inp", d, DVec(dx.begin(), dx.end()), {1e-7, 1e-6});
  expect_grad("gelu_backward_inplace", "inp", loss, x.data(), d.data(), n, 5e-3);
}

TEST(Ops, Swiglu) {
  const int64_t n = 157;
  Vec g = randn(n, 21, 2.0f), u = randn(n, 22), out(n), R = randn(n, 23);
  g[0] = 0.0f, g[1] = 8.0f, g[2] = -8.0f, g[3] = 20.0f, g[4] = -20.0f;
  swiglu_forward(out.data(), g.data(), u.data(), n);
  DVec ref(n);
  for (int64_t i = 0; i < n; ++i) ref[i] = g[i] / (1.0 + std::exp(-static_cast<double>(g[i]))) * u[i];
  expect_close("swiglu_forward", "out", out, ref, {2e-7, 2e-6});

  Vec dg(n), du(n);
  swiglu_backward(dg.data(), du.data(), R.data(), g.data(), u.data(), n);
  auto loss = [&] {
    swiglu_forward(out.data(), g.data(), u.data(), n);
    return weighted_sum(out.data(), R.data(), n);
  };
  expect_grad("swiglu_backward", "gate", loss, g.data(), dg.data(), n, 2e-3);
  expect_grad("swiglu_backward", "up", loss, u.data(), du.data(), n, 1e-3);

  Vec Pg = randn(n, 24), Pu = randn(n, 25), ag = Pg, au = Pu;
  swiglu_backward(ag.data(), au.data(), R.data(), g.data(), u.data(), n);
  expect_accumulates("swiglu_backward", "gate", Pg, dg, ag);
  expect_accumulates("swiglu_backward", "up", Pu, du, au);

  Vec og(n), ou(n);
  swiglu_backward(og.data(), nullptr, R.data(), g.data(), u.data(), n);
  swiglu_backward(nullptr, ou.data(), R.data(), g.data(), u.data(), n);
  swiglu_backward(nullptr, nullptr, R.data(), g.data(), u.data(), n);
  expect_same("swiglu_backward", "dgate", og, dg);
  expect_same("swiglu_backward", "dup", ou, du);
}

// ===================================================================================================
// softmax / topk
// ===================================================================================================

DVec softmax_ref(const Vec& x, int64_t N, int64_t D) {
  DVec y(N * D);
  for (int64_t n = 0; n < N; ++n) {
    double mx = -INFINITY, s = 0;
    for (int64_t d = 0; d < D; ++d) mx = std::max(mx, static_cast<double>(x[n * D + d]));
    for (int64_t d = 0; d < D; ++d) s += std::exp(x[n * D + d] - mx);
    for (int64_t d = 0; d < D; ++d) y[n * D + d] = std::exp(x[n * D + d] - mx) / s;
  }
  return y;
}

TEST(Ops, Softmax) {
  const int64_t N = 6, D = 13;
  Vec x = randn(N * D, 31, 2.0f), out(N * D), R = randn(N * D, 32);
  for (int64_t d = 0; d < D; ++d) x[5 * D + d] *= 5e3f;  // a row of large logits (|x| ~ 1e4)
  softmax_forward(out.data(), x.data(), N, D);
  expect_close("softmax_forward", "out", out, softmax_ref(x, N, D), {1e-7, 2e-6});

  // Gradients on the moderate rows only (FD through a 1e4-scale row is meaningless in float).
  const int64_t Ng = 5;
  Vec dx(Ng * D);
  softmax_forward(out.data(), x.data(), Ng, D);
  softmax_backward(dx.data(), R.data(), out.data(), Ng, D);
  auto loss = [&] {
    softmax_forward(out.data(), x.data(), Ng, D);
    return weighted_sum(out.data(), R.data(), Ng * D);
  };
  expect_grad("softmax_backward", "inp", loss, x.data(), dx.data(), dx.size(), 2e-3);

  softmax_forward(out.data(), x.data(), Ng, D);  // check_gradient left `out` at a perturbed x
  Vec P = randn(dx.size(), 33), acc = P;
  softmax_backward(acc.data(), R.data(), out.data(), Ng, D);
  expect_accumulates("softmax_backward", "inp", P, dx, acc);
}

// Reference top-k: stable sort of the indices by descending value (ties: lower index first).
void topk_ref(const Vec& x, int64_t N, int64_t D, int64_t K, Vec& vals, IVec& idx) {
  vals.assign(N * K, 0), idx.assign(N * K, 0);
  for (int64_t n = 0; n < N; ++n) {
    std::vector<int32_t> order(D);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return x[n * D + a] > x[n * D + b]; });
    for (int64_t k = 0; k < K; ++k) idx[n * K + k] = order[k], vals[n * K + k] = x[n * D + order[k]];
  }
}

void expect_topk(const Vec& x, int64_t N, int64_t D, int64_t K, const char* what) {
  Vec vals(N * K), rvals;
  IVec idx(N * K), ridx;
  topk_forward(vals.data(), idx.data(), x.data(), N, D, K);
  topk_ref(x, N, D, K, rvals, ridx);
  int mismatches = 0;
  for (int64_t i = 0; i < N * K; ++i) {
    if (idx[i] != ridx[i] || std::memcmp(&vals[i], &rvals[i], sizeof(float)) != 0) {
      if (mismatches++ < 5)
        ADD_FAILURE() << "topk " << what << " N=" << N << " D=" << D << " K=" << K << " row " << i / K << " slot "
                      << i % K << ": got (" << vals[i] << ", " << idx[i] << ") want (" << rvals[i] << ", "
                      << ridx[i] << ")";
    }
  }
  std::printf("[value] %-26s %-8s N=%lld D=%lld K=%lld mismatches=%d (exact)\n", "topk_forward", what, (long long)N,
              (long long)D, (long long)K, mismatches);
}

TEST(Ops, TopkExactWithTies) {
  // Hand-written rows: ties must keep the lower index first.
  {
    Vec x = {1, 3, 3, 2, 3, 0, -1, 3};
    Vec vals(4);
    IVec idx(4);
    topk_forward(vals.data(), idx.data(), x.data(), 1, 8, 4);
    EXPECT_EQ(idx, (IVec{1, 2, 4, 7}));
    EXPECT_EQ(vals, (Vec{3, 3, 3, 3}));
  }
  const int64_t D = 9;
  for (int64_t K : {int64_t{1}, int64_t{2}, int64_t{4}, D}) {
    // Continuous values (distinct), heavy ties (integers in [0, 3)), and rows with +-inf, -0/+0.
    Vec cont = randn(17 * D, 41 + K);
    expect_topk(cont, 17, D, K, "distinct");
    IVec ints = randint(33 * D, 3, 42 + K);
    Vec ties(ints.begin(), ints.end());
    expect_topk(ties, 33, D, K, "ties");
    Vec special = {-INFINITY, 1, -INFINITY, 0.0f, -0.0f, INFINITY, 1, -2, INFINITY,
                   -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    expect_topk(special, 2, D, K, "inf/0");
  }
  // D = 1 and K = D = large.
  Vec one = {2.5f, -1.0f};
  expect_topk(one, 2, 1, 1, "D=1");
  IVec big = randint(3 * 64, 5, 43);
  expect_topk(Vec(big.begin(), big.end()), 3, 64, 64, "K=D=64");
}

// ===================================================================================================
// norms
// ===================================================================================================

TEST(Ops, LayerNorm) {
  const int64_t N = 5, C = 19;
  const float eps = 1e-5f;
  Vec x = randn(N * C, 51, 1.5f), w = randn(C, 52, 0.5f), b = randn(C, 53), R = randn(N * C, 54);
  for (int64_t c = 0; c < C; ++c) x[c] += 3.0f, w[c] += 1.0f;  // a row with a non-zero mean
  Vec out(N * C), mean(N), rstd(N);
  layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, eps);
  DVec ref(N * C), rmean(N), rrstd(N);
  for (int64_t n = 0; n < N; ++n) {
    double m = 0, v = 0;
    for (int64_t c = 0; c < C; ++c) m += x[n * C + c];
    m /= C;
    for (int64_t c = 0; c < C; ++c) v += (x[n * C + c] - m) * (x[n * C + c] - m);
    v /= C;
    double s = 1.0 / std::sqrt(v + eps);
    for (int64_t c = 0; c < C; ++c) ref[n * C + c] = (x[n * C + c] - m) * s * w[c] + b[c];
    rmean[n] = m, rrstd[n] = s;
  }
  expect_close("layernorm_forward", "out", out, ref, {1e-6, 2e-6});
  expect_close("layernorm_forward", "mean", mean, rmean, {1e-7, 2e-7});
  expect_close("layernorm_forward", "rstd", rstd, rrstd, {0, 2e-7});

  Vec dx(N * C), dw(C), db(C);
  layernorm_backward(dx.data(), dw.data(), db.data(), R.data(), x.data(), w.data(), mean.data(), rstd.data(), N, C);
  Vec o2(N * C), m2(N), r2(N);
  auto loss = [&] {
    layernorm_forward(o2.data(), m2.data(), r2.data(), x.data(), w.data(), b.data(), N, C, eps);
    return weighted_sum(o2.data(), R.data(), o2.size());
  };
  expect_grad("layernorm_backward", "inp", loss, x.data(), dx.data(), dx.size(), 5e-3);
  expect_grad("layernorm_backward", "weight", loss, w.data(), dw.data(), dw.size(), 1e-3);
  expect_grad("layernorm_backward", "bias", loss, b.data(), db.data(), db.size(), 1e-3);

  Vec Px = randn(dx.size(), 55), Pw = randn(C, 56), Pb = randn(C, 57), ax = Px, aw = Pw, ab = Pb;
  layernorm_backward(ax.data(), aw.data(), ab.data(), R.data(), x.data(), w.data(), mean.data(), rstd.data(), N, C);
  expect_accumulates("layernorm_backward", "inp", Px, dx, ax);
  expect_accumulates("layernorm_backward", "weight", Pw, dw, aw);
  expect_accumulates("layernorm_backward", "bias", Pb, db, ab);

  Vec ox(dx.size()), ow(C), ob(C);
  layernorm_backward(ox.data(), nullptr, nullptr, R.data(), x.data(), w.data(), mean.data(), rstd.data(), N, C);
  layernorm_backward(nullptr, ow.data(), nullptr, R.data(), x.data(), w.data(), mean.data(), rstd.data(), N, C);
  layernorm_backward(nullptr, nullptr, ob.data(), R.data(), x.data(), w.data(), mean.data(), rstd.data(), N, C);
  layernorm_backward(nullptr, nullptr, nullptr, R.data(), x.data(), w.data(), mean.data(), rstd.data(), N, C);
  expect_same("layernorm_backward", "dinp", ox, dx);
  expect_same("layernorm_backward", "dweight", ow, dw);
  expect_same("layernorm_backward", "dbias", ob, db);
}

TEST(Ops, RmsNorm) {
  const int64_t N = 5, C = 21;
  const float eps = 1e-6f;
  Vec x = randn(N * C, 61, 1.5f), w = randn(C, 62, 0.5f), R = randn(N * C, 63);
  for (int64_t c = 0; c < C; ++c) w[c] += 1.0f;
  Vec out(N * C), rstd(N);
  rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, eps);
  DVec ref(N * C), rrstd(N);
  for (int64_t n = 0; n < N; ++n) {
    double ss = 0;
    for (int64_t c = 0; c < C; ++c) ss += static_cast<double>(x[n * C + c]) * x[n * C + c];
    double s = 1.0 / std::sqrt(ss / C + eps);
    for (int64_t c = 0; c < C; ++c) ref[n * C + c] = x[n * C + c] * s * w[c];
    rrstd[n] = s;
  }
  expect_close("rmsnorm_forward", "out", out, ref, {1e-6, 2e-6});
  expect_close("rmsnorm_forward", "rstd", rstd, rrstd, {0, 2e-7});

  Vec dx(N * C), dw(C);
  rmsnorm_backward(dx.data(), dw.data(), R.data(), x.data(), w.data(), rstd.data(), N, C);
  Vec o2(N * C), r2(N);
  auto loss = [&] {
    rmsnorm_forward(o2.data(), r2.data(), x.data(), w.data(), N, C, eps);
    return weighted_sum(o2.data(), R.data(), o2.size());
  };
  expect_grad("rmsnorm_backward", "inp", loss, x.data(), dx.data(), dx.size(), 5e-3);
  expect_grad("rmsnorm_backward", "weight", loss, w.data(), dw.data(), dw.size(), 1e-3);

  Vec Px = randn(dx.size(), 64), Pw = randn(C, 65), ax = Px, aw = Pw;
  rmsnorm_backward(ax.data(), aw.data(), R.data(), x.data(), w.data(), rstd.data(), N, C);
  expect_accumulates("rmsnorm_backward", "inp", Px, dx, ax);
  expect_accumulates("rmsnorm_backward", "weight", Pw, dw, aw);

  Vec ox(dx.size()), ow(C);
  rmsnorm_backward(ox.data(), nullptr, R.data(), x.data(), w.data(), rstd.data(), N, C);
  rmsnorm_backward(nullptr, ow.data(), R.data(), x.data(), w.data(), rstd.data(), N, C);
  rmsnorm_backward(nullptr, nullptr, R.data(), x.data(), w.data(), rstd.data(), N, C);
  expect_same("rmsnorm_backward", "dinp", ox, dx);
  expect_same("rmsnorm_backward", "dweight", ow, dw);
}

// ===================================================================================================
// attention
// ===================================================================================================

void attention_ref(DVec& out, DVec& att, const Vec& qkv, int64_t B, int64_t T, int64_t C, int64_t NH) {
  const int64_t HS = C / NH, C3 = 3 * C;
  const double scale = 1.0 / std::sqrt(static_cast<double>(HS));
  out.assign(B * T * C, 0), att.assign(B * NH * T * T, 0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < NH; ++h) {
        DVec pre(t + 1);
        double mx = -INFINITY;
        for (int64_t t2 = 0; t2 <= t; ++t2) {
          double s = 0;
          for (int64_t i = 0; i < HS; ++i)
            s += static_cast<double>(qkv[(b * T + t) * C3 + h * HS + i]) * qkv[(b * T + t2) * C3 + C + h * HS + i];
          pre[t2] = s * scale;
          mx = std::max(mx, pre[t2]);
        }
        double sum = 0;
        for (int64_t t2 = 0; t2 <= t; ++t2) sum += std::exp(pre[t2] - mx);
        for (int64_t t2 = 0; t2 <= t; ++t2) {
          double p = std::exp(pre[t2] - mx) / sum;
          att[((b * NH + h) * T + t) * T + t2] = p;
          for (int64_t i = 0; i < HS; ++i)
            out[(b * T + t) * C + h * HS + i] += p * qkv[(b * T + t2) * C3 + 2 * C + h * HS + i];
        }
      }
}

TEST(Ops, Attention) {
  const int64_t B = 2, T = 5, C = 12, NH = 3;
  Vec qkv = randn(B * T * 3 * C, 71), out(B * T * C), pre(B * NH * T * T), att(B * NH * T * T);
  Vec R = randn(out.size(), 72);
  attention_forward(out.data(), pre.data(), att.data(), qkv.data(), B, T, C, NH);
  DVec rout, ratt;
  attention_ref(rout, ratt, qkv, B, T, C, NH);
  expect_close("attention_forward", "out", out, rout, {1e-6, 1e-5});
  expect_close("attention_forward", "att", att, ratt, {1e-7, 2e-6});

  Vec dqkv(qkv.size()), datt(att.size()), dpre(att.size());
  attention_backward(dqkv.data(), datt.data(), dpre.data(), R.data(), qkv.data(), att.data(), B, T, C, NH);
  Vec o2(out.size()), p2(pre.size()), a2(att.size());
  auto loss = [&] {
    attention_forward(o2.data(), p2.data(), a2.data(), qkv.data(), B, T, C, NH);
    return weighted_sum(o2.data(), R.data(), o2.size());
  };
  expect_grad("attention_backward", "qkv", loss, qkv.data(), dqkv.data(), dqkv.size(), 5e-3);

  // Scratch buffers filled with garbage must not matter (they are overwritten).
  Vec P = randn(dqkv.size(), 73), acc = P, junk1(att.size(), 1e30f), junk2(att.size(), kNaN);
  attention_backward(acc.data(), junk1.data(), junk2.data(), R.data(), qkv.data(), att.data(), B, T, C, NH);
  expect_accumulates("attention_backward", "qkv", P, dqkv, acc);
}

// ===================================================================================================
// embeddings
// ===================================================================================================

TEST(Ops, Embedding) {
  const int64_t B = 2, T = 5, C = 6, V = 7;
  IVec tok = {3, 1, 3, 3, 0, 6, 1, 1, 2, 3};  // duplicates; tokens 4 and 5 unused
  Vec wte = randn(V * C, 81), wpe = randn(T * C, 82), out(B * T * C), R = randn(out.size(), 83);
  embedding_forward(out.data(), tok.data(), wte.data(), wpe.data(), B, T, C);
  DVec ref(out.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < C; ++c)
        ref[(b * T + t) * C + c] = static_cast<double>(wte[tok[b * T + t] * C + c]) + wpe[t * C + c];
  expect_close("embedding_forward", "out", out, ref, {0, 6e-8});

  Vec dwte(wte.size()), dwpe(wpe.size());
  embedding_backward(dwte.data(), dwpe.data(), R.data(), tok.data(), B, T, C);
  auto loss = [&] {
    embedding_forward(out.data(), tok.data(), wte.data(), wpe.data(), B, T, C);
    return weighted_sum(out.data(), R.data(), out.size());
  };
  expect_grad("embedding_backward", "wte", loss, wte.data(), dwte.data(), dwte.size(), 1e-3);
  expect_grad("embedding_backward", "wpe", loss, wpe.data(), dwpe.data(), dwpe.size(), 1e-3);

  Vec Pe = randn(dwte.size(), 84), Pp = randn(dwpe.size(), 85), ae = Pe, ap = Pp;
  embedding_backward(ae.data(), ap.data(), R.data(), tok.data(), B, T, C);
  expect_accumulates("embedding_backward", "wte", Pe, dwte, ae);
  expect_accumulates("embedding_backward", "wpe", Pp, dwpe, ap);

  Vec oe(dwte.size()), op(dwpe.size());
  embedding_backward(oe.data(), nullptr, R.data(), tok.data(), B, T, C);
  embedding_backward(nullptr, op.data(), R.data(), tok.data(), B, T, C);
  embedding_backward(nullptr, nullptr, R.data(), tok.data(), B, T, C);
  expect_same("embedding_backward", "dwte", oe, dwte);
  expect_same("embedding_backward", "dwpe", op, dwpe);
}

// ===================================================================================================
// cross-entropy
// ===================================================================================================

double ce_ref(const Vec& logits, const IVec& tgt, int64_t N, int64_t V, DVec* probs = nullptr) {
  double total = 0;
  if (probs) probs->assign(N * V, 0);
  for (int64_t n = 0; n < N; ++n) {
    double mx = -INFINITY, s = 0;
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, static_cast<double>(logits[n * V + v]));
    for (int64_t v = 0; v < V; ++v) s += std::exp(logits[n * V + v] - mx);
    double lse = mx + std::log(s);
    total += lse - logits[n * V + tgt[n]];  // -log softmax[target]
    if (probs)
      for (int64_t v = 0; v < V; ++v) (*probs)[n * V + v] = std::exp(logits[n * V + v] - lse);
  }
  return total / N;
}

TEST(Ops, CrossEntropy) {
  const int64_t N = 6, V = 11;
  Vec logits = randn(N * V, 91, 2.0f), probs(N * V);
  IVec tgt = {0, 10, 3, 3, 7, 5};
  double loss0 = cross_entropy_forward(probs.data(), logits.data(), tgt.data(), N, V);
  DVec rprobs;
  double rloss = ce_ref(logits, tgt, N, V, &rprobs);
  std::printf("[value] %-26s %-8s got=%.9f ref=%.9f abs_err=%.2e\n", "cross_entropy_forward", "loss", loss0, rloss,
              std::fabs(loss0 - rloss));
  EXPECT_NEAR(loss0, rloss, 1e-6 * std::max(1.0, std::fabs(rloss)));
  expect_close("cross_entropy_forward", "probs", probs, rprobs, {1e-8, 2e-6});

  Vec dl(N * V);
  cross_entropy_backward(dl.data(), probs.data(), tgt.data(), N, V, 1.0f);
  Vec scratch(N * V);
  auto loss = [&] { return cross_entropy_forward(scratch.data(), logits.data(), tgt.data(), N, V); };
  expect_grad("cross_entropy_backward", "logits", loss, logits.data(), dl.data(), dl.size(), 2e-3);

  // dloss scales linearly; accumulation.
  Vec d25(N * V);
  cross_entropy_backward(d25.data(), probs.data(), tgt.data(), N, V, 2.5f);
  DVec want(N * V);
  for (size_t i = 0; i < want.size(); ++i) want[i] = 2.5 * dl[i];
  expect_close("cross_entropy_backward", "dloss2.5", d25, want, {1e-7, 1e-6});
  Vec P = randn(dl.size(), 92), acc = P;
  cross_entropy_backward(acc.data(), probs.data(), tgt.data(), N, V, 1.0f);
  expect_accumulates("cross_entropy_backward", "logits", P, dl, acc);
}

TEST(Ops, CrossEntropyLargeLogitsMatchesDoubleLogSoftmax) {
  const int64_t N = 5, V = 9;
  Vec logits = randn(N * V, 93, 1e4f);
  IVec tgt = randint(N, V, 94);
  // Row 0: target is the smallest logit (probability underflows to 0 in float; loss ~ 2e4).
  for (int64_t v = 0; v < V; ++v) logits[v] = v == 4 ? -1e4f : (v == 2 ? 1e4f : 0.0f);
  tgt[0] = 4;
  // Row 1: all logits equal and huge (loss = log V).
  for (int64_t v = 0; v < V; ++v) logits[V + v] = 3e4f;
  Vec probs(N * V);
  double got = cross_entropy_forward(probs.data(), logits.data(), tgt.data(), N, V);
  double ref = ce_ref(logits, tgt, N, V);
  std::printf("[value] %-26s %-8s got=%.6f ref=%.6f rel_err=%.2e\n", "cross_entropy_forward", "loss@1e4", got, ref,
              std::fabs(got - ref) / std::fabs(ref));
  EXPECT_TRUE(std::isfinite(got));
  EXPECT_NEAR(got, ref, 1e-6 * std::fabs(ref));
  // Per row too, through N = 1 calls.
  for (int64_t n = 0; n < N; ++n) {
    Vec row(logits.begin() + n * V, logits.begin() + (n + 1) * V);
    IVec t1 = {tgt[n]};
    double g1 = cross_entropy_forward(probs.data(), row.data(), t1.data(), 1, V);
    double r1 = ce_ref(row, t1, 1, V);
    EXPECT_NEAR(g1, r1, 1e-6 * std::max(1.0, std::fabs(r1))) << "row " << n;
  }
  EXPECT_NEAR(cross_entropy_forward(probs.data(), logits.data() + V, tgt.data() + 1, 1, V), std::log(9.0), 1e-6);
}

// ===================================================================================================
// gather / scatter
// ===================================================================================================

TEST(Ops, GatherRows) {
  const int64_t N = 6, R = 9, C = 5;
  IVec index = {2, 0, 2, 5, 5, 5, 1, 2, 0};  // duplicates; rows 3, 4 unused
  Vec inp = randn(N * C, 101), out(R * C), Rm = randn(R * C, 102);
  gather_rows(out.data(), inp.data(), index.data(), R, C);
  DVec ref(R * C);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) ref[r * C + c] = inp[index[r] * C + c];
  expect_close("gather_rows", "out", out, ref, {0, 0});

  // Gradient of gather is scatter_add of dout back to the source rows.
  Vec dinp(N * C);
  scatter_add_rows(dinp.data(), Rm.data(), index.data(), nullptr, R, N, C);
  auto loss = [&] {
    gather_rows(out.data(), inp.data(), index.data(), R, C);
    return weighted_sum(out.data(), Rm.data(), out.size());
  };
  expect_grad("gather_rows(bwd=scatter)", "inp", loss, inp.data(), dinp.data(), dinp.size(), 1e-3);
  // scatter_add_rows accumulates.
  Vec P = randn(dinp.size(), 103), acc = P;
  scatter_add_rows(acc.data(), Rm.data(), index.data(), nullptr, R, N, C);
  expect_accumulates("scatter_add_rows", "out", P, dinp, acc);
}

TEST(Ops, ScatterAddRows) {
  const int64_t N = 6, R = 10, C = 7;
  IVec index = {4, 0, 4, 4, 1, 5, 0, 4, 2, 1};  // duplicates; row 3 unused
  Vec inp = randn(R * C, 111), scale = randn(R, 112), base = randn(N * C, 113), Rm = randn(N * C, 114);
  for (bool with_scale : {false, true}) {
    Vec out = base;
    scatter_add_rows(out.data(), inp.data(), index.data(), with_scale ? scale.data() : nullptr, R, N, C);
    DVec ref(base.begin(), base.end());
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) ref[index[r] * C + c] += (with_scale ? scale[r] : 1.0) * inp[r * C + c];
    expect_close(with_scale ? "scatter_add_rows(scale)" : "scatter_add_rows(null)", "out", out, ref, {1e-6, 1e-6});
  }
  // Backward of scatter: dinp[r] = scale[r] * dout[index[r]] (a gather), dscale[r] = dout[index[r]] . inp[r].
  Vec g(R * C), dinp(R * C), dscale(R);
  gather_rows(g.data(), Rm.data(), index.data(), R, C);
  for (int64_t r = 0; r < R; ++r) {
    double s = 0;
    for (int64_t c = 0; c < C; ++c) dinp[r * C + c] = scale[r] * g[r * C + c], s += double(g[r * C + c]) * inp[r * C + c];
    dscale[r] = static_cast<float>(s);
  }
  Vec out(N * C);
  auto loss = [&] {
    out = base;
    scatter_add_rows(out.data(), inp.data(), index.data(), scale.data(), R, N, C);
    return weighted_sum(out.data(), Rm.data(), out.size());
  };
  expect_grad("scatter_add_rows(bwd=gather)", "inp", loss, inp.data(), dinp.data(), dinp.size(), 1e-3);
  expect_grad("scatter_add_rows(bwd=gather)", "scale", loss, scale.data(), dscale.data(), dscale.size(), 1e-3);
}

// Scatters and the other row reductions are bit-identical for any thread count (the contract of
// scatter_add_rows; ops.cpp says the same of every column-block reduction).
TEST(Ops, DeterministicAcrossThreadCounts) {
  const int64_t N = 13, R = 301, C = 100;  // 7 column blocks of 16, the last one partial
  IVec index = randint(R, N, 121);
  for (int64_t r = 0; r < R; r += 3) index[r] = 5;  // a hot row: ~100 duplicates
  Vec inp = randn(R * C, 122), scale = randn(R, 123), base = randn(N * C, 124);
  std::vector<Vec> results;
  for (int threads : {1, 2, 4}) {
    with_threads(threads, [&] {
      Vec a = base, b = base;
      scatter_add_rows(a.data(), inp.data(), index.data(), scale.data(), R, N, C);
      scatter_add_rows(b.data(), inp.data(), index.data(), nullptr, R, N, C);
      a.insert(a.end(), b.begin(), b.end());
      results.push_back(std::move(a));
    });
  }
  EXPECT_TRUE(bits_equal(results[0], results[1])) << "scatter_add_rows: 1 vs 2 threads differ";
  EXPECT_TRUE(bits_equal(results[0], results[2])) << "scatter_add_rows: 1 vs 4 threads differ";
  // Rows sharing an index are summed in increasing r: compare with that order in double.
  DVec ref(base.begin(), base.end());
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) ref[index[r] * C + c] += static_cast<double>(scale[r]) * inp[r * C + c];
  expect_close("scatter_add_rows(1-2-4 thr)", "out", results[0].data(), ref.data(), ref.size(), {1e-5, 1e-5});
  // Bit-exact against the documented order, out[index[r]] += scale[r] * inp[r] for r = 0, 1, ...
  // in float; the kernel may or may not fuse the multiply-add, so both forms are accepted.
  {
    Vec fused = base, split = base;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) {
        float& f = fused[index[r] * C + c];
        f = std::fma(scale[r], inp[r * C + c], f);
        volatile float prod = scale[r] * inp[r * C + c];
        split[index[r] * C + c] += prod;
      }
    Vec got(results[0].begin(), results[0].begin() + N * C);
    bool exact = bits_equal(got, fused) || bits_equal(got, split);
    std::printf("[determ] scatter_add_rows      increasing-r order bit-exact (fma or not): %s\n", exact ? "yes" : "NO");
    EXPECT_TRUE(exact) << "scatter_add_rows: rows sharing an index are not summed in increasing r";
  }
  std::printf("[determ] scatter_add_rows      1/2/4 threads bit-identical: %s\n",
              bits_equal(results[0], results[1]) && bits_equal(results[0], results[2]) ? "yes" : "NO");

  // embedding_backward (duplicate tokens) and the norms' parameter gradients.
  const int64_t B = 3, T = 17, E = 40, V = 5;
  IVec tok = randint(B * T, V, 125);
  Vec dout = randn(B * T * E, 126), x = randn(B * T * E, 127), w = randn(E, 128);
  std::vector<Vec> emb, ln;
  for (int threads : {1, 2, 4}) {
    with_threads(threads, [&] {
      Vec dwte(V * E), dwpe(T * E);
      embedding_backward(dwte.data(), dwpe.data(), dout.data(), tok.data(), B, T, E);
      dwte.insert(dwte.end(), dwpe.begin(), dwpe.end());
      emb.push_back(std::move(dwte));
      Vec o(B * T * E), mean(B * T), rstd(B * T), dw(E), db(E), dw2(E);
      layernorm_forward(o.data(), mean.data(), rstd.data(), x.data(), w.data(), w.data(), B * T, E, 1e-5f);
      layernorm_backward(nullptr, dw.data(), db.data(), dout.data(), x.data(), w.data(), mean.data(), rstd.data(),
                         B * T, E);
      rmsnorm_forward(o.data(), rstd.data(), x.data(), w.data(), B * T, E, 1e-5f);
      rmsnorm_backward(nullptr, dw2.data(), dout.data(), x.data(), w.data(), rstd.data(), B * T, E);
      dw.insert(dw.end(), db.begin(), db.end());
      dw.insert(dw.end(), dw2.begin(), dw2.end());
      ln.push_back(std::move(dw));
    });
  }
  EXPECT_TRUE(bits_equal(emb[0], emb[1]) && bits_equal(emb[0], emb[2])) << "embedding_backward differs by threads";
  EXPECT_TRUE(bits_equal(ln[0], ln[1]) && bits_equal(ln[0], ln[2])) << "norm dweight/dbias differ by threads";
}

// ===================================================================================================
// optimizer
// ===================================================================================================

TEST(Ops, AdamwClosedForm) {
  const int64_t n = 37;
  const float lr = 1e-2f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
  for (float wd : {0.0f, 0.1f}) {
    Vec p = randn(n, 131), m(n, 0.0f), v(n, 0.0f);
    DVec rp(p.begin(), p.end()), rm(n, 0), rv(n, 0);
    for (int64_t t = 1; t <= 3; ++t) {
      Vec g = randn(n, 131 + t, t == 2 ? 1e-3f : 1.0f);  // step 2: small grads (eps and history matter)
      adamw_update(p.data(), g.data(), m.data(), v.data(), n, lr, b1, b2, eps, wd, t);
      const double bc1 = 1.0 - std::pow(double(b1), double(t)), bc2 = 1.0 - std::pow(double(b2), double(t));
      for (int64_t i = 0; i < n; ++i) {
        rm[i] = b1 * rm[i] + (1.0 - b1) * g[i];
        rv[i] = b2 * rv[i] + (1.0 - b2) * double(g[i]) * g[i];
        double mhat = rm[i] / bc1, vhat = rv[i] / bc2;
        rp[i] = rp[i] * (1.0 - double(lr) * wd) - lr * mhat / (std::sqrt(vhat) + eps);
      }
      std::string what = "step" + std::to_string(t) + (wd > 0 ? " wd" : "");
      // m sums terms of ~0.1 |g| that can cancel to ~1e-3: a few float ulps of the terms (~3e-8)
      // absolute; the debug build (no FMA contraction) rounds each product apart and needs it.
      expect_close("adamw_update", what + " m", m, rm, {3e-8, 2e-6});
      expect_close("adamw_update", what + " v", v, rv, {1e-12, 2e-6});
      expect_close("adamw_update", what + " p", p, rp, {2e-7, 2e-6});
    }
  }
  // Zero gradients: only the decoupled decay acts, p * (1 - lr wd)^3.
  Vec p = randn(n, 140), p0 = p, g(n, 0.0f), m(n, 0.0f), v(n, 0.0f);
  for (int64_t t = 1; t <= 3; ++t) adamw_update(p.data(), g.data(), m.data(), v.data(), n, 0.1f, b1, b2, eps, 0.5f, t);
  DVec ref(n);
  for (int64_t i = 0; i < n; ++i) ref[i] = p0[i] * std::pow(1.0 - 0.1 * 0.5, 3);
  expect_close("adamw_update", "decay^3", p, ref, {0, 1e-6});
  // Step 1 with g != 0: bias correction makes the step exactly lr * sign(g) (for |g| >> eps).
  Vec q(n, 0.0f), gq = randn(n, 141);
  Vec mq(n, 0.0f), vq(n, 0.0f);
  adamw_update(q.data(), gq.data(), mq.data(), vq.data(), n, lr, b1, b2, eps, 0.0f, 1);
  DVec rq(n);
  for (int64_t i = 0; i < n; ++i) rq[i] = -lr * gq[i] / (std::fabs(double(gq[i])) + eps);
  expect_close("adamw_update", "step1=-lr*sgn", q, rq, {0, 2e-6});
}

// ===================================================================================================
// NaN / Inf: every output and gradient finite on extreme inputs (kept apart from the tolerances)
// ===================================================================================================

TEST(OpsFinite, ExtremeInputs) {
  int checks = 0;
  auto finite = [&](const char* op, const Vec& x) {
    ++checks;
    EXPECT_TRUE(all_finite(x.data(), x.size())) << op << ": non-finite value";
  };
  // Elementwise at +-1e4, +-88, +-100 and tiny values.
  Vec xs = {0.0f, 1e-30f, -1e-30f, 1e-45f, 88.0f, -88.0f, 100.0f, -100.0f, 1e4f, -1e4f, 3e4f, -3e4f};
  const int64_t ne = xs.size();
  Vec out(ne), d(ne), d2(ne), ones(ne, 1.0f);
  gelu_forward(out.data(), xs.data(), ne);
  finite("gelu_forward", out);
  EXPECT_EQ(out[8], 1e4f);
  EXPECT_EQ(out[9], 0.0f);
  gelu_backward(d.data(), ones.data(), xs.data(), ne);
  finite("gelu_backward", d);
  Vec di = ones;
  gelu_backward_inplace(di.data(), xs.data(), ne);
  finite("gelu_backward_inplace", di);
  swiglu_forward(out.data(), xs.data(), xs.data(), ne);
  finite("swiglu_forward", out);
  std::fill(d.begin(), d.end(), 0.0f);
  swiglu_backward(d.data(), d2.data(), ones.data(), xs.data(), ones.data(), ne);
  finite("swiglu_backward dgate", d);
  finite("swiglu_backward dup", d2);

  // Softmax and cross-entropy on logits of 1e4 and 1e30 (and rows mixing +-).
  const int64_t N = 4, D = 8;
  Vec logits = randn(N * D, 151, 1e4f);
  for (int64_t v = 0; v < D; ++v) logits[2 * D + v] = v % 2 ? 1e30f : -1e30f, logits[3 * D + v] = 1e4f;
  Vec sm(N * D), dsm(N * D), dout = randn(N * D, 152);
  softmax_forward(sm.data(), logits.data(), N, D);
  finite("softmax_forward(1e4)", sm);
  for (int64_t n = 0; n < N; ++n) {
    double s = 0;
    for (int64_t v = 0; v < D; ++v) s += sm[n * D + v];
    EXPECT_NEAR(s, 1.0, 1e-5) << "softmax row " << n;
  }
  softmax_backward(dsm.data(), dout.data(), sm.data(), N, D);
  finite("softmax_backward(1e4)", dsm);
  IVec tgt = {1, 7, 0, 3};
  Vec probs(N * D), dl(N * D);
  double ce = cross_entropy_forward(probs.data(), logits.data(), tgt.data(), N, D);
  EXPECT_TRUE(std::isfinite(ce)) << "cross_entropy_forward(1e4/1e30) = " << ce;
  finite("cross_entropy_forward probs", probs);
  cross_entropy_backward(dl.data(), probs.data(), tgt.data(), N, D, 1.0f);
  finite("cross_entropy_backward", dl);

  // Attention with large q/k (pre-softmax scores ~1e4..1e6): every att row finite, a distribution,
  // masked entries zero; out and dqkv finite.
  const int64_t B = 2, T = 6, C = 8, NH = 2;
  for (float sc : {100.0f, 1e3f}) {
    Vec qkv = randn(B * T * 3 * C, 153, sc), o(B * T * C), pre(B * NH * T * T), att(B * NH * T * T);
    attention_forward(o.data(), pre.data(), att.data(), qkv.data(), B, T, C, NH);
    finite("attention_forward out", o);
    finite("attention_forward att", att);
    for (int64_t row = 0; row < B * NH * T; ++row) {
      int64_t t = row % T;
      double s = 0;
      for (int64_t t2 = 0; t2 < T; ++t2) {
        float a = att[row * T + t2];
        if (t2 > t) {
          EXPECT_EQ(a, 0.0f) << "attention: future position " << t2 << " of row " << row;
        }
        EXPECT_GE(a, 0.0f);
        s += a;
      }
      EXPECT_NEAR(s, 1.0, 1e-5) << "attention row " << row;
    }
    Vec dq(qkv.size()), datt(att.size()), dpre(att.size()), dy = randn(o.size(), 154);
    attention_backward(dq.data(), datt.data(), dpre.data(), dy.data(), qkv.data(), att.data(), B, T, C, NH);
    finite("attention_backward dqkv", dq);
  }

  // Norms on a constant row (variance 0), a zero row, and a row of 1e4 / 1e20 magnitudes.
  const int64_t Cn = 16;
  Vec xn(4 * Cn), w(Cn, 1.0f), b(Cn, 0.0f), on(4 * Cn), mean(4), rstd(4), dn = randn(4 * Cn, 155);
  for (int64_t c = 0; c < Cn; ++c)
    xn[c] = 3.0f, xn[Cn + c] = 0.0f, xn[2 * Cn + c] = (c % 3 - 1) * 1e4f, xn[3 * Cn + c] = (c % 2 ? 1e20f : -5e19f);
  layernorm_forward(on.data(), mean.data(), rstd.data(), xn.data(), w.data(), b.data(), 4, Cn, 1e-5f);
  finite("layernorm_forward", on);
  Vec dxn(4 * Cn), dwn(Cn), dbn(Cn);
  layernorm_backward(dxn.data(), dwn.data(), dbn.data(), dn.data(), xn.data(), w.data(), mean.data(), rstd.data(), 4,
                     Cn);
  finite("layernorm_backward dinp", dxn);
  finite("layernorm_backward dweight", dwn);
  rmsnorm_forward(on.data(), rstd.data(), xn.data(), w.data(), 4, Cn, 1e-5f);
  finite("rmsnorm_forward", on);
  std::fill(dxn.begin(), dxn.end(), 0.0f), std::fill(dwn.begin(), dwn.end(), 0.0f);
  rmsnorm_backward(dxn.data(), dwn.data(), dn.data(), xn.data(), w.data(), rstd.data(), 4, Cn);
  finite("rmsnorm_backward dinp", dxn);
  finite("rmsnorm_backward dweight", dwn);

  // Adam with huge and zero gradients.
  Vec p(ne, 1.0f), m(ne, 0.0f), v(ne, 0.0f), g = xs;
  for (int64_t t = 1; t <= 3; ++t) adamw_update(p.data(), g.data(), m.data(), v.data(), ne, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.1f, t);
  finite("adamw_update", p);
  std::printf("[finite] %d outputs/gradients finite on extreme inputs\n", checks);
}

}  // namespace
}  // namespace moe

// The compiler keeps constant vectors whose upper half is zero (GCC 12.2 with AVX-512 turned each of
// these into a broadcast of its first element; CMakeLists.txt works around it).
TEST(Build, CompilerKeepsConstantVectors) {
  const std::vector<int64_t> i64{7, 7, 0, 0};
  EXPECT_EQ(i64[2], 0);
  EXPECT_EQ(i64[3], 0);
  const std::vector<double> f64{0.5, 0.5, 0.0, 0.0};
  EXPECT_EQ(f64[3], 0.0);
  const std::vector<float> f32{0.5f, 0.5f, 0.5f, 0.5f, 0.0f, 0.0f, 0.0f, 0.0f};
  EXPECT_EQ(f32[7], 0.0f);
  const std::vector<int32_t> i32{1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0};
  EXPECT_EQ(i32[15], 0);
}

