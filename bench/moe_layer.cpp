// moe bench moe-layer: see bench.h.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench.h"
#include "bench/report.h"
#include "moe/experts.h"
#include "moe/moe_layer.h"
#include "tensor/ops.h"
#include "tensor/tensor.h"

namespace moe::bench {
namespace {

constexpr int64_t kC = 512, kF = 2048, kE = 8, kK = 2, kN = 4096;

double median_ms(int repeats, const std::function<void()>& fn) {
  fn();  // warm-up: first-touch pages, GEMM backend probe
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void fill(Tensor& t, uint64_t seed, float scale) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < t.numel(); ++i) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;  // xorshift: cheap, deterministic
    t[i] = scale * (static_cast<float>(s >> 40) / static_cast<float>(1 << 24) - 0.5f);
  }
}

// This CPU's FP32 fused multiply-add peak on `threads` threads, GFLOP/s: independent FMA chains on the
// widest vectors the build targets (-march=native: 16 lanes with AVX-512, else 8 with AVX2 and FMA),
// enough chains per thread to cover the FMA units' latency, for ~0.2 s. The ceiling a GEMM kernel
// can approach here; the GEMM rate below is measured against it.
double fma_peak_gflops(int threads) {
#if defined(__AVX512F__)
  using V = __m512;
  constexpr int kLanes = 16, kChains = 16;
  auto fma = [](V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); };
  auto set1 = [](float x) { return _mm512_set1_ps(x); };
#elif defined(__AVX2__) && defined(__FMA__)
  using V = __m256;
  constexpr int kLanes = 8, kChains = 12;
  auto fma = [](V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); };
  auto set1 = [](float x) { return _mm256_set1_ps(x); };
#else
  return 0;  // no FMA vectors in this build
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  auto sum = [](V v) {
    float f[kLanes];
    std::memcpy(f, &v, sizeof f);
    float t = 0;
    for (float x : f) t += x;
    return t;
  };
  constexpr int64_t kIters = 1 << 22;
  double best = 0;
  for (int attempt = 0; attempt < 3; ++attempt) {
    float sink = 0;
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
      V acc[kChains];
      for (int i = 0; i < kChains; ++i) acc[i] = set1(1.0f + 1e-3f * i);
      const V m = set1(0.999999f), a = set1(1e-7f);
      for (int64_t it = 0; it < kIters; ++it)
        for (int i = 0; i < kChains; ++i) acc[i] = fma(acc[i], m, a);
      for (int i = 0; i < kChains; ++i) sink += sum(acc[i]);
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (sink == 42.0f) std::fputc(0, stderr);  // keeps the chains alive
    best = std::max(best, 2.0 * kLanes * kChains * kIters * threads / s * 1e-9);
  }
  return best;
#endif
}

// The OpenBLAS kernels the PyTorch peer is timed with: its own detection (no OPENBLAS_CORETYPE, which
// some machines set to dodge old detection bugs) and the newest kernels this CPU's ISA runs, so the
// peer is at its best kernel on whatever CPU the benchmark meets. "" is OpenBLAS's own choice.
std::vector<std::string> peer_coretypes() {
  std::vector<std::string> c{""};
  if (__builtin_cpu_supports("avx512f")) {
    c.push_back("SkylakeX");
    if (__builtin_cpu_supports("avx512bf16")) c.push_back("Cooperlake");
  }
  if (__builtin_cpu_supports("avx2")) c.insert(c.end(), {"Haswell", "Zen"});
  return c;
}

// Runs the PyTorch peer with OpenBLAS's kernel `coretype` ("": as OpenBLAS detects); false if it
// could not run (a kernel this CPU lacks ends the process with SIGILL).
bool run_peer(const std::string& coretype, int threads, int repeats, double* fwd_ms, double* fwdbwd_ms) {
  const std::string kernel =
      coretype.empty() ? "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE" : "env OPENBLAS_CORETYPE=" + coretype;
  // glibc malloc returns freed blocks above 32 MiB to the OS, so every step of the peer's backward
  // page-faults its [E,F,C] gradient buffers in again (2.8 s instead of 0.84 s fwd+bwd, measured):
  // keep freed memory, as the allocators PyTorch's CPU tuning guide recommends do.
  const std::string malloc_keep = " GLIBC_TUNABLES=glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=4294967296";
  std::string cmd = kernel + malloc_keep + " OMP_NUM_THREADS=" + std::to_string(threads) + " /usr/bin/python3 " + torch_peer_script() +
                    " --threads " + std::to_string(threads) + " --repeats " + std::to_string(repeats) + " 2>/dev/null";
  std::unique_ptr<FILE, int (*)(FILE*)> p(popen(cmd.c_str(), "r"), pclose);
  if (!p) return false;
  std::string out;
  char buf[512];
  while (fgets(buf, sizeof buf, p.get())) out += buf;
  auto j = nlohmann::json::parse(out, nullptr, false);
  if (j.is_discarded() || !j.contains("forward_ms")) return false;
  *fwd_ms = j["forward_ms"].get<double>();
  *fwdbwd_ms = j["forward_backward_ms"].get<double>();
  return true;
}

}  // namespace

int moe_layer(const BenchOptions& opt) {
  omp_set_num_threads(opt.threads);
  // One kernel for the whole bench, chosen as `moe train` chooses it (the best of interleaved rounds
  // on the expert shapes, OpenBLAS only when clearly faster), not by gemm()'s one lazy timing, which
  // a noisy moment can flip.
  const GemmRates rates = measure_gemm_backends(expert_gemm_shapes(kN * kK / kE, kC, kF), 7);
  pin_gemm_backend(pick_gemm_backend(rates), describe_gemm_rates(rates));
  Report report("moe-layer",
                "one MoE layer on this CPU: d_model " + std::to_string(kC) + ", d_ffn " + std::to_string(kF) + ", " +
                    std::to_string(kE) + " experts, top-" + std::to_string(kK) + ", " + std::to_string(kN) +
                    " tokens, GELU; median of " + std::to_string(opt.repeats),
                opt, /*uses_gemm=*/true);
  report.note("GEMM kernel: " + gemm_backend());
  // A row: time, tokens/s, GFLOP/s (NaN where the column does not apply) and what it is measured against.
  const double nan = std::nan("");
  auto row = [&](const std::string& name, double ms, double tokens_per_s, double gflops, const std::string& note) {
    report.row({name, ms, tokens_per_s, gflops, note});
  };

  MoeConfig cfg;
  cfg.d_model = kC, cfg.d_ffn = kF, cfg.n_experts = kE, cfg.top_k = kK;
  MoeLayer layer("moe.", cfg, kN);
  uint64_t seed = 1;
  for (Param* p : layer.params()) fill(p->value, seed++, 0.05f);
  Tensor x({kN, kC}), y({kN, kC}), dy({kN, kC}), dx({kN, kC});
  fill(x, 100, 2.0f);
  fill(dy, 101, 1.0f);
  layer.forward(y.data(), x.data(), kN);
  const Routing& r = layer.routing();
  int64_t R = r.rows();
  int64_t max_rows = *std::max_element(r.tokens_per_expert.begin(), r.tokens_per_expert.end());
  report.table("the layer, its experts and its references",
               {{"measurement", "", 0, 46}, {"time", "ms"}, {"tokens/s", "1/s", 0}, {"rate", "GFLOP/s", 1}, {"note", ""}});

  // 0. The CPU's FMA peak: what every other rate is a share of.
  const double peak = fma_peak_gflops(opt.threads);
  row("FP32 FMA peak (" + std::to_string(opt.threads) + " threads)", nan, nan, peak, "independent FMA chains");

  // 1. This machine's GEMM rate on the expert shapes (balanced rows per expert), each backend.
  int64_t M = R / kE;
  Tensor a({std::max(M, kF), kF}), b({kF, kF}), c({std::max(M, kF), kF});
  fill(a, 7, 1.0f), fill(b, 8, 1.0f);
  double gemm_flops = 0;
  const std::vector<GemmShape> shapes = expert_gemm_shapes(M, kC, kF);
  for (const GemmShape& g : shapes) gemm_flops += 2.0 * g.M * g.N * g.K;
  double gemm_rate = 0;
  const std::string chosen = gemm_backend_name();
  for (const char* backend : {"onednn", "openblas"}) {
    double ms = median_ms(opt.repeats, [&] {
      for (const GemmShape& g : shapes)
        gemm_with(backend, g.trans_a, g.trans_b, g.M, g.N, g.K, 1.0f, a.data(), g.trans_a ? g.M : g.K, b.data(),
                  g.trans_b ? g.K : g.N, 0.0f, c.data(), g.N);
    });
    double rate = gemm_flops / (ms * 1e6);
    if (backend == chosen) gemm_rate = rate;
    char note[64];
    std::snprintf(note, sizeof note, "%s%.0f%% of FMA peak", backend == chosen ? "in use, the reference; " : "",
                  100 * rate / peak);
    row(std::string("GEMM, expert shapes x6, ") + backend, ms, nan, rate, note);
  }

  // 2. The MoE layer.
  double expert_flops_fwd = 2.0 * R * kC * kF * 2;
  double router_flops_fwd = 2.0 * kN * kC * kE;
  double fwd_ms = median_ms(opt.repeats, [&] { layer.forward(y.data(), x.data(), kN); });
  double fwdbwd_ms = median_ms(opt.repeats, [&] {
    for (Param* p : layer.params()) p->grad.zero();
    dx.zero();
    layer.forward(y.data(), x.data(), kN);
    layer.backward(dx.data(), dy.data());
  });
  char load[64];
  std::snprintf(load, sizeof load, "%lld rows, expert load max/mean %.2f", (long long)R, max_rows / (double(R) / kE));
  row("MoE layer forward", fwd_ms, kN / (fwd_ms * 1e-3), (expert_flops_fwd + router_flops_fwd) / (fwd_ms * 1e6), load);
  row("MoE layer forward+backward", fwdbwd_ms, kN / (fwdbwd_ms * 1e-3),
      3 * (expert_flops_fwd + router_flops_fwd) / (fwdbwd_ms * 1e6), "");

  // 3. The experts phase alone (the layer's GEMM chains over its permuted rows).
  ExpertShape s{kE, kC, kF, Activation::gelu};
  Tensor xp({R, kC}), out({R, kC}), h1({R, kF}), act({R, kF}), dout({R, kC}), dxp({R, kC}), dact({R, kF}),
      dh1({R, kF});
  fill(xp, 9, 2.0f), fill(dout, 10, 1.0f);
  Param *w1 = nullptr, *w2 = nullptr;
  for (Param* p : layer.params()) {
    if (p->name == "moe.w1") w1 = p;
    if (p->name == "moe.w2") w2 = p;
  }
  if (!w1 || !w2) throw std::logic_error("bench: MoE layer has no moe.w1 / moe.w2");
  double experts_ms = median_ms(opt.repeats, [&] {
    experts_forward(out.data(), h1.data(), nullptr, act.data(), xp.data(), r.expert_offset.data(), w1->value.data(),
                    w2->value.data(), nullptr, s);
    experts_backward(dxp.data(), w1->grad.data(), w2->grad.data(), nullptr, dact.data(), dh1.data(), nullptr,
                     dout.data(), xp.data(), h1.data(), nullptr, act.data(), r.expert_offset.data(),
                     w1->value.data(), w2->value.data(), nullptr, s);
  });
  double experts_rate = 3 * expert_flops_fwd / (experts_ms * 1e6);
  char note[64];
  std::snprintf(note, sizeof note, "%.0f%% of the GEMM rate", 100 * experts_rate / gemm_rate);
  row("experts fwd+bwd (GEMM chains + activation)", experts_ms, kN / (experts_ms * 1e-3), experts_rate, note);
  std::snprintf(note, sizeof note, "experts are %.0f%% of layer time", 100 * experts_ms / fwdbwd_ms);
  row("  rest of the layer (router, permute, combine)", fwdbwd_ms - experts_ms, nan, nan, note);
  report.note("goal (the project's, not measured): experts >= 85% of the GEMM rate; the layer >= 2x the PyTorch "
              "peer at its best kernel, forward+backward");

  // 4. The PyTorch peer, at its best of the OpenBLAS kernels this CPU runs.
  if (opt.skip_torch) return report.finish(0);
  double best_fwd = 0, best_fb = 0;
  std::string best_core;
  report.table("the PyTorch peer (bench/torch_moe_layer_peer.py), each OpenBLAS kernel this CPU runs",
               {{"measurement", "", 0, 46}, {"time", "ms"}, {"tokens/s", "1/s", 0}, {"rate", "GFLOP/s", 1}, {"kernel", ""}});
  for (const std::string& core : peer_coretypes()) {
    double f, fb;
    const std::string label = core.empty() ? std::string("OpenBLAS's own detection") : "OPENBLAS_CORETYPE=" + core;
    if (!run_peer(core, opt.threads, opt.repeats, &f, &fb)) {
      row("PyTorch peer fwd+bwd", nan, nan, nan, label + ": did not run");
      continue;
    }
    row("PyTorch peer fwd+bwd", fb, kN / (fb * 1e-3), 3 * (expert_flops_fwd + router_flops_fwd) / (fb * 1e6), label);
    if (best_fb == 0 || fb < best_fb) best_fwd = f, best_fb = fb, best_core = core.empty() ? "detected" : core;
  }
  if (best_fb == 0) {
    report.note("PyTorch peer could not run (/usr/bin/python3 with torch: scripts/setup.sh --test)");
    return report.finish(1);
  }
  report.table("moe against the PyTorch peer at its best kernel (" + best_core + ")",
               {{"pass", ""}, {"moe", "tokens/s", 0}, {"peer", "tokens/s", 0}, {"peer time / moe time", "x"}});
  report.row({std::string("forward"), kN / (fwd_ms * 1e-3), kN / (best_fwd * 1e-3), best_fwd / fwd_ms});
  report.row({std::string("forward+backward"), kN / (fwdbwd_ms * 1e-3), kN / (best_fb * 1e-3), best_fb / fwdbwd_ms});
  return report.finish(0);
}

}  // namespace moe::bench
