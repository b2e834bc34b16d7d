#include "lockstep/core/tree_sum.h"

#include <cstring>

#include "lockstep/core/error.h"
#include "lockstep/core/thread_pool.h"

namespace lockstep {

void TreeSum::reset(int64_t n, int64_t leaves) {
  LOCKSTEP_CHECK(leaves >= 1, "a tree sum needs at least one leaf");
  n_ = n;
  leaves_ = leaves;
  stack_.resize(static_cast<size_t>(tree_sum_stack(leaves)));
  for (FloatBuffer& b : stack_)
    if (b.size() != n) b = FloatBuffer(n);
}

void TreeSum::push(int64_t leaf, float* x, int64_t begin, int64_t end) {
  LOCKSTEP_CHECK(leaf >= 0 && leaf < leaves_ && begin >= 0 && begin <= end && end <= n_, "tree sum: leaf ", leaf,
                 " of ", leaves_, ", range [", begin, ", ", end, ") of ", n_);
  if (leaves_ == 1) return;  // the only leaf is the sum
  float* s[64];
  for (size_t j = 0; j < stack_.size(); ++j) s[j] = stack_[j].data();
  const bool last = leaf == leaves_ - 1;
  const uint64_t c = static_cast<uint64_t>(leaf);
  const int t = std::countr_one(c);
  parallel_for(end - begin, [&](int64_t i0, int64_t i1) {
    i0 += begin, i1 += begin;
    if (last) {
      for (int64_t i = i0; i < i1; ++i) {
        float carry = x[i];
        for (uint64_t h = c; h; h &= h - 1) carry = s[std::countr_zero(h)][i] + carry;
        x[i] = carry;
      }
      return;
    }
    float* dst = s[t];
    for (int64_t i = i0; i < i1; ++i) {
      float carry = x[i];
      for (int j = 0; j < t; ++j) carry = s[j][i] + carry;
      dst[i] = carry;
    }
    std::memset(x + i0, 0, static_cast<size_t>(i1 - i0) * sizeof(float));
  });
}

}  // namespace lockstep
