// Reductions over several buffers of the compute seam (kernels/ops.h): how determinism = "layout"
// combines the pieces a layout splits (docs/design/reductions.md). Each output element is a fixed
// expression of the leaves' elements at the same index, so every backend and thread count gives the
// same bits.
#pragma once

#include <cstdint>

#include "lockstep/core/tree_sum.h"
#include "lockstep/kernels/op.h"

namespace lockstep {

struct ReduceOps {
  // out[i] = the canonical tree (core/tree_sum.h) over leaves[0][i] .. leaves[L - 1][i]. out may be a
  // leaf (each leaf is read before the root is written).
  Op<void(float* out, const float* const* leaves, int64_t L, int64_t n)> tree_sum{"tree_sum"};
  // out[i] = ((leaves[0][i] + leaves[1][i]) + leaves[2][i]) + ..., left to right (rank order).
  Op<void(float* out, const float* const* leaves, int64_t L, int64_t n)> ordered_sum{"ordered_sum"};
  // out[i] = the sum of pieces[0][i] .. pieces[K - 1][i] along `tree` (core/tree_sum.h PieceTree: a
  // block of leaves that is not a subtree, summed as the canonical tree's pieces of it). out may be
  // a piece.
  Op<void(float* out, const float* const* pieces, const PieceTree& tree, int64_t n)> piece_tree_sum{"piece_tree_sum"};
  // core/tree_sum.h tree_sum_push_block over all n elements: x (the canonical tree over leaves
  // [c, c + 2^level)) pushed into the tree whose levels first_level and up live in stack (n apart);
  // the last push writes the root to out.
  Op<void(float* out, const float* x, int64_t c, int level, bool last, int64_t n, float* stack, int first_level)>
      tree_push_block{"tree_push_block"};
  // One push of a streamed canonical tree (core/tree_sum.h tree_push_fold) over n elements: dst = x,
  // then dst = levels[j] + dst for each set bit j of `held`, smallest first; zero (x itself, or
  // null): x zeroed once read. dst may be x; neither may be a held level.
  Op<void(float* dst, const float* x, uint64_t held, float* const* levels, int64_t n, float* zero)> tree_fold{
      "tree_fold"};

  template <class F>
  void each(F&& f) {
    f(tree_sum), f(ordered_sum), f(piece_tree_sum), f(tree_push_block), f(tree_fold);
  }
};

}  // namespace lockstep
