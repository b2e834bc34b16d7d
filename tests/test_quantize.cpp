// Quantisers (tensorwise / blockwise FP8, MXFP8, NVFP4), stochastic rounding and the random
// Hadamard transform, against double-precision references.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "lockstep/core/float_formats.h"
#include "lockstep/core/philox.h"
#include "lockstep/kernels/cpu/quantize.h"
#include "testing.h"

namespace lockstep {
namespace {

using testing::bitwise_equal;
using testing::with_threads;

struct FormatBits {
  int M, emin;
};
FormatBits bits_of(ElemFormat f) {
  return f == ElemFormat::e4m3 ? FormatBits{3, -6} : f == ElemFormat::e5m2 ? FormatBits{2, -14} : FormatBits{1, 0};
}

// Gap between the representable magnitudes around |y| (double), for |y| <= max_finite.
double gap_at(ElemFormat f, double y) {
  const FormatBits b = bits_of(f);
  const int e = y == 0 ? b.emin : std::max(b.emin, static_cast<int>(std::floor(std::log2(std::abs(y)))));
  return std::ldexp(1.0, e - b.M);
}

// Outliers on a normal background, with some exact zeros, rows x cols.
std::vector<float> test_matrix(int64_t rows, int64_t cols, uint64_t seed, float scale = 1.0f) {
  std::vector<float> x = testing::randn(rows * cols, seed, "quantize", scale);
  for (int64_t i = 0; i < rows * cols; i += 97) x[i] *= 40.0f;
  for (int64_t i = 5; i < rows * cols; i += 131) x[i] = 0.0f;
  return x;
}

// The recipe-independent contract: value() is dequantize()'s output bit for bit, and each code is
// the nearest (ties aside) to x / m, m = the element's multiplier (block scale * tensor scale), or
// +-max when x / m is beyond it. Checked in double.
void check_nearest(const QuantizedTensor& q, const std::vector<float>& x) {
  std::vector<float> deq(static_cast<size_t>(q.rows * q.cols));
  dequantize(deq.data(), q);
  const double fmax = max_finite(q.elem);
  for (int64_t r = 0; r < q.rows; ++r) {
    for (int64_t c = 0; c < q.cols; ++c) {
      const size_t i = static_cast<size_t>(r * q.cols + c);
      ASSERT_TRUE(bitwise_equal(&deq[i], std::vector<float>{q.value(r, c)}.data(), 1));
      const double m = static_cast<double>(q.block_scale(r / q.block_rows, c / q.block_cols)) * q.tensor_scale;
      const double y = x[i] / m, v = decode(q.elem, q.code(r, c));
      if (std::abs(y) >= fmax) {
        ASSERT_EQ(std::abs(v), fmax) << r << "," << c << " y=" << y;
      } else {
        ASSERT_LE(std::abs(v - y), 0.5 * gap_at(q.elem, y) + 1e-6 * std::abs(y)) << r << "," << c << " y=" << y << " code value " << v;
      }
      ASSERT_EQ(std::signbit(v), std::signbit(x[i])) << r << "," << c;
    }
  }
}

// max over blocks of (max |value - x| in the block) / amax_b, in double.
double worst_block_error(const QuantizedTensor& q, const std::vector<float>& x) {
  double worst = 0;
  for (int64_t br = 0; br < q.grid_rows(); ++br) {
    for (int64_t bc = 0; bc < q.grid_cols(); ++bc) {
      double amax_b = 0, err = 0;
      for (int64_t r = br * q.block_rows; r < std::min(q.rows, (br + 1) * q.block_rows); ++r) {
        for (int64_t c = bc * q.block_cols; c < std::min(q.cols, (bc + 1) * q.block_cols); ++c) {
          const double xv = x[static_cast<size_t>(r * q.cols + c)];
          amax_b = std::max(amax_b, std::abs(xv));
          err = std::max(err, std::abs(static_cast<double>(q.value(r, c)) - xv));
        }
      }
      if (amax_b > 0) worst = std::max(worst, err / amax_b);
    }
  }
  return worst;
}

TEST(Quantize, ScaleFromAmaxFollowsTransformerEngine) {
  EXPECT_EQ(fp8_scale_from_amax(2.0f, ElemFormat::e4m3), 224.0f);
  EXPECT_EQ(fp8_scale_from_amax(2.0f, ElemFormat::e4m3, 1), 112.0f);
  EXPECT_EQ(fp8_scale_from_amax(4.0f, ElemFormat::e5m2), 14336.0f);
  EXPECT_EQ(fp8_scale_from_amax(0.0f, ElemFormat::e4m3, 0, 3.5f), 3.5f);  // keep the last scale
  EXPECT_EQ(fp8_scale_from_amax(std::numeric_limits<float>::infinity(), ElemFormat::e4m3, 0, 2.0f), 2.0f);
  EXPECT_EQ(fp8_scale_from_amax(std::nanf(""), ElemFormat::e4m3), 1.0f);
  const std::vector<float> x = {0.5f, -3.0f, 2.0f, std::nanf("")};
  EXPECT_EQ(amax(x.data(), 3), 3.0f);
  EXPECT_TRUE(std::isnan(amax(x.data(), 4)));
}

TEST(Quantize, TensorwiseIsNearestWithinTheFormatsBound) {
  for (ElemFormat f : {ElemFormat::e4m3, ElemFormat::e5m2}) {
    const std::vector<float> x = test_matrix(37, 53, 1);
    const float scale = fp8_scale_from_amax(amax(x.data(), 37 * 53), f);
    QuantizedTensor q;
    quantize_tensorwise(q, x.data(), 37, 53, f, scale);
    EXPECT_EQ(q.scales.size(), 1u);
    EXPECT_EQ(q.scales[0], 1.0f / scale);
    check_nearest(q, x);
    // Relative error 2^-(M+1) in the normal range, absolute half a subnormal quantum below it.
    const FormatBits b = bits_of(f);
    for (int64_t i = 0; i < 37 * 53; ++i) {
      const double err = std::abs(static_cast<double>(q.value(i / 53, i % 53)) - x[i]);
      const double bound = std::max(std::ldexp(std::abs(x[i]), -(b.M + 1)),
                                    std::ldexp(q.scales[0], b.emin - b.M - 1));
      ASSERT_LE(err, bound * (1 + 1e-6)) << elem_format_name(f) << " " << x[i];
    }
  }
}

// The encoder's vector lanes and its scalar tail against encode(f, x * scale) (the scalar encoder):
// every fp32 exponent with both signs, each mantissa's rounding boundaries for the format (half a
// quantum, one ulp either side, an odd and an even truncated code), the largest mantissas (carry
// into the exponent, saturation), infinities and NaNs with payloads; rows of 61 values, so that
// the tail of each row is encoded by the scalar loop. Round to nearest and stochastic.
TEST(Quantize, EncodingOfEveryExponentMatchesTheScalarEncoders) {
  for (ElemFormat f : {ElemFormat::e4m3, ElemFormat::e5m2}) {
    const int sh = 23 - bits_of(f).M;
    const uint32_t half = 1u << (sh - 1);
    const uint32_t mantissas[] = {0, 1, half - 1, half, half + 1, (1u << sh) | half, ((1u << sh) | half) - 1,
                                  ((1u << sh) | half) + 1, (3u << sh) | half, 0x7fffffu, 0x7fffffu - half, 0x400000u};
    std::vector<float> x;
    for (uint32_t sign : {0u, 1u})
      for (uint32_t e = 0; e < 256; ++e)
        for (uint32_t m : mantissas) x.push_back(std::bit_cast<float>(sign << 31 | e << 23 | m));
    const int64_t cols = 61, rows = (static_cast<int64_t>(x.size()) + cols - 1) / cols;
    x.resize(static_cast<size_t>(rows * cols), 0.0f);
    for (float scale : {1.0f, 0.3f, 1.0f / 3.0f * 0x1p-20f, 0x1p30f}) {
      QuantizedTensor q;
      quantize_tensorwise(q, x.data(), rows, cols, f, scale);
      for (size_t i = 0; i < x.size(); ++i)
        ASSERT_EQ(q.codes[i], encode(f, x[i] * scale))
            << elem_format_name(f) << " x bits " << std::hex << std::bit_cast<uint32_t>(x[i]) << " scale " << scale;
      // Stochastic: encode_stochastic with the element's draw, the runs starting anywhere in a block.
      for (int64_t base : {0, 1, 2, 3}) {
        StochasticRounding sr;
        sr.enabled = true;
        sr.seed = 5;
        sr.index_base = base;
        quantize_tensorwise(q, x.data(), rows, cols, f, scale, sr);
        const RandomStream rng(sr.seed, sr_purpose(sr.tensor_id, sr.step));
        for (size_t i = 0; i < x.size(); ++i)
          ASSERT_EQ(q.codes[i], encode_stochastic(f, x[i] * scale, rng.bits(static_cast<uint64_t>(base) + i)))
              << elem_format_name(f) << " x bits " << std::hex << std::bit_cast<uint32_t>(x[i]) << " scale " << scale;
      }
    }
  }
}

// The same for E2M1 (NVFP4's elements, two per byte): codes against encode(e2m1, x * m), m = S / d
// the block's multiplier from quantize.h's two-level scales (S = 6 * 448 / amax, d the decoded
// E4M3 block scale), on values spread over 2^-11 .. 2^3 in every block with the rounding boundaries
// of one mantissa bit; 84 columns, so that each row ends in a 4-column block the scalar loop encodes.
TEST(Quantize, NearestE2m1EncodingMatchesTheScalarEncoder) {
  const uint32_t mantissas[] = {0, 1, 0x200000u - 1, 0x200000u, 0x200001u, 0x600000u, 0x5fffffu, 0x600001u, 0x7fffffu};
  std::vector<float> x;
  for (uint32_t sign : {0u, 1u})  // exponent-minor: each block of 16 spans the range (subnormal codes too)
    for (uint32_t m : mantissas)
      for (uint32_t e = 127 - 11; e <= 127 + 3; ++e) x.push_back(std::bit_cast<float>(sign << 31 | e << 23 | m));
  const int64_t cols = 84, rows = (static_cast<int64_t>(x.size()) + cols - 1) / cols;
  x.resize(static_cast<size_t>(rows * cols), 0.25f);
  float t = 0.0f;
  for (float v : x) t = std::max(t, std::abs(v));
  const float S = 6.0f * 448.0f / t;
  QuantizedTensor q;
  quantize_nvfp4(q, x.data(), rows, cols, 1);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
      float amax_b = 0.0f;
      for (int64_t c = c0; c < std::min(cols, c0 + 16); ++c) amax_b = std::max(amax_b, std::abs(x[r * cols + c]));
      const float d = decode_e4m3(encode_e4m3((amax_b / 6.0f) * S));
      const float m = d == 0.0f ? 0.0f : S / d;
      for (int64_t c = c0; c < std::min(cols, c0 + 16); ++c) {
        const uint8_t code = (q.codes[static_cast<size_t>(r * q.row_bytes() + c / 2)] >> (c % 2 ? 4 : 0)) & 0xF;
        ASSERT_EQ(code, encode(ElemFormat::e2m1, x[r * cols + c] * m))
            << "x bits " << std::hex << std::bit_cast<uint32_t>(x[r * cols + c]) << " row " << std::dec << r << " col " << c;
      }
    }
}

// Every block recipe, round to nearest and stochastic, against the scalar encoders element by
// element: code(r, c) == encode(f, x * m) or encode_stochastic(f, x * m, bits(index)), m the
// element's multiplier (1 / the block's power-of-two scale; NVFP4: S / d as above), the index
// index_base + r * row stride + c with the bases 0..3 (so that a run's first draw sits anywhere in
// its Philox block) and a wider global row. Column blocks of 1 (128 x 1), 128 (1 x 128), 32 (MXFP8),
// 16 (NVFP4, a row's 64-block chunks) and 12 (2 x 12), 75 columns, so that rows end in scalar tails.
TEST(Quantize, EveryRecipesCodesMatchTheScalarEncoders) {
  const int64_t rows = 256, cols = 75;
  std::vector<float> x = test_matrix(rows, cols, 9);
  for (int64_t i = 0; i < rows * cols; i += 7) x[i] = std::bit_cast<float>((std::bit_cast<uint32_t>(x[i]) & 0xfff00000u) | 0x80000u);
  // (blockwise_odd: 2 x 12 blocks, whose 8-column groups straddle blocks: a multiplier per lane.)
  enum Kind { blockwise_cols, blockwise_rows, mxfp8, nvfp4, blockwise_odd };
  for (Kind kind : {blockwise_cols, blockwise_rows, mxfp8, nvfp4, blockwise_odd})
    for (bool stochastic : {false, true})
      for (int64_t base : {0, 1, 2, 3})
        for (int64_t global_cols : {int64_t{0}, int64_t{83}}) {
          StochasticRounding sr;
          sr.enabled = stochastic;
          sr.seed = 7;
          sr.step = 3;
          sr.tensor_id = 11;
          sr.index_base = base;
          sr.global_cols = global_cols;
          QuantizedTensor q;
          const ElemFormat f = kind == nvfp4 ? ElemFormat::e2m1 : ElemFormat::e4m3;
          switch (kind) {
            case blockwise_cols: quantize_blockwise(q, x.data(), rows, cols, f, 128, 1, sr); break;
            case blockwise_rows: quantize_blockwise(q, x.data(), rows, cols, f, 1, 128, sr); break;
            case mxfp8: quantize_mxfp8(q, x.data(), rows, cols, f, ScaleRounding::up, 32, sr); break;
            case nvfp4: quantize_nvfp4(q, x.data(), rows, cols, 1, sr); break;
            case blockwise_odd: quantize_blockwise(q, x.data(), rows, cols, f, 2, 12, sr); break;
          }
          float t = 0.0f;
          for (float v : x) t = std::max(t, std::abs(v));
          const float S = 6.0f * 448.0f / t;
          const RandomStream rng(sr.seed, sr_purpose(sr.tensor_id, sr.step));
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < cols; ++c) {
              const float d = q.block_scale(r / q.block_rows, c / q.block_cols);
              const float m = kind != nvfp4 ? 1.0f / d : d == 0.0f ? 0.0f : S / d;
              const float y = x[r * cols + c] * m;
              const auto index = static_cast<uint64_t>(base + r * (global_cols ? global_cols : cols) + c);
              const uint8_t want = stochastic ? encode_stochastic(f, y, rng.bits(index)) : encode(f, y);
              const uint8_t got = kind == nvfp4 ? (q.codes[static_cast<size_t>(r * q.row_bytes() + c / 2)] >> (c % 2 ? 4 : 0)) & 0xF
                                                : q.codes[static_cast<size_t>(r * cols + c)];
              ASSERT_EQ(got, want) << "kind " << kind << " stochastic " << stochastic << " base " << base << " global_cols "
                                   << global_cols << " at " << r << "," << c;
            }
        }
}

// amax against the scalar fold m = (|v| > m or isnan(|v|)) ? |v| : m from 0, bitwise: without a
// NaN the max; with NaNs (each with its own payload) at the start, in the middle of a vector stretch
// and in the tail, the last one. Lengths around the vector widths.
TEST(Quantize, AmaxIsTheScalarFoldBitwiseWhereverTheNaNs) {
  const auto fold = [](const std::vector<float>& v, int64_t n) {
    float m = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      const float a = std::abs(v[static_cast<size_t>(i)]);
      m = (a > m || std::isnan(a)) ? a : m;
    }
    return m;
  };
  for (int64_t n : {1, 7, 8, 9, 31, 32, 33, 100, 5000, 300001}) {
    std::vector<float> x = test_matrix(1, n, 3);
    x[static_cast<size_t>(n / 2)] = -7500.0f;  // the max, negative
    EXPECT_EQ(std::bit_cast<uint32_t>(amax(x.data(), n)), std::bit_cast<uint32_t>(7500.0f)) << n;
    EXPECT_EQ(std::bit_cast<uint32_t>(amax(x.data(), n)), std::bit_cast<uint32_t>(fold(x, n))) << n;
    uint32_t payload = 0x7fc00001u;
    for (int64_t at : {int64_t{0}, n / 3, n - 1}) {
      x[static_cast<size_t>(at)] = std::bit_cast<float>(payload++ | 0x80000000u);
      ASSERT_EQ(std::bit_cast<uint32_t>(amax(x.data(), n)), std::bit_cast<uint32_t>(fold(x, n))) << n << " " << at;
    }
  }
}

TEST(Quantize, BlockwiseUsesPowerOfTwoScalesPerBlock) {
  const int64_t rows = 130, cols = 300;  // partial edge blocks both ways
  const std::vector<float> x = test_matrix(rows, cols, 2);
  for (auto [br, bc] : {std::pair<int64_t, int64_t>{1, 128}, {128, 1}, {128, 128}}) {
    QuantizedTensor q;
    quantize_blockwise(q, x.data(), rows, cols, ElemFormat::e4m3, br, bc);
    ASSERT_EQ(q.grid_rows(), (rows + br - 1) / br);
    ASSERT_EQ(q.grid_cols(), (cols + bc - 1) / bc);
    check_nearest(q, x);
    for (int64_t gr = 0; gr < q.grid_rows(); ++gr) {
      for (int64_t gc = 0; gc < q.grid_cols(); ++gc) {
        double amax_b = 0;
        for (int64_t r = gr * br; r < std::min(rows, (gr + 1) * br); ++r) {
          for (int64_t c = gc * bc; c < std::min(cols, (gc + 1) * bc); ++c) amax_b = std::max(amax_b, std::abs(double(x[r * cols + c])));
        }
        const double want = amax_b == 0 ? 1 : std::ldexp(1.0, -static_cast<int>(std::floor(std::log2(448.0 / amax_b))));
        ASSERT_EQ(q.block_scale(gr, gc), want) << br << "x" << bc << " block " << gr << "," << gc;
      }
    }
    EXPECT_LE(worst_block_error(q, x), 0x1p-4) << br << "x" << bc;
  }
}

TEST(Quantize, Mxfp8ScalesFollowOcpOrTransformerEngine) {
  const int64_t rows = 9, cols = 100;
  const std::vector<float> x = test_matrix(rows, cols, 3, 0.01f);
  for (ElemFormat f : {ElemFormat::e4m3, ElemFormat::e5m2}) {
    for (ScaleRounding rule : {ScaleRounding::down, ScaleRounding::up}) {
      QuantizedTensor q;
      quantize_mxfp8(q, x.data(), rows, cols, f, rule);
      ASSERT_EQ(q.scale_format, ScaleFormat::e8m0);
      ASSERT_EQ(q.grid_cols(), 4);
      check_nearest(q, x);
      int saturated = 0;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t gc = 0; gc < 4; ++gc) {
          double amax_b = 0;
          for (int64_t c = gc * 32; c < std::min(cols, gc * 32 + 32); ++c) amax_b = std::max(amax_b, std::abs(double(x[r * cols + c])));
          const int e = rule == ScaleRounding::down
                            ? static_cast<int>(std::floor(std::log2(amax_b))) - max_exponent(f)
                            : static_cast<int>(std::ceil(std::log2(amax_b / max_finite(f))));
          ASSERT_EQ(q.block_scale(r, gc), std::ldexp(1.0, e)) << r << "," << gc;
          for (int64_t c = gc * 32; c < std::min(cols, gc * 32 + 32); ++c) {
            saturated += std::abs(x[r * cols + c]) / q.block_scale(r, gc) > max_finite(f);
          }
        }
      }
      // TE's rule never saturates; OCP's does for blocks whose amax sits in [fmax, 2^(emax+1)) X.
      if (rule == ScaleRounding::up) {
        EXPECT_EQ(saturated, 0) << elem_format_name(f);
      } else {
        EXPECT_GT(saturated, 0) << elem_format_name(f);  // this data has such blocks
      }
      EXPECT_LE(worst_block_error(q, x), f == ElemFormat::e4m3 ? 0.125 : 0.25);
    }
  }
}

TEST(Quantize, Nvfp4TwoLevelScales) {
  const int64_t rows = 32, cols = 88;  // 88 = 5.5 blocks of 16: a partial block, full bytes
  const std::vector<float> x = test_matrix(rows, cols, 4);
  const double t = amax(x.data(), rows * cols);
  for (int64_t br : {1, 16}) {
    QuantizedTensor q;
    quantize_nvfp4(q, x.data(), rows, cols, br);
    ASSERT_EQ(q.elem, ElemFormat::e2m1);
    ASSERT_EQ(q.scale_format, ScaleFormat::e4m3);
    ASSERT_EQ(q.row_bytes(), 44);
    EXPECT_EQ(q.tensor_scale, static_cast<float>(t / 2688.0));
    check_nearest(q, x);
    for (int64_t gr = 0; gr < q.grid_rows(); ++gr) {
      for (int64_t gc = 0; gc < q.grid_cols(); ++gc) {
        double amax_b = 0;
        for (int64_t r = gr * br; r < (gr + 1) * br; ++r) {
          for (int64_t c = gc * 16; c < std::min(cols, gc * 16 + 16); ++c) amax_b = std::max(amax_b, std::abs(double(x[r * cols + c])));
        }
        // The E4M3 scale is the nearest to amax_b / 6 in units of the tensor scale.
        const double s = amax_b / 6 / (t / 2688.0), got = q.block_scale(gr, gc);
        ASSERT_LE(std::abs(got - s), 0.5 * gap_at(ElemFormat::e4m3, s) + 1e-5 * s) << gr << "," << gc;
      }
    }
    // Half the widest E2M1 gap (4 to 6) over the block's top value 6, plus the scale's rounding.
    EXPECT_LE(worst_block_error(q, x), (1.0 / 6) * (1 + 0x1p-4)) << br;
  }
  // A tensor of zeros: codes 0, values 0.
  const std::vector<float> zeros(64, 0.0f);
  QuantizedTensor z;
  quantize_nvfp4(z, zeros.data(), 2, 32);
  for (int64_t i = 0; i < 64; ++i) EXPECT_EQ(z.value(i / 32, i % 32), 0.0f);
}

// quantize.h: given the whole tensor's amax, a piece (cut on block boundaries: a tensor-parallel
// shard, a canonical piece under determinism = "layout") gets the whole tensor's tensor scale, and
// so the codes and block scales the whole tensor's quantisation gives it, bit for bit.
TEST(Quantize, Nvfp4PieceWithTheTensorsAmaxIsTheWholesSlice) {
  const int64_t rows = 48, cols = 96;
  const std::vector<float> x = test_matrix(rows, cols, 11);
  const float t = amax(x.data(), rows * cols);
  for (int64_t br : {1, 16}) {
    QuantizedTensor whole, given;
    quantize_nvfp4(whole, x.data(), rows, cols, br);
    quantize_nvfp4(given, x.data(), rows, cols, br, {}, &t);  // the amax passed for the whole: the same bits
    EXPECT_EQ(given.codes, whole.codes);
    EXPECT_EQ(given.scale_codes, whole.scale_codes);
    EXPECT_EQ(std::bit_cast<uint32_t>(given.tensor_scale), std::bit_cast<uint32_t>(whole.tensor_scale));
    // Pieces [r0, r0 + 16) x [c0, c0 + pc): their own amax is smaller than t (the outliers fall elsewhere).
    for (const auto& [r0, c0, pc] : {std::tuple<int64_t, int64_t, int64_t>{0, 0, 32}, {16, 32, 64}, {32, 80, 16}}) {
      const int64_t pr = 16;
      std::vector<float> piece(static_cast<size_t>(pr * pc));
      for (int64_t r = 0; r < pr; ++r)
        for (int64_t c = 0; c < pc; ++c) piece[r * pc + c] = x[(r0 + r) * cols + c0 + c];
      QuantizedTensor q;
      quantize_nvfp4(q, piece.data(), pr, pc, br, {}, &t);
      EXPECT_EQ(std::bit_cast<uint32_t>(q.tensor_scale), std::bit_cast<uint32_t>(whole.tensor_scale)) << br;
      for (int64_t r = 0; r < pr; ++r)
        for (int64_t c = 0; c < pc; ++c)
          ASSERT_EQ(q.code(r, c), whole.code(r0 + r, c0 + c)) << br << " " << r0 + r << "," << c0 + c;
      for (int64_t gr = 0; gr < q.grid_rows(); ++gr)
        for (int64_t gc = 0; gc < q.grid_cols(); ++gc)
          ASSERT_EQ(std::bit_cast<uint32_t>(q.block_scale(gr, gc)),
                    std::bit_cast<uint32_t>(whole.block_scale(r0 / br + gr, c0 / 16 + gc)))
              << br << " block " << gr << "," << gc;
      // Without it the piece's own amax sets the scales: other bits (the test can fail).
      QuantizedTensor own;
      quantize_nvfp4(own, piece.data(), pr, pc, br);
      if (amax(piece.data(), pr * pc) != t) {
        EXPECT_NE(own.tensor_scale, whole.tensor_scale);
      }
    }
  }
}

TEST(Quantize, NaNPoisonsItsBlock) {
  std::vector<float> x = test_matrix(2, 64, 5);
  x[40] = std::nanf("");  // row 0, column 40
  QuantizedTensor q;
  quantize_blockwise(q, x.data(), 2, 64, ElemFormat::e4m3, 1, 32);
  quantize_mxfp8(q, x.data(), 2, 64, ElemFormat::e4m3);
  for (int64_t c = 0; c < 64; ++c) {
    EXPECT_EQ(std::isnan(q.value(0, c)), c >= 32) << c;
    EXPECT_FALSE(std::isnan(q.value(1, c)));
  }
  quantize_blockwise(q, x.data(), 2, 64, ElemFormat::e4m3, 1, 32);
  EXPECT_TRUE(std::isnan(q.value(0, 33)) && !std::isnan(q.value(0, 3)));
  quantize_blockwise(q, x.data(), 2, 64, ElemFormat::e4m3, 128, 1);  // a block per column
  for (int64_t c = 0; c < 64; ++c) EXPECT_EQ(std::isnan(q.value(1, c)), c == 40) << c;
  // A NaN block's codes are its multiplier's (NaN) code, in the vector lanes and the scalar tail
  // alike, whatever NaNs (negative: x86's default NaN) the block holds: x * NaN would be either NaN.
  std::vector<float> y(45, 1.0f);  // 40 columns in lanes, 5 in the tail
  for (int64_t c : {1, 4, 7, 10, 33, 38, 41, 43}) y[static_cast<size_t>(c)] = std::bit_cast<float>(0xffc00000u);
  quantize_blockwise(q, y.data(), 1, 45, ElemFormat::e4m3, 1, 128);
  for (int64_t c = 0; c < 45; ++c)
    EXPECT_EQ(q.codes[static_cast<size_t>(c)], encode(ElemFormat::e4m3, std::numeric_limits<float>::quiet_NaN())) << c;
  // And a NaN block scale decodes to itself (value() and dequantize()), whatever the code.
  std::vector<float> values(45);
  dequantize(values.data(), q);
  for (int64_t c = 0; c < 45; ++c) {
    EXPECT_EQ(std::bit_cast<uint32_t>(values[static_cast<size_t>(c)]), std::bit_cast<uint32_t>(q.block_scale(0, 0))) << c;
    EXPECT_EQ(std::bit_cast<uint32_t>(q.value(0, c)), std::bit_cast<uint32_t>(q.block_scale(0, 0))) << c;
  }
  quantize_nvfp4(q, x.data(), 2, 64);
  EXPECT_TRUE(std::isnan(q.value(1, 0)));  // the tensor scale
}

// Mean of the dequantised values over `draws` SR keys (steps) must be x within 6 sigma per element;
// nearest rounding of the same x is visibly biased.
TEST(Quantize, StochasticRoundingIsUnbiased) {
  const int64_t rows = 4, cols = 64, n = rows * cols;
  std::vector<float> x(n);
  // 1.3 falls 0.6 of a gap above 1 in NVFP4's units and 0.4 of a gap above 80 in FP8's (1.3 * 64):
  // nearest rounding is biased by 0.4 gap. Every 16th element, 6, pins each block's scale.
  for (int64_t i = 0; i < n; ++i) x[i] = i % 16 == 0 ? 6.0f : 1.3f;
  const int draws = 400;
  for (int recipe = 0; recipe < 2; ++recipe) {
    std::vector<double> mean(n, 0.0), gap(n, 0.0);
    QuantizedTensor q;
    for (int s = 0; s < draws; ++s) {
      StochasticRounding sr{true, 123, static_cast<uint64_t>(s), 7};
      if (recipe == 0) {
        quantize_nvfp4(q, x.data(), rows, cols, 1, sr);
      } else {
        quantize_blockwise(q, x.data(), rows, cols, ElemFormat::e4m3, 1, 32, sr);
      }
      for (int64_t i = 0; i < n; ++i) mean[i] += q.value(i / cols, i % cols) / double(draws);
    }
    for (int64_t i = 0; i < n; ++i) {
      const double m = static_cast<double>(q.block_scale(i / cols / q.block_rows, i % cols / q.block_cols)) * q.tensor_scale;
      gap[i] = gap_at(q.elem, x[i] / m) * m;
      ASSERT_NEAR(mean[i], x[i], 6 * 0.5 * gap[i] / std::sqrt(draws) + 1e-6) << "recipe " << recipe << " element " << i;
    }
    // The same x rounded to nearest: the average error is a sizeable fraction of a gap.
    if (recipe == 0) {
      quantize_nvfp4(q, x.data(), rows, cols, 1);
    } else {
      quantize_blockwise(q, x.data(), rows, cols, ElemFormat::e4m3, 1, 32);
    }
    double bias_nearest = 0, bias_sr = 0;
    for (int64_t i = 0; i < n; ++i) {
      bias_nearest += (q.value(i / cols, i % cols) - x[i]) / gap[i];
      bias_sr += (mean[i] - x[i]) / gap[i];
    }
    EXPECT_GT(std::abs(bias_nearest) / n, 0.05) << recipe;
    EXPECT_LT(std::abs(bias_sr) / n, 0.01) << recipe;
  }
}

TEST(Quantize, StochasticRoundingIsKeyedByGlobalIndex) {
  const int64_t rows = 24, cols = 96;
  const std::vector<float> x = test_matrix(rows, cols, 6);
  const StochasticRounding sr{true, 9, 3, 77};
  QuantizedTensor full, a, b;
  quantize_mxfp8(full, x.data(), rows, cols, ElemFormat::e5m2, ScaleRounding::up, 32, sr);
  quantize_mxfp8(a, x.data(), rows, cols, ElemFormat::e5m2, ScaleRounding::up, 32, sr);
  EXPECT_EQ(full.codes, a.codes);
  // Another step, another tensor: other draws.
  quantize_mxfp8(a, x.data(), rows, cols, ElemFormat::e5m2, ScaleRounding::up, 32, {true, 9, 4, 77});
  EXPECT_NE(full.codes, a.codes);
  quantize_mxfp8(a, x.data(), rows, cols, ElemFormat::e5m2, ScaleRounding::up, 32, {true, 9, 3, 78});
  EXPECT_NE(full.codes, a.codes);
  // A shard of rows [8, 24) and a shard of columns [32, 96) draw what the full tensor drew.
  quantize_mxfp8(a, x.data() + 8 * cols, 16, cols, ElemFormat::e5m2, ScaleRounding::up, 32,
                 {true, 9, 3, 77, 8 * cols});
  EXPECT_TRUE(std::equal(a.codes.begin(), a.codes.end(), full.codes.begin() + 8 * cols));
  std::vector<float> right(rows * 64);
  for (int64_t r = 0; r < rows; ++r) std::copy_n(x.data() + r * cols + 32, 64, right.data() + r * 64);
  quantize_mxfp8(b, right.data(), rows, 64, ElemFormat::e5m2, ScaleRounding::up, 32, {true, 9, 3, 77, 32, cols});
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < 64; ++c) ASSERT_EQ(b.code(r, c), full.code(r, c + 32)) << r << "," << c;
  }
}

TEST(Quantize, BitwiseIndependentOfThreads) {
  const int64_t rows = 64, cols = 160;
  const std::vector<float> x = test_matrix(rows, cols, 7);
  const StochasticRounding sr{true, 5, 2, 1};
  auto run_all = [&] {
    std::vector<QuantizedTensor> out(7);
    quantize_tensorwise(out[0], x.data(), rows, cols, ElemFormat::e4m3, 10.0f, sr);
    quantize_blockwise(out[1], x.data(), rows, cols, ElemFormat::e4m3, 1, 128, sr);
    quantize_blockwise(out[2], x.data(), rows, cols, ElemFormat::e5m2, 32, 32);
    quantize_mxfp8(out[3], x.data(), rows, cols, ElemFormat::e4m3, ScaleRounding::down, 32, sr);
    quantize_nvfp4(out[4], x.data(), rows, cols, 1, sr);
    quantize_nvfp4(out[5], x.data(), rows, cols, 16);
    quantize_blockwise(out[6], x.data(), rows, cols, ElemFormat::e4m3, 16, 1, sr);  // a scale per column
    out[6].tensor_scale = amax(x.data(), rows * cols);  // amax's parts, over the threads
    return out;
  };
  std::vector<QuantizedTensor> one, two, three;
  with_threads(1, [&] { one = run_all(); });
  with_threads(2, [&] { two = run_all(); });
  with_threads(3, [&] { three = run_all(); });
  for (size_t i = 0; i < one.size(); ++i) {
    for (const auto* other : {&two[i], &three[i]}) {
      EXPECT_EQ(one[i].codes, other->codes) << i;
      EXPECT_EQ(one[i].scale_codes, other->scale_codes) << i;
      EXPECT_TRUE(bitwise_equal(one[i].scales, other->scales)) << i;
      EXPECT_EQ(std::bit_cast<uint32_t>(one[i].tensor_scale), std::bit_cast<uint32_t>(other->tensor_scale));
    }
  }
}

TEST(Quantize, StorageIsWhatTheFormatsCost) {
  const std::vector<float> x = test_matrix(32, 256, 8);
  QuantizedTensor q;
  quantize_mxfp8(q, x.data(), 32, 256, ElemFormat::e4m3);
  EXPECT_EQ(q.storage_bytes(), 32 * 256 + 32 * 8);  // 8.25 bits per element
  quantize_nvfp4(q, x.data(), 32, 256);
  EXPECT_EQ(q.storage_bytes(), 32 * 128 + 32 * 16 + 4);  // 4.5 bits per element + tensor scale
  quantize_blockwise(q, x.data(), 32, 256, ElemFormat::e4m3, 1, 128);
  EXPECT_EQ(q.storage_bytes(), 32 * 256 + 32 * 2 * 4);
}

TEST(Hadamard, IsOrthogonalWithEntriesOfAQuarter) {
  // Q is the transform of the identity (rows axis: column k of the output is Q e_k).
  std::vector<float> I(256, 0.0f), Q(256);
  for (int i = 0; i < 16; ++i) I[i * 16 + i] = 1.0f;
  hadamard16(Q.data(), I.data(), 16, 16, HadamardAxis::rows);
  int negatives = 0;
  for (int i = 0; i < 16; ++i) {
    for (int j = 0; j < 16; ++j) {
      ASSERT_EQ(std::abs(Q[i * 16 + j]), 0.25f);
      double dot = 0;
      for (int k = 0; k < 16; ++k) dot += double(Q[i * 16 + k]) * Q[j * 16 + k];
      ASSERT_EQ(dot, i == j ? 1.0 : 0.0) << i << "," << j;
    }
  }
  for (float s : hadamard16_signs()) negatives += s < 0;
  EXPECT_GT(negatives, 0);  // a random sign vector, not all +1
  EXPECT_LT(negatives, 16);
  // Q = H16 diag(s) / 4 by the definition.
  for (int i = 0; i < 16; ++i) {
    for (int k = 0; k < 16; ++k) {
      const float h = (__builtin_popcount(i & k) & 1) ? -1.0f : 1.0f;
      ASSERT_EQ(Q[i * 16 + k], h * hadamard16_signs()[k] * 0.25f);
    }
  }
}

TEST(Hadamard, MatchesTheMatrixProductAndBothAxesAgree) {
  const int64_t rows = 48, cols = 20;
  const std::vector<float> x = testing::randn(rows * cols, 9, "hadamard");
  std::vector<float> y(rows * cols), xt(cols * rows), yt(cols * rows);
  hadamard16(y.data(), x.data(), rows, cols, HadamardAxis::rows);
  std::vector<double> ref(rows * cols, 0.0);
  for (int64_t g = 0; g < rows / 16; ++g) {
    for (int i = 0; i < 16; ++i) {
      for (int k = 0; k < 16; ++k) {
        const double q = ((__builtin_popcount(i & k) & 1) ? -0.25 : 0.25) * hadamard16_signs()[k];
        for (int64_t j = 0; j < cols; ++j) ref[(g * 16 + i) * cols + j] += q * x[(g * 16 + k) * cols + j];
      }
    }
  }
  EXPECT_TRUE(testing::all_close(y, ref, 1e-6, 1e-6, "hadamard rows"));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) xt[c * rows + r] = x[r * cols + c];
  }
  hadamard16(yt.data(), xt.data(), cols, rows, HadamardAxis::cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) ASSERT_EQ(yt[c * rows + r], y[r * cols + c]);
  }
  // In place, and any thread count: the same bits.
  std::vector<float> z = x;
  with_threads(3, [&] { hadamard16(z.data(), z.data(), rows, cols, HadamardAxis::rows); });
  EXPECT_TRUE(bitwise_equal(z, y));
  EXPECT_THROW(hadamard16(z.data(), x.data(), 40, cols, HadamardAxis::rows), InternalError);
}

TEST(Hadamard, CancelsInTheWeightGradient) {
  // dW = dY^T X over T tokens; with Q applied to both along tokens: (Q dY)^T (Q X) = dY^T X.
  const int64_t T = 64, N = 24, K = 40;
  const std::vector<float> dy = testing::randn(T * N, 10, "dy"), x = testing::randn(T * K, 10, "x");
  std::vector<float> qdy(T * N), qx(T * K);
  hadamard16(qdy.data(), dy.data(), T, N, HadamardAxis::rows);
  hadamard16(qx.data(), x.data(), T, K, HadamardAxis::rows);
  std::vector<float> dw(N * K, 0.0f);
  std::vector<double> ref(N * K, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) {
      double a = 0, b = 0;
      for (int64_t t = 0; t < T; ++t) {
        a += double(qdy[t * N + n]) * qx[t * K + k];
        b += double(dy[t * N + n]) * x[t * K + k];
      }
      dw[n * K + k] = static_cast<float>(a);
      ref[n * K + k] = b;
    }
  }
  EXPECT_TRUE(testing::all_close(dw, ref, 1e-5, 1e-5, "transformed dW"));
}

}  // namespace
}  // namespace lockstep
