// Fuzz target: the safetensors reader (decode_safetensors, what load_safetensors and the checkpoint
// loader run on a file's bytes). The input is a whole .safetensors file. A file that decodes must
// encode again (when its names are ones the writer accepts) and decode to the same tensors.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>

#include "fuzz/fuzz_util.h"
#include "model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using moe::fuzz::require;
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  std::map<std::string, moe::LoadedTensor> tensors;
  std::map<std::string, std::string> metadata;
  if (!moe::decode_safetensors(bytes, "fuzz.safetensors", &tensors, &metadata)) return 0;

  // The reader takes any name the reference implementation takes; the writer refuses an empty one.
  std::vector<moe::TensorRef> refs;
  for (const auto& [name, t] : tensors) {
    if (name.empty()) return 0;
    refs.push_back({name, t.shape, t.data.data()});
  }
  std::string encoded;
  require(static_cast<bool>(moe::encode_safetensors(refs, metadata, &encoded)), "decoded tensors encode again");
  std::map<std::string, moe::LoadedTensor> again;
  std::map<std::string, std::string> again_meta;
  require(static_cast<bool>(moe::decode_safetensors(encoded, "re-encoded", &again, &again_meta)),
          "re-encoded file decodes");
  require(again_meta == metadata && again.size() == tensors.size(), "same metadata and tensor names");
  for (const auto& [name, t] : tensors) {
    const moe::LoadedTensor& u = again.at(name);
    // Bit-wise: the data may hold NaNs.
    require(u.shape == t.shape && u.data.size() == t.data.size() &&
                (t.data.empty() || std::memcmp(u.data.data(), t.data.data(), t.data.size() * sizeof(float)) == 0),
            "same shapes and bytes");
  }
  return 0;
}
