// Causal multi-head self-attention (ops.h), the way llm.c's first CUDA version does it: split the
// heads out of qkv, two cuBLAS strided-batched GEMMs around a causal softmax, merge the heads back.
// It materialises the [T,T] scores (as the CPU kernel does, so both save the same `att`); a fused
// flash-style kernel would avoid that memory and is the next step for long sequences.
//
// Layout: qkv [B,T,3,NH,HS] (q, k, v side by side per token); heads [B,NH,T,HS]; scores [B,NH,T,T].
#include <cublas_v2.h>

#include "cuda/kernel_util.cuh"

namespace moe::cuda {

using namespace detail;

namespace {

constexpr int kThreads = 256;
constexpr int kRowThreads = 128;

// dst[which][b,h,t,d] = qkv[b,t,which,h,d] for which in 0..parts-1 (parts 3: qkv; 1: a [B,T,C] tensor).
template <typename T>
__global__ void split_heads_kernel(T* dst, const T* src, int64_t B, int64_t T_, int64_t NH, int64_t HS, int parts) {
  const int64_t C = NH * HS, n = B * T_ * parts * C;
  MOE_GRID_LOOP(i, n) {
    const int64_t d = i % HS, h = (i / HS) % NH, which = (i / C) % parts, t = (i / (parts * C)) % T_,
                  b = i / (parts * C * T_);
    dst[which * B * T_ * C + ((b * NH + h) * T_ + t) * HS + d] = src[i];
  }
}

// dst[b,t,which,h,d] (+)= src[which][b,h,t,d].
template <typename T>
__global__ void merge_heads_kernel(T* dst, const T* src, int64_t B, int64_t T_, int64_t NH, int64_t HS, int parts,
                                   bool accumulate) {
  const int64_t C = NH * HS, n = B * T_ * parts * C;
  MOE_GRID_LOOP(i, n) {
    const int64_t d = i % HS, h = (i / HS) % NH, which = (i / C) % parts, t = (i / (parts * C)) % T_,
                  b = i / (parts * C * T_);
    const float v = load(src, which * B * T_ * C + ((b * NH + h) * T_ + t) * HS + d);
    store(dst, i, accumulate ? load(dst, i) + v : v);
  }
}

// One block per score row (b, h, t): att[s] = softmax over s <= t of preatt, 0 for s > t.
template <typename T>
__global__ void causal_softmax_kernel(T* att, const T* preatt, int64_t T_) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x, t = row % T_, base = row * T_;
  float mx = -INFINITY;
  for (int64_t s = threadIdx.x; s <= t; s += blockDim.x) mx = fmaxf(mx, load(preatt, base + s));
  mx = block_max(mx, shared);
  float sum = 0;
  for (int64_t s = threadIdx.x; s <= t; s += blockDim.x) sum += expf(load(preatt, base + s) - mx);
  const float inv = 1.0f / block_sum(sum, shared);
  for (int64_t s = threadIdx.x; s < T_; s += blockDim.x)
    store(att, base + s, s <= t ? expf(load(preatt, base + s) - mx) * inv : 0.0f);
}

// dpreatt[s] = att[s] (datt[s] - sum_s' att[s'] datt[s']) for s <= t, 0 beyond.
template <typename T>
__global__ void causal_softmax_backward_kernel(T* dpreatt, const T* datt, const T* att, int64_t T_) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x, t = row % T_, base = row * T_;
  float dot = 0;
  for (int64_t s = threadIdx.x; s <= t; s += blockDim.x) dot += load(att, base + s) * load(datt, base + s);
  dot = block_sum(dot, shared);
  for (int64_t s = threadIdx.x; s < T_; s += blockDim.x)
    store(dpreatt, base + s, s <= t ? load(att, base + s) * (load(datt, base + s) - dot) : 0.0f);
}

// Row-major batched C_i[M,N] = alpha op(A_i) op(B_i) + beta C_i (see gemm.cpp for the swap).
Status batched_gemm(Context& ctx, DType dt, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                    const void* A, int64_t lda, int64_t sa, const void* B, int64_t ldb, int64_t sb, float beta, void* C,
                    int64_t ldc, int64_t sc, int64_t batch, const char* what) {
  const cudaDataType_t t = dt == DType::f32 ? CUDA_R_32F : CUDA_R_16BF;
  const cublasComputeType_t ct =
      dt == DType::f32 && ctx.tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  const cublasStatus_t st = cublasGemmStridedBatchedEx(
      ctx.cublas(), tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(N),
      static_cast<int>(M), static_cast<int>(K), &alpha, B, t, static_cast<int>(ldb), sb, A, t, static_cast<int>(lda), sa,
      &beta, C, t, static_cast<int>(ldc), sc, static_cast<int>(batch), ct, CUBLAS_GEMM_DEFAULT);
  if (st == CUBLAS_STATUS_SUCCESS) return Status::ok();
  return Status::error(str_cat("cuda ", what, ": ", cublasGetStatusName(st), " (", cublasGetStatusString(st), ")"));
}

char* part(void* scratch, int64_t i, int64_t BTC, DType dt) {
  return static_cast<char*>(scratch) + i * BTC * static_cast<int64_t>(dtype_size(dt));
}

}  // namespace

Status attention_forward(Context& ctx, DType dt, void* out, void* preatt, void* att, void* scratch, const void* qkv,
                         int64_t B, int64_t T, int64_t C, int64_t NH) {
  if (NH < 1 || C % NH != 0) return Status::error(str_cat("cuda attention_forward: C (", C, ") % NH (", NH, ") != 0"));
  if (B * T == 0) return Status::ok();
  const int64_t HS = C / NH, BTC = B * T * C, BH = B * NH;
  const float scale = 1.0f / sqrtf(static_cast<float>(HS));
  void *q = part(scratch, 0, BTC, dt), *k = part(scratch, 1, BTC, dt), *v = part(scratch, 2, BTC, dt),
       *oh = part(scratch, 3, BTC, dt);
  return dispatch(dt, [&]<typename E>() -> Status {
    split_heads_kernel<E><<<blocks_for(3 * BTC, kThreads), kThreads, 0, ctx.stream()>>>(
        static_cast<E*>(q), static_cast<const E*>(qkv), B, T, NH, HS, 3);
    if (Status s = launched("attention_forward (split heads)"); !s) return s;
    // preatt[T,T] = scale q[T,HS] k[T,HS]^T per (b, h)
    if (Status s = batched_gemm(ctx, dt, false, true, T, T, HS, scale, q, HS, T * HS, k, HS, T * HS, 0.0f, preatt, T,
                                T * T, BH, "attention_forward (q k^T)");
        !s)
      return s;
    causal_softmax_kernel<E><<<static_cast<unsigned>(BH * T), kRowThreads, 0, ctx.stream()>>>(
        static_cast<E*>(att), static_cast<const E*>(preatt), T);
    if (Status s = launched("attention_forward (softmax)"); !s) return s;
    // out_h[T,HS] = att[T,T] v[T,HS]
    if (Status s = batched_gemm(ctx, dt, false, false, T, HS, T, 1.0f, att, T, T * T, v, HS, T * HS, 0.0f, oh, HS,
                                T * HS, BH, "attention_forward (att v)");
        !s)
      return s;
    merge_heads_kernel<E><<<blocks_for(BTC, kThreads), kThreads, 0, ctx.stream()>>>(
        static_cast<E*>(out), static_cast<const E*>(oh), B, T, NH, HS, 1, false);
    return launched("attention_forward (merge heads)");
  });
}

Status attention_backward(Context& ctx, DType dt, void* dqkv, void* datt, void* dpreatt, void* scratch, const void* dout,
                          const void* qkv, const void* att, int64_t B, int64_t T, int64_t C, int64_t NH) {
  if (NH < 1 || C % NH != 0) return Status::error(str_cat("cuda attention_backward: C (", C, ") % NH (", NH, ") != 0"));
  if (B * T == 0) return Status::ok();
  const int64_t HS = C / NH, BTC = B * T * C, BH = B * NH;
  const float scale = 1.0f / sqrtf(static_cast<float>(HS));
  // scratch: q k v | dout_h | dq dk dv (contiguous, so they merge into dqkv in one pass)
  void *q = part(scratch, 0, BTC, dt), *k = part(scratch, 1, BTC, dt), *v = part(scratch, 2, BTC, dt),
       *doh = part(scratch, 3, BTC, dt), *dq = part(scratch, 4, BTC, dt), *dk = part(scratch, 5, BTC, dt),
       *dv = part(scratch, 6, BTC, dt);
  return dispatch(dt, [&]<typename E>() -> Status {
    split_heads_kernel<E><<<blocks_for(3 * BTC, kThreads), kThreads, 0, ctx.stream()>>>(
        static_cast<E*>(q), static_cast<const E*>(qkv), B, T, NH, HS, 3);
    split_heads_kernel<E><<<blocks_for(BTC, kThreads), kThreads, 0, ctx.stream()>>>(
        static_cast<E*>(doh), static_cast<const E*>(dout), B, T, NH, HS, 1);
    if (Status s = launched("attention_backward (split heads)"); !s) return s;
    // datt = dout_h v^T;  dv = att^T dout_h
    if (Status s = batched_gemm(ctx, dt, false, true, T, T, HS, 1.0f, doh, HS, T * HS, v, HS, T * HS, 0.0f, datt, T,
                                T * T, BH, "attention_backward (datt)");
        !s)
      return s;
    if (Status s = batched_gemm(ctx, dt, true, false, T, HS, T, 1.0f, att, T, T * T, doh, HS, T * HS, 0.0f, dv, HS,
                                T * HS, BH, "attention_backward (dv)");
        !s)
      return s;
    causal_softmax_backward_kernel<E><<<static_cast<unsigned>(BH * T), kRowThreads, 0, ctx.stream()>>>(
        static_cast<E*>(dpreatt), static_cast<const E*>(datt), static_cast<const E*>(att), T);
    if (Status s = launched("attention_backward (softmax)"); !s) return s;
    // preatt = scale q k^T:  dq = scale dpreatt k;  dk = scale dpreatt^T q
    if (Status s = batched_gemm(ctx, dt, false, false, T, HS, T, scale, dpreatt, T, T * T, k, HS, T * HS, 0.0f, dq, HS,
                                T * HS, BH, "attention_backward (dq)");
        !s)
      return s;
    if (Status s = batched_gemm(ctx, dt, true, false, T, HS, T, scale, dpreatt, T, T * T, q, HS, T * HS, 0.0f, dk, HS,
                                T * HS, BH, "attention_backward (dk)");
        !s)
      return s;
    merge_heads_kernel<E><<<blocks_for(3 * BTC, kThreads), kThreads, 0, ctx.stream()>>>(
        static_cast<E*>(dqkv), static_cast<const E*>(dq), B, T, NH, HS, 3, true);
    return launched("attention_backward (merge heads)");
  });
}

}  // namespace moe::cuda
