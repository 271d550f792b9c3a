// Fuzz target: the recorded-load-trace loader (sim/load.h: Load::make of a `moe train --metrics`
// JSON-lines file, `moe sim --load FILE`), then what the simulator does with it: the loads of a
// few steps and an expert-parallel graph's sizes from each (fill_ep_costs).
// The input: byte 0 picks the ranks (1 + byte % 4), whether the model drops tokens (bit 7:
// capacity_factor 1.25) and whether the exchange is padded (bit 6, DeepSpeed-MoE's); the rest is
// the file. The model is the tiny one of the checkpoint seeds
// (2 MoE layers of 4 experts, top-2), which the seed traces were recorded with.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fuzz/fuzz_util.h"
#include "graph/ep_builder.h"
#include "sim/load.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using moe::fuzz::require;
  if (size < 1) return 0;
  moe::ModelConfig cfg;
  cfg.seq_len = 4;
  cfg.d_model = 2;
  cfg.n_layers = 2;
  cfg.n_heads = 1;
  cfg.d_ffn = 2;
  cfg.n_experts = 4;
  cfg.top_k = 2;
  if (data[0] & 0x80) cfg.capacity_factor = 1.25;
  const int ranks = 1 + data[0] % 4;
  const int64_t batch = 2;

  const auto path = moe::fuzz::scratch_dir() / "loads.jsonl";
  moe::fuzz::write_file(path, std::string_view(reinterpret_cast<const char*>(data) + 1, size - 1));
  moe::sim::LoadSpec spec;
  require(static_cast<bool>(moe::sim::LoadSpec::parse(path.string(), &spec)) &&
              spec.kind == moe::sim::LoadSpec::Kind::recorded,
          "a file path is a recorded load");
  moe::sim::Load load;
  if (!moe::sim::Load::make(spec, cfg, ranks, batch * cfg.seq_len, &load)) return 0;
  require(load.recorded_steps() > 0 && load.moe_layers() == 2, "a loaded trace has steps and the model's layers");

  moe::graph::EpStepOptions opt;
  opt.world = ranks;
  opt.ep_size = ranks == 3 ? 1 : ranks;  // divides the 4 experts
  opt.batch = batch;
  opt.padded_exchange = (data[0] & 0x40) != 0;
  const moe::graph::EpStep step = moe::graph::build_ep_step(cfg, opt);
  for (int64_t s = 0; s < 3; ++s) {
    const moe::sim::StepLoad loads = load.step(s);
    for (int r = 0; r < ranks; ++r) {
      moe::graph::StepGraph g = step.graph;
      moe::sim::fill_ep_costs(cfg, opt, loads, r, &g);
    }
  }
  return 0;
}
