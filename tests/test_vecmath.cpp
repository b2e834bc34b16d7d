#include "lockstep/kernels/cpu/vecmath.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "testing.h"

namespace lockstep {
namespace {

// Error of got against the exact ref, in units of the last place of a float at ref (normal range).
double ulp_error(float got, double ref) {
  int e = 0;
  std::frexp(ref, &e);
  return std::abs(static_cast<double>(got) - ref) / std::ldexp(1.0, e - 24);
}

// A dense sweep of [lo, hi]: evenly spaced values, plus every 1021st float bit pattern (dense near
// zero, where even spacing is sparse).
std::vector<float> sweep(float lo, float hi) {
  std::vector<float> v;
  constexpr int kEven = 1 << 20;
  for (int i = 0; i <= kEven; ++i) {
    v.push_back(static_cast<float>(lo + (static_cast<double>(hi) - lo) * i / kEven));
  }
  for (float end : {lo, hi}) {
    const uint32_t top = std::bit_cast<uint32_t>(std::abs(end));
    const uint32_t sign = end < 0 ? 0x80000000u : 0u;
    for (uint32_t b = 0; b <= top; b += 1021) v.push_back(std::bit_cast<float>(b | sign));
  }
  return v;
}

TEST(VecMath, ExpWithinTwoUlpOnItsRange) {
  double worst = 0;
  float worst_x = 0;
  for (float x : sweep(vm::kExpLo, vm::kExpHi)) {
    const double err = ulp_error(vm::exp(x), std::exp(static_cast<double>(x)));
    if (err > worst) {
      worst = err;
      worst_x = x;
    }
  }
  EXPECT_LE(worst, 2.0) << "at x = " << worst_x;
  std::printf("vm::exp max error %.3f ulp (at x = %.9g)\n", worst, worst_x);
}

TEST(VecMath, ExpUnderflowsToZeroAndClampsAbove) {
  EXPECT_EQ(vm::exp(-std::numeric_limits<float>::infinity()), 0.0f);
  for (float x : {-87.31f, -88.0f, -100.0f, -1e4f, -1e30f, std::numeric_limits<float>::lowest()}) {
    EXPECT_EQ(vm::exp(x), 0.0f) << "x = " << x;
  }
  EXPECT_EQ(vm::exp(0.0f), 1.0f);
  EXPECT_EQ(vm::exp(-0.0f), 1.0f);
  EXPECT_GT(vm::exp(vm::kExpLo), 0.0f);
  // Clamped, never inf: a softmax over huge logits stays finite.
  for (float x : {88.72f, 1e30f, std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(vm::exp(x), vm::exp(vm::kExpHi)) << "x = " << x;
  }
  EXPECT_TRUE(std::isfinite(vm::exp(vm::kExpHi)));
}

TEST(VecMath, NaNPropagates) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(vm::exp(nan)));
  EXPECT_TRUE(std::isnan(vm::sigmoid(nan)));
#ifdef LOCKSTEP_AVX2
  float out[8];
  _mm256_storeu_ps(out, vm::exp(_mm256_set1_ps(nan)));
  EXPECT_TRUE(std::isnan(out[0]));
  _mm256_storeu_ps(out, vm::sigmoid(_mm256_set1_ps(nan)));
  EXPECT_TRUE(std::isnan(out[0]));
#endif
}

TEST(VecMath, SigmoidAccuracy) {
  double worst = 0;
  float worst_x = 0;
  for (float x : sweep(-87.0f, 88.0f)) {
    const double ref = 1.0 / (1.0 + std::exp(-static_cast<double>(x)));
    const double err = ulp_error(vm::sigmoid(x), ref);
    if (err > worst) {
      worst = err;
      worst_x = x;
    }
  }
  EXPECT_LE(worst, 4.0) << "at x = " << worst_x;
  std::printf("vm::sigmoid max error %.3f ulp (at x = %.9g)\n", worst, worst_x);
  // Below the range exp(-x) is clamped: the result is tiny, not exact.
  for (float x : {-90.0f, -1e3f, -std::numeric_limits<float>::infinity()}) {
    EXPECT_LT(vm::sigmoid(x), 1e-38f) << "x = " << x;
    EXPECT_GE(vm::sigmoid(x), 0.0f) << "x = " << x;
  }
  EXPECT_EQ(vm::sigmoid(100.0f), 1.0f);
  EXPECT_EQ(vm::sigmoid(std::numeric_limits<float>::infinity()), 1.0f);
  EXPECT_EQ(vm::sigmoid(0.0f), 0.5f);
}

#ifdef LOCKSTEP_AVX2
// Special and boundary values for the bitwise and edge-case checks.
std::vector<float> edge_values() {
  using lim = std::numeric_limits<float>;
  constexpr float inf = lim::infinity();
  std::vector<float> v = {0.0f,   -0.0f, inf,   -inf,   lim::denorm_min(), -lim::denorm_min(), lim::min(),
                          88.72f, 89.0f, 1e30f, -1e30f, lim::max(),        lim::lowest()};
  for (float b : {vm::kExpLo, vm::kExpHi, -0.5f * 0.693147f, 0.5f * 0.693147f}) {
    float lo = b, hi = b;
    for (int i = 0; i < 4; ++i) {
      v.push_back(lo = std::nextafter(lo, -inf));
      v.push_back(hi = std::nextafter(hi, inf));
    }
    v.push_back(b);
  }
  return v;
}

// The AVX2 forms compute exactly the bits of the scalar forms, lane by lane.
TEST(VecMath, Avx2MatchesScalarBitwise) {
  std::vector<float> xs = sweep(-100.0f, 100.0f);
  const std::vector<float> edges = edge_values();
  xs.insert(xs.end(), edges.begin(), edges.end());
  xs.resize((xs.size() + 7) / 8 * 8, 1.0f);
  std::vector<float> ve(xs.size()), vs(xs.size()), se(xs.size()), ss(xs.size());
  for (size_t i = 0; i < xs.size(); i += 8) {
    const __m256 x = _mm256_loadu_ps(&xs[i]);
    _mm256_storeu_ps(&ve[i], vm::exp(x));
    _mm256_storeu_ps(&vs[i], vm::sigmoid(x));
  }
  for (size_t i = 0; i < xs.size(); ++i) {
    se[i] = vm::exp(xs[i]);
    ss[i] = vm::sigmoid(xs[i]);
  }
  EXPECT_TRUE(testing::bitwise_equal(ve, se, "exp"));
  EXPECT_TRUE(testing::bitwise_equal(vs, ss, "sigmoid"));
}

TEST(VecMath, HorizontalReductionsFollowTheDocumentedOrder) {
  // Values whose float sum depends on the order: only the documented order gives `want`.
  alignas(32) const float v[8] = {1e8f, 1.0f, -3.0f, 7.5f, -1e8f, 0.25f, 5.0f, -2.0f};
  EXPECT_EQ(std::bit_cast<uint32_t>(vm::hsum(_mm256_load_ps(v))), std::bit_cast<uint32_t>(vm::hsum8(v)));
  const float a0 = v[0] + v[4], a1 = v[1] + v[5], a2 = v[2] + v[6], a3 = v[3] + v[7];
  EXPECT_EQ(vm::hsum8(v), (a0 + a2) + (a1 + a3));
  EXPECT_EQ(vm::hmax(_mm256_load_ps(v)), 1e8f);
}
#endif

}  // namespace
}  // namespace lockstep
