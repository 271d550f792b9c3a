// Fuzz target: the checkpoint loader (model/checkpoint.h: load_checkpoint, read_checkpoint_weights;
// runtime/sharded_checkpoint.h: load_sharded_checkpoint; runtime/trainer.h: check_resume, what
// --resume checks in the loaded state). The input is a checkpoint folder as pieces
// cut at fuzz_util.h's kFileSeparator:
//   state.json, then model and optimizer .safetensors of part 0, of part 1, ... (as many parts as
//   state.json's "parts" says when that is an integer in [1, 8], else 1; pieces beyond are ignored,
//   missing ones are missing files).
// When state.json is an object without "files", the harness adds the true sizes and checksums of
// the files it wrote, so mutations reach the safetensors and "rows" checks instead of all failing
// the checksum; with "files" present the input's own values are checked.
// The model loaded into is fixed and tiny (tiny_model_config(); the seeds were written by `moe train`
// with it), loaded whole and, with its expert weights sharded, as one rank of an expert-parallel group.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "fuzz/fuzz_util.h"
#include "model/checkpoint.h"
#include "model/data.h"
#include "model/model.h"
#include "model/optimizer.h"
#include "runtime/sharded_checkpoint.h"
#include "runtime/train_config.h"
#include "runtime/trainer.h"

namespace {

using json = nlohmann::json;

// moe train --seq-len 4 --d-model 2 --layers 2 --heads 1 --d-ffn 2 --experts 4 --top-k 2: as small as
// the byte vocabulary allows (a 16 KB checkpoint), so the fuzzer runs fast; two MoE layers of four
// experts shard over two ranks.
moe::ModelConfig tiny_model_config() {
  moe::ModelConfig c;
  c.seq_len = 4;
  c.d_model = 2;
  c.n_layers = 2;
  c.n_heads = 1;
  c.d_ffn = 2;
  c.n_experts = 4;
  c.top_k = 2;
  return c;
}

struct Whole {
  moe::Model model{tiny_model_config(), 1};
  moe::AdamW opt{model.params(), moe::AdamWConfig{}};
};

// The same parameters as one rank of two holds them under expert parallelism: rows [2, 4) of every
// expert tensor (first dimension n_experts), the rest whole.
struct Sharded {
  std::vector<std::unique_ptr<moe::Param>> owned;
  std::vector<moe::Param*> params;
  std::unique_ptr<moe::AdamW> opt;
  explicit Sharded(const moe::Model& m) {
    const int64_t experts = m.config().n_experts;
    for (const moe::Param* p : m.params()) {
      std::vector<int64_t> shape = p->value.shape();
      const bool expert = p->name.find(".moe.w") != std::string::npos && shape.size() == 3 && shape[0] == experts;
      if (expert) shape[0] = experts / 2;
      owned.push_back(std::make_unique<moe::Param>(p->name, shape, p->decay));
      if (expert) {
        owned.back()->full_dim0 = experts;
        owned.back()->shard_begin = experts / 2;
      }
      params.push_back(owned.back().get());
    }
    opt = std::make_unique<moe::AdamW>(params, moe::AdamWConfig{});
  }
};

std::string hex64(uint64_t x) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(x));
  return buf;
}

std::string part_file(const char* kind, int p, int n) {
  if (n == 1) return std::string(kind) + ".safetensors";
  return std::string(kind) + "-" + std::to_string(p) + "-of-" + std::to_string(n) + ".safetensors";
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Whole whole;
  static Sharded sharded(whole.model);

  const std::vector<std::string_view> pieces =
      moe::fuzz::split_files(std::string_view(reinterpret_cast<const char*>(data), size));
  const std::filesystem::path dir = moe::fuzz::fresh_dir("checkpoint");

  json state = json::parse(pieces[0], nullptr, /*allow_exceptions=*/false);
  int n_parts = 1;
  if (state.is_object() && state.contains("parts") && state["parts"].is_number_integer() &&
      state["parts"].get<int64_t>() >= 1 && state["parts"].get<int64_t>() <= 8)
    n_parts = state["parts"].get<int>();
  const bool fill_files = state.is_object() && !state.contains("files");
  size_t next = 1;
  for (int p = 0; p < n_parts; ++p) {
    for (const char* kind : {"model", "optimizer"}) {
      if (next >= pieces.size()) break;
      const std::string_view bytes = pieces[next++];
      const std::string file = part_file(kind, p, n_parts);
      moe::fuzz::write_file(dir / file, bytes);
      if (fill_files)
        state["files"][file] = {{"bytes", bytes.size()}, {"fnv1a64", hex64(moe::fnv1a64(bytes.data(), bytes.size()))}};
    }
  }
  moe::fuzz::write_file(dir / "state.json", fill_files ? std::string_view(state.dump()) : pieces[0]);

  // One entry point per input (picked by its size, so any input reaches each), not all of them:
  // each reads and checks the whole folder again, and speed is coverage.
  json loaded_state;
  switch (size % 3) {
    case 0:
      if (moe::load_checkpoint(dir.string(), whole.model.params(), &whole.opt, &loaded_state)) {
        // What `moe train --resume` does next with the state (the seeds' corpus hash, so mutations
        // reach the identity check).
        moe::TrainConfig resume;
        resume.resume = dir.string();
        int64_t start = 0;
        (void)moe::check_resume(resume, loaded_state, 0xe50b513910a75b25ull, &start);
      }
      break;
    case 1:
      (void)moe::runtime::load_sharded_checkpoint(dir.string(), sharded.opt.get(), &loaded_state);
      break;
    default: {
      std::map<std::string, moe::LoadedTensor> weights;
      (void)moe::read_checkpoint_weights(dir.string(), &weights);
      (void)moe::load_checkpoint(dir.string(), whole.model.params(), nullptr, nullptr);
    }
  }
  return 0;
}
