// Activation memory, planned once: modules reserve their slices when the model is built, the arena
// allocates one block, and every step reuses it (steady-state steps do not allocate).
//
// Slots (pipeline parallelism): a pipeline schedule keeps several micro-batches in flight, each
// with its own saved activations. The plan is the same for every micro-batch, so a slot is one
// more block with the same layout; select(k) makes slot k the one every slice resolves to. Slots
// are allocated when first selected, so the memory a run holds is what its schedule keeps in
// flight. Scratch slices (reserve_scratch: backward's working buffers, used within one module call)
// live once, outside the slots.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "lockstep/core/error.h"
#include "lockstep/core/tensor.h"

namespace lockstep {

struct ArenaSlice {
  int64_t offset = -1;
  int64_t size = 0;
  bool scratch = false;
};

class Arena {
 public:
  ArenaSlice reserve(int64_t floats) { return reserve_in(total_, floats, false); }
  ArenaSlice reserve_scratch(int64_t floats) { return reserve_in(scratch_total_, floats, true); }
  // The memory of the blocks allocated from here on (null: plain host memory).
  void set_allocator(Allocator* allocator) {
    allocator_ = allocator;
    scratch_.set_allocator(allocator);
  }
  void allocate() {
    scratch_.resize(scratch_total_);
    select(0);
  }
  // Slot k's block holds the saved activations from here on (allocated on first use).
  void select(int k) {
    LOCKSTEP_CHECK(k >= 0, "arena slot ", k);
    while (static_cast<int>(slots_.size()) <= k) slots_.push_back(std::make_unique<FloatBuffer>(total_, allocator_));
    current_ = slots_[static_cast<size_t>(k)]->data();
  }
  float* operator()(ArenaSlice s) const {
    LOCKSTEP_CHECK(s.offset >= 0 && current_, "arena slice used before allocation");
    return s.scratch ? scratch_.data() + s.offset : current_ + s.offset;
  }
  // Floats of one slot (one micro-batch's saved activations) and of the scratch.
  int64_t total_floats() const { return total_; }
  int64_t scratch_floats() const { return scratch_total_; }
  int slots() const { return static_cast<int>(slots_.size()); }
  // Every float allocated: the slots in use and the scratch.
  int64_t allocated_floats() const { return static_cast<int64_t>(slots_.size()) * total_ + scratch_total_; }

 private:
  ArenaSlice reserve_in(int64_t& total, int64_t floats, bool scratch) {
    LOCKSTEP_CHECK(current_ == nullptr, "arena reserve after allocation");
    const ArenaSlice s{total, floats, scratch};
    total += (floats + 15) / 16 * 16;  // 64-byte aligned slices
    return s;
  }
  int64_t total_ = 0, scratch_total_ = 0;
  Allocator* allocator_ = nullptr;
  std::vector<std::unique_ptr<FloatBuffer>> slots_;
  FloatBuffer scratch_;
  float* current_ = nullptr;
};

}  // namespace lockstep
