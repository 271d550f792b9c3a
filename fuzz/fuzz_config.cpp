// Fuzz target: the JSON config files. The input is the file `moe train --config FILE` reads
// (TrainConfig::merge_file: every training key and a "model" object), and the same bytes as a bare
// model config object (ModelConfig::from_json, as `moe sim --model FILE` and checkpoints carry it).
// Whatever is accepted must validate without a crash and survive to_json -> from_json unchanged.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <nlohmann/json.hpp>

#include "fuzz/fuzz_util.h"
#include "model/config.h"
#include "runtime/train_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using moe::fuzz::require;
  const std::string_view input(reinterpret_cast<const char*>(data), size);

  const auto path = moe::fuzz::scratch_dir() / "config.json";
  moe::fuzz::write_file(path, input);
  moe::TrainConfig cfg;
  if (moe::TrainConfig::merge_file(path.string(), &cfg)) {
    (void)cfg.validate();  // its own checks, after flags in `moe train`: an answer, never a crash
    moe::TrainConfig again;
    require(static_cast<bool>(moe::TrainConfig::merge_json(cfg.to_json(), &again)),
            "an accepted TrainConfig's to_json() merges back");
    require(again.to_json() == cfg.to_json(), "TrainConfig round-trips through JSON");
  }

  const nlohmann::json j = nlohmann::json::parse(input, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  moe::ModelConfig model;
  if (moe::ModelConfig::from_json(j, &model)) {
    require(static_cast<bool>(model.validate()), "an accepted ModelConfig validates");
    (void)model.moe_config(model.n_layers - 1);
    moe::ModelConfig again;
    require(static_cast<bool>(moe::ModelConfig::from_json(model.to_json(), &again)) && again == model,
            "ModelConfig round-trips through JSON");
  }
  return 0;
}
