// The safetensors file format (https://huggingface.co/docs/safetensors), f32 only, so PyTorch users
// load our weights with the standard loaders:
//   [u64 little-endian header length H][H bytes of JSON header, space-padded to 8][raw data]
//   header: {"<name>": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...,
//            "__metadata__": {"<key>": "<string>", ...}}   (offsets relative to the data start)
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "util/status.h"

namespace moe {

// A tensor to write. The data is borrowed: it must hold prod(shape) floats until the call returns.
struct TensorRef {
  std::string name;
  std::vector<int64_t> shape;
  const float* data = nullptr;
};

// A tensor read back.
struct LoadedTensor {
  std::vector<int64_t> shape;
  std::vector<float> data;  // prod(shape) floats, row-major
};

// The file's bytes for `tensors` (data in the given order) and `metadata`. Names must be unique
// and not "__metadata__" (else an error Status).
Status encode_safetensors(const std::vector<TensorRef>& tensors, const std::map<std::string, std::string>& metadata,
                          std::string* bytes);

// Parses a whole file's bytes. Every structural problem (short file, header length beyond the file,
// bad JSON, a dtype other than F32, a shape that disagrees with its byte range, offsets outside the
// data or overlapping) is an error Status that names `what` (the file) and the tensor.
Status decode_safetensors(const std::string& bytes, const std::string& what, std::map<std::string, LoadedTensor>* tensors,
                          std::map<std::string, std::string>* metadata);

// Writes `bytes` to `path` atomically: path.tmp, fsync, rename over path, fsync the folder.
// After a crash the file is the old one or the new one, never a part.
Status write_file_atomic(const std::string& path, const std::string& bytes);
// Reads a whole file; an error Status names the path when it is missing or unreadable.
Status read_file(const std::string& path, std::string* bytes);

}  // namespace moe
