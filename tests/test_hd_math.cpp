// The host/device forms of the per-element math (core/hd.h) give the bits of the CPU code they
// replaced: the references below are the earlier host-only formulations (table decode via ldexp,
// E8M0 through frexp, the Hadamard butterflies over strips, Philox through std::array).
#include <gtest/gtest.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "lockstep/core/float_formats.h"
#include "lockstep/core/hd.h"
#include "lockstep/core/philox.h"
#include "lockstep/kernels/cpu/quantize.h"
#include "lockstep/kernels/hadamard.h"
#include "lockstep/kernels/math.h"
#include "lockstep/kernels/quantize.h"
#include "testing.h"

namespace lockstep {
namespace {

uint32_t bits(float x) { return std::bit_cast<uint32_t>(x); }

// decode() as the 256-entry tables were built before: ldexp of the integer significand.
float reference_decode(ElemFormat f, uint32_t code) {
  const int E = f == ElemFormat::e4m3 ? 4 : f == ElemFormat::e5m2 ? 5 : 2;
  const int M = f == ElemFormat::e4m3 ? 3 : f == ElemFormat::e5m2 ? 2 : 1;
  const int bias = f == ElemFormat::e4m3 ? 7 : f == ElemFormat::e5m2 ? 15 : 1;
  const uint32_t mag = code & ((1u << (E + M)) - 1);
  const bool negative = (code >> (E + M)) & 1u;
  const int exp = static_cast<int>(mag >> M);
  const uint32_t mant = mag & ((1u << M) - 1);
  float v;
  if (f == ElemFormat::e4m3 && mag == 0x7F) {
    v = std::numeric_limits<float>::quiet_NaN();
  } else if (f == ElemFormat::e5m2 && exp == 31) {
    v = mant == 0 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
  } else if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), 1 - bias - M);
  } else {
    v = std::ldexp(static_cast<float>((1u << M) | mant), exp - bias - M);
  }
  return negative ? -v : v;
}

TEST(HdMath, DecodeGivesTheBitsOfTheLdexpTables) {
  for (ElemFormat f : {ElemFormat::e4m3, ElemFormat::e5m2, ElemFormat::e2m1}) {
    for (uint32_t c = 0; c < 256; ++c) {
      const uint32_t want = bits(reference_decode(f, c));
      ASSERT_EQ(bits(decode(f, static_cast<uint8_t>(c))), want) << elem_format_name(f) << " " << c;
      ASSERT_EQ(bits(decode_table(f)[c]), want) << elem_format_name(f) << " " << c;
    }
  }
  for (uint32_t c = 0; c < 256; ++c) {
    const float want = c == 0xFF ? std::numeric_limits<float>::quiet_NaN()
                       : c == 0  ? 0x1p-127f
                                 : std::ldexp(1.0f, static_cast<int>(c) - 127);
    ASSERT_EQ(bits(decode_e8m0(static_cast<uint8_t>(c))), bits(want)) << c;
  }
}

// encode_e8m0 as it was: frexp, then the rounding rule on the fraction.
uint8_t reference_e8m0(float x, ScaleRounding rounding) {
  if (!(x >= 0.0f) || std::isinf(x)) return 0xFF;
  if (x == 0.0f) return 0;
  int e;
  const float m = std::frexp(x, &e);
  int k = e - 1;
  if (m != 0.5f) {
    switch (rounding) {
      case ScaleRounding::down:
        break;
      case ScaleRounding::up:
        ++k;
        break;
      case ScaleRounding::nearest:
        if (m > 0.75f || (m == 0.75f && ((k + 127) & 1))) ++k;
        break;
    }
  }
  k = k < -127 ? -127 : k > 127 ? 127 : k;
  return static_cast<uint8_t>(k + 127);
}

TEST(HdMath, EncodeE8m0GivesTheBitsOfFrexp) {
  std::vector<uint32_t> inputs;
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 1021) inputs.push_back(static_cast<uint32_t>(u));
  for (uint32_t u = 0; u < 0x01000000u; u += 7) inputs.push_back(u);  // subnormals and the first binades
  for (uint32_t u : {0x7f800000u, 0xff800000u, 0x7fc00000u, 0x80000000u, 0x3fc00000u, 0x3f400000u, 0x00400000u,
                     0x00600000u, 0x00200000u, 0x7f7fffffu})
    inputs.push_back(u);
  for (ScaleRounding r : {ScaleRounding::down, ScaleRounding::up, ScaleRounding::nearest}) {
    for (uint32_t u : inputs) {
      const float x = std::bit_cast<float>(u);
      ASSERT_EQ(encode_e8m0(x, r), reference_e8m0(x, r)) << std::hex << u << " rounding " << static_cast<int>(r);
    }
  }
}

// The Hadamard transform as the CPU kernel ran it before: sign, butterflies and scaling, each a
// pass over a strip of `width` columns.
void reference_hadamard_lanes(float* t, int64_t width) {
  const std::array<float, 16>& s = hadamard16_signs();
  for (int k = 0; k < 16; ++k)
    for (int64_t j = 0; j < width; ++j) t[k * width + j] *= s[k];
  for (int h = 1; h < 16; h *= 2) {
    for (int i = 0; i < 16; ++i) {
      if (i & h) continue;
      for (int64_t j = 0; j < width; ++j) {
        const float u = t[i * width + j], v = t[(i + h) * width + j];
        t[i * width + j] = u + v;
        t[(i + h) * width + j] = u - v;
      }
    }
  }
  for (int64_t j = 0; j < 16 * width; ++j) t[j] *= 0.25f;
}

TEST(HdMath, HadamardGivesTheBitsOfTheStripPasses) {
  const int64_t rows = 48, cols = 83;  // strips of 64 and 19 columns: vector lanes and a scalar tail
  std::vector<float> x = testing::randn(rows * cols, 3, "hd_math/hadamard", 100.0f);
  x[5] = std::numeric_limits<float>::infinity();
  x[200] = std::numeric_limits<float>::denorm_min();
  std::vector<float> want = x;
  for (int64_t g = 0; g < rows / 16; ++g) {
    for (int64_t c0 = 0; c0 < cols; c0 += 64) {
      const int64_t w = std::min<int64_t>(64, cols - c0);
      std::vector<float> t(static_cast<size_t>(16 * w));
      for (int k = 0; k < 16; ++k)
        for (int64_t j = 0; j < w; ++j) t[k * w + j] = x[(g * 16 + k) * cols + c0 + j];
      reference_hadamard_lanes(t.data(), w);
      for (int k = 0; k < 16; ++k)
        for (int64_t j = 0; j < w; ++j) want[(g * 16 + k) * cols + c0 + j] = t[k * w + j];
    }
  }
  std::vector<float> got(x.size());
  hadamard16(got.data(), x.data(), rows, cols, HadamardAxis::rows);
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(bits(got[i]), bits(want[i])) << i;

  // One vector through the HD function directly, and the column axis.
  float v[16];
  for (int k = 0; k < 16; ++k) v[k] = x[k * cols + 7];
  hadamard16_apply(v, hadamard16_signs().data());
  for (int k = 0; k < 16; ++k) ASSERT_EQ(bits(v[k]), bits(want[k * cols + 7])) << k;
  std::vector<float> xt(x.size()), gt(x.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) xt[c * rows + r] = x[r * cols + c];
  hadamard16(gt.data(), xt.data(), cols, rows, HadamardAxis::cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) ASSERT_EQ(bits(gt[c * rows + r]), bits(want[r * cols + c])) << r << " " << c;
}

TEST(HdMath, PhiloxBlockFormsAgree) {
  const RandomStream rng(0xfedcba9876543210ULL, purpose_id("hd_math/philox"));
  for (uint64_t b :
       {uint64_t{0}, uint64_t{1}, uint64_t{0xffffffff}, uint64_t{0x100000000}, uint64_t{0x123456789abcdef}}) {
    uint32_t w[4];
    rng.block(b, w);
    const std::array<uint32_t, 4> a = rng.block(b);
    const std::array<uint32_t, 4> p =
        philox4x32_10({static_cast<uint32_t>(rng.seed()), static_cast<uint32_t>(rng.seed() >> 32)},
                      {static_cast<uint32_t>(b), static_cast<uint32_t>(b >> 32), static_cast<uint32_t>(rng.purpose()),
                       static_cast<uint32_t>(rng.purpose() >> 32)});
    for (int j = 0; j < 4; ++j) {
      EXPECT_EQ(w[j], a[j]);
      EXPECT_EQ(w[j], p[j]);
      EXPECT_EQ(rng.bits(4 * b + j), w[j]);
      EXPECT_EQ(rng.uniform(4 * b + j), static_cast<float>(w[j] >> 8) * 0x1p-24f);
    }
  }
}

TEST(HdMath, HelpersAreExact) {
  EXPECT_EQ(hd::fma(0x1.000002p0f, 0x1.000002p0f, -1.0f), std::fma(0x1.000002p0f, 0x1.000002p0f, -1.0f));
  EXPECT_EQ(hd::rint(2.5f), 2.0f);
  EXPECT_EQ(hd::rint(-3.5f), -4.0f);
  EXPECT_EQ(hd::countl_zero(1u), 31);
  EXPECT_EQ(hd::countl_zero(0x80000000u), 0);
  EXPECT_TRUE(hd::is_nan(std::numeric_limits<float>::quiet_NaN()));
  EXPECT_FALSE(hd::is_nan(std::numeric_limits<float>::infinity()));
  EXPECT_TRUE(hd::is_inf(-std::numeric_limits<float>::infinity()));
  EXPECT_FALSE(hd::is_finite(std::numeric_limits<float>::infinity()));
  EXPECT_EQ(bits(hd::magnitude(-0.0f)), 0u);
  float p[8] = {1, 2, 3, 4, 5, 6, 7, 0x1p30f};
  EXPECT_EQ(vm::hsum8(p), ((1.0f + 5.0f) + (3.0f + 7.0f)) + ((2.0f + 6.0f) + (4.0f + 0x1p30f)));
}

}  // namespace
}  // namespace lockstep
