// The single-GPU MoE layer (moe_layer.h): a fixed sequence of cuda/ops.h calls.
#include "cuda/moe_layer.h"

#include <algorithm>
#include <tuple>

#include "cuda/ops.h"
#include "util/str_cat.h"

namespace moe::cuda {

namespace {

Status alloc(DeviceBuffer& b, int64_t elements, size_t element_bytes) {
  return b.allocate(static_cast<size_t>(std::max<int64_t>(1, elements)) * element_bytes);
}

}  // namespace

Status MoeLayer::create(Context& ctx, DType dt, const MoeShape& s, int64_t max_tokens, std::unique_ptr<MoeLayer>* out) {
  if (s.C <= 0 || s.F <= 0 || s.E <= 0 || s.K < 1 || s.K > std::min<int64_t>(s.E, 16) || max_tokens <= 0)
    return Status::error(str_cat("cuda MoeLayer: bad shape C ", s.C, " F ", s.F, " E ", s.E, " K ", s.K,
                                 " max_tokens ", max_tokens, " (REQUIRES 1 <= K <= min(E, 16), dims > 0)"));
  std::unique_ptr<MoeLayer> layer(new MoeLayer(ctx, dt, s, max_tokens));
  if (Status st = layer->allocate(); !st) return st;
  *out = std::move(layer);
  return Status::ok();
}

Status MoeLayer::allocate() {
  const size_t d = dtype_size(dt_), f = sizeof(float), i = sizeof(int32_t);
  const int64_t C = s_.C, F = s_.F, E = s_.E, K = s_.K, N = max_n_, R = max_n_ * s_.K;
  for (auto [b, n, sz] : {std::tuple{&wg_, E * C, d}, {&w1_, E * F * C, d}, {&w2_, E * C * F, d}, {&dwg_, E * C, d},
                          {&dw1_, E * F * C, d}, {&dw2_, E * C * F, d}, {&logits_, N * E, d}, {&probs_, N * E, d},
                          {&top_values_, N * K, f}, {&top_index_, N * K, i}, {&gate_, N * K, f},
                          {&token_rows_, N * K, i}, {&row_token_, R, i}, {&ones_, N * K, f}, {&xp_, R * C, d},
                          {&h_, R * F, d}, {&act_, R * F, d}, {&out_rows_, R * C, d}, {&d_out_rows_, R * C, d},
                          {&dact_, R * F, d}, {&dh_, R * F, d}, {&dxp_, R * C, d}, {&dgate_, N * K, f},
                          {&dprobs_, N * E, d}, {&dlogits_, N * E, d}})
    if (Status st = alloc(*b, n, sz); !st) return st;
  for (DeviceBuffer* b : {&wg_, &w1_, &w2_, &dwg_, &dw1_, &dw2_})
    if (Status st = fill_zero(ctx_, b->get(), static_cast<int64_t>(b->bytes())); !st) return st;
  const std::vector<float> ones(static_cast<size_t>(N * K), 1.0f);
  return copy_to_device(ctx_, ones_.get(), ones.data(), ones.size() * sizeof(float));
}

Status MoeLayer::forward(void* y, const void* x, int64_t N) {
  if (N < 0 || N > max_n_) return Status::error(str_cat("cuda MoeLayer::forward: N ", N, " > max_tokens ", max_n_));
  const int64_t C = s_.C, F = s_.F, E = s_.E, K = s_.K;
  n_ = N;
  x_ = x;
  // router
  if (Status st = linear_forward(ctx_, dt_, logits_.get(), x, wg_.get(), N, C, E); !st) return st;
  if (Status st = softmax_forward(ctx_, dt_, probs_.get(), logits_.get(), N, E); !st) return st;
  if (Status st = topk_forward(ctx_, dt_, top_values_.as<float>(), top_index_.as<int32_t>(), probs_.get(), N, E, K); !st)
    return st;
  if (Status st = gate_weights_forward(ctx_, gate_.as<float>(), top_values_.as<float>(), N, K, s_.renormalize); !st)
    return st;
  // layout on the host: counts -> offsets -> each assignment's row (expert-contiguous, token order within)
  host_index_.resize(static_cast<size_t>(N * K));
  if (Status st = copy_to_host(ctx_, host_index_.data(), top_index_.get(), host_index_.size() * sizeof(int32_t)); !st)
    return st;
  off_.assign(static_cast<size_t>(E + 1), 0);
  for (int32_t e : host_index_) ++off_[static_cast<size_t>(e) + 1];
  for (int64_t e = 0; e < E; ++e) off_[e + 1] += off_[e];
  rows_ = off_[E];
  std::vector<int64_t> next(off_.begin(), off_.end() - 1);
  host_token_rows_.resize(host_index_.size());
  host_row_token_.resize(static_cast<size_t>(rows_));
  for (int64_t a = 0; a < N * K; ++a) {
    const int64_t r = next[host_index_[a]]++;
    host_token_rows_[a] = static_cast<int32_t>(r);
    host_row_token_[r] = static_cast<int32_t>(a / K);
  }
  MOE_CUDA_TRY(cudaMemcpyAsync(token_rows_.get(), host_token_rows_.data(), host_token_rows_.size() * sizeof(int32_t),
                               cudaMemcpyHostToDevice, ctx_.stream()),
               "cuda MoeLayer: layout upload");
  MOE_CUDA_TRY(cudaMemcpyAsync(row_token_.get(), host_row_token_.data(), host_row_token_.size() * sizeof(int32_t),
                               cudaMemcpyHostToDevice, ctx_.stream()),
               "cuda MoeLayer: layout upload");
  // experts
  const int64_t R = rows_;
  if (Status st = gather_rows(ctx_, dt_, xp_.get(), x, row_token_.as<int32_t>(), R, C); !st) return st;
  if (Status st = grouped_gemm(ctx_, dt_, true, h_.get(), xp_.get(), w1_.get(), off_.data(), E, C, F, 1.0f, 0.0f); !st)
    return st;
  if (Status st = gelu_forward(ctx_, dt_, act_.get(), h_.get(), R * F); !st) return st;
  if (Status st = grouped_gemm(ctx_, dt_, true, out_rows_.get(), act_.get(), w2_.get(), off_.data(), E, F, C, 1.0f, 0.0f);
      !st)
    return st;
  return combine_rows(ctx_, dt_, y, out_rows_.get(), token_rows_.as<int32_t>(), gate_.as<float>(), N, K, C, false);
}

Status MoeLayer::backward(void* dx, const void* dy) {
  if (!x_) return Status::error("cuda MoeLayer::backward: REQUIRES a forward first");
  const int64_t C = s_.C, F = s_.F, E = s_.E, K = s_.K, N = n_, R = rows_;
  const size_t d = dtype_size(dt_);
  // combine: d(out rows) and d(gate weights)
  if (Status st = fill_zero(ctx_, dgate_.get(), N * K * static_cast<int64_t>(sizeof(float))); !st) return st;
  if (Status st = combine_rows_backward(ctx_, dt_, d_out_rows_.get(), dgate_.as<float>(), dy, out_rows_.get(),
                                        token_rows_.as<int32_t>(), gate_.as<float>(), N, K, C);
      !st)
    return st;
  // second expert GEMM: out = act w2[e]^T  ->  dact = dout w2[e];  dw2[e] += dout^T act
  if (Status st = grouped_gemm(ctx_, dt_, false, dact_.get(), d_out_rows_.get(), w2_.get(), off_.data(), E, C, F, 1.0f,
                               0.0f);
      !st)
    return st;
  if (Status st = grouped_gemm_weight_grad(ctx_, dt_, dw2_.get(), d_out_rows_.get(), act_.get(), off_.data(), E, F, C,
                                           1.0f, 1.0f);
      !st)
    return st;
  // GELU (gelu_backward accumulates: start from zero)
  if (Status st = fill_zero(ctx_, dh_.get(), R * F * static_cast<int64_t>(d)); !st) return st;
  if (Status st = gelu_backward(ctx_, dt_, dh_.get(), dact_.get(), h_.get(), R * F); !st) return st;
  // first expert GEMM: h = xp w1[e]^T  ->  dxp = dh w1[e];  dw1[e] += dh^T xp
  if (Status st = grouped_gemm(ctx_, dt_, false, dxp_.get(), dh_.get(), w1_.get(), off_.data(), E, F, C, 1.0f, 0.0f); !st)
    return st;
  if (Status st = grouped_gemm_weight_grad(ctx_, dt_, dw1_.get(), dh_.get(), xp_.get(), off_.data(), E, C, F, 1.0f, 1.0f);
      !st)
    return st;
  // un-permute the token gradients: dx[n] += sum_k dxp[row(n,k)]
  if (Status st = combine_rows(ctx_, dt_, dx, dxp_.get(), token_rows_.as<int32_t>(), ones_.as<float>(), N, K, C, true);
      !st)
    return st;
  // router: gate weights -> probs -> logits -> x, wg
  if (Status st = gate_weights_backward(ctx_, dt_, dprobs_.get(), dgate_.as<float>(), top_values_.as<float>(),
                                        top_index_.as<int32_t>(), N, E, K, s_.renormalize);
      !st)
    return st;
  if (Status st = fill_zero(ctx_, dlogits_.get(), N * E * static_cast<int64_t>(d)); !st) return st;
  if (Status st = softmax_backward(ctx_, dt_, dlogits_.get(), dprobs_.get(), probs_.get(), N, E); !st) return st;
  return linear_backward(ctx_, dt_, dx, dwg_.get(), dlogits_.get(), x_, wg_.get(), N, C, E);
}

double MoeLayer::flops_forward_backward() const {
  // forward: router 2NCE, experts 2 * 2RCF; backward: twice each
  const double router = 2.0 * n_ * s_.C * s_.E, experts = 4.0 * rows_ * s_.C * s_.F;
  return 3.0 * (router + experts);
}

}  // namespace moe::cuda
