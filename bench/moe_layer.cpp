// moe bench moe-layer: see bench.h.
#include <fcntl.h>
#include <immintrin.h>
#include <omp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

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
#include <thread>
#include <vector>

#include "bench/bench.h"
#include "bench/report.h"
#include "moe/experts.h"
#include "moe/moe_layer.h"
#include "tensor/ops.h"
#include "tensor/tensor.h"

namespace moe::bench {
namespace {

constexpr int64_t kC = 512, kF = 2048, kE = 8, kK = 2, kN = 4096;

double time_ms(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

double median_ms(int repeats, const std::function<void()>& fn) {
  fn();  // warm-up: first-touch pages, GEMM backend probe
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i) t.push_back(time_ms(fn));
  return median(t);
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

// The PyTorch peer as a child process (torch_moe_layer_peer.py --serve) with OpenBLAS's kernel
// `coretype` ("": as OpenBLAS detects it): it times one pass per request, so the bench alternates the
// peer's passes with moe's and pairs each with one of moe's seconds apart. Unpaired, the two sides
// met different spells of this machine (its FMA rate moves by up to 2.4x between them, docs/cpus.md)
// and the ratio moved 1.4-2.7x from run to run. Not thread safe; one request at a time.
class Peer {
 public:
  Peer(const std::string& coretype, int threads) {
    // The child's environment, made before fork (the child only execs).
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e) {
      const std::string kv = *e;
      const std::string key = kv.substr(0, kv.find('='));
      if (key != "OPENBLAS_CORETYPE" && key != "OPENBLAS_L2_SIZE" && key != "GLIBC_TUNABLES" &&
          key != "OMP_NUM_THREADS")
        env.push_back(kv);  // OPENBLAS_THREAD_TIMEOUT among them: see below
    }
    if (!coretype.empty()) env.push_back("OPENBLAS_CORETYPE=" + coretype);
    // OPENBLAS_THREAD_TIMEOUT passes on as moe runs with it (src/cli/main.cpp sets it): the peer's
    // OpenBLAS workers sleep right after a call too, and PyTorch's OpenMP loops keep their CPUs; fwd+bwd
    // 1,364-1,693 against 1,615-1,889 ms at OpenBLAS's default (3 rounds, AVX2 AMD EPYC, 2026-11-27).
    // glibc malloc returns freed blocks above 32 MiB to the OS, so every step of the peer's backward
    // page-faults its [E,F,C] gradient buffers in again (2.8 s instead of 0.84 s fwd+bwd, measured):
    // keep freed memory, as the allocators PyTorch's CPU tuning guide recommends do.
    env.push_back("GLIBC_TUNABLES=glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=4294967296");
    env.push_back("OMP_NUM_THREADS=" + std::to_string(threads));
    const std::string script = torch_peer_script(), nthreads = std::to_string(threads);
    std::vector<char*> envp, argv;
    for (std::string& kv : env) envp.push_back(kv.data());
    envp.push_back(nullptr);
    for (const char* a : {"/usr/bin/python3", script.c_str(), "--serve", "--threads", nthreads.c_str()})
      argv.push_back(const_cast<char*>(a));
    argv.push_back(nullptr);
    int to_child[2], from_child[2];
    // Close-on-exec: a peer started later must not hold this one's input open (it would never see EOF).
    if (pipe2(to_child, O_CLOEXEC) != 0) return;
    if (pipe2(from_child, O_CLOEXEC) != 0) {
      close(to_child[0]), close(to_child[1]);
      return;
    }
    pid_ = fork();
    if (pid_ == 0) {
      dup2(to_child[0], 0), dup2(from_child[1], 1);
      const int devnull = open("/dev/null", O_WRONLY);
      if (devnull >= 0) dup2(devnull, 2);
      for (int fd : {to_child[0], to_child[1], from_child[0], from_child[1]}) close(fd);
      execve(argv[0], argv.data(), envp.data());
      _exit(127);
    }
    close(to_child[0]), close(from_child[1]);
    if (pid_ < 0) {
      close(to_child[1]), close(from_child[0]);
      return;
    }
    to_ = fdopen(to_child[1], "w");
    from_ = fdopen(from_child[0], "r");
  }
  ~Peer() {
    if (to_) std::fclose(to_);  // end of its input: it exits
    if (from_) std::fclose(from_);
    if (pid_ > 0) waitpid(pid_, nullptr, 0);
  }
  Peer(const Peer&) = delete;
  Peer& operator=(const Peer&) = delete;

  // Blocks until the peer has warmed up; false if it could not run (no torch, or a kernel this CPU
  // lacks: SIGILL).
  bool ready() {
    if (!ready_ && from_) ready_ = read_line() == "ready";
    return ready_;
  }
  // One timed pass ("fwd" or "fwdbwd") in milliseconds, as the peer measured it; NaN if it died.
  double time_ms(const char* pass) {
    if (!ready_ || std::fprintf(to_, "%s\n", pass) < 0 || std::fflush(to_) != 0) return std::nan("");
    const std::string line = read_line();
    char* end = nullptr;
    const double ms = std::strtod(line.c_str(), &end);
    return end != line.c_str() ? ms : std::nan("");
  }

 private:
  std::string read_line() {
    char buf[128];
    if (!std::fgets(buf, sizeof buf, from_)) return "";
    std::string line = buf;
    while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
    return line;
  }
  pid_t pid_ = -1;
  FILE* to_ = nullptr;
  FILE* from_ = nullptr;
  bool ready_ = false;
};

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
  const std::string chosen = gemm_backend_name();
  auto gemm_pass_with = [&](const std::string& backend) {
    for (const GemmShape& g : shapes)
      gemm_with(backend, g.trans_a, g.trans_b, g.M, g.N, g.K, 1.0f, a.data(), g.trans_a ? g.M : g.K, b.data(),
                g.trans_b ? g.K : g.N, 0.0f, c.data(), g.N);
  };
  auto gemm_pass = [&] { gemm_pass_with(chosen); };
  for (const char* backend : {"onednn", "openblas"}) {
    double ms = median_ms(opt.repeats, [&] { gemm_pass_with(backend); });
    double rate = gemm_flops / (ms * 1e6);
    char note[64];
    std::snprintf(note, sizeof note, "%s%.0f%% of FMA peak", backend == chosen ? "in use, the reference; " : "",
                  100 * rate / peak);
    row(std::string("GEMM, expert shapes x6, ") + backend, ms, nan, rate, note);
  }

  // 2. The MoE layer.
  double expert_flops_fwd = 2.0 * R * kC * kF * 2;
  double router_flops_fwd = 2.0 * kN * kC * kE;
  const std::function<void()> fwd_pass = [&] { layer.forward(y.data(), x.data(), kN); };
  const std::function<void()> fwdbwd_pass = [&] {
    for (Param* p : layer.params()) p->grad.zero();
    dx.zero();
    layer.forward(y.data(), x.data(), kN);
    layer.backward(dx.data(), dy.data());
  };
  const double fwd_ms = median_ms(opt.repeats, fwd_pass);
  const double fwdbwd_ms = median_ms(opt.repeats, fwdbwd_pass);
  char load[96];
  std::snprintf(load, sizeof load, "%lld rows, expert load max/mean %.2f, %s", (long long)R,
                max_rows / (double(R) / kE),
                experts_thread_plan(r.expert_offset.data(), kE).empty() ? "experts in turn" : "one expert per thread");
  row("MoE layer forward", fwd_ms, kN / (fwd_ms * 1e-3), (expert_flops_fwd + router_flops_fwd) / (fwd_ms * 1e6), load);
  const double layer_flops = 3 * (expert_flops_fwd + router_flops_fwd);  // forward+backward
  row("MoE layer forward+backward", fwdbwd_ms, kN / (fwdbwd_ms * 1e-3), layer_flops / (fwdbwd_ms * 1e6), "");

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
  auto experts_pass = [&] {
    experts_forward(out.data(), h1.data(), nullptr, act.data(), xp.data(), r.expert_offset.data(), w1->value.data(),
                    w2->value.data(), nullptr, s);
    experts_backward(dxp.data(), w1->grad.data(), w2->grad.data(), nullptr, dact.data(), dh1.data(), nullptr,
                     dout.data(), xp.data(), h1.data(), nullptr, act.data(), r.expert_offset.data(),
                     w1->value.data(), w2->value.data(), nullptr, s);
  };
  // Each pass paired with one of the reference GEMMs right before it: their ratio, pass by pass, is
  // what the machine's spells leave alone.
  experts_pass();
  std::vector<double> experts_times, experts_shares;
  for (int i = 0; i < opt.repeats; ++i) {
    const double gemm_ms = time_ms(gemm_pass);
    const double ms = time_ms(experts_pass);
    experts_times.push_back(ms);
    experts_shares.push_back((3 * expert_flops_fwd / ms) / (gemm_flops / gemm_ms));
  }
  const double experts_ms = median(experts_times);
  double experts_rate = 3 * expert_flops_fwd / (experts_ms * 1e6);
  char note[96];
  std::snprintf(note, sizeof note, "%.0f%% of the GEMM rate (paired, %.0f-%.0f%%)", 100 * median(experts_shares),
                100 * *std::min_element(experts_shares.begin(), experts_shares.end()),
                100 * *std::max_element(experts_shares.begin(), experts_shares.end()));
  row("experts fwd+bwd (GEMM chains + activation)", experts_ms, kN / (experts_ms * 1e-3), experts_rate, note);
  // The activation is the experts' one pass over memory outside the GEMMs (it ran scalar on AVX2
  // once, 14% of the experts' time): forward from h1, backward in place on a fresh copy of dact
  // each time (repeated in place, gradients would shrink to denormals).
  Tensor dact_in({R, kF});
  std::vector<double> gelu_times;
  for (int i = 0; i < opt.repeats; ++i) {
    std::copy(dact.data(), dact.data() + R * kF, dact_in.data());
    gelu_times.push_back(time_ms([&] {
      gelu_forward(act.data(), h1.data(), R * kF);
      gelu_backward_inplace(dact_in.data(), h1.data(), R * kF);
    }));
  }
  const double gelu_ms = median(gelu_times);
  // forward reads h1, writes act; backward reads h1 and dact, writes dact: 5 floats an element.
  std::snprintf(note, sizeof note, "%.0f%% of the experts' time, %.1f GB/s", 100 * gelu_ms / experts_ms,
                5.0 * 4 * R * kF / (gelu_ms * 1e6));
  row("  activation (GELU fwd+bwd)", gelu_ms, nan, nan, note);
  std::snprintf(note, sizeof note, "experts are %.0f%% of layer time", 100 * experts_ms / fwdbwd_ms);
  row("  rest of the layer (router, permute, combine)", fwdbwd_ms - experts_ms, nan, nan, note);
  report.note("goal (the project's, not measured): experts >= 85% of the GEMM rate; the layer >= 2x the PyTorch "
              "peer at its best kernel, forward+backward");

  // 4. The PyTorch peer at each OpenBLAS kernel this CPU runs, all of them started at once and taking
  //    turns, each of its passes paired with one of moe's right before or after it (the order
  //    alternating by round, so a drift weighs on both sides alike). The reference is the kernel
  //    with the lowest median paired ratio.
  if (opt.skip_torch) return report.finish(0);
  signal(SIGPIPE, SIG_IGN);  // a peer that dies shows as a failed pass, not as the end of the bench
  struct PeerRuns {
    std::string core, label;
    std::unique_ptr<Peer> peer;
    bool died = false;
    std::vector<double> moe_ms[2], peer_ms[2];  // the pairs' times: [0] forward, [1] forward+backward
  };
  // Peer time / moe time over the pairs of pass k.
  auto paired = [](const PeerRuns& p, int k) { return paired_rounds(p.peer_ms[k], p.moe_ms[k]); };
  std::vector<PeerRuns> peers;
  for (const std::string& core : peer_coretypes()) {
    PeerRuns& p = peers.emplace_back();
    p.core = core;
    p.label = core.empty() ? std::string("OpenBLAS's own detection") : "OPENBLAS_CORETYPE=" + core;
    p.peer = std::make_unique<Peer>(core, opt.threads);
  }
  for (PeerRuns& p : peers)
    if (!p.peer->ready()) p.died = true;
  const char* const pass_name[2] = {"fwd", "fwdbwd"};
  const std::function<void()>* const moe_pass[2] = {&fwd_pass, &fwdbwd_pass};
  // Each pass starts on CPUs the other side has left: at OpenBLAS's default its worker threads poll
  // (sched_yield) for 2^28 TSC cycles, 0.1 s at 2.7 GHz, after a call, so the pass right after a
  // peer's shared the CPUs with them (0.1 s of CPU in a peer idle 0.5 s after one matmul, measured;
  // moe's figures here ran 5-9% below the same passes timed alone, AVX2 AMD EPYC). The peer's workers
  // now sleep at once (above); the pause stays for whatever else a pass leaves running.
  auto settle = [] { std::this_thread::sleep_for(std::chrono::milliseconds(250)); };
  for (int round = 0; round < opt.repeats; ++round) {
    for (PeerRuns& p : peers) {
      for (int k = 0; k < 2 && !p.died; ++k) {
        double moe_ms = 0, peer_ms = 0;
        if (round % 2 == 0) {
          settle(), moe_ms = time_ms(*moe_pass[k]);
          settle(), peer_ms = p.peer->time_ms(pass_name[k]);
        } else {
          settle(), peer_ms = p.peer->time_ms(pass_name[k]);
          settle(), moe_ms = time_ms(*moe_pass[k]);
        }
        if (std::isnan(peer_ms)) {
          p.died = true;
          break;
        }
        p.moe_ms[k].push_back(moe_ms), p.peer_ms[k].push_back(peer_ms);
      }
    }
  }
  report.table("the PyTorch peer (bench/torch_moe_layer_peer.py) at each OpenBLAS kernel this CPU runs, "
               "forward+backward",
               {{"kernel", "", 0, 30}, {"time", "ms"}, {"tokens/s", "1/s", 0}, {"rate", "GFLOP/s", 1},
                {"peer time / moe time, paired", "x"}});
  const PeerRuns* best = nullptr;
  for (const PeerRuns& p : peers) {
    if (p.died) {
      report.row({p.label + ": did not run", nan, nan, nan, nan});
      continue;
    }
    const double ms = median(p.peer_ms[1]);
    report.row({p.label, ms, kN / (ms * 1e-3), layer_flops / (ms * 1e6), paired(p, 1).median});
    if (!best || paired(p, 1).median < paired(*best, 1).median) best = &p;
  }
  if (!best) {
    report.note("PyTorch peer could not run (/usr/bin/python3 with torch: scripts/setup.sh --test)");
    return report.finish(1);
  }
  report.table("moe against the PyTorch peer at its best kernel (" + (best->core.empty() ? "detected" : best->core) +
                   "), " + std::to_string(best->moe_ms[1].size()) + " paired passes",
               {{"pass", ""}, {"moe", "tokens/s", 0}, {"peer", "tokens/s", 0}, {"peer time / moe time", "x"},
                {"lowest pair", "x"}, {"highest pair", "x"}});
  for (int k = 0; k < 2; ++k) {
    const PairedRounds pairs = paired(*best, k);
    report.row({std::string(k == 0 ? "forward" : "forward+backward"), kN / (median(best->moe_ms[k]) * 1e-3),
                kN / (median(best->peer_ms[k]) * 1e-3), pairs.median, pairs.lowest, pairs.highest});
  }
  return report.finish(0);
}

}  // namespace moe::bench
