#include "lockstep/core/tree_sum.h"

#include <algorithm>
#include <cstring>

#include "lockstep/core/error.h"
#include "lockstep/core/thread_pool.h"

namespace lockstep {

namespace {

void pieces_of(std::vector<int64_t>& out, int64_t lo, int64_t hi, int64_t a, int64_t b) {
  if (hi <= a || b <= lo) return;
  if (a <= lo && hi <= b) {
    out.push_back(hi);
    return;
  }
  const int64_t p = lo + canonical_split(hi - lo);  // a partial overlap has at least 2 leaves
  pieces_of(out, lo, p, a, b);
  pieces_of(out, p, hi, a, b);
}

}  // namespace

std::vector<int64_t> canonical_pieces(int64_t L, int64_t a, int64_t b) {
  LOCKSTEP_CHECK(0 <= a && a <= b && b <= L, "canonical_pieces: block [", a, ", ", b, ") of ", L, " leaves");
  std::vector<int64_t> bounds{a};
  pieces_of(bounds, 0, L, a, b);
  return bounds;
}

PieceTree::PieceTree(int64_t L, const std::vector<int64_t>& bounds) {
  LOCKSTEP_CHECK(bounds.size() >= 2 && bounds.front() == 0 && bounds.back() == L, "PieceTree: the pieces must cover ",
                 L, " leaves");
  pieces_ = static_cast<int>(bounds.size()) - 1;
  // Node [lo, hi) evaluated into scratch buffer d (its left subtree too, its right into d + 1):
  // returns its operand.
  auto eval = [&](auto& self, int64_t lo, int64_t hi, int d) -> int {
    const auto it = std::lower_bound(bounds.begin(), bounds.end(), lo);
    // Every node met starts a piece and ends at or after its end, unless a piece is not a subtree.
    LOCKSTEP_CHECK(it + 1 < bounds.end() && *it == lo && it[1] <= hi, "PieceTree: the tree's node [", lo, ", ", hi,
                   ") cuts a piece: the pieces are not subtrees of the tree over ", L, " leaves");
    if (it[1] == hi) return static_cast<int>(it - bounds.begin());
    const int64_t p = lo + canonical_split(hi - lo);
    const int a = self(self, lo, p, d), b = self(self, p, hi, d + 1);
    temps_ = std::max(temps_, d + 1);
    adds_.push_back({-1 - d, a, b});
    return -1 - d;
  };
  if (eval(eval, 0, L, 0) < 0) adds_.back().dst = -1 - temps_;  // the root's addition writes out
}

void TreeSum::reset(int64_t n, const std::vector<int64_t>& bounds) {
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
      if (b.size() != n) b = FloatBuffer(n);
}

void TreeSum::push(int64_t leaf, float* x, int64_t begin, int64_t end) {
  LOCKSTEP_CHECK(leaf >= 0 && leaf < leaves() && begin >= 0 && begin <= end && end <= n_, "tree sum: leaf ", leaf,
                 " of ", leaves(), ", range [", begin, ", ", end, ") of ", n_);
  if (leaves() == 1) return;  // the only leaf is the sum
  // The piece holding the leaf, and the leaf's index c in it.
  const size_t k = static_cast<size_t>(std::upper_bound(bounds_.begin(), bounds_.end(), leaf) - bounds_.begin()) - 1;
  const uint64_t c = static_cast<uint64_t>(leaf - bounds_[k]);
  const bool last = leaf == bounds_[k + 1] - 1;
  float* done = last && k < held_.size() ? held_[k].data() : nullptr;  // a piece's sum but the final one
  if (last && !done && c == 0) return;  // a one-leaf last piece: x is its sum
  const TreePush p = tree_push(static_cast<int64_t>(c), 0, last);
  const auto subtree = [this](int j) { return stack_[static_cast<size_t>(j)].data(); };
  float* dst = p.store >= 0 ? subtree(p.store) : done ? done : x;
  const bool zero = !last || done;  // x starts the next leaf from zero
  parallel_for(end - begin, [&](int64_t i0, int64_t i1) {
    tree_push_fold(dst, x, p.held, subtree, begin + i0, begin + i1, zero ? x : nullptr);
  });
}

}  // namespace lockstep
