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

}  // namespace lockstep
