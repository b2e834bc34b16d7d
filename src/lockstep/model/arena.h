// Activation memory, planned once: modules reserve their slices when the model is built, the arena
// allocates one block, and every step reuses it (steady-state steps do not allocate).
//
// Slots (pipeline parallelism): a pipeline schedule keeps several micro-batches in flight, each
// with its own saved activations. The plan is the same for every micro-batch, so a slot is one
// more block with the same layout; select(k) makes slot k the one every slice resolves to. Slots
// are allocated when first selected, so the memory a run holds is what its schedule keeps in
// flight. Scratch slices (reserve_scratch: backward's working buffers, used within one module call)
// live once, outside the slots.
//
// Recompute (train.recompute_granularity = "full"): the activations of a recomputed group of layers
// are reserved between begin_recompute() and end_recompute(); every group's start at the same
// offset of one recompute region, which is as large as the largest group and lives once, outside
// the slots: forward writes a group's activations there and moves on (the next group overwrites
// them), backward runs the group's forward again into it before the group's backward reads it.
#pragma once

#include <algorithm>
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
  bool recompute = false;  // in the recompute region
};

class Arena {
 public:
  ArenaSlice reserve(int64_t floats) {
    if (!in_group_) return reserve_in(total_, floats, false);
    ArenaSlice s = reserve_in(group_total_, floats, false);
    s.recompute = true;
    recompute_total_ = std::max(recompute_total_, group_total_);
    return s;
  }
  // The reserve() calls between these two are a recomputed group's (above).
  void begin_recompute() {
    LOCKSTEP_CHECK(!in_group_, "arena: recompute groups do not nest");
    in_group_ = true;
    group_total_ = 0;
  }
  void end_recompute() { in_group_ = false; }
  ArenaSlice reserve_scratch(int64_t floats) { return reserve_in(scratch_total_, floats, true); }
  // The memory of the blocks allocated from here on (null: plain host memory).
  void set_allocator(Allocator* allocator) {
    allocator_ = allocator;
    scratch_.set_allocator(allocator);
    recompute_.set_allocator(allocator);
  }
  void allocate() {
    scratch_.resize(scratch_total_);
    recompute_.resize(recompute_total_);
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
    return s.scratch ? scratch_.data() + s.offset : s.recompute ? recompute_.data() + s.offset : current_ + s.offset;
  }
  // Floats of one slot (one micro-batch's saved activations), of the scratch and of the recompute
  // region.
  int64_t total_floats() const { return total_; }
  int64_t scratch_floats() const { return scratch_total_; }
  int64_t recompute_floats() const { return recompute_total_; }
  int slots() const { return static_cast<int>(slots_.size()); }
  // Every float allocated: the slots in use, the scratch and the recompute region.
  int64_t allocated_floats() const {
    return static_cast<int64_t>(slots_.size()) * total_ + scratch_total_ + recompute_total_;
  }

 private:
  ArenaSlice reserve_in(int64_t& total, int64_t floats, bool scratch) {
    LOCKSTEP_CHECK(current_ == nullptr, "arena reserve after allocation");
    const ArenaSlice s{total, floats, scratch};
    total += (floats + 15) / 16 * 16;  // 64-byte aligned slices
    return s;
  }
  int64_t total_ = 0, scratch_total_ = 0, recompute_total_ = 0, group_total_ = 0;
  bool in_group_ = false;
  Allocator* allocator_ = nullptr;
  std::vector<std::unique_ptr<FloatBuffer>> slots_;
  FloatBuffer scratch_, recompute_;
  float* current_ = nullptr;
};

}  // namespace lockstep
