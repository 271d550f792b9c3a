// GPU kernels: the CUDA twin of tensor/ops.h, op for op, plus the MoE layer's grouped expert GEMM and
// fused permute / un-permute. Everything runs on ctx.stream() (device.h) and returns once queued.
//
// Conventions (the contract of every function below, as in tensor/ops.h):
//  - Device pointers, row-major; shapes in the comment beside each argument (letters: tensor/tensor.h).
//  - `dt` is the storage type of the op's activations, weights and their gradients (`void*`
//    arguments). Arguments typed `float*` are f32 whatever dt is: saved statistics (mean, rstd),
//    softmax probabilities of the loss, gate weights, master weights and optimizer moments.
//    Arithmetic is f32 throughout; a bf16 result is the f32 result rounded once, on store.
//  - Forward functions overwrite their outputs; backward functions ACCUMULATE (+=) into the
//    gradients they write (a null one is skipped where stated), exactly like the CPU kernels.
//  - Deterministic: no atomics on floats; reductions run in a fixed order, so the same inputs give
//    the same bits run after run (the runtime's resume and cross-rank equality rely on it).
//  - Returns: a launch error (or a cuBLAS error) as a Status naming the op. Faults inside kernels
//    surface at the next ctx.synchronize().
//
// Tolerance policy against the CPU reference (tests/cuda/test_cuda_ops.cpp): f32 (TF32 off):
// |gpu - cpu| <= 1e-4 * max(1, |cpu|) (reduction order differs); bf16 storage, with the CPU run on
// the same bf16-rounded inputs: |gpu - cpu| <= 2^-6 * max(1, |cpu|) (a few bf16 roundings on the way).
#pragma once

#include <cstdint>

#include "cuda/device.h"

namespace moe::cuda {

// ---- conversions -------------------------------------------------------------------------------
Status cast_f32_to(Context& ctx, DType dt, void* out /*[n]*/, const float* inp /*[n]*/, int64_t n);
Status cast_to_f32(Context& ctx, DType dt, float* out /*[n]*/, const void* inp /*[n]*/, int64_t n);
Status fill_zero(Context& ctx, void* p, int64_t bytes);

// ---- GEMM (cuBLAS, f32 accumulation) -------------------------------------------------------------
// C[M,N] = alpha * op(A)[M,K] * op(B)[K,N] + beta * C, row-major, all three in dt.
Status gemm(Context& ctx, DType dt, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
            const void* A, int64_t lda, const void* B, int64_t ldb, float beta, void* C, int64_t ldc);
// linear, PyTorch layout (weight [OC,IC]), no bias.
Status linear_forward(Context& ctx, DType dt, void* out /*[N,OC]*/, const void* inp /*[N,IC]*/,
                      const void* weight /*[OC,IC]*/, int64_t N, int64_t IC, int64_t OC);
Status linear_backward(Context& ctx, DType dt, void* dinp /*[N,IC] or null*/, void* dweight /*[OC,IC] or null*/,
                       const void* dout /*[N,OC]*/, const void* inp /*[N,IC]*/, const void* weight /*[OC,IC]*/,
                       int64_t N, int64_t IC, int64_t OC);

// ---- grouped expert GEMM -------------------------------------------------------------------------
// One GEMM per expert over expert-contiguous rows, run as Context::grouped_gemm_chunk_rows() and
// grouped_gemm_lanes() say (device.h: equal row chunks in one cublasGemmBatchedEx call, the default;
// per-expert cublasGemmEx on concurrent streams; or one cublasGemmGroupedBatchedEx call): for every e
// with rows = off[e+1] - off[e] > 0,
//   Y[off[e]:off[e+1], :] = alpha * X[off[e]:off[e+1], :] (Kin) x op(W[e]) + beta * Y[...]
// where W[e] is [Nout, Kin] (a PyTorch linear weight, trans_w = true: the forward) or [Kin, Nout]
// (trans_w = false: the backward's dX = dY W). `off` is a HOST array of E+1 non-decreasing offsets
// (the MoE layer knows its counts on the host: they decide the all-to-all sizes).
Status grouped_gemm(Context& ctx, DType dt, bool trans_w, void* Y /*[R,Nout]*/, const void* X /*[R,Kin]*/,
                    const void* W /*[E,*]*/, const int64_t* off /*host [E+1]*/, int64_t E, int64_t Kin, int64_t Nout,
                    float alpha, float beta);
// The weight gradients of the same (per expert on the lanes, or the grouped call; never chunks, since
// they sum over the rows): for every e with rows > 0,
//   dW[e] ([Nout, Kin]) = alpha * dY[off[e]:off[e+1]]^T X[off[e]:off[e+1]] + beta * dW[e].
Status grouped_gemm_weight_grad(Context& ctx, DType dt, void* dW /*[E,Nout,Kin]*/, const void* dY /*[R,Nout]*/,
                                const void* X /*[R,Kin]*/, const int64_t* off /*host [E+1]*/, int64_t E, int64_t Kin,
                                int64_t Nout, float alpha, float beta);
// The same products as grouped_gemm, one cublasGemmEx per expert: the reference the grouped call
// is tested and benchmarked against.
Status grouped_gemm_looped(Context& ctx, DType dt, bool trans_w, void* Y, const void* X, const void* W,
                           const int64_t* off, int64_t E, int64_t Kin, int64_t Nout, float alpha, float beta);
// Grouped calls that cuBLAS answered CUBLAS_STATUS_NOT_SUPPORTED and that ran as the per-expert loop
// instead (same results, other speed), since the process started. Not thread-safe.
int64_t grouped_gemm_fallbacks();

// ---- elementwise ---------------------------------------------------------------------------------
Status add_inplace(Context& ctx, DType dt, void* a, const void* b, int64_t n);  // a += b
Status scale_inplace(Context& ctx, DType dt, void* a, float s, int64_t n);      // a *= s
Status gelu_forward(Context& ctx, DType dt, void* out, const void* inp, int64_t n);  // tanh approximation
Status gelu_backward(Context& ctx, DType dt, void* dinp, const void* dout, const void* inp, int64_t n);
Status swiglu_forward(Context& ctx, DType dt, void* out, const void* gate, const void* up, int64_t n);
Status swiglu_backward(Context& ctx, DType dt, void* dgate, void* dup, const void* dout, const void* gate,
                       const void* up, int64_t n);

// ---- router: softmax and top-k over the last dimension ---------------------------------------
Status softmax_forward(Context& ctx, DType dt, void* out /*[N,D]*/, const void* inp /*[N,D]*/, int64_t N, int64_t D);
Status softmax_backward(Context& ctx, DType dt, void* dinp /*[N,D]*/, const void* dout /*[N,D]*/,
                        const void* out /*[N,D]*/, int64_t N, int64_t D);
// Largest K of each row, descending, ties to the lower index. REQUIRES: 1 <= K <= 16, K <= D.
Status topk_forward(Context& ctx, DType dt, float* values /*[N,K]*/, int32_t* indices /*[N,K]*/,
                    const void* inp /*[N,D]*/, int64_t N, int64_t D, int64_t K);

// Gate weights of the top-k choices: weight[n,k] = values[n,k] / sum_k values[n,k] when renormalize
// (and K > 1), else values[n,k]. All f32.
Status gate_weights_forward(Context& ctx, float* weight /*[N,K]*/, const float* values /*[N,K]*/, int64_t N, int64_t K,
                            bool renormalize);
// Its backward into the router's probabilities: dprobs[n,:] is overwritten, zero except at the K
// chosen experts, where it is d(loss)/d(prob) through the (renormalized) gate weight.
Status gate_weights_backward(Context& ctx, DType dt, void* dprobs /*[N,E]*/, const float* dweight /*[N,K]*/,
                             const float* values /*[N,K]*/, const int32_t* indices /*[N,K]*/, int64_t N, int64_t E,
                             int64_t K, bool renormalize);

// ---- router extras: bias, aux and z losses (moe/router.h's arithmetic) -------------------------------
// a[n,d] += scale * v[d] for every row n (v is f32; the product is rounded before the sum, as the CPU's
// two steps round): the router bias on the logits (scale 1) and the aux loss's gradient on the
// probabilities (v = f_e, scale = aux_loss_weight * E / N).
Status add_row_vector(Context& ctx, DType dt, void* a /*[N,D]*/, const float* v /*[D]*/, float scale, int64_t N,
                      int64_t D);
// What the aux and z losses need, in double arithmetic as router_loss_forward does on the CPU:
// lse[n] = logsumexp(logits[n,:]) (one thread per row) and prob_sum[d] = sum_n probs[n,d] (device
// doubles; two fixed-order passes over row chunks, not the CPU's row order). No atomics,
// deterministic. REQUIRES: D >= 1.
Status router_stats_forward(Context& ctx, DType dt, float* lse /*[N]*/, double* prob_sum /*[D]*/,
                            const void* logits /*[N,D]*/, const void* probs /*[N,D]*/, int64_t N, int64_t D);
// The z loss's gradient: dlogits[n,d] += (scale * lse[n]) * probs[n,d] (scale = z_loss_weight * 2 / N).
Status router_z_backward(Context& ctx, DType dt, void* dlogits /*[N,D]*/, const float* lse /*[N]*/,
                         const void* probs /*[N,D]*/, float scale, int64_t N, int64_t D);

// ---- norms ---------------------------------------------------------------------------------------
Status layernorm_forward(Context& ctx, DType dt, void* out /*[N,C]*/, float* mean /*[N]*/, float* rstd /*[N]*/,
                         const void* inp /*[N,C]*/, const void* weight /*[C]*/, const void* bias /*[C]*/, int64_t N,
                         int64_t C, float eps);
// dweight/dbias accumulate the column sums over rows, in two fixed-order passes over row chunks
// (deterministic; not the CPU's row order: within the f32/bf16 tolerance).
Status layernorm_backward(Context& ctx, DType dt, void* dinp /*[N,C]*/, void* dweight /*[C]*/, void* dbias /*[C]*/,
                          const void* dout, const void* inp, const void* weight, const float* mean, const float* rstd,
                          int64_t N, int64_t C);
Status rmsnorm_forward(Context& ctx, DType dt, void* out /*[N,C]*/, float* rstd /*[N]*/, const void* inp /*[N,C]*/,
                       const void* weight /*[C]*/, int64_t N, int64_t C, float eps);
Status rmsnorm_backward(Context& ctx, DType dt, void* dinp /*[N,C]*/, void* dweight /*[C]*/, const void* dout,
                        const void* inp, const void* weight, const float* rstd, int64_t N, int64_t C);

// ---- causal multi-head self-attention --------------------------------------------------------------
// Same layout and semantics as the CPU kernel: qkv [B,T,3C], head h's q at columns [h*HS, (h+1)*HS).
// Built from cuBLAS strided-batched GEMMs and a causal softmax; `scratch` holds q, k, v and the
// attention output head-major (4 * B*T*C elements of dt). att keeps the probabilities (dt) for
// backward; preatt is scratch of the same size.
Status attention_forward(Context& ctx, DType dt, void* out /*[B,T,C]*/, void* preatt /*[B,NH,T,T]*/,
                         void* att /*[B,NH,T,T]*/, void* scratch /*[4,B,T,C]*/, const void* qkv /*[B,T,3C]*/,
                         int64_t B, int64_t T, int64_t C, int64_t NH);
// datt and dpreatt: scratch [B,NH,T,T]; scratch: [8,B,T,C] of dt.
Status attention_backward(Context& ctx, DType dt, void* dqkv /*[B,T,3C]*/, void* datt, void* dpreatt,
                          void* scratch /*[8,B,T,C]*/, const void* dout /*[B,T,C]*/, const void* qkv,
                          const void* att, int64_t B, int64_t T, int64_t C, int64_t NH);

// ---- embeddings ------------------------------------------------------------------------------
Status embedding_forward(Context& ctx, DType dt, void* out /*[B,T,C]*/, const int32_t* tokens /*[B,T]*/,
                         const void* wte /*[V,C]*/, const void* wpe /*[T,C]*/, int64_t B, int64_t T, int64_t C);
// dwte and dwpe are f32 whatever dt is: a vocabulary row sums the gradients of every token that
// reads it, too many roundings for bf16. Deterministic without atomics, and per element in the CPU
// kernel's order: each distinct token's positions, grouped on the host (which is why the tokens are
// a HOST array here: the caller has them), are added in order by one block; each position row by
// one thread per element. REQUIRES: tokens in [0, V), B*T < 2^31.
Status embedding_backward(Context& ctx, DType dt, float* dwte /*[V,C] or null*/, float* dwpe /*[T,C] or null*/,
                          const void* dout /*[B,T,C]*/, const int32_t* host_tokens /*host [B,T]*/, int64_t B,
                          int64_t T, int64_t C);

// ---- loss ------------------------------------------------------------------------------------------
// Softmax cross-entropy per row: probs (f32) and losses[n] = -log probs[n, target[n]] (f32). The mean
// is the caller's (a reduction over losses, or a copy to the host).
Status cross_entropy_forward(Context& ctx, DType dt, float* probs /*[N,V]*/, float* losses /*[N]*/,
                             const void* logits /*[N,V]*/, const int32_t* targets /*[N]*/, int64_t N, int64_t V);
// dlogits += dloss * (probs - onehot(target)) / N
Status cross_entropy_backward(Context& ctx, DType dt, void* dlogits /*[N,V]*/, const float* probs /*[N,V]*/,
                              const int32_t* targets /*[N]*/, int64_t N, int64_t V, float dloss);

// ---- MoE permute / un-permute ----------------------------------------------------------------------
// Dispatch: out[r] = inp[index[r]] (tokens to expert-contiguous rows).
Status gather_rows(Context& ctx, DType dt, void* out /*[R,C]*/, const void* inp /*[N,C]*/, const int32_t* index /*[R]*/,
                   int64_t R, int64_t C);
// Its inverse where index[r] >= 0: out[index[r]] = inp[r]; rows with index -1 are skipped. The
// indices >= 0 must be distinct (no two rows write one row).
Status scatter_rows(Context& ctx, DType dt, void* out /*[N,C]*/, const void* inp /*[R,C]*/, const int32_t* index /*[R]*/,
                    int64_t R, int64_t C);
// Combine with gate scaling, fused: y[n] (+)= sum_k weight[n,k] * rows[token_rows[n,k]] over the k
// with token_rows[n,k] >= 0 (a dropped assignment is -1), summed in k order; one thread block per
// token, so no atomics. accumulate = false overwrites y.
Status combine_rows(Context& ctx, DType dt, void* y /*[N,C]*/, const void* rows /*[R,C]*/,
                    const int32_t* token_rows /*[N,K]*/, const float* weight /*[N,K]*/, int64_t N, int64_t K,
                    int64_t C, bool accumulate);
// Its backward: drows[token_rows[n,k]] = weight[n,k] * dy[n] (overwrite; rows no token refers to are
// left as they are), and, when dweight is not null, dweight[n,k] += <dy[n], rows[token_rows[n,k]]>.
Status combine_rows_backward(Context& ctx, DType dt, void* drows /*[R,C]*/, float* dweight /*[N,K] or null*/,
                             const void* dy /*[N,C]*/, const void* rows /*[R,C]*/, const int32_t* token_rows /*[N,K]*/,
                             const float* weight /*[N,K]*/, int64_t N, int64_t K, int64_t C);

// ---- optimizer ---------------------------------------------------------------------------------------
// PyTorch AdamW on f32 master weights; `param_out`, when not null, receives the updated weights in dt
// (the copy the forward reads).
Status adamw_update(Context& ctx, DType dt, float* param /*[n]*/, void* param_out /*[n] or null*/,
                    const void* grad /*[n]*/, float* m, float* v, int64_t n, float lr, float beta1, float beta2,
                    float eps, float weight_decay, int64_t t);
// *out (one device double) = sum_i x[i]^2 in double arithmetic: a gradient's share of the global norm
// (AdamW::clip_grad_norm). Two fixed-order passes over chunks of 64 Ki elements: deterministic.
Status sum_squares(Context& ctx, DType dt, double* out /*device [1]*/, const void* x /*[n]*/, int64_t n);

}  // namespace moe::cuda
