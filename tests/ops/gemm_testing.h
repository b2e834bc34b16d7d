// GEMM test helpers shared by the op harness's cases (tests/ops/gemm.cpp) and the CPU backend's own
// tests (tests/test_gemm.cpp): operands with padded leading dimensions and the contract's
// references (the FMA chain, the canonical tree over k_segments, double), and operands stored in
// low precision with the fp32 matrices they stand for.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "../testing.h"
#include "lockstep/core/dtype.h"
#include "lockstep/core/error.h"
#include "lockstep/core/tree_sum.h"
#include "lockstep/kernels/cpu/quantize.h"
#include "lockstep/kernels/gemm.h"
#include "lockstep/kernels/quantize.h"

namespace lockstep::gemm_testing {

// Operands of one GEMM with padded leading dimensions, so that a kernel reading or writing past a
// row's end is caught (the padding of C holds a sentinel that must survive).
struct GemmCase {
  int64_t M, N, K;
  Trans ta, tb;
  int64_t lda, ldb, ldc;
  std::vector<float> A, B, C0, bias;

  GemmCase(int64_t M_, int64_t N_, int64_t K_, Trans ta_, Trans tb_, uint64_t seed, int64_t pad = 3)
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
          const std::vector<int64_t> sections =
              opt.k_sections.empty() ? whole : std::vector<int64_t>(opt.k_sections.begin(), opt.k_sections.end());
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
  std::string name() const { return str(M, "x", N, "x", K, ta == Trans::N ? " N" : " T", tb == Trans::N ? "N" : "T"); }
};

inline constexpr Trans kTrans[] = {Trans::N, Trans::T};

// ---- Operands in low precision (bf16, FP8, MXFP8, NVFP4): decoded while packing, the result must
// equal the fp32 GEMM on the dequantised matrices bit for bit.

enum class Storage { f32, bf16, e4m3_tensor, e5m2_block, mxfp8, nvfp4, nvfp4_2d, e4m3_column_block };
inline constexpr Storage kStorages[] = {
    Storage::f32,   Storage::bf16,  Storage::e4m3_tensor, Storage::e5m2_block,
    Storage::mxfp8, Storage::nvfp4, Storage::nvfp4_2d,    Storage::e4m3_column_block};

// A stored rows x cols matrix in one storage, and the fp32 matrix it stands for (quantised and
// dequantised by the CPU backend's functions: the operands' preparation, not what is tested).
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
      case Storage::f32:
        dense = x;
        return;
      case Storage::bf16:
        for (float v : x) half.push_back(to_bf16(v));
        for (size_t i = 0; i < x.size(); ++i) dense[i] = to_f32(half[i]);
        return;
      case Storage::e4m3_tensor:
        quantize_tensorwise(q, x.data(), rows, cols, ElemFormat::e4m3,
                            fp8_scale_from_amax(amax(x.data(), rows * cols), ElemFormat::e4m3));
        break;
      case Storage::e5m2_block:
        quantize_blockwise(q, x.data(), rows, cols, ElemFormat::e5m2, 1, 128);
        break;
      case Storage::e4m3_column_block:  // 128 x 1 blocks: a scale per column, columns of 5 magnitudes
        for (int64_t i = 0; i < rows * cols; ++i) x[i] = std::ldexp(x[i], static_cast<int>(i % cols % 5) * 3);
        quantize_blockwise(q, x.data(), rows, cols, ElemFormat::e4m3, 128, 1);
        break;
      case Storage::mxfp8:
        quantize_mxfp8(q, x.data(), rows, cols, ElemFormat::e4m3);
        break;
      case Storage::nvfp4:
        quantize_nvfp4(q, x.data(), rows, cols, 1);
        break;
      case Storage::nvfp4_2d:
        quantize_nvfp4(q, x.data(), rows, cols, 16);
        break;
    }
    dequantize(dense.data(), q);
  }
};

// The k_segments (and k_sections) layouts both GEMM tests run: sections, empty segments, 12 (not a
// power of two) segments, 130 segments (past the one-pass limit of 128), K = 4000 (past 4 kernel K
// blocks of 768 or 512) and K = 0.
struct KSegmentLayout {
  int64_t M, N, K;
  std::vector<int64_t> sections, segments;
};
inline std::vector<KSegmentLayout> k_segment_layouts() {
  std::vector<int64_t> many(131);
  for (int64_t s = 0; s <= 130; ++s) many[static_cast<size_t>(s)] = s * 260 / 130;
  const std::vector<int64_t> long_k = {0, 1000, 1000, 2500, 4000};
  return {
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
}

}  // namespace lockstep::gemm_testing
