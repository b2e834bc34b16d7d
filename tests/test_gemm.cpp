#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "lockstep/core/error.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/core/tree_sum.h"
#include "lockstep/kernels/cpu/gemm.h"
#include "lockstep/kernels/cpu/grouped_gemm.h"
#include "lockstep/kernels/cpu/quantize.h"
#include "testing.h"

namespace lockstep {
namespace {

using testing::bitwise_equal;

// Operands of one GEMM with padded leading dimensions, so that a kernel reading or writing past a
// row's end is caught (the padding of C holds a sentinel that must survive).
struct Case {
  int64_t M, N, K;
  Trans ta, tb;
  int64_t lda, ldb, ldc;
  std::vector<float> A, B, C0, bias;

  Case(int64_t M_, int64_t N_, int64_t K_, Trans ta_, Trans tb_, uint64_t seed, int64_t pad = 3)
      : M(M_), N(N_), K(K_), ta(ta_), tb(tb_) {
    lda = (ta == Trans::N ? K : M) + pad;
    ldb = (tb == Trans::N ? N : K) + pad;
    ldc = N + pad;
    A = testing::randn((ta == Trans::N ? M : K) * lda, seed, "A");
    B = testing::randn((tb == Trans::N ? K : N) * ldb, seed, "B");
    C0 = testing::randn(M * ldc, seed, "C");
    bias = testing::randn(N, seed, "bias");
  }
  float a(int64_t i, int64_t k) const { return ta == Trans::N ? A[i * lda + k] : A[k * lda + i]; }
  float b(int64_t k, int64_t j) const { return tb == Trans::N ? B[k * ldb + j] : B[j * ldb + k]; }

  std::vector<float> run(const GemmOptions& opt, bool portable = false) const {
    std::vector<float> C = C0;
    if (portable) {
      detail::gemm_portable(C.data(), ldc, A.data(), lda, ta, B.data(), ldb, tb, M, N, K, opt);
    } else {
      gemm(C.data(), ldc, A.data(), lda, ta, B.data(), ldb, tb, M, N, K, opt);
    }
    return C;
  }

  // The contract of gemm.h, literally: one fma chain per element over k in [k0, k1).
  float chain(int64_t i, int64_t j, float acc, int64_t k0, int64_t k1) const {
    for (int64_t k = k0; k < k1; ++k) acc = std::fma(a(i, k), b(k, j), acc);
    return acc;
  }
  float init(int64_t i, int64_t j, const GemmOptions& opt) const {
    return opt.accumulate ? C0[i * ldc + j] : opt.bias ? opt.bias[j] : 0.0f;
  }
  std::vector<float> reference(const GemmOptions& opt) const {
    std::vector<float> C = C0;
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t j = 0; j < N; ++j) {
        float v;
        if (opt.k_segments.empty()) {
          v = chain(i, j, init(i, j, opt), 0, K);
        } else {
          // The canonical tree over the segments' chains (core/tree_sum.h), written out
          // recursively, then added to the init (none: -0, the identity). A segment's chain runs
          // over its part of each section in turn (one section: all of K).
          const std::vector<int64_t> whole = {K};
          const std::vector<int64_t> sections = opt.k_sections.empty()
                                                    ? whole
                                                    : std::vector<int64_t>(opt.k_sections.begin(), opt.k_sections.end());
          const size_t S = opt.k_segments.size() / sections.size() - 1;
          const auto leaf = [&](size_t s) {
            float acc = 0.0f;
            int64_t at = 0;
            for (size_t q = 0; q < sections.size(); ++q) {
              acc = chain(i, j, acc, at + opt.k_segments[q * (S + 1) + s], at + opt.k_segments[q * (S + 1) + s + 1]);
              at += sections[q];
            }
            return acc;
          };
          const std::function<float(size_t, size_t)> tree = [&](size_t s0, size_t s1) -> float {
            if (s1 - s0 == 1) return leaf(s0);
            return tree(s0, s0 + static_cast<size_t>(canonical_split(static_cast<int64_t>(s1 - s0)))) +
                   tree(s0 + static_cast<size_t>(canonical_split(static_cast<int64_t>(s1 - s0))), s1);
          };
          v = (opt.accumulate || opt.bias ? init(i, j, opt) : -0.0f) + tree(0, S);
        }
        C[i * ldc + j] = v;
      }
    }
    return C;
  }
  std::vector<double> reference_double(const GemmOptions& opt) const {
    std::vector<double> C(C0.begin(), C0.end());
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t j = 0; j < N; ++j) {
        double acc = init(i, j, opt);
        for (int64_t k = 0; k < K; ++k) acc += double(a(i, k)) * double(b(k, j));
        C[i * ldc + j] = acc;
      }
    }
    return C;
  }
  std::string name() const {
    return str(M, "x", N, "x", K, ta == Trans::N ? " N" : " T", tb == Trans::N ? "N" : "T");
  }
};

const Trans kTrans[] = {Trans::N, Trans::T};

// One gemm_batch of the cases (options: init and k_segments) gives each its reference's bits, for
// 1, 2 and 3 threads.
void batch_matches_reference(const std::vector<Case>& cases, const std::vector<GemmOptions>& opts) {
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    ThreadPool::Bind bind(&pool);
    std::vector<std::vector<float>> out;
    std::vector<GemmBatchItem> items;
    for (const Case& c : cases) out.push_back(c.C0);
    for (size_t i = 0; i < cases.size(); ++i) {
      const Case& c = cases[i];
      GemmBatchItem it{out[i].data(), c.ldc, c.A.data(), c.lda, c.ta, c.B.data(), c.ldb, c.tb, c.M, c.N, c.K};
      it.accumulate = opts[i].accumulate;
      it.bias = opts[i].bias;
      it.k_segments = opts[i].k_segments;
      it.k_sections = opts[i].k_sections;
      items.push_back(it);
    }
    gemm_batch(items.data(), static_cast<int64_t>(items.size()));
    for (size_t i = 0; i < cases.size(); ++i)
      ASSERT_TRUE(bitwise_equal(out[i], cases[i].reference(opts[i]), cases[i].name() + str(" item ", i, " threads ", threads)));
  }
}


TEST(Gemm, MatchesFmaChainAndDoubleReference) {
  const int64_t sizes[] = {1, 5, 17, 67, 130};
  for (Trans ta : kTrans) {
    for (Trans tb : kTrans) {
      for (int64_t M : sizes) {
        for (int64_t N : sizes) {
          for (int64_t K : sizes) {
            const Case c(M, N, K, ta, tb, 1);
            const std::vector<float> got = c.run({});
            ASSERT_TRUE(bitwise_equal(got, c.reference({}), c.name()));
            ASSERT_TRUE(testing::all_close(got, c.reference_double({}), 1e-5, 2e-6 * K, c.name()));
          }
        }
      }
    }
  }
}

// Shapes that cross every cache block (K blocks, several M blocks, several N blocks) and edges.
TEST(Gemm, CrossesCacheBlocks) {
  const int64_t shapes[][3] = {{300, 37, 700}, {7, 4500, 3}, {45, 70, 1100}};
  for (const auto& s : shapes) {
    for (Trans ta : kTrans) {
      for (Trans tb : kTrans) {
        const Case c(s[0], s[1], s[2], ta, tb, 2);
        GemmOptions opt;
        opt.accumulate = true;
        ASSERT_TRUE(bitwise_equal(c.run(opt), c.reference(opt), c.name()));
      }
    }
  }
}

TEST(Gemm, AccumulateAndBias) {
  for (Trans ta : kTrans) {
    for (Trans tb : kTrans) {
      const Case c(67, 130, 17, ta, tb, 3);
      GemmOptions acc;
      acc.accumulate = true;
      ASSERT_TRUE(bitwise_equal(c.run(acc), c.reference(acc), c.name() + " accumulate"));
      ASSERT_TRUE(testing::all_close(c.run(acc), c.reference_double(acc), 1e-5, 1e-4));
      GemmOptions bias;
      bias.bias = c.bias.data();
      ASSERT_TRUE(bitwise_equal(c.run(bias), c.reference(bias), c.name() + " bias"));
      // accumulate wins over bias: init is C.
      GemmOptions both = acc;
      both.bias = c.bias.data();
      ASSERT_TRUE(bitwise_equal(c.run(both), c.reference(acc), c.name() + " both"));
    }
  }
}

TEST(Gemm, EmptyKWritesInit) {
  const Case c(5, 17, 0, Trans::N, Trans::T, 4);
  for (const bool accumulate : {false, true}) {
    for (const bool bias : {false, true}) {
      GemmOptions opt;
      opt.accumulate = accumulate;
      opt.bias = bias ? c.bias.data() : nullptr;
      ASSERT_TRUE(bitwise_equal(c.run(opt), c.reference(opt)));
    }
  }
}

// Segments over K (a row-parallel layer), and over sections (a fused projection's input gradient:
// segment s's chain runs over its part of each section in turn); empty parts and an empty segment
// included; segment counts that are not powers of two (the streamed tree holds several subtrees at
// the last one); output rows wider than the combiner's block; 1 and 3 threads.
// Without an init the segmented product is the tree itself: a -0 (an underflowing negative
// product) stays -0, as the sum over ranks of -0 parts keeps it. Edge tiles (4 x 3) and whole
// ones (12 x 128: the tiles of every kernel, whose last segment stores to C from its epilogue), on
// every kernel.
TEST(Gemm, KSegmentsKeepNegativeZero) {
  const std::vector<int64_t> segments = {0, 2, 4, 6, 8};
  GemmOptions opt;
  opt.k_segments = segments;
  for (const auto& [M, N] : {std::pair<int64_t, int64_t>{4, 3}, {12, 128}})
    for (const std::string& kernel : detail::gemm_kernels()) {
      const std::vector<float> A(static_cast<size_t>(M * 8), 1e-30f), B(static_cast<size_t>(8 * N), -1e-30f);
      std::vector<float> C(static_cast<size_t>(M * N), 1.0f);
      detail::gemm_with_kernel(kernel, C.data(), N, A.data(), 8, Trans::N, B.data(), N, Trans::N, M, N, 8, opt);
      for (float v : C)
        ASSERT_EQ(std::bit_cast<uint32_t>(v), std::bit_cast<uint32_t>(-0.0f)) << kernel << " " << M << " x " << N;
    }
}

// k_segments (and k_sections): the canonical tree over the segments' chains plus the init, as the
// reference writes it out. The product runs in one pass (every segment's chain and the tree per
// tile) up to 128 segments and K up to 4 kernel K blocks, segment by segment past that: both give
// the reference's bits on every micro-kernel and for 3 threads, with several rectangles per
// thread, sections, empty segments, 12 (not a power of two) segments and K = 0.
TEST(Gemm, KSegments) {
  struct Layout {
    int64_t M, N, K;
    std::vector<int64_t> sections, segments;
  };
  std::vector<int64_t> many(131);  // 130 segments: past the one-pass limit
  for (int64_t s = 0; s <= 130; ++s) many[s] = s * 260 / 130;
  std::vector<int64_t> long_k = {0, 1000, 1000, 2500, 4000};  // K = 4000 > 4 x 768 (and 4 x 512)
  const std::vector<Layout> layouts = {
      {17, 67, 130, {}, {0, 40, 40, 77, 130}},
      {17, 67, 130, {50, 30, 50}, {0, 12, 25, 37, 50, /**/ 0, 7, 7, 22, 30, /**/ 0, 12, 25, 25, 50}},
      {17, 67, 130, {}, {0, 130}},
      {17, 300, 130, {}, {0, 9, 30, 31, 77, 90, 130}},
      {17, 67, 130, {}, {0, 5, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 130}},
      {70, 150, 96, {}, {0, 12, 24, 36, 48, 60, 72, 84, 96}},
      {9, 70, 100, {60, 40}, {0, 0, 20, 60, /**/ 0, 10, 40, 40}},
      {9, 70, 260, {}, many},
      {9, 33, 4000, {}, long_k},
      {5, 7, 0, {}, {0, 0, 0}},
      {5, 7, 0, {0, 0}, {0, 0, 0, /**/ 0, 0, 0}},
  };
  const std::vector<std::string> kernels = detail::gemm_kernels();
  uint64_t seed = 40;
  for (const Layout& l : layouts) {
    for (Trans ta : kTrans) {
      for (Trans tb : kTrans) {
        const Case c(l.M, l.N, l.K, ta, tb, seed++);
        for (int mode = 0; mode < 3; ++mode) {
          GemmOptions opt;
          opt.k_segments = l.segments;
          opt.k_sections = l.sections;
          opt.accumulate = mode == 1;
          opt.bias = mode == 2 ? c.bias.data() : nullptr;
          const std::vector<float> ref = c.reference(opt);
          const std::string what = c.name() + str(" mode ", mode, " segments ", l.segments.size());
          for (const std::string& k : kernels) {
            std::vector<float> C = c.C0;
            detail::gemm_with_kernel(k, C.data(), c.ldc, c.A.data(), c.lda, ta, c.B.data(), c.ldb, tb, c.M, c.N, c.K,
                                     opt);
            ASSERT_TRUE(bitwise_equal(C, ref, what + " " + k));
          }
          testing::with_threads(3, [&] { ASSERT_TRUE(bitwise_equal(c.run(opt), ref, what + " 3 threads")); });
        }
      }
    }
  }
}

// Segmented items of a batch (the grouped GEMMs of determinism = "layout") give their own gemm()
// reference's bits, next to plain items, in one pass or past its limits, for any thread count.
TEST(Gemm, BatchOfSegmentedItems) {
  const std::vector<int64_t> seg8 = {0, 4, 9, 9, 15, 20, 26, 30, 37}, seg3 = {0, 1, 2, 3}, one = {0, 37};
  const std::vector<int64_t> seg_long = {0, 1000, 4000}, seg_empty = {0, 0, 0, 0, 0};
  struct Item {
    int64_t M, N, K;
    const std::vector<int64_t>* segments;
  };
  const std::vector<Item> shapes = {{211, 150, 37, &seg8}, {64, 64, 37, &seg8}, {3, 5, 3, &seg3},
                                    {17, 19, 37, nullptr}, {6, 9, 37, &one},     {7, 20, 4000, &seg_long},
                                    {6, 9, 0, &seg_empty}, {0, 9, 37, &seg8}};
  std::vector<Case> cases;
  cases.reserve(4 * shapes.size());  // opts point into the cases
  std::vector<GemmOptions> opts;
  uint64_t seed = 60;
  for (Trans ta : kTrans) {
    for (Trans tb : kTrans) {
      for (const Item& s : shapes) {
        cases.emplace_back(s.M, s.N, s.K, ta, tb, seed++);
        GemmOptions o;
        o.accumulate = seed % 3 == 0;
        if (seed % 3 == 1) o.bias = cases.back().bias.data();
        if (s.segments) o.k_segments = *s.segments;
        opts.push_back(o);
      }
    }
  }
  batch_matches_reference(cases, opts);
}

// Every micro-kernel this machine runs (AVX-512, AVX2, portable) gives the chain's exact bits,
// also across K blocks and edge tiles.
TEST(Gemm, EveryKernelSameBits) {
  const std::vector<std::string> kernels = detail::gemm_kernels();
  ASSERT_EQ(kernels.front(), gemm_kernel_name());
  ASSERT_EQ(kernels.back(), "portable");
  const int64_t shapes[][3] = {{67, 130, 17}, {130, 67, 800}, {1, 5, 1}};
  for (const auto& s : shapes) {
    for (Trans ta : kTrans) {
      for (Trans tb : kTrans) {
        const Case c(s[0], s[1], s[2], ta, tb, 6);
        GemmOptions opt;
        opt.bias = c.bias.data();
        const std::vector<float> ref = c.reference(opt);
        for (const std::string& k : kernels) {
          std::vector<float> C = c.C0;
          detail::gemm_with_kernel(k, C.data(), c.ldc, c.A.data(), c.lda, ta, c.B.data(), c.ldb, tb,
                                   c.M, c.N, c.K, opt);
          ASSERT_TRUE(bitwise_equal(C, ref, c.name() + " " + k));
        }
        ASSERT_TRUE(bitwise_equal(c.run(opt, true), ref, c.name() + " gemm_portable"));
      }
    }
  }
}

TEST(Gemm, SameBitsForAnyThreadCount) {
  for (Trans ta : kTrans) {
    for (Trans tb : kTrans) {
      // Large enough to be split across threads, odd enough to give uneven splits.
      const Case c(131, 173, 67, ta, tb, 7);
      GemmOptions opt;
      opt.accumulate = true;
      std::vector<float> one;
      for (int threads : {1, 2, 3}) {
        ThreadPool pool(threads);
        ThreadPool::Bind bind(&pool);
        const std::vector<float> got = c.run(opt);
        if (threads == 1) {
          one = got;
          ASSERT_TRUE(bitwise_equal(got, c.reference(opt), c.name()));
        } else {
          ASSERT_TRUE(bitwise_equal(got, one, c.name() + str(" threads ", threads)));
        }
      }
    }
  }
}

// Accumulating over [0, K1) then [K1, K) equals one call over [0, K): gradients summed over
// micro-batches equal the gradient of the concatenated batch.
TEST(Gemm, AccumulateSplitAlongK) {
  for (Trans ta : kTrans) {
    for (Trans tb : kTrans) {
      const Case c(17, 130, 67, ta, tb, 8);
      GemmOptions opt;
      opt.accumulate = true;
      const std::vector<float> whole = c.run(opt);
      const int64_t K1 = 29;
      std::vector<float> C = c.C0;
      const float* A = c.A.data();
      const float* B = c.B.data();
      gemm(C.data(), c.ldc, A, c.lda, ta, B, c.ldb, tb, c.M, c.N, K1, opt);
      gemm(C.data(), c.ldc, A + (ta == Trans::N ? K1 : K1 * c.lda), c.lda, ta,
           B + (tb == Trans::N ? K1 * c.ldb : K1), c.ldb, tb, c.M, c.N, c.K - K1, opt);
      ASSERT_TRUE(bitwise_equal(C, whole, c.name()));
    }
  }
}

// A batch gives each item the bits of its own gemm() call (the FMA-chain reference), whatever the
// thread count, with items of every transpose and init, empty items, and items large enough to be
// cut into several rectangles.
TEST(Gemm, BatchEqualsOneGemmPerItem) {
  std::vector<Case> cases;
  std::vector<GemmOptions> opts;
  uint64_t seed = 20;
  for (Trans ta : kTrans) {
    for (Trans tb : kTrans) {
      cases.emplace_back(211, 307, 67, ta, tb, seed++);  // ~4M FMAs: several rectangles
      cases.emplace_back(5, 17, 33, ta, tb, seed++);
      cases.emplace_back(0, 9, 4, ta, tb, seed++);        // no rows (an expert without tokens)
      cases.emplace_back(6, 9, 0, ta, tb, seed++);        // K = 0: C = init
    }
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    GemmOptions o;
    o.accumulate = i % 3 == 0;
    if (i % 3 == 1) o.bias = cases[i].bias.data();
    opts.push_back(o);
  }
  batch_matches_reference(cases, opts);
}

TEST(Gemm, ContiguousOverload) {
  const Case c(5, 17, 67, Trans::T, Trans::N, 9, 0);
  std::vector<float> C(c.M * c.N);
  gemm(C.data(), c.A.data(), c.ta, c.B.data(), c.tb, c.M, c.N, c.K);
  ASSERT_TRUE(bitwise_equal(C, c.reference({})));
}


// ---- Operands in low precision (bf16, FP8, MXFP8, NVFP4): decoded while packing, the result must
// equal the fp32 GEMM on the dequantised matrices bit for bit.

enum class Storage { f32, bf16, e4m3_tensor, e5m2_block, mxfp8, nvfp4, nvfp4_2d, e4m3_column_block };
const Storage kStorages[] = {Storage::f32,  Storage::bf16,  Storage::e4m3_tensor, Storage::e5m2_block,
                             Storage::mxfp8, Storage::nvfp4, Storage::nvfp4_2d,   Storage::e4m3_column_block};

// A stored rows x cols matrix in one storage, and the fp32 matrix it stands for.
struct StoredOperand {
  std::vector<float> dense;  // what the operand stands for (dequantised / widened), rows x cols
  std::vector<bf16> half;
  QuantizedTensor q;
  Storage storage;
  int64_t cols;
  StoredOperand(Storage st, int64_t rows, int64_t cols_, uint64_t seed) : storage(st), cols(cols_) {
    std::vector<float> x = testing::randn(rows * cols, seed, "operand");
    dense.resize(x.size());
    switch (st) {
      case Storage::f32: dense = x; return;
      case Storage::bf16:
        for (float v : x) half.push_back(to_bf16(v));
        for (size_t i = 0; i < x.size(); ++i) dense[i] = to_f32(half[i]);
        return;
      case Storage::e4m3_tensor:
        quantize_tensorwise(q, x.data(), rows, cols, ElemFormat::e4m3, fp8_scale_from_amax(amax(x.data(), rows * cols), ElemFormat::e4m3));
        break;
      case Storage::e5m2_block: quantize_blockwise(q, x.data(), rows, cols, ElemFormat::e5m2, 1, 128); break;
      case Storage::e4m3_column_block:  // 128 x 1 blocks: a scale per column, columns of 5 magnitudes
        for (int64_t i = 0; i < rows * cols; ++i) x[i] = std::ldexp(x[i], static_cast<int>(i % cols % 5) * 3);
        quantize_blockwise(q, x.data(), rows, cols, ElemFormat::e4m3, 128, 1);
        break;
      case Storage::mxfp8: quantize_mxfp8(q, x.data(), rows, cols, ElemFormat::e4m3); break;
      case Storage::nvfp4: quantize_nvfp4(q, x.data(), rows, cols, 1); break;
      case Storage::nvfp4_2d: quantize_nvfp4(q, x.data(), rows, cols, 16); break;
    }
    dequantize(dense.data(), q);
  }
  GemmOperand operand(Trans t) const {
    if (storage == Storage::f32) return gemm_operand(dense.data(), cols, t);
    if (storage == Storage::bf16) return gemm_operand(half.data(), cols, t);
    return gemm_operand(q, t);
  }
};

TEST(GemmOperands, EqualTheFp32GemmOnTheDequantisedOperands) {
  const int64_t M = 37, N = 45, K = 600;  // edge tiles, and K crosses a cache block
  const std::vector<int64_t> segments = {0, 100, 333, 600};
  int checked = 0;
  for (size_t ia = 0; ia < std::size(kStorages); ++ia) {
    for (size_t ib = 0; ib < std::size(kStorages); ++ib) {
      // Every storage on each side against f32 and against itself, and a few mixed pairs.
      if (!(ia == 0 || ib == 0 || ia == ib || (ia + ib) % 3 == 0)) continue;
      for (Trans ta : {Trans::N, Trans::T}) {
        for (Trans tb : {Trans::N, Trans::T}) {
          const StoredOperand A(kStorages[ia], ta == Trans::N ? M : K, ta == Trans::N ? K : M, 100 + ia);
          const StoredOperand B(kStorages[ib], tb == Trans::N ? K : N, tb == Trans::N ? N : K, 200 + ib);
          const std::vector<float> C0 = testing::randn(M * N, 3, "C0"), bias = testing::randn(N, 3, "bias");
          GemmOptions plain, acc, with_bias, segmented;
          acc.accumulate = true;
          with_bias.bias = bias.data();
          segmented.k_segments = segments;
          for (const GemmOptions* opt : {&plain, &acc, &with_bias, &segmented}) {
            std::vector<float> want = C0, got = C0;
            gemm(want.data(), N, A.dense.data(), A.cols, ta, B.dense.data(), B.cols, tb, M, N, K, *opt);
            for (const std::string& kernel : detail::gemm_kernels()) {
              got = C0;
              detail::gemm_with_kernel(kernel, got.data(), N, A.operand(ta), B.operand(tb), M, N, K, *opt);
              ASSERT_TRUE(bitwise_equal(got, want, kernel)) << "A storage " << ia << " B storage " << ib;
            }
            testing::with_threads(2, [&] {
              got = C0;
              gemm(got.data(), N, A.operand(ta), B.operand(tb), M, N, K, *opt);
            });
            ASSERT_TRUE(bitwise_equal(got, want, "2 threads")) << "A storage " << ia << " B storage " << ib;
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 100);
}

TEST(GemmOperands, EveryCodeDecodesAsDequantizeDoes) {
  // op(A) = the transpose of one stored row holding every code (so the vector decoding runs),
  // times B = 1 on top of C = -0: each C[i] is then exactly A's decoded value, sign of zero and NaN
  // bits included.
  for (ElemFormat f : {ElemFormat::e4m3, ElemFormat::e5m2, ElemFormat::e2m1}) {
    for (float s : {1.0f, 0.75f}) {
      QuantizedTensor q;
      q.elem = f;
      q.rows = 1;
      q.cols = 256;
      q.block_cols = 256;
      q.scales = {s};
      q.tensor_scale = f == ElemFormat::e2m1 ? 0.3f : 1.0f;
      q.codes.resize(static_cast<size_t>(q.row_bytes()));
      for (size_t c = 0; c < q.codes.size(); ++c) {
        q.codes[c] = static_cast<uint8_t>(f == ElemFormat::e2m1 ? (c % 16) | (((c + 5) % 16) << 4) : c);
      }
      std::vector<float> C(256, -0.0f), want(256);
      const float one = 1.0f;
      GemmOptions acc;
      acc.accumulate = true;
      gemm(C.data(), 1, gemm_operand(q, Trans::T), gemm_operand(&one, 1, Trans::N), 256, 1, 1, acc);
      dequantize(want.data(), q);
      for (int i = 0; i < 256; ++i) want[i] = std::fma(want[i], 1.0f, -0.0f);
      ASSERT_TRUE(bitwise_equal(C, want, std::string(elem_format_name(f))));
      if (s == 1.0f && f != ElemFormat::e2m1) {
        for (int i = 0; i < 256; ++i) ASSERT_TRUE(bitwise_equal(&C[i], std::vector<float>{decode(f, i)}.data(), 1)) << i;
      }
    }
  }
}

// A NaN block scale (a block that held a NaN) decodes to the scale's NaN in every column, in the
// vector lanes and the scalar tails alike, whatever the codes (a NaN code times a NaN scale would be
// either NaN as the operands fall): bitwise dequantize()'s, for one scale per row block and per column.
TEST(GemmOperands, NaNBlocksDecodeAsDequantizeDoes) {
  for (int64_t block_rows : {1, 128}) {
    const int64_t block_cols = block_rows == 1 ? 128 : 1, cols = 45;  // 40 columns in lanes, 5 in the tail
    std::vector<float> x(cols, 1.0f);
    for (int64_t c : {1, 4, 7, 10, 33, 38, 41, 43}) x[static_cast<size_t>(c)] = std::bit_cast<float>(0xffc00000u);
    QuantizedTensor q;
    quantize_blockwise(q, x.data(), 1, cols, ElemFormat::e4m3, block_rows, block_cols);
    // Give every code a NaN (0x7f / 0xff) or not, so the decoded values and the scales mix.
    for (int64_t c = 0; c < cols; ++c) q.codes[static_cast<size_t>(c)] = c % 3 == 0 ? 0xff : c % 3 == 1 ? 0x7f : 0x38;
    std::vector<float> C(static_cast<size_t>(cols), -0.0f), want(static_cast<size_t>(cols));
    const float one = 1.0f;
    GemmOptions acc;
    acc.accumulate = true;
    gemm(C.data(), 1, gemm_operand(q, Trans::T), gemm_operand(&one, 1, Trans::N), cols, 1, 1, acc);
    dequantize(want.data(), q);
    for (int64_t c = 0; c < cols; ++c) want[static_cast<size_t>(c)] = std::fma(want[static_cast<size_t>(c)], 1.0f, -0.0f);
    ASSERT_TRUE(bitwise_equal(C, want, "block rows " + std::to_string(block_rows)));
  }
}

TEST(GemmOperands, GroupedExpertsEqualTheFp32GroupedGemm) {
  // 4 experts (one without rows), stacked weights in one quantised tensor, expert e reading its rows.
  const int64_t E = 4, Nout = 32, K = 48, R = 40;
  const int64_t offsets[] = {0, 5, 5, 19, 40};
  const StoredOperand A(Storage::mxfp8, R, K, 11);
  const StoredOperand Wt(Storage::nvfp4_2d, E * Nout, K, 12);  // (E, Nout, K): W.trans = T
  const StoredOperand Wn(Storage::e4m3_tensor, E * K, Nout, 13);  // (E, K, Nout): W.trans = N
  const StoredOperand dY(Storage::e5m2_block, R, Nout, 14);
  const StoredOperand X(Storage::bf16, R, K, 15);
  const std::vector<float> bias = testing::randn(E * Nout, 16, "bias"), C0 = testing::randn(R * Nout, 16, "C0");
  const std::vector<float> dW0 = testing::randn(E * Nout * K, 16, "dW0");
  for (int threads : {1, 2}) {
    testing::with_threads(threads, [&] {
      for (const StoredOperand* W : {&Wt, &Wn}) {
        const Trans tw = W == &Wt ? Trans::T : Trans::N;
        for (bool accumulate : {false, true}) {
          std::vector<float> got = C0, want = C0;
          grouped_gemm(got.data(), A.operand(Trans::N), W->operand(tw), bias.data(), offsets, E, Nout, K, accumulate);
          grouped_gemm(want.data(), A.dense.data(), W->dense.data(), tw, bias.data(), offsets, E, Nout, K, accumulate);
          ASSERT_TRUE(bitwise_equal(got, want, "grouped_gemm")) << threads << " threads";
        }
      }
      std::vector<float> got = dW0, want = dW0;
      grouped_gemm_wgrad(got.data(), dY.operand(Trans::T), X.operand(Trans::N), offsets, E, Nout, K);
      grouped_gemm_wgrad(want.data(), nullptr, dY.dense.data(), X.dense.data(), offsets, E, Nout, K);
      ASSERT_TRUE(bitwise_equal(got, want, "grouped_gemm_wgrad")) << threads << " threads";
    });
  }
}

// determinism = "layout"'s expert GEMMs over the hidden units (grouped_gemm.h): per expert, the tree
// over segments of chains over slice s of every section, then the bias; and the property expert tensor
// parallelism relies on: P ranks each computing their block of S / P segments on their slices of
// the operands (no bias), combined along the canonical tree over ranks, then the bias, give the same
// bits. Also 1, 2, 3 threads, a double reference and one gemm() per expert with k_segment_bounds.
TEST(GroupedGemm, SegmentedIsTheTreeOverSegmentsAndSplitsOverRanks) {
  const int64_t E = 3, Nout = 19, S = 4, f = 3, R = 12;
  const int64_t offsets[] = {0, 5, 5, 12};  // expert 1 has no rows
  for (int64_t X : {1, 2}) {
    const int64_t K = S * X * f, section = S * f;
    const std::vector<float> A = testing::randn(R * K, 21, "A"), bias = testing::randn(E * Nout, 21, "bias");
    for (Trans tw : kTrans) {
      const std::vector<float> W = testing::randn(E * Nout * K, 22, "W");  // (E, Nout, K) for T, (E, K, Nout) for N
      auto w = [&](int64_t e, int64_t k, int64_t j) {
        return tw == Trans::T ? W[(e * Nout + j) * K + k] : W[(e * K + k) * Nout + j];
      };
      const GemmOperand Aop = gemm_operand(A.data(), K, Trans::N), Wop = gemm_operand(W.data(), tw == Trans::T ? K : Nout, tw);
      for (bool with_bias : {false, true}) {
        const float* b = with_bias ? bias.data() : nullptr;
        const std::string what = str("sections ", X, tw == Trans::T ? " W^T" : " W", with_bias ? " bias" : "");
        std::vector<float> want(static_cast<size_t>(R * Nout));
        std::vector<double> ref(want.size());
        for (int64_t e = 0; e < E; ++e)
          for (int64_t i = offsets[e]; i < offsets[e + 1]; ++i)
            for (int64_t j = 0; j < Nout; ++j) {
              const std::function<float(int64_t, int64_t)> tree = [&](int64_t s0, int64_t s1) -> float {
                if (s1 - s0 > 1) return tree(s0, s0 + canonical_split(s1 - s0)) + tree(s0 + canonical_split(s1 - s0), s1);
                float acc = 0.0f;
                for (int64_t x = 0; x < X; ++x)
                  for (int64_t k = x * section + s0 * f; k < x * section + (s0 + 1) * f; ++k)
                    acc = std::fma(A[i * K + k], w(e, k, j), acc);
                return acc;
              };
              const float t = tree(0, S);
              want[i * Nout + j] = b ? b[e * Nout + j] + t : t;
              double d = b ? b[e * Nout + j] : 0.0;
              for (int64_t k = 0; k < K; ++k) d += double(A[i * K + k]) * double(w(e, k, j));
              ref[i * Nout + j] = d;
            }
        for (int threads : {1, 2, 3}) {
          testing::with_threads(threads, [&] {
            std::vector<float> got(want.size());
            grouped_gemm_segmented(got.data(), Aop, Wop, b, offsets, E, Nout, K, KSegments{S, X});
            ASSERT_TRUE(bitwise_equal(got, want, what)) << threads << " threads";
          });
        }
        ASSERT_TRUE(testing::all_close(want, ref, 1e-5, 1e-5, what));
        {  // one gemm per expert with the same cut as gemm options
          std::vector<float> got(want.size());
          GemmOptions opt;
          const KSegmentBounds bounds = k_segment_bounds(KSegments{S, X}, K);
          bounds.apply(opt);
          for (int64_t e = 0; e < E; ++e) {
            opt.bias = b ? b + e * Nout : nullptr;
            const int64_t r0 = offsets[e], rows = offsets[e + 1] - r0;
            if (rows > 0)
              gemm(got.data() + r0 * Nout, Nout, A.data() + r0 * K, K, Trans::N, W.data() + e * Nout * K,
                   tw == Trans::T ? K : Nout, tw, rows, Nout, K, opt);
          }
          ASSERT_TRUE(bitwise_equal(got, want, what + ", gemm per expert"));
        }
        for (int64_t P : {2, 4}) {
          // Rank r: slices [r S/P f, (r + 1) S/P f) of every section, of A's columns and W's K.
          const int64_t Kr = K / P, sr = section / P;
          std::vector<std::vector<float>> parts(static_cast<size_t>(P));
          for (int64_t r = 0; r < P; ++r) {
            std::vector<float> Ar(static_cast<size_t>(R * Kr)), Wr(static_cast<size_t>(E * Nout * Kr));
            for (int64_t x = 0; x < X; ++x)
              for (int64_t k = 0; k < sr; ++k) {
                const int64_t kl = x * sr + k, kg = x * section + r * sr + k;
                for (int64_t i = 0; i < R; ++i) Ar[i * Kr + kl] = A[i * K + kg];
                for (int64_t e = 0; e < E; ++e)
                  for (int64_t j = 0; j < Nout; ++j)
                    (tw == Trans::T ? Wr[(e * Nout + j) * Kr + kl] : Wr[(e * Kr + kl) * Nout + j]) = w(e, kg, j);
              }
            parts[r].resize(want.size());
            grouped_gemm_segmented(parts[r].data(), gemm_operand(Ar.data(), Kr, Trans::N),
                                   gemm_operand(Wr.data(), tw == Trans::T ? Kr : Nout, tw), nullptr, offsets, E, Nout,
                                   Kr, KSegments{S / P, X});
          }
          std::vector<const float*> leaves;
          for (const auto& part : parts) leaves.push_back(part.data());
          std::vector<float> got(want.size()), stack(static_cast<size_t>(tree_sum_stack(P)) * want.size());
          tree_sum(got.data(), leaves.data(), P, R * Nout, stack.data());
          if (b)
            for (int64_t e = 0; e < E; ++e)
              for (int64_t i = offsets[e]; i < offsets[e + 1]; ++i)
                for (int64_t j = 0; j < Nout; ++j) got[i * Nout + j] = b[e * Nout + j] + got[i * Nout + j];
          ASSERT_TRUE(bitwise_equal(got, want, what + str(", ", P, " ranks")));
        }
      }
    }
  }
}

TEST(GemmOperands, QuantisedViews) {
  // A view at (row0, col0) of a quantised matrix reads the same values as that block of the
  // dequantised matrix (its scales are the stored blocks', not re-derived).
  const StoredOperand W(Storage::nvfp4_2d, 64, 96, 5);
  const StoredOperand X(Storage::mxfp8, 20, 64, 6);
  const int64_t M = 20, N = 24, K = 40;  // y(20 x 24) = x[:, 16:56] W[32:56, 16:56]^T
  std::vector<float> got(M * N), want(M * N);
  gemm(got.data(), N, gemm_operand(X.q, Trans::N, 0, 16), gemm_operand(W.q, Trans::T, 32, 16), M, N, K);
  gemm(want.data(), N, X.dense.data() + 16, 64, Trans::N, W.dense.data() + 32 * 96 + 16, 96, Trans::T, M, N, K);
  EXPECT_TRUE(bitwise_equal(got, want));
  // An odd column origin in packed E2M1 (a view starting in the high nibble of a byte).
  const StoredOperand X4(Storage::nvfp4, 20, 64, 7);
  gemm(got.data(), N, gemm_operand(X4.q, Trans::N, 0, 3), gemm_operand(W.q, Trans::T, 32, 16), M, N, K);
  gemm(want.data(), N, X4.dense.data() + 3, 64, Trans::N, W.dense.data() + 32 * 96 + 16, 96, Trans::T, M, N, K);
  EXPECT_TRUE(bitwise_equal(got, want, "odd origin"));
  EXPECT_THROW(gemm(got.data(), N, gemm_operand(X.q, Trans::N, 0, 30), gemm_operand(W.q, Trans::T), M, N, K),
               InternalError);
}

}  // namespace
}  // namespace lockstep
