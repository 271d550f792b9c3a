// Fuzz target: the JSON config files. The input is the file `moe train --config FILE` reads
// (TrainConfig::merge_file: every training key and a "model" object), and the same bytes as a bare
// model config object (ModelConfig::from_json, as `moe sim --model FILE` and checkpoints carry it).
// Whatever is accepted must hold the values the file gives, validate without a crash and survive
// to_json -> from_json unchanged.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <nlohmann/json.hpp>

#include "fuzz/fuzz_util.h"
#include "model/config.h"
#include "runtime/train_config.h"

namespace {

// JSON's == casts an unsigned to a signed integer first (so 2^64 - 1 equals -1): integers compare
// by value here.
bool same_value(const nlohmann::json& a, const nlohmann::json& b) {
  if (!a.is_number_integer() || !b.is_number_integer()) return a == b;
  auto value = [](const nlohmann::json& x) {
    return x.is_number_unsigned() ? static_cast<__int128>(x.get<uint64_t>()) : static_cast<__int128>(x.get<int64_t>());
  };
  return value(a) == value(b);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using moe::fuzz::require;
  const std::string_view input(reinterpret_cast<const char*>(data), size);

  const nlohmann::json j = nlohmann::json::parse(input, nullptr, /*allow_exceptions=*/false);
  const auto path = moe::fuzz::scratch_dir() / "config.json";
  moe::fuzz::write_file(path, input);
  moe::TrainConfig cfg;
  if (moe::TrainConfig::merge_file(path.string(), &cfg)) {
    (void)cfg.validate();  // its own checks, after flags in `moe train`: an answer, never a crash
    // Every key accepted holds what the file says (not, say, an integer wrapped to fit an int).
    const nlohmann::json read = cfg.to_json();
    for (const auto& [key, value] : j.items()) {
      if (key != "model") {
        require(same_value(read.at(key), value), "an accepted training key reads as written");
        continue;
      }
      for (const auto& [model_key, model_value] : value.items())
        require(same_value(read.at("model").at(model_key), model_value), "an accepted model key reads as written");
    }
    moe::TrainConfig again;
    require(static_cast<bool>(moe::TrainConfig::merge_json(read, &again)),
            "an accepted TrainConfig's to_json() merges back");
    require(again.to_json() == read, "TrainConfig round-trips through JSON");
  }

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
