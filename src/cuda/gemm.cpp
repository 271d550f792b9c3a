// GEMMs through cuBLAS (ops.h): the dense GEMM, linear layers, and the MoE experts' grouped GEMM.
//
// Row-major to cuBLAS: cuBLAS is column-major, and a row-major [M,N] matrix is the column-major
// [N,M] matrix of its transpose. So row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T:
// the same call with the operands swapped and M, N swapped, transpose flags unchanged.
#include <cublas_v2.h>

#include <climits>
#include <vector>

#include "cuda/ops.h"
#include "util/str_cat.h"

namespace moe::cuda {

namespace {

// One row-major product C[M,N] = alpha op(A)[M,K] op(B)[K,N] + beta C.
struct RowMajorGemm {
  bool trans_a = false, trans_b = false;
  int64_t M = 0, N = 0, K = 0;
  const void* A = nullptr;
  int64_t lda = 0;
  const void* B = nullptr;
  int64_t ldb = 0;
  void* C = nullptr;
  int64_t ldc = 0;
};

cudaDataType_t cuda_type(DType dt) { return dt == DType::f32 ? CUDA_R_32F : CUDA_R_16BF; }

cublasComputeType_t compute_type(const Context& ctx, DType dt) {
  if (dt == DType::f32 && ctx.tf32()) return CUBLAS_COMPUTE_32F_FAST_TF32;
  return CUBLAS_COMPUTE_32F;  // bf16 inputs, f32 accumulation
}

cublasOperation_t op(bool trans) { return trans ? CUBLAS_OP_T : CUBLAS_OP_N; }

Status cublas_status(cublasStatus_t st, const std::string& what) {
  if (st == CUBLAS_STATUS_SUCCESS) return Status::ok();
  return Status::error(str_cat(what, ": ", cublasGetStatusName(st), " (", cublasGetStatusString(st), ")"));
}

bool fits_int(int64_t v) { return v >= 0 && v <= INT_MAX; }

Status check_dims(const char* what, const RowMajorGemm& g) {
  if (!fits_int(g.M) || !fits_int(g.N) || !fits_int(g.K) || !fits_int(g.lda) || !fits_int(g.ldb) || !fits_int(g.ldc))
    return Status::error(str_cat(what, ": dimensions out of cuBLAS's int range (M ", g.M, ", N ", g.N, ", K ", g.K, ")"));
  return Status::ok();
}

Status run_one(Context& ctx, DType dt, const RowMajorGemm& g, float alpha, float beta, const char* what) {
  if (g.M == 0 || g.N == 0) return Status::ok();
  if (Status s = check_dims(what, g); !s) return s;
  const cudaDataType_t t = cuda_type(dt);
  return cublas_status(
      cublasGemmEx(ctx.cublas(), op(g.trans_b), op(g.trans_a), static_cast<int>(g.N), static_cast<int>(g.M),
                   static_cast<int>(g.K), &alpha, g.B, t, static_cast<int>(g.ldb), g.A, t, static_cast<int>(g.lda), &beta,
                   g.C, t, static_cast<int>(g.ldc), compute_type(ctx, dt), CUBLAS_GEMM_DEFAULT),
      what);
}

const char* at(const void* base, int64_t elements, DType dt) {
  return static_cast<const char*>(base) + elements * static_cast<int64_t>(dtype_size(dt));
}
char* at(void* base, int64_t elements, DType dt) {
  return static_cast<char*>(base) + elements * static_cast<int64_t>(dtype_size(dt));
}

// Expert e's product of grouped_gemm (trans_w: W[e] is [Nout,Kin]) over its rows.
RowMajorGemm expert_product(DType dt, bool trans_w, void* Y, const void* X, const void* W, const int64_t* off,
                            int64_t e, int64_t Kin, int64_t Nout) {
  RowMajorGemm g;
  g.trans_a = false;
  g.trans_b = trans_w;
  g.M = off[e + 1] - off[e];
  g.N = Nout;
  g.K = Kin;
  g.A = at(X, off[e] * Kin, dt);
  g.lda = Kin;
  g.B = at(W, e * Nout * Kin, dt);
  g.ldb = trans_w ? Kin : Nout;
  g.C = at(Y, off[e] * Nout, dt);
  g.ldc = Nout;
  return g;
}

// Expert e's weight gradient dW[e][Nout,Kin] = dY_e^T X_e.
RowMajorGemm expert_weight_grad(DType dt, void* dW, const void* dY, const void* X, const int64_t* off, int64_t e,
                                int64_t Kin, int64_t Nout) {
  RowMajorGemm g;
  g.trans_a = true;
  g.trans_b = false;
  g.M = Nout;
  g.N = Kin;
  g.K = off[e + 1] - off[e];
  g.A = at(dY, off[e] * Nout, dt);
  g.lda = Nout;
  g.B = at(X, off[e] * Kin, dt);
  g.ldb = Kin;
  g.C = at(dW, e * Nout * Kin, dt);
  g.ldc = Kin;
  return g;
}

Status check_offsets(const char* what, const int64_t* off, int64_t E) {
  if (E < 0 || off == nullptr) return Status::error(str_cat(what, ": REQUIRES E >= 0 and host offsets"));
  for (int64_t e = 0; e < E; ++e)
    if (off[e + 1] < off[e] || off[e] < 0)
      return Status::error(str_cat(what, ": offsets must be non-decreasing from >= 0 (expert ", e, ")"));
  return Status::ok();
}

// The products as one cublasGemmGroupedBatchedEx call: one group per product (group size 1, since
// the row counts differ). Falls back to one call per product where cuBLAS does not support the
// type combination (it reports CUBLAS_STATUS_NOT_SUPPORTED).
int64_t grouped_fallbacks = 0;  // grouped_gemm_fallbacks()

Status run_grouped(Context& ctx, DType dt, const std::vector<RowMajorGemm>& gs, float alpha, float beta,
                   const char* what) {
  if (gs.empty()) return Status::ok();
  const size_t n = gs.size();
  std::vector<cublasOperation_t> ta(n), tb(n);
  std::vector<int> m(n), nn(n), k(n), lda(n), ldb(n), ldc(n), group_size(n, 1);
  std::vector<float> alphas(n, alpha), betas(n, beta);
  // Device pointer arrays: [first operands | second operands | outputs], staged through pageable
  // host memory (cudaMemcpyAsync returns once it has copied them out, so `ptrs` may go away).
  std::vector<const void*> ptrs(3 * n);
  for (size_t i = 0; i < n; ++i) {
    const RowMajorGemm& g = gs[i];
    if (Status s = check_dims(what, g); !s) return s;
    ta[i] = op(g.trans_b);
    tb[i] = op(g.trans_a);
    m[i] = static_cast<int>(g.N);
    nn[i] = static_cast<int>(g.M);
    k[i] = static_cast<int>(g.K);
    lda[i] = static_cast<int>(g.ldb);
    ldb[i] = static_cast<int>(g.lda);
    ldc[i] = static_cast<int>(g.ldc);
    ptrs[i] = g.B;
    ptrs[n + i] = g.A;
    ptrs[2 * n + i] = g.C;
  }
  void* dev = nullptr;
  if (Status s = ctx.pointer_scratch(ptrs.size() * sizeof(void*), &dev); !s) return s;
  MOE_CUDA_TRY(cudaMemcpyAsync(dev, ptrs.data(), ptrs.size() * sizeof(void*), cudaMemcpyHostToDevice, ctx.stream()),
               str_cat(what, ": staging pointers"));
  const void* const* first = static_cast<const void* const*>(dev);
  const void* const* second = first + n;
  void* const* out = const_cast<void* const*>(reinterpret_cast<const void* const*>(first + 2 * n));
  const cudaDataType_t t = cuda_type(dt);
  const cublasStatus_t st = cublasGemmGroupedBatchedEx(
      ctx.cublas(), ta.data(), tb.data(), m.data(), nn.data(), k.data(), alphas.data(), first, t, lda.data(), second, t,
      ldb.data(), betas.data(), out, t, ldc.data(), static_cast<int>(n), group_size.data(), compute_type(ctx, dt));
  if (st == CUBLAS_STATUS_NOT_SUPPORTED) {
    // Same products, one call per expert: counted, so that the tests and `moe bench cuda` can tell
    // the grouped call from this (grouped_gemm_fallbacks(), ops.h).
    ++grouped_fallbacks;
    for (const RowMajorGemm& g : gs)
      if (Status s = run_one(ctx, dt, g, alpha, beta, what); !s) return s;
    return Status::ok();
  }
  return cublas_status(st, what);
}

}  // namespace

Status gemm(Context& ctx, DType dt, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
            const void* A, int64_t lda, const void* B, int64_t ldb, float beta, void* C, int64_t ldc) {
  RowMajorGemm g{trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc};
  return run_one(ctx, dt, g, alpha, beta, "cuda gemm");
}

Status linear_forward(Context& ctx, DType dt, void* out, const void* inp, const void* weight, int64_t N, int64_t IC,
                      int64_t OC) {
  // out[N,OC] = inp[N,IC] weight[OC,IC]^T
  return gemm(ctx, dt, false, true, N, OC, IC, 1.0f, inp, IC, weight, IC, 0.0f, out, OC);
}

Status linear_backward(Context& ctx, DType dt, void* dinp, void* dweight, const void* dout, const void* inp,
                       const void* weight, int64_t N, int64_t IC, int64_t OC) {
  // dinp[N,IC] += dout[N,OC] weight[OC,IC];  dweight[OC,IC] += dout^T[OC,N] inp[N,IC]
  if (dinp)
    if (Status s = gemm(ctx, dt, false, false, N, IC, OC, 1.0f, dout, OC, weight, IC, 1.0f, dinp, IC); !s) return s;
  if (dweight)
    if (Status s = gemm(ctx, dt, true, false, OC, IC, N, 1.0f, dout, OC, inp, IC, 1.0f, dweight, IC); !s) return s;
  return Status::ok();
}

Status grouped_gemm(Context& ctx, DType dt, bool trans_w, void* Y, const void* X, const void* W, const int64_t* off,
                    int64_t E, int64_t Kin, int64_t Nout, float alpha, float beta) {
  if (Status s = check_offsets("cuda grouped_gemm", off, E); !s) return s;
  std::vector<RowMajorGemm> gs;
  for (int64_t e = 0; e < E; ++e)
    if (off[e + 1] > off[e]) gs.push_back(expert_product(dt, trans_w, Y, X, W, off, e, Kin, Nout));
  return run_grouped(ctx, dt, gs, alpha, beta, "cuda grouped_gemm");
}

Status grouped_gemm_weight_grad(Context& ctx, DType dt, void* dW, const void* dY, const void* X, const int64_t* off,
                                int64_t E, int64_t Kin, int64_t Nout, float alpha, float beta) {
  if (Status s = check_offsets("cuda grouped_gemm_weight_grad", off, E); !s) return s;
  std::vector<RowMajorGemm> gs;
  for (int64_t e = 0; e < E; ++e)
    if (off[e + 1] > off[e]) gs.push_back(expert_weight_grad(dt, dW, dY, X, off, e, Kin, Nout));
  // An expert with no rows keeps dW[e] = beta dW[e]: with beta = 1 (accumulate) that is nothing to do;
  // other betas would need a scale kernel, which no caller wants.
  if (beta != 1.0f && gs.size() != static_cast<size_t>(E))
    return Status::error("cuda grouped_gemm_weight_grad: beta != 1 with an expert that has no rows is not supported");
  return run_grouped(ctx, dt, gs, alpha, beta, "cuda grouped_gemm_weight_grad");
}

Status grouped_gemm_looped(Context& ctx, DType dt, bool trans_w, void* Y, const void* X, const void* W,
                           const int64_t* off, int64_t E, int64_t Kin, int64_t Nout, float alpha, float beta) {
  if (Status s = check_offsets("cuda grouped_gemm_looped", off, E); !s) return s;
  for (int64_t e = 0; e < E; ++e) {
    if (off[e + 1] == off[e]) continue;
    if (Status s = run_one(ctx, dt, expert_product(dt, trans_w, Y, X, W, off, e, Kin, Nout), alpha, beta,
                           "cuda grouped_gemm_looped");
        !s)
      return s;
  }
  return Status::ok();
}

int64_t grouped_gemm_fallbacks() { return grouped_fallbacks; }

}  // namespace moe::cuda
