// The op table: every differentiable kernel of src/tensor/ops.h as one row (its inputs, the kernel,
// a double-precision reference written here, its backward), so one harness checks them all the same
// way (tests/test_op_table.cpp on the CPU; tests/cuda/test_cuda_op_table.cpp runs the rows that have a
// CUDA kernel against the same references). A new op is covered by adding one row.
//
// Conventions: a row's output is one float array; its backward is given dout and ACCUMULATES
// d(sum(out * dout))/d(input) into the gradient of every differentiable float input (the ops.h
// rule); integer inputs (token ids, targets, row indices) are never differentiated.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "tensor/ops.h"

namespace moe::testing {

struct FloatInput {
  std::string name;
  int64_t size = 0;
  float scale = 1.0f;         // normal(0, scale), fixed seed
  bool differentiable = true;
};
struct IntInput {
  std::string name;
  int64_t size = 0;
  int32_t below = 1;  // uniform in [0, below), fixed seed
};

// The values a row runs on.
struct OpInputs {
  std::vector<std::vector<float>> f;    // one per FloatInput, in order
  std::vector<std::vector<int32_t>> i;  // one per IntInput, in order
};

struct OpRow;
inline void PrintTo(const OpRow& row, std::ostream* os);  // gtest names a failing row by its name

struct OpRow {
  std::string name;
  std::vector<FloatInput> floats;
  std::vector<IntInput> ints;
  int64_t out_size = 0;
  // The row's shape parameters, named as in its comment (e.g. linear: N, IC, OC), for the code that
  // runs the row elsewhere (the CUDA adapters).
  std::map<std::string, int64_t> dims{};
  std::function<void(const OpInputs&, float* out)> forward{};     // the kernel under test
  std::function<void(const OpInputs&, double* out)> reference{};  // double precision, written here
  // Accumulates into grads[k] (sized like floats[k]; null for a non-differentiable input).
  std::function<void(const OpInputs&, const float* dout, const std::vector<float*>& grads)> backward{};
  double atol = 1e-5, rtol = 1e-5;  // value mode: |got - ref| <= atol + rtol |ref|
  double grad_tol = 1e-3;           // gradient mode: check_gradient's max_rel_err (floor 1e-2)
  float eps = 1e-2f;                // finite-difference step
};

inline void PrintTo(const OpRow& row, std::ostream* os) { *os << row.name; }

// Inputs of `row` from fixed seeds (seed + input index).
inline OpInputs make_inputs(const OpRow& row, uint64_t seed = 1) {
  OpInputs in;
  for (size_t k = 0; k < row.floats.size(); ++k) {
    std::mt19937_64 g(seed + k);
    std::normal_distribution<float> d(0.0f, row.floats[k].scale);
    std::vector<float> v(row.floats[k].size);
    for (float& x : v) x = d(g);
    in.f.push_back(std::move(v));
  }
  for (size_t k = 0; k < row.ints.size(); ++k) {
    std::mt19937_64 g(seed + 100 + k);
    std::uniform_int_distribution<int32_t> d(0, row.ints[k].below - 1);
    std::vector<int32_t> v(row.ints[k].size);
    for (int32_t& x : v) x = d(g);
    in.i.push_back(std::move(v));
  }
  return in;
}

inline double gelu_tanh(double x) {
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

inline std::vector<OpRow> op_table() {
  std::vector<OpRow> t;
  {  // linear: out[n,o] = sum_i inp[n,i] w[o,i]
    const int64_t N = 6, IC = 9, OC = 5;
    OpRow r{"linear", {{"inp", N * IC}, {"weight", OC * IC, 0.5f}}, {}, N * OC};
    r.dims = {{"N", N}, {"IC", IC}, {"OC", OC}};
    r.forward = [=](const OpInputs& in, float* out) { linear_forward(out, in.f[0].data(), in.f[1].data(), N, IC, OC); };
    r.reference = [=](const OpInputs& in, double* out) {
      for (int64_t n = 0; n < N; ++n)
        for (int64_t o = 0; o < OC; ++o) {
          double s = 0;
          for (int64_t i = 0; i < IC; ++i) s += static_cast<double>(in.f[0][n * IC + i]) * in.f[1][o * IC + i];
          out[n * OC + o] = s;
        }
    };
    r.backward = [=](const OpInputs& in, const float* dout, const std::vector<float*>& g) {
      linear_backward(g[0], g[1], dout, in.f[0].data(), in.f[1].data(), N, IC, OC);
    };
    t.push_back(r);
  }
  {  // GELU, tanh approximation
    const int64_t n = 101;
    OpRow r{"gelu", {{"inp", n, 2.0f}}, {}, n};
    r.dims = {{"n", n}};
    r.forward = [=](const OpInputs& in, float* out) { gelu_forward(out, in.f[0].data(), n); };
    r.reference = [=](const OpInputs& in, double* out) {
      for (int64_t i = 0; i < n; ++i) out[i] = gelu_tanh(in.f[0][i]);
    };
    r.backward = [=](const OpInputs& in, const float* dout, const std::vector<float*>& g) {
      gelu_backward(g[0], dout, in.f[0].data(), n);
    };
    r.atol = 5e-7, r.rtol = 2e-6, r.grad_tol = 5e-3;  // FD truncation near 0 (gelu''' large)
    t.push_back(r);
  }
  {  // SwiGLU: silu(gate) * up
    const int64_t n = 77;
    OpRow r{"swiglu", {{"gate", n, 2.0f}, {"up", n}}, {}, n};
    r.dims = {{"n", n}};
    r.forward = [=](const OpInputs& in, float* out) { swiglu_forward(out, in.f[0].data(), in.f[1].data(), n); };
    r.reference = [=](const OpInputs& in, double* out) {
      for (int64_t i = 0; i < n; ++i) {
        const double g = in.f[0][i];
        out[i] = g / (1.0 + std::exp(-g)) * in.f[1][i];
      }
    };
    r.backward = [=](const OpInputs& in, const float* dout, const std::vector<float*>& g) {
      swiglu_backward(g[0], g[1], dout, in.f[0].data(), in.f[1].data(), n);
    };
    r.atol = 2e-7, r.rtol = 2e-6, r.grad_tol = 2e-3;
    t.push_back(r);
  }
  {  // softmax over rows (its backward reads the forward's output, recomputed here)
    const int64_t N = 5, D = 7;
    OpRow r{"softmax", {{"inp", N * D, 2.0f}}, {}, N * D};
    r.dims = {{"N", N}, {"D", D}};
    r.forward = [=](const OpInputs& in, float* out) { softmax_forward(out, in.f[0].data(), N, D); };
    r.reference = [=](const OpInputs& in, double* out) {
      for (int64_t n = 0; n < N; ++n) {
        double mx = -1e300, s = 0;
        for (int64_t d = 0; d < D; ++d) mx = std::max(mx, static_cast<double>(in.f[0][n * D + d]));
        for (int64_t d = 0; d < D; ++d) s += std::exp(in.f[0][n * D + d] - mx);
        for (int64_t d = 0; d < D; ++d) out[n * D + d] = std::exp(in.f[0][n * D + d] - mx) / s;
      }
    };
    r.backward = [=](const OpInputs& in, const float* dout, const std::vector<float*>& g) {
      std::vector<float> out(N * D);
      softmax_forward(out.data(), in.f[0].data(), N, D);
      softmax_backward(g[0], dout, out.data(), N, D);
    };
    r.atol = 1e-7, r.rtol = 1e-5;
    t.push_back(r);
  }
  {  // LayerNorm with weight and bias, eps 1e-5
    const int64_t N = 4, C = 12;
    const float eps = 1e-5f;
    OpRow r{"layernorm", {{"inp", N * C, 1.5f}, {"weight", C}, {"bias", C}}, {}, N * C};
    r.dims = {{"N", N}, {"C", C}};
    r.forward = [=](const OpInputs& in, float* out) {
      std::vector<float> mean(N), rstd(N);
      layernorm_forward(out, mean.data(), rstd.data(), in.f[0].data(), in.f[1].data(), in.f[2].data(), N, C, eps);
    };
    r.reference = [=](const OpInputs& in, double* out) {
      for (int64_t n = 0; n < N; ++n) {
        double m = 0, v = 0;
        for (int64_t c = 0; c < C; ++c) m += in.f[0][n * C + c];
        m /= C;
        for (int64_t c = 0; c < C; ++c) v += (in.f[0][n * C + c] - m) * (in.f[0][n * C + c] - m);
        const double rs = 1.0 / std::sqrt(v / C + eps);
        for (int64_t c = 0; c < C; ++c) out[n * C + c] = (in.f[0][n * C + c] - m) * rs * in.f[1][c] + in.f[2][c];
      }
    };
    r.backward = [=](const OpInputs& in, const float* dout, const std::vector<float*>& g) {
      std::vector<float> out(N * C), mean(N), rstd(N);
      layernorm_forward(out.data(), mean.data(), rstd.data(), in.f[0].data(), in.f[1].data(), in.f[2].data(), N, C, eps);
      layernorm_backward(g[0], g[1], g[2], dout, in.f[0].data(), in.f[1].data(), mean.data(), rstd.data(), N, C);
    };
    r.atol = 1e-6, r.rtol = 1e-5, r.grad_tol = 3e-3;
    t.push_back(r);
  }
  {  // RMSNorm, eps 1e-5
    const int64_t N = 4, C = 12;
    const float eps = 1e-5f;
    OpRow r{"rmsnorm", {{"inp", N * C, 1.5f}, {"weight", C}}, {}, N * C};
    r.dims = {{"N", N}, {"C", C}};
    r.forward = [=](const OpInputs& in, float* out) {
      std::vector<float> rstd(N);
      rmsnorm_forward(out, rstd.data(), in.f[0].data(), in.f[1].data(), N, C, eps);
    };
    r.reference = [=](const OpInputs& in, double* out) {
      for (int64_t n = 0; n < N; ++n) {
        double ms = 0;
        for (int64_t c = 0; c < C; ++c) ms += static_cast<double>(in.f[0][n * C + c]) * in.f[0][n * C + c];
        const double rs = 1.0 / std::sqrt(ms / C + eps);
        for (int64_t c = 0; c < C; ++c) out[n * C + c] = in.f[0][n * C + c] * rs * in.f[1][c];
      }
    };
    r.backward = [=](const OpInputs& in, const float* dout, const std::vector<float*>& g) {
      std::vector<float> out(N * C), rstd(N);
      rmsnorm_forward(out.data(), rstd.data(), in.f[0].data(), in.f[1].data(), N, C, eps);
      rmsnorm_backward(g[0], g[1], dout, in.f[0].data(), in.f[1].data(), rstd.data(), N, C);
    };
    r.atol = 1e-6, r.rtol = 1e-5, r.grad_tol = 3e-3;
    t.push_back(r);
  }
  {  // causal multi-head self-attention over qkv [B,T,3C]
    const int64_t B = 2, T = 5, C = 8, NH = 2, HS = C / NH;
    OpRow r{"attention", {{"qkv", B * T * 3 * C}}, {}, B * T * C};
    r.dims = {{"B", B}, {"T", T}, {"C", C}, {"NH", NH}};
    r.forward = [=](const OpInputs& in, float* out) {
      std::vector<float> pre(B * NH * T * T), att(B * NH * T * T);
      attention_forward(out, pre.data(), att.data(), in.f[0].data(), B, T, C, NH);
    };
    r.reference = [=](const OpInputs& in, double* out) {
      const std::vector<float>& x = in.f[0];
      const double scale = 1.0 / std::sqrt(static_cast<double>(HS));
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < NH; ++h)
          for (int64_t t1 = 0; t1 < T; ++t1) {
            std::vector<double> w(t1 + 1);
            double mx = -1e300, s = 0;
            for (int64_t t2 = 0; t2 <= t1; ++t2) {
              double d = 0;
              for (int64_t k = 0; k < HS; ++k)
                d += static_cast<double>(x[(b * T + t1) * 3 * C + h * HS + k]) * x[(b * T + t2) * 3 * C + C + h * HS + k];
              w[t2] = d * scale, mx = std::max(mx, w[t2]);
            }
            for (double& v : w) v = std::exp(v - mx), s += v;
            for (int64_t k = 0; k < HS; ++k) {
              double o = 0;
              for (int64_t t2 = 0; t2 <= t1; ++t2) o += w[t2] / s * x[(b * T + t2) * 3 * C + 2 * C + h * HS + k];
              out[(b * T + t1) * C + h * HS + k] = o;
            }
          }
    };
    r.backward = [=](const OpInputs& in, const float* dout, const std::vector<float*>& g) {
      std::vector<float> out(B * T * C), pre(B * NH * T * T), att(B * NH * T * T), datt(att.size()), dpre(att.size());
      attention_forward(out.data(), pre.data(), att.data(), in.f[0].data(), B, T, C, NH);
      attention_backward(g[0], datt.data(), dpre.data(), dout, in.f[0].data(), att.data(), B, T, C, NH);
    };
    r.atol = 1e-6, r.rtol = 1e-5, r.grad_tol = 3e-3;
    t.push_back(r);
  }
  {  // token + position embedding
    const int64_t B = 2, T = 4, C = 6, V = 7;
    OpRow r{"embedding", {{"wte", V * C}, {"wpe", T * C}}, {{"tokens", B * T, static_cast<int32_t>(V)}}, B * T * C};
    r.dims = {{"B", B}, {"T", T}, {"C", C}, {"V", V}};
    r.forward = [=](const OpInputs& in, float* out) {
      embedding_forward(out, in.i[0].data(), in.f[0].data(), in.f[1].data(), B, T, C);
    };
    r.reference = [=](const OpInputs& in, double* out) {
      for (int64_t b = 0; b < B; ++b)
        for (int64_t p = 0; p < T; ++p)
          for (int64_t c = 0; c < C; ++c)
            out[(b * T + p) * C + c] =
                static_cast<double>(in.f[0][in.i[0][b * T + p] * C + c]) + in.f[1][p * C + c];
    };
    r.backward = [=](const OpInputs& in, const float* dout, const std::vector<float*>& g) {
      embedding_backward(g[0], g[1], dout, in.i[0].data(), B, T, C);
    };
    r.atol = 0, r.rtol = 1e-7;
    t.push_back(r);
  }
  {  // softmax cross-entropy: out[0] = the mean loss over N rows
    const int64_t N = 5, V = 9;
    OpRow r{"cross_entropy", {{"logits", N * V, 2.0f}}, {{"targets", N, static_cast<int32_t>(V)}}, 1};
    r.dims = {{"N", N}, {"V", V}};
    r.forward = [=](const OpInputs& in, float* out) {
      std::vector<float> probs(N * V);
      out[0] = static_cast<float>(cross_entropy_forward(probs.data(), in.f[0].data(), in.i[0].data(), N, V));
    };
    r.reference = [=](const OpInputs& in, double* out) {
      double loss = 0;
      for (int64_t n = 0; n < N; ++n) {
        double mx = -1e300, s = 0;
        for (int64_t v = 0; v < V; ++v) mx = std::max(mx, static_cast<double>(in.f[0][n * V + v]));
        for (int64_t v = 0; v < V; ++v) s += std::exp(in.f[0][n * V + v] - mx);
        loss += -(in.f[0][n * V + in.i[0][n]] - mx - std::log(s));
      }
      out[0] = loss / N;
    };
    r.backward = [=](const OpInputs& in, const float* dout, const std::vector<float*>& g) {
      std::vector<float> probs(N * V);
      cross_entropy_forward(probs.data(), in.f[0].data(), in.i[0].data(), N, V);
      cross_entropy_backward(g[0], probs.data(), in.i[0].data(), N, V, dout[0]);
    };
    r.atol = 1e-6, r.rtol = 1e-6;
    t.push_back(r);
  }
  {  // rows by index: out[r] = inp[index[r]]
    const int64_t N = 6, R = 9, C = 5;
    OpRow r{"gather_rows", {{"inp", N * C}}, {{"index", R, static_cast<int32_t>(N)}}, R * C};
    r.dims = {{"N", N}, {"R", R}, {"C", C}};
    r.forward = [=](const OpInputs& in, float* out) { gather_rows(out, in.f[0].data(), in.i[0].data(), R, C); };
    r.reference = [=](const OpInputs& in, double* out) {
      for (int64_t k = 0; k < R; ++k)
        for (int64_t c = 0; c < C; ++c) out[k * C + c] = in.f[0][in.i[0][k] * C + c];
    };
    // d inp[index[r]] += dout[r]: scatter_add_rows, the op's adjoint.
    r.backward = [=](const OpInputs& in, const float* dout, const std::vector<float*>& g) {
      scatter_add_rows(g[0], dout, in.i[0].data(), nullptr, R, N, C);
    };
    r.atol = 0, r.rtol = 0;
    t.push_back(r);
  }
  {  // out[index[r]] += scale[r] * inp[r], into zeros (duplicate indices summed)
    const int64_t N = 4, R = 9, C = 5;
    OpRow r{"scatter_add_rows", {{"inp", R * C}, {"scale", R}}, {{"index", R, static_cast<int32_t>(N)}}, N * C};
    r.dims = {{"N", N}, {"R", R}, {"C", C}};
    r.forward = [=](const OpInputs& in, float* out) {
      std::fill(out, out + N * C, 0.0f);
      scatter_add_rows(out, in.f[0].data(), in.i[0].data(), in.f[1].data(), R, N, C);
    };
    r.reference = [=](const OpInputs& in, double* out) {
      std::fill(out, out + N * C, 0.0);
      for (int64_t k = 0; k < R; ++k)
        for (int64_t c = 0; c < C; ++c) out[in.i[0][k] * C + c] += static_cast<double>(in.f[1][k]) * in.f[0][k * C + c];
    };
    // d inp[r] += scale[r] dout[index[r]];  d scale[r] += dot(dout[index[r]], inp[r]) (written here:
    // ops.h has no fused kernel for it; the MoE combine computes it in combine_backward).
    r.backward = [=](const OpInputs& in, const float* dout, const std::vector<float*>& g) {
      std::vector<float> rows(R * C);
      gather_rows(rows.data(), dout, in.i[0].data(), R, C);
      for (int64_t k = 0; k < R; ++k) {
        double dot = 0;
        for (int64_t c = 0; c < C; ++c) {
          g[0][k * C + c] += in.f[1][k] * rows[k * C + c];
          dot += static_cast<double>(rows[k * C + c]) * in.f[0][k * C + c];
        }
        g[1][k] += static_cast<float>(dot);
      }
    };
    r.atol = 1e-6, r.rtol = 1e-6;
    t.push_back(r);
  }
  return t;
}

}  // namespace moe::testing
