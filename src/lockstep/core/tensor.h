// Tensors: a shape, a dtype and memory.
//
// TensorView does not own its memory (a view into a flat parameter buffer, an activation arena or a
// caller's array); Tensor owns 64-byte aligned storage. Both are row-major and contiguous: lockstep's
// kernels take raw pointers and sizes (llm.c style), and these types carry shapes between modules,
// the parameter table, checkpoints and fingerprints.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/core/dtype.h"
#include "lockstep/core/error.h"
#include "lockstep/core/memory.h"

namespace lockstep {

class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims) : dims_(dims) {}
  explicit Shape(std::vector<int64_t> dims) : dims_(std::move(dims)) {}

  int rank() const { return static_cast<int>(dims_.size()); }
  int64_t operator[](int i) const { return dims_.at(i); }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : dims_) n *= d;
    return n;
  }
  const std::vector<int64_t>& dims() const { return dims_; }
  bool operator==(const Shape&) const = default;
  std::string to_string() const;  // "(4, 256)"

 private:
  std::vector<int64_t> dims_;
};

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Shape shape;

  int64_t numel() const { return shape.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  float* f32() const {
    LOCKSTEP_CHECK(dtype == DType::f32, "tensor is ", dtype_name(dtype), ", not f32");
    return static_cast<float*>(data);
  }
  bf16* bf16_data() const {
    LOCKSTEP_CHECK(dtype == DType::bf16, "tensor is ", dtype_name(dtype), ", not bf16");
    return static_cast<bf16*>(data);
  }
};

// Owning, 64-byte aligned, zero-initialised.
class Tensor {
 public:
  Tensor() = default;
  Tensor(Shape shape, DType dtype = DType::f32);

  TensorView view() const { return TensorView{data_.get(), dtype_, shape_}; }
  float* f32() const { return view().f32(); }
  const Shape& shape() const { return shape_; }
  DType dtype() const { return dtype_; }
  int64_t numel() const { return shape_.numel(); }
  size_t nbytes() const { return view().nbytes(); }

 private:
  struct Free {
    void operator()(void* p) const;
  };
  std::unique_ptr<void, Free> data_;
  Shape shape_;
  DType dtype_ = DType::f32;
};

// 64-byte aligned array of floats, zero-initialised; the building block of flat buffers and arenas.
// Its memory comes from an allocator (a device's, which counts it) or, with none, from the host.
class FloatBuffer {
 public:
  FloatBuffer() = default;
  explicit FloatBuffer(int64_t n, Allocator* allocator = nullptr) : allocator_(allocator) { resize(n); }
  // The allocator of every later resize (null: plain host memory).
  void set_allocator(Allocator* allocator) { allocator_ = allocator; }
  void resize(int64_t n);  // reallocated and zeroed, whatever the size before
  // At least n floats: reallocated (zeroed) only when smaller, else left as it is (a scratch reused
  // call by call).
  void grow(int64_t n) {
    if (size_ < n) resize(n);
  }
  float* data() const { return data_.get(); }
  int64_t size() const { return size_; }
  float& operator[](int64_t i) const { return data_.get()[i]; }

 private:
  struct Free {
    Allocator* allocator;
    size_t bytes;
    void operator()(float* p) const;
  };
  std::unique_ptr<float, Free> data_{nullptr, Free{nullptr, 0}};
  int64_t size_ = 0;
  Allocator* allocator_ = nullptr;
};

}  // namespace lockstep
