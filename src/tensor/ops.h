// CPU kernels: explicit forward and backward for every op the model uses (llm.c style).
//
// Conventions (the contract for every function below):
//  - Raw row-major f32 pointers; shapes in the comment beside each argument (letters: tensor.h).
//  - Forward functions overwrite their outputs.
//  - Backward functions ACCUMULATE (+=) into every gradient they write, so a tensor used twice
//    (residual streams, tied embeddings) just receives two calls. Callers zero gradients per step.
//    Where a backward has several gradient outputs, a null one means "not needed" and is skipped;
//    a backward with a single gradient output REQUIRES it non-null.
//  - Kernels are multi-threaded with OpenMP; none allocates except where stated.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moe {

// ---- GEMM -----------------------------------------------------------------------------------
// C[M,N] = alpha * op(A)[M,K] * op(B)[K,N] + beta * C, row-major; op(X) = X^T when trans_x.
// The backend (oneDNN's dnnl_sgemm or OpenBLAS's cblas_sgemm) is the pinned one (pin_gemm_backend:
// moe train pins one per job), else chosen once per process by measure_gemm_backends on a
// representative shape; MOE_GEMM=onednn|openblas forces one.
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
          const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);
// Which backend gemm() uses, and why (e.g. "onednn (measured onednn 101.0 vs openblas/Haswell 22.0 ...)").
std::string gemm_backend();
// Just its name: "onednn" or "openblas".
std::string gemm_backend_name();
// Makes gemm() use `name` ("onednn" or "openblas", else std::invalid_argument) from now on, without
// measuring. The two backends round differently, so bit-exact continuation (resume, every rank of a
// job) needs one backend: a checkpoint records it, and ranks adopt rank 0's. Call before training
// starts; not thread-safe against concurrent gemm() calls.
void pin_gemm_backend(const std::string& name, const std::string& reason);
// The same GEMM through a named backend ("onednn" or "openblas"); for benchmarks and tests.
void gemm_with(const std::string& backend, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
               float alpha, const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
               int64_t ldc);
// OpenBLAS's own thread pool (oneDNN follows OpenMP's omp_set_num_threads). REQUIRES: no gemm() in flight.
void set_gemm_threads(int threads);

// One GEMM of a measurement: C[M,N] = op(A)[M,K] op(B)[K,N] (shapes as in gemm()).
struct GemmShape {
  bool trans_a = false, trans_b = false;
  int64_t M = 0, N = 0, K = 0;
};
// Each backend's rate on a list of shapes, GFLOP/s: the best of `rounds` rounds, each round timing
// both backends one after the other (which goes first alternates), each for >= 4 ms. The best, not
// the median: other jobs on the machine only ever slow a kernel down, and a disturbance that lasts
// several rounds moved a median by 2x (oneDNN measured 67 GFLOP/s against its 190, so the slower
// kernel was picked for the whole job).
struct GemmRates {
  double onednn_gflops = 0, openblas_gflops = 0;
  // The median over rounds of OpenBLAS's rate over oneDNN's in the same round: the two run back to
  // back, so a disturbance that slows both cancels, and one fast round (a neighbour went idle) moves it
  // little where it moves a best.
  double median_ratio = 0;
  int rounds = 0;
  std::string openblas_core;  // the kernel OpenBLAS runs here ("Haswell", "SkylakeX", ...)
};
// Takes about rounds x 10 ms on the calling thread with the current thread counts.
// REQUIRES: shapes non-empty with M, N, K >= 1 and rounds >= 1 (std::invalid_argument).
GemmRates measure_gemm_backends(const std::vector<GemmShape>& shapes, int rounds);
// The GEMM kernel in use (pinned, or the lazy choice) on a list of shapes, GFLOP/s: the best of
// `rounds` rounds timed as measure_gemm_backends times each backend.
// REQUIRES: as measure_gemm_backends (std::invalid_argument).
double measure_gemm_rate(const std::vector<GemmShape>& shapes, int rounds);
// The rates from each round's GFLOP/s of each backend (what measure_gemm_backends times). Pure.
// REQUIRES: both series of the same non-zero length (std::invalid_argument).
GemmRates gemm_rates_from_rounds(const std::vector<double>& onednn, const std::vector<double>& openblas,
                                 const std::string& openblas_core);
// OpenBLAS wins only when its rate beats oneDNN's by more than this share, in the best rates and in
// the median of the rounds' ratios alike: near-ties, where noise would flip the choice from run to run,
// go to oneDNN, whose kernel follows the CPU's ISA. 25%: on AMD Zen 4 the two kernels run within a few
// percent of each other, and with other jobs on the machine the best of 7 rounds still measured
// OpenBLAS 13% ahead in one run of three (10% flipped it). The median: on a busy Xeon one of three
// runs measured OpenBLAS best at 90.4 against oneDNN's 72.1 (25.4% ahead), the two others oneDNN 17-19%
// ahead, and the three same-seed runs trained with different kernels.
inline constexpr double kGemmSwitchMargin = 0.25;
// "onednn" or "openblas" by that rule. Pure.
std::string pick_gemm_backend(const GemmRates& rates);
// "measured onednn 180.1 vs openblas/Haswell 88.0 GFLOP/s, best of 7 interleaved rounds (median
// ratio 0.49)".
std::string describe_gemm_rates(const GemmRates& rates);

// OpenBLAS picks its kernel once, when it loads, from a table of CPU models; Debian's 0.3.21 does not
// know newer CPUs and falls back to its SSE3 kernel (Prescott) on an AVX-512 Xeon: 33 against
// oneDNN's 217 GFLOP/s on the expert shapes. The core type for OPENBLAS_CORETYPE that this CPU's
// instruction set runs, given OpenBLAS's own choice `detected`: "SkylakeX" with AVX-512 (F, CD, BW,
// DQ, VL), else "Haswell" with AVX2 and FMA; "" where `detected` already uses AVX2 (Haswell, Zen,
// Excavator, SkylakeX, Cooperlake, SapphireRapids) or the CPU has neither. Decided by instruction
// set, never by CPU model. Pure.
std::string openblas_core_for_isa(const std::string& detected, bool avx512, bool avx2_fma);
// The same for the CPU this runs on.
std::string openblas_core_for_this_cpu(const std::string& detected);
// The kernel OpenBLAS chose when it loaded ("Prescott", "SkylakeX", ...). `moe` re-runs itself with
// OPENBLAS_CORETYPE = openblas_core_for_this_cpu(openblas_kernel()) where that is not "" (src/cli/main.cpp).
std::string openblas_kernel();

// ---- linear (no bias), PyTorch layout: weight [OC, IC] ------------------------------------
void linear_forward(float* out /*[N,OC]*/, const float* inp /*[N,IC]*/, const float* weight /*[OC,IC]*/,
                    int64_t N, int64_t IC, int64_t OC);
void linear_backward(float* dinp /*[N,IC] or null*/, float* dweight /*[OC,IC] or null*/,
                     const float* dout /*[N,OC]*/, const float* inp /*[N,IC]*/, const float* weight /*[OC,IC]*/,
                     int64_t N, int64_t IC, int64_t OC);

// ---- elementwise ------------------------------------------------------------------------------
void add_inplace(float* a, const float* b, int64_t n);                     // a += b
void scale_inplace(float* a, float s, int64_t n);                          // a *= s
// GELU, tanh approximation (PyTorch approximate="tanh", GPT-2).
void gelu_forward(float* out, const float* inp, int64_t n);
void gelu_backward(float* dinp, const float* dout, const float* inp, int64_t n);
// The one in-place exception to the accumulate rule: d holds dout on entry and dinp on return.
// Expert backward uses it so the [R,F] gradient makes one pass through memory instead of three.
void gelu_backward_inplace(float* d, const float* inp, int64_t n);
// SwiGLU: out = silu(gate) * up.
void swiglu_forward(float* out /*[n]*/, const float* gate /*[n]*/, const float* up /*[n]*/, int64_t n);
void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up, int64_t n);

// ---- softmax and top-k over the last dimension ---------------------------------------------
void softmax_forward(float* out /*[N,D]*/, const float* inp /*[N,D]*/, int64_t N, int64_t D);
void softmax_backward(float* dinp /*[N,D]*/, const float* dout /*[N,D]*/, const float* out /*[N,D]*/,
                      int64_t N, int64_t D);
// Largest K entries of each row, in descending order; ties go to the lower index (as torch.topk
// does on CPU for distinct values; equal values are rare for float router logits).
void topk_forward(float* values /*[N,K]*/, int32_t* indices /*[N,K]*/, const float* inp /*[N,D]*/,
                  int64_t N, int64_t D, int64_t K);

// ---- norms --------------------------------------------------------------------------------------
// LayerNorm with affine weight and bias; saves mean and rstd for backward.
void layernorm_forward(float* out /*[N,C]*/, float* mean /*[N]*/, float* rstd /*[N]*/, const float* inp /*[N,C]*/,
                       const float* weight /*[C]*/, const float* bias /*[C]*/, int64_t N, int64_t C, float eps);
void layernorm_backward(float* dinp /*[N,C]*/, float* dweight /*[C]*/, float* dbias /*[C]*/, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int64_t N, int64_t C);
// RMSNorm: out = inp * rstd * weight, rstd = 1/sqrt(mean(inp^2) + eps).
void rmsnorm_forward(float* out /*[N,C]*/, float* rstd /*[N]*/, const float* inp /*[N,C]*/,
                     const float* weight /*[C]*/, int64_t N, int64_t C, float eps);
void rmsnorm_backward(float* dinp /*[N,C]*/, float* dweight /*[C]*/, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C);

// ---- causal multi-head self-attention ------------------------------------------------------
// qkv holds q, k, v side by side per token: [B,T,3C] with head h's q at columns [h*HS, (h+1)*HS).
// att saves the softmax probabilities for backward; preatt is scratch of the same size.
// Scale 1/sqrt(HS); position t attends to positions <= t.
void attention_forward(float* out /*[B,T,C]*/, float* preatt /*[B,NH,T,T]*/, float* att /*[B,NH,T,T]*/,
                       const float* qkv /*[B,T,3C]*/, int64_t B, int64_t T, int64_t C, int64_t NH);
// One query's attention over n keys, as the inference engine (serve/engine.cpp) runs it for a row over
// its KV cache: attention_forward's mathematics for one (b, t, h), whose GEMMs sum in another order, so
// the two agree to float rounding. Key/value j at k + j * stride and v + j * stride ([HS] each); pre [n]
// the scaled scores, att [n] their softmax (att may be pre), out [HS] = sum_j att[j] * v_j.
void attend_query(float* out /*[HS]*/, float* pre /*[n]*/, float* att /*[n]*/, const float* q /*[HS]*/, const float* k,
                  const float* v, int64_t stride, int64_t n, int64_t HS, float scale);
// datt and dpreatt are scratch [B,NH,T,T] (overwritten).
void attention_backward(float* dqkv /*[B,T,3C]*/, float* datt, float* dpreatt, const float* dout /*[B,T,C]*/,
                        const float* qkv, const float* att, int64_t B, int64_t T, int64_t C, int64_t NH);

// ---- embeddings -----------------------------------------------------------------------------
// out[b,t] = wte[tokens[b,t]] + wpe[t]
void embedding_forward(float* out /*[B,T,C]*/, const int32_t* tokens /*[B,T]*/, const float* wte /*[V,C]*/,
                       const float* wpe /*[T,C]*/, int64_t B, int64_t T, int64_t C);
void embedding_backward(float* dwte /*[V,C]*/, float* dwpe /*[T,C]*/, const float* dout /*[B,T,C]*/,
                        const int32_t* tokens, int64_t B, int64_t T, int64_t C);

// ---- loss -------------------------------------------------------------------------------------
// Softmax cross-entropy from logits; saves probs; returns the mean loss over the N rows.
double cross_entropy_forward(float* probs /*[N,V]*/, const float* logits /*[N,V]*/, const int32_t* targets /*[N]*/,
                             int64_t N, int64_t V);
// dlogits += dloss * (probs - onehot(target)) / N
void cross_entropy_backward(float* dlogits /*[N,V]*/, const float* probs /*[N,V]*/, const int32_t* targets /*[N]*/,
                            int64_t N, int64_t V, float dloss);

// ---- token rows by index (permute / un-permute) ---------------------------------------------
// out[r] = inp[index[r]]
void gather_rows(float* out /*[R,C]*/, const float* inp /*[N,C]*/, const int32_t* index /*[R]*/, int64_t R, int64_t C);
// out[index[r]] += scale[r] * inp[r] (scale may be null = 1). Rows sharing an index are summed in
// increasing r, so results do not depend on thread count.
void scatter_add_rows(float* out /*[N,C]*/, const float* inp /*[R,C]*/, const int32_t* index /*[R]*/,
                      const float* scale /*[R] or null*/, int64_t R, int64_t N, int64_t C);

// ---- optimizer ------------------------------------------------------------------------------
// One decoupled-weight-decay Adam step (PyTorch AdamW), step t >= 1 (bias correction).
void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, float lr, float beta1,
                  float beta2, float eps, float weight_decay, int64_t t);

}  // namespace moe
