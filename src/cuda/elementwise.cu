// Elementwise kernels (ops.h): casts, add/scale, GELU, SwiGLU, AdamW and the sum of squares of the
// gradient norm. Grid-stride loops of 256 threads; the formulas are the CPU kernels' (tensor/ops.cpp),
// evaluated in f32.
#include <algorithm>

#include "cuda/kernel_util.cuh"

namespace moe::cuda {

using namespace detail;

namespace {

constexpr int kThreads = 256;
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi), as tensor/ops.cpp

template <typename T>
__global__ void cast_from_f32_kernel(T* out, const float* inp, int64_t n) {
  MOE_GRID_LOOP(i, n) store(out, i, inp[i]);
}
template <typename T>
__global__ void cast_to_f32_kernel(float* out, const T* inp, int64_t n) {
  MOE_GRID_LOOP(i, n) out[i] = load(inp, i);
}
template <typename T>
__global__ void add_kernel(T* a, const T* b, int64_t n) {
  MOE_GRID_LOOP(i, n) store(a, i, load(a, i) + load(b, i));
}
template <typename T>
__global__ void scale_kernel(T* a, float s, int64_t n) {
  MOE_GRID_LOOP(i, n) store(a, i, load(a, i) * s);
}

__device__ __forceinline__ float gelu(float x) {
  return 0.5f * x * (1.0f + tanhf(kGeluScale * (x + 0.044715f * x * x * x)));
}
__device__ __forceinline__ float gelu_grad(float x) {
  const float th = tanhf(kGeluScale * (x + 0.044715f * x * x * x));
  return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
}
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

template <typename T>
__global__ void gelu_forward_kernel(T* out, const T* inp, int64_t n) {
  MOE_GRID_LOOP(i, n) store(out, i, gelu(load(inp, i)));
}
template <typename T>
__global__ void gelu_backward_kernel(T* dinp, const T* dout, const T* inp, int64_t n) {
  MOE_GRID_LOOP(i, n) store(dinp, i, load(dinp, i) + gelu_grad(load(inp, i)) * load(dout, i));
}
template <typename T>
__global__ void swiglu_forward_kernel(T* out, const T* gate, const T* up, int64_t n) {
  MOE_GRID_LOOP(i, n) {
    const float g = load(gate, i);
    store(out, i, g * sigmoid(g) * load(up, i));
  }
}
template <typename T>
__global__ void swiglu_backward_kernel(T* dgate, T* dup, const T* dout, const T* gate, const T* up, int64_t n) {
  MOE_GRID_LOOP(i, n) {
    const float g = load(gate, i), s = sigmoid(g), dy = load(dout, i);
    if (dgate) store(dgate, i, load(dgate, i) + dy * load(up, i) * s * (1.0f + g * (1.0f - s)));
    if (dup) store(dup, i, load(dup, i) + dy * g * s);
  }
}

template <typename T>
__global__ void adamw_kernel(float* param, T* param_out, const T* grad, float* m, float* v, int64_t n, float lr,
                             float beta1, float beta2, float eps, float decay, float bc1, float bc2) {
  MOE_GRID_LOOP(i, n) {
    const float g = load(grad, i);
    const float mi = beta1 * m[i] + (1.0f - beta1) * g;
    const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float p = param[i] * decay - lr * (mi / bc1) / (sqrtf(vi / bc2) + eps);
    param[i] = p;
    if (param_out) store(param_out, i, p);
  }
}

// *out = sum of x[i]^2 in double, in two passes, so that a large tensor spreads over the GPU (one
// block for all of it walked n / 256 elements per thread): pass 1, block b sums x[b*kSumChunk,
// (b+1)*kSumChunk) (each thread a fixed stride, then a fixed tree) into partial[b]; pass 2, one block
// sums the partials the same way. Deterministic.
constexpr int kSumThreads = 256;
constexpr int64_t kSumChunk = 1 << 16;

__device__ __forceinline__ double tree_sum(double s, double* lanes) {
  lanes[threadIdx.x] = s;
  __syncthreads();
  for (int half = kSumThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) lanes[threadIdx.x] += lanes[threadIdx.x + half];
    __syncthreads();
  }
  return lanes[0];
}

template <typename T>
__global__ void sum_squares_partial_kernel(double* partial, const T* x, int64_t n) {
  __shared__ double lanes[kSumThreads];
  const int64_t begin = blockIdx.x * kSumChunk, end = begin + kSumChunk < n ? begin + kSumChunk : n;
  double s = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kSumThreads) {
    const double v = load(x, i);
    s += v * v;
  }
  const double total = tree_sum(s, lanes);
  if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

__global__ void sum_partials_kernel(double* out, const double* partial, int64_t m) {
  __shared__ double lanes[kSumThreads];
  double s = 0;
  for (int64_t i = threadIdx.x; i < m; i += kSumThreads) s += partial[i];
  const double total = tree_sum(s, lanes);
  if (threadIdx.x == 0) *out = total;
}

}  // namespace

Status sum_squares(Context& ctx, DType dt, double* out, const void* x, int64_t n) {
  if (n < 0) return Status::error(str_cat("cuda sum_squares: REQUIRES n >= 0, got ", n));
  const int64_t blocks = std::max<int64_t>(1, (n + kSumChunk - 1) / kSumChunk);
  void* partial = nullptr;
  if (Status s = ctx.reduction_scratch(static_cast<size_t>(blocks) * sizeof(double), &partial); !s) return s;
  return dispatch(dt, [&]<typename T>() -> Status {
    sum_squares_partial_kernel<T><<<static_cast<unsigned>(blocks), kSumThreads, 0, ctx.stream()>>>(
        static_cast<double*>(partial), static_cast<const T*>(x), n);
    if (Status s = launched("sum_squares (partial sums)"); !s) return s;
    sum_partials_kernel<<<1, kSumThreads, 0, ctx.stream()>>>(out, static_cast<const double*>(partial), blocks);
    return launched("sum_squares");
  });
}

Status cast_f32_to(Context& ctx, DType dt, void* out, const float* inp, int64_t n) {
  return dispatch(dt, [&]<typename T>() {
    cast_from_f32_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, ctx.stream()>>>(static_cast<T*>(out), inp, n);
    return launched("cast_f32_to");
  });
}

Status cast_to_f32(Context& ctx, DType dt, float* out, const void* inp, int64_t n) {
  return dispatch(dt, [&]<typename T>() {
    cast_to_f32_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, ctx.stream()>>>(out, static_cast<const T*>(inp), n);
    return launched("cast_to_f32");
  });
}

Status fill_zero(Context& ctx, void* p, int64_t bytes) {
  if (bytes <= 0) return Status::ok();
  MOE_CUDA_TRY(cudaMemsetAsync(p, 0, static_cast<size_t>(bytes), ctx.stream()), "cuda fill_zero");
  return Status::ok();
}

Status add_inplace(Context& ctx, DType dt, void* a, const void* b, int64_t n) {
  return dispatch(dt, [&]<typename T>() {
    add_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, ctx.stream()>>>(static_cast<T*>(a), static_cast<const T*>(b), n);
    return launched("add_inplace");
  });
}

Status scale_inplace(Context& ctx, DType dt, void* a, float s, int64_t n) {
  return dispatch(dt, [&]<typename T>() {
    scale_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, ctx.stream()>>>(static_cast<T*>(a), s, n);
    return launched("scale_inplace");
  });
}

Status gelu_forward(Context& ctx, DType dt, void* out, const void* inp, int64_t n) {
  return dispatch(dt, [&]<typename T>() {
    gelu_forward_kernel<T>
        <<<blocks_for(n, kThreads), kThreads, 0, ctx.stream()>>>(static_cast<T*>(out), static_cast<const T*>(inp), n);
    return launched("gelu_forward");
  });
}

Status gelu_backward(Context& ctx, DType dt, void* dinp, const void* dout, const void* inp, int64_t n) {
  return dispatch(dt, [&]<typename T>() {
    gelu_backward_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, ctx.stream()>>>(
        static_cast<T*>(dinp), static_cast<const T*>(dout), static_cast<const T*>(inp), n);
    return launched("gelu_backward");
  });
}

Status swiglu_forward(Context& ctx, DType dt, void* out, const void* gate, const void* up, int64_t n) {
  return dispatch(dt, [&]<typename T>() {
    swiglu_forward_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, ctx.stream()>>>(
        static_cast<T*>(out), static_cast<const T*>(gate), static_cast<const T*>(up), n);
    return launched("swiglu_forward");
  });
}

Status swiglu_backward(Context& ctx, DType dt, void* dgate, void* dup, const void* dout, const void* gate,
                       const void* up, int64_t n) {
  return dispatch(dt, [&]<typename T>() {
    swiglu_backward_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, ctx.stream()>>>(
        static_cast<T*>(dgate), static_cast<T*>(dup), static_cast<const T*>(dout), static_cast<const T*>(gate),
        static_cast<const T*>(up), n);
    return launched("swiglu_backward");
  });
}

Status adamw_update(Context& ctx, DType dt, float* param, void* param_out, const void* grad, float* m, float* v,
                    int64_t n, float lr, float beta1, float beta2, float eps, float weight_decay, int64_t t) {
  if (t < 1) return Status::error("cuda adamw_update: REQUIRES step t >= 1");
  // Bias corrections on the host in double, rounded to f32: what the CPU kernel does.
  const float bc1 = 1.0f - static_cast<float>(std::pow(static_cast<double>(beta1), static_cast<double>(t)));
  const float bc2 = 1.0f - static_cast<float>(std::pow(static_cast<double>(beta2), static_cast<double>(t)));
  const float decay = 1.0f - lr * weight_decay;
  return dispatch(dt, [&]<typename T>() {
    adamw_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, ctx.stream()>>>(
        param, static_cast<T*>(param_out), static_cast<const T*>(grad), m, v, n, lr, beta1, beta2, eps, decay, bc1, bc2);
    return launched("adamw_update");
  });
}

}  // namespace moe::cuda
