// Shared by the .cu files of src/cuda: f32/bf16 loads and stores, dispatch on DType, launch checks,
// and block reductions. Not a public header.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/ops.h"
#include "util/str_cat.h"

namespace moe::cuda::detail {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float load(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load(const bf16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store(bf16* p, int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }

// Calls f.template operator()<T>() with T = float or bf16 as dt says: one kernel template, two types.
template <typename F>
Status dispatch(DType dt, F&& f) {
  if (dt == DType::f32) return f.template operator()<float>();
  return f.template operator()<bf16>();
}

// The launch's error (bad configuration, no device) as a Status naming the op.
inline Status launched(const char* op) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return Status::ok();
  return Status::error(str_cat("cuda ", op, ": kernel launch failed: ", cudaGetErrorString(e)));
}

inline unsigned blocks_for(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65535LL * 1024 ? 65535LL * 1024 : b));
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result. The
// order is fixed by the block shape, so results are deterministic. `shared` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();  // shared may still be read by a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : 0.0f;
  return warp_sum(v);
}
__device__ __forceinline__ float block_max(float v, float* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : -INFINITY;
  return warp_max(v);
}

// The layout of the two-pass column reductions over N rows (router_loss.cu, norms.cu): a block of
// kColumnTile columns x kRowLanes lanes per chunk of rows; lane y sums the chunk's rows y, y + kRowLanes,
// ... then the lanes are added in order, and a second pass adds the chunks in order. Chunks of at
// least 512 rows, at most 65535 of them (the grid's y limit). Deterministic: the order is fixed.
constexpr int kColumnTile = 32, kRowLanes = 8;
struct ColumnChunks {
  int64_t rows, count;  // rows per chunk, chunks
  explicit ColumnChunks(int64_t N)
      : rows(std::max<int64_t>(512, (N + 65534) / 65535)), count((N + rows - 1) / rows) {}
  dim3 grid(int64_t columns) const {
    return dim3(static_cast<unsigned>((columns + kColumnTile - 1) / kColumnTile), static_cast<unsigned>(count));
  }
  static dim3 block() { return dim3(kColumnTile, kRowLanes); }
};

// Grid-stride loop over [0, n).
#define MOE_GRID_LOOP(i, n) \
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

}  // namespace moe::cuda::detail
