// MoeLayer: composes the phases router -> layout -> dispatch -> experts -> combine (see moe_layer.h).
#include "moe/moe_layer.h"

#include <stdexcept>
#include <string>

#include "moe/combine.h"
#include "moe/experts.h"
#include "moe/layout.h"
#include "moe/router.h"

namespace moe {

namespace {
const MoeConfig& validated(const MoeConfig& c, int64_t max_tokens) {
  auto fail = [](const std::string& m) { throw std::invalid_argument("MoeLayer config: " + m); };
  if (c.d_model <= 0) fail("d_model (" + std::to_string(c.d_model) + ") must be > 0");
  if (c.d_ffn <= 0) fail("d_ffn (" + std::to_string(c.d_ffn) + ") must be > 0");
  if (c.n_experts <= 0) fail("n_experts (" + std::to_string(c.n_experts) + ") must be > 0");
  if (c.top_k < 1 || c.top_k > c.n_experts)
    fail("top_k (" + std::to_string(c.top_k) + ") must be in [1, n_experts = " + std::to_string(c.n_experts) + "]");
  if (!(c.capacity_factor >= 0.0f)) fail("capacity_factor must be >= 0 (0 = dropless)");
  if (max_tokens <= 0 || max_tokens * c.top_k > INT32_MAX) fail("max_tokens out of range");
  return c;
}

ExpertShape expert_shape(const MoeConfig& c) { return ExpertShape{c.n_experts, c.d_model, c.d_ffn, c.activation}; }
}  // namespace

MoeLayer::MoeLayer(const std::string& prefix, const MoeConfig& cfg, int64_t max_tokens)
    : cfg_(validated(cfg, max_tokens)),
      max_tokens_(max_tokens),
      router_(prefix + "router.weight", {cfg.n_experts, cfg.d_model}),
      w1_(prefix + "w1", {cfg.n_experts, cfg.d_ffn, cfg.d_model}),
      w2_(prefix + "w2", {cfg.n_experts, cfg.d_model, cfg.d_ffn}),
      w3_(prefix + "w3", cfg.activation == Activation::swiglu
                             ? std::vector<int64_t>{cfg.n_experts, cfg.d_ffn, cfg.d_model}
                             : std::vector<int64_t>{0}) {
  const int64_t N = max_tokens, C = cfg.d_model, F = cfg.d_ffn, E = cfg.n_experts, K = cfg.top_k;
  const int64_t NK = N * K;
  const bool swiglu = cfg.activation == Activation::swiglu;
  routing_reserve(routing_, N, K, E);
  layout_scratch_.resize(layout_scratch_size(E, K));
  logits_.resize({N, E});
  probs_.resize({N, E});
  dprobs_.resize({N, E});
  dlogits_.resize({N, E});
  lse_.resize({N});
  load_frac_.resize({E});
  mean_prob_.resize({E});
  xp_.resize({NK, C});
  outp_.resize({NK, C});
  dout_p_.resize({NK, C});
  dxp_.resize({NK, C});
  h1_.resize({NK, F});
  act_.resize({NK, F});
  dact_.resize({NK, F});
  dh_.resize({NK, F});
  if (swiglu) {
    h3_.resize({NK, F});
    dh3_.resize({NK, F});
  }
  row_weight_.resize({NK});
  dgate_.resize({NK});
}

std::vector<Param*> MoeLayer::params() {
  std::vector<Param*> p{&router_, &w1_, &w2_};
  if (cfg_.activation == Activation::swiglu) p.push_back(&w3_);
  return p;
}

void MoeLayer::forward(float* y, const float* x, int64_t N) {
  if (N < 0 || N > max_tokens_)
    throw std::logic_error("MoeLayer::forward: REQUIRES 0 <= N (" + std::to_string(N) + ") <= max_tokens (" +
                           std::to_string(max_tokens_) + ")");
  const int64_t C = cfg_.d_model, E = cfg_.n_experts, K = cfg_.top_k;
  x_ = x;
  n_ = N;
  // router: gate choices and weights, then the losses (f_e counts choices before dropping)
  router_forward(logits_.data(), probs_.data(), routing_, x, router_.value.data(), N, C, E, K, cfg_.renormalize);
  RouterLosses l = router_loss_forward(lse_.data(), load_frac_.data(), mean_prob_.data(), logits_.data(),
                                       probs_.data(), routing_, N, E);
  aux_loss_ = l.aux;
  z_loss_ = l.z;
  // layout: expert-contiguous rows, capacity dropping in global order
  layout_build(routing_, expert_capacity(cfg_.capacity_factor, N, K, E), layout_scratch_.data());
  // dispatch -> experts -> combine
  dispatch_forward(xp_.data(), x, routing_, C);
  experts_forward(outp_.data(), h1_.data(), h3_.data(), act_.data(), xp_.data(), routing_.expert_offset.data(),
                  w1_.value.data(), w2_.value.data(), w3_.value.data(), expert_shape(cfg_));
  combine_forward(y, row_weight_.data(), outp_.data(), routing_, C);
}

void MoeLayer::backward(float* dx, const float* dy) {
  if (!x_) throw std::logic_error("MoeLayer::backward: REQUIRES forward() first");
  const int64_t N = n_, C = cfg_.d_model, E = cfg_.n_experts;
  combine_backward(dout_p_.data(), dgate_.data(), dy, outp_.data(), routing_, C);
  experts_backward(dxp_.data(), w1_.grad.data(), w2_.grad.data(), w3_.grad.data(), dact_.data(), dh_.data(),
                   dh3_.data(), dout_p_.data(), xp_.data(), h1_.data(), h3_.data(), act_.data(),
                   routing_.expert_offset.data(), w1_.value.data(), w2_.value.data(), w3_.value.data(),
                   expert_shape(cfg_));
  dispatch_backward(dx, dxp_.data(), routing_, C);
  router_backward(dx, router_.grad.data(), dprobs_.data(), dlogits_.data(), dgate_.data(), routing_, probs_.data(),
                  lse_.data(), load_frac_.data(), x_, router_.value.data(), N, C, E, cfg_.renormalize,
                  cfg_.aux_loss_weight, cfg_.z_loss_weight);
}

}  // namespace moe
