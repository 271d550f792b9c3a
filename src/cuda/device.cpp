// Device discovery, device memory and the per-device context (device.h).
#include "cuda/device.h"

#include <cublasLt.h>
#include <cublas_v2.h>

#include <cstdio>
#include <utility>

#include "util/str_cat.h"

namespace moe::cuda {

namespace {

// cuBLAS's own workspace: 32 MiB is what NVIDIA recommends for Hopper (cuBLAS docs,
// cublasSetWorkspace); smaller makes some GEMM kernels unavailable.
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

Status cublas_status(cublasStatus_t st, const char* what) {
  if (st == CUBLAS_STATUS_SUCCESS) return Status::ok();
  return Status::error(str_cat(what, ": ", cublasGetStatusName(st), " (", cublasGetStatusString(st), ")"));
}

// A cuBLAS handle on `stream` with `workspace`, computing as ops.h promises.
Status configure_cublas(cublasHandle_t h, cudaStream_t stream, const DeviceBuffer& workspace) {
  if (Status s = cublas_status(cublasSetStream(h, stream), "cublasSetStream"); !s) return s;
  // By default a GEMM with bf16 output may add its split-K partial sums in bf16; ops.h promises one
  // rounding of an f32 sum (the weight gradients, whose K is every token, are the likely split-K case).
  if (Status s = cublas_status(
          cublasSetMathMode(h, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                                         CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)),
          "cublasSetMathMode");
      !s)
    return s;
  return cublas_status(cublasSetWorkspace(h, workspace.get(), workspace.bytes()), "cublasSetWorkspace");
}

std::string gib(size_t bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f GiB", static_cast<double>(bytes) / (1u << 30));
  return b;
}

}  // namespace

size_t dtype_size(DType t) { return t == DType::f32 ? 4 : 2; }
const char* dtype_name(DType t) { return t == DType::f32 ? "f32" : "bf16"; }

Status cuda_status(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return Status::ok();
  return Status::error(str_cat(what, ": ", cudaGetErrorString(err)));
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no driver" error so later calls are not confused
    return 0;
  }
  return n;
}

std::string device_summary(int device) {
  int n = 0;
  if (cudaError_t e = cudaGetDeviceCount(&n); e != cudaSuccess) {
    (void)cudaGetLastError();
    return str_cat("no CUDA device: ", cudaGetErrorString(e));
  }
  if (device < 0 || device >= n) return str_cat("no CUDA device ", device, " (", n, " present)");
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, device) != cudaSuccess) return "CUDA device properties unavailable";
  int driver = 0;
  cudaDriverGetVersion(&driver);
  return str_cat(p.name, ", sm_", p.major, p.minor, ", ", gib(p.totalGlobalMem), ", ", p.multiProcessorCount,
                 " SMs, driver ", driver / 1000, ".", (driver % 1000) / 10);
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_) cudaFree(ptr_);
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_) cudaFree(ptr_);
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

Status DeviceBuffer::allocate(size_t bytes) {
  if (ptr_) cudaFree(ptr_);
  ptr_ = nullptr;
  bytes_ = 0;
  if (bytes == 0) return Status::ok();
  MOE_CUDA_TRY(cudaMalloc(&ptr_, bytes), str_cat("cudaMalloc(", gib(bytes), ")"));
  bytes_ = bytes;
  return Status::ok();
}

Status Context::create(int device, std::unique_ptr<Context>* out) {
  const int n = device_count();
  if (device < 0 || device >= n)
    return Status::error(str_cat("cuda: cannot use device ", device, ": ", device_summary(device)));
  std::unique_ptr<Context> ctx(new Context());
  ctx->device_ = device;
  MOE_CUDA_TRY(cudaSetDevice(device), str_cat("cudaSetDevice(", device, ")"));
  MOE_CUDA_TRY(cudaStreamCreateWithFlags(&ctx->stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  if (Status s = cublas_status(cublasCreate(&ctx->cublas_), "cublasCreate"); !s) return s;
  if (Status s = cublas_status(cublasLtCreate(&ctx->cublas_lt_), "cublasLtCreate"); !s) return s;
  if (Status s = ctx->workspace_.allocate(kCublasWorkspaceBytes); !s) return s;
  if (Status s = configure_cublas(ctx->cublas_, ctx->stream_, ctx->workspace_); !s) return s;
  *out = std::move(ctx);
  return Status::ok();
}

Status Context::lanes(int n, Lane** out) {
  if (n > lane_count_) {
    MOE_CUDA_TRY(cudaStreamSynchronize(stream_), "cuda stream");  // the old lanes may still run
    std::unique_ptr<Lane[]> grown(new Lane[n]);
    for (int i = 0; i < lane_count_; ++i) std::swap(grown[i], lanes_[i]);
    for (int i = lane_count_; i < n; ++i) {
      Lane& l = grown[i];
      MOE_CUDA_TRY(cudaStreamCreateWithFlags(&l.stream, cudaStreamNonBlocking), "cudaStreamCreate (lane)");
      MOE_CUDA_TRY(cudaEventCreateWithFlags(&l.done, cudaEventDisableTiming), "cudaEventCreate (lane)");
      if (Status s = cublas_status(cublasCreate(&l.cublas), "cublasCreate (lane)"); !s) return s;
      if (Status s = l.workspace.allocate(kCublasWorkspaceBytes); !s) return s;
      if (Status s = configure_cublas(l.cublas, l.stream, l.workspace); !s) return s;
    }
    lanes_ = std::move(grown);
    lane_count_ = n;
  }
  *out = lanes_.get();
  return Status::ok();
}

Status Context::fork_event(cudaEvent_t* out) {
  if (!fork_) MOE_CUDA_TRY(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming), "cudaEventCreate (fork)");
  MOE_CUDA_TRY(cudaEventRecord(fork_, stream_), "cudaEventRecord (fork)");
  *out = fork_;
  return Status::ok();
}

Context::~Context() {
  if (stream_) cudaStreamSynchronize(stream_);
  for (int i = 0; i < lane_count_; ++i) {
    Lane& l = lanes_[i];
    cudaStreamSynchronize(l.stream);
    cublasDestroy(l.cublas);
    cudaEventDestroy(l.done);
    cudaStreamDestroy(l.stream);
  }
  if (fork_) cudaEventDestroy(fork_);
  if (cublas_lt_) cublasLtDestroy(cublas_lt_);
  if (cublas_) cublasDestroy(cublas_);
  if (stream_) cudaStreamDestroy(stream_);
}

Status Context::synchronize() {
  MOE_CUDA_TRY(cudaStreamSynchronize(stream_), "cuda stream (an earlier kernel or copy failed)");
  return Status::ok();
}

// Grows `buf` to at least `bytes`. The old buffer may still be read by work queued on the stream
// (GEMMs, reductions): let it finish before freeing it.
Status Context::grow_scratch(DeviceBuffer& buf, size_t bytes, void** out) {
  if (buf.bytes() < bytes) {
    MOE_CUDA_TRY(cudaStreamSynchronize(stream_), "cuda stream");
    if (Status s = buf.allocate(bytes); !s) return s;
  }
  *out = buf.get();
  return Status::ok();
}

Status Context::pointer_scratch(size_t bytes, void** out) { return grow_scratch(pointers_, bytes, out); }
Status Context::chunk_scratch(size_t bytes, void** out) { return grow_scratch(chunks_, bytes, out); }
Status Context::reduction_scratch(size_t bytes, void** out) { return grow_scratch(partials_, bytes, out); }

Status copy_to_device(Context& ctx, void* dst, const void* src, size_t bytes) {
  MOE_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, ctx.stream()), "copy to device");
  return ctx.synchronize();
}

Status copy_to_host(Context& ctx, void* dst, const void* src, size_t bytes) {
  MOE_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, ctx.stream()), "copy to host");
  return ctx.synchronize();
}

}  // namespace moe::cuda
