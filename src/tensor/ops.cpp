// CPU kernels of ops.h (GEMM itself lives in gemm.cpp). Reductions that feed the loss run in
// double; everything is deterministic for a given thread count, and scatters are deterministic for
// any thread count (each thread owns a column range and walks rows in order).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#include "tensor/ops.h"

namespace moe {

// ---- linear -------------------------------------------------------------------------------------

void linear_forward(float* out, const float* inp, const float* weight, int64_t N, int64_t IC, int64_t OC) {
  gemm(false, true, N, OC, IC, 1.0f, inp, IC, weight, IC, 0.0f, out, OC);  // out = inp @ W^T
}

void linear_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                     int64_t N, int64_t IC, int64_t OC) {
  if (dinp) gemm(false, false, N, IC, OC, 1.0f, dout, OC, weight, IC, 1.0f, dinp, IC);     // += dout @ W
  if (dweight) gemm(true, false, OC, IC, N, 1.0f, dout, OC, inp, IC, 1.0f, dweight, IC);  // += dout^T @ inp
}

// ---- elementwise -------------------------------------------------------------------------------

void add_inplace(float* a, const float* b, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) a[i] += b[i];
}

void scale_inplace(float* a, float s, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) a[i] *= s;
}

namespace {
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)

// exp(x) in a form the compiler vectorizes (libm's expf/tanhf are scalar calls, which made GELU
// cost as much as the expert GEMMs): Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, then
// Cephes' degree-6 polynomial for e^r (relative error about 1e-7) and 2^n built in the exponent bits.
inline float exp_vec(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-6f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}
inline float tanh_vec(float u) { return 1.0f - 2.0f / (exp_vec(2.0f * u) + 1.0f); }
inline float sigmoid(float x) { return 1.0f / (1.0f + exp_vec(-x)); }
}  // namespace

void gelu_forward(float* out, const float* inp, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float x = inp[i];
    out[i] = 0.5f * x * (1.0f + tanh_vec(kGeluScale * (x + 0.044715f * x * x * x)));
  }
}

namespace {
inline float gelu_grad(float x) {
  float u = kGeluScale * (x + 0.044715f * x * x * x);
  float th = tanh_vec(u);
  float sech2 = 1.0f - th * th;
  return 0.5f * (1.0f + th) + 0.5f * x * sech2 * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
}
}  // namespace

void gelu_backward(float* dinp, const float* dout, const float* inp, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) dinp[i] += gelu_grad(inp[i]) * dout[i];
}

void gelu_backward_inplace(float* d, const float* inp, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) d[i] *= gelu_grad(inp[i]);
}

void swiglu_forward(float* out, const float* gate, const float* up, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] * sigmoid(gate[i]) * up[i];
}

void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float g = gate[i], s = sigmoid(g);
    float silu = g * s;
    if (dgate) dgate[i] += dout[i] * up[i] * s * (1.0f + g * (1.0f - s));
    if (dup) dup[i] += dout[i] * silu;
  }
}

// ---- softmax / top-k -----------------------------------------------------------------------------

namespace {
// y[0..D) = softmax(x[0..D)) with std::exp and a double sum (the router's and the loss's; attention's
// softmax_row below trades that for speed). Returns log sum_d exp(x[d]), exact in double even where
// y underflows.
double softmax_row_exact(float* y, const float* x, int64_t D) {
  float mx = -INFINITY;
  for (int64_t d = 0; d < D; ++d) mx = std::max(mx, x[d]);
  double sum = 0;
  for (int64_t d = 0; d < D; ++d) {
    y[d] = std::exp(x[d] - mx);
    sum += y[d];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t d = 0; d < D; ++d) y[d] *= inv;
  return std::log(sum) + mx;
}
}  // namespace

void softmax_forward(float* out, const float* inp, int64_t N, int64_t D) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) softmax_row_exact(out + n * D, inp + n * D, D);
}

void softmax_backward(float* dinp, const float* dout, const float* out, int64_t N, int64_t D) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* dy = dout + n * D;
    const float* y = out + n * D;
    double dot = 0;
    for (int64_t d = 0; d < D; ++d) dot += static_cast<double>(dy[d]) * y[d];
    float fdot = static_cast<float>(dot);
    for (int64_t d = 0; d < D; ++d) dinp[n * D + d] += y[d] * (dy[d] - fdot);
  }
}

void topk_forward(float* values, int32_t* indices, const float* inp, int64_t N, int64_t D, int64_t K) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * D;
    // Insertion into a sorted list of K: D is the expert count (small), so this beats a heap.
    for (int64_t k = 0; k < K; ++k) {
      values[n * K + k] = -INFINITY;
      indices[n * K + k] = -1;
    }
    for (int64_t d = 0; d < D; ++d) {
      float v = x[d];
      int64_t pos = K;
      // Strictly greater: an equal value stays behind the earlier (lower) index.
      while (pos > 0 && (indices[n * K + pos - 1] < 0 || v > values[n * K + pos - 1])) --pos;
      if (pos == K) continue;
      for (int64_t k = K - 1; k > pos; --k) {
        values[n * K + k] = values[n * K + k - 1];
        indices[n * K + k] = indices[n * K + k - 1];
      }
      values[n * K + pos] = v;
      indices[n * K + pos] = static_cast<int32_t>(d);
    }
  }
}

// ---- norms -------------------------------------------------------------------------------------

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int64_t N, int64_t C, float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    double m = 0;
    for (int64_t c = 0; c < C; ++c) m += x[c];
    m /= C;
    double var = 0;
    for (int64_t c = 0; c < C; ++c) var += (x[c] - m) * (x[c] - m);
    var /= C;
    float s = static_cast<float>(1.0 / std::sqrt(var + eps));
    float fm = static_cast<float>(m);
    float* y = out + n * C;
    for (int64_t c = 0; c < C; ++c) y[c] = (x[c] - fm) * s * weight[c] + bias[c];
    mean[n] = fm;
    rstd[n] = s;
  }
}

namespace {
// Parameter gradients summed over rows: each thread owns a column range, rows in order, so the
// result is independent of the thread count.
template <typename F>
void for_column_blocks(int64_t C, F&& body) {
  const int64_t block = 16;
  const int64_t nblocks = (C + block - 1) / block;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < nblocks; ++b) body(b * block, std::min(C, (b + 1) * block));
}
}  // namespace

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int64_t N, int64_t C) {
  if (dinp) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* dy = dout + n * C;
      const float* x = inp + n * C;
      float m = mean[n], s = rstd[n];
      double dnorm_mean = 0, dnorm_norm_mean = 0;
      for (int64_t c = 0; c < C; ++c) {
        float norm = (x[c] - m) * s;
        float dnorm = weight[c] * dy[c];
        dnorm_mean += dnorm;
        dnorm_norm_mean += static_cast<double>(dnorm) * norm;
      }
      float a = static_cast<float>(dnorm_mean / C), b = static_cast<float>(dnorm_norm_mean / C);
      float* dx = dinp + n * C;
      for (int64_t c = 0; c < C; ++c) {
        float norm = (x[c] - m) * s;
        dx[c] += (weight[c] * dy[c] - a - norm * b) * s;
      }
    }
  }
  if (dweight || dbias) {
    for_column_blocks(C, [&](int64_t c0, int64_t c1) {
      for (int64_t n = 0; n < N; ++n) {
        const float* dy = dout + n * C;
        const float* x = inp + n * C;
        for (int64_t c = c0; c < c1; ++c) {
          if (dweight) dweight[c] += (x[c] - mean[n]) * rstd[n] * dy[c];
          if (dbias) dbias[c] += dy[c];
        }
      }
    });
  }
}

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C,
                     float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    double ss = 0;
    for (int64_t c = 0; c < C; ++c) ss += static_cast<double>(x[c]) * x[c];
    float s = static_cast<float>(1.0 / std::sqrt(ss / C + eps));
    float* y = out + n * C;
    for (int64_t c = 0; c < C; ++c) y[c] = x[c] * s * weight[c];
    rstd[n] = s;
  }
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, int64_t N, int64_t C) {
  if (dinp) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* dy = dout + n * C;
      const float* x = inp + n * C;
      float s = rstd[n];
      // y = x*s*w, s = (mean(x^2)+eps)^-1/2: dx = s*w*dy - x * s^3 * mean(x * w * dy)
      double dot = 0;
      for (int64_t c = 0; c < C; ++c) dot += static_cast<double>(x[c]) * weight[c] * dy[c];
      float k = static_cast<float>(dot / C) * s * s * s;
      float* dx = dinp + n * C;
      for (int64_t c = 0; c < C; ++c) dx[c] += s * weight[c] * dy[c] - x[c] * k;
    }
  }
  if (dweight) {
    for_column_blocks(C, [&](int64_t c0, int64_t c1) {
      for (int64_t n = 0; n < N; ++n)
        for (int64_t c = c0; c < c1; ++c) dweight[c] += inp[n * C + c] * rstd[n] * dout[n * C + c];
    });
  }
}

// ---- attention -----------------------------------------------------------------------------------

namespace {
// att[0..n) = softmax(pre[0..n)); att may be pre.
void softmax_row(float* att, const float* pre, int64_t n) {
  float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, pre[j]);
  float sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    att[j] = exp_vec(pre[j] - mx);
    sum += att[j];
  }
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) att[j] *= inv;
}
}  // namespace

void attend_query(float* out, float* pre, float* att, const float* q, const float* k, const float* v, int64_t stride,
                  int64_t n, int64_t HS, float scale) {
  for (int64_t j = 0; j < n; ++j) {
    const float* kj = k + j * stride;
    float dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < HS; ++i) dot += q[i] * kj[i];
    pre[j] = dot * scale;
  }
  softmax_row(att, pre, n);
  for (int64_t i = 0; i < HS; ++i) out[i] = 0;
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = v + j * stride;
#pragma omp simd
    for (int64_t i = 0; i < HS; ++i) out[i] += att[j] * vj[i];
  }
}

// Per (batch, head) as GEMMs: scores = scale q k^T, a causal softmax per row, out = att v. Each GEMM is
// small ([T,HS] x [HS,T]) and runs on the calling thread inside the (b, h) loop, as the experts' do.
void attention_forward(float* out, float* preatt, float* att, const float* qkv, int64_t B, int64_t T, int64_t C,
                       int64_t NH) {
  const int64_t HS = C / NH, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h) {
      const float* q = qkv + b * T * C3 + h * HS;  // [T,HS], row stride C3; k at q + C, v at q + 2C
      float* pre = preatt + (b * NH + h) * T * T;   // [T,T]; above the diagonal unused
      float* a = att + (b * NH + h) * T * T;        // [T,T]; zero above the diagonal
      gemm(false, true, T, T, HS, scale, q, C3, q + C, C3, 0.0f, pre, T);
      for (int64_t t = 0; t < T; ++t) {
        softmax_row(a + t * T, pre + t * T, t + 1);
        std::fill(a + t * T + t + 1, a + (t + 1) * T, 0.0f);
      }
      gemm(false, false, T, HS, T, 1.0f, a, T, q + 2 * C, C3, 0.0f, out + b * T * C + h * HS, C);
    }
}

void attention_backward(float* dqkv, float* datt, float* dpreatt, const float* dout, const float* qkv,
                        const float* att, int64_t B, int64_t T, int64_t C, int64_t NH) {
  const int64_t HS = C / NH, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HS));
  // One (b, h) per task: it writes only its own head's columns of dqkv for batch b, so no races.
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h) {
      const float* q = qkv + b * T * C3 + h * HS;  // [T,HS], row stride C3; k at q + C, v at q + 2C
      float* dq = dqkv + b * T * C3 + h * HS;      // the same layout
      const float* dy = dout + b * T * C + h * HS;  // [T,HS], row stride C
      const float* a = att + (b * NH + h) * T * T;  // [T,T], zero above the diagonal
      float* da = datt + (b * NH + h) * T * T;
      float* dpre = dpreatt + (b * NH + h) * T * T;
      gemm(true, false, T, HS, T, 1.0f, a, T, dy, C, 1.0f, dq + 2 * C, C3);  // dv += att^T dy
      gemm(false, true, T, T, HS, 1.0f, dy, C, q + 2 * C, C3, 0.0f, da, T);  // datt = dy v^T
      // softmax: dpre = att * (datt - sum(att * datt)), zero above the diagonal
      for (int64_t t = 0; t < T; ++t) {
        const float* at = a + t * T;
        const float* d = da + t * T;
        float* dp = dpre + t * T;
        float s = 0;
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j <= t; ++j) s += at[j] * d[j];
#pragma omp simd
        for (int64_t j = 0; j <= t; ++j) dp[j] = at[j] * (d[j] - s);
        std::fill(dp + t + 1, dp + T, 0.0f);
      }
      gemm(false, false, T, HS, T, scale, dpre, T, q + C, C3, 1.0f, dq, C3);  // dq += scale dpre k
      gemm(true, false, T, HS, T, scale, dpre, T, q, C3, 1.0f, dq + C, C3);   // dk += scale dpre^T q
    }
}

// ---- embeddings ---------------------------------------------------------------------------------

void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B, int64_t T,
                       int64_t C) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const float* e = wte + static_cast<int64_t>(tokens[b * T + t]) * C;
      const float* p = wpe + t * C;
      float* o = out + (b * T + t) * C;
      for (int64_t c = 0; c < C; ++c) o[c] = e[c] + p[c];
    }
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B, int64_t T,
                        int64_t C) {
  for_column_blocks(C, [&](int64_t c0, int64_t c1) {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        const float* d = dout + (b * T + t) * C;
        if (dwte) {
          float* e = dwte + static_cast<int64_t>(tokens[b * T + t]) * C;
          for (int64_t c = c0; c < c1; ++c) e[c] += d[c];
        }
        if (dwpe)
          for (int64_t c = c0; c < c1; ++c) dwpe[t * C + c] += d[c];
      }
  });
}

// ---- loss ---------------------------------------------------------------------------------------

double cross_entropy_forward(float* probs, const float* logits, const int32_t* targets, int64_t N, int64_t V) {
  double total = 0;
#pragma omp parallel for reduction(+ : total) schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = logits + n * V;
    // -log softmax[target] = logsumexp - logit[target]
    total += softmax_row_exact(probs + n * V, x, V) - x[targets[n]];
  }
  return total / static_cast<double>(N);
}

void cross_entropy_backward(float* dlogits, const float* probs, const int32_t* targets, int64_t N, int64_t V,
                            float dloss) {
  const float s = dloss / static_cast<float>(N);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    float* d = dlogits + n * V;
    const float* p = probs + n * V;
    for (int64_t v = 0; v < V; ++v) d[v] += s * p[v];
    d[targets[n]] -= s;
  }
}

// ---- token rows by index ------------------------------------------------------------------------

void gather_rows(float* out, const float* inp, const int32_t* index, int64_t R, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r)
    std::memcpy(out + r * C, inp + static_cast<int64_t>(index[r]) * C, C * sizeof(float));
}

void scatter_add_rows(float* out, const float* inp, const int32_t* index, const float* scale, int64_t R, int64_t N,
                      int64_t C) {
  (void)N;
  for_column_blocks(C, [&](int64_t c0, int64_t c1) {
    for (int64_t r = 0; r < R; ++r) {
      float s = scale ? scale[r] : 1.0f;
      float* o = out + static_cast<int64_t>(index[r]) * C;
      const float* x = inp + r * C;
      for (int64_t c = c0; c < c1; ++c) o[c] += s * x[c];
    }
  });
}

// ---- optimizer ------------------------------------------------------------------------------------

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, float lr, float beta1, float beta2,
                  float eps, float weight_decay, int64_t t) {
  const float bc1 = 1.0f - static_cast<float>(std::pow(beta1, static_cast<double>(t)));
  const float bc2 = 1.0f - static_cast<float>(std::pow(beta2, static_cast<double>(t)));
  const float decay = 1.0f - lr * weight_decay;
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float g = grad[i];
    m[i] = beta1 * m[i] + (1.0f - beta1) * g;
    v[i] = beta2 * v[i] + (1.0f - beta2) * g * g;
    float mhat = m[i] / bc1, vhat = v[i] / bc2;
    param[i] = param[i] * decay - lr * mhat / (std::sqrt(vhat) + eps);
  }
}

}  // namespace moe
