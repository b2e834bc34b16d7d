#include "lockstep/kernels/cpu/reduce.h"

#include <vector>

#include "lockstep/core/thread_pool.h"
#include "lockstep/core/tree_sum.h"

namespace lockstep {

void tree_sum(float* out, const float* const* leaves, int64_t L, int64_t n) {
  parallel_for(n, [&](int64_t i0, int64_t i1) {
    thread_local std::vector<const float*> at;  // per thread, kept across calls
    thread_local std::vector<float> stack;
    at.resize(static_cast<size_t>(L));
    for (int64_t g = 0; g < L; ++g) at[static_cast<size_t>(g)] = leaves[g] + i0;
    stack.resize(static_cast<size_t>(tree_sum_stack(L) * (i1 - i0)));
    tree_sum(out + i0, at.data(), L, i1 - i0, stack.data());
  });
}

void ordered_sum(float* out, const float* const* leaves, int64_t L, int64_t n) {
  parallel_for(n, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      float acc = leaves[0][i];
      for (int64_t g = 1; g < L; ++g) acc += leaves[g][i];
      out[i] = acc;
    }
  });
}

void piece_tree_sum(float* out, const float* const* pieces, const PieceTree& tree, int64_t n) {
  const int64_t K = tree.pieces();
  parallel_for(n, [&](int64_t i0, int64_t i1) {
    thread_local std::vector<const float*> at;  // per thread, kept across calls
    thread_local std::vector<float> scratch;
    at.resize(static_cast<size_t>(K));
    for (int64_t k = 0; k < K; ++k) at[static_cast<size_t>(k)] = pieces[k] + i0;
    scratch.resize(static_cast<size_t>(tree.scratch_size() * (i1 - i0)));
    tree.sum(out + i0, at.data(), i1 - i0, scratch.data());
  });
}

void tree_push_block(float* out, const float* x, int64_t c, int level, bool last, int64_t n, float* stack,
                     int first_level) {
  parallel_for(
      n, [&](int64_t i0, int64_t i1) { tree_sum_push_block(out, x, c, level, last, n, stack, first_level, i0, i1); });
}

void tree_fold(float* dst, const float* x, uint64_t held, float* const* levels, int64_t n, float* zero) {
  const auto level = [levels](int j) { return levels[j]; };
  parallel_for(n, [&](int64_t i0, int64_t i1) { tree_push_fold(dst, x, held, level, i0, i1, zero); });
}

}  // namespace lockstep
