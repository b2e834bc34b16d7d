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

}  // namespace lockstep
