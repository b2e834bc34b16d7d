// Reductions over several buffers of the compute seam (kernels/ops.h): how determinism = "layout"
// combines the pieces a layout splits (docs/design/reductions.md). Each output element is a fixed
// expression of the leaves' elements at the same index, so every backend and thread count gives the
// same bits.
#pragma once

#include <cstdint>

#include "lockstep/kernels/op.h"

namespace lockstep {

struct ReduceOps {
  // out[i] = the canonical tree (core/tree_sum.h) over leaves[0][i] .. leaves[L - 1][i]. out may be a
  // leaf (each leaf is read before the root is written).
  Op<void(float* out, const float* const* leaves, int64_t L, int64_t n)> tree_sum{"tree_sum"};
  // out[i] = ((leaves[0][i] + leaves[1][i]) + leaves[2][i]) + ..., left to right (rank order).
  Op<void(float* out, const float* const* leaves, int64_t L, int64_t n)> ordered_sum{"ordered_sum"};

  template <class F>
  void each(F&& f) {
    f(tree_sum), f(ordered_sum);
  }
};

}  // namespace lockstep
