// moe bench cuda: the GPU kernels' speed on this machine's first GPU, each against a reference measured
// in the same run, and the simulator's H100 preset prediction beside every measurement.
//
// Rows (bf16 storage, f32 accumulation; median of --repeats timings of `iters` back-to-back calls,
// timed with CUDA events on the context's stream):
//   dense GEMM        [M,K] x [K,N] for a square 8192 shape and for each expert shape's merged
//                     product: the reference rate
//   experts GEMM      the experts' first GEMM (rows x C -> F per expert) over expert-contiguous rows,
//                     balanced and Zipf(1.0)-skewed, each way cuda::grouped_gemm can run it (one
//                     cublasGemmGroupedBatchedEx call; per expert on n lanes; r-row chunks in one
//                     cublasGemmBatchedEx) and one cublasGemmEx per expert on one stream; "same-FLOPs
//                     dense GEMM time / time" = the dense GEMM of the same total rows (same FLOPs) over it
//   MoE layer         cuda::MoeLayer forward + backward (router, permute, grouped GEMMs, GELU,
//                     combine), the default way and with the grouped call; the same column = the time
//                     the dense rate gives its FLOPs over its time; tokens/s
//   PyTorch           the same layer in PyTorch eager on the same GPU, bf16 (bench/torch_moe_layer_peer.py:
//                     a loop over experts, and torch._grouped_mm), and moe's speed over it
//   sim               sim::op_time on the h100x8-hgx preset's device (presets.cpp: the H100 SXM
//                     datasheet) for the same FLOPs and bytes; error = predicted / measured - 1
// Goals (the project's; printed as a labelled note, not as columns): grouped >= 0.70 of the dense
// rate; MoE layer time <= 1.3x the dense time for its FLOPs; sim within 10%.
// Without a GPU it says so and exits 1.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench.h"
#include "bench/report.h"
#include "cuda/device.h"
#include "cuda/moe_layer.h"
#include "cuda/ops.h"
#include "sim/compute.h"
#include "sim/simulate.h"
#include "util/shell.h"
#include "util/str_cat.h"

namespace moe::bench {

namespace {

using cuda::Context;
using cuda::DeviceBuffer;
using cuda::DType;

// Fills `bytes` of device memory with small random bf16 values: one random block uploaded, then
// copied over the rest (the values only need to be finite and not denormal).
Status fill_random_bf16(Context& ctx, void* dst, size_t bytes, uint32_t seed) {
  const size_t block_elems = size_t{1} << 20;
  std::vector<float> host(block_elems);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-0.05f, 0.05f);
  for (float& x : host) x = u(rng);
  DeviceBuffer f32, block;
  if (Status s = f32.allocate(block_elems * 4); !s) return s;
  if (Status s = block.allocate(block_elems * 2); !s) return s;
  if (Status s = cuda::copy_to_device(ctx, f32.get(), host.data(), block_elems * 4); !s) return s;
  if (Status s = cuda::cast_f32_to(ctx, DType::bf16, block.get(), f32.as<float>(), block_elems); !s) return s;
  for (size_t off = 0; off < bytes; off += block_elems * 2)
    MOE_CUDA_TRY(cudaMemcpyAsync(static_cast<char*>(dst) + off, block.get(), std::min(block_elems * 2, bytes - off),
                                 cudaMemcpyDeviceToDevice, ctx.stream()),
                 "bench fill");
  return ctx.synchronize();
}

// Median over `repeats` of the mean time of `iters` calls of f, in seconds.
Status time_it(Context& ctx, int repeats, int iters, const std::function<Status()>& f, double* seconds) {
  cudaEvent_t start, stop;
  MOE_CUDA_TRY(cudaEventCreate(&start), "cudaEventCreate");
  MOE_CUDA_TRY(cudaEventCreate(&stop), "cudaEventCreate");
  if (Status s = f(); !s) return s;  // warm-up (cuBLAS heuristics, lazy module loading)
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r) {
    MOE_CUDA_TRY(cudaEventRecord(start, ctx.stream()), "cudaEventRecord");
    for (int i = 0; i < iters; ++i)
      if (Status s = f(); !s) return s;
    MOE_CUDA_TRY(cudaEventRecord(stop, ctx.stream()), "cudaEventRecord");
    MOE_CUDA_TRY(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    MOE_CUDA_TRY(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    t.push_back(ms * 1e-3 / iters);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  *seconds = median(t);
  return Status::ok();
}

// Expert-contiguous offsets of `rows` rows over E experts: equal, or Zipf(1.0) by expert rank.
std::vector<int64_t> expert_offsets(int64_t rows, int64_t E, bool skewed) {
  std::vector<double> share(E, 1.0);
  if (skewed)
    for (int64_t e = 0; e < E; ++e) share[e] = 1.0 / static_cast<double>(e + 1);
  double total = 0;
  for (double s : share) total += s;
  std::vector<int64_t> off(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) off[e + 1] = off[e] + static_cast<int64_t>(std::floor(rows * share[e] / total));
  off[E] = rows;  // the remainder goes to the last expert
  return off;
}

struct ExpertShape {
  const char* name;
  int64_t tokens, C, F, E, K;
};

double tflops(double flops, double s) { return flops / s / 1e12; }

// PyTorch's MoE layer (bench/torch_moe_layer_peer.py) on this GPU in bf16, forward + backward; false
// where it cannot run. python3 from PATH (the GPU machines' PyTorch), or MOE_PYTHON.
bool run_torch_peer(const ExpertShape& sh, const char* impl, int repeats, double* fwdbwd_ms, std::string* version) {
  const char* py = std::getenv("MOE_PYTHON");
  const ShellResult r = run_shell(str_cat(py ? py : "python3", " ", torch_peer_script(), " --device cuda --dtype bf16 --impl ", impl,
                                          " --d-model ", sh.C, " --d-ffn ", sh.F, " --experts ", sh.E, " --top-k ", sh.K,
                                          " --tokens ", sh.tokens, " --repeats ", repeats, " 2>/dev/null"));
  const nlohmann::json j = nlohmann::json::parse(r.output, nullptr, false);
  if (r.exit_code != 0 || j.is_discarded() || !j.contains("forward_backward_ms")) return false;
  *fwdbwd_ms = j["forward_backward_ms"].get<double>();
  *version = j.value("torch", "?");
  return true;
}

}  // namespace

int cuda_kernels(const BenchOptions& opt) {
  if (cuda::device_count() == 0) {
    std::fprintf(stderr, "bench cuda: %s\n", cuda::device_summary().c_str());
    return 1;
  }
  std::unique_ptr<Context> ctx;
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "bench cuda: %s\n", s.message().c_str());
    return 1;
  };
  if (Status s = Context::create(0, &ctx); !s) return fail(s);
  sim::SimRunConfig cfg;
  if (Status s = sim::preset_cluster("h100x8-hgx", 1, &cfg.cluster); !s) return fail(s);
  const sim::DeviceSpec& h100 = cfg.cluster.node.device;
  const int repeats = std::max(3, opt.repeats);
  char what[256];
  std::snprintf(what, sizeof what, "CUDA kernels on %s; bf16 storage, f32 accumulation; median of %d timings; sim: %s "
                "preset device (%.1f TFLOP/s peak, %.2f TB/s)", cuda::device_summary().c_str(), repeats,
                h100.name.c_str(), h100.peak_flops / 1e12, h100.mem_bandwidth / 1e12);
  Report report("cuda", what, opt);
  const std::vector<Column> op_columns = {{"op", "", 0, 44},   {"time", "ms", 3},
                                          {"rate", "TFLOP/s", 1}, {"same-FLOPs dense GEMM time / time", "x"},
                                          {"sim", "ms", 3},    {"sim / measured - 1", "%", 1}};
  report.table("dense GEMM", op_columns);
  const double nan = std::nan("");
  // vs_dense: the time a dense GEMM of the same FLOPs takes over this op's (NaN: not compared).
  auto row = [&](const std::string& name, double flops, double bytes, double s, double vs_dense) {
    const double sim_s = sim::op_time(h100, flops, bytes);
    report.row({name, s * 1e3, tflops(flops, s), vs_dense, sim_s * 1e3, 100 * (sim_s / s - 1)});
  };

  // Dense GEMM of [M,K] x [K,N] in bf16; returns its seconds per call.
  auto dense = [&](int64_t M, int64_t N, int64_t K, double* seconds) -> Status {
    DeviceBuffer a, b, c;
    if (Status s = a.allocate(M * K * 2); !s) return s;
    if (Status s = b.allocate(K * N * 2); !s) return s;
    if (Status s = c.allocate(M * N * 2); !s) return s;
    if (Status s = fill_random_bf16(*ctx, a.get(), a.bytes(), 1); !s) return s;
    if (Status s = fill_random_bf16(*ctx, b.get(), b.bytes(), 2); !s) return s;
    return time_it(*ctx, repeats, 10, [&] {
      return cuda::gemm(*ctx, DType::bf16, false, false, M, N, K, 1.0f, a.get(), K, b.get(), N, 0.0f, c.get(), N);
    }, seconds);
  };
  double square_s = 0;
  const int64_t S = 8192;
  if (Status s = dense(S, S, S, &square_s); !s) return fail(s);
  row("dense GEMM 8192^3", 2.0 * S * S * S, 3.0 * S * S * 2, square_s, nan);

  const ExpertShape shapes[] = {{"GPT-MoE C2048 F8192 E16 top-2", 8192, 2048, 8192, 16, 2},
                                {"fine-grained C2048 F1408 E64 top-6", 8192, 2048, 1408, 64, 6}};
  for (const ExpertShape& sh : shapes) {
    const int64_t R = sh.tokens * sh.K;
    double merged_s = 0;
    if (Status s = dense(R, sh.F, sh.C, &merged_s); !s) return fail(s);
    const double flops = 2.0 * R * sh.C * sh.F;
    const double bytes = 2.0 * (R * sh.C + sh.E * sh.C * sh.F + R * sh.F);
    report.table(str_cat(sh.name, ": ", sh.tokens, " tokens -> ", R, " rows"), op_columns);
    row("  dense GEMM, same FLOPs (rows x C -> F)", flops, 2.0 * (R * sh.C + sh.C * sh.F + R * sh.F), merged_s, 1.0);
    DeviceBuffer x, w, y;
    if (Status s = x.allocate(R * sh.C * 2); !s) return fail(s);
    if (Status s = w.allocate(sh.E * sh.F * sh.C * 2); !s) return fail(s);
    if (Status s = y.allocate(R * sh.F * 2); !s) return fail(s);
    if (Status s = fill_random_bf16(*ctx, x.get(), x.bytes(), 3); !s) return fail(s);
    if (Status s = fill_random_bf16(*ctx, w.get(), w.bytes(), 4); !s) return fail(s);
    // The experts' products each way grouped_gemm can run them (Context lanes and chunk rows): one
    // cublasGemmGroupedBatchedEx call; one cublasGemmEx per expert on n concurrent lanes; full chunks
    // of r rows, the last one padded or overlapping, as one cublasGemmBatchedEx; and, for reference, the
    // same per-expert GEMMs one after another on one stream ("looped").
    const int default_lanes = ctx->grouped_gemm_lanes(), default_chunk = ctx->grouped_gemm_chunk_rows();
    const bool default_overlap = ctx->grouped_gemm_chunk_overlap();
    const struct {
      int lanes, chunk_rows;  // lanes < 0: looped
      bool overlap;           // chunks: the last one overlapping (else padded)
    } ways[] = {{0, 0, false},  {2, 0, false},   {4, 0, false},   {8, 0, false}, {4, 64, true},
                {4, 128, true}, {4, 128, false}, {4, 256, true}, {-1, 0, false}};
    for (bool skewed : {false, true}) {
      const std::vector<int64_t> off = expert_offsets(R, sh.E, skewed);
      for (const auto& way : ways) {
        double t = 0;
        ctx->set_grouped_gemm_lanes(std::max(way.lanes, 0));
        ctx->set_grouped_gemm_chunk_rows(way.chunk_rows);
        ctx->set_grouped_gemm_chunk_overlap(way.overlap);
        Status st = time_it(*ctx, repeats, 10, [&] {
          return way.lanes < 0 ? cuda::grouped_gemm_looped(*ctx, DType::bf16, true, y.get(), x.get(), w.get(), off.data(),
                                                           sh.E, sh.C, sh.F, 1.0f, 0.0f)
                               : cuda::grouped_gemm(*ctx, DType::bf16, true, y.get(), x.get(), w.get(), off.data(),
                                                    sh.E, sh.C, sh.F, 1.0f, 0.0f);
        }, &t);
        if (!st) return fail(st);
        std::string how = way.lanes < 0    ? "looped, one stream"
                          : way.lanes == 0 ? "cuBLAS grouped call"
                                           : str_cat(way.lanes, " lanes");
        if (way.chunk_rows > 0)
          how = str_cat(way.chunk_rows, "-row chunks, ", way.overlap ? "last overlapping" : "last padded");
        if (way.lanes == default_lanes && way.chunk_rows == default_chunk && way.overlap == default_overlap)
          how += " (default)";
        row(str_cat("  experts GEMM, ", skewed ? "zipf 1.0, " : "balanced, ", how), flops, bytes, t, merged_s / t);
      }
    }
    ctx->set_grouped_gemm_lanes(default_lanes);
    ctx->set_grouped_gemm_chunk_rows(default_chunk);
    ctx->set_grouped_gemm_chunk_overlap(default_overlap);
    // The whole layer, forward + backward.
    std::unique_ptr<cuda::MoeLayer> layer;
    if (Status s = cuda::MoeLayer::create(*ctx, DType::bf16, {sh.C, sh.F, sh.E, sh.K, true}, sh.tokens, &layer); !s)
      return fail(s);
    {
      // The router's weight is f32 whatever the layer's dtype (moe_layer.h).
      std::vector<float> wg(static_cast<size_t>(sh.E * sh.C));
      std::mt19937 rng(5);
      std::uniform_real_distribution<float> u(-0.05f, 0.05f);
      for (float& x : wg) x = u(rng);
      if (Status s = cuda::copy_to_device(*ctx, layer->wg(), wg.data(), wg.size() * sizeof(float)); !s) return fail(s);
    }
    if (Status s = fill_random_bf16(*ctx, layer->w1(), sh.E * sh.F * sh.C * 2, 6); !s) return fail(s);
    if (Status s = fill_random_bf16(*ctx, layer->w2(), sh.E * sh.C * sh.F * 2, 7); !s) return fail(s);
    DeviceBuffer lx, ly, ldx;
    if (Status s = lx.allocate(sh.tokens * sh.C * 2); !s) return fail(s);
    if (Status s = ly.allocate(sh.tokens * sh.C * 2); !s) return fail(s);
    if (Status s = ldx.allocate(sh.tokens * sh.C * 2); !s) return fail(s);
    if (Status s = fill_random_bf16(*ctx, lx.get(), lx.bytes(), 8); !s) return fail(s);
    // backward adds into dx; cudaMalloc leaves whatever was there (NaNs would time other paths)
    if (Status s = cuda::fill_zero(*ctx, ldx.get(), static_cast<int64_t>(ldx.bytes())); !s) return fail(s);
    // Warm-up pass: it also routes the tokens, which the layer's FLOP count depends on.
    if (Status s = layer->forward(ly.get(), lx.get(), sh.tokens); !s) return fail(s);
    if (Status s = layer->backward(ldx.get(), ly.get()); !s) return fail(s);
    if (Status s = ctx->synchronize(); !s) return fail(s);
    const double layer_flops = layer->flops_forward_backward();
    const double dense_equiv_s = layer_flops / (flops / merged_s);
    const double layer_bytes = 3.0 * 2.0 * (sh.tokens * sh.C * 4 + 3.0 * R * sh.C + 3.0 * R * sh.F + 2.0 * sh.E * sh.C * sh.F);
    double layer_s = 0;
    for (const auto& way : {std::pair{default_lanes, default_chunk}, std::pair{0, 0}}) {
      ctx->set_grouped_gemm_lanes(way.first);
      ctx->set_grouped_gemm_chunk_rows(way.second);
      double t = 0;
      Status st = time_it(*ctx, repeats, 3, [&] {
        if (Status s = layer->forward(ly.get(), lx.get(), sh.tokens); !s) return s;
        return layer->backward(ldx.get(), ly.get());
      }, &t);
      if (!st) return fail(st);
      const bool is_default = way.first == default_lanes && way.second == default_chunk;
      if (is_default) layer_s = t;
      row(is_default ? "  MoE layer fwd+bwd (default)" : "  MoE layer fwd+bwd, cuBLAS grouped call", layer_flops,
          layer_bytes, t, dense_equiv_s / t);
    }
    ctx->set_grouped_gemm_lanes(default_lanes);
    ctx->set_grouped_gemm_chunk_rows(default_chunk);
    // PyTorch eager on the same GPU, same shapes, bf16: the per-expert loop most PyTorch MoE code is, and
    // the experts as torch._grouped_mm calls. Same FLOPs as ours (the router's are a rounding error).
    std::vector<std::pair<std::string, double>> peers;  // (label, seconds)
    for (const char* impl : {"loop", "grouped_mm"}) {
      double peer_ms = 0;
      std::string torch_version;
      if (!run_torch_peer(sh, impl, repeats, &peer_ms, &torch_version)) {
        report.note(str_cat(sh.name, ": PyTorch ", impl, " could not run (python3 with torch and a GPU; MOE_PYTHON names another)"));
        continue;
      }
      const std::string label = str_cat("  PyTorch ", torch_version, " eager, ", impl);
      row(label, layer_flops, layer_bytes, peer_ms * 1e-3, dense_equiv_s / (peer_ms * 1e-3));
      peers.emplace_back(label, peer_ms * 1e-3);
    }
    report.table(str_cat(sh.name, ": the MoE layer forward+backward against PyTorch"),
                 {{"implementation", "", 0, 44}, {"tokens/s", "1/s", 0}, {"its time / moe's time", "x"}});
    report.row({std::string("  moe (default)"), sh.tokens / layer_s, 1.0});
    for (const auto& [label, seconds] : peers) report.row({label, sh.tokens / seconds, seconds / layer_s});
  }
  report.note("same-FLOPs dense GEMM time / time: for the experts' GEMM rows the dense GEMM of the same FLOPs "
              "(rows x C -> F) measured above; for the MoE layer rows the time the dense GEMM's rate gives the layer's "
              "FLOPs. Goals (the project's, not measured): >= 0.70 for the GEMM rows, >= 0.77 (time <= 1.30x) for the "
              "layer. sim = sim::op_time of the preset device.");
  if (const int64_t n = cuda::grouped_gemm_fallbacks(); n > 0)
    report.note(str_cat("cuBLAS refused ", n, " grouped calls (NOT_SUPPORTED): the \"grouped\" rows timed the "
                        "per-expert loop"));
  return report.finish(0);
}

}  // namespace moe::bench
