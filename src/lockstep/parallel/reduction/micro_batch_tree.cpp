#include "lockstep/parallel/reduction/micro_batch_tree.h"

#include <algorithm>

#include "lockstep/core/error.h"
#include "lockstep/core/tree_sum.h"
#include "lockstep/kernels/device.h"

namespace lockstep {

void MicroBatchTree::reset(Device& device, int64_t n, const std::vector<int64_t>& bounds) {
  device_ = &device;
  LOCKSTEP_CHECK(bounds.size() >= 2 && bounds.front() == 0, "a tree sum needs at least one leaf");
  int64_t longest = 0;
  for (size_t k = 0; k + 1 < bounds.size(); ++k) {
    LOCKSTEP_CHECK(bounds[k] < bounds[k + 1], "tree sum: empty piece ", k);
    longest = std::max(longest, bounds[k + 1] - bounds[k]);
  }
  n_ = n;
  bounds_ = bounds;
  stack_.resize(static_cast<size_t>(tree_sum_stack(longest)));
  held_.resize(bounds.size() - 2);
  for (std::vector<FloatBuffer>* v : {&stack_, &held_})
    for (FloatBuffer& b : *v)
      if (b.size() != n) b = FloatBuffer(n, &device.memory());
}

void MicroBatchTree::push(int64_t leaf, float* x, int64_t begin, int64_t end) {
  LOCKSTEP_CHECK(leaf >= 0 && leaf < leaves() && begin >= 0 && begin <= end && end <= n_, "tree sum: leaf ", leaf,
                 " of ", leaves(), ", range [", begin, ", ", end, ") of ", n_);
  if (leaves() == 1) return;  // the only leaf is the sum
  // The piece holding the leaf, and the leaf's index c in it.
  const size_t k = static_cast<size_t>(std::upper_bound(bounds_.begin(), bounds_.end(), leaf) - bounds_.begin()) - 1;
  const uint64_t c = static_cast<uint64_t>(leaf - bounds_[k]);
  const bool last = leaf == bounds_[k + 1] - 1;
  float* done = last && k < held_.size() ? held_[k].data() : nullptr;  // a piece's sum but the final one
  if (last && !done && c == 0) return;                                 // a one-leaf last piece: x is its sum
  const TreePush p = tree_push(static_cast<int64_t>(c), 0, last);
  float* levels[64];
  for (size_t j = 0; j < stack_.size(); ++j) levels[j] = stack_[j].data() + begin;
  float* dst = p.store >= 0 ? stack_[static_cast<size_t>(p.store)].data() : done ? done : x;
  const bool zero = !last || done;  // x starts the next leaf from zero
  device_->ops.tree_fold(dst + begin, x + begin, p.held, levels, end - begin, zero ? x + begin : nullptr);
}

}  // namespace lockstep
