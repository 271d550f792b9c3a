// Router kernels (ops.h): softmax over experts and top-k. One block per row for softmax (block
// reductions, fixed order); one thread per row for top-k (D is the expert count: a sorted insertion
// into K registers beats a parallel selection at these sizes, and matches the CPU tie rule exactly).
#include "cuda/kernel_util.cuh"

namespace moe::cuda {

using namespace detail;

namespace {

constexpr int kRowThreads = 128;
constexpr int kMaxTopK = 16;

template <typename T>
__global__ void softmax_forward_kernel(T* out, const T* inp, int64_t D) {
  __shared__ float shared[32];
  const T* x = inp + blockIdx.x * D;
  T* y = out + blockIdx.x * D;
  float mx = -INFINITY;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) mx = fmaxf(mx, load(x, d));
  mx = block_max(mx, shared);
  float sum = 0;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) sum += expf(load(x, d) - mx);
  const float inv = 1.0f / block_sum(sum, shared);
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) store(y, d, expf(load(x, d) - mx) * inv);
}

template <typename T>
__global__ void softmax_backward_kernel(T* dinp, const T* dout, const T* out, int64_t D) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x * D;
  float dot = 0;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) dot += load(dout, row + d) * load(out, row + d);
  dot = block_sum(dot, shared);
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x)
    store(dinp, row + d, load(dinp, row + d) + load(out, row + d) * (load(dout, row + d) - dot));
}

template <typename T>
__global__ void topk_kernel(float* values, int32_t* indices, const T* inp, int64_t N, int64_t D, int K) {
  const int64_t n = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (n >= N) return;
  float v[kMaxTopK];
  int32_t idx[kMaxTopK];
  for (int k = 0; k < K; ++k) v[k] = -INFINITY, idx[k] = -1;
  const T* x = inp + n * D;
  for (int64_t d = 0; d < D; ++d) {
    const float val = load(x, d);
    int pos = K;
    // Strictly greater: an equal value stays behind the earlier (lower) index, as on the CPU.
    while (pos > 0 && (idx[pos - 1] < 0 || val > v[pos - 1])) --pos;
    if (pos == K) continue;
    for (int k = K - 1; k > pos; --k) v[k] = v[k - 1], idx[k] = idx[k - 1];
    v[pos] = val;
    idx[pos] = static_cast<int32_t>(d);
  }
  for (int k = 0; k < K; ++k) values[n * K + k] = v[k], indices[n * K + k] = idx[k];
}

}  // namespace

Status softmax_forward(Context& ctx, DType dt, void* out, const void* inp, int64_t N, int64_t D) {
  if (N == 0) return Status::ok();
  return dispatch(dt, [&]<typename T>() {
    softmax_forward_kernel<T><<<static_cast<unsigned>(N), kRowThreads, 0, ctx.stream()>>>(
        static_cast<T*>(out), static_cast<const T*>(inp), D);
    return launched("softmax_forward");
  });
}

Status softmax_backward(Context& ctx, DType dt, void* dinp, const void* dout, const void* out, int64_t N, int64_t D) {
  if (N == 0) return Status::ok();
  return dispatch(dt, [&]<typename T>() {
    softmax_backward_kernel<T><<<static_cast<unsigned>(N), kRowThreads, 0, ctx.stream()>>>(
        static_cast<T*>(dinp), static_cast<const T*>(dout), static_cast<const T*>(out), D);
    return launched("softmax_backward");
  });
}

Status topk_forward(Context& ctx, DType dt, float* values, int32_t* indices, const void* inp, int64_t N, int64_t D,
                    int64_t K) {
  if (K < 1 || K > kMaxTopK || K > D)
    return Status::error(str_cat("cuda topk_forward: REQUIRES 1 <= K <= min(", kMaxTopK, ", D); K ", K, ", D ", D));
  if (N == 0) return Status::ok();
  return dispatch(dt, [&]<typename T>() {
    topk_kernel<T><<<blocks_for(N, kRowThreads), kRowThreads, 0, ctx.stream()>>>(
        values, indices, static_cast<const T*>(inp), N, D, static_cast<int>(K));
    return launched("topk_forward");
  });
}

namespace {

__global__ void gate_weights_forward_kernel(float* weight, const float* values, int64_t N, int64_t K, bool renorm) {
  const int64_t n = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (n >= N) return;
  // The CPU's arithmetic (moe/router.cpp): one reciprocal, then products.
  float sum = 0;
  for (int64_t k = 0; k < K; ++k) sum += values[n * K + k];
  const float inv = 1.0f / sum;
  for (int64_t k = 0; k < K; ++k) weight[n * K + k] = renorm ? values[n * K + k] * inv : values[n * K + k];
}

// w_k = p_k / S, S = sum_j p_j:  dL/dp_k = (dw_k - sum_j dw_j w_j) / S.
template <typename T>
__global__ void gate_weights_backward_kernel(T* dprobs, const float* dweight, const float* values,
                                             const int32_t* indices, int64_t N, int64_t E, int64_t K, bool renorm) {
  const int64_t n = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (n >= N) return;
  for (int64_t e = 0; e < E; ++e) store(dprobs, n * E + e, 0.0f);
  float sum = 0, dot = 0;
  for (int64_t k = 0; k < K; ++k) sum += values[n * K + k];
  const float inv = 1.0f / sum;
  for (int64_t k = 0; k < K; ++k) dot += dweight[n * K + k] * values[n * K + k] * inv;
  for (int64_t k = 0; k < K; ++k) {
    const float d = renorm ? (dweight[n * K + k] - dot) * inv : dweight[n * K + k];
    store(dprobs, n * E + indices[n * K + k], d);
  }
}

}  // namespace

Status gate_weights_forward(Context& ctx, float* weight, const float* values, int64_t N, int64_t K, bool renormalize) {
  if (N == 0) return Status::ok();
  gate_weights_forward_kernel<<<blocks_for(N, kRowThreads), kRowThreads, 0, ctx.stream()>>>(
      weight, values, N, K, renormalize && K > 1);
  return launched("gate_weights_forward");
}

Status gate_weights_backward(Context& ctx, DType dt, void* dprobs, const float* dweight, const float* values,
                             const int32_t* indices, int64_t N, int64_t E, int64_t K, bool renormalize) {
  if (N == 0) return Status::ok();
  return dispatch(dt, [&]<typename T>() {
    gate_weights_backward_kernel<T><<<blocks_for(N, kRowThreads), kRowThreads, 0, ctx.stream()>>>(
        static_cast<T*>(dprobs), dweight, values, indices, N, E, K, renormalize && K > 1);
    return launched("gate_weights_backward");
  });
}

}  // namespace moe::cuda
