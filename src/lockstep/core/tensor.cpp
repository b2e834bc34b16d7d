#include "lockstep/core/tensor.h"

namespace lockstep {

std::string Shape::to_string() const {
  std::string s = "(";
  for (size_t i = 0; i < dims_.size(); ++i) s += (i ? ", " : "") + std::to_string(dims_[i]);
  return s + ")";
}

Tensor::Tensor(Shape shape, DType dtype)
    : data_(host_allocate(static_cast<size_t>(shape.numel()) * dtype_size(dtype))),
      shape_(std::move(shape)),
      dtype_(dtype) {}

void Tensor::Free::operator()(void* p) const { host_release(p); }

void FloatBuffer::resize(int64_t n) {
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  data_.reset();
  void* p = allocator_ ? allocator_->allocate(bytes) : host_allocate(bytes);
  data_ = std::unique_ptr<float, Free>(static_cast<float*>(p), Free{allocator_, bytes});
  size_ = n;
}

void FloatBuffer::Free::operator()(float* p) const {
  if (allocator)
    allocator->release(p, bytes);
  else
    host_release(p);
}

}  // namespace lockstep
