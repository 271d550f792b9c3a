// The model's input and output kernels (ops.h): token + position embedding and softmax
// cross-entropy, forward and backward.
#include <algorithm>
#include <climits>
#include <vector>

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

// dwte: block u takes the u-th distinct token, rows[u], and adds the gradient rows of its positions
// positions[starts[u] .. starts[u+1]) (ascending) one after another, each column by one thread: per
// element the CPU kernel's additions in its order (tokens in order), so the same result; the
// distinct tokens spread over the GPU instead of one thread per column walking every token.
template <typename T>
__global__ void embedding_backward_wte_kernel(float* dwte, const T* dout, const int32_t* rows, const int32_t* starts,
                                              const int32_t* positions, int64_t C) {
  const int64_t u = blockIdx.x;
  float* w = dwte + static_cast<int64_t>(rows[u]) * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = w[c];
    for (int32_t p = starts[u]; p < starts[u + 1]; ++p) acc += load(dout, static_cast<int64_t>(positions[p]) * C + c);
    w[c] = acc;
  }
}

// dwpe[t, c] += dout[b, t, c] for b in order: one thread per element.
template <typename T>
__global__ void embedding_backward_wpe_kernel(float* dwpe, const T* dout, int64_t B, int64_t T_, int64_t C) {
  MOE_GRID_LOOP(i, T_ * C) {
    float acc = dwpe[i];
    for (int64_t b = 0; b < B; ++b) acc += load(dout, b * T_ * C + i);
    dwpe[i] = acc;
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

Status embedding_backward(Context& ctx, DType dt, float* dwte, float* dwpe, const void* dout,
                          const int32_t* host_tokens, int64_t B, int64_t T, int64_t C) {
  const int64_t BT = B * T;
  if (BT == 0 || (!dwte && !dwpe)) return Status::ok();
  if (BT > INT32_MAX) return Status::error(str_cat("cuda embedding_backward: B*T (", BT, ") over 2^31"));
  // The positions of every token, grouped by token (ascending), positions ascending within: a
  // counting sort on the host, which has the tokens; uploaded as [rows | starts | positions].
  std::vector<int32_t> csr;
  int64_t distinct = 0;
  if (dwte) {
    int32_t top = 0;
    for (int64_t i = 0; i < BT; ++i) {
      if (host_tokens[i] < 0) return Status::error(str_cat("cuda embedding_backward: token ", i, " is negative"));
      top = std::max(top, host_tokens[i]);
    }
    std::vector<int32_t> count(static_cast<size_t>(top) + 2, 0);
    for (int64_t i = 0; i < BT; ++i) ++count[host_tokens[i] + 1];
    for (int32_t v = 0; v <= top; ++v) distinct += count[v + 1] > 0 ? 1 : 0;
    csr.resize(static_cast<size_t>(2 * distinct + 1 + BT));
    int32_t* rows = csr.data();
    int32_t* starts = rows + distinct;
    int32_t* positions = starts + distinct + 1;
    int64_t u = 0;
    int32_t at = 0;
    std::vector<int32_t> next(static_cast<size_t>(top) + 1, 0);
    for (int32_t v = 0; v <= top; ++v) {
      if (count[v + 1] == 0) continue;
      rows[u] = v;
      starts[u++] = at;
      next[v] = at;
      at += count[v + 1];
    }
    starts[distinct] = at;
    for (int64_t i = 0; i < BT; ++i) positions[next[host_tokens[i]]++] = static_cast<int32_t>(i);
  }
  return dispatch(dt, [&]<typename E>() -> Status {
    if (dwte) {
      void* dev = nullptr;
      if (Status s = ctx.reduction_scratch(csr.size() * sizeof(int32_t), &dev); !s) return s;
      // From pageable memory: staged before the call returns, so `csr` may go afterwards.
      MOE_CUDA_TRY(cudaMemcpyAsync(dev, csr.data(), csr.size() * sizeof(int32_t), cudaMemcpyHostToDevice, ctx.stream()),
                   "cuda embedding_backward: staging token positions");
      const int32_t* rows = static_cast<const int32_t*>(dev);
      embedding_backward_wte_kernel<E><<<static_cast<unsigned>(distinct), kThreads, 0, ctx.stream()>>>(
          dwte, static_cast<const E*>(dout), rows, rows + distinct, rows + 2 * distinct + 1, C);
      if (Status s = launched("embedding_backward (wte)"); !s) return s;
    }
    if (dwpe) {
      embedding_backward_wpe_kernel<E><<<blocks_for(T * C, kThreads), kThreads, 0, ctx.stream()>>>(
          dwpe, static_cast<const E*>(dout), B, T, C);
      if (Status s = launched("embedding_backward (wpe)"); !s) return s;
    }
    return Status::ok();
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
