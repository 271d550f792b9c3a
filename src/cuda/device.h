// Start here for src/cuda: the GPU the CUDA backend runs on, device memory, and the per-device
// context (stream, cuBLAS handles, workspace) that every kernel in cuda/ops.h is launched with.
//
// Built only where nvcc exists (CMake sets MOE_HAVE_CUDA); nothing outside src/cuda, the CUDA tests
// and the CUDA benchmarks includes these headers. On a machine without a GPU or without a driver,
// device_count() is 0 and Context::create fails with a Status that says why: callers (the tests)
// skip with that message.
//
// Errors: CUDA and cuBLAS failures become a Status naming the call and the CUDA error string. A
// kernel launch error (bad configuration) is reported by the launcher; an asynchronous error (a
// fault inside a kernel) by the next Context::synchronize(), as CUDA reports them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "util/status.h"

typedef struct cublasContext* cublasHandle_t;
typedef struct cublasLtContext* cublasLtHandle_t;

namespace moe::cuda {

// Storage type of activations and weights. Arithmetic is always f32 (bf16 values are widened on
// load, rounded on store); statistics (norm mean/rstd), probabilities saved for backward, losses,
// master weights and optimizer moments are always f32.
enum class DType : uint8_t { f32, bf16 };
size_t dtype_size(DType t);       // 4 or 2
const char* dtype_name(DType t);  // "f32" or "bf16"

// GPUs this process can use: 0 where there is no GPU or no driver (never an error).
int device_count();
// "NVIDIA H100 80GB HBM3, sm_90, 79.1 GiB, driver 13.0", or why there is none.
std::string device_summary(int device = 0);

// A CUDA call's result as a Status: "cudaMalloc(1.00 GiB): out of memory".
Status cuda_status(cudaError_t err, const std::string& what);
#define MOE_CUDA_TRY(call, what)                                      \
  do {                                                               \
    if (::moe::Status moe_cuda_st = ::moe::cuda::cuda_status((call), (what)); !moe_cuda_st) \
      return moe_cuda_st;                                            \
  } while (0)

// Owns `bytes` of device memory (cudaMalloc; freed in the destructor). Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr, o.bytes_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Frees what it held and allocates `bytes` (contents undefined). Errors name the size.
  Status allocate(size_t bytes);
  void* get() const { return ptr_; }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// One device's execution context: its compute stream (non-blocking), a cuBLAS and a cuBLASLt
// handle bound to that stream, and the cuBLAS workspace. Every op in cuda/ops.h runs on
// ctx.stream(). Thread safety: one thread at a time (cuBLAS handles are not thread-safe).
class Context {
 public:
  // REQUIRES: 0 <= device < device_count() (else an error Status, e.g. on a machine without GPUs).
  static Status create(int device, std::unique_ptr<Context>* out);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  cublasHandle_t cublas() const { return cublas_; }
  cublasLtHandle_t cublas_lt() const { return cublas_lt_; }

  // f32 GEMMs: false (default) computes in full f32, so results compare with the CPU reference at
  // f32 tolerance; true lets cuBLAS use TF32 tensor cores (10-bit mantissa inputs, much faster).
  void set_tf32(bool on) { tf32_ = on; }
  bool tf32() const { return tf32_; }

  // How grouped_gemm (ops.h) runs the experts' products: 0, one cublasGemmGroupedBatchedEx call; n >= 1,
  // one cublasGemmEx per expert spread over n side streams ("lanes") that run concurrently, joined
  // back into stream() with events. Either way each product is one deterministic cuBLAS GEMM.
  void set_grouped_gemm_lanes(int n) { grouped_lanes_ = n < 0 ? 0 : n; }
  int grouped_gemm_lanes() const { return grouped_lanes_; }
  // grouped_gemm (not the weight gradients, whose rows are the sum) may instead cut every expert's
  // rows into chunks of this many rows and run them all as one cublasGemmBatchedEx call: the full
  // chunks in place, each expert's last partial chunk copied into a padded chunk and back. 0: no chunks.
  void set_grouped_gemm_chunk_rows(int rows) { chunk_rows_ = rows < 0 ? 0 : rows; }
  int grouped_gemm_chunk_rows() const { return chunk_rows_; }
  // With chunks and beta = 0, an expert with more rows than a chunk runs its last partial chunk as
  // the full chunk that ends at its last row instead (true, the default): it overlaps the previous
  // chunk, whose rows are then computed twice by the same kernel on the same inputs and written
  // with the same bits, and no padded copy is made. Experts with fewer rows than a chunk, and
  // beta != 0 (the overlap would add twice), still go through the padded chunk. false: always padded.
  void set_grouped_gemm_chunk_overlap(bool on) { chunk_overlap_ = on; }
  bool grouped_gemm_chunk_overlap() const { return chunk_overlap_; }

  // Side stream i (i < n) for concurrent GEMMs, with a cuBLAS handle and workspace of its own (a
  // handle's workspace must not be shared by kernels that may run at once). Created on first use.
  struct Lane {
    cudaStream_t stream = nullptr;
    cublasHandle_t cublas = nullptr;
    cudaEvent_t done = nullptr;
    DeviceBuffer workspace;
  };
  Status lanes(int n, Lane** out);
  // Records an event on stream() that lanes wait on before starting (the fork of a fork-join).
  Status fork_event(cudaEvent_t* out);

  // Blocks until the stream's work is done; returns the first asynchronous error.
  Status synchronize();

  // Device scratch for the grouped GEMM's pointer arrays: at least `bytes`, grown as needed.
  // Stream-ordered reuse: a later call on the same stream may overwrite what an earlier one staged.
  Status pointer_scratch(size_t bytes, void** out);
  // Device scratch for the grouped GEMM's padded chunks: the same contract, a buffer of its own.
  Status chunk_scratch(size_t bytes, void** out);
  // Device scratch for the partial sums of two-pass reductions (kernel_util.cuh's users): the same
  // contract, a buffer of its own.
  Status reduction_scratch(size_t bytes, void** out);

 private:
  Context() = default;
  Status grow_scratch(DeviceBuffer& buf, size_t bytes, void** out);
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  cublasLtHandle_t cublas_lt_ = nullptr;
  DeviceBuffer workspace_;
  DeviceBuffer pointers_;
  DeviceBuffer partials_;
  DeviceBuffer chunks_;
  bool tf32_ = false;
  int grouped_lanes_ = kDefaultGroupedLanes;
  int chunk_rows_ = kDefaultChunkRows;
  bool chunk_overlap_ = true;
  std::unique_ptr<Lane[]> lanes_;
  int lane_count_ = 0;
  cudaEvent_t fork_ = nullptr;

 public:
  static constexpr int kDefaultGroupedLanes = 4;
  static constexpr int kDefaultChunkRows = 128;
};

// Host <-> device copies on ctx's stream, synchronous to the host (they return when done).
Status copy_to_device(Context& ctx, void* dst, const void* src, size_t bytes);
Status copy_to_host(Context& ctx, void* dst, const void* src, size_t bytes);

}  // namespace moe::cuda
