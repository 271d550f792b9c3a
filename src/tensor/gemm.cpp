// GEMM through a tuned library, with the backend chosen by measurement.
//
// Why measure: Debian's OpenBLAS 0.3.21 does not recognise newer CPUs and silently runs an older
// kernel (SSE3 or Haswell's, 2-5x slower than the machine allows), while oneDNN dispatches on the ISA
// it finds. On another machine the order may flip, so both are timed, in interleaved rounds whose
// best rates are compared (a median once let a long disturbance pick the slower kernel for a whole
// run), and OpenBLAS is kept only when clearly faster. `moe train` decides on rank 0 and pins the choice
// on every rank (runtime/trainer.cpp); other programs decide lazily on first use.
// MOE_GEMM=onednn|openblas overrides the lazy choice (for benchmarks and tests).
#include <cblas.h>
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "tensor/ops.h"

namespace moe {
namespace {

enum class Backend { onednn, openblas };

void gemm_onednn(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                 const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  dnnl_status_t st = dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  if (st != dnnl_success) {
    // A failed GEMM means a shape/stride bug in the caller; continuing would train on garbage.
    std::fprintf(stderr, "moe: dnnl_sgemm failed (status %d) for M=%lld N=%lld K=%lld lda=%lld ldb=%lld ldc=%lld\n",
                 static_cast<int>(st), (long long)M, (long long)N, (long long)K, (long long)lda, (long long)ldb,
                 (long long)ldc);
    std::abort();
  }
}

void gemm_openblas(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                   const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, (blasint)M,
              (blasint)N, (blasint)K, alpha, A, (blasint)lda, B, (blasint)ldb, beta, C, (blasint)ldc);
}

void run(Backend b, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
         const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {  // C = beta * C; libraries differ on K == 0, so handle it here
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
    return;
  }
  if (b == Backend::onednn)
    gemm_onednn(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  else
    gemm_openblas(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

// Seconds one backend takes for the whole list of shapes, repeated until at least min_s has
// passed (small shapes take microseconds: one pass would time the clock).
double time_shapes(Backend b, const std::vector<GemmShape>& shapes, std::vector<float>& A, std::vector<float>& B,
                   std::vector<float>& C, double min_s) {
  int reps = 0;
  const auto t0 = std::chrono::steady_clock::now();
  double elapsed = 0;
  do {
    for (const GemmShape& g : shapes)
      run(b, g.trans_a, g.trans_b, g.M, g.N, g.K, 1.0f, A.data(), g.trans_a ? g.M : g.K, B.data(),
          g.trans_b ? g.K : g.N, 0.0f, C.data(), g.N);
    ++reps;
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } while (elapsed < min_s);
  return elapsed / reps;
}

Backend parse(const std::string& name) {
  if (name == "onednn") return Backend::onednn;
  if (name == "openblas") return Backend::openblas;
  throw std::invalid_argument("gemm_with: unknown backend '" + name + "' (onednn or openblas)");
}

struct Choice {
  Backend backend = Backend::onednn;
  std::string why;
};

// A backend pinned by pin_gemm_backend() (moe train's choice, a checkpoint's) wins over measurement.
Choice& pinned() {
  static Choice p;
  return p;
}
bool& is_pinned() {
  static bool b = false;
  return b;
}

const Choice& choice() {
  if (is_pinned()) return pinned();
  static Choice c;
  static std::once_flag once;
  std::call_once(once, [] {
    const char* env = std::getenv("MOE_GEMM");
    if (env && *env) {
      std::string e(env);
      if (e != "onednn" && e != "openblas") {
        std::fprintf(stderr, "moe: MOE_GEMM must be 'onednn' or 'openblas', got '%s'\n", env);
        std::exit(2);
      }
      c.backend = e == "onednn" ? Backend::onednn : Backend::openblas;
      c.why = e + " (forced by MOE_GEMM)";
      return;
    }
    // The expert w1 shape and its two backward partners at the benchmark layer's size.
    const std::vector<GemmShape> shapes{{false, true, 512, 1024, 512}, {false, false, 512, 512, 1024},
                                        {true, false, 1024, 512, 512}};
    const GemmRates rates = measure_gemm_backends(shapes, 5);
    const std::string name = pick_gemm_backend(rates);
    c.backend = parse(name);
    c.why = name + " (" + describe_gemm_rates(rates) + ")";
  });
  return c;
}


}  // namespace

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  run(choice().backend, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

std::string gemm_backend() { return choice().why; }

std::string gemm_backend_name() { return choice().backend == Backend::onednn ? "onednn" : "openblas"; }

namespace {
// Operands big enough for every shape of a measurement, and the FLOPs of one pass over the shapes.
struct ShapeOperands {
  std::vector<float> A, B, C;
  double flops = 0;
};
ShapeOperands operands_for(const char* who, const std::vector<GemmShape>& shapes, int rounds) {
  if (shapes.empty() || rounds < 1) throw std::invalid_argument(std::string(who) + ": no shapes or rounds < 1");
  size_t a = 0, b = 0, c = 0;
  ShapeOperands o;
  for (const GemmShape& g : shapes) {
    if (g.M < 1 || g.N < 1 || g.K < 1) throw std::invalid_argument(std::string(who) + ": empty shape");
    a = std::max(a, static_cast<size_t>(g.M * g.K));
    b = std::max(b, static_cast<size_t>(g.K * g.N));
    c = std::max(c, static_cast<size_t>(g.M * g.N));
    o.flops += 2.0 * g.M * g.N * g.K;
  }
  o.A.assign(a, 0.01f), o.B.assign(b, 0.02f), o.C.assign(c, 0.0f);
  return o;
}
}  // namespace

double measure_gemm_rate(const std::vector<GemmShape>& shapes, int rounds) {
  ShapeOperands o = operands_for("measure_gemm_rate", shapes, rounds);
  const Backend b = choice().backend;
  time_shapes(b, shapes, o.A, o.B, o.C, 0);  // warm-up, as below
  double best = 0;
  for (int r = 0; r < rounds; ++r) best = std::max(best, o.flops / time_shapes(b, shapes, o.A, o.B, o.C, 0.004) * 1e-9);
  return best;
}

GemmRates measure_gemm_backends(const std::vector<GemmShape>& shapes, int rounds) {
  ShapeOperands o = operands_for("measure_gemm_backends", shapes, rounds);
  std::vector<float>&A = o.A, &B = o.B, &C = o.C;
  const double flops = o.flops;
  // Warm-up: first-touch pages, each library's kernel selection and thread pool.
  time_shapes(Backend::onednn, shapes, A, B, C, 0);
  time_shapes(Backend::openblas, shapes, A, B, C, 0);
  std::vector<double> onednn, openblas;
  for (int r = 0; r < rounds; ++r) {
    // Alternate which backend goes first, so neither always meets the same moment of a busy machine.
    const bool onednn_first = r % 2 == 0;
    for (int i = 0; i < 2; ++i) {
      const bool is_onednn = (i == 0) == onednn_first;
      const double s = time_shapes(is_onednn ? Backend::onednn : Backend::openblas, shapes, A, B, C, 0.004);
      (is_onednn ? onednn : openblas).push_back(flops / s * 1e-9);
    }
  }
  return gemm_rates_from_rounds(onednn, openblas, openblas_kernel());
}

GemmRates gemm_rates_from_rounds(const std::vector<double>& onednn, const std::vector<double>& openblas,
                                 const std::string& openblas_core) {
  if (onednn.empty() || onednn.size() != openblas.size())
    throw std::invalid_argument("gemm_rates_from_rounds: REQUIRES two series of the same non-zero length");
  std::vector<double> ratio(onednn.size());
  for (size_t i = 0; i < ratio.size(); ++i) ratio[i] = openblas[i] / onednn[i];
  std::sort(ratio.begin(), ratio.end());
  const size_t n = ratio.size();
  const double median = n % 2 ? ratio[n / 2] : 0.5 * (ratio[n / 2 - 1] + ratio[n / 2]);
  return {*std::max_element(onednn.begin(), onednn.end()), *std::max_element(openblas.begin(), openblas.end()),
          median, static_cast<int>(n), openblas_core};
}

std::string openblas_core_for_isa(const std::string& detected, bool avx512, bool avx2_fma) {
  static const char* const kAvx2Cores[] = {"Haswell", "Zen", "Excavator", "SkylakeX", "Cooperlake", "SapphireRapids"};
  for (const char* c : kAvx2Cores)
    if (detected == c) return "";
  if (avx512) return "SkylakeX";
  if (avx2_fma) return "Haswell";
  return "";
}

std::string openblas_core_for_this_cpu(const std::string& detected) {
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512vl");
  const bool avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return openblas_core_for_isa(detected, avx512, avx2_fma);
}

std::string openblas_kernel() { return openblas_get_corename(); }

std::string pick_gemm_backend(const GemmRates& r) {
  const bool clearly_faster =
      r.openblas_gflops > (1.0 + kGemmSwitchMargin) * r.onednn_gflops && r.median_ratio > 1.0 + kGemmSwitchMargin;
  return clearly_faster ? "openblas" : "onednn";
}

std::string describe_gemm_rates(const GemmRates& r) {
  char buf[200];
  std::snprintf(buf, sizeof buf,
                "measured onednn %.1f vs openblas/%s %.1f GFLOP/s, best of %d interleaved rounds (median ratio %.2f)",
                r.onednn_gflops, r.openblas_core.c_str(), r.openblas_gflops, r.rounds, r.median_ratio);
  return buf;
}

void set_gemm_threads(int threads) { openblas_set_num_threads(std::max(1, threads)); }

void pin_gemm_backend(const std::string& name, const std::string& reason) {
  pinned().backend = parse(name);
  // OpenBLAS's kernel varies with the CPU and OPENBLAS_CORETYPE: say which one runs, and how long its
  // workers poll after a call (src/cli/main.cpp sets OPENBLAS_THREAD_TIMEOUT).
  std::string kernel = name;
  if (pinned().backend == Backend::openblas) {
    const char* timeout = std::getenv("OPENBLAS_THREAD_TIMEOUT");
    kernel.append("/").append(openblas_kernel()).append(", workers poll ");
    if (timeout) kernel.append("2^").append(timeout).append(" cycles");
    else kernel.append("OpenBLAS's default");
    kernel.append(" after a call");
  }
  pinned().why = kernel + " (" + reason + ")";
  is_pinned() = true;
}

void gemm_with(const std::string& backend, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
               const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  run(parse(backend), trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

}  // namespace moe
