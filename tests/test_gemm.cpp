// The CPU backend's GEMM micro-kernels: every kernel this machine runs (AVX-512, AVX2, portable)
// against the FMA-chain reference, bit for bit, through detail::gemm_with_kernel. The op's
// contract on every backend (references, options, k_segments, batches, low-precision operands,
// grouped GEMMs, thread counts) is tested by the op harness: tests/ops/gemm.cpp.
#include <gtest/gtest.h>

#include <bit>
#include <iterator>
#include <string>
#include <vector>

#include "lockstep/kernels/cpu/gemm.h"
#include "ops/gemm_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

using namespace gemm_testing;
using testing::bitwise_equal;

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

// k_segments (and k_sections) on every micro-kernel: the canonical tree over the segments' chains
// plus the init, as the reference writes it out, in one pass (up to 128 segments and K up to 4
// kernel K blocks) or segment by segment past that; sections, empty segments, 12 (not a power of
// two) segments and K = 0.
TEST(Gemm, KSegments) {
  const std::vector<std::string> kernels = detail::gemm_kernels();
  uint64_t seed = 40;
  for (const KSegmentLayout& l : k_segment_layouts()) {
    for (Trans ta : kTrans) {
      for (Trans tb : kTrans) {
        const GemmCase c(l.M, l.N, l.K, ta, tb, seed++);
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
        }
      }
    }
  }
}

// Every micro-kernel this machine runs (AVX-512, AVX2, portable) gives the chain's exact bits,
// also across K blocks and edge tiles; and so does gemm_portable.
TEST(Gemm, EveryKernelSameBits) {
  const std::vector<std::string> kernels = detail::gemm_kernels();
  ASSERT_EQ(kernels.front(), gemm_kernel_name());
  ASSERT_EQ(kernels.back(), "portable");
  const int64_t shapes[][3] = {{67, 130, 17}, {130, 67, 800}, {1, 5, 1}};
  for (const auto& s : shapes) {
    for (Trans ta : kTrans) {
      for (Trans tb : kTrans) {
        const GemmCase c(s[0], s[1], s[2], ta, tb, 6);
        GemmOptions opt;
        opt.bias = c.bias.data();
        const std::vector<float> ref = c.reference(opt);
        for (const std::string& k : kernels) {
          std::vector<float> C = c.C0;
          detail::gemm_with_kernel(k, C.data(), c.ldc, c.A.data(), c.lda, ta, c.B.data(), c.ldb, tb, c.M, c.N, c.K,
                                   opt);
          ASSERT_TRUE(bitwise_equal(C, ref, c.name() + " " + k));
        }
        std::vector<float> C = c.C0;
        detail::gemm_portable(C.data(), c.ldc, c.A.data(), c.lda, ta, c.B.data(), c.ldb, tb, c.M, c.N, c.K, opt);
        ASSERT_TRUE(bitwise_equal(C, ref, c.name() + " gemm_portable"));
      }
    }
  }
}

GemmOperand host_operand(const StoredOperand& s, Trans t) {
  if (s.storage == Storage::f32) return gemm_operand(s.dense.data(), s.cols, t);
  if (s.storage == Storage::bf16) return gemm_operand(s.half.data(), s.cols, t);
  return gemm_operand(s.q, t);
}

// Operands in low precision decoded by every micro-kernel: the fp32 GEMM on the dequantised
// matrices, bit for bit.
TEST(GemmOperands, EqualTheFp32GemmOnTheDequantisedOperands) {
  const int64_t M = 37, N = 45, K = 600;  // edge tiles, and K crosses a cache block
  const std::vector<int64_t> segments = {0, 100, 333, 600};
  int checked = 0;
  for (size_t ia = 0; ia < std::size(kStorages); ++ia) {
    for (size_t ib = 0; ib < std::size(kStorages); ++ib) {
      // Every storage on each side against f32 and against itself, and a few mixed pairs.
      if (!(ia == 0 || ib == 0 || ia == ib || (ia + ib) % 3 == 0)) continue;
      for (Trans ta : kTrans) {
        for (Trans tb : kTrans) {
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
              detail::gemm_with_kernel(kernel, got.data(), N, host_operand(A, ta), host_operand(B, tb), M, N, K, *opt);
              ASSERT_TRUE(bitwise_equal(got, want, kernel)) << "A storage " << ia << " B storage " << ib;
            }
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 100);
}

}  // namespace
}  // namespace lockstep
