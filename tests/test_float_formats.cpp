// FP8 E4M3 / E5M2, FP4 E2M1 and E8M0: every code against a value computed independently in double,
// and encode against a brute-force nearest-code search in double.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "lockstep/core/float_formats.h"
#include "lockstep/core/philox.h"

namespace lockstep {
namespace {

struct Spec {
  ElemFormat f;
  int E, M, bias;
  int codes;  // 256, or 16 for E2M1
};
const Spec kSpecs[] = {
    {ElemFormat::e4m3, 4, 3, 7, 256}, {ElemFormat::e5m2, 5, 2, 15, 256}, {ElemFormat::e2m1, 2, 1, 1, 16}};

// The value of a code from the formats' definitions, in double (NaN for NaN codes).
double reference_value(const Spec& s, int code) {
  const int sign = (code >> (s.E + s.M)) & 1;
  const int exp = (code >> s.M) & ((1 << s.E) - 1);
  const int mant = code & ((1 << s.M) - 1);
  const int emax_field = (1 << s.E) - 1;
  double v;
  if (s.f == ElemFormat::e4m3 && exp == emax_field && mant == (1 << s.M) - 1) return std::nan("");
  if (s.f == ElemFormat::e5m2 && exp == emax_field) {
    if (mant != 0) return std::nan("");
    v = HUGE_VAL;
  } else if (exp == 0) {
    v = mant / std::pow(2.0, s.M) * std::pow(2.0, 1 - s.bias);
  } else {
    v = (1.0 + mant / std::pow(2.0, s.M)) * std::pow(2.0, exp - s.bias);
  }
  return sign ? -v : v;
}

bool same_value(double a, float b) {
  if (std::isnan(a)) return std::isnan(b);
  return a == static_cast<double>(b) && std::signbit(a) == std::signbit(b);
}

TEST(FloatFormats, EveryCodeDecodesToItsDefinedValue) {
  for (const Spec& s : kSpecs) {
    for (int c = 0; c < 256; ++c) {
      const double want = reference_value(s, c % s.codes);
      EXPECT_TRUE(same_value(want, decode(s.f, static_cast<uint8_t>(c))))
          << elem_format_name(s.f) << " code " << c << ": " << decode(s.f, static_cast<uint8_t>(c)) << " vs " << want;
      EXPECT_TRUE(same_value(want, decode_table(s.f)[c]));
    }
  }
  // Landmarks of the specs.
  EXPECT_EQ(decode_e4m3(0x7E), 448.0f);
  EXPECT_EQ(decode_e4m3(0x38), 1.0f);
  EXPECT_EQ(decode_e4m3(0x08), 0x1p-6f);  // smallest normal
  EXPECT_EQ(decode_e4m3(0x01), 0x1p-9f);  // smallest subnormal
  EXPECT_TRUE(std::isnan(decode_e4m3(0x7F)) && std::isnan(decode_e4m3(0xFF)));
  EXPECT_EQ(decode_e4m3(0x78), 256.0f);  // E4M3 has no infinity: S.1111.000 is a number
  EXPECT_EQ(decode_e5m2(0x7B), 57344.0f);
  EXPECT_EQ(decode_e5m2(0x3C), 1.0f);
  EXPECT_EQ(decode_e5m2(0x01), 0x1p-16f);
  EXPECT_EQ(decode_e5m2(0x7C), std::numeric_limits<float>::infinity());
  EXPECT_EQ(decode_e5m2(0xFC), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(decode_e5m2(0x7D)) && std::isnan(decode_e5m2(0x7E)) && std::isnan(decode_e5m2(0x7F)));
  const float e2m1[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int c = 0; c < 8; ++c) {
    EXPECT_EQ(decode_e2m1(static_cast<uint8_t>(c)), e2m1[c]);
    EXPECT_EQ(decode_e2m1(static_cast<uint8_t>(c | 8)), -e2m1[c]);
  }
  EXPECT_TRUE(std::signbit(decode_e4m3(0x80)) && decode_e4m3(0x80) == 0.0f);  // -0
  EXPECT_TRUE(std::signbit(decode_e2m1(0x8)));
}

TEST(FloatFormats, EveryFiniteCodeRoundTrips) {
  for (const Spec& s : kSpecs) {
    for (int c = 0; c < s.codes; ++c) {
      const float v = decode(s.f, static_cast<uint8_t>(c));
      if (std::isnan(v)) continue;
      const Overflow o = std::isinf(v) ? Overflow::nonfinite : Overflow::saturate;
      EXPECT_EQ(encode(s.f, v, o), c) << elem_format_name(s.f) << " " << v;
    }
  }
}

// The nearest finite code of x's sign in double, ties to the code with an even mantissa: what
// encode(x, saturate) must give (saturation is "nearest finite" too).
int brute_force_nearest(const Spec& s, float x) {
  const int sign = std::signbit(x) ? 1 << (s.E + s.M) : 0;
  if (std::abs(static_cast<double>(x)) >= max_finite(s.f))
    return sign | (s.f == ElemFormat::e4m3 ? 0x7E : s.f == ElemFormat::e5m2 ? 0x7B : 0x7);
  int best = -1;
  double best_d = 0;
  for (int mag = 0; mag < s.codes / 2; ++mag) {
    const double v = reference_value(s, sign | mag);
    if (!std::isfinite(v)) continue;
    const double d = std::abs(v - static_cast<double>(x));
    if (best < 0 || d < best_d || (d == best_d && (mag & 1) == 0)) {
      best = sign | mag;
      best_d = d;
    }
  }
  return best;
}

// Positive finite values of the format in increasing order.
std::vector<double> positive_values(const Spec& s) {
  std::vector<double> v;
  for (int mag = 0; mag < s.codes / 2; ++mag) {
    const double x = reference_value(s, mag);
    if (std::isfinite(x)) v.push_back(x);
  }
  return v;
}

TEST(FloatFormats, EncodeRoundsToNearestEvenLikeABruteForceSearch) {
  for (const Spec& s : kSpecs) {
    std::vector<float> xs;
    const std::vector<double> v = positive_values(s);
    for (size_t i = 0; i + 1 < v.size(); ++i) {
      const auto mid = static_cast<float>((v[i] + v[i + 1]) / 2);  // exact in fp32
      ASSERT_EQ(static_cast<double>(mid), (v[i] + v[i + 1]) / 2);
      for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f), static_cast<float>(v[i]),
                      std::nextafter(static_cast<float>(v[i + 1]), 0.0f)}) {
        xs.push_back(x);
        xs.push_back(-x);
      }
    }
    const RandomStream rng(7, purpose_id("float_formats/encode"));
    for (int i = 0; i < 20000; ++i) {  // log-uniform over the whole range, and beyond it
      const float x = std::ldexp(1.0f + rng.uniform(2 * i), static_cast<int>(rng.bits(2 * i + 1) % 40) - 24);
      xs.push_back(i % 2 ? x : -x);
    }
    for (float x : {0.0f, -0.0f, 1e-30f, -1e-45f, 1e30f, -3e38f}) xs.push_back(x);
    for (float x : xs) {
      ASSERT_EQ(encode(s.f, x), brute_force_nearest(s, x)) << elem_format_name(s.f) << " x=" << x;
    }
  }
}

TEST(FloatFormats, TiesGoToTheEvenCode) {
  EXPECT_EQ(encode_e4m3(1.0625f), 0x38);  // between 1 (0x38) and 1.125 (0x39)
  EXPECT_EQ(encode_e4m3(1.1875f), 0x3A);  // between 1.125 (0x39) and 1.25 (0x3A)
  EXPECT_EQ(encode_e4m3(-1.0625f), 0xB8);
  EXPECT_EQ(encode_e4m3(0x1p-10f), 0x00);  // half the smallest subnormal: to zero
  EXPECT_EQ(encode_e4m3(0x3p-10f), 0x02);  // 1.5 subnormal quanta: up to 2
  EXPECT_EQ(encode_e4m3(0xFp-10f), 0x08);  // 7.5 quanta: up to the smallest normal
  EXPECT_EQ(encode_e5m2(1.125f), 0x3C);    // between 1 and 1.25
  EXPECT_EQ(encode_e5m2(1.375f), 0x3E);    // between 1.25 and 1.5
  EXPECT_EQ(encode_e2m1(2.5f), 0x4);       // between 2 (0x4) and 3 (0x5)
  EXPECT_EQ(encode_e2m1(3.5f), 0x6);       // between 3 and 4
  EXPECT_EQ(encode_e2m1(5.0f), 0x6);       // between 4 (0x6) and 6 (0x7)
  EXPECT_EQ(encode_e2m1(0.25f), 0x0);      // between 0 and 0.5
  EXPECT_EQ(encode_e2m1(0.75f), 0x2);      // between 0.5 and 1
  EXPECT_EQ(encode_e2m1(-1.25f), 0xA);
}

TEST(FloatFormats, OverflowSaturatesOrBecomesNonFinite) {
  const float inf = std::numeric_limits<float>::infinity();
  // E4M3: 448 is max; the tie with the (absent) 480 at 464 goes to 448, the even code.
  EXPECT_EQ(encode_e4m3(464.0f, Overflow::nonfinite), 0x7E);
  EXPECT_EQ(encode_e4m3(std::nextafter(464.0f, 1e9f), Overflow::nonfinite), 0x7F);
  EXPECT_EQ(encode_e4m3(-1e6f, Overflow::nonfinite), 0xFF);
  EXPECT_EQ(encode_e4m3(inf, Overflow::nonfinite), 0x7F);
  EXPECT_EQ(encode_e4m3(1e6f), 0x7E);
  EXPECT_EQ(encode_e4m3(-inf), 0xFE);
  // E5M2: the tie at 61440 between 57344 (odd mantissa) and 65536 goes up: to inf.
  EXPECT_EQ(encode_e5m2(std::nextafter(61440.0f, 0.0f), Overflow::nonfinite), 0x7B);
  EXPECT_EQ(encode_e5m2(61440.0f, Overflow::nonfinite), 0x7C);
  EXPECT_EQ(encode_e5m2(-61440.0f, Overflow::nonfinite), 0xFC);
  EXPECT_EQ(encode_e5m2(61440.0f), 0x7B);
  EXPECT_EQ(encode_e5m2(inf), 0x7B);
  EXPECT_EQ(encode_e5m2(-inf, Overflow::nonfinite), 0xFC);
  EXPECT_EQ(encode_e2m1(7.0f), 0x7);
  EXPECT_EQ(encode_e2m1(-1e30f), 0xF);
  EXPECT_EQ(encode_e2m1(-inf), 0xF);
}

TEST(FloatFormats, NaNAndSignedZero) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(encode_e4m3(nan), 0x7F);
  EXPECT_EQ(encode_e4m3(-nan), 0xFF);
  EXPECT_EQ(encode_e4m3(std::bit_cast<float>(0x7f800001u)), 0x7F);  // signalling NaN too
  EXPECT_TRUE(std::isnan(decode_e5m2(encode_e5m2(nan))));
  EXPECT_TRUE(std::isnan(decode_e5m2(encode_e5m2(nan, Overflow::nonfinite))));
  EXPECT_EQ(encode_e4m3(-0.0f), 0x80);
  EXPECT_EQ(encode_e5m2(-0.0f), 0x80);
  EXPECT_EQ(encode_e2m1(-0.0f), 0x8);
  EXPECT_EQ(encode_e4m3(-1e-4f), 0x80);                             // underflow keeps the sign
  EXPECT_EQ(encode_e4m3(std::bit_cast<float>(0x00000001u)), 0x00);  // fp32 subnormal input
}

TEST(FloatFormats, StochasticRoundingPicksANeighbourWithTheRightOdds) {
  const RandomStream rng(11, purpose_id("float_formats/sr"));
  const int n = 40000;
  // x = lo + p (hi - lo) for a few p, in the normal and subnormal ranges of each format.
  struct Case {
    ElemFormat f;
    float lo, hi, p;
  };
  for (const Case& c : {Case{ElemFormat::e4m3, 1.0f, 1.125f, 0.25f}, Case{ElemFormat::e4m3, 0x1p-9f, 0x2p-9f, 0.7f},
                        Case{ElemFormat::e5m2, 1024.0f, 1280.0f, 0.5f}, Case{ElemFormat::e2m1, 4.0f, 6.0f, 0.1f},
                        Case{ElemFormat::e2m1, 0.0f, 0.5f, 0.9f}}) {
    const float x = c.lo + c.p * (c.hi - c.lo);
    int up = 0;
    for (int i = 0; i < n; ++i) {
      const float v = decode(c.f, encode_stochastic(c.f, -x, rng.bits(i)));
      ASSERT_TRUE(v == -c.lo || v == -c.hi) << v;
      up += v == -c.hi;
    }
    const double p = static_cast<double>(x - c.lo) / (c.hi - c.lo), sd = std::sqrt(p * (1 - p) / n);
    EXPECT_NEAR(static_cast<double>(up) / n, p, 5 * sd) << elem_format_name(c.f) << " x=" << x;
  }
  // Representable values never move; above max saturates.
  for (uint32_t bits : {0u, 0x80000000u, 0xffffffffu}) {
    EXPECT_EQ(encode_stochastic(ElemFormat::e4m3, 448.0f, bits), 0x7E);
    EXPECT_EQ(encode_stochastic(ElemFormat::e4m3, 1000.0f, bits), 0x7E);
    EXPECT_EQ(encode_stochastic(ElemFormat::e4m3, 1.0f, bits), 0x38);
    EXPECT_EQ(encode_stochastic(ElemFormat::e2m1, 1e9f, bits), 0x7);
  }
  // The rule "round up iff (bits >> 8) * 2^-24 < p", exactly.
  EXPECT_EQ(encode_stochastic(ElemFormat::e4m3, 1.0625f, (0x800000u - 1) << 8), 0x39);
  EXPECT_EQ(encode_stochastic(ElemFormat::e4m3, 1.0625f, 0x800000u << 8), 0x38);
}

TEST(FloatFormats, E8M0EveryCode) {
  for (int c = 0; c < 255; ++c) {
    const float v = decode_e8m0(static_cast<uint8_t>(c));
    EXPECT_EQ(static_cast<double>(v), std::pow(2.0, c - 127)) << c;
    for (ScaleRounding r : {ScaleRounding::down, ScaleRounding::up, ScaleRounding::nearest}) {
      EXPECT_EQ(encode_e8m0(v, r), c);
    }
  }
  EXPECT_TRUE(std::isnan(decode_e8m0(0xFF)));
}

TEST(FloatFormats, E8M0Rounding) {
  using R = ScaleRounding;
  EXPECT_EQ(encode_e8m0(3.0f, R::down), 128);     // 2
  EXPECT_EQ(encode_e8m0(3.0f, R::up), 129);       // 4
  EXPECT_EQ(encode_e8m0(3.0f, R::nearest), 128);  // tie 1.5 * 2: code 128 is even
  EXPECT_EQ(encode_e8m0(6.0f, R::nearest), 130);  // tie 1.5 * 4: codes 129 | 130
  EXPECT_EQ(encode_e8m0(1.25f, R::nearest), 127);
  EXPECT_EQ(encode_e8m0(1.75f, R::nearest), 128);
  EXPECT_EQ(encode_e8m0(std::nextafter(2.0f, 0.0f), R::down), 127);
  EXPECT_EQ(encode_e8m0(std::nextafter(1.0f, 2.0f), R::up), 128);
  EXPECT_EQ(encode_e8m0(0.0f), 0);
  EXPECT_EQ(encode_e8m0(1e-40f, R::down), 0);  // below 2^-127: clamps
  EXPECT_EQ(encode_e8m0(3e38f, R::up), 254);   // above 2^127: clamps
  EXPECT_EQ(encode_e8m0(-1.0f), 0xFF);
  EXPECT_EQ(encode_e8m0(std::numeric_limits<float>::infinity()), 0xFF);
  EXPECT_EQ(encode_e8m0(std::numeric_limits<float>::quiet_NaN()), 0xFF);
}

}  // namespace
}  // namespace lockstep
