// The model on one GPU (gpu_model.h): moe::Model's forward and backward (model/model.cpp), phase for
// phase and op for op, on cuda/ops.h kernels. Shapes use N = B*T rows.
#include "cuda/gpu_model.h"

#include <algorithm>
#include <sstream>
#include <utility>

#include "cuda/ops.h"
#include "util/str_cat.h"

namespace moe::cuda {

namespace {

constexpr float kNormEps = 1e-5f;  // model/model.cpp's
constexpr DType kF32 = DType::f32;

Status alloc(DeviceBuffer& b, int64_t elements, size_t element_bytes) {
  return b.allocate(static_cast<size_t>(std::max<int64_t>(1, elements)) * element_bytes);
}

// Zeroes the first n elements of type dt of b (the part the current batch uses).
Status zero_n(Context& ctx, DType dt, DeviceBuffer& b, int64_t n) {
  return fill_zero(ctx, b.get(), n * static_cast<int64_t>(dtype_size(dt)));
}

// out = a + b over n elements of type dt (device).
Status add_to(Context& ctx, DType dt, void* out, const void* a, const void* b, int64_t n) {
  MOE_CUDA_TRY(cudaMemcpyAsync(out, a, static_cast<size_t>(n) * dtype_size(dt), cudaMemcpyDeviceToDevice, ctx.stream()),
               "cuda model: residual copy");
  return add_inplace(ctx, dt, out, b, n);
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < s.size(); ++i) out << (i ? "," : "") << s[i];
  out << ']';
  return out.str();
}

}  // namespace

// One transformer block: its parameters (indices into params_) and the activations of the last
// forward, sized for N = max_batch * seq_len, in the model's dtype unless marked f32.
struct GpuModel::Block {
  int64_t index = 0;
  int norm1_w = -1, norm1_b = -1;   // [C] (bias: LayerNorm only)
  int qkv_w = -1;                   // [3C,C]
  int proj_w = -1;                  // [C,C]
  int norm2_w = -1, norm2_b = -1;   // [C]
  std::unique_ptr<MoeLayer> moe;    // MoE block (its router.weight, w1, w2, w3 are params_ too)
  int mlp_w1 = -1, mlp_w2 = -1, mlp_w3 = -1;  // dense block: [F,C], [C,F], [F,C] (w3: SwiGLU)

  DeviceBuffer ln1;                 // [B,T,C] norm1(x)
  DeviceBuffer ln1_mean, ln1_rstd;  // [B,T] f32 (mean: LayerNorm only)
  DeviceBuffer qkv;                 // [B,T,3C]
  DeviceBuffer att;                 // [B,NH,T,T] softmax probabilities
  DeviceBuffer atty;                // [B,T,C] attention output, heads concatenated (before proj)
  DeviceBuffer resid_mid;           // [B,T,C] h = x + proj(atty)
  DeviceBuffer ln2;                 // [B,T,C] norm2(h), the FFN input (the MoE layer keeps a pointer to it)
  DeviceBuffer ln2_mean, ln2_rstd;  // [B,T] f32
  DeviceBuffer h1;                  // [B,T,F] dense: ln2 @ w1^T (GELU input, or SwiGLU gate)
  DeviceBuffer h3;                  // [B,T,F] dense SwiGLU: ln2 @ w3^T (up)
  DeviceBuffer act;                 // [B,T,F] dense: gelu(h1) or silu(h1) * h3
  DeviceBuffer out;                 // [B,T,C] block output h + ffn(ln2): the next block's input
};

GpuModel::GpuModel(Context& ctx, const ModelConfig& cfg, int64_t max_batch, DType dt)
    : ctx_(ctx), cfg_(cfg), max_batch_(max_batch), dt_(dt) {}

GpuModel::~GpuModel() = default;

Status GpuModel::create(Context& ctx, const ModelConfig& cfg, int64_t max_batch, DType dt,
                        std::unique_ptr<GpuModel>* out) {
  if (Status s = cfg.validate(); !s) return s;
  if (max_batch < 1) return Status::error(str_cat("cuda model: max_batch (", max_batch, ") must be >= 1"));
  if (cfg.top_k > 16) return Status::error(str_cat("cuda model: top_k (", cfg.top_k, ") > 16, the GPU top-k's limit"));
  std::unique_ptr<GpuModel> m(new GpuModel(ctx, cfg, max_batch, dt));
  if (Status s = m->allocate(); !s) return s;
  *out = std::move(m);
  return Status::ok();
}

int GpuModel::add_param(const std::string& name, std::vector<int64_t> shape, bool decay, DType dt, void* value_dt,
                        void* grad_dt) {
  DeviceParam p;
  p.name = name;
  p.numel = 1;
  for (int64_t d : shape) p.numel *= d;
  p.shape = std::move(shape);
  p.decay = decay;
  p.dt = dt;
  p.value_dt = value_dt;
  p.grad_dt = grad_dt;
  params_.push_back(std::move(p));
  return static_cast<int>(params_.size()) - 1;
}

Status GpuModel::allocate_param_storage() {
  // A zeroed buffer of n elements of type t, owned by the model.
  auto own = [&](int64_t n, DType t, void** out) -> Status {
    DeviceBuffer b;
    if (Status s = alloc(b, n, dtype_size(t)); !s) return s;
    if (Status s = fill_zero(ctx_, b.get(), static_cast<int64_t>(b.bytes())); !s) return s;
    *out = b.get();
    owned_.push_back(std::move(b));
    return Status::ok();
  };
  int64_t widest = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    DeviceParam& p = params_[i];
    if (p.dt == kF32) {
      // The master is the copy the kernels use (the MoE layer's buffers, or the model's).
      if (!p.value_dt)
        for (void** b : {&p.value_dt, &p.grad_dt})
          if (Status s = own(p.numel, kF32, b); !s) return s;
      p.value = static_cast<float*>(p.value_dt);
      p.grad = static_cast<float*>(p.grad_dt);
      continue;
    }
    void* value = nullptr;
    void* grad = nullptr;
    if (Status s = own(p.numel, kF32, &value); !s) return s;
    if (Status s = own(p.numel, kF32, &grad); !s) return s;
    p.value = static_cast<float*>(value);
    p.grad = static_cast<float*>(grad);
    if (!p.value_dt) {
      if (Status s = own(p.numel, p.dt, &p.value_dt); !s) return s;
      if (static_cast<int>(i) != wpe_)
        if (Status s = own(p.numel, p.dt, &p.grad_dt); !s) return s;
    }
    if (p.grad_dt) widest = std::max(widest, p.numel);
  }
  if (widest > 0)
    if (Status s = alloc(widen_, widest, sizeof(float)); !s) return s;
  return Status::ok();
}

Status GpuModel::allocate() {
  const int64_t V = cfg_.vocab_size, T = cfg_.seq_len, C = cfg_.d_model, F = cfg_.d_ffn, NH = cfg_.n_heads,
                E = cfg_.n_experts;
  const int64_t B = max_batch_, N = B * T;
  const bool ln = !cfg_.use_rmsnorm();
  const bool swiglu = cfg_.activation_kind() == Activation::swiglu;

  const size_t d = dtype_size(dt_), f = sizeof(float);

  // Parameters in moe::Model::params() order; storage in allocate_param_storage().
  wte_ = add_param("wte.weight", {V, C}, true, dt_);
  wpe_ = add_param("wpe.weight", {T, C}, true, dt_);
  bool any_dense = false;
  for (int64_t l = 0; l < cfg_.n_layers; ++l) {
    auto b = std::make_unique<Block>();
    const std::string p = "blocks." + std::to_string(l) + ".";
    b->index = l;
    b->norm1_w = add_param(p + "norm1.weight", {C}, false, dt_);
    if (ln) b->norm1_b = add_param(p + "norm1.bias", {C}, false, dt_);
    b->qkv_w = add_param(p + "attn.qkv.weight", {3 * C, C}, true, dt_);
    b->proj_w = add_param(p + "attn.proj.weight", {C, C}, true, dt_);
    b->norm2_w = add_param(p + "norm2.weight", {C}, false, dt_);
    if (ln) b->norm2_b = add_param(p + "norm2.bias", {C}, false, dt_);
    if (cfg_.is_moe_layer(l)) {
      if (Status s = MoeLayer::create(ctx_, dt_, moe_shape(cfg_.moe_config(l)), N, &b->moe); !s) return s;
      MoeLayer& m = *b->moe;
      add_param(p + "moe.router.weight", {E, C}, true, kF32, m.wg(), m.dwg());  // f32 whatever dt (moe_layer.h)
      add_param(p + "moe.w1", {E, F, C}, true, dt_, m.w1(), m.dw1());
      add_param(p + "moe.w2", {E, C, F}, true, dt_, m.w2(), m.dw2());
      if (swiglu) add_param(p + "moe.w3", {E, F, C}, true, dt_, m.w3(), m.dw3());
    } else {
      any_dense = true;
      b->mlp_w1 = add_param(p + "mlp.w1", {F, C}, true, dt_);
      b->mlp_w2 = add_param(p + "mlp.w2", {C, F}, true, dt_);
      if (swiglu) b->mlp_w3 = add_param(p + "mlp.w3", {F, C}, true, dt_);
      if (Status s = alloc(b->h1, N * F, d); !s) return s;
      if (swiglu)
        if (Status s = alloc(b->h3, N * F, d); !s) return s;
      if (Status s = alloc(b->act, N * F, d); !s) return s;
    }
    for (auto [buf, n, sz] : {std::tuple{&b->ln1, N * C, d}, {&b->ln1_rstd, N, f}, {&b->qkv, N * 3 * C, d},
                              {&b->att, B * NH * T * T, d}, {&b->atty, N * C, d}, {&b->resid_mid, N * C, d},
                              {&b->ln2, N * C, d}, {&b->ln2_rstd, N, f}, {&b->out, N * C, d}})
      if (Status s = alloc(*buf, n, sz); !s) return s;
    if (ln)
      for (DeviceBuffer* buf : {&b->ln1_mean, &b->ln2_mean})
        if (Status s = alloc(*buf, N, f); !s) return s;
    blocks_.push_back(std::move(b));
  }
  normf_w_ = add_param("norm_f.weight", {C}, false, dt_);
  if (ln) normf_b_ = add_param("norm_f.bias", {C}, false, dt_);
  if (Status s = allocate_param_storage(); !s) return s;

  // Activations and scratch.
  if (Status s = alloc(tokens_, N, sizeof(int32_t)); !s) return s;
  if (Status s = alloc(targets_, N, sizeof(int32_t)); !s) return s;
  for (auto [buf, n, sz] : {std::tuple{&encoded_, N * C, d}, {&lnf_, N * C, d}, {&lnf_rstd_, N, f},
                            {&logits_, N * V, d}, {&probs_, N * V, f}, {&losses_, N, f}, {&preatt_, B * NH * T * T, d},
                            {&attn_scratch_, 8 * N * C, d}, {&tmp_, N * C, d}, {&dlogits_, N * V, d},
                            {&dres_, N * C, d}, {&dln_, N * C, d}, {&datty_, N * C, d}, {&dqkv_, N * 3 * C, d},
                            {&datt_, B * NH * T * T, d}, {&dpreatt_, B * NH * T * T, d}})
    if (Status s = alloc(*buf, n, sz); !s) return s;
  if (ln)
    if (Status s = alloc(lnf_mean_, N, f); !s) return s;
  if (any_dense) {
    if (Status s = alloc(dh1_, N * F, d); !s) return s;
    if (swiglu)
      if (Status s = alloc(dh3_, N * F, d); !s) return s;
    if (Status s = alloc(dact_, N * F, d); !s) return s;
  }
  host_losses_.resize(static_cast<size_t>(N));
  return ctx_.synchronize();
}

int64_t GpuModel::num_params() const {
  int64_t n = 0;
  for (const DeviceParam& p : params_) n += p.numel;
  return n;
}

namespace {

// Whether host parameter hp matches device parameter dp (name, shape, decay, not sharded).
Status check_match(const Param& hp, const DeviceParam& dp, size_t i) {
  if (hp.name != dp.name || hp.value.shape() != dp.shape || hp.decay != dp.decay || hp.sharded())
    return Status::error(str_cat("cuda model: parameter ", i, " is ", hp.name, " ", shape_str(hp.value.shape()),
                                 hp.sharded() ? " (sharded)" : "", " on the host, ", dp.name, " ", shape_str(dp.shape),
                                 " on the GPU (decay ", hp.decay, " vs ", dp.decay, ")"));
  return Status::ok();
}

// Checks every pair first (nothing is copied when one differs), then copies each: copy(host param,
// device param).
template <typename Copy>
Status for_matching_params(const std::vector<Param*>& hp, const std::vector<DeviceParam>& dp, Copy copy) {
  if (hp.size() != dp.size())
    return Status::error(str_cat("cuda model: the host model has ", hp.size(), " parameters, the GPU model ", dp.size()));
  for (size_t i = 0; i < hp.size(); ++i)
    if (Status s = check_match(*hp[i], dp[i], i); !s) return s;
  for (size_t i = 0; i < hp.size(); ++i)
    if (Status s = copy(*hp[i], dp[i]); !s) return s;
  return Status::ok();
}

size_t bytes_of(const DeviceParam& p) { return static_cast<size_t>(p.numel) * sizeof(float); }

}  // namespace

Status refresh_weight_copy(Context& ctx, const DeviceParam& p) {
  if (p.dt == DType::f32) return Status::ok();
  return cast_f32_to(ctx, p.dt, p.value_dt, p.value, p.numel);
}

Status GpuModel::load_weights(const moe::Model& host) {
  return for_matching_params(host.params(), params_, [&](Param& h, const DeviceParam& d) {
    if (Status s = copy_to_device(ctx_, d.value, h.value.data(), bytes_of(d)); !s) return s;
    return refresh_weight_copy(ctx_, d);
  });
}

Status GpuModel::store_weights(moe::Model* host) const {
  return for_matching_params(host->params(), params_, [&](Param& h, const DeviceParam& d) {
    return copy_to_host(ctx_, h.value.data(), d.value, bytes_of(d));
  });
}

Status GpuModel::store_gradients(moe::Model* host) const {
  return for_matching_params(host->params(), params_, [&](Param& h, const DeviceParam& d) {
    return copy_to_host(ctx_, h.grad.data(), d.grad, bytes_of(d));
  });
}

Status GpuModel::zero_grad() {
  for (const DeviceParam& p : params_)
    if (Status s = fill_zero(ctx_, p.grad, p.numel * static_cast<int64_t>(sizeof(float))); !s) return s;
  return Status::ok();
}

const void* GpuModel::block_input(int64_t l) const { return l == 0 ? encoded_.get() : blocks_[l - 1]->out.get(); }

Status GpuModel::norm_forward(void* out, float* mean, float* rstd, const void* inp, int wi, int bi, int64_t N) {
  const int64_t C = cfg_.d_model;
  if (cfg_.use_rmsnorm()) return rmsnorm_forward(ctx_, dt_, out, rstd, inp, w(wi), N, C, kNormEps);
  return layernorm_forward(ctx_, dt_, out, mean, rstd, inp, w(wi), w(bi), N, C, kNormEps);
}

Status GpuModel::norm_backward(void* dinp, int wi, int bi, const void* dout, const void* inp, const float* mean,
                               const float* rstd, int64_t N) {
  const int64_t C = cfg_.d_model;
  if (cfg_.use_rmsnorm()) return rmsnorm_backward(ctx_, dt_, dinp, g(wi), dout, inp, w(wi), rstd, N, C);
  return layernorm_backward(ctx_, dt_, dinp, g(wi), g(bi), dout, inp, w(wi), mean, rstd, N, C);
}

// ---- forward ------------------------------------------------------------------------------------

Status GpuModel::forward(const int32_t* tokens, const int32_t* targets, int64_t B, double* loss) {
  const int64_t T = cfg_.seq_len, V = cfg_.vocab_size, N = B * T;
  if (B < 1 || B > max_batch_) return Status::error(str_cat("cuda model: B (", B, ") not in [1, ", max_batch_, "]"));
  if (!tokens || !targets) return Status::error("cuda model: forward needs tokens and targets");
  for (int64_t i = 0; i < N; ++i)
    if (tokens[i] < 0 || tokens[i] >= V || targets[i] < 0 || targets[i] >= V)
      return Status::error(str_cat("cuda model: token or target ", i, " out of [0, ", V, ")"));
  B_ = B;
  T_ = T;
  host_tokens_.assign(tokens, tokens + N);  // the embedding backward groups them on the host
  if (Status s = copy_to_device(ctx_, tokens_.get(), tokens, static_cast<size_t>(N) * sizeof(int32_t)); !s) return s;
  if (Status s = copy_to_device(ctx_, targets_.get(), targets, static_cast<size_t>(N) * sizeof(int32_t)); !s) return s;
  if (Status s = encoder_forward(); !s) return s;
  for (int64_t l = 0; l < static_cast<int64_t>(blocks_.size()); ++l) {
    if (Status s = attention_block_forward(*blocks_[l], block_input(l)); !s) return s;
    if (Status s = ffn_forward(*blocks_[l]); !s) return s;
  }
  return head_forward(loss);
}

Status GpuModel::encoder_forward() {
  // encoded [N,C] = wte [V,C] [tokens] + wpe [T,C] [t]
  return embedding_forward(ctx_, dt_, encoded_.get(), tokens_.as<int32_t>(), w(wte_), w(wpe_), B_, T_, cfg_.d_model);
}

Status GpuModel::attention_block_forward(Block& b, const void* x /*[N,C]*/) {
  const int64_t C = cfg_.d_model, NH = cfg_.n_heads, N = B_ * T_;
  // h = x + proj(attention(qkv(norm1(x)))); then the FFN input norm2(h)
  if (Status s = norm_forward(b.ln1.get(), b.ln1_mean.as<float>(), b.ln1_rstd.as<float>(), x, b.norm1_w, b.norm1_b,
                              N);
      !s)
    return s;
  // qkv [N,3C] = ln1 [N,C] @ qkv_w [3C,C]^T
  if (Status s = linear_forward(ctx_, dt_, b.qkv.get(), b.ln1.get(), w(b.qkv_w), N, C, 3 * C); !s) return s;
  // atty [N,C]; att, preatt [B,NH,T,T]; scratch [4,N,C]
  if (Status s = attention_forward(ctx_, dt_, b.atty.get(), preatt_.get(), b.att.get(), attn_scratch_.get(),
                                   b.qkv.get(), B_, T_, C, NH);
      !s)
    return s;
  // tmp [N,C] = atty [N,C] @ proj_w [C,C]^T;  resid_mid = x + tmp
  if (Status s = linear_forward(ctx_, dt_, tmp_.get(), b.atty.get(), w(b.proj_w), N, C, C); !s) return s;
  if (Status s = add_to(ctx_, dt_, b.resid_mid.get(), x, tmp_.get(), N * C); !s) return s;
  return norm_forward(b.ln2.get(), b.ln2_mean.as<float>(), b.ln2_rstd.as<float>(), b.resid_mid.get(), b.norm2_w,
                      b.norm2_b, N);
}

Status GpuModel::ffn_forward(Block& b) {
  const int64_t C = cfg_.d_model, F = cfg_.d_ffn, N = B_ * T_;
  if (b.moe) {
    // tmp [N,C] = MoE(ln2 [N,C])
    if (Status s = b.moe->forward(tmp_.get(), b.ln2.get(), N); !s) return s;
  } else {
    // h1 [N,F] = ln2 @ w1^T; act = gelu(h1) or silu(h1) * (ln2 @ w3^T); tmp [N,C] = act @ w2^T
    if (Status s = linear_forward(ctx_, dt_, b.h1.get(), b.ln2.get(), w(b.mlp_w1), N, C, F); !s) return s;
    if (b.mlp_w3 >= 0) {
      if (Status s = linear_forward(ctx_, dt_, b.h3.get(), b.ln2.get(), w(b.mlp_w3), N, C, F); !s) return s;
      if (Status s = swiglu_forward(ctx_, dt_, b.act.get(), b.h1.get(), b.h3.get(), N * F); !s) return s;
    } else {
      if (Status s = gelu_forward(ctx_, dt_, b.act.get(), b.h1.get(), N * F); !s) return s;
    }
    if (Status s = linear_forward(ctx_, dt_, tmp_.get(), b.act.get(), w(b.mlp_w2), N, F, C); !s) return s;
  }
  // out [N,C] = resid_mid + tmp
  return add_to(ctx_, dt_, b.out.get(), b.resid_mid.get(), tmp_.get(), N * C);
}

Status GpuModel::head_forward(double* loss) {
  const int64_t V = cfg_.vocab_size, C = cfg_.d_model, N = B_ * T_;
  const void* x = block_input(static_cast<int64_t>(blocks_.size()));
  // lnf [N,C] = norm_f(x);  logits [N,V] = lnf @ wte^T (tied);  probs [N,V] f32, losses [N] f32
  if (Status s = norm_forward(lnf_.get(), lnf_mean_.as<float>(), lnf_rstd_.as<float>(), x, normf_w_, normf_b_, N); !s)
    return s;
  if (Status s = linear_forward(ctx_, dt_, logits_.get(), lnf_.get(), w(wte_), N, C, V); !s) return s;
  if (Status s = cross_entropy_forward(ctx_, dt_, probs_.as<float>(), losses_.as<float>(), logits_.get(),
                                       targets_.as<int32_t>(), N, V);
      !s)
    return s;
  // The mean over the N rows, summed in double in row order (waits for the stream).
  if (Status s = copy_to_host(ctx_, host_losses_.data(), losses_.get(), static_cast<size_t>(N) * sizeof(float)); !s)
    return s;
  double total = 0;
  for (int64_t n = 0; n < N; ++n) total += host_losses_[n];
  loss_ = total / static_cast<double>(N);
  if (loss) *loss = loss_;
  return Status::ok();
}

// ---- backward -----------------------------------------------------------------------------------

// Under bf16 the parameter gradients come from the bf16 kernels (cuBLAS and the norms' column sums
// add in f32 and round once on store) into a bf16 gradient per parameter, zeroed here first: each is
// written once per backward (a GEMM's beta = 1 onto zero), so it holds one rounding of an f32 sum,
// and is then widened and added to the f32 gradient. Not accumulated in f32 directly because ops.h's
// GEMMs take one dtype for A, B and C (bf16 operands, so a bf16 dweight); not kept in bf16 across
// backward() calls, so that accumulation over micro-batches adds in f32, and AdamW and the gradient
// norm read f32. Two exceptions write the f32 gradients directly: the embedding's kernel (dwte and
// dwpe are f32 in ops.h, as a vocabulary row sums many positions), and the MoE router (f32 whatever
// the dtype, moe_layer.h).
Status GpuModel::backward() {
  if (B_ == 0) return Status::error("cuda model: backward REQUIRES a forward first");
  if (Status s = zero_low_precision_grads(); !s) return s;
  if (Status s = head_backward(); !s) return s;
  for (int64_t l = static_cast<int64_t>(blocks_.size()) - 1; l >= 0; --l) {
    if (Status s = ffn_backward(*blocks_[l]); !s) return s;
    if (Status s = attention_block_backward(*blocks_[l], block_input(l)); !s) return s;
  }
  if (Status s = encoder_backward(); !s) return s;
  return widen_low_precision_grads();
}

Status GpuModel::zero_low_precision_grads() {
  for (const DeviceParam& p : params_)
    if (p.dt != kF32 && p.grad_dt)
      if (Status s = fill_zero(ctx_, p.grad_dt, p.numel * static_cast<int64_t>(dtype_size(p.dt))); !s) return s;
  return Status::ok();
}

Status GpuModel::widen_low_precision_grads() {
  for (const DeviceParam& p : params_) {
    if (p.dt == kF32 || !p.grad_dt) continue;
    // grad [numel] f32 += widen_ [numel] f32 = grad_dt [numel] widened
    if (Status s = cast_to_f32(ctx_, p.dt, widen_.as<float>(), p.grad_dt, p.numel); !s) return s;
    if (Status s = add_inplace(ctx_, kF32, p.grad, widen_.get(), p.numel); !s) return s;
  }
  return Status::ok();
}

Status GpuModel::head_backward() {
  const int64_t V = cfg_.vocab_size, C = cfg_.d_model, N = B_ * T_;
  // dlogits [N,V] = d(mean CE)/dlogits (one process: the whole batch, scale 1)
  if (Status s = zero_n(ctx_, dt_, dlogits_, N * V); !s) return s;
  if (Status s = cross_entropy_backward(ctx_, dt_, dlogits_.get(), probs_.as<float>(), targets_.as<int32_t>(), N, V,
                                        1.0f);
      !s)
    return s;
  // logits = lnf @ wte^T:  dln [N,C] = dlogits @ wte;  wte.grad [V,C] += dlogits^T @ lnf (tied)
  if (Status s = zero_n(ctx_, dt_, dln_, N * C); !s) return s;
  if (Status s = linear_backward(ctx_, dt_, dln_.get(), g(wte_), dlogits_.get(), lnf_.get(), w(wte_), N, C, V); !s)
    return s;
  // dres [N,C] = norm_f backward (into zero)
  if (Status s = zero_n(ctx_, dt_, dres_, N * C); !s) return s;
  return norm_backward(dres_.get(), normf_w_, normf_b_, dln_.get(), block_input(static_cast<int64_t>(blocks_.size())),
                       lnf_mean_.as<float>(), lnf_rstd_.as<float>(), N);
}

// dres_ holds d(loss)/d(out of block l) on entry; the FFN leaves d(loss)/d(ln2) in dln_, and
// attention_block_backward turns both into d(loss)/d(input of block l) in dres_.
Status GpuModel::ffn_backward(Block& b) {
  const int64_t C = cfg_.d_model, F = cfg_.d_ffn, N = B_ * T_;
  if (Status s = zero_n(ctx_, dt_, dln_, N * C); !s) return s;
  if (b.moe) return b.moe->backward(dln_.get(), dres_.get());  // includes the aux/z-loss gradients
  // tmp = act @ w2^T:  dact [N,F] = dres @ w2;  w2.grad [C,F] += dres^T @ act
  if (Status s = zero_n(ctx_, dt_, dact_, N * F); !s) return s;
  if (Status s = linear_backward(ctx_, dt_, dact_.get(), g(b.mlp_w2), dres_.get(), b.act.get(), w(b.mlp_w2), N, F, C);
      !s)
    return s;
  // activation: dh1 [N,F] (and dh3 [N,F]), accumulated into zero
  if (Status s = zero_n(ctx_, dt_, dh1_, N * F); !s) return s;
  if (b.mlp_w3 >= 0) {
    if (Status s = zero_n(ctx_, dt_, dh3_, N * F); !s) return s;
    if (Status s = swiglu_backward(ctx_, dt_, dh1_.get(), dh3_.get(), dact_.get(), b.h1.get(), b.h3.get(), N * F); !s)
      return s;
    // h3 = ln2 @ w3^T:  dln [N,C] += dh3 @ w3;  w3.grad [F,C] += dh3^T @ ln2
    if (Status s = linear_backward(ctx_, dt_, dln_.get(), g(b.mlp_w3), dh3_.get(), b.ln2.get(), w(b.mlp_w3), N, C, F);
        !s)
      return s;
  } else {
    if (Status s = gelu_backward(ctx_, dt_, dh1_.get(), dact_.get(), b.h1.get(), N * F); !s) return s;
  }
  // h1 = ln2 @ w1^T:  dln [N,C] += dh1 @ w1;  w1.grad [F,C] += dh1^T @ ln2
  return linear_backward(ctx_, dt_, dln_.get(), g(b.mlp_w1), dh1_.get(), b.ln2.get(), w(b.mlp_w1), N, C, F);
}

Status GpuModel::attention_block_backward(Block& b, const void* x /*[N,C]*/) {
  const int64_t C = cfg_.d_model, NH = cfg_.n_heads, N = B_ * T_;
  // out = h + ffn(ln2):  dh = dout + norm2_backward(dln), accumulated into dres [N,C]
  if (Status s = norm_backward(dres_.get(), b.norm2_w, b.norm2_b, dln_.get(), b.resid_mid.get(), b.ln2_mean.as<float>(),
                               b.ln2_rstd.as<float>(), N);
      !s)
    return s;
  // h = x + proj(atty):  datty [N,C] = dh @ proj;  proj.grad [C,C] += dh^T @ atty
  if (Status s = zero_n(ctx_, dt_, datty_, N * C); !s) return s;
  if (Status s = linear_backward(ctx_, dt_, datty_.get(), g(b.proj_w), dres_.get(), b.atty.get(), w(b.proj_w), N, C, C);
      !s)
    return s;
  // dqkv [N,3C] (datt, dpreatt [B,NH,T,T] and the [8,N,C] scratch are overwritten)
  if (Status s = zero_n(ctx_, dt_, dqkv_, N * 3 * C); !s) return s;
  if (Status s = attention_backward(ctx_, dt_, dqkv_.get(), datt_.get(), dpreatt_.get(), attn_scratch_.get(),
                                    datty_.get(), b.qkv.get(), b.att.get(), B_, T_, C, NH);
      !s)
    return s;
  // qkv = ln1 @ qkv_w^T:  dln [N,C] = dqkv @ qkv_w;  qkv_w.grad [3C,C] += dqkv^T @ ln1
  if (Status s = zero_n(ctx_, dt_, dln_, N * C); !s) return s;
  if (Status s = linear_backward(ctx_, dt_, dln_.get(), g(b.qkv_w), dqkv_.get(), b.ln1.get(), w(b.qkv_w), N, C, 3 * C);
      !s)
    return s;
  // dx = dh + norm1_backward(dln), accumulated into dres [N,C]
  return norm_backward(dres_.get(), b.norm1_w, b.norm1_b, dln_.get(), x, b.ln1_mean.as<float>(), b.ln1_rstd.as<float>(),
                       N);
}

Status GpuModel::encoder_backward() {
  // wte.grad [V,C] += dres rows by token;  wpe.grad [T,C] += dres rows by position: into the f32
  // gradients whatever dt (ops.h), so under bf16 wte's bf16 gradient holds the LM head's share only
  return embedding_backward(ctx_, dt_, params_[wte_].grad, params_[wpe_].grad, dres_.get(), host_tokens_.data(), B_,
                            T_, cfg_.d_model);
}

// ---- statistics ---------------------------------------------------------------------------------

double GpuModel::aux_loss() const {
  double s = 0;
  for (const auto& b : blocks_)
    if (b->moe) s += b->moe->aux_loss();
  return s;
}

double GpuModel::z_loss() const {
  double s = 0;
  for (const auto& b : blocks_)
    if (b->moe) s += b->moe->z_loss();
  return s;
}

double GpuModel::moe_loss() const {
  double s = 0;
  for (const auto& b : blocks_)
    if (b->moe) s += b->moe->weighted_loss();
  return s;
}

const MoeLayer* GpuModel::moe_layer(int64_t l) const { return blocks_.at(static_cast<size_t>(l))->moe.get(); }

std::vector<LayerLoad> GpuModel::load_stats() const {
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

}  // namespace moe::cuda
