// The reductions over several buffers (kernels/reduce.h) on every backend: bit for bit against
// core/tree_sum.h's host functions called directly (the canonical tree, PieceTree::sum,
// tree_sum_push_block) and against the serial left-to-right loop, and within a tolerance of the
// double sum. The leaves span many binades, so the orders give different bits (checked, so that a
// backend summing in another order fails).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../op_harness.h"
#include "../testing.h"
#include "lockstep/core/error.h"
#include "lockstep/core/tree_sum.h"

namespace lockstep::harness {
namespace {

using testing::bitwise_equal;
using testing::randn;
using testing::random_ints;

// L leaves of n elements, each element randn * 2^e with e in [-12, 12]: the order of the additions
// changes the bits.
std::vector<std::vector<float>> make_leaves(int64_t L, int64_t n, uint64_t seed) {
  std::vector<std::vector<float>> leaves;
  for (int64_t l = 0; l < L; ++l) {
    std::vector<float> v = randn(n, seed, str("leaf ", l));
    const std::vector<int32_t> e = random_ints(n, 25, seed, str("exponent ", l));
    for (int64_t i = 0; i < n; ++i) v[i] = std::ldexp(v[i], e[i] - 12);
    leaves.push_back(std::move(v));
  }
  return leaves;
}

std::vector<const float*> pointers(const std::vector<std::vector<float>>& v, int64_t from = 0, int64_t to = -1) {
  std::vector<const float*> p;
  for (int64_t l = from; l < (to < 0 ? static_cast<int64_t>(v.size()) : to); ++l) p.push_back(v[l].data());
  return p;
}

// The host's canonical tree (core/tree_sum.h) over leaves [from, to).
std::vector<float> host_tree(const std::vector<std::vector<float>>& leaves, int64_t from, int64_t to, int64_t n) {
  std::vector<float> out(n), stack(std::max<int64_t>(1, tree_sum_stack(to - from) * n));
  const std::vector<const float*> p = pointers(leaves, from, to);
  tree_sum(out.data(), p.data(), to - from, n, stack.data());
  return out;
}

// Every element within L ulps of its magnitude sum of the double sum.
::testing::AssertionResult near_double_sum(const std::vector<float>& got, const std::vector<std::vector<float>>& leaves,
                                           const std::string& what) {
  const int64_t L = static_cast<int64_t>(leaves.size());
  for (size_t i = 0; i < got.size(); ++i) {
    double sum = 0, mag = 0;
    for (const auto& l : leaves) sum += l[i], mag += std::abs(static_cast<double>(l[i]));
    if (!(std::abs(got[i] - sum) <= static_cast<double>(L) * 0x1p-23 * mag))
      return ::testing::AssertionFailure() << what << "[" << i << "]: " << got[i] << " vs the double sum " << sum;
  }
  return ::testing::AssertionSuccess();
}

// Some element differs in bits (the case can tell two orders apart).
bool differ(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() != b.size() || (!a.empty() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) != 0);
}

// Uploads each leaf: the pointer array lives on the host, the leaves on the backend.
std::vector<Buf<float>> upload(Run& r, const std::vector<std::vector<float>>& leaves) {
  std::vector<Buf<float>> b;
  for (const auto& l : leaves) b.push_back(r.in(l));
  return b;
}
std::vector<const float*> pointers(const std::vector<Buf<float>>& b) {
  std::vector<const float*> p;
  for (const auto& x : b) p.push_back(x.p());
  return p;
}

constexpr int64_t kSizes[] = {0, 1, 7, 3001};

// Where tree_sum's out goes: -1 a buffer of its own, else that leaf (the first and the last).
std::vector<int64_t> aliases(int64_t L) {
  return L > 1 ? std::vector<int64_t>{-1, 0, L - 1} : std::vector<int64_t>{-1, 0};
}

}  // namespace

void add_reduce_cases(Registry& reg) {
  // tree_sum: the canonical tree over L leaves, per element; out a separate buffer, the first leaf
  // or the last leaf.
  for (const int64_t L : {1, 2, 3, 5, 8, 13})
    for (const int64_t n : kSizes) {
      reg.add(
          {"Reduce", "TreeSumIsTheCanonicalTree", {"tree_sum"}, str("L=", L, " n=", n)},
          [=] { return make_leaves(L, n, 1); },
          [=](Run& r, const std::vector<std::vector<float>>& leaves) {
            for (const int64_t alias : aliases(L)) {
              std::vector<Buf<float>> b = upload(r, leaves);
              Buf<float> own = r.in(randn(n, 2, "out"));
              float* out = alias < 0 ? own.p() : b[alias].p();
              r.ops.tree_sum(out, pointers(b).data(), L, n);
              r.out(str("out (alias ", alias, ")"), r.get(out, n));
            }
          },
          [=](const Result& got, const std::vector<std::vector<float>>& leaves) {
            const std::vector<float> want = host_tree(leaves, 0, L, n);
            for (const int64_t alias : aliases(L)) {
              const std::string name = str("out (alias ", alias, ")");
              EXPECT_TRUE(bitwise_equal(got[name], want, name));
            }
            EXPECT_TRUE(near_double_sum(got["out (alias -1)"], leaves, "out"));
            if (L >= 4 && n > 1000) {
              std::vector<float> ordered(n);
              for (int64_t i = 0; i < n; ++i) {
                float acc = leaves[0][i];
                for (int64_t l = 1; l < L; ++l) acc += leaves[l][i];
                ordered[i] = acc;
              }
              EXPECT_TRUE(differ(want, ordered)) << "the case cannot tell the tree from the ordered sum";
            }
          });
    }

  // ordered_sum: ((l0 + l1) + l2) + ..., left to right; out separate or the first leaf.
  for (const int64_t L : {1, 2, 3, 6})
    for (const int64_t n : kSizes) {
      reg.add(
          {"Reduce", "OrderedSumAddsLeftToRight", {"ordered_sum"}, str("L=", L, " n=", n)},
          [=] { return make_leaves(L, n, 3); },
          [=](Run& r, const std::vector<std::vector<float>>& leaves) {
            for (const bool alias : {false, true}) {
              std::vector<Buf<float>> b = upload(r, leaves);
              Buf<float> own = r.in(randn(n, 4, "out"));
              float* out = alias ? b[0].p() : own.p();
              r.ops.ordered_sum(out, pointers(b).data(), L, n);
              r.out(alias ? "out = leaf 0" : "out", r.get(out, n));
            }
          },
          [=](const Result& got, const std::vector<std::vector<float>>& leaves) {
            std::vector<float> want(n);
            for (int64_t i = 0; i < n; ++i) {
              float acc = leaves[0][i];
              for (int64_t l = 1; l < L; ++l) acc = acc + leaves[l][i];
              want[i] = acc;
            }
            EXPECT_TRUE(bitwise_equal(got["out"], want, "out"));
            EXPECT_TRUE(bitwise_equal(got["out = leaf 0"], want, "out = leaf 0"));
            EXPECT_TRUE(near_double_sum(got["out"], leaves, "out"));
            if (L >= 4 && n > 1000) {
              EXPECT_TRUE(differ(want, host_tree(leaves, 0, L, n))) << "ordered = tree here";
            }
          });
    }

  // piece_tree_sum: consecutive blocks of the L leaves, each cut into its canonical pieces
  // (canonical_pieces), each piece summed along its own tree on the host; the op adds the pieces
  // along the PieceTree: PieceTree::sum's bits, which are the canonical tree's over all L leaves.
  {
    struct Blocks {
      int64_t L;
      std::vector<int64_t> ends;  // the blocks' ends; the first starts at 0
    };
    struct In {
      std::vector<std::vector<float>> leaves, pieces;
      std::vector<int64_t> bounds;
    };
    for (const Blocks& bl : {Blocks{1, {1}}, Blocks{8, {8}}, Blocks{7, {2, 7}}, Blocks{13, {5, 6, 13}},
                             Blocks{12, {3, 10, 12}}, Blocks{6, {1, 2, 3, 4, 5, 6}}})
      for (const int64_t n : kSizes) {
        reg.add(
            {"Reduce",
             "PieceTreeSumIsThePieceTreeAndTheCanonicalTree",
             {"piece_tree_sum"},
             str("L=", bl.L, " blocks ending at ", ::testing::PrintToString(bl.ends), " n=", n)},
            [=] {
              In in{make_leaves(bl.L, n, 5), {}, {0}};
              int64_t a = 0;
              for (const int64_t b : bl.ends) {
                const std::vector<int64_t> p = canonical_pieces(bl.L, a, b);
                in.bounds.insert(in.bounds.end(), p.begin() + 1, p.end());
                a = b;
              }
              for (size_t k = 0; k + 1 < in.bounds.size(); ++k)
                in.pieces.push_back(host_tree(in.leaves, in.bounds[k], in.bounds[k + 1], n));
              return in;
            },
            [=](Run& r, const In& in) {
              const PieceTree tree(bl.L, in.bounds);
              for (const bool alias : {false, true}) {
                std::vector<Buf<float>> b = upload(r, in.pieces);
                Buf<float> own = r.in(randn(n, 6, "out"));
                float* out = alias ? b[0].p() : own.p();
                r.ops.piece_tree_sum(out, pointers(b).data(), tree, n);
                r.out(alias ? "out = piece 0" : "out", r.get(out, n));
              }
            },
            [=](const Result& got, const In& in) {
              const PieceTree tree(bl.L, in.bounds);
              ASSERT_EQ(tree.pieces(), static_cast<int64_t>(in.pieces.size()));
              std::vector<float> want(n), scratch(std::max<int64_t>(1, tree.scratch_size() * n));
              tree.sum(want.data(), pointers(in.pieces).data(), n, scratch.data());
              EXPECT_TRUE(bitwise_equal(want, host_tree(in.leaves, 0, bl.L, n), "PieceTree::sum = the canonical tree"));
              EXPECT_TRUE(bitwise_equal(got["out"], want, "out"));
              EXPECT_TRUE(bitwise_equal(got["out = piece 0"], want, "out = piece 0"));
              EXPECT_TRUE(near_double_sum(got["out"], in.leaves, "out"));
            });
      }
  }

  // tree_push_block: the L leaves pushed as aligned blocks (c, level), each x the canonical tree over
  // its 2^level leaves; the stack (levels first_level and up) after every push is
  // tree_sum_push_block's on the host, and the last push's root is the canonical tree over all L.
  // out separate, or out = x (the push in place, as GPT's head gradient does).
  {
    struct Push {
      int64_t c;
      int level;
    };
    struct Plan {
      int64_t L;
      std::vector<Push> pushes;
    };
    struct In {
      std::vector<std::vector<float>> leaves, blocks;
    };
    const std::vector<Plan> plans = {
        {1, {{0, 0}}},
        {4, {{0, 2}}},
        {11, {{0, 2}, {4, 1}, {6, 0}, {7, 0}, {8, 1}, {10, 0}}},
        {12, {{0, 2}, {4, 1}, {6, 1}, {8, 2}}},
        {13,
         {{0, 0}, {1, 0}, {2, 0}, {3, 0}, {4, 0}, {5, 0}, {6, 0}, {7, 0}, {8, 0}, {9, 0}, {10, 0}, {11, 0}, {12, 0}}},
        {24, {{0, 3}, {8, 3}, {16, 3}}},
    };
    for (const Plan& plan : plans)
      for (const int64_t n : kSizes) {
        int first = 99;
        std::string label = str("L=", plan.L, " pushes");
        for (const Push& p : plan.pushes) first = std::min(first, p.level), label += str(" (", p.c, ", ", p.level, ")");
        const int64_t stack_n = std::max<int64_t>(0, tree_sum_stack(plan.L) - first) * n;
        reg.add(
            {"Reduce",
             "TreePushBlockIsTheHostsPush",
             {"tree_push_block"},
             str(label, " first_level=", first, " n=", n)},
            [=] {
              In in{make_leaves(plan.L, n, 7), {}};
              int64_t next = 0;
              for (const Push& p : plan.pushes) {
                LOCKSTEP_CHECK(p.c == next && p.c % (int64_t{1} << p.level) == 0, "the plan's blocks");
                next = p.c + (int64_t{1} << p.level);
                in.blocks.push_back(host_tree(in.leaves, p.c, next, n));
              }
              LOCKSTEP_CHECK(next == plan.L, "the plan covers the leaves");
              return in;
            },
            [=](Run& r, const In& in) {
              for (const bool in_place : {false, true}) {
                const std::string name = in_place ? "in place " : "";
                Buf<float> stack = r.in(randn(stack_n, 8, "stack")), out = r.in(randn(n, 8, "out"));
                for (size_t k = 0; k < plan.pushes.size(); ++k) {
                  const Push& p = plan.pushes[k];
                  const bool last = k + 1 == plan.pushes.size();
                  Buf<float> x = r.in(in.blocks[k]);
                  r.ops.tree_push_block(in_place ? x.p() : out.p(), x, p.c, p.level, last, n, stack, first);
                  if (!last)
                    r.out(str(name, "stack after push ", k), stack);
                  else
                    r.out(name + "root", in_place ? x : out);
                }
              }
            },
            [=](const Result& got, const In& in) {
              std::vector<float> stack = randn(stack_n, 8, "stack"), out = randn(n, 8, "out");
              for (size_t k = 0; k < plan.pushes.size(); ++k) {
                const Push& p = plan.pushes[k];
                const bool last = k + 1 == plan.pushes.size();
                tree_sum_push_block(out.data(), in.blocks[k].data(), p.c, p.level, last, n, stack.data(), first, 0, n);
                if (!last) {
                  for (const std::string name : {"", "in place "})
                    EXPECT_TRUE(bitwise_equal(got[str(name, "stack after push ", k)], stack,
                                              str(name, "stack after push ", k)));
                }
              }
              EXPECT_TRUE(
                  bitwise_equal(out, host_tree(in.leaves, 0, plan.L, n), "the host's pushes = the canonical tree"));
              EXPECT_TRUE(bitwise_equal(got["root"], out, "root"));
              EXPECT_TRUE(bitwise_equal(got["in place root"], out, "in place root"));
              EXPECT_TRUE(near_double_sum(got["root"], in.leaves, "root"));
            });
      }
  }

  // tree_fold: one push of a streamed tree (what MicroBatchTree::push runs): dst = x, then dst =
  // levels[j] + dst for each set bit j of `held`, smallest first; x zeroed when asked; dst = x too.
  // Bitwise the host's tree_push_fold.
  for (const uint64_t held : {uint64_t{0}, uint64_t{1}, uint64_t{0b1011}, uint64_t{0b110}})
    for (const int64_t n : kSizes) {
      struct In {
        std::vector<float> x;
        std::vector<std::vector<float>> levels;
      };
      reg.add(
          {"Reduce", "TreeFoldIsTheHostsFold", {"tree_fold"}, str("held=", held, " n=", n)},
          [=] {
            In in{randn(n, 9, "x"), {}};
            for (int j = 0; j < 4; ++j) in.levels.push_back(randn(n, 10 + static_cast<uint64_t>(j), "level"));
            return in;
          },
          [=](Run& r, const In& in) {
            for (const int mode : {0, 1, 2}) {  // separate dst; separate dst and x zeroed; dst = x
              std::vector<Buf<float>> levels;
              std::vector<float*> at;
              for (const std::vector<float>& l : in.levels) levels.push_back(r.in(l));
              for (Buf<float>& l : levels) at.push_back(l.p());
              Buf<float> x = r.in(in.x), dst = r.in(randn(n, 11, "dst"));
              float* d = mode == 2 ? x.p() : dst.p();
              r.ops.tree_fold(d, x, held, at.data(), n, mode == 1 ? x.p() : nullptr);
              r.out(str("mode ", mode, " dst"), mode == 2 ? x : dst);
              r.out(str("mode ", mode, " x"), x);
            }
          },
          [=](const Result& got, const In& in) {
            std::vector<float> want(static_cast<size_t>(n));
            const auto level = [&](int j) { return in.levels[static_cast<size_t>(j)].data(); };
            tree_push_fold(want.data(), in.x.data(), held, level, 0, n);
            for (const int mode : {0, 1, 2}) EXPECT_TRUE(bitwise_equal(got[str("mode ", mode, " dst")], want, "dst"));
            EXPECT_TRUE(bitwise_equal(got["mode 0 x"], in.x, "x kept"));
            EXPECT_TRUE(bitwise_equal(got["mode 1 x"], std::vector<float>(static_cast<size_t>(n), 0.0f), "x zeroed"));
          });
    }
}

}  // namespace lockstep::harness
