#include "lockstep/core/tensor.h"

#include <cstdlib>
#include <cstring>
#include <new>

namespace lockstep {

namespace {
void* aligned_zeroed(size_t bytes) {
  const size_t rounded = (bytes + 63) / 64 * 64;
  if (rounded == 0) return nullptr;
  void* p = std::aligned_alloc(64, rounded);
  if (!p) throw std::bad_alloc();
  std::memset(p, 0, rounded);
  return p;
}
}  // namespace

std::string Shape::to_string() const {
  std::string s = "(";
  for (size_t i = 0; i < dims_.size(); ++i) s += (i ? ", " : "") + std::to_string(dims_[i]);
  return s + ")";
}

Tensor::Tensor(Shape shape, DType dtype)
    : data_(aligned_zeroed(static_cast<size_t>(shape.numel()) * dtype_size(dtype))),
      shape_(std::move(shape)),
      dtype_(dtype) {}

void Tensor::Free::operator()(void* p) const { std::free(p); }

void FloatBuffer::resize(int64_t n) {
  data_.reset(static_cast<float*>(aligned_zeroed(static_cast<size_t>(n) * sizeof(float))));
  size_ = n;
}

void FloatBuffer::Free::operator()(float* p) const { std::free(p); }

}  // namespace lockstep
