// The safetensors file format (https://huggingface.co/docs/safetensors), f32 only, so PyTorch users
// load our weights with the standard loaders:
//   [u64 little-endian header length H][H bytes of JSON header, space-padded to 8][raw data]
//   header: {"<name>": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...,
//            "__metadata__": {"<key>": "<string>", ...}}   (offsets relative to the data start)
// The writer lays the tensors out back to back in the order given; the reader accepts what the
// reference implementation accepts (tensor byte ranges tiling the data exactly), F32 only.
// tests/load_safetensors.py reads our files with nothing but struct, json and torch.
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

// Sets *bytes to the file's bytes for `tensors` (data in the given order) and `metadata`.
// Errors (nothing else is checked, *bytes is then unspecified): a duplicate, empty or
// "__metadata__" name, a negative dimension, null data for a non-empty tensor, a name or metadata
// string that is not valid UTF-8 (JSON cannot carry it).
Status encode_safetensors(const std::vector<TensorRef>& tensors, const std::map<std::string, std::string>& metadata,
                          std::string* bytes);

// Parses a whole file's bytes into *tensors (keyed by name) and, when metadata is not null, the
// "__metadata__" strings into *metadata. Every structural problem is an error Status that starts
// with `what` (the file) and names the problem and the tensor: a file shorter than 8 bytes, a
// header length beyond the file, a header that is not a JSON object, a malformed entry, a dtype
// other than F32, a negative or non-integer dimension, data_offsets outside the data, a byte range
// that disagrees with the shape, ranges that overlap or leave bytes of the data unused, non-string
// metadata. On error *tensors and *metadata are unchanged.
Status decode_safetensors(const std::string& bytes, const std::string& what, std::map<std::string, LoadedTensor>* tensors,
                          std::map<std::string, std::string>* metadata);

// encode_safetensors + write_file_atomic: after a crash `path` is the old file or the new one.
Status save_safetensors(const std::string& path, const std::vector<TensorRef>& tensors,
                        const std::map<std::string, std::string>& metadata);
// read_file + decode_safetensors; errors name `path`. metadata may be null.
Status load_safetensors(const std::string& path, std::map<std::string, LoadedTensor>* tensors,
                        std::map<std::string, std::string>* metadata);

// Writes `bytes` to `path` atomically: path.tmp, fsync, rename over path, fsync the folder.
// After a crash the file is the old one or the new one, never a part; on error path.tmp is removed.
Status write_file_atomic(const std::string& path, const std::string& bytes);
// Reads a whole file; an error Status names the path when it is missing, not a regular file, or
// unreadable.
Status read_file(const std::string& path, std::string* bytes);

}  // namespace moe
