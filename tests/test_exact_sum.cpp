// The exact combiners of determinism = "layout": ExactSum (core/exact_sum.h) against exact
// references (__float128 where the terms fit its 113 bits, hand-made cases elsewhere), for order
// and grouping independence, rounding, subnormals and non-finite terms; the sum of squares against
// term-by-term accumulation and a long double reference on 1, 2 and 3 threads; the canonical tree
// (core/tree_sum.h) against its recursive definition, its block property (the layout argument) and
// the streaming form pushed range by range.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <memory>
#include <tuple>
#include <vector>

#include "lockstep/core/exact_sum.h"
#include "lockstep/core/philox.h"
#include "lockstep/core/tree_sum.h"
#include "lockstep/kernels/device.h"
#include "lockstep/parallel/reduction/micro_batch_tree.h"
#include "testing.h"

namespace lockstep {
namespace {

using testing::randn;
using testing::with_threads;

double sum_of(const std::vector<double>& v) {
  ExactSum s;
  for (double x : v) s.add(x);
  return s.value();
}

uint64_t bits(double x) { return std::bit_cast<uint64_t>(x); }

// n doubles of both signs, magnitudes 2^-20 .. 2^40, each a multiple of 2^-60: their exact sum has
// at most 100 + log2(n) significant bits, so __float128 (113 bits) holds every partial sum exactly
// and its rounding to double is the correctly rounded exact sum.
std::vector<double> wide_terms(int n, uint64_t seed) {
  const RandomStream rng(seed, purpose_id("exact_sum/terms"));
  std::vector<double> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    const double mant = 1.0 + rng.uniform(3 * i);
    const int e = -20 + static_cast<int>(rng.bits(3 * i + 1) % 61);
    double x = std::ldexp(mant, e);
    x = std::ldexp(std::nearbyint(std::ldexp(x, 60)), -60);
    v[i] = (rng.bits(3 * i + 2) & 1) ? -x : x;
  }
  return v;
}

TEST(ExactSum, EqualsTheCorrectlyRoundedExactSum) {
  for (uint64_t seed : {1, 2, 3}) {
    const std::vector<double> v = wide_terms(1000, seed);
    __float128 ref = 0;
    for (double x : v) ref += x;
    EXPECT_EQ(bits(sum_of(v)), bits(static_cast<double>(ref))) << "seed " << seed;
    double naive = 0;
    for (double x : v) naive += x;
    std::printf("[ exact_sum ] seed %llu: exact %.17g, left fold in double %.17g\n", (unsigned long long)seed,
                sum_of(v), naive);
  }
}

TEST(ExactSum, SameBitsInAnyOrderAndGrouping) {
  std::vector<double> v = wide_terms(777, 4);
  // Also terms far apart: the largest and smallest doubles, subnormals.
  v.push_back(1e300), v.push_back(-1e300), v.push_back(4.9e-324), v.push_back(1e-310), v.push_back(3.5e250);
  const double expected = sum_of(v);
  for (uint64_t seed : {5, 6, 7}) {
    std::vector<double> w = v;
    const RandomStream rng(seed, purpose_id("exact_sum/shuffle"));
    for (size_t i = w.size() - 1; i > 0; --i) std::swap(w[i], w[rng.bits(i) % (i + 1)]);
    // Groups of varying sizes, merged in reverse order, through the word form.
    std::vector<ExactSum> groups;
    for (size_t i = 0; i < w.size();) {
      const size_t len = 1 + rng.bits(10000 + i) % 50;
      ExactSum g;
      for (size_t k = i; k < std::min(w.size(), i + len); ++k) g.add(w[k]);
      uint64_t words[ExactSum::kWords];
      g.to_words(words);
      groups.push_back(ExactSum::from_words(words));
      i += len;
    }
    ExactSum total;
    for (auto it = groups.rbegin(); it != groups.rend(); ++it) total.merge(*it);
    EXPECT_EQ(bits(total.value()), bits(expected)) << "seed " << seed;
    ExactSum direct;
    for (double x : w) direct.add(x);
    EXPECT_TRUE(total == direct);  // the same integer, not only the same rounding
  }
}

// The binned squares at their worst: every element the largest significand of one exponent, a
// whole flush of them per bin set and past it, and runs of one exponent (every bin set's chain).
TEST(ExactSum, SumOfSquaresFullBins) {
  for (float v : {std::nextafter(2.0f, 0.0f), -std::nextafter(1e30f, 0.0f), std::nextafter(1e-40f, 1.0f)}) {
    for (int64_t n : {int64_t{1} << 15, (int64_t{1} << 16) + 3, int64_t{200003}}) {
      const std::vector<float> x(static_cast<size_t>(n), v);
      ExactSum by_term;
      for (float t : x) by_term.add(static_cast<double>(t) * static_cast<double>(t));
      EXPECT_TRUE(exact_sum_of_squares(x.data(), n) == by_term) << v << " x " << n;
    }
  }
}

TEST(ExactSum, CancellationRoundingAndRange) {
  EXPECT_EQ(sum_of({1e300, 1.0, -1e300}), 1.0);                   // a left fold in double gives 0
  const __float128 r = static_cast<__float128>(0.1) + 0.2 - 0.3;  // exact: the terms share a binade's grid
  EXPECT_EQ(bits(sum_of({0.1, 0.2, -0.3})), bits(static_cast<double>(r)));
  const double two53 = 9007199254740992.0;
  EXPECT_EQ(sum_of({two53, 1.0}), two53);                    // tie: to even
  EXPECT_EQ(sum_of({two53, 1.0, 1.0}), two53 + 2);           // exact
  EXPECT_EQ(sum_of({two53, 1.0, 0x1p-100}), two53 + 2);      // above the tie: up
  EXPECT_EQ(sum_of({two53 + 2, 1.0}), two53 + 4);            // tie from an odd significand: up to even
  EXPECT_EQ(sum_of({two53, 1.0, -0x1p-100}), two53);         // below the tie: down
  EXPECT_EQ(sum_of({-two53, -1.0, -0x1p-100}), -two53 - 2);  // negative, symmetric
  const double tiny = std::numeric_limits<double>::denorm_min();
  EXPECT_EQ(sum_of({tiny, tiny, tiny}), 3 * tiny);
  EXPECT_EQ(sum_of({0x1p-1022, -tiny}), 0x1p-1022 - tiny);  // normal minus subnormal: subnormal, exact
  EXPECT_EQ(sum_of({1.0, -1.0}), 0.0);
  EXPECT_FALSE(std::signbit(sum_of({-0.0, -0.0})));  // an exact zero is +0
  const double big = std::numeric_limits<double>::max();
  EXPECT_EQ(sum_of({big, big, -big}), big);  // no overflow inside the accumulator
  EXPECT_EQ(sum_of({big, big}), std::numeric_limits<double>::infinity());
  EXPECT_EQ(sum_of({-big, -big}), -std::numeric_limits<double>::infinity());
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(sum_of({1.0, inf}), inf);
  EXPECT_EQ(sum_of({1.0, -inf}), -inf);
  EXPECT_TRUE(std::isnan(sum_of({inf, -inf})));
  EXPECT_TRUE(std::isnan(sum_of({1.0, std::numeric_limits<double>::quiet_NaN()})));
  EXPECT_EQ(ExactSum().value(), 0.0);
}

TEST(ExactSum, SumOfSquaresIsExactAndThreadIndependent) {
  // Mixed magnitudes: normal values, large ones, and subnormal floats.
  std::vector<float> x = randn(300001, 8, "exact_sum/squares");
  for (size_t i = 0; i < x.size(); i += 97) x[i] *= 1e30f;
  for (size_t i = 5; i < x.size(); i += 101) x[i] = std::ldexp(x[i], -140);
  ExactSum by_term;
  long double ref = 0;
  for (float v : x) {
    by_term.add(static_cast<double>(v) * static_cast<double>(v));  // exact in double
    ref += static_cast<long double>(v) * v;
  }
  for (int threads : {1, 2, 3}) {
    with_threads(threads, [&] {
      const ExactSum s = exact_sum_of_squares(x.data(), static_cast<int64_t>(x.size()));
      EXPECT_EQ(bits(s.value()), bits(by_term.value())) << threads << " threads";
      // Any split of the buffer gives the same accumulator.
      ExactSum split = exact_sum_of_squares(x.data(), 12345);
      split.merge(exact_sum_of_squares(x.data() + 12345, static_cast<int64_t>(x.size()) - 12345));
      EXPECT_TRUE(split == s);
    });
  }
  const double got = by_term.value();
  EXPECT_LT(std::fabs(static_cast<long double>(got) - ref), 1e-15L * ref);
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> y = {1.0f, -inf, 2.0f};
  EXPECT_EQ(exact_sum_of_squares(y.data(), 3).value(), std::numeric_limits<double>::infinity());
  y[1] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(exact_sum_of_squares(y.data(), 3).value()));
  // A non-finite element in every bin set's turn, not only the first's.
  for (int64_t at = 0; at < 16; ++at) {
    std::vector<float> z(40, 0.5f);
    z[static_cast<size_t>(at)] = -inf;
    EXPECT_EQ(exact_sum_of_squares(z.data(), 40).value(), std::numeric_limits<double>::infinity()) << at;
  }
}

// The canonical tree by its definition, recursively.
float tree_reference(const std::vector<std::vector<float>>& x, size_t lo, size_t n, size_t i) {
  if (n == 1) return x[lo][i];
  const size_t p = static_cast<size_t>(canonical_split(static_cast<int64_t>(n)));
  return tree_reference(x, lo, p, i) + tree_reference(x, lo + p, n - p, i);
}

std::vector<std::vector<float>> leaves_of(int64_t L, int64_t n, uint64_t seed) {
  std::vector<std::vector<float>> x;
  for (int64_t l = 0; l < L; ++l) x.push_back(randn(n, seed, "tree/leaf" + std::to_string(l)));
  return x;
}

std::vector<float> tree_of(const std::vector<std::vector<float>>& x) {
  const int64_t L = static_cast<int64_t>(x.size()), n = static_cast<int64_t>(x[0].size());
  std::vector<const float*> p;
  for (const auto& v : x) p.push_back(v.data());
  std::vector<float> out(static_cast<size_t>(n));
  std::vector<float> stack(static_cast<size_t>(std::max<int64_t>(1, tree_sum_stack(L) * n)));
  tree_sum(out.data(), p.data(), L, n, stack.data());
  return out;
}

TEST(TreeSum, CanonicalSplitAndDefinition) {
  EXPECT_EQ(canonical_split(2), 1);
  EXPECT_EQ(canonical_split(3), 2);
  EXPECT_EQ(canonical_split(4), 2);
  EXPECT_EQ(canonical_split(5), 4);
  EXPECT_EQ(canonical_split(8), 4);
  EXPECT_EQ(canonical_split(9), 8);
  const int64_t n = 257;
  for (int64_t L = 1; L <= 13; ++L) {
    const auto x = leaves_of(L, n, 10 + static_cast<uint64_t>(L));
    const std::vector<float> got = tree_of(x);
    double worst = 0;
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(tree_reference(x, 0, x.size(), i)))
          << "L " << L << " element " << i;
      double ref = 0;
      for (const auto& v : x) ref += v[i];
      worst = std::max(worst, std::fabs(got[i] - ref));
    }
    EXPECT_LT(worst, 1e-5 * static_cast<double>(L)) << "L " << L;  // against double: rounding only
  }
}

// tree_sum_push one leaf at a time through one buffer, the last push writing the sum over the leaf
// it reads (out aliasing x, as the LM head's and attention's token segments use it): the tree's bits.
TEST(TreeSum, PushOneLeafAtATimeInPlaceEqualsTheTree) {
  const int64_t n = 67;
  for (int64_t L = 1; L <= 13; ++L) {
    const auto x = leaves_of(L, n, 500 + static_cast<uint64_t>(L));
    std::vector<float> leaf(static_cast<size_t>(n));
    std::vector<float> stack(static_cast<size_t>(std::max<int64_t>(1, tree_sum_stack(L) * n)));
    for (int64_t c = 0; c < L; ++c) {
      std::copy(x[c].begin(), x[c].end(), leaf.begin());
      tree_sum_push(leaf.data(), leaf.data(), c, c + 1 == L, n, stack.data());
    }
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(std::bit_cast<uint32_t>(leaf[i]), std::bit_cast<uint32_t>(tree_reference(x, 0, x.size(), i)))
          << "L " << L << " element " << i;
  }
}

// tree_sum_push_block: the leaves cut greedily into aligned power-of-two blocks (at most `cap` leaves
// each, as the LM head's weight gradient cuts its segments into chunks), each block's tree pushed as
// one, and over element ranges cut anywhere (the threads' shares): the tree's bits over all L. The
// stack holds only the levels of the smallest block and up (first_level), as the head allocates it.
TEST(TreeSum, PushAlignedBlocksOverRangesEqualsTheTree) {
  const int64_t n = 1024 + 300;
  for (int64_t L = 1; L <= 19; ++L)
    for (int64_t cap : {1, 2, 4, 8, 16}) {
      const auto x = leaves_of(L, n, 900 + static_cast<uint64_t>(L * 17 + cap));
      std::vector<std::pair<int64_t, int64_t>> blocks;  // (first leaf, leaves)
      for (int64_t c = 0, count = 1; c < L; c += count) {
        count = 1;
        while (c % (2 * count) == 0 && c + 2 * count <= L && 2 * count <= cap) count *= 2;
        blocks.emplace_back(c, count);
      }
      int first_level = 64;
      for (const auto& [c, count] : blocks)
        first_level = std::min(first_level, std::countr_zero(static_cast<uint64_t>(count)));
      const int64_t levels = std::max<int64_t>(0, tree_sum_stack(L) - first_level);
      std::vector<float> block(static_cast<size_t>(n));
      // The stack between two guard buffers, which must come out untouched.
      std::vector<float> guarded(static_cast<size_t>((levels + 2) * n), 12345.0f);
      float* stack = guarded.data() + n;
      std::vector<float> scratch(static_cast<size_t>(std::max<int64_t>(1, tree_sum_stack(cap) * n)));
      for (const auto& [c, count] : blocks) {
        std::vector<const float*> p;
        for (int64_t k = c; k < c + count; ++k) p.push_back(x[static_cast<size_t>(k)].data());
        tree_sum(block.data(), p.data(), count, n, scratch.data());
        const int level = std::countr_zero(static_cast<uint64_t>(count));
        for (const auto& [b, e] : {std::pair<int64_t, int64_t>{0, 5}, {5, 1030}, {1030, n}})
          tree_sum_push_block(block.data(), block.data(), c, level, c + count == L, n, stack, first_level, b, e);
      }
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(guarded[static_cast<size_t>(i)], 12345.0f) << "L " << L << " cap " << cap << ": below the stack";
        ASSERT_EQ(guarded[static_cast<size_t>((levels + 1) * n + i)], 12345.0f)
            << "L " << L << " cap " << cap << ": above it";
      }
      for (int64_t i = 0; i < n; ++i)
        ASSERT_EQ(std::bit_cast<uint32_t>(block[i]), std::bit_cast<uint32_t>(tree_reference(x, 0, x.size(), i)))
            << "L " << L << " blocks of at most " << cap << " element " << i;
    }
}

// Past several blocks of tree_sum (16,384 elements) and of its passes (1,024; the last block partial) and with the
// root written over any one leaf (combine_token_pieces writes it over the rank's own piece 0, which
// can be the first, a middle or the last leaf): still the tree's bits.
TEST(TreeSum, ManyBlocksAndRootOverAnyLeafEqualTheTree) {
  const int64_t n = 2 * 16384 + 77;  // past tree_sum's element blocks and the fold's
  for (int64_t L : {1, 2, 3, 7, 8, 13, 16}) {
    const auto x = leaves_of(L, n, 700 + static_cast<uint64_t>(L));
    std::vector<float> want(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i)
      want[static_cast<size_t>(i)] = tree_reference(x, 0, x.size(), static_cast<size_t>(i));
    std::vector<float> stack(static_cast<size_t>(std::max<int64_t>(1, tree_sum_stack(L) * n)));
    for (int64_t over : {int64_t{-1}, int64_t{0}, L / 2, L - 1}) {  // -1: a separate output
      auto leaves = x;
      std::vector<const float*> p;
      for (const auto& v : leaves) p.push_back(v.data());
      std::vector<float> separate(static_cast<size_t>(n));
      float* out = over < 0 ? separate.data() : leaves[static_cast<size_t>(over)].data();
      tree_sum(out, p.data(), L, n, stack.data());
      for (int64_t i = 0; i < n; ++i)
        ASSERT_EQ(std::bit_cast<uint32_t>(out[i]), std::bit_cast<uint32_t>(want[static_cast<size_t>(i)]))
            << "L " << L << " root over leaf " << over << " element " << i;
    }
  }
}

// The in-place form (the segmented GEMMs' combiner): leaves a stride apart, summed over ranges
// [begin, end) cut anywhere, gives leaf 0 the tree's bits there and leaves other elements alone.
TEST(TreeSum, InPlaceOverRangesEqualsTheTree) {
  const int64_t n = 101, stride = 128;
  for (int64_t L = 1; L <= 11; ++L) {
    const auto x = leaves_of(L, n, 300 + static_cast<uint64_t>(L));
    const std::vector<float> want = tree_of(x);
    std::vector<float> packed(static_cast<size_t>(L * stride), 7.0f);
    for (int64_t l = 0; l < L; ++l) std::copy(x[l].begin(), x[l].end(), packed.begin() + l * stride);
    for (const auto& [b, e] : {std::pair<int64_t, int64_t>{0, 37}, {37, 38}, {38, n}})
      tree_sum_in_place(packed.data(), L, stride, b, e);
    EXPECT_TRUE(testing::bitwise_equal(std::vector<float>(packed.begin(), packed.begin() + n), want)) << "L " << L;
    for (int64_t l = 0; l < L; ++l)
      for (int64_t i = n; i < stride; ++i) ASSERT_EQ(packed[l * stride + i], 7.0f) << "L " << L;
  }
}

// D ranks with A (a power of two) consecutive leaves each: summing each rank's block along the
// canonical tree, then the D block sums along the canonical tree over D, is the tree over all.
TEST(TreeSum, PowerOfTwoBlocksAreSubtrees) {
  const int64_t n = 64;
  for (int64_t A : {1, 2, 4, 8})
    for (int64_t D = 1; D <= 7; ++D) {
      const auto x = leaves_of(D * A, n, 100 + static_cast<uint64_t>(D * A));
      std::vector<std::vector<float>> blocks;
      for (int64_t d = 0; d < D; ++d)
        blocks.push_back(tree_of(std::vector<std::vector<float>>(x.begin() + d * A, x.begin() + (d + 1) * A)));
      EXPECT_TRUE(testing::bitwise_equal(tree_of(blocks), tree_of(x))) << "D " << D << " x A " << A;
    }
  // A block that is not a power of two is not a subtree: 2 x 3 differs from the tree over 6.
  const auto x = leaves_of(6, n, 200);
  const std::vector<std::vector<float>> halves = {tree_of({x[0], x[1], x[2]}), tree_of({x[3], x[4], x[5]})};
  EXPECT_FALSE(testing::bitwise_equal(tree_of(halves), tree_of(x)));
}

// The nodes of the canonical tree over leaves [lo, hi), by its definition.
void nodes_of(std::vector<std::pair<int64_t, int64_t>>& out, int64_t lo, int64_t hi) {
  out.push_back({lo, hi});
  if (hi - lo == 1) return;
  const int64_t p = lo + canonical_split(hi - lo);
  nodes_of(out, lo, p);
  nodes_of(out, p, hi);
}

// Every block [a, b) of every tree over L = 1..17 leaves: its canonical pieces are nodes of the
// tree, cover the block in order, and are maximal (no node holding one of them lies in the block);
// and the tree over L evaluated over the pieces of the blocks [0, a), [a, b), [b, L) (PieceTree)
// gives the tree's bits.
TEST(TreeSum, BlocksAreTheirCanonicalPieces) {
  const int64_t n = 33;
  for (int64_t L = 1; L <= 17; ++L) {
    std::vector<std::pair<int64_t, int64_t>> nodes;
    nodes_of(nodes, 0, L);
    auto is_node = [&](int64_t lo, int64_t hi) {
      return std::find(nodes.begin(), nodes.end(), std::pair{lo, hi}) != nodes.end();
    };
    const auto x = leaves_of(L, n, 500 + static_cast<uint64_t>(L));
    const std::vector<float> want = tree_of(x);
    for (int64_t a = 0; a < L; ++a)
      for (int64_t b = a + 1; b <= L; ++b) {
        const std::vector<int64_t> p = canonical_pieces(L, a, b);
        ASSERT_GE(p.size(), 2u);
        EXPECT_EQ(p.front(), a);
        EXPECT_EQ(p.back(), b);
        EXPECT_LE(static_cast<int64_t>(p.size()) - 1, 2 * std::bit_width(static_cast<uint64_t>(L)));
        for (size_t k = 0; k + 1 < p.size(); ++k) {
          ASSERT_LT(p[k], p[k + 1]);
          EXPECT_TRUE(is_node(p[k], p[k + 1])) << "L " << L << " [" << a << ", " << b << ") piece " << k;
          for (const auto& [lo, hi] : nodes)
            EXPECT_FALSE(lo <= p[k] && p[k + 1] <= hi && hi - lo > p[k + 1] - p[k] && a <= lo && hi <= b)
                << "L " << L << " [" << a << ", " << b << ") piece " << k << " is inside node [" << lo << ", " << hi
                << ")";
        }
        // The pieces of [0, a), [a, b), [b, L), each summed along its own tree, then PieceTree.
        std::vector<int64_t> bounds{0};
        for (const auto& [lo, hi] : {std::pair{int64_t{0}, a}, std::pair{a, b}, std::pair{b, L}}) {
          if (lo == hi) continue;
          const std::vector<int64_t> q = canonical_pieces(L, lo, hi);
          bounds.insert(bounds.end(), q.begin() + 1, q.end());
        }
        std::vector<std::vector<float>> sums;
        std::vector<const float*> at;
        for (size_t k = 0; k + 1 < bounds.size(); ++k)
          sums.push_back(tree_of(std::vector<std::vector<float>>(x.begin() + bounds[k], x.begin() + bounds[k + 1])));
        for (const auto& v : sums) at.push_back(v.data());
        const PieceTree tree(L, bounds);
        EXPECT_EQ(tree.pieces(), static_cast<int>(sums.size()));
        std::vector<float> got(n), scratch(static_cast<size_t>(tree.scratch_size() * n + 1));
        tree.sum(got.data(), at.data(), n, scratch.data());
        EXPECT_TRUE(testing::bitwise_equal(got, want)) << "L " << L << " [" << a << ", " << b << ")";
        // In place, into the last piece.
        tree.sum(sums.back().data(), at.data(), n, scratch.data());
        EXPECT_TRUE(testing::bitwise_equal(sums.back(), want)) << "L " << L << " [" << a << ", " << b << ") in place";
      }
  }
  // Pieces that are not subtrees are refused: 3 + 3 leaves of a tree over 6.
  EXPECT_THROW(PieceTree(6, {0, 3, 6}), std::exception);
}

TEST(MicroBatchTree, StreamingRangeByRangeEqualsTheTree) {
  const int64_t n = 5000;
  for (int64_t L : {1, 2, 3, 6, 8, 11}) {
    const auto x = leaves_of(L, n, 300 + static_cast<uint64_t>(L));
    const std::vector<float> expected = tree_of(x);
    for (int threads : {1, 3}) {
      with_threads(threads, [&] {
        const std::unique_ptr<Device> cpu = Device::cpu();
        MicroBatchTree tree;
        tree.reset(*cpu, n, L);
        std::vector<float> buf(static_cast<size_t>(n));
        for (int64_t l = 0; l < L; ++l) {
          // The leaf is accumulated into a zeroed buffer and pushed in uneven ranges, last first
          // (as backward reports parameters).
          for (int64_t i = 0; i < n; ++i) {
            if (l > 0) {
              ASSERT_EQ(buf[i], 0.0f) << "not zeroed after leaf " << l - 1;
            }
            buf[i] += x[l][i];
          }
          const int64_t cuts[] = {n, 4000, 1234, 17, 0};
          for (int k = 0; k + 1 < 5; ++k) tree.push(l, buf.data(), cuts[k + 1], cuts[k]);
        }
        EXPECT_TRUE(testing::bitwise_equal(buf, expected)) << "L " << L << ", " << threads << " threads";
      });
    }
  }
}

// Streaming with pieces: a rank's block of leaves pushed in order leaves each piece's tree sum in
// piece(k) and the last one's in the buffer (DataParallel's pieced layout mode).
TEST(MicroBatchTree, StreamingPiecesEqualTheirTrees) {
  const int64_t n = 3000;
  for (const auto& [L, a, b] :
       {std::tuple<int64_t, int64_t, int64_t>{9, 0, 3}, {9, 3, 6}, {9, 6, 9}, {10, 5, 10}, {13, 1, 12}, {6, 2, 4}})
    for (int threads : {1, 3})
      with_threads(threads, [&] {
        const auto x = leaves_of(L, n, 700 + static_cast<uint64_t>(L * 31 + a));
        std::vector<int64_t> bounds = canonical_pieces(L, a, b);
        for (int64_t& v : bounds) v -= a;
        const std::unique_ptr<Device> cpu = Device::cpu();
        MicroBatchTree tree;
        tree.reset(*cpu, n, bounds);
        ASSERT_EQ(tree.pieces(), static_cast<int64_t>(bounds.size()) - 1);
        std::vector<float> buf(static_cast<size_t>(n), 0.0f);
        for (int64_t l = 0; l < b - a; ++l) {
          for (int64_t i = 0; i < n; ++i) {
            ASSERT_EQ(buf[i], 0.0f) << "not zeroed after leaf " << l - 1;
            buf[i] += x[a + l][i];
          }
          const int64_t cuts[] = {n, 2000, 17, 0};
          for (int k = 0; k + 1 < 4; ++k) tree.push(l, buf.data(), cuts[k + 1], cuts[k]);
        }
        auto piece_tree = [&](size_t k) {
          return tree_of(std::vector<std::vector<float>>(x.begin() + a + bounds[k], x.begin() + a + bounds[k + 1]));
        };
        const size_t K = bounds.size() - 1;
        for (size_t k = 0; k + 1 < K; ++k)
          EXPECT_TRUE(testing::bitwise_equal(std::vector<float>(tree.piece(k), tree.piece(k) + n), piece_tree(k)))
              << "L " << L << " [" << a << ", " << b << ") piece " << k;
        EXPECT_TRUE(testing::bitwise_equal(buf, piece_tree(K - 1)))
            << "L " << L << " [" << a << ", " << b << ") last piece";
      });
}

}  // namespace
}  // namespace lockstep
