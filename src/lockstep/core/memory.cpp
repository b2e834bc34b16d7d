#include "lockstep/core/memory.h"

#include <cstdlib>
#include <cstring>
#include <new>

namespace lockstep {

void* host_allocate(size_t bytes) {
  const size_t rounded = (bytes + 63) / 64 * 64;
  if (rounded == 0) return nullptr;
  void* p = std::aligned_alloc(64, rounded);
  if (!p) throw std::bad_alloc();
  std::memset(p, 0, rounded);
  return p;
}

void host_release(void* p) noexcept { std::free(p); }

}  // namespace lockstep
