// LayerNorm and RMSNorm (ops.h). Row kernels: one block per row, block reductions in a fixed order.
// Parameter gradients: one thread per column walks the rows in order (the CPU kernel's order), so
// they are deterministic without atomics; reads are coalesced across the threads of a warp.
#include "cuda/kernel_util.cuh"

namespace moe::cuda {

using namespace detail;

namespace {

constexpr int kRowThreads = 256;
constexpr int kColumnThreads = 128;

template <typename T>
__global__ void layernorm_forward_kernel(T* out, float* mean, float* rstd, const T* inp, const T* weight,
                                         const T* bias, int64_t C, float eps) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x * C;
  float s = 0;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) s += load(inp, row + c);
  const float m = block_sum(s, shared) / C;
  float ss = 0;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float d = load(inp, row + c) - m;
    ss += d * d;
  }
  const float r = rsqrtf(block_sum(ss, shared) / C + eps);
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
    store(out, row + c, (load(inp, row + c) - m) * r * load(weight, c) + load(bias, c));
  if (threadIdx.x == 0) mean[blockIdx.x] = m, rstd[blockIdx.x] = r;
}

template <typename T>
__global__ void layernorm_backward_input_kernel(T* dinp, const T* dout, const T* inp, const T* weight,
                                                const float* mean, const float* rstd, int64_t C) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x * C;
  const float m = mean[blockIdx.x], s = rstd[blockIdx.x];
  float sum_dnorm = 0, sum_dnorm_norm = 0;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float norm = (load(inp, row + c) - m) * s;
    const float dnorm = load(weight, c) * load(dout, row + c);
    sum_dnorm += dnorm;
    sum_dnorm_norm += dnorm * norm;
  }
  const float a = block_sum(sum_dnorm, shared) / C;
  const float b = block_sum(sum_dnorm_norm, shared) / C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float norm = (load(inp, row + c) - m) * s;
    store(dinp, row + c, load(dinp, row + c) + (load(weight, c) * load(dout, row + c) - a - norm * b) * s);
  }
}

template <typename T>
__global__ void layernorm_backward_params_kernel(T* dweight, T* dbias, const T* dout, const T* inp,
                                                 const float* mean, const float* rstd, int64_t N, int64_t C) {
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= C) return;
  float dw = 0, db = 0;
  for (int64_t n = 0; n < N; ++n) {
    const float dy = load(dout, n * C + c);
    dw += (load(inp, n * C + c) - mean[n]) * rstd[n] * dy;
    db += dy;
  }
  if (dweight) store(dweight, c, load(dweight, c) + dw);
  if (dbias) store(dbias, c, load(dbias, c) + db);
}

template <typename T>
__global__ void rmsnorm_forward_kernel(T* out, float* rstd, const T* inp, const T* weight, int64_t C, float eps) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x * C;
  float ss = 0;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float x = load(inp, row + c);
    ss += x * x;
  }
  const float r = rsqrtf(block_sum(ss, shared) / C + eps);
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) store(out, row + c, load(inp, row + c) * r * load(weight, c));
  if (threadIdx.x == 0) rstd[blockIdx.x] = r;
}

template <typename T>
__global__ void rmsnorm_backward_input_kernel(T* dinp, const T* dout, const T* inp, const T* weight,
                                              const float* rstd, int64_t C) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x * C;
  const float s = rstd[blockIdx.x];
  // y = x s w, s = (mean(x^2) + eps)^-1/2:  dx = s w dy - x s^3 mean(x w dy)
  float dot = 0;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) dot += load(inp, row + c) * load(weight, c) * load(dout, row + c);
  const float k = block_sum(dot, shared) / C * s * s * s;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
    store(dinp, row + c, load(dinp, row + c) + s * load(weight, c) * load(dout, row + c) - load(inp, row + c) * k);
}

template <typename T>
__global__ void rmsnorm_backward_weight_kernel(T* dweight, const T* dout, const T* inp, const float* rstd, int64_t N,
                                               int64_t C) {
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= C) return;
  float dw = 0;
  for (int64_t n = 0; n < N; ++n) dw += load(inp, n * C + c) * rstd[n] * load(dout, n * C + c);
  store(dweight, c, load(dweight, c) + dw);
}

}  // namespace

Status layernorm_forward(Context& ctx, DType dt, void* out, float* mean, float* rstd, const void* inp,
                         const void* weight, const void* bias, int64_t N, int64_t C, float eps) {
  if (N == 0) return Status::ok();
  return dispatch(dt, [&]<typename T>() {
    layernorm_forward_kernel<T><<<static_cast<unsigned>(N), kRowThreads, 0, ctx.stream()>>>(
        static_cast<T*>(out), mean, rstd, static_cast<const T*>(inp), static_cast<const T*>(weight),
        static_cast<const T*>(bias), C, eps);
    return launched("layernorm_forward");
  });
}

Status layernorm_backward(Context& ctx, DType dt, void* dinp, void* dweight, void* dbias, const void* dout,
                          const void* inp, const void* weight, const float* mean, const float* rstd, int64_t N,
                          int64_t C) {
  if (N == 0) return Status::ok();
  return dispatch(dt, [&]<typename T>() {
    if (dinp) {
      layernorm_backward_input_kernel<T><<<static_cast<unsigned>(N), kRowThreads, 0, ctx.stream()>>>(
          static_cast<T*>(dinp), static_cast<const T*>(dout), static_cast<const T*>(inp), static_cast<const T*>(weight),
          mean, rstd, C);
      if (Status s = launched("layernorm_backward"); !s) return s;
    }
    if (dweight || dbias) {
      layernorm_backward_params_kernel<T><<<blocks_for(C, kColumnThreads), kColumnThreads, 0, ctx.stream()>>>(
          static_cast<T*>(dweight), static_cast<T*>(dbias), static_cast<const T*>(dout), static_cast<const T*>(inp),
          mean, rstd, N, C);
      if (Status s = launched("layernorm_backward (parameters)"); !s) return s;
    }
    return Status::ok();
  });
}

Status rmsnorm_forward(Context& ctx, DType dt, void* out, float* rstd, const void* inp, const void* weight, int64_t N,
                       int64_t C, float eps) {
  if (N == 0) return Status::ok();
  return dispatch(dt, [&]<typename T>() {
    rmsnorm_forward_kernel<T><<<static_cast<unsigned>(N), kRowThreads, 0, ctx.stream()>>>(
        static_cast<T*>(out), rstd, static_cast<const T*>(inp), static_cast<const T*>(weight), C, eps);
    return launched("rmsnorm_forward");
  });
}

Status rmsnorm_backward(Context& ctx, DType dt, void* dinp, void* dweight, const void* dout, const void* inp,
                        const void* weight, const float* rstd, int64_t N, int64_t C) {
  if (N == 0) return Status::ok();
  return dispatch(dt, [&]<typename T>() {
    if (dinp) {
      rmsnorm_backward_input_kernel<T><<<static_cast<unsigned>(N), kRowThreads, 0, ctx.stream()>>>(
          static_cast<T*>(dinp), static_cast<const T*>(dout), static_cast<const T*>(inp), static_cast<const T*>(weight),
          rstd, C);
      if (Status s = launched("rmsnorm_backward"); !s) return s;
    }
    if (dweight) {
      rmsnorm_backward_weight_kernel<T><<<blocks_for(C, kColumnThreads), kColumnThreads, 0, ctx.stream()>>>(
          static_cast<T*>(dweight), static_cast<const T*>(dout), static_cast<const T*>(inp), rstd, N, C);
      if (Status s = launched("rmsnorm_backward (weight)"); !s) return s;
    }
    return Status::ok();
  });
}

}  // namespace moe::cuda
