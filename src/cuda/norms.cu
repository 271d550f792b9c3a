// LayerNorm and RMSNorm (ops.h). Row kernels: one block per row, block reductions in a fixed order.
// Parameter gradients: column sums in two fixed-order passes (norm_params_backward), deterministic
// without atomics; reads are coalesced across the 32 columns of a block row.
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

// Parameter gradients in two passes (ColumnChunks, kernel_util.cuh), so that N rows spread over the
// GPU (one thread per column walking every row used a few SMs for ~N serial steps): pass 1 into
// partial[chunk, c] (and partial2 for LayerNorm's bias), pass 2 adds the chunks in order into the
// gradient. Deterministic; the order differs from the CPU kernel's row by row sum, within the
// f32/bf16 tolerance (ops.h).

// RMS: only dw (partial2 null). LayerNorm: dw over (x - mean) rstd dy, db over dy.
template <typename T, bool kLayerNorm>
__global__ void norm_params_partial_kernel(float* partial, float* partial2, const T* dout, const T* inp,
                                           const float* mean, const float* rstd, int64_t N, int64_t C,
                                           int64_t rows) {
  __shared__ float lane_dw[kRowLanes][kColumnTile], lane_db[kRowLanes][kColumnTile];
  const int64_t c = blockIdx.x * (int64_t)kColumnTile + threadIdx.x;
  const int64_t n0 = blockIdx.y * rows, n1 = n0 + rows < N ? n0 + rows : N;
  float dw = 0, db = 0;
  if (c < C) {
    for (int64_t n = n0 + threadIdx.y; n < n1; n += kRowLanes) {
      const float dy = load(dout, n * C + c);
      const float x = kLayerNorm ? load(inp, n * C + c) - mean[n] : load(inp, n * C + c);
      dw += x * rstd[n] * dy;
      db += dy;
    }
  }
  lane_dw[threadIdx.y][threadIdx.x] = dw;
  lane_db[threadIdx.y][threadIdx.x] = db;
  __syncthreads();
  if (threadIdx.y != 0 || c >= C) return;
  float sw = 0, sb = 0;
  for (int y = 0; y < kRowLanes; ++y) sw += lane_dw[y][threadIdx.x], sb += lane_db[y][threadIdx.x];
  partial[blockIdx.y * C + c] = sw;
  if (partial2) partial2[blockIdx.y * C + c] = sb;
}

// grad[c] += sum over chunks k in order of partial[k, c] (grad null: skipped).
template <typename T>
__global__ void add_column_partials_kernel(T* grad, const float* partial, int64_t chunks, int64_t C) {
  MOE_GRID_LOOP(c, C) {
    float s = 0;
    for (int64_t k = 0; k < chunks; ++k) s += partial[k * C + c];
    store(grad, c, load(grad, c) + s);
  }
}

// Both passes; dbias only for LayerNorm (may be null, as may dweight).
template <typename T, bool kLayerNorm>
Status norm_params_backward(Context& ctx, T* dweight, T* dbias, const T* dout, const T* inp, const float* mean,
                            const float* rstd, int64_t N, int64_t C, const char* what) {
  if (C == 0) return Status::ok();
  const ColumnChunks chunks(N);
  void* scratch = nullptr;
  if (Status s = ctx.reduction_scratch(static_cast<size_t>(2 * chunks.count * C) * sizeof(float), &scratch); !s)
    return s;
  float* partial = static_cast<float*>(scratch);
  float* partial2 = kLayerNorm ? partial + chunks.count * C : nullptr;
  norm_params_partial_kernel<T, kLayerNorm><<<chunks.grid(C), ColumnChunks::block(), 0, ctx.stream()>>>(
      partial, partial2, dout, inp, mean, rstd, N, C, chunks.rows);
  if (Status s = launched(what); !s) return s;
  if (dweight) {
    add_column_partials_kernel<T><<<blocks_for(C, kColumnThreads), kColumnThreads, 0, ctx.stream()>>>(dweight, partial,
                                                                                                     chunks.count, C);
    if (Status s = launched(what); !s) return s;
  }
  if (dbias) {
    add_column_partials_kernel<T><<<blocks_for(C, kColumnThreads), kColumnThreads, 0, ctx.stream()>>>(dbias, partial2,
                                                                                                     chunks.count, C);
    if (Status s = launched(what); !s) return s;
  }
  return Status::ok();
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
      if (Status s = norm_params_backward<T, true>(ctx, static_cast<T*>(dweight), static_cast<T*>(dbias),
                                                   static_cast<const T*>(dout), static_cast<const T*>(inp), mean, rstd,
                                                   N, C, "layernorm_backward (parameters)");
          !s)
        return s;
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
      if (Status s = norm_params_backward<T, false>(ctx, static_cast<T*>(dweight), static_cast<T*>(nullptr),
                                                    static_cast<const T*>(dout), static_cast<const T*>(inp), nullptr,
                                                    rstd, N, C, "rmsnorm_backward (weight)");
          !s)
        return s;
    }
    return Status::ok();
  });
}

}  // namespace moe::cuda
