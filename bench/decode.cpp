// `moe bench decode`: the inference engine's decode step on one process, against this machine's memory
// read bandwidth and GEMM rate measured in the same run. A decode step reads every dense weight and the
// weights of each expert some row chose, for a handful of rows: it is bound by memory, not by the GEMM
// rate, so its share of the bandwidth is the figure that says how close it runs to the machine.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cmath>
#include <string>
#include <vector>

#include "bench/bench.h"
#include "bench/report.h"
#include "model/model.h"
#include "moe/experts.h"
#include "serve/engine.h"
#include "tensor/ops.h"

namespace moe::bench {

namespace {

using Clock = std::chrono::steady_clock;

// Read bandwidth: the sum of a 1 GiB array (far beyond any cache) on `threads` threads, best of 3.
// Integer sums: a float sum may not be reordered, so it would run one add at a time and measure the
// adder (9.5 GB/s seen), not the memory.
double read_bandwidth_gbs() {
  const int64_t n = int64_t{1} << 28;  // 32-bit words
  std::vector<uint32_t> a(n);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) a[i] = static_cast<uint32_t>(i & 7);
  double best = 0;
  for (int r = 0; r < 3; ++r) {
    const Clock::time_point t0 = Clock::now();
    uint32_t sum = 0;
#pragma omp parallel for schedule(static) reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) sum += a[i];
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (sum == 1) return 0;  // keeps the loop
    best = std::max(best, n * 4.0 / s / 1e9);
  }
  return best;
}

struct ModelCase {
  std::string name;
  ModelConfig cfg;
};

// Bytes of the weights every decode step reads whatever the routing: embeddings (the tied head reads
// wte whole), attention, norms, routers, dense FFN blocks.
double dense_weight_bytes(const Model& m) {
  double floats = 0;
  for (const Param* p : m.params())
    if (p->name.find(".moe.w") == std::string::npos) floats += static_cast<double>(p->value.numel());
  return floats * 4;
}

}  // namespace

int decode(const BenchOptions& opt) {
  omp_set_num_threads(opt.threads);
  set_gemm_threads(opt.threads);
  std::vector<ModelCase> cases;
  cases.push_back({"default", ModelConfig{}});
  ModelConfig large;
  large.seq_len = 256, large.d_model = 512, large.n_heads = 8, large.d_ffn = 2048, large.n_layers = 4;
  cases.push_back({"large", large});
  const GemmRates rates = measure_gemm_backends(expert_gemm_shapes(1024, large.d_model, large.d_ffn), 7);
  pin_gemm_backend(pick_gemm_backend(rates), describe_gemm_rates(rates));
  Report report("decode",
                "decode steps of the inference engine on one process (random weights; prompt 32 tokens per "
                "sequence, then 32 decode steps timed; median of " + std::to_string(opt.repeats) + ")",
                opt, /*uses_gemm=*/true);
  const double bandwidth = read_bandwidth_gbs();
  const double gemm_rate = measure_gemm_rate(expert_gemm_shapes(1024, large.d_model, large.d_ffn), 5);
  report.table("references, measured now", {{"reference", "", 0, 40}, {"rate", "", 1}, {"note", ""}});
  report.row({"memory read bandwidth", bandwidth, "GB/s: sum of a 1 GiB array, best of 3"});
  report.row({"GEMM rate", gemm_rate, "GFLOP/s: expert shapes (1024 rows, d 512, F 2048), " + gemm_backend_name()});

  report.table("decode",
               {{"model, sequences", "", 0, 22}, {"params", "M", 1}, {"step", "ms", 3}, {"tokens/s", "1/s", 0},
                {"read/step", "MB", 1}, {"read", "GB/s", 1}, {"of bw", "%", 0}, {"compute", "GFLOP/s", 2},
                {"of GEMM", "%", 1}});
  constexpr int32_t kPrompt = 32, kSteps = 32;
  for (const ModelCase& mc : cases) {
    const ModelConfig& c = mc.cfg;
    const int64_t C = c.d_model, F = c.d_ffn, V = c.vocab_size, K = c.top_k;
    for (int64_t B : {1, 4, 16}) {
      Model model(c, (B * kPrompt + c.seq_len - 1) / c.seq_len);
      model.init(1);
      serve::InferenceEngine engine(model, B, B * kPrompt);
      const double dense_bytes = dense_weight_bytes(model);
      const double expert_bytes = (c.activation_kind() == Activation::swiglu ? 3.0 : 2.0) * F * C * 4;
      std::vector<float> logits(B * kPrompt * V);
      std::vector<double> ms;
      double bytes = 0, flops = 0;
      for (int r = 0; r < opt.repeats; ++r) {
        std::vector<serve::Row> rows;
        for (int32_t s = 0; s < B; ++s)
          for (int32_t p = 0; p < kPrompt; ++p) rows.push_back({s, p, (s * 31 + p * 7) % 256, p + 1 == kPrompt});
        // Greedy: each sequence's next token is its logits' argmax.
        std::vector<int32_t> next(B);
        auto take_argmax = [&] {
          for (int64_t s = 0; s < B; ++s)
            next[s] = static_cast<int32_t>(std::max_element(logits.begin() + s * V, logits.begin() + (s + 1) * V) -
                                           (logits.begin() + s * V));
        };
        engine.forward(rows, logits.data());
        engine.take_expert_loads();
        take_argmax();
        double step_bytes = 0, step_flops = 0, total_ms = 0;
        for (int32_t step = 0; step < kSteps; ++step) {
          rows.clear();
          for (int32_t s = 0; s < B; ++s) rows.push_back({s, kPrompt + step, next[s], true});
          const Clock::time_point t0 = Clock::now();
          engine.forward(rows, logits.data());
          total_ms += std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
          take_argmax();
          // What this step read: dense weights, every expert some row chose, each row's cached K and V.
          int64_t experts = 0;
          for (const auto& layer : engine.take_expert_loads())
            for (int64_t n : layer) experts += n > 0;
          const double kv = 2.0 * (kPrompt + step + 1) * C * 4 * c.n_layers * B;
          step_bytes += dense_bytes + experts * expert_bytes + kv;
          step_flops += 2.0 * B * (dense_bytes / 4 - static_cast<double>(V) * C) + 2.0 * B * C * V +
                        2.0 * B * K * expert_bytes / 4 * (c.n_layers - (c.dense_every_other ? c.n_layers / 2 : 0)) +
                        2.0 * kv / 4;
        }
        ms.push_back(total_ms / kSteps);
        bytes = step_bytes / kSteps, flops = step_flops / kSteps;
      }
      const double step_ms = median(ms);
      const double gbs = bytes / (step_ms * 1e6), gflops = flops / (step_ms * 1e6);
      report.row({mc.name + ", " + std::to_string(B), model.num_params() / 1e6, step_ms, B / (step_ms / 1e3),
                  bytes / 1e6, gbs, 100 * gbs / bandwidth, gflops, 100 * gflops / gemm_rate});
    }
  }
  report.note("read/step: dense weights (embeddings, attention, norms, routers, dense FFNs), the experts some row "
              "chose (counted per step), each row's cached keys and values; compute: 2 FLOPs per weight per row, plus "
              "attention over the cache");
  report.note("default: the model moe train trains (" + std::to_string(ModelConfig{}.d_model) +
              " wide, about 10 MB of weights: it stays in this CPU's caches, so its share of the DRAM bandwidth can pass "
              "100%); large: d_model 512, d_ffn 2048, 8 experts, 4 layers (286 MB of weights, beyond this CPU's caches: a step "
              "reads the dense weights and the experts its rows chose)");
  return report.finish(0);
}

}  // namespace moe::bench
