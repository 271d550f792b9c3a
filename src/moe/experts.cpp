#include "moe/experts.h"

#include <cstring>
#include <stdexcept>

#include "tensor/ops.h"

namespace moe {

namespace {
void check(const int64_t* off, const ExpertShape& s, const void* h3, const void* w3) {
  for (int64_t e = 0; e < s.E; ++e)
    if (off[e + 1] < off[e]) throw std::logic_error("experts: REQUIRES non-decreasing offsets");
  if (s.activation == Activation::swiglu && (!h3 || !w3))
    throw std::logic_error("experts: SwiGLU REQUIRES h3 and w3");
}
}  // namespace

void experts_forward(float* out, float* h1, float* h3, float* act, const float* xp, const int64_t* off,
                     const float* w1, const float* w2, const float* w3, const ExpertShape& s) {
  check(off, s, h3, w3);
  const int64_t C = s.C, F = s.F;
  const bool swiglu = s.activation == Activation::swiglu;
  for (int64_t e = 0; e < s.E; ++e) {
    const int64_t r0 = off[e], n = off[e + 1] - off[e];
    if (n == 0) continue;
    const float* x = xp + r0 * C;
    float* a = act + r0 * F;
    float* g = h1 + r0 * F;
    linear_forward(g, x, w1 + e * F * C, n, C, F);
    if (swiglu) {
      float* u = h3 + r0 * F;
      linear_forward(u, x, w3 + e * F * C, n, C, F);
      swiglu_forward(a, g, u, n * F);
    } else {
      gelu_forward(a, g, n * F);
    }
    linear_forward(out + r0 * C, a, w2 + e * C * F, n, F, C);
  }
}

void experts_backward(float* dxp, float* dw1, float* dw2, float* dw3, float* dact, float* dh1, float* dh3,
                      const float* dout, const float* xp, const float* h1, const float* h3, const float* act,
                      const int64_t* off, const float* w1, const float* w2, const float* w3, const ExpertShape& s) {
  check(off, s, h3, w3);
  if (s.activation == Activation::swiglu && !dh3) throw std::logic_error("experts_backward: SwiGLU REQUIRES dh3");
  const int64_t C = s.C, F = s.F;
  const bool swiglu = s.activation == Activation::swiglu;
  for (int64_t e = 0; e < s.E; ++e) {
    const int64_t r0 = off[e], n = off[e + 1] - off[e];
    if (n == 0) continue;
    const float* dy = dout + r0 * C;
    const float* x = xp + r0 * C;
    const float* w1e = w1 + e * F * C;
    const float* w2e = w2 + e * C * F;
    float* da = dact + r0 * F;
    // GELU works in place in dact (see gelu_backward_inplace); SwiGLU needs dh1 and dh3 apart.
    float* dg = swiglu ? dh1 + r0 * F : da;
    float* dx = dxp + r0 * C;
    // out = act @ w2^T:  dact = dout @ w2 (overwrite),  dw2 += dout^T @ act
    gemm(false, false, n, F, C, 1.0f, dy, C, w2e, F, 0.0f, da, F);
    if (dw2) linear_backward(nullptr, dw2 + e * C * F, dy, act + r0 * F, w2e, n, F, C);
    // activation (swiglu_backward accumulates, so its outputs start from zero)
    if (swiglu) {
      float* du = dh3 + r0 * F;
      std::memset(dg, 0, static_cast<size_t>(n * F) * sizeof(float));
      std::memset(du, 0, static_cast<size_t>(n * F) * sizeof(float));
      swiglu_backward(dg, du, da, h1 + r0 * F, h3 + r0 * F, n * F);
    } else {
      gelu_backward_inplace(da, h1 + r0 * F, n * F);
    }
    // h1 = xp @ w1^T (and h3 = xp @ w3^T):  dxp = dh1 @ w1 (+ dh3 @ w3),  dw1 += dh1^T @ xp
    gemm(false, false, n, C, F, 1.0f, dg, F, w1e, C, 0.0f, dx, C);
    if (dw1) linear_backward(nullptr, dw1 + e * F * C, dg, x, w1e, n, C, F);
    if (swiglu) {
      const float* du = dh3 + r0 * F;
      const float* w3e = w3 + e * F * C;
      gemm(false, false, n, C, F, 1.0f, du, F, w3e, C, 1.0f, dx, C);
      if (dw3) linear_backward(nullptr, dw3 + e * F * C, du, x, w3e, n, C, F);
    }
  }
}

std::vector<GemmShape> expert_gemm_shapes(int64_t rows, int64_t C, int64_t F) {
  const int64_t M = rows;
  return {{false, true, M, F, C},    // h1 = xp @ w1^T
          {false, true, M, C, F},    // out = act @ w2^T
          {false, false, M, F, C},   // dact = dout @ w2
          {true, false, C, F, M},    // dw2 += dout^T @ act
          {false, false, M, C, F},   // dxp = dh1 @ w1
          {true, false, F, C, M}};   // dw1 += dh1^T @ xp
}

}  // namespace moe
