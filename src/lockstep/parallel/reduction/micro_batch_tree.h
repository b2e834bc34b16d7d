// The micro-batch tree (docs/design/reductions.md#micro-batch-tree): under determinism = "layout" a
// gradient is summed over the step's micro-batches along the canonical tree (core/tree_sum.h), not
// in arrival order, so that any split of the micro-batches over ranks adds the same way. The tree is
// streamed: each micro-batch's gradient is pushed as its leaf when its backward reports it, folding
// the complete subtrees held so far (a binary counter), and the last push leaves the root in place.
//
// With pieces (bounds 0 = p_0 < ... < p_K = leaves, as canonical_pieces cuts a block relative to
// its first leaf), each piece is summed along its own canonical tree: the sums of pieces 0 .. K-2
// are kept in piece(k), the last piece's is left in x like the single tree's (one more buffer of n
// per extra piece; the partial sums are shared, the pieces being pushed one after the other).
// The additions run as the device's ops (kernels/reduce.h tree_fold), its buffers in its memory.
#pragma once

#include <cstdint>
#include <vector>

#include "lockstep/core/tensor.h"

namespace lockstep {

class Device;

class MicroBatchTree {
 public:
  void reset(Device& device, int64_t n, int64_t leaves) { reset(device, n, std::vector<int64_t>{0, leaves}); }
  void reset(Device& device, int64_t n, const std::vector<int64_t>& bounds);
  int64_t leaves() const { return bounds_.back(); }
  int64_t pieces() const { return static_cast<int64_t>(bounds_.size()) - 1; }
  // x[begin, end) holds leaf `leaf`'s values there. Except for the last leaf they are folded into
  // the partial sums (or, for the last leaf of a piece but the last, become piece(k) there) and
  // x[begin, end) is zeroed (ready to accumulate the next leaf from zero); for the last leaf
  // x[begin, end) becomes the tree sum of the last piece (of all leaves without pieces).
  void push(int64_t leaf, float* x, int64_t begin, int64_t end);
  // Piece k < pieces() - 1: its tree sum once its last leaf is pushed (n elements).
  float* piece(int64_t k) { return held_[static_cast<size_t>(k)].data(); }

 private:
  Device* device_ = nullptr;
  int64_t n_ = 0;
  std::vector<int64_t> bounds_{0, 1};
  std::vector<FloatBuffer> stack_;  // stack_[j]: a complete subtree of 2^j leaves when held
  std::vector<FloatBuffer> held_;   // the sums of pieces 0 .. K-2
};

}  // namespace lockstep
