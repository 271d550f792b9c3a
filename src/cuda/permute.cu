// The MoE layer's permute (dispatch: tokens to expert-contiguous rows) and un-permute (combine:
// rows back to tokens, scaled by their gate weights), ops.h. Un-permute runs one block per token
// over the token's K rows, so a token's sum has a fixed order and needs no atomics.
#include "cuda/kernel_util.cuh"

namespace moe::cuda {

using namespace detail;

namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void gather_rows_kernel(T* out, const T* inp, const int32_t* index, int64_t C) {
  const int64_t src = static_cast<int64_t>(index[blockIdx.x]) * C, dst = blockIdx.x * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) out[dst + c] = inp[src + c];
}

template <typename T>
__global__ void scatter_rows_kernel(T* out, const T* inp, const int32_t* index, int64_t C) {
  if (index[blockIdx.x] < 0) return;
  const int64_t dst = static_cast<int64_t>(index[blockIdx.x]) * C, src = blockIdx.x * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) out[dst + c] = inp[src + c];
}

template <typename T>
__global__ void combine_rows_kernel(T* y, const T* rows, const int32_t* token_rows, const float* weight, int64_t K,
                                    int64_t C, bool accumulate) {
  const int64_t n = blockIdx.x;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = accumulate ? load(y, n * C + c) : 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t r = token_rows[n * K + k];
      if (r >= 0) acc += weight[n * K + k] * load(rows, static_cast<int64_t>(r) * C + c);
    }
    store(y, n * C + c, acc);
  }
}

template <typename T>
__global__ void combine_rows_backward_kernel(T* drows, float* dweight, const T* dy, const T* rows,
                                             const int32_t* token_rows, const float* weight, int64_t K, int64_t C) {
  __shared__ float shared[32];
  const int64_t n = blockIdx.x;
  for (int64_t k = 0; k < K; ++k) {
    const int32_t r = token_rows[n * K + k];
    if (r < 0) continue;  // uniform over the block: every thread reads the same r
    const float w = weight[n * K + k];
    float dot = 0;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const float g = load(dy, n * C + c);
      store(drows, static_cast<int64_t>(r) * C + c, w * g);
      dot += g * load(rows, static_cast<int64_t>(r) * C + c);
    }
    if (dweight) {
      dot = block_sum(dot, shared);
      if (threadIdx.x == 0) dweight[n * K + k] += dot;
    }
  }
}

}  // namespace

Status gather_rows(Context& ctx, DType dt, void* out, const void* inp, const int32_t* index, int64_t R, int64_t C) {
  if (R == 0) return Status::ok();
  return dispatch(dt, [&]<typename T>() {
    gather_rows_kernel<T><<<static_cast<unsigned>(R), kThreads, 0, ctx.stream()>>>(
        static_cast<T*>(out), static_cast<const T*>(inp), index, C);
    return launched("gather_rows");
  });
}

Status scatter_rows(Context& ctx, DType dt, void* out, const void* inp, const int32_t* index, int64_t R, int64_t C) {
  if (R == 0) return Status::ok();
  return dispatch(dt, [&]<typename T>() {
    scatter_rows_kernel<T><<<static_cast<unsigned>(R), kThreads, 0, ctx.stream()>>>(
        static_cast<T*>(out), static_cast<const T*>(inp), index, C);
    return launched("scatter_rows");
  });
}

Status combine_rows(Context& ctx, DType dt, void* y, const void* rows, const int32_t* token_rows, const float* weight,
                    int64_t N, int64_t K, int64_t C, bool accumulate) {
  if (N == 0) return Status::ok();
  return dispatch(dt, [&]<typename T>() {
    combine_rows_kernel<T><<<static_cast<unsigned>(N), kThreads, 0, ctx.stream()>>>(
        static_cast<T*>(y), static_cast<const T*>(rows), token_rows, weight, K, C, accumulate);
    return launched("combine_rows");
  });
}

Status combine_rows_backward(Context& ctx, DType dt, void* drows, float* dweight, const void* dy, const void* rows,
                             const int32_t* token_rows, const float* weight, int64_t N, int64_t K, int64_t C) {
  if (N == 0) return Status::ok();
  return dispatch(dt, [&]<typename T>() {
    combine_rows_backward_kernel<T><<<static_cast<unsigned>(N), kThreads, 0, ctx.stream()>>>(
        static_cast<T*>(drows), dweight, static_cast<const T*>(dy), static_cast<const T*>(rows), token_rows, weight, K,
        C);
    return launched("combine_rows_backward");
  });
}

}  // namespace moe::cuda
