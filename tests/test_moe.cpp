// Tests for src/moe: the MoE layer against a naive double-precision reference written here,
// finite-difference gradients, capacity dropping, layout invariants and the router losses'
// closed forms. Every case prints its max error.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <new>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "grad_check.h"
#include "moe/combine.h"
#include "moe/experts.h"
#include "moe/layout.h"
#include "moe/moe_layer.h"
#include "moe/router.h"

// ---- allocation counter (to check "no allocation in forward/backward after construction") ----
// (Replacement operator new/delete pair; GCC's -Wmismatched-new-delete misreads malloc/free in it.
// Not under AddressSanitizer, which replaces them itself: the test is skipped there.)
#if defined(__SANITIZE_ADDRESS__)
#define MOE_COUNT_ALLOCS 0
#else
#define MOE_COUNT_ALLOCS 1
#endif
static std::atomic<bool> g_count_allocs{false};
static std::atomic<long> g_allocs{0};
#if MOE_COUNT_ALLOCS
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
__attribute__((noinline)) void* operator new(std::size_t n) {
  if (g_count_allocs.load(std::memory_order_relaxed)) g_allocs.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
__attribute__((noinline)) void operator delete(void* p) noexcept { std::free(p); }
__attribute__((noinline)) void operator delete(void* p, std::size_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop
#endif

namespace moe {
namespace {

using moe::testing::fill_normal;

constexpr int64_t kN = 24, kC = 16, kF = 32, kE = 4;

const char* act_name(Activation a) { return a == Activation::gelu ? "gelu" : "swiglu"; }

MoeConfig make_cfg(int64_t K, Activation act, bool renorm, float cf, float aux_w = 0.01f, float z_w = 0.001f) {
  MoeConfig c;
  c.d_model = kC;
  c.d_ffn = kF;
  c.n_experts = kE;
  c.top_k = K;
  c.activation = act;
  c.renormalize = renorm;
  c.capacity_factor = cf;
  c.aux_loss_weight = aux_w;
  c.z_loss_weight = z_w;
  return c;
}

Param* find_param(MoeLayer& m, const std::string& suffix) {
  for (Param* p : m.params())
    if (p->name.size() >= suffix.size() && p->name.compare(p->name.size() - suffix.size(), suffix.size(), suffix) == 0)
      return p;
  return nullptr;
}

// Router std 0.5 keeps router probabilities well separated (top-k choices are stable under the
// finite-difference probes); expert weights std 0.3 keep activations O(1).
void init_params(MoeLayer& m, uint64_t seed) {
  uint64_t s = seed;
  for (Param* p : m.params()) {
    float std = p->name.find("router") != std::string::npos ? 0.5f : 0.3f;
    fill_normal(p->value.data(), p->value.numel(), ++s, std);
  }
}

// ---- naive reference (double, per token, plain loops) --------------------------------------
struct Reference {
  std::vector<double> y;          // [N,C]
  std::vector<int> expert;        // [N*K]
  std::vector<double> weight;     // [N*K], 0 when dropped
  std::vector<char> kept;         // [N*K]
  double aux = 0, z = 0;
};

double gelu_ref(double h) {
  const double k = std::sqrt(2.0 / M_PI);
  return 0.5 * h * (1.0 + std::tanh(k * (h + 0.044715 * h * h * h)));
}
double silu_ref(double g) { return g / (1.0 + std::exp(-g)); }

Reference reference(const MoeConfig& cfg, const float* x, int64_t N, const float* router, const float* w1,
                    const float* w2, const float* w3) {
  const int64_t C = cfg.d_model, F = cfg.d_ffn, E = cfg.n_experts, K = cfg.top_k;
  Reference ref;
  ref.y.assign(N * C, 0.0);
  ref.expert.assign(N * K, -1);
  ref.weight.assign(N * K, 0.0);
  ref.kept.assign(N * K, 1);
  std::vector<double> probs(N * E);
  double zsum = 0;
  for (int64_t n = 0; n < N; ++n) {
    std::vector<double> logit(E);
    for (int64_t e = 0; e < E; ++e) {
      double s = 0;
      for (int64_t c = 0; c < C; ++c) s += static_cast<double>(x[n * C + c]) * router[e * C + c];
      logit[e] = s;
    }
    double mx = *std::max_element(logit.begin(), logit.end());
    double se = 0;
    for (int64_t e = 0; e < E; ++e) se += std::exp(logit[e] - mx);
    double lse = mx + std::log(se);
    zsum += lse * lse;
    for (int64_t e = 0; e < E; ++e) probs[n * E + e] = std::exp(logit[e] - lse);
    std::vector<int> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return probs[n * E + a] > probs[n * E + b]; });
    double psum = 0;
    for (int64_t k = 0; k < K; ++k) psum += probs[n * E + order[k]];
    for (int64_t k = 0; k < K; ++k) {
      double p = probs[n * E + order[k]];
      ref.expert[n * K + k] = order[k];
      ref.weight[n * K + k] = (K > 1 && cfg.renormalize) ? p / psum : p;
    }
  }
  // capacity in global order: all first choices in token order, then all second choices, ...
  if (cfg.capacity_factor > 0) {
    int64_t cap = static_cast<int64_t>(std::ceil(static_cast<double>(cfg.capacity_factor) * N * K / E));
    std::vector<int64_t> used(E, 0);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n) {
        int e = ref.expert[n * K + k];
        if (used[e] < cap) ++used[e];
        else ref.kept[n * K + k] = 0, ref.weight[n * K + k] = 0.0;
      }
  }
  // y[n] = sum_k w * FFN_e(x[n])
  std::vector<double> h(F);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      if (!ref.kept[n * K + k]) continue;
      const int64_t e = ref.expert[n * K + k];
      for (int64_t f = 0; f < F; ++f) {
        double g = 0, u = 0;
        for (int64_t c = 0; c < C; ++c) {
          g += static_cast<double>(w1[(e * F + f) * C + c]) * x[n * C + c];
          if (cfg.activation == Activation::swiglu) u += static_cast<double>(w3[(e * F + f) * C + c]) * x[n * C + c];
        }
        h[f] = cfg.activation == Activation::gelu ? gelu_ref(g) : silu_ref(g) * u;
      }
      for (int64_t c = 0; c < C; ++c) {
        double o = 0;
        for (int64_t f = 0; f < F; ++f) o += static_cast<double>(w2[(e * C + c) * F + f]) * h[f];
        ref.y[n * C + c] += ref.weight[n * K + k] * o;
      }
    }
  // aux = E * sum_e f_e P_e (f over choices before dropping), z = mean lse^2
  double aux = 0;
  for (int64_t e = 0; e < E; ++e) {
    double f = 0, P = 0;
    for (int64_t a = 0; a < N * K; ++a) f += ref.expert[a] == e;
    for (int64_t n = 0; n < N; ++n) P += probs[n * E + e];
    aux += (f / (N * K)) * (P / N);
  }
  ref.aux = E * aux;
  ref.z = zsum / N;
  return ref;
}

Reference reference_of(MoeLayer& m, const float* x, int64_t N) {
  Param* w3 = find_param(m, "w3");
  return reference(m.config(), x, N, find_param(m, "router.weight")->value.data(), find_param(m, "w1")->value.data(),
                   find_param(m, "w2")->value.data(), w3 ? w3->value.data() : nullptr);
}

// ---- forward equals the naive reference ---------------------------------------------------------
struct FwdCase {
  int64_t K;
  Activation act;
  bool renorm;
  float cf;
};

class MoeForward : public ::testing::TestWithParam<FwdCase> {};

TEST_P(MoeForward, MatchesNaiveReference) {
  const FwdCase p = GetParam();
  MoeLayer m("blocks.0.moe.", make_cfg(p.K, p.act, p.renorm, p.cf), kN);
  init_params(m, 100 + p.K);
  std::vector<float> x(kN * kC), y(kN * kC);
  fill_normal(x.data(), x.size(), 7);
  m.forward(y.data(), x.data(), kN);
  Reference ref = reference_of(m, x.data(), kN);
  const Routing& r = m.routing();
  ASSERT_EQ(r.expert.size(), static_cast<size_t>(kN * p.K));
  for (int64_t a = 0; a < kN * p.K; ++a) {
    ASSERT_EQ(r.expert[a], ref.expert[a]) << "assignment " << a;
    ASSERT_NEAR(r.weight[a], ref.weight[a], 1e-6) << "assignment " << a;
  }
  double max_err = 0;
  for (int64_t i = 0; i < kN * kC; ++i) max_err = std::max(max_err, std::fabs(y[i] - ref.y[i]));
  int64_t ref_dropped = 0;
  for (char k : ref.kept) ref_dropped += !k;
  std::printf("[forward K=%ld %s renorm=%d cf=%.2f] max|y - ref| = %.3g  |aux - ref| = %.3g  |z - ref| = %.3g  "
              "dropped=%ld\n",
              static_cast<long>(p.K), act_name(p.act), p.renorm, p.cf, max_err, std::fabs(m.aux_loss() - ref.aux),
              std::fabs(m.z_loss() - ref.z), static_cast<long>(r.dropped));
  EXPECT_LT(max_err, 1e-5);
  EXPECT_NEAR(m.aux_loss(), ref.aux, 1e-5);
  EXPECT_NEAR(m.z_loss(), ref.z, 1e-5 * std::max(1.0, ref.z));
  EXPECT_EQ(r.dropped, ref_dropped);
  EXPECT_FLOAT_EQ(m.weighted_loss(), m.config().aux_loss_weight * m.aux_loss() + m.config().z_loss_weight * m.z_loss());
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MoeForward,
    ::testing::Values(FwdCase{1, Activation::gelu, true, 0}, FwdCase{1, Activation::swiglu, true, 0},
                      FwdCase{2, Activation::gelu, true, 0}, FwdCase{2, Activation::gelu, false, 0},
                      FwdCase{2, Activation::swiglu, true, 0}, FwdCase{2, Activation::swiglu, false, 0},
                      FwdCase{2, Activation::gelu, true, 0.5f}, FwdCase{1, Activation::swiglu, true, 0.75f},
                      FwdCase{3, Activation::swiglu, true, 0}));

// ---- finite-difference gradients ------------------------------------------------------------
// loss = sum(y * R) + aux_w * aux + z_w * z, accumulated in double from the layer's f32 forward.
// Central differences with eps = 1e-2 (f32 forward: round-off in the loss is ~1e-6, i.e. ~1e-4 in
// the difference quotient; truncation ~eps^2). Tolerance per probe, G = max |analytic| over the tensor:
//   |analytic - numeric| <= 1e-4 + 1e-3 * G + 1e-2 * max(|analytic|, |numeric|).
// Top-k is piecewise constant: a probe whose +eps or -eps forward changes any expert choice (and
// hence possibly the dropping) is skipped; at most a quarter of the probes may be skipped.
struct GradCase {
  int64_t K;
  Activation act;
  bool renorm;
  float cf;
  bool main_loss;  // false: R = 0, only the aux and z terms
};

class MoeGradient : public ::testing::TestWithParam<GradCase> {};

TEST_P(MoeGradient, MatchesFiniteDifferences) {
  const GradCase p = GetParam();
  const float aux_w = 0.5f, z_w = 0.2f;  // large, so the router-loss gradients are checked too
  MoeLayer m("moe.", make_cfg(p.K, p.act, p.renorm, p.cf, aux_w, z_w), kN);
  init_params(m, 200 + p.K * 10 + static_cast<int>(p.act));
  std::vector<float> x(kN * kC), y(kN * kC), R(kN * kC, 0.0f), dx(kN * kC, 0.0f);
  fill_normal(x.data(), x.size(), 11);
  if (p.main_loss) fill_normal(R.data(), R.size(), 13);

  auto loss = [&]() {
    m.forward(y.data(), x.data(), kN);
    double l = 0;
    for (int64_t i = 0; i < kN * kC; ++i) l += static_cast<double>(y[i]) * R[i];
    return l + static_cast<double>(aux_w) * m.aux_loss() + static_cast<double>(z_w) * m.z_loss();
  };
  // analytic
  for (Param* q : m.params()) q->grad.zero();
  loss();
  const std::vector<int32_t> base_expert = m.routing().expert;
  const int64_t base_dropped = m.routing().dropped;
  m.backward(dx.data(), R.data());

  struct Target {
    std::string name;
    float* value;
    const float* grad;
    size_t n;
  };
  std::vector<Target> targets{{"x", x.data(), dx.data(), x.size()}};
  for (Param* q : m.params()) targets.push_back({q->name, q->value.data(), q->grad.data(), q->value.numel()});

  const float eps = 1e-2f;
  const double atol_floor = 1e-4, atol_scale = 1e-3, rtol = 1e-2;
  const size_t max_checks = 64;
  std::printf("[grad K=%ld %s renorm=%d cf=%.2f %s] dropped=%ld\n", static_cast<long>(p.K), act_name(p.act), p.renorm,
              p.cf, p.main_loss ? "sum(y*R)+aux+z" : "aux+z only", static_cast<long>(base_dropped));
  for (const Target& t : targets) {
    ASSERT_TRUE(moe::testing::all_finite(t.grad, t.n)) << t.name;
    size_t stride = t.n <= max_checks ? 1 : t.n / max_checks;
    double G = 0;
    for (size_t i = 0; i < t.n; ++i) G = std::max(G, std::fabs(static_cast<double>(t.grad[i])));
    const double atol = atol_floor + atol_scale * G;
    double max_abs = 0, max_rel = 0, max_grad = 0;
    int checked = 0, skipped = 0, bad = 0;
    for (size_t i = 0; i < t.n; i += stride) {
      const float orig = t.value[i];
      t.value[i] = orig + eps;
      const double lp = loss();
      bool same = m.routing().expert == base_expert;
      t.value[i] = orig - eps;
      const double lm = loss();
      same = same && m.routing().expert == base_expert;
      t.value[i] = orig;
      if (!same) {
        ++skipped;
        continue;
      }
      const double num = (lp - lm) / (2.0 * eps), a = t.grad[i];
      const double err = std::fabs(a - num), mag = std::max(std::fabs(a), std::fabs(num));
      max_abs = std::max(max_abs, err);
      max_rel = std::max(max_rel, err / std::max(mag, 1e-3));
      max_grad = std::max(max_grad, mag);
      if (err > atol + rtol * mag) {
        ++bad;
        if (bad <= 3) ADD_FAILURE() << t.name << "[" << i << "]: analytic " << a << " numeric " << num;
      }
      ++checked;
    }
    std::printf("  %-16s checked %3d skipped %2d  max|grad| %.3g  max abs err %.3g  max rel err %.3g\n",
                t.name.c_str(), checked, skipped, max_grad, max_abs, max_rel);
    EXPECT_EQ(bad, 0) << t.name;
    EXPECT_LE(skipped * 4, checked + skipped) << t.name << ": too many probes changed the routing";
    const bool expert_weight = t.name == "moe.w1" || t.name == "moe.w2" || t.name == "moe.w3";
    if (!p.main_loss && expert_weight) {
      EXPECT_EQ(max_grad, 0.0) << t.name << ": aux/z do not depend on expert weights";
    } else {
      EXPECT_GT(max_grad, 0.0) << t.name << ": gradient identically zero, check is vacuous";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MoeGradient,
    ::testing::Values(GradCase{1, Activation::gelu, true, 0, true}, GradCase{1, Activation::swiglu, true, 0, true},
                      GradCase{2, Activation::gelu, true, 0, true}, GradCase{2, Activation::gelu, false, 0, true},
                      GradCase{2, Activation::swiglu, true, 0, true}, GradCase{2, Activation::swiglu, false, 0, true},
                      GradCase{2, Activation::swiglu, true, 0.75f, true}, GradCase{1, Activation::gelu, true, 0.75f, true},
                      GradCase{2, Activation::gelu, true, 0, false}));

// backward ACCUMULATES into dx and the parameter gradients.
TEST(MoeLayer, BackwardAccumulates) {
  MoeLayer m("moe.", make_cfg(2, Activation::swiglu, true, 0), kN);
  init_params(m, 5);
  std::vector<float> x(kN * kC), y(kN * kC), dy(kN * kC), dx1(kN * kC, 0.0f), dx2(kN * kC, 0.0f);
  fill_normal(x.data(), x.size(), 1);
  fill_normal(dy.data(), dy.size(), 2);
  m.forward(y.data(), x.data(), kN);
  m.backward(dx1.data(), dy.data());
  std::vector<std::vector<float>> g1;
  for (Param* q : m.params()) g1.emplace_back(q->grad.data(), q->grad.data() + q->grad.numel());
  m.forward(y.data(), x.data(), kN);
  m.backward(dx2.data(), dy.data());
  m.backward(dx2.data(), dy.data());
  double max_err = 0;
  for (int64_t i = 0; i < kN * kC; ++i) max_err = std::max(max_err, std::fabs(dx2[i] - 2.0 * dx1[i]));
  std::vector<Param*> ps = m.params();
  for (size_t j = 0; j < ps.size(); ++j)
    for (size_t i = 0; i < ps[j]->grad.numel(); ++i)
      max_err = std::max(max_err, std::fabs(ps[j]->grad[i] - 3.0 * g1[j][i]));
  std::printf("[accumulate] max err %.3g\n", max_err);
  EXPECT_LT(max_err, 1e-5);
}

// No allocation in forward/backward once constructed (after one warm-up step, which lets the GEMM
// backend and OpenMP initialize themselves), at several batch sizes up to max_tokens.
TEST(MoeLayer, NoAllocationAfterConstruction) {
  if (!MOE_COUNT_ALLOCS) GTEST_SKIP() << "allocation counting is off under AddressSanitizer";
  MoeLayer m("moe.", make_cfg(2, Activation::swiglu, true, 0.75f), kN);
  init_params(m, 9);
  std::vector<float> x(kN * kC), y(kN * kC), dy(kN * kC), dx(kN * kC, 0.0f);
  fill_normal(x.data(), x.size(), 3);
  fill_normal(dy.data(), dy.size(), 4);
  m.forward(y.data(), x.data(), 2);
  m.backward(dx.data(), dy.data());
  g_allocs = 0;
  g_count_allocs = true;
  for (int64_t n : {kN, int64_t{5}, int64_t{1}, kN}) {
    m.forward(y.data(), x.data(), n);
    m.backward(dx.data(), dy.data());
  }
  g_count_allocs = false;
  std::printf("[no-alloc] operator new calls during 4 steps: %ld\n", g_allocs.load());
  EXPECT_EQ(g_allocs.load(), 0);
}

// ---- capacity: hand-built case where the global order matters ---------------------------------
// E=4, K=2, N=8, cf=0.5 => capacity ceil(0.5*8*2/4) = 2. Choices (first, second) per token:
//   t0 (0,1) t1 (0,2) t2 (0,1) t3 (1,0) t4 (2,3) t5 (1,3) t6 (3,0) t7 (3,2)
// First choices, token order: e0 keeps t0,t1 and drops t2; e1 keeps t3,t5; e2 keeps t4; e3 keeps t6,t7.
// Second choices: only t1->e2 fits (e2 has 1); t0->e1, t2->e1, t3->e0, t4->e3, t5->e3, t6->e0,
// t7->e2 (e2 now full) are dropped. A token-major order would instead keep t0->e1 and drop t5->e1.
const int kChoices[8][2] = {{0, 1}, {0, 2}, {0, 1}, {1, 0}, {2, 3}, {1, 3}, {3, 0}, {3, 2}};
const std::vector<char> kExpectKept = {1, 0, 1, 1, 0, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0};  // [n*K+k]

void expect_capacity_layout(const Routing& r) {
  EXPECT_EQ(r.dropped, 8);
  EXPECT_EQ(r.tokens_per_expert, (std::vector<int64_t>{2, 2, 2, 2}));
  EXPECT_EQ(r.expert_offset, (std::vector<int64_t>{0, 2, 4, 6, 8}));
  // expert 2 holds t1 (its second choice) before t4 (first choice): rows are in token order
  EXPECT_EQ(r.row_token, (std::vector<int32_t>{0, 1, 3, 5, 1, 4, 6, 7}));
  EXPECT_EQ(r.row_assignment, (std::vector<int32_t>{0, 2, 6, 10, 3, 8, 12, 14}));
  for (int a = 0; a < 16; ++a) {
    if (kExpectKept[a]) EXPECT_GT(r.weight[a], 0.0f) << "assignment " << a;
    else EXPECT_EQ(r.weight[a], 0.0f) << "assignment " << a;
  }
}

TEST(MoeLayout, CapacityGlobalOrderStandalone) {
  Routing r;
  r.N = 8, r.K = 2, r.E = 4;
  for (int n = 0; n < 8; ++n)
    for (int k = 0; k < 2; ++k) {
      r.expert.push_back(kChoices[n][k]);
      r.prob.push_back(k == 0 ? 0.6f : 0.3f);
      r.weight.push_back(k == 0 ? 0.6f : 0.3f);
    }
  ASSERT_EQ(expert_capacity(0.5f, 8, 2, 4), 2);
  std::vector<int64_t> scratch(layout_scratch_size(4, 2));
  layout_build(r, expert_capacity(0.5f, 8, 2, 4), scratch.data());
  expect_capacity_layout(r);
  std::printf("[capacity standalone] dropped %ld of 16, tokens_per_expert sum %ld\n", static_cast<long>(r.dropped),
              static_cast<long>(std::accumulate(r.tokens_per_expert.begin(), r.tokens_per_expert.end(), int64_t{0})));
}

TEST(MoeLayout, CapacityGlobalOrderThroughLayer) {
  const int64_t N = 8;
  MoeConfig cfg = make_cfg(2, Activation::gelu, true, 0.5f);
  MoeLayer m("moe.", cfg, N);
  init_params(m, 31);
  // router = identity on the first E features, so logits[n] = x[n, 0..E)
  Param* router = find_param(m, "router.weight");
  router->value.zero();
  for (int e = 0; e < kE; ++e) router->value[e * kC + e] = 1.0f;
  std::vector<float> x(N * kC), y(N * kC);
  fill_normal(x.data(), x.size(), 17);
  for (int n = 0; n < N; ++n) {
    for (int e = 0; e < kE; ++e) x[n * kC + e] = -1.0f;
    x[n * kC + kChoices[n][0]] = 3.0f;
    x[n * kC + kChoices[n][1]] = 2.0f;
  }
  m.forward(y.data(), x.data(), N);
  const Routing& r = m.routing();
  for (int n = 0; n < N; ++n)
    for (int k = 0; k < 2; ++k) ASSERT_EQ(r.expert[n * 2 + k], kChoices[n][k]);
  expect_capacity_layout(r);
  EXPECT_EQ(std::accumulate(r.tokens_per_expert.begin(), r.tokens_per_expert.end(), int64_t{0}), N * 2 - r.dropped);
  // token 2 lost both assignments: y = 0 exactly; every row matches the reference (dropped -> 0)
  for (int64_t c = 0; c < kC; ++c) EXPECT_EQ(y[2 * kC + c], 0.0f);
  Reference ref = reference_of(m, x.data(), N);
  double max_err = 0;
  for (int64_t i = 0; i < N * kC; ++i) max_err = std::max(max_err, std::fabs(y[i] - ref.y[i]));
  for (int a = 0; a < 16; ++a) EXPECT_EQ(ref.kept[a], kExpectKept[a]) << "reference disagrees at " << a;
  std::printf("[capacity layer] dropped %ld, max|y - ref| = %.3g\n", static_cast<long>(r.dropped), max_err);
  EXPECT_LT(max_err, 1e-5);
}

// ---- layout invariants on random routings ---------------------------------------------------------
TEST(MoeLayout, InvariantsOnRandomRoutings) {
  std::mt19937 g(123);
  int cases = 0;
  for (int64_t E : {4, 6})
    for (int64_t K : {1, 2, 3})
      for (int64_t cap : {-1, 0, 3, 5, 100}) {
        const int64_t N = 24;
        Routing r;
        r.N = N, r.K = K, r.E = E;
        for (int64_t n = 0; n < N; ++n) {
          std::vector<int> perm(E);
          std::iota(perm.begin(), perm.end(), 0);
          // skewed: expert 0 is popular, so capacity binds
          std::shuffle(perm.begin(), perm.end(), g);
          if (g() % 2) std::swap(perm[0], *std::find(perm.begin(), perm.end(), 0));
          for (int64_t k = 0; k < K; ++k) r.expert.push_back(perm[k]), r.prob.push_back(0.5f), r.weight.push_back(0.5f);
        }
        std::vector<int64_t> scratch(layout_scratch_size(E, K));
        layout_build(r, cap, scratch.data());
        // independent reference for which assignments are kept (global order k-major, then n)
        std::vector<char> kept(N * K, 1);
        std::vector<int64_t> used(E, 0);
        for (int64_t k = 0; k < K; ++k)
          for (int64_t n = 0; n < N; ++n) {
            int e = r.expert[n * K + k];
            if (cap >= 0 && used[e] >= cap) kept[n * K + k] = 0;
            else ++used[e];
          }
        int64_t n_kept = std::count(kept.begin(), kept.end(), 1);
        ASSERT_EQ(r.rows(), n_kept);
        ASSERT_EQ(r.dropped, N * K - n_kept);
        ASSERT_EQ(r.expert_offset.size(), static_cast<size_t>(E + 1));
        ASSERT_EQ(r.expert_offset[0], 0);
        int64_t sum = 0;
        std::vector<int> seen(N * K, 0);
        for (int64_t e = 0; e < E; ++e) {
          ASSERT_EQ(r.tokens_per_expert[e], r.expert_offset[e + 1] - r.expert_offset[e]);
          if (cap >= 0) {
            ASSERT_LE(r.tokens_per_expert[e], cap);
          }
          sum += r.tokens_per_expert[e];
          for (int64_t row = r.expert_offset[e]; row < r.expert_offset[e + 1]; ++row) {
            const int32_t a = r.row_assignment[row];
            ASSERT_EQ(r.expert[a], e);                         // contiguous per expert
            ASSERT_EQ(r.row_token[row], a / K);                 // row_token consistent
            if (row > r.expert_offset[e]) {
              ASSERT_LT(r.row_token[row - 1], r.row_token[row]);  // token order
            }
            ++seen[a];
          }
        }
        ASSERT_EQ(sum, N * K - r.dropped);
        for (int64_t a = 0; a < N * K; ++a) {
          ASSERT_EQ(seen[a], kept[a]) << "assignment " << a;  // each kept one exactly once
          ASSERT_EQ(r.weight[a], kept[a] ? 0.5f : 0.0f);
        }
        ++cases;
      }
  std::printf("[layout invariants] %d routings checked, all invariants hold\n", cases);
}

// Experts phase standalone: offsets that do not start at 0 and an expert with no rows.
TEST(MoeExperts, StandaloneOffsets) {
  const ExpertShape s{3, kC, kF, Activation::swiglu};
  const int64_t off[4] = {2, 5, 5, 9};  // rows [2,9): e0 3 rows, e1 none, e2 4 rows
  const int64_t R = 9;
  std::vector<float> w1(3 * kF * kC), w2(3 * kC * kF), w3(3 * kF * kC), xp(R * kC);
  fill_normal(w1.data(), w1.size(), 1, 0.3f);
  fill_normal(w2.data(), w2.size(), 2, 0.3f);
  fill_normal(w3.data(), w3.size(), 3, 0.3f);
  fill_normal(xp.data(), xp.size(), 4);
  std::vector<float> out(R * kC, 123.0f), h1(R * kF), h3(R * kF), act(R * kF);
  experts_forward(out.data(), h1.data(), h3.data(), act.data(), xp.data(), off, w1.data(), w2.data(), w3.data(), s);
  double max_err = 0;
  for (int64_t e = 0; e < 3; ++e)
    for (int64_t row = off[e]; row < off[e + 1]; ++row)
      for (int64_t c = 0; c < kC; ++c) {
        double o = 0;
        for (int64_t f = 0; f < kF; ++f) {
          double g = 0, u = 0;
          for (int64_t j = 0; j < kC; ++j) {
            g += static_cast<double>(w1[(e * kF + f) * kC + j]) * xp[row * kC + j];
            u += static_cast<double>(w3[(e * kF + f) * kC + j]) * xp[row * kC + j];
          }
          o += static_cast<double>(w2[(e * kC + c) * kF + f]) * silu_ref(g) * u;
        }
        max_err = std::max(max_err, std::fabs(out[row * kC + c] - o));
      }
  for (int64_t i = 0; i < 2 * kC; ++i) EXPECT_EQ(out[i], 123.0f);  // rows before off[0] untouched
  std::printf("[experts standalone] max err %.3g\n", max_err);
  EXPECT_LT(max_err, 1e-5);
}

// Experts spread one per thread (experts_thread_plan) compute what one thread computes, bit for bit:
// every GEMM and activation of an expert then runs on a single thread either way. Shapes large enough
// that oneDNN splits each GEMM over 2 threads when the experts run in turn; offsets that do not start
// at 0, an expert with no rows. With skewed rows the plan is empty and the experts run in turn.
TEST(MoeExperts, OnePerThreadEqualsOneThread) {
  pin_gemm_backend("onednn", "test: the plan runs one expert per thread with oneDNN only");
  constexpr int64_t C = 64, F = 256, E = 5;
  for (const Activation act_kind : {Activation::gelu, Activation::swiglu}) {
    const ExpertShape s{E, C, F, act_kind};
    const bool swiglu = act_kind == Activation::swiglu;
    for (const bool balanced : {true, false}) {
      // rows per expert: balanced {96, 0, 96, 96, 96} (two threads: 192 each), skewed {300, 0, 20, 40, 24}
      const std::vector<int64_t> off = balanced ? std::vector<int64_t>{8, 104, 104, 200, 296, 392}
                                                : std::vector<int64_t>{8, 308, 308, 328, 368, 392};
      const int64_t R = off[E];
      std::vector<float> w1(E * F * C), w2(E * C * F), w3(E * F * C), xp(R * C), dout(R * C);
      fill_normal(w1.data(), w1.size(), 11, 0.1f);
      fill_normal(w2.data(), w2.size(), 12, 0.1f);
      fill_normal(w3.data(), w3.size(), 13, 0.1f);
      fill_normal(xp.data(), xp.size(), 14);
      fill_normal(dout.data(), dout.size(), 15);
      struct Result {
        std::vector<float> out, dxp, dw1, dw2, dw3;
        size_t plan_threads = 0;
      };
      auto run = [&](int threads) {
        const int before = omp_get_max_threads();
        omp_set_num_threads(threads);
        Result r{std::vector<float>(R * C), std::vector<float>(R * C), std::vector<float>(E * F * C),
                 std::vector<float>(E * C * F), std::vector<float>(E * F * C)};
        r.plan_threads = experts_thread_plan(off.data(), E).size();
        std::vector<float> h1(R * F), h3(R * F), act(R * F), dact(R * F), dh1(R * F), dh3(R * F);
        experts_forward(r.out.data(), h1.data(), swiglu ? h3.data() : nullptr, act.data(), xp.data(), off.data(),
                        w1.data(), w2.data(), swiglu ? w3.data() : nullptr, s);
        experts_backward(r.dxp.data(), r.dw1.data(), r.dw2.data(), swiglu ? r.dw3.data() : nullptr, dact.data(),
                         dh1.data(), swiglu ? dh3.data() : nullptr, dout.data(), xp.data(), h1.data(),
                         swiglu ? h3.data() : nullptr, act.data(), off.data(), w1.data(), w2.data(),
                         swiglu ? w3.data() : nullptr, s);
        omp_set_num_threads(before);
        return r;
      };
      const Result one = run(1), two = run(2);
      EXPECT_EQ(one.plan_threads, 0u);
      EXPECT_EQ(two.plan_threads, balanced ? 2u : 0u) << (balanced ? "balanced" : "skewed");
      double max_diff = 0;
      for (auto member : {&Result::out, &Result::dxp, &Result::dw1, &Result::dw2, &Result::dw3}) {
        const std::vector<float>&a = one.*member, &b = two.*member;
        for (size_t i = 0; i < a.size(); ++i)
          max_diff = std::max(max_diff, static_cast<double>(std::fabs(a[i] - b[i])));
        if (balanced) {
          EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
        }
      }
      std::printf("[experts one per thread] %s, %s rows: 2 threads vs 1, max diff %.3g\n", swiglu ? "swiglu" : "gelu",
                  balanced ? "balanced" : "skewed", max_diff);
      EXPECT_LT(max_diff, 1e-4);
    }
  }
}

// ---- router losses: closed forms ------------------------------------------------------------------
TEST(MoeRouterLoss, UniformRouterGivesAuxOneAndZLogESquared) {
  for (int64_t K : {1, 2}) {
    MoeLayer m("moe.", make_cfg(K, Activation::gelu, true, 0), kN);
    init_params(m, 41);
    find_param(m, "router.weight")->value.zero();  // logits 0 => probs uniform 1/E
    std::vector<float> x(kN * kC), y(kN * kC);
    fill_normal(x.data(), x.size(), 43);
    m.forward(y.data(), x.data(), kN);
    // aux = E * sum_e f_e * (1/E) = sum_e f_e = 1 whatever the (tied) choices; z = log(E)^2
    const double z_expect = std::log(static_cast<double>(kE)) * std::log(static_cast<double>(kE));
    std::printf("[router uniform K=%ld] |aux - 1| = %.3g  |z - log(E)^2| = %.3g\n", static_cast<long>(K),
                std::fabs(m.aux_loss() - 1.0), std::fabs(m.z_loss() - z_expect));
    EXPECT_NEAR(m.aux_loss(), 1.0, 1e-6);
    EXPECT_NEAR(m.z_loss(), z_expect, 1e-6);
    // ties go to the lower expert index
    for (int64_t n = 0; n < kN; ++n)
      for (int64_t k = 0; k < K; ++k) EXPECT_EQ(m.routing().expert[n * K + k], k);
  }
}

TEST(MoeRouterLoss, EvenlySpreadChoicesGiveAuxOne) {
  // router = identity on the first E features; token n's logits are v rotated by n, so every expert
  // is chosen equally often (f_e = 1/E) and mean probs are uniform (P_e = 1/E): aux = 1;
  // every row has the same logsumexp: z = lse(v)^2.
  const double v[kE] = {1.5, 0.5, -0.25, -1.0};
  for (int64_t K : {1, 2}) {
    MoeLayer m("moe.", make_cfg(K, Activation::swiglu, true, 0), kN);
    init_params(m, 47);
    Param* router = find_param(m, "router.weight");
    router->value.zero();
    for (int e = 0; e < kE; ++e) router->value[e * kC + e] = 1.0f;
    std::vector<float> x(kN * kC, 0.0f), y(kN * kC);
    for (int64_t n = 0; n < kN; ++n)
      for (int64_t e = 0; e < kE; ++e) x[n * kC + e] = static_cast<float>(v[(e - n % kE + kE) % kE]);
    m.forward(y.data(), x.data(), kN);
    double se = 0;
    for (double l : v) se += std::exp(l);
    const double z_expect = std::log(se) * std::log(se);
    for (int64_t e = 0; e < kE; ++e) EXPECT_EQ(m.routing().tokens_per_expert[e], kN * K / kE);
    std::printf("[router spread K=%ld] |aux - 1| = %.3g  |z - lse^2| = %.3g\n", static_cast<long>(K),
                std::fabs(m.aux_loss() - 1.0), std::fabs(m.z_loss() - z_expect));
    EXPECT_NEAR(m.aux_loss(), 1.0, 1e-6);
    EXPECT_NEAR(m.z_loss(), z_expect, 1e-5);
  }
}

TEST(MoeLayer, RejectsBadConfigAndOversizedBatch) {
  EXPECT_THROW(MoeLayer("m.", make_cfg(5, Activation::gelu, true, 0), 8), std::invalid_argument);  // K > E
  EXPECT_THROW(MoeLayer("m.", make_cfg(1, Activation::gelu, true, -1.0f), 8), std::invalid_argument);
  MoeLayer m("m.", make_cfg(1, Activation::gelu, true, 0), 8);
  std::vector<float> x(16 * kC), y(16 * kC);
  EXPECT_THROW(m.forward(y.data(), x.data(), 9), std::logic_error);
  EXPECT_EQ(m.params().size(), 3u);
  EXPECT_EQ(find_param(m, "router.weight")->name, "m.router.weight");
}

}  // namespace
}  // namespace moe
