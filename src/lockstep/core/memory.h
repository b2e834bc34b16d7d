// Where buffers get their memory. A device's allocator (kernels/device.h) counts the bytes it holds
// and their high-water mark; without one (tests, scratch), buffers take plain host memory.
#pragma once

#include <cstddef>

namespace lockstep {

class Allocator {
 public:
  virtual ~Allocator() = default;
  // `bytes` of 64-byte aligned, zeroed memory (null for 0 bytes); throws std::bad_alloc.
  virtual void* allocate(size_t bytes) = 0;
  // Returns what allocate(bytes) gave.
  virtual void release(void* p, size_t bytes) noexcept = 0;
};

// Plain 64-byte aligned, zeroed host memory (no accounting).
void* host_allocate(size_t bytes);
void host_release(void* p) noexcept;

}  // namespace lockstep
