// The canonical summation tree: the combiner of determinism = "layout" for big buffers (gradients,
// docs/design/reductions.md#the-canonical-tree).
//
// The canonical tree over leaves x_0 .. x_{L-1} depends on L only:
//     tree(x_0 .. x_{L-1}) = x_0                                        when L = 1
//                          = tree(x_0 .. x_{p-1}) + tree(x_p .. x_{L-1}) otherwise,
// p the largest power of two below L (canonical_split). Each element is summed along this tree
// (floating-point addition is commutative, so only the tree's shape matters, not which operand
// comes first). Two properties make it the layout-invariant sum of micro-batch gradients:
//   - blocks: when L = D x A with A a power of two, the D blocks of A consecutive leaves are whole
//     subtrees, and the tree above them is the canonical tree over D leaves. So D ranks that each
//     sum their A micro-batches along the canonical tree, then combine the D partial sums along the
//     canonical tree over ranks (ReduceOp::tree_sum, comm/communicator.h), get exactly the bits of
//     one process summing all L leaves.
//   - pieces: any block [a, b) of consecutive leaves is the union of O(log L) maximal subtrees
//     (canonical_pieces), and every subtree is the canonical tree over its own leaves. So D ranks
//     holding blocks of any sizes each sum their block's pieces along the canonical tree (MicroBatchTree
//     with pieces), and the pieces of all ranks are combined along the tree over L with the pieces
//     as leaves (PieceTree; Communicator's *_pieces collectives): again the one-process bits.
//   - streaming: the leaves can be pushed one at a time with ceil(log2 L) partial sums kept (a
//     binary counter: after leaf c, bit j of c + 1 says whether a complete subtree of 2^j leaves is
//     held), so a trainer never holds more than that many gradient-sized buffers.
// Everything here is elementwise: the result is bitwise independent of threads and of how the
// elements are split into ranges.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <vector>

#include "lockstep/core/tensor.h"

namespace lockstep {

// The largest power of two below n (n >= 2): where the canonical tree over n leaves splits.
inline int64_t canonical_split(int64_t n) { return int64_t{1} << (std::bit_width(static_cast<uint64_t>(n - 1)) - 1); }

// determinism = "layout"'s cut of a reduction that tensor parallelism may split (a sum over tokens
// or vocabulary columns) into S canonical segments: the S + 1 boundaries of segment s =
// [s n / S, (s + 1) n / S) (floor). When n is divisible by P and P divides S, part p of the n / P
// items cut into S / P segments this way gets exactly segments [p S / P, (p + 1) S / P) of the
// whole, so a rank holding part p holds a subtree of the canonical tree over the S segments.
// S = 0 (determinism = "run", ParamStore::token_segments): no boundaries, the sum is one chain
// (GemmOptions::k_segments empty).
inline std::vector<int64_t> canonical_segments(int64_t n, int64_t S) {
  if (S <= 0) return {};
  std::vector<int64_t> b(static_cast<size_t>(S + 1));
  for (int64_t s = 0; s <= S; ++s) b[static_cast<size_t>(s)] = s * n / S;
  return b;
}

// Block [a, b) of the canonical tree over L leaves as its maximal subtrees, left to right: the
// K + 1 bounds a = p_0 < p_1 < ... < p_K = b, piece k being leaves [p_k, p_{k+1}). When the block
// is a subtree (e.g. b - a = 2^j with a a multiple of it) K = 1. K <= 2 log2 L. An empty block
// (a == b) has no pieces: {a}, K = 0.
std::vector<int64_t> canonical_pieces(int64_t L, int64_t a, int64_t b);

// The canonical tree over L leaves evaluated with subtrees of it as its leaves: `bounds` (0 = p_0 <
// ... < p_K = L) cut the L leaves into K pieces, each a subtree (the concatenated canonical_pieces
// of consecutive blocks are); sum() adds the K piece sums along the tree above them, so given each
// piece's canonical tree sum it returns the tree over all L leaves, bit for bit.
class PieceTree {
 public:
  PieceTree(int64_t L, const std::vector<int64_t>& bounds);
  int64_t pieces() const { return pieces_; }
  int64_t scratch_size() const { return temps_; }  // buffers of n elements sum() needs
  // out[i] = the tree over pieces[0][i] .. pieces[K-1][i]. scratch: scratch_size() x n. out may
  // alias any piece (each element is read before it is written).
  template <typename T>
  void sum(T* out, const T* const* pieces, int64_t n, T* scratch) const;

 private:
  // An addition dst = a + b; operands >= 0 are pieces, -1 - t is scratch buffer t, and a dst of
  // -1 - temps_ is out (the root).
  struct Add {
    int dst, a, b;
  };
  int pieces_ = 0, temps_ = 0;
  std::vector<Add> adds_;  // in evaluation order
};

// out[i] = the canonical tree sum of leaves[0][i] .. leaves[L-1][i]. stack: scratch of
// tree_sum_stack(L) x n elements. out may alias a leaf: each leaf is read before the root is written.
template <typename T>
void tree_sum(T* out, const T* const* leaves, int64_t L, int64_t n, T* stack);
inline int64_t tree_sum_stack(int64_t L) { return L > 1 ? std::bit_width(static_cast<uint64_t>(L - 1)) : 0; }
// tree_sum one leaf at a time: push leaves c = 0, 1, ..., L - 1 in order (last: c = L - 1); the
// last push writes the tree sum to out (which may alias x). stack as tree_sum's.
template <typename T>
void tree_sum_push(T* out, const T* x, int64_t c, bool last, int64_t n, T* stack);
// The same push for an aligned block of leaves: x holds the canonical tree over leaves [c, c + 2^level)
// (c a multiple of 2^level; a complete subtree of the tree over L, as every aligned power-of-two
// block is), which then stands for those 2^level pushes, bit for bit; last: c + 2^level = L. stack
// holds the buffers of levels first_level and up, n apart (pushes whose blocks all have a level of at
// least first_level never touch a level below it). Only elements [i0, i1) of out, x and every stack
// buffer are touched, so disjoint ranges may be pushed from different threads.
template <typename T>
void tree_sum_push_block(T* out, const T* x, int64_t c, int level, bool last, int64_t n, T* stack, int first_level,
                         int64_t i0, int64_t i1);

// In place: L leaves stored `stride` elements apart (leaf s at x + s * stride), summed along the
// canonical tree over elements [begin, end) of each, into leaf 0 (the other leaves are clobbered).
// The combiner of per-segment partials (model/moe/experts.cpp, kernels/cpu/norms.cpp,
// embedding.cpp): each thread passes its rows, contiguous in every leaf.
inline void tree_sum_in_place(float* x, int64_t L, int64_t stride, int64_t begin, int64_t end) {
  if (L <= 1) return;
  const int64_t h = canonical_split(L);
  tree_sum_in_place(x, h, stride, begin, end);
  tree_sum_in_place(x + h * stride, L - h, stride, begin, end);
  float* a = x + begin;
  const float* b = x + h * stride + begin;
  for (int64_t k = 0; k < end - begin; ++k) a[k] = a[k] + b[k];
}

// dst[0, n) += the canonical tree over the segments of a sum over tokens: leaf k is
// accumulate(leaf, bounds[k], bounds[k + 1]), which adds tokens [begin, end) into the zeroed
// leaf (n elements). The layout-mode form of a gradient summed over tokens (bias, gate weight).
template <typename Accumulate>
void add_segment_tree(float* dst, int64_t n, const std::vector<int64_t>& bounds, Accumulate&& accumulate) {
  const int64_t S = static_cast<int64_t>(bounds.size()) - 1;
  thread_local std::vector<float> leaves;  // per thread, kept across calls (no allocation in steady state)
  leaves.assign(static_cast<size_t>(S * n), 0.0f);
  for (int64_t k = 0; k < S; ++k) accumulate(leaves.data() + k * n, bounds[k], bounds[k + 1]);
  tree_sum_in_place(leaves.data(), S, n, 0, n);
  for (int64_t j = 0; j < n; ++j) dst[j] += leaves[j];
}

// One push of the canonical tree streamed as a binary counter (tree_sum_push, tree_sum_push_block,
// parallel/reduction/micro_batch_tree.h): a block of 2^level leaves starting at leaf c (a multiple of 2^level; level 0:
// one leaf) folds the held subtrees whose levels are the bits of `held`, smallest first, and its carry becomes the
// subtree of level `store` (-1: the root, for the last block). Before the last, those are the trailing one bits of c /
// 2^level, from the block's own level up; the last folds every held subtree, the one bits of c.
struct TreePush {
  uint64_t held;
  int store;
};
inline TreePush tree_push(int64_t c, int level, bool last) {
  const uint64_t u = static_cast<uint64_t>(c);
  if (last) return {u, -1};
  const int ones = std::countr_one(u >> level);
  return {((uint64_t{1} << ones) - 1) << level, level + ones};
}

// The additions of a push over elements [i0, i1): dst = x, then dst = subtree(j) + dst for each
// level j of `held`, smallest first, a block of elements at a time (vectorised; the block stays in
// cache between the passes). dst may alias x (the additions then run in place); neither may be a
// held subtree. zero: if given (x itself, not aliased by dst), x's block is zeroed once read.
template <typename T, typename Subtree>
void tree_push_fold(T* dst, const T* x, uint64_t held, const Subtree& subtree, int64_t i0, int64_t i1,
                    T* zero = nullptr) {
  constexpr int64_t kBlock = 1024;
  for (int64_t b0 = i0; b0 < i1; b0 += kBlock) {
    const int64_t m = std::min(i1 - b0, kBlock);
    T* d = dst + b0;
    const T* src = x + b0;
    uint64_t h = held;
    if (!h) {
      if (d != src) std::memcpy(d, src, static_cast<size_t>(m) * sizeof(T));
    } else {
      const T* s0 = subtree(std::countr_zero(h)) + b0;
      for (int64_t i = 0; i < m; ++i) d[i] = s0[i] + src[i];
      for (h &= h - 1; h; h &= h - 1) {
        const T* sj = subtree(std::countr_zero(h)) + b0;
        for (int64_t i = 0; i < m; ++i) d[i] = sj[i] + d[i];
      }
    }
    if (zero) std::memset(zero + b0, 0, static_cast<size_t>(m) * sizeof(T));
  }
}

template <typename T>
void tree_sum_push_block(T* out, const T* x, int64_t c, int level, bool last, int64_t n, T* stack, int first_level,
                         int64_t i0, int64_t i1) {
  const TreePush p = tree_push(c, level, last);
  const auto subtree = [stack, n, first_level](int j) { return stack + (j - first_level) * n; };
  tree_push_fold(p.store < 0 ? out : subtree(p.store), x, p.held, subtree, i0, i1);
}

template <typename T>
void tree_sum_push(T* out, const T* x, int64_t c, bool last, int64_t n, T* stack) {
  tree_sum_push_block(out, x, c, 0, last, n, stack, 0, 0, n);
}

template <typename T>
void tree_sum(T* out, const T* const* leaves, int64_t L, int64_t n, T* stack) {
  // Every leaf pushed over a block of elements before the next block: the partial sums of a block
  // stay in cache instead of going through memory once per leaf (each element's additions are the
  // same, so are its bits; out aliasing a leaf is still read before written, element by element).
  constexpr int64_t kBlock = 16384;
  for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
    const int64_t b1 = std::min(n, b0 + kBlock);
    for (int64_t c = 0; c < L; ++c) tree_sum_push_block(out, leaves[c], c, 0, c + 1 == L, n, stack, 0, b0, b1);
  }
}

template <typename T>
void PieceTree::sum(T* out, const T* const* pieces, int64_t n, T* scratch) const {
  if (adds_.empty()) {
    if (out != pieces[0]) std::memmove(out, pieces[0], static_cast<size_t>(n) * sizeof(T));
    return;
  }
  auto at = [&](int x) -> T* {
    return x >= 0 ? const_cast<T*>(pieces[x]) : x == -1 - temps_ ? out : scratch + (-1 - x) * n;
  };
  for (const Add& add : adds_) {
    T* d = at(add.dst);
    const T* a = at(add.a);
    const T* b = at(add.b);
    for (int64_t i = 0; i < n; ++i) d[i] = a[i] + b[i];
  }
}

}  // namespace lockstep
