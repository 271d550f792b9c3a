#include "moe/experts.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <numeric>
#include <stdexcept>

#include "tensor/ops.h"

namespace moe {

namespace {
// Experts one per thread, each GEMM of an expert on its thread, or in turn with each GEMM on all
// threads. On 2 threads one expert per thread ran faster than each GEMM split over both, whose
// halves wait for each other (2026-11-27, docs/cpus.md; oneDNN): the 6 expert GEMMs at 1024 rows by
// 6% (median of 30 interleaved rounds), bench moe-layer's experts forward by 10-13% and backward by
// 1-4% (calls alternating between the two ways, 2 runs). Taken only where the experts' rows split over
// the threads within 3% of even (largest first, each to the least-loaded thread; deterministic), else
// the busiest thread would cost more than the split GEMMs save, and only with oneDNN, which runs a
// GEMM called inside an OpenMP region on its calling thread (OpenBLAS keeps its own thread pool).
// This plans it without allocating once warm (the layer allocates nothing after its first step): the
// experts by rows, largest first, in `order`, each one's thread in `thread_of` (-1: no rows), in
// buffers the caller keeps. False: run the experts in turn.
bool plan_experts(const int64_t* off, int64_t E, std::vector<int64_t>& order, std::vector<int>& thread_of,
                  std::vector<int64_t>& load) {
  const int threads = omp_get_max_threads();
  if (threads < 2 || E < threads || gemm_backend_name() != "onednn") return false;
  order.resize(static_cast<size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  auto rows = [&](int64_t e) { return off[e + 1] - off[e]; };
  // Ties by index; std::sort, as stable_sort takes a buffer from the heap.
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return rows(a) != rows(b) ? rows(a) > rows(b) : a < b; });
  thread_of.assign(static_cast<size_t>(E), -1);
  load.assign(static_cast<size_t>(threads), 0);
  for (int64_t e : order) {
    if (rows(e) == 0) continue;
    const auto t = std::min_element(load.begin(), load.end()) - load.begin();
    thread_of[static_cast<size_t>(e)] = static_cast<int>(t);
    load[static_cast<size_t>(t)] += rows(e);
  }
  const int64_t total = off[E] - off[0], busiest = *std::max_element(load.begin(), load.end());
  return total > 0 && busiest * threads <= total * 103 / 100;
}

void check(const int64_t* off, const ExpertShape& s, const void* h3, const void* w3) {
  for (int64_t e = 0; e < s.E; ++e)
    if (off[e + 1] < off[e]) throw std::logic_error("experts: REQUIRES non-decreasing offsets");
  if (s.activation == Activation::swiglu && (!h3 || !w3))
    throw std::logic_error("experts: SwiGLU REQUIRES h3 and w3");
}

// Calls one(e) for every expert with rows: spread over the threads where plan_experts says so,
// else in order. An exception from one(e) reaches the caller (the first, by thread).
template <typename Fn>
void for_each_expert(const int64_t* off, int64_t E, const Fn& one) {
  thread_local std::vector<int64_t> order, load;
  thread_local std::vector<int> thread_of;
  thread_local std::vector<std::exception_ptr> failed;
  failed.assign(static_cast<size_t>(omp_get_max_threads()), nullptr);  // sized on any call: warm after one
  if (!plan_experts(off, E, order, thread_of, load)) {
    for (int64_t e = 0; e < E; ++e)
      if (off[e + 1] > off[e]) one(e);
    return;
  }
  // The team reads this thread's buffers (a thread_local named inside the region is the worker's own).
  const std::vector<int64_t>& by_rows = order;
  const std::vector<int>& owner = thread_of;
  std::vector<std::exception_ptr>& errors = failed;
#pragma omp parallel num_threads(static_cast<int>(load.size()))
  {
    const int t = omp_get_thread_num();
    try {
      for (int64_t e : by_rows)
        if (owner[static_cast<size_t>(e)] == t) one(e);
    } catch (...) {
      errors[static_cast<size_t>(t)] = std::current_exception();
    }
  }
  for (const std::exception_ptr& f : errors)
    if (f) std::rethrow_exception(f);
}
}  // namespace

std::vector<std::vector<int64_t>> experts_thread_plan(const int64_t* off, int64_t E) {
  std::vector<int64_t> order, load;
  std::vector<int> thread_of;
  if (!plan_experts(off, E, order, thread_of, load)) return {};
  std::vector<std::vector<int64_t>> plan(load.size());
  for (int64_t e : order)
    if (const int t = thread_of[static_cast<size_t>(e)]; t >= 0) plan[static_cast<size_t>(t)].push_back(e);
  return plan;
}

void experts_forward(float* out, float* h1, float* h3, float* act, const float* xp, const int64_t* off,
                     const float* w1, const float* w2, const float* w3, const ExpertShape& s) {
  check(off, s, h3, w3);
  const int64_t C = s.C, F = s.F;
  const bool swiglu = s.activation == Activation::swiglu;
  for_each_expert(off, s.E, [&](int64_t e) {
    const int64_t r0 = off[e], n = off[e + 1] - off[e];
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
  });
}

void experts_backward(float* dxp, float* dw1, float* dw2, float* dw3, float* dact, float* dh1, float* dh3,
                      const float* dout, const float* xp, const float* h1, const float* h3, const float* act,
                      const int64_t* off, const float* w1, const float* w2, const float* w3, const ExpertShape& s) {
  check(off, s, h3, w3);
  if (s.activation == Activation::swiglu && !dh3) throw std::logic_error("experts_backward: SwiGLU REQUIRES dh3");
  const int64_t C = s.C, F = s.F;
  const bool swiglu = s.activation == Activation::swiglu;
  for_each_expert(off, s.E, [&](int64_t e) {
    const int64_t r0 = off[e], n = off[e + 1] - off[e];
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
  });
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
