// Activation memory, planned once: modules reserve their slices when the model is built, the arena
// allocates one block, and every step reuses it (steady-state steps do not allocate).
#pragma once

#include <cstdint>

#include "lockstep/core/error.h"
#include "lockstep/core/tensor.h"

namespace lockstep {

struct ArenaSlice {
  int64_t offset = -1;
  int64_t size = 0;
};

class Arena {
 public:
  ArenaSlice reserve(int64_t floats) {
    LOCKSTEP_CHECK(buffer_.size() == 0, "arena reserve after allocation");
    const ArenaSlice s{total_, floats};
    total_ += (floats + 15) / 16 * 16;  // 64-byte aligned slices
    return s;
  }
  void allocate() { buffer_.resize(total_); }
  float* operator()(ArenaSlice s) const {
    LOCKSTEP_CHECK(s.offset >= 0 && buffer_.size() == total_, "arena slice used before allocation");
    return buffer_.data() + s.offset;
  }
  int64_t total_floats() const { return total_; }

 private:
  int64_t total_ = 0;
  FloatBuffer buffer_;
};

}  // namespace lockstep
