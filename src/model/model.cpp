#include "model/model.h"

#include <cstring>
#include <random>
#include <stdexcept>

#include "model/data.h"
#include "tensor/ops.h"

namespace moe {

namespace {

bool ends_with(const std::string& s, const char* suffix) {
  const size_t n = std::strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

// Zeroes the first n floats of t (the part the current batch uses).
void zero_n(Tensor& t, int64_t n) { std::memset(t.data(), 0, static_cast<size_t>(n) * sizeof(float)); }

// out = a + b over n floats.
void add_to(float* out, const float* a, const float* b, int64_t n) {
  std::memcpy(out, a, static_cast<size_t>(n) * sizeof(float));
  add_inplace(out, b, n);
}

// How a parameter starts, from its name (docs/model.md, "Parameters").
struct InitRule {
  enum Kind { normal, ones, zeros } kind;
  double std = 0;
};

InitRule init_rule(const std::string& name, int64_t n_layers) {
  const double base = 0.02;
  const double scaled = 0.02 / std::sqrt(2.0 * static_cast<double>(n_layers));
  if (ends_with(name, ".bias")) return {InitRule::zeros};
  if (ends_with(name, "norm1.weight") || ends_with(name, "norm2.weight") || name == "norm_f.weight")
    return {InitRule::ones};
  if (ends_with(name, ".attn.proj.weight") || ends_with(name, ".moe.w2") || ends_with(name, ".mlp.w2"))
    return {InitRule::normal, scaled};
  if (name == "wte.weight" || name == "wpe.weight" || ends_with(name, ".attn.qkv.weight") ||
      ends_with(name, ".moe.router.weight") || ends_with(name, ".moe.w1") || ends_with(name, ".moe.w3") ||
      ends_with(name, ".mlp.w1") || ends_with(name, ".mlp.w3"))
    return {InitRule::normal, base};
  throw std::logic_error("Model::init: no init rule for parameter " + name);
}

// n values std * N(0,1) from gen: Box-Muller on 53-bit uniforms in (0,1), both outputs used.
void fill_normal(float* x, size_t n, std::mt19937_64& gen, double std) {
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  auto uniform = [&gen] { return (static_cast<double>(gen() >> 11) + 0.5) * 0x1.0p-53; };
  for (size_t i = 0; i < n; i += 2) {
    const double r = std::sqrt(-2.0 * std::log(uniform()));
    const double theta = kTwoPi * uniform();
    x[i] = static_cast<float>(std * r * std::cos(theta));
    if (i + 1 < n) x[i + 1] = static_cast<float>(std * r * std::sin(theta));
  }
}

}  // namespace

uint64_t param_seed(uint64_t seed, const std::string& name) {
  return splitmix64(fnv1a64(name.data(), name.size()) ^ splitmix64(seed));
}

// One transformer block: its parameters and the activations of the last forward (for backward).
// Shapes use N = B*T rows; buffers are sized for max_batch * seq_len.
struct Model::Block {
  int64_t index = 0;
  Param* norm1_w = nullptr;  // [C]
  Param* norm1_b = nullptr;  // [C] LayerNorm only
  Param* qkv_w = nullptr;    // [3C,C]
  Param* proj_w = nullptr;   // [C,C]
  Param* norm2_w = nullptr;  // [C]
  Param* norm2_b = nullptr;  // [C] LayerNorm only
  std::unique_ptr<MoeLayer> moe;  // MoE block
  Param* mlp_w1 = nullptr;   // [F,C] dense block
  Param* mlp_w2 = nullptr;   // [C,F] dense block
  Param* mlp_w3 = nullptr;   // [F,C] dense block, SwiGLU only

  Tensor ln1;        // [B,T,C] norm1(x)
  Tensor ln1_mean;   // [B,T] (LayerNorm only)
  Tensor ln1_rstd;   // [B,T]
  Tensor qkv;        // [B,T,3C]
  Tensor att;        // [B,NH,T,T] softmax probabilities
  Tensor atty;       // [B,T,C] attention output, heads concatenated (before proj)
  Tensor resid_mid;  // [B,T,C] h = x + proj(atty)
  Tensor ln2;        // [B,T,C] norm2(h), the FFN input (the MoE layer keeps a pointer to it)
  Tensor ln2_mean;   // [B,T] (LayerNorm only)
  Tensor ln2_rstd;   // [B,T]
  Tensor h1;         // [B,T,F] dense: ln2 @ w1^T (GELU input, or SwiGLU gate)
  Tensor h3;         // [B,T,F] dense SwiGLU: ln2 @ w3^T (up)
  Tensor act;        // [B,T,F] dense: gelu(h1) or silu(h1) * h3
  Tensor out;        // [B,T,C] block output h + ffn(ln2): the next block's input
};

Param* Model::add_param(const std::string& name, std::vector<int64_t> shape, bool decay) {
  owned_.push_back(std::make_unique<Param>(name, std::move(shape), decay));
  params_.push_back(owned_.back().get());
  return owned_.back().get();
}

Model::Model(const ModelConfig& cfg, int64_t max_batch) : cfg_(cfg), max_batch_(max_batch) {
  if (Status s = cfg.validate(); !s) throw std::invalid_argument(s.message());
  if (max_batch < 1) throw std::invalid_argument("Model: max_batch (" + std::to_string(max_batch) + ") must be >= 1");
  const int64_t V = cfg.vocab_size, T = cfg.seq_len, C = cfg.d_model, F = cfg.d_ffn, NH = cfg.n_heads;
  const int64_t B = max_batch, N = B * T;
  const bool ln = !cfg.use_rmsnorm();
  const bool swiglu = cfg.activation_kind() == Activation::swiglu;

  wte_ = add_param("wte.weight", {V, C}, true);
  wpe_ = add_param("wpe.weight", {T, C}, true);
  for (int64_t l = 0; l < cfg.n_layers; ++l) {
    auto b = std::make_unique<Block>();
    const std::string p = "blocks." + std::to_string(l) + ".";
    b->index = l;
    b->norm1_w = add_param(p + "norm1.weight", {C}, false);
    if (ln) b->norm1_b = add_param(p + "norm1.bias", {C}, false);
    b->qkv_w = add_param(p + "attn.qkv.weight", {3 * C, C}, true);
    b->proj_w = add_param(p + "attn.proj.weight", {C, C}, true);
    b->norm2_w = add_param(p + "norm2.weight", {C}, false);
    if (ln) b->norm2_b = add_param(p + "norm2.bias", {C}, false);
    if (cfg.is_moe_layer(l)) {
      b->moe = std::make_unique<MoeLayer>(p + "moe.", cfg.moe_config(l), N);
      for (Param* q : b->moe->params()) params_.push_back(q);
    } else {
      b->mlp_w1 = add_param(p + "mlp.w1", {F, C}, true);
      b->mlp_w2 = add_param(p + "mlp.w2", {C, F}, true);
      if (swiglu) b->mlp_w3 = add_param(p + "mlp.w3", {F, C}, true);
      b->h1.resize({B, T, F});
      if (swiglu) b->h3.resize({B, T, F});
      b->act.resize({B, T, F});
    }
    b->ln1.resize({B, T, C});
    if (ln) b->ln1_mean.resize({B, T});
    b->ln1_rstd.resize({B, T});
    b->qkv.resize({B, T, 3 * C});
    b->att.resize({B, NH, T, T});
    b->atty.resize({B, T, C});
    b->resid_mid.resize({B, T, C});
    b->ln2.resize({B, T, C});
    if (ln) b->ln2_mean.resize({B, T});
    b->ln2_rstd.resize({B, T});
    b->out.resize({B, T, C});
    blocks_.push_back(std::move(b));
  }
  normf_w_ = add_param("norm_f.weight", {C}, false);
  if (ln) normf_b_ = add_param("norm_f.bias", {C}, false);

  tokens_.resize(static_cast<size_t>(N));
  targets_.resize(static_cast<size_t>(N));
  encoded_.resize({B, T, C});
  lnf_.resize({B, T, C});
  if (ln) lnf_mean_.resize({B, T});
  lnf_rstd_.resize({B, T});
  logits_.resize({B, T, V});
  probs_.resize({B, T, V});
  preatt_.resize({B, NH, T, T});
  tmp_.resize({B, T, C});
  dlogits_.resize({B, T, V});
  dres_.resize({B, T, C});
  dln_.resize({B, T, C});
  datty_.resize({B, T, C});
  dqkv_.resize({B, T, 3 * C});
  datt_.resize({B, NH, T, T});
  dpreatt_.resize({B, NH, T, T});
  bool any_dense = false;
  for (int64_t l = 0; l < cfg.n_layers; ++l) any_dense |= !cfg.is_moe_layer(l);
  if (any_dense) {
    dh1_.resize({B, T, F});
    if (swiglu) dh3_.resize({B, T, F});
    dact_.resize({B, T, F});
  }
}

Model::~Model() = default;

int64_t Model::num_params() const {
  int64_t n = 0;
  for (const Param* p : params_) n += static_cast<int64_t>(p->value.numel());
  return n;
}

MoeLayer* Model::moe_layer(int64_t l) const {
  if (l < 0 || l >= static_cast<int64_t>(blocks_.size())) throw std::out_of_range("Model::moe_layer: bad block");
  return blocks_[l]->moe.get();
}

void Model::set_router_step(int64_t step) {
  if (!cfg_.router_bias_drifts()) return;
  for (int64_t l = 0; l < n_blocks(); ++l)
    if (MoeLayer* m = moe_layer(l)) m->set_router_bias(cfg_.router_bias(l, step));
}

void Model::init(uint64_t seed) {
  for (Param* p : params_) {
    const InitRule r = init_rule(p->name, cfg_.n_layers);
    float* v = p->value.data();
    const size_t n = p->value.numel();
    switch (r.kind) {
      case InitRule::ones:
        for (size_t i = 0; i < n; ++i) v[i] = 1.0f;
        break;
      case InitRule::zeros:
        p->value.zero();
        break;
      case InitRule::normal: {
        std::mt19937_64 gen(param_seed(seed, p->name));
        fill_normal(v, n, gen, r.std);
        break;
      }
    }
  }
}

void Model::zero_grad() {
  for (Param* p : params_) p->grad.zero();
}

void Model::norm_forward(float* out, float* mean, float* rstd, const float* inp, const Param* w, const Param* b,
                         int64_t N) const {
  const int64_t C = cfg_.d_model;
  if (cfg_.use_rmsnorm()) {
    rmsnorm_forward(out, rstd, inp, w->value.data(), N, C, kNormEps);
  } else {
    layernorm_forward(out, mean, rstd, inp, w->value.data(), b->value.data(), N, C, kNormEps);
  }
}

void Model::norm_backward(float* dinp, Param* w, Param* b, const float* dout, const float* inp, const float* mean,
                          const float* rstd, int64_t N) const {
  const int64_t C = cfg_.d_model;
  if (cfg_.use_rmsnorm()) {
    rmsnorm_backward(dinp, w->grad.data(), dout, inp, w->value.data(), rstd, N, C);
  } else {
    layernorm_backward(dinp, w->grad.data(), b->grad.data(), dout, inp, w->value.data(), mean, rstd, N, C);
  }
}

void Model::begin_step(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T) {
  if (T == 0) T = cfg_.seq_len;
  if (B < 1 || B > max_batch_)
    throw std::logic_error("Model::forward: B (" + std::to_string(B) + ") not in [1, max_batch]");
  if (T < 1 || T > cfg_.seq_len)
    throw std::logic_error("Model::forward: T (" + std::to_string(T) + ") not in [1, seq_len]");
  const int64_t V = cfg_.vocab_size, N = B * T;
  for (int64_t i = 0; i < N; ++i) {
    if (tokens[i] < 0 || tokens[i] >= V) throw std::logic_error("Model::forward: token out of [0, V)");
    if (targets && (targets[i] < 0 || targets[i] >= V))
      throw std::logic_error("Model::forward: target out of [0, V)");
  }
  B_ = B;
  T_ = T;
  have_targets_ = targets != nullptr;
  loss_ = std::nan("");
  std::memcpy(tokens_.data(), tokens, static_cast<size_t>(N) * sizeof(int32_t));
  if (targets) std::memcpy(targets_.data(), targets, static_cast<size_t>(N) * sizeof(int32_t));
}

const float* Model::block_input(int64_t l) const {
  return l == 0 ? encoded_.data() : blocks_[l - 1]->out.data();
}

void Model::embed_forward() {
  embedding_forward(encoded_.data(), tokens_.data(), wte_->value.data(), wpe_->value.data(), B_, T_, cfg_.d_model);
}

void Model::attn_forward(int64_t l) {
  Block& b = *blocks_.at(l);
  const int64_t C = cfg_.d_model, NH = cfg_.n_heads, N = B_ * T_;
  const float* x = block_input(l);
  // h = x + proj(attention(qkv(norm1(x)))); then the FFN input norm2(h)
  norm_forward(b.ln1.data(), b.ln1_mean.data(), b.ln1_rstd.data(), x, b.norm1_w, b.norm1_b, N);
  linear_forward(b.qkv.data(), b.ln1.data(), b.qkv_w->value.data(), N, C, 3 * C);
  attention_forward(b.atty.data(), preatt_.data(), b.att.data(), b.qkv.data(), B_, T_, C, NH);
  linear_forward(tmp_.data(), b.atty.data(), b.proj_w->value.data(), N, C, C);
  add_to(b.resid_mid.data(), x, tmp_.data(), N * C);
  norm_forward(b.ln2.data(), b.ln2_mean.data(), b.ln2_rstd.data(), b.resid_mid.data(), b.norm2_w, b.norm2_b, N);
}

void Model::ffn_forward(int64_t l) {
  Block& b = *blocks_.at(l);
  const int64_t C = cfg_.d_model, F = cfg_.d_ffn, N = B_ * T_;
  if (b.moe) {
    b.moe->forward(tmp_.data(), b.ln2.data(), N);
  } else {
    linear_forward(b.h1.data(), b.ln2.data(), b.mlp_w1->value.data(), N, C, F);
    if (b.mlp_w3) {
      linear_forward(b.h3.data(), b.ln2.data(), b.mlp_w3->value.data(), N, C, F);
      swiglu_forward(b.act.data(), b.h1.data(), b.h3.data(), N * F);
    } else {
      gelu_forward(b.act.data(), b.h1.data(), N * F);
    }
    linear_forward(tmp_.data(), b.act.data(), b.mlp_w2->value.data(), N, F, C);
  }
  add_to(b.out.data(), b.resid_mid.data(), tmp_.data(), N * C);
}

void Model::moe_gate_forward(int64_t l) { blocks_.at(l)->moe->ep_gate(blocks_[l]->ln2.data(), B_ * T_); }

void Model::moe_combine_forward(int64_t l, const TokenExchange& ex) {
  Block& b = *blocks_.at(l);
  b.moe->ep_combine(ex, tmp_.data());
  add_to(b.out.data(), b.resid_mid.data(), tmp_.data(), B_ * T_ * cfg_.d_model);
}

double Model::head_forward() {
  const int64_t V = cfg_.vocab_size, C = cfg_.d_model, N = B_ * T_;
  const float* x = block_input(static_cast<int64_t>(blocks_.size()));
  // logits = norm_f(x) @ wte^T
  norm_forward(lnf_.data(), lnf_mean_.data(), lnf_rstd_.data(), x, normf_w_, normf_b_, N);
  linear_forward(logits_.data(), lnf_.data(), wte_->value.data(), N, C, V);
  loss_ = have_targets_ ? cross_entropy_forward(probs_.data(), logits_.data(), targets_.data(), N, V) : std::nan("");
  return loss_;
}

double Model::forward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T) {
  begin_step(tokens, targets, B, T);
  embed_forward();
  for (int64_t l = 0; l < static_cast<int64_t>(blocks_.size()); ++l) {
    attn_forward(l);
    ffn_forward(l);
  }
  return head_forward();
}

void Model::head_backward() {
  if (B_ == 0 || !have_targets_) throw std::logic_error("Model::backward: the last forward() had no targets");
  const int64_t V = cfg_.vocab_size, C = cfg_.d_model, N = B_ * T_;
  // d(mean CE)/dlogits, then logits = lnf @ wte^T (tied: accumulates into wte.grad).
  zero_n(dlogits_, N * V);
  cross_entropy_backward(dlogits_.data(), probs_.data(), targets_.data(), N, V, ce_grad_scale_);
  zero_n(dln_, N * C);
  linear_backward(dln_.data(), wte_->grad.data(), dlogits_.data(), lnf_.data(), wte_->value.data(), N, C, V);
  zero_n(dres_, N * C);
  norm_backward(dres_.data(), normf_w_, normf_b_, dln_.data(), block_input(static_cast<int64_t>(blocks_.size())),
                lnf_mean_.data(), lnf_rstd_.data(), N);
}

// dres_ holds d(loss)/d(out of block l) on entry to ffn_backward(l) (or moe_combine_backward(l)); the
// FFN leaves d(loss)/d(ln2) in dln_, and attn_backward(l) turns both into d(loss)/d(input of block l).
void Model::ffn_backward(int64_t l) {
  Block& b = *blocks_.at(l);
  const int64_t C = cfg_.d_model, F = cfg_.d_ffn, N = B_ * T_;
  zero_n(dln_, N * C);
  if (b.moe) {
    b.moe->backward(dln_.data(), dres_.data());  // includes the aux/z-loss gradient
    return;
  }
  zero_n(dact_, N * F);
  linear_backward(dact_.data(), b.mlp_w2->grad.data(), dres_.data(), b.act.data(), b.mlp_w2->value.data(), N, F, C);
  zero_n(dh1_, N * F);
  if (b.mlp_w3) {
    zero_n(dh3_, N * F);
    swiglu_backward(dh1_.data(), dh3_.data(), dact_.data(), b.h1.data(), b.h3.data(), N * F);
    linear_backward(dln_.data(), b.mlp_w3->grad.data(), dh3_.data(), b.ln2.data(), b.mlp_w3->value.data(), N, C, F);
  } else {
    gelu_backward(dh1_.data(), dact_.data(), b.h1.data(), N * F);
  }
  linear_backward(dln_.data(), b.mlp_w1->grad.data(), dh1_.data(), b.ln2.data(), b.mlp_w1->value.data(), N, C, F);
}

void Model::moe_combine_backward(int64_t l, const TokenExchange& ex) {
  zero_n(dln_, B_ * T_ * cfg_.d_model);
  blocks_.at(l)->moe->ep_combine_bwd(ex, dres_.data());
}

void Model::moe_gate_backward(int64_t l, const TokenExchange& ex) { blocks_.at(l)->moe->ep_gate_bwd(ex, dln_.data()); }

void Model::attn_backward(int64_t l) {
  Block& b = *blocks_.at(l);
  const int64_t C = cfg_.d_model, NH = cfg_.n_heads, N = B_ * T_;
  // out = h + ffn(ln2): d h = d out + norm2_backward(d ln2)
  norm_backward(dres_.data(), b.norm2_w, b.norm2_b, dln_.data(), b.resid_mid.data(), b.ln2_mean.data(),
                b.ln2_rstd.data(), N);
  // h = x + proj(attention(qkv(ln1))): d x = d h + norm1_backward(...)
  zero_n(datty_, N * C);
  linear_backward(datty_.data(), b.proj_w->grad.data(), dres_.data(), b.atty.data(), b.proj_w->value.data(), N, C, C);
  zero_n(dqkv_, N * 3 * C);
  attention_backward(dqkv_.data(), datt_.data(), dpreatt_.data(), datty_.data(), b.qkv.data(), b.att.data(), B_, T_, C,
                     NH);
  zero_n(dln_, N * C);
  linear_backward(dln_.data(), b.qkv_w->grad.data(), dqkv_.data(), b.ln1.data(), b.qkv_w->value.data(), N, C, 3 * C);
  norm_backward(dres_.data(), b.norm1_w, b.norm1_b, dln_.data(), block_input(l), b.ln1_mean.data(), b.ln1_rstd.data(),
                N);
}

void Model::embed_backward() {
  embedding_backward(wte_->grad.data(), wpe_->grad.data(), dres_.data(), tokens_.data(), B_, T_, cfg_.d_model);
}

void Model::backward() {
  head_backward();
  for (int64_t l = static_cast<int64_t>(blocks_.size()) - 1; l >= 0; --l) {
    ffn_backward(l);
    attn_backward(l);
  }
  embed_backward();
}

std::vector<Param*> Model::block_params(int64_t l) const {
  const Block& b = *blocks_.at(l);
  std::vector<Param*> out;
  for (Param* p : {b.norm1_w, b.norm1_b, b.qkv_w, b.proj_w, b.norm2_w, b.norm2_b, b.mlp_w1, b.mlp_w2, b.mlp_w3})
    if (p) out.push_back(p);
  if (b.moe)
    for (Param* p : b.moe->params()) out.push_back(p);
  return out;
}

std::vector<Param*> Model::embedding_params() const { return {wte_, wpe_}; }

std::vector<Param*> Model::head_params() const {
  std::vector<Param*> out{normf_w_};
  if (normf_b_) out.push_back(normf_b_);
  return out;
}

double Model::aux_loss() const {
  double s = 0;
  for (const auto& b : blocks_)
    if (b->moe) s += b->moe->aux_loss();
  return s;
}

double Model::z_loss() const {
  double s = 0;
  for (const auto& b : blocks_)
    if (b->moe) s += b->moe->z_loss();
  return s;
}

double Model::moe_loss() const {
  double s = 0;
  for (const auto& b : blocks_)
    if (b->moe) s += b->moe->weighted_loss();
  return s;
}

std::vector<LayerLoad> Model::load_stats() const {
  std::vector<LayerLoad> out;
  for (const auto& b : blocks_) {
    if (!b->moe) continue;
    const Routing& r = b->moe->routing();
    LayerLoad s;
    s.layer = b->index;
    s.tokens_per_expert = r.tokens_per_expert;
    s.dropped = r.dropped;
    s.aux_loss = b->moe->aux_loss();
    s.z_loss = b->moe->z_loss();
    out.push_back(std::move(s));
  }
  return out;
}

void Model::set_expert_parallel(comm::Communicator* ep, comm::Communicator* batch) {
  for (int64_t l = 0; l < cfg_.n_layers; ++l)
    if (MoeLayer* m = moe_layer(l)) m->set_expert_parallel(ep, batch);
}

void Model::enable_placements(const plan::Nodes& nodes, comm::Communicator* gather) {
  for (int64_t l = 0; l < cfg_.n_layers; ++l)
    if (MoeLayer* m = moe_layer(l)) m->enable_placements(nodes, &replica_memory_, gather);
}

}  // namespace moe
