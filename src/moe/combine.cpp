#include "moe/combine.h"

#include <cstring>

#include "tensor/ops.h"

namespace moe {

void dispatch_forward(float* xp, const float* x, const Routing& r, int64_t C) {
  gather_rows(xp, x, r.row_token.data(), r.rows(), C);
}

void dispatch_backward(float* dx, const float* dxp, const Routing& r, int64_t C) {
  scatter_add_rows(dx, dxp, r.row_token.data(), nullptr, r.rows(), r.N, C);
}

void combine_forward(float* y, float* row_weight, const float* outp, const Routing& r, int64_t C) {
  const int64_t R = r.rows();
  const int32_t* ra = r.row_assignment.data();
  const float* w = r.weight.data();
  for (int64_t i = 0; i < R; ++i) row_weight[i] = w[ra[i]];
  std::memset(y, 0, static_cast<size_t>(r.N * C) * sizeof(float));
  scatter_add_rows(y, outp, r.row_token.data(), row_weight, R, r.N, C);
}

void combine_backward(float* doutp, float* dgate, const float* dy, const float* outp, const Routing& r, int64_t C) {
  const int64_t R = r.rows();
  const int32_t* ra = r.row_assignment.data();
  const float* w = r.weight.data();
  gather_rows(doutp, dy, r.row_token.data(), R, C);  // doutp[r] = dy[n]; scaled below
  if (dgate) std::memset(dgate, 0, static_cast<size_t>(r.N * r.K) * sizeof(float));
#pragma omp parallel for schedule(static) if (R * C > 65536)
  for (int64_t i = 0; i < R; ++i) {
    float* d = doutp + i * C;
    if (dgate) {
      const float* o = outp + i * C;
      float dot = 0;
      for (int64_t c = 0; c < C; ++c) dot += d[c] * o[c];
      dgate[ra[i]] = dot;
    }
    const float s = w[ra[i]];
    for (int64_t c = 0; c < C; ++c) d[c] *= s;
  }
}

}  // namespace moe
