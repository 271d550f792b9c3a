// The single-GPU MoE layer (moe_layer.h): a fixed sequence of cuda/ops.h calls around a host layout
// built by the CPU layer's own layout code (moe/layout.h), so both keep and drop the same assignments.
#include "cuda/moe_layer.h"

#include <algorithm>
#include <tuple>

#include "cuda/ops.h"
#include "moe/layout.h"
#include "util/str_cat.h"

namespace moe::cuda {

namespace {

constexpr DType kF32 = DType::f32;  // the router's type (moe_layer.h)

Status alloc(DeviceBuffer& b, int64_t elements, size_t element_bytes) {
  return b.allocate(static_cast<size_t>(std::max<int64_t>(1, elements)) * element_bytes);
}

}  // namespace

MoeShape moe_shape(const moe::MoeConfig& c) {
  MoeShape s;
  s.C = c.d_model;
  s.F = c.d_ffn;
  s.E = c.n_experts;
  s.K = c.top_k;
  s.renormalize = c.renormalize;
  s.swiglu = c.activation == Activation::swiglu;
  s.capacity_factor = c.capacity_factor;
  s.aux_loss_weight = c.aux_loss_weight;
  s.z_loss_weight = c.z_loss_weight;
  s.router_bias = c.router_bias;
  return s;
}

Status MoeLayer::create(Context& ctx, DType dt, const MoeShape& s, int64_t max_tokens, std::unique_ptr<MoeLayer>* out) {
  if (s.C <= 0 || s.F <= 0 || s.E <= 0 || s.K < 1 || s.K > std::min<int64_t>(s.E, 16) || max_tokens <= 0)
    return Status::error(str_cat("cuda MoeLayer: bad shape C ", s.C, " F ", s.F, " E ", s.E, " K ", s.K,
                                 " max_tokens ", max_tokens, " (REQUIRES 1 <= K <= min(E, 16), dims > 0)"));
  if (!s.router_bias.empty() && static_cast<int64_t>(s.router_bias.size()) != s.E)
    return Status::error(str_cat("cuda MoeLayer: router_bias has ", s.router_bias.size(), " values, E is ", s.E));
  if (!(s.capacity_factor >= 0.0f))
    return Status::error("cuda MoeLayer: capacity_factor must be >= 0 (0 = dropless)");
  std::unique_ptr<MoeLayer> layer(new MoeLayer(ctx, dt, s, max_tokens));
  if (Status st = layer->allocate(); !st) return st;
  *out = std::move(layer);
  return Status::ok();
}

Status MoeLayer::allocate() {
  const size_t d = dtype_size(dt_), f = sizeof(float), i = sizeof(int32_t), f64 = sizeof(double);
  const int64_t C = s_.C, F = s_.F, E = s_.E, K = s_.K, N = max_n_, R = max_n_ * s_.K;
  for (auto [b, n, sz] : {std::tuple{&wg_, E * C, f}, {&w1_, E * F * C, d}, {&w2_, E * C * F, d}, {&dwg_, E * C, f},
                          {&dw1_, E * F * C, d}, {&dw2_, E * C * F, d}, {&logits_, N * E, f}, {&probs_, N * E, f},
                          {&top_values_, N * K, f}, {&top_index_, N * K, i}, {&gate_, N * K, f},
                          {&token_rows_, N * K, i}, {&row_token_, R, i}, {&ones_, N * K, f}, {&bias_, E, f},
                          {&lse_, N, f}, {&prob_sum_, E, f64}, {&load_frac_, E, f}, {&xp_, R * C, d},
                          {&h_, R * F, d}, {&act_, R * F, d}, {&out_rows_, R * C, d}, {&d_out_rows_, R * C, d},
                          {&dact_, R * F, d}, {&dh_, R * F, d}, {&dxp_, R * C, d}, {&dgate_, N * K, f},
                          {&dprobs_, N * E, f}, {&dlogits_, N * E, f}})
    if (Status st = alloc(*b, n, sz); !st) return st;
  if (dt_ != kF32)
    for (DeviceBuffer* b : {&x32_, &dx32_})
      if (Status st = alloc(*b, N * C, f); !st) return st;
  if (s_.swiglu)
    for (auto [b, n] : {std::pair{&w3_, E * F * C}, {&dw3_, E * F * C}, {&h3_, R * F}, {&dh3_, R * F}})
      if (Status st = alloc(*b, n, d); !st) return st;
  for (DeviceBuffer* b : {&wg_, &w1_, &w2_, &w3_, &dwg_, &dw1_, &dw2_, &dw3_})
    if (Status st = fill_zero(ctx_, b->get(), static_cast<int64_t>(b->bytes())); !st) return st;
  const std::vector<float> ones(static_cast<size_t>(N * K), 1.0f);
  if (Status st = copy_to_device(ctx_, ones_.get(), ones.data(), ones.size() * sizeof(float)); !st) return st;
  if (!s_.router_bias.empty())
    if (Status st = copy_to_device(ctx_, bias_.get(), s_.router_bias.data(), s_.router_bias.size() * sizeof(float)); !st)
      return st;
  moe::routing_reserve(routing_, N, K, E);
  layout_scratch_.resize(static_cast<size_t>(moe::layout_scratch_size(E, K)));
  return Status::ok();
}

Status MoeLayer::forward(void* y, const void* x, int64_t N) {
  if (N < 0 || N > max_n_) return Status::error(str_cat("cuda MoeLayer::forward: N ", N, " > max_tokens ", max_n_));
  const int64_t C = s_.C, F = s_.F, E = s_.E, K = s_.K;
  n_ = N;
  // router, in f32 (x [N,C] widened first under bf16): logits [N,E] (+ bias), probs [N,E], top-k
  // [N,K], gate weights [N,K]; the losses' statistics
  x_ = static_cast<const float*>(x);
  if (dt_ != kF32) {
    if (Status st = cast_to_f32(ctx_, dt_, x32_.as<float>(), x, N * C); !st) return st;
    x_ = x32_.as<float>();
  }
  if (Status st = linear_forward(ctx_, kF32, logits_.get(), x_, wg_.get(), N, C, E); !st) return st;
  if (!s_.router_bias.empty())
    if (Status st = add_row_vector(ctx_, kF32, logits_.get(), bias_.as<float>(), 1.0f, N, E); !st) return st;
  if (Status st = softmax_forward(ctx_, kF32, probs_.get(), logits_.get(), N, E); !st) return st;
  if (Status st = topk_forward(ctx_, kF32, top_values_.as<float>(), top_index_.as<int32_t>(), probs_.get(), N, E, K);
      !st)
    return st;
  if (Status st = gate_weights_forward(ctx_, gate_.as<float>(), top_values_.as<float>(), N, K, s_.renormalize); !st)
    return st;
  if (Status st = router_stats_forward(ctx_, kF32, lse_.as<float>(), prob_sum_.as<double>(), logits_.get(),
                                       probs_.get(), N, E);
      !st)
    return st;
  // To the host (each copy waits for the stream): the choices, lse [N] and the probability sums [E].
  routing_.N = N;
  routing_.K = K;
  routing_.E = E;
  routing_.expert.resize(static_cast<size_t>(N * K));
  routing_.weight.assign(static_cast<size_t>(N * K), 0.0f);  // layout_build zeroes dropped ones; unused here
  routing_.prob.clear();
  host_lse_.resize(static_cast<size_t>(N));
  host_prob_sum_.resize(static_cast<size_t>(E));
  if (Status st = copy_to_host(ctx_, routing_.expert.data(), top_index_.get(), routing_.expert.size() * sizeof(int32_t));
      !st)
    return st;
  if (Status st = copy_to_host(ctx_, host_lse_.data(), lse_.get(), host_lse_.size() * sizeof(float)); !st) return st;
  if (Status st = copy_to_host(ctx_, host_prob_sum_.data(), prob_sum_.get(), host_prob_sum_.size() * sizeof(double));
      !st)
    return st;
  // Losses, exactly as router_loss_forward: f_e over the N*K choices before dropping (float), P_e and
  // the sums in double.
  host_load_frac_.assign(static_cast<size_t>(E), 0.0f);
  aux_loss_ = z_loss_ = 0;
  if (N > 0) {
    for (int32_t e : routing_.expert) host_load_frac_[e] += 1.0f;
    const float inv_nk = 1.0f / static_cast<float>(N * K);
    for (float& lf : host_load_frac_) lf *= inv_nk;
    double z = 0, aux = 0;
    for (float l : host_lse_) z += static_cast<double>(l) * l;
    for (int64_t e = 0; e < E; ++e)
      aux += static_cast<double>(host_load_frac_[e]) * (host_prob_sum_[e] / static_cast<double>(N));
    aux_loss_ = static_cast<float>(static_cast<double>(E) * aux);
    z_loss_ = static_cast<float>(z / static_cast<double>(N));
  }
  // Layout: the CPU layer's (expert-contiguous rows in token order, capacity in the global order).
  moe::layout_build(routing_, moe::expert_capacity(s_.capacity_factor, N, K, E), layout_scratch_.data());
  rows_ = routing_.rows();
  host_token_rows_.assign(static_cast<size_t>(N * K), -1);
  for (int64_t r = 0; r < rows_; ++r) host_token_rows_[routing_.row_assignment[r]] = static_cast<int32_t>(r);
  // Pageable-memory uploads: each returns once its source is staged (the vectors live on anyway).
  MOE_CUDA_TRY(cudaMemcpyAsync(token_rows_.get(), host_token_rows_.data(), host_token_rows_.size() * sizeof(int32_t),
                               cudaMemcpyHostToDevice, ctx_.stream()),
               "cuda MoeLayer: layout upload");
  MOE_CUDA_TRY(cudaMemcpyAsync(row_token_.get(), routing_.row_token.data(), routing_.row_token.size() * sizeof(int32_t),
                               cudaMemcpyHostToDevice, ctx_.stream()),
               "cuda MoeLayer: layout upload");
  MOE_CUDA_TRY(cudaMemcpyAsync(load_frac_.get(), host_load_frac_.data(), host_load_frac_.size() * sizeof(float),
                               cudaMemcpyHostToDevice, ctx_.stream()),
               "cuda MoeLayer: load fractions upload");
  // experts over the R kept rows: xp [R,C] -> h [R,F] (h3 [R,F]) -> act [R,F] -> out_rows [R,C]
  const int64_t R = rows_;
  const int64_t* off = routing_.expert_offset.data();
  if (Status st = gather_rows(ctx_, dt_, xp_.get(), x, row_token_.as<int32_t>(), R, C); !st) return st;
  if (Status st = grouped_gemm(ctx_, dt_, true, h_.get(), xp_.get(), w1_.get(), off, E, C, F, 1.0f, 0.0f); !st)
    return st;
  if (s_.swiglu) {
    if (Status st = grouped_gemm(ctx_, dt_, true, h3_.get(), xp_.get(), w3_.get(), off, E, C, F, 1.0f, 0.0f); !st)
      return st;
    if (Status st = swiglu_forward(ctx_, dt_, act_.get(), h_.get(), h3_.get(), R * F); !st) return st;
  } else {
    if (Status st = gelu_forward(ctx_, dt_, act_.get(), h_.get(), R * F); !st) return st;
  }
  if (Status st = grouped_gemm(ctx_, dt_, true, out_rows_.get(), act_.get(), w2_.get(), off, E, F, C, 1.0f, 0.0f); !st)
    return st;
  // y [N,C] = sum_k gate[n,k] * out_rows[row(n,k)] over the kept assignments
  return combine_rows(ctx_, dt_, y, out_rows_.get(), token_rows_.as<int32_t>(), gate_.as<float>(), N, K, C, false);
}

Status MoeLayer::backward(void* dx, const void* dy) {
  if (!x_) return Status::error("cuda MoeLayer::backward: REQUIRES a forward first");
  const int64_t C = s_.C, F = s_.F, E = s_.E, K = s_.K, N = n_, R = rows_;
  const size_t d = dtype_size(dt_);
  const int64_t* off = routing_.expert_offset.data();
  // combine: d(out rows) [R,C] (every kept row is written) and d(gate weights) [N,K] (0 where dropped)
  if (Status st = fill_zero(ctx_, dgate_.get(), N * K * static_cast<int64_t>(sizeof(float))); !st) return st;
  if (Status st = combine_rows_backward(ctx_, dt_, d_out_rows_.get(), dgate_.as<float>(), dy, out_rows_.get(),
                                        token_rows_.as<int32_t>(), gate_.as<float>(), N, K, C);
      !st)
    return st;
  // second expert GEMM: out = act w2[e]^T  ->  dact [R,F] = dout w2[e];  dw2[e] += dout^T act
  if (Status st = grouped_gemm(ctx_, dt_, false, dact_.get(), d_out_rows_.get(), w2_.get(), off, E, C, F, 1.0f, 0.0f);
      !st)
    return st;
  if (Status st = grouped_gemm_weight_grad(ctx_, dt_, dw2_.get(), d_out_rows_.get(), act_.get(), off, E, F, C, 1.0f,
                                           1.0f);
      !st)
    return st;
  // activation (its backward accumulates: start from zero): dh [R,F] (and dh3 [R,F])
  if (Status st = fill_zero(ctx_, dh_.get(), R * F * static_cast<int64_t>(d)); !st) return st;
  if (s_.swiglu) {
    if (Status st = fill_zero(ctx_, dh3_.get(), R * F * static_cast<int64_t>(d)); !st) return st;
    if (Status st = swiglu_backward(ctx_, dt_, dh_.get(), dh3_.get(), dact_.get(), h_.get(), h3_.get(), R * F); !st)
      return st;
  } else {
    if (Status st = gelu_backward(ctx_, dt_, dh_.get(), dact_.get(), h_.get(), R * F); !st) return st;
  }
  // first expert GEMM(s): h = xp w1[e]^T (h3 = xp w3[e]^T)  ->  dxp [R,C] = dh w1[e] (+ dh3 w3[e]);
  // dw1[e] += dh^T xp (dw3[e] += dh3^T xp)
  if (Status st = grouped_gemm(ctx_, dt_, false, dxp_.get(), dh_.get(), w1_.get(), off, E, F, C, 1.0f, 0.0f); !st)
    return st;
  if (Status st = grouped_gemm_weight_grad(ctx_, dt_, dw1_.get(), dh_.get(), xp_.get(), off, E, C, F, 1.0f, 1.0f); !st)
    return st;
  if (s_.swiglu) {
    if (Status st = grouped_gemm(ctx_, dt_, false, dxp_.get(), dh3_.get(), w3_.get(), off, E, F, C, 1.0f, 1.0f); !st)
      return st;
    if (Status st = grouped_gemm_weight_grad(ctx_, dt_, dw3_.get(), dh3_.get(), xp_.get(), off, E, C, F, 1.0f, 1.0f);
        !st)
      return st;
  }
  // un-permute the token gradients: dx[n] += sum_k dxp[row(n,k)] over the kept assignments
  if (Status st = combine_rows(ctx_, dt_, dx, dxp_.get(), token_rows_.as<int32_t>(), ones_.as<float>(), N, K, C, true);
      !st)
    return st;
  // router, in f32 (moe/router.cpp's router_backward): dprobs [N,E] = gate-weight term + aux term;
  // dlogits [N,E] = softmax_backward(dprobs) + z term; then x and wg.
  if (Status st = gate_weights_backward(ctx_, kF32, dprobs_.get(), dgate_.as<float>(), top_values_.as<float>(),
                                        top_index_.as<int32_t>(), N, E, K, s_.renormalize);
      !st)
    return st;
  const float n_mean = static_cast<float>(N);
  if (s_.aux_loss_weight != 0.0f && N > 0) {
    // d aux / d probs[n,e] = E f_e / N (f_e a constant: Switch Transformer)
    const float aux_scale = s_.aux_loss_weight * static_cast<float>(E) / n_mean;
    if (Status st = add_row_vector(ctx_, kF32, dprobs_.get(), load_frac_.as<float>(), aux_scale, N, E); !st) return st;
  }
  if (Status st = fill_zero(ctx_, dlogits_.get(), N * E * static_cast<int64_t>(sizeof(float))); !st) return st;
  if (Status st = softmax_backward(ctx_, kF32, dlogits_.get(), dprobs_.get(), probs_.get(), N, E); !st) return st;
  if (s_.z_loss_weight != 0.0f && N > 0) {
    // d z / d logits[n,e] = 2 lse_n probs[n,e] / N
    const float z_scale = s_.z_loss_weight * 2.0f / n_mean;
    if (Status st = router_z_backward(ctx_, kF32, dlogits_.get(), lse_.as<float>(), probs_.get(), z_scale, N, E); !st)
      return st;
  }
  if (dt_ == kF32) return linear_backward(ctx_, kF32, dx, dwg_.get(), dlogits_.get(), x_, wg_.get(), N, C, E);
  // dx [N,C] is in dt and holds the experts' share (rounded by the combine): widened into dx32, it
  // gets the router's share in f32, and the sum is rounded back into dx.
  if (Status st = cast_to_f32(ctx_, dt_, dx32_.as<float>(), dx, N * C); !st) return st;
  if (Status st = linear_backward(ctx_, kF32, dx32_.get(), dwg_.get(), dlogits_.get(), x_, wg_.get(), N, C, E); !st)
    return st;
  return cast_f32_to(ctx_, dt_, dx, dx32_.as<float>(), N * C);
}

double MoeLayer::flops_forward_backward() const {
  // forward: router 2NCE, experts 2 * 2RCF (SwiGLU: 3 * 2RCF); backward: twice each
  const double router = 2.0 * n_ * s_.C * s_.E, experts = (s_.swiglu ? 6.0 : 4.0) * rows_ * s_.C * s_.F;
  return 3.0 * (router + experts);
}

}  // namespace moe::cuda
