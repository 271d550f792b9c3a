#include "tensor/tensor.h"

#include <cstdlib>
#include <new>
#include <sstream>
#include <stdexcept>

namespace moe {

void Tensor::Free::operator()(float* p) const { std::free(p); }

void Tensor::resize(std::vector<int64_t> shape) {
  size_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) throw std::invalid_argument("Tensor: negative dimension");
    n *= static_cast<size_t>(d);
  }
  shape_ = std::move(shape);
  numel_ = n;
  if (n > capacity_) {
    size_t bytes = ((n * sizeof(float) + 63) / 64) * 64;
    float* p = static_cast<float*>(std::aligned_alloc(64, bytes));
    if (!p) throw std::bad_alloc();
    data_.reset(p);
    capacity_ = n;
  }
  zero();
}

std::string Tensor::shape_str() const {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < shape_.size(); ++i) s << (i ? "," : "") << shape_[i];
  s << "]";
  return s.str();
}

}  // namespace moe
