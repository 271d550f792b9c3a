// GEMMs through cuBLAS (ops.h): the dense GEMM, linear layers, and the MoE experts' grouped GEMM.
//
// Row-major to cuBLAS: cuBLAS is column-major, and a row-major [M,N] matrix is the column-major
// [N,M] matrix of its transpose. So row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T:
// the same call with the operands swapped and M, N swapped, transpose flags unchanged.
#include <cublas_v2.h>

#include <algorithm>
#include <climits>
#include <cstring>
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

// On `handle` (ctx.cublas(), or a lane's); ctx gives the compute type.
Status run_one(Context& ctx, cublasHandle_t handle, DType dt, const RowMajorGemm& g, float alpha, float beta,
               const char* what) {
  if (g.M == 0 || g.N == 0) return Status::ok();
  if (Status s = check_dims(what, g); !s) return s;
  const cudaDataType_t t = cuda_type(dt);
  return cublas_status(
      cublasGemmEx(handle, op(g.trans_b), op(g.trans_a), static_cast<int>(g.N), static_cast<int>(g.M),
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

int64_t grouped_fallbacks = 0;  // grouped_gemm_fallbacks()

// Every product cut into chunks of `rows` rows, all run as one cublasGemmBatchedEx call on
// ctx.stream(): the full chunks in place; each product's last partial chunk as the full chunk ending
// at its last row where Context::grouped_gemm_chunk_overlap allows, else through a padded chunk
// in scratch (its rows gathered in, the GEMM over all `rows` rows, the real rows scattered back; the
// padding repeats the chunk's first row, so it is finite, and is dropped). Only for products whose
// rows are independent (grouped_gemm; not the weight gradients, which sum over the rows). X and Y are
// the products' common input [R,Kin] and output [R,Nout].
Status run_chunked(Context& ctx, DType dt, const std::vector<RowMajorGemm>& gs, int64_t rows, const void* X,
                   void* Y, int64_t Kin, int64_t Nout, float alpha, float beta, const char* what) {
  const int64_t esz = static_cast<int64_t>(dtype_size(dt));
  auto row_of = [&](const void* p, const void* base, int64_t width) {
    return static_cast<int32_t>((static_cast<const char*>(p) - static_cast<const char*>(base)) / (width * esz));
  };
  // Where the last partial chunk may instead be the full chunk ending at the product's last row
  // (Context::grouped_gemm_chunk_overlap): it rewrites rows of the chunk before it with the same bits.
  const bool overlap = beta == 0.0f && ctx.grouped_gemm_chunk_overlap();
  std::vector<RowMajorGemm> chunks, partial;
  for (const RowMajorGemm& g : gs) {
    const int64_t full = g.M / rows;
    for (int64_t c = 0; c <= full; ++c) {
      RowMajorGemm p = g;
      p.M = c < full ? rows : g.M % rows;
      if (p.M == 0) continue;
      const bool window = c == full && overlap && full > 0;
      const int64_t first_row = window ? g.M - rows : c * rows;
      if (window) p.M = rows;
      p.A = static_cast<const char*>(g.A) + first_row * g.lda * esz;
      p.C = static_cast<char*>(g.C) + first_row * g.ldc * esz;
      (c < full || window ? chunks : partial).push_back(p);
    }
  }
  // Device scratch: [padded X: partials x rows x Kin][padded Y: partials x rows x Nout]. The pointer
  // arrays and both row indices go over in one copy (each pageable copy costs a round trip).
  const int64_t P = static_cast<int64_t>(partial.size()), padded_rows = P * rows;
  const size_t x_bytes = (static_cast<size_t>(padded_rows * Kin * esz) + 255) / 256 * 256;
  void* scratch = nullptr;
  if (P > 0)
    if (Status s = ctx.chunk_scratch(x_bytes + static_cast<size_t>(padded_rows * Nout * esz), &scratch); !s) return s;
  char* x_pad = static_cast<char*>(scratch);
  char* y_pad = x_pad + x_bytes;
  std::vector<int32_t> gather(static_cast<size_t>(padded_rows)), scatter(static_cast<size_t>(padded_rows));
  for (int64_t i = 0; i < P; ++i) {
    const RowMajorGemm& p = partial[i];
    const int32_t r0 = row_of(p.A, X, Kin);
    for (int64_t j = 0; j < rows; ++j) {
      gather[i * rows + j] = j < p.M ? r0 + static_cast<int32_t>(j) : r0;
      scatter[i * rows + j] = j < p.M ? r0 + static_cast<int32_t>(j) : -1;  // the padding is dropped
    }
    RowMajorGemm padded = p;
    padded.M = rows;
    padded.A = x_pad + i * rows * Kin * esz;
    padded.C = y_pad + i * rows * Nout * esz;
    chunks.push_back(padded);
  }
  // Every chunk has the same shape, transposes and leading dimensions: they differ only in where
  // they point.
  const size_t n = chunks.size();
  std::vector<char> staged(3 * n * sizeof(void*) + 2 * gather.size() * 4);
  const void** ptrs = reinterpret_cast<const void**>(staged.data());
  for (size_t i = 0; i < n; ++i) ptrs[i] = chunks[i].B, ptrs[n + i] = chunks[i].A, ptrs[2 * n + i] = chunks[i].C;
  std::memcpy(staged.data() + 3 * n * sizeof(void*), gather.data(), gather.size() * 4);
  std::memcpy(staged.data() + 3 * n * sizeof(void*) + gather.size() * 4, scatter.data(), scatter.size() * 4);
  void* dev = nullptr;
  if (Status s = ctx.pointer_scratch(staged.size(), &dev); !s) return s;
  MOE_CUDA_TRY(cudaMemcpyAsync(dev, staged.data(), staged.size(), cudaMemcpyHostToDevice, ctx.stream()),
               str_cat(what, ": staging pointers"));
  const void* const* first = static_cast<const void* const*>(dev);
  const int32_t* gather_dev = reinterpret_cast<const int32_t*>(first + 3 * n);
  const int32_t* scatter_dev = gather_dev + padded_rows;
  if (P > 0) {
    if (Status s = gather_rows(ctx, dt, x_pad, X, gather_dev, padded_rows, Kin); !s) return s;
    if (beta != 0.0f)
      if (Status s = gather_rows(ctx, dt, y_pad, Y, gather_dev, padded_rows, Nout); !s) return s;
  }
  const RowMajorGemm& g = chunks.front();
  if (Status s = check_dims(what, g); !s) return s;
  const cudaDataType_t t = cuda_type(dt);
  if (Status s = cublas_status(
          cublasGemmBatchedEx(ctx.cublas(), op(g.trans_b), op(g.trans_a), static_cast<int>(g.N), static_cast<int>(g.M),
                              static_cast<int>(g.K), &alpha, first, t, static_cast<int>(g.ldb), first + n, t,
                              static_cast<int>(g.lda), &beta, const_cast<void* const*>(first + 2 * n), t,
                              static_cast<int>(g.ldc), static_cast<int>(n), compute_type(ctx, dt), CUBLAS_GEMM_DEFAULT),
          what);
      !s)
    return s;
  return scatter_rows(ctx, dt, Y, y_pad, scatter_dev, padded_rows, Nout);
}

// The products as one cublasGemmEx each, spread over n lanes (Context::lanes) that run at once: the
// largest first, each to the lane with the least work so far. The lanes start after what is queued
// on ctx.stream(), and ctx.stream() continues after all of them.
Status run_on_lanes(Context& ctx, DType dt, std::vector<RowMajorGemm> gs, int n, float alpha, float beta,
                    const char* what) {
  n = std::min<int>(n, static_cast<int>(gs.size()));
  Context::Lane* lanes = nullptr;
  if (Status s = ctx.lanes(n, &lanes); !s) return s;
  cudaEvent_t fork = nullptr;
  if (Status s = ctx.fork_event(&fork); !s) return s;
  for (int i = 0; i < n; ++i) MOE_CUDA_TRY(cudaStreamWaitEvent(lanes[i].stream, fork), str_cat(what, ": lane wait"));
  auto work = [](const RowMajorGemm& g) { return double(g.M) * double(g.N) * double(g.K); };
  std::stable_sort(gs.begin(), gs.end(), [&](const RowMajorGemm& a, const RowMajorGemm& b) { return work(a) > work(b); });
  std::vector<double> load(n, 0.0);
  for (const RowMajorGemm& g : gs) {
    const int i = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    load[i] += work(g);
    if (Status s = run_one(ctx, lanes[i].cublas, dt, g, alpha, beta, what); !s) return s;
  }
  for (int i = 0; i < n; ++i) {
    MOE_CUDA_TRY(cudaEventRecord(lanes[i].done, lanes[i].stream), str_cat(what, ": lane done"));
    MOE_CUDA_TRY(cudaStreamWaitEvent(ctx.stream(), lanes[i].done), str_cat(what, ": join"));
  }
  return Status::ok();
}

// The products on lanes (Context::grouped_gemm_lanes() > 0), or else as one cublasGemmGroupedBatchedEx
// call: one group per product (group size 1, since the row counts differ), falling back to one call
// per product where cuBLAS does not support the type combination (it reports CUBLAS_STATUS_NOT_SUPPORTED).
Status run_grouped(Context& ctx, DType dt, const std::vector<RowMajorGemm>& gs, float alpha, float beta,
                   const char* what) {
  if (gs.empty()) return Status::ok();
  if (ctx.grouped_gemm_lanes() > 0) return run_on_lanes(ctx, dt, gs, ctx.grouped_gemm_lanes(), alpha, beta, what);
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
      if (Status s = run_one(ctx, ctx.cublas(), dt, g, alpha, beta, what); !s) return s;
    return Status::ok();
  }
  return cublas_status(st, what);
}

}  // namespace

Status gemm(Context& ctx, DType dt, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
            const void* A, int64_t lda, const void* B, int64_t ldb, float beta, void* C, int64_t ldc) {
  RowMajorGemm g{trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc};
  return run_one(ctx, ctx.cublas(), dt, g, alpha, beta, "cuda gemm");
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
  if (!gs.empty() && ctx.grouped_gemm_chunk_rows() > 0)
    return run_chunked(ctx, dt, gs, ctx.grouped_gemm_chunk_rows(), X, Y, Kin, Nout, alpha, beta, "cuda grouped_gemm");
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
    if (Status s = run_one(ctx, ctx.cublas(), dt, expert_product(dt, trans_w, Y, X, W, off, e, Kin, Nout), alpha, beta,
                           "cuda grouped_gemm_looped");
        !s)
      return s;
  }
  return Status::ok();
}

int64_t grouped_gemm_fallbacks() { return grouped_fallbacks; }

}  // namespace moe::cuda
