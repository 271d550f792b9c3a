// Start here for src/tensor: the f32 tensor every layer passes around, and the parameter type.
//
// Dimension letters used in shape comments across moe:
//   B batch, T sequence position, N tokens (= B*T, or a subset routed to an expert), C d_model,
//   F d_ffn, E experts, K router top-k, V vocabulary (256 bytes), NH heads, HS head size (C/NH),
//   R rows in expert-contiguous (permuted) order (= N*K minus dropped assignments).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

namespace moe {

// A dense row-major f32 tensor that owns 64-byte aligned storage.
// Thread safety: none; a Tensor is owned by one layer and reused across steps (no hot-path allocation).
class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::vector<int64_t> shape) { resize(std::move(shape)); }
  Tensor(std::initializer_list<int64_t> shape) { resize(std::vector<int64_t>(shape)); }

  // Reallocates only when the element count grows; contents become zero.
  void resize(std::vector<int64_t> shape);
  void zero() { if (numel_) std::memset(data_.get(), 0, numel_ * sizeof(float)); }

  float* data() { return data_.get(); }
  const float* data() const { return data_.get(); }
  float& operator[](size_t i) { return data_.get()[i]; }
  float operator[](size_t i) const { return data_.get()[i]; }
  size_t numel() const { return numel_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_.at(i < 0 ? shape_.size() + i : i); }
  std::string shape_str() const;

 private:
  struct Free { void operator()(float* p) const; };
  std::vector<int64_t> shape_;
  size_t numel_ = 0;
  size_t capacity_ = 0;
  std::unique_ptr<float, Free> data_;
};

// A trainable parameter: its value and the gradient accumulated into it by backward passes.
// `name` is its key in checkpoints (safetensors) and in the PyTorch reference.
// `decay` says whether AdamW applies weight decay to it (matrices yes; norms no).
struct Param {
  std::string name;
  Tensor value;
  Tensor grad;
  bool decay = true;
  // Sharded parameters (expert parallelism): this process holds some rows of a tensor whose full
  // first dimension is full_dim0 and whose name is `name`: rows shard_rows (ascending) when that is
  // not empty (experts re-sharded to arbitrary owners), else rows [shard_begin, shard_begin +
  // value.dim(0)). full_dim0 == 0: not sharded, the whole tensor (replicated on every rank).
  int64_t shard_begin = 0, full_dim0 = 0;
  std::vector<int64_t> shard_rows;
  bool sharded() const { return full_dim0 > 0; }
  // The full tensor's row held as row i of value. REQUIRES: sharded(), 0 <= i < value.dim(0).
  int64_t shard_row(int64_t i) const { return shard_rows.empty() ? shard_begin + i : shard_rows[i]; }
  Param(std::string n, std::vector<int64_t> shape, bool wd = true)
      : name(std::move(n)), value(shape), grad(shape), decay(wd) {}
};

}  // namespace moe
