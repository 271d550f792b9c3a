// GEMM through a tuned library, with the backend chosen by measurement.
//
// Why measure: Debian's OpenBLAS 0.3.21 does not recognise this machine's CPU and silently runs an
// SSE3 kernel (about 4.6x slower than its AVX-512 one), while oneDNN dispatches on the ISA it finds.
// On another machine the order may flip, so we time both once per process on an expert-FFN shape
// and keep the faster. MOE_GEMM=onednn|openblas overrides the choice (for benchmarks and tests).
#include <cblas.h>
#include <oneapi/dnnl/dnnl.h>

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

// Best-of-3 GFLOP/s of one backend on [M,K] x [K,N]^T, the expert w1 shape of the benchmark layer.
double measure(Backend b) {
  const int64_t M = 512, N = 1024, K = 512;
  std::vector<float> A(M * K, 0.01f), B(N * K, 0.02f), C(M * N);
  run(b, false, true, M, N, K, 1.0f, A.data(), K, B.data(), K, 0.0f, C.data(), N);  // warm-up
  double best = 1e30;
  for (int i = 0; i < 3; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    run(b, false, true, M, N, K, 1.0f, A.data(), K, B.data(), K, 0.0f, C.data(), N);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return 2.0 * M * N * K / best * 1e-9;
}

struct Choice {
  Backend backend = Backend::onednn;
  std::string why;
};

// A backend pinned by pin_gemm_backend() (e.g. from a checkpoint) wins over measurement.
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
    double onednn = measure(Backend::onednn), openblas = measure(Backend::openblas);
    c.backend = onednn >= openblas ? Backend::onednn : Backend::openblas;
    char buf[160];
    std::snprintf(buf, sizeof buf, "%s (measured onednn %.1f vs openblas/%s %.1f GFLOP/s)",
                  c.backend == Backend::onednn ? "onednn" : "openblas", onednn, openblas_get_corename(), openblas);
    c.why = buf;
  });
  return c;
}

Backend parse(const std::string& name) {
  if (name == "onednn") return Backend::onednn;
  if (name == "openblas") return Backend::openblas;
  throw std::invalid_argument("gemm_with: unknown backend '" + name + "' (onednn or openblas)");
}

}  // namespace

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  run(choice().backend, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

std::string gemm_backend() { return choice().why; }

std::string gemm_backend_name() { return choice().backend == Backend::onednn ? "onednn" : "openblas"; }

void pin_gemm_backend(const std::string& name, const std::string& reason) {
  pinned().backend = parse(name);
  pinned().why = name + " (" + reason + ")";
  is_pinned() = true;
}

void gemm_with(const std::string& backend, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
               const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  run(parse(backend), trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

}  // namespace moe
