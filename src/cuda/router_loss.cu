// The router's extras (ops.h): a constant bias row on the logits, and the load-balancing (aux) and z
// losses' statistics and gradients, with the CPU's arithmetic (moe/router.cpp). Statistics run in a
// fixed order (one thread per row; column sums in two fixed-order passes), in double like the CPU:
// deterministic, no atomics.
#include "cuda/kernel_util.cuh"

namespace moe::cuda {

using namespace detail;

namespace {

constexpr int kThreads = 256;

// a[i] += scale * v[i % D], the product rounded before the sum (no FMA contraction): the CPU's two
// steps (dp = aux_scale * load_frac; dp += ...; and logits += bias).
template <typename T>
__global__ void add_row_vector_kernel(T* a, const float* v, float scale, int64_t D, int64_t n) {
  MOE_GRID_LOOP(i, n) store(a, i, __fadd_rn(load(a, i), __fmul_rn(scale, v[i % D])));
}

// lse[n] = m + log(sum_d exp(logits[n,d] - m)) in double, m the row's max (router_loss_forward).
template <typename T>
__global__ void row_logsumexp_kernel(float* lse, const T* logits, int64_t N, int64_t D) {
  const int64_t n = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (n >= N) return;
  const T* l = logits + n * D;
  float m = load(l, 0);
  for (int64_t d = 1; d < D; ++d) m = fmaxf(m, load(l, d));
  double s = 0;
  for (int64_t d = 0; d < D; ++d) s += exp(static_cast<double>(load(l, d)) - m);
  lse[n] = static_cast<float>(m + log(s));
}

// prob_sum[d] = sum_n probs[n,d] in double, in two passes (ColumnChunks, kernel_util.cuh) so that N
// rows spread over the GPU (one thread per column walking every row took ~0.1 us per row: longer than
// the layer's GEMMs) while the order stays fixed: pass 1 into partial[chunk, d], pass 2 over chunks.

template <typename T>
__global__ void column_partial_kernel(double* partial, const T* probs, int64_t N, int64_t D, int64_t rows) {
  __shared__ double lane_sum[kRowLanes][kColumnTile];
  const int64_t d = blockIdx.x * (int64_t)kColumnTile + threadIdx.x;
  const int64_t n0 = blockIdx.y * rows, n1 = n0 + rows < N ? n0 + rows : N;
  double s = 0;
  if (d < D)
    for (int64_t n = n0 + threadIdx.y; n < n1; n += kRowLanes) s += load(probs, n * D + d);
  lane_sum[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || d >= D) return;
  double t = 0;
  for (int y = 0; y < kRowLanes; ++y) t += lane_sum[y][threadIdx.x];
  partial[blockIdx.y * D + d] = t;
}

__global__ void column_finish_kernel(double* out, const double* partial, int64_t chunks, int64_t D) {
  const int64_t d = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (d >= D) return;
  double s = 0;
  for (int64_t c = 0; c < chunks; ++c) s += partial[c * D + d];
  out[d] = s;
}

// dlogits[n,d] += (scale * lse[n]) * probs[n,d]  (d z / d logits = 2 lse_n probs[n,d] / N).
template <typename T>
__global__ void router_z_backward_kernel(T* dlogits, const float* lse, const T* probs, float scale, int64_t D,
                                         int64_t n) {
  MOE_GRID_LOOP(i, n) {
    const float zl = __fmul_rn(scale, lse[i / D]);
    store(dlogits, i, __fadd_rn(load(dlogits, i), __fmul_rn(zl, load(probs, i))));
  }
}

}  // namespace

Status add_row_vector(Context& ctx, DType dt, void* a, const float* v, float scale, int64_t N, int64_t D) {
  const int64_t n = N * D;
  if (n == 0) return Status::ok();
  return dispatch(dt, [&]<typename T>() {
    add_row_vector_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, ctx.stream()>>>(static_cast<T*>(a), v, scale, D, n);
    return launched("add_row_vector");
  });
}

Status router_stats_forward(Context& ctx, DType dt, float* lse, double* prob_sum, const void* logits, const void* probs,
                            int64_t N, int64_t D) {
  if (D < 1) return Status::error(str_cat("cuda router_stats_forward: REQUIRES D >= 1, got ", D));
  if (N == 0) return fill_zero(ctx, prob_sum, D * static_cast<int64_t>(sizeof(double)));
  return dispatch(dt, [&]<typename T>() -> Status {
    row_logsumexp_kernel<T><<<blocks_for(N, kThreads), kThreads, 0, ctx.stream()>>>(lse, static_cast<const T*>(logits),
                                                                                     N, D);
    if (Status s = launched("router_stats_forward (logsumexp)"); !s) return s;
    const ColumnChunks chunks(N);
    void* partial = nullptr;
    if (Status s = ctx.reduction_scratch(static_cast<size_t>(chunks.count * D) * sizeof(double), &partial); !s)
      return s;
    column_partial_kernel<T><<<chunks.grid(D), ColumnChunks::block(), 0, ctx.stream()>>>(
        static_cast<double*>(partial), static_cast<const T*>(probs), N, D, chunks.rows);
    if (Status s = launched("router_stats_forward (column partial sums)"); !s) return s;
    column_finish_kernel<<<blocks_for(D, kThreads), kThreads, 0, ctx.stream()>>>(
        prob_sum, static_cast<const double*>(partial), chunks.count, D);
    return launched("router_stats_forward (column sums)");
  });
}

Status router_z_backward(Context& ctx, DType dt, void* dlogits, const float* lse, const void* probs, float scale,
                         int64_t N, int64_t D) {
  const int64_t n = N * D;
  if (n == 0) return Status::ok();
  return dispatch(dt, [&]<typename T>() {
    router_z_backward_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, ctx.stream()>>>(
        static_cast<T*>(dlogits), lse, static_cast<const T*>(probs), scale, D, n);
    return launched("router_z_backward");
  });
}

}  // namespace moe::cuda
