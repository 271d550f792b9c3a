// The model's input and output kernels (ops.h): token + position embedding and softmax
// cross-entropy, forward and backward.
#include "cuda/kernel_util.cuh"

namespace moe::cuda {

using namespace detail;

namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void embedding_forward_kernel(T* out, const int32_t* tokens, const T* wte, const T* wpe, int64_t T_,
                                         int64_t C, int64_t n) {
  MOE_GRID_LOOP(i, n) {
    const int64_t bt = i / C, c = i % C, t = bt % T_;
    store(out, i, load(wte, static_cast<int64_t>(tokens[bt]) * C + c) + load(wpe, t * C + c));
  }
}

// One thread per column c, tokens in order: the CPU kernel's summation order.
template <typename T>
__global__ void embedding_backward_kernel(float* dwte, float* dwpe, const T* dout, const int32_t* tokens, int64_t BT,
                                          int64_t T_, int64_t C) {
  const int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= C) return;
  for (int64_t bt = 0; bt < BT; ++bt) {
    const float d = load(dout, bt * C + c);
    if (dwte) dwte[static_cast<int64_t>(tokens[bt]) * C + c] += d;
    if (dwpe) dwpe[(bt % T_) * C + c] += d;
  }
}

template <typename T>
__global__ void cross_entropy_forward_kernel(float* probs, float* losses, const T* logits, const int32_t* targets,
                                             int64_t V) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x * V;
  float mx = -INFINITY;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) mx = fmaxf(mx, load(logits, row + v));
  mx = block_max(mx, shared);
  float sum = 0;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) sum += expf(load(logits, row + v) - mx);
  sum = block_sum(sum, shared);
  const float inv = 1.0f / sum;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) probs[row + v] = expf(load(logits, row + v) - mx) * inv;
  // -log softmax[target] = logsumexp - logit[target]: finite even where the probability underflows.
  if (threadIdx.x == 0) losses[blockIdx.x] = logf(sum) + mx - load(logits, row + targets[blockIdx.x]);
}

template <typename T>
__global__ void cross_entropy_backward_kernel(T* dlogits, const float* probs, const int32_t* targets, int64_t V,
                                              float scale, int64_t n) {
  MOE_GRID_LOOP(i, n) {
    const int64_t row = i / V, v = i % V;
    const float onehot = v == targets[row] ? 1.0f : 0.0f;
    store(dlogits, i, load(dlogits, i) + scale * (probs[i] - onehot));
  }
}

}  // namespace

Status embedding_forward(Context& ctx, DType dt, void* out, const int32_t* tokens, const void* wte, const void* wpe,
                         int64_t B, int64_t T, int64_t C) {
  const int64_t n = B * T * C;
  if (n == 0) return Status::ok();
  return dispatch(dt, [&]<typename E>() {
    embedding_forward_kernel<E><<<blocks_for(n, kThreads), kThreads, 0, ctx.stream()>>>(
        static_cast<E*>(out), tokens, static_cast<const E*>(wte), static_cast<const E*>(wpe), T, C, n);
    return launched("embedding_forward");
  });
}

Status embedding_backward(Context& ctx, DType dt, float* dwte, float* dwpe, const void* dout, const int32_t* tokens,
                          int64_t B, int64_t T, int64_t C) {
  if (B * T == 0 || (!dwte && !dwpe)) return Status::ok();
  return dispatch(dt, [&]<typename E>() {
    embedding_backward_kernel<E><<<blocks_for(C, kThreads), kThreads, 0, ctx.stream()>>>(
        dwte, dwpe, static_cast<const E*>(dout), tokens, B * T, T, C);
    return launched("embedding_backward");
  });
}

Status cross_entropy_forward(Context& ctx, DType dt, float* probs, float* losses, const void* logits,
                             const int32_t* targets, int64_t N, int64_t V) {
  if (N == 0) return Status::ok();
  return dispatch(dt, [&]<typename E>() {
    cross_entropy_forward_kernel<E><<<static_cast<unsigned>(N), kThreads, 0, ctx.stream()>>>(
        probs, losses, static_cast<const E*>(logits), targets, V);
    return launched("cross_entropy_forward");
  });
}

Status cross_entropy_backward(Context& ctx, DType dt, void* dlogits, const float* probs, const int32_t* targets,
                              int64_t N, int64_t V, float dloss) {
  const int64_t n = N * V;
  if (n == 0) return Status::ok();
  const float scale = dloss / static_cast<float>(N);
  return dispatch(dt, [&]<typename E>() {
    cross_entropy_backward_kernel<E><<<blocks_for(n, kThreads), kThreads, 0, ctx.stream()>>>(
        static_cast<E*>(dlogits), probs, targets, V, scale, n);
    return launched("cross_entropy_backward");
  });
}

}  // namespace moe::cuda
