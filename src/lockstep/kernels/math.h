// The scalar elementary functions of the kernels, host and device (LOCKSTEP_HD, core/hd.h).
//
// Each function performs exactly specified IEEE operations in a fixed order (explicit FMAs, no
// libm), so it gives the same bits on the CPU, in the AVX2 lanes of kernels/cpu/vecmath.h (which
// mirror these forms lane by lane) and on a GPU compiled with -fmad=false -ftz=false
// -prec-div=true (see core/hd.h). These are the kernels' own approximations, not glibc's: for the
// functions bit-exact with std::exp / std::log use core/libm.h.
//
// exp(x): x < -87.3 gives exactly 0 (so exp(-inf) = 0 in masked softmax); x is clamped at 88.3
// above; NaN stays NaN (a diverging run must show NaN, not a tiny number). Range reduction
// x = n*ln2 + r, |r| <= ln2/2, Cephes' degree-6 polynomial, then 2^n from the exponent bits.
// Accuracy: within 2 ulp of the true value on [-87.3, 88.3].
#pragma once

#include <cstdint>

#include "lockstep/core/hd.h"

namespace lockstep::vm {

inline constexpr float kExpLo = -87.3f;
inline constexpr float kExpHi = 88.3f;
inline constexpr float kLog2e = 1.44269504088896341f;
inline constexpr float kLn2Hi = 0.693359375f;
inline constexpr float kLn2Lo = -2.12194440e-4f;
inline constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                       kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

LOCKSTEP_HD inline float exp(float x) {
  const bool underflow = x < kExpLo;
  // The clamps mirror _mm256_max_ps(lo, x) and _mm256_min_ps(hi, x), which pass a NaN x through.
  x = kExpLo > x ? kExpLo : x;
  x = kExpHi < x ? kExpHi : x;
  const float n = hd::rint(x * kLog2e);
  float r = hd::fma(n, -kLn2Hi, x);
  r = hd::fma(n, -kLn2Lo, r);
  float p = kP0;
  p = hd::fma(p, r, kP1);
  p = hd::fma(p, r, kP2);
  p = hd::fma(p, r, kP3);
  p = hd::fma(p, r, kP4);
  p = hd::fma(p, r, kP5);
  const float r2 = r * r;
  p = hd::fma(p, r2, r) + 1.0f;
  // A NaN n must not reach the integer conversion (undefined); p is NaN then anyway.
  const int32_t ni = n == n ? static_cast<int32_t>(n) : 0;
  const float scale = hd::bit_cast<float>((ni + 127) << 23);
  return underflow ? 0.0f : p * scale;
}

// Logistic sigmoid 1 / (1 + exp(-x)).
LOCKSTEP_HD inline float sigmoid(float x) { return 1.0f / (1.0f + exp(-x)); }

// The horizontal-sum order of vecmath.h's hsum(__m256) for 8 scalar partial sums: lanes
// (0+4, 1+5, 2+6, 3+7), then (0+2, 1+3), then (0+1).
LOCKSTEP_HD inline float hsum8(const float* p) {
  const float a0 = p[0] + p[4], a1 = p[1] + p[5], a2 = p[2] + p[6], a3 = p[3] + p[7];
  const float b0 = a0 + a2, b1 = a1 + a3;
  return b0 + b1;
}

// Lane-generic kernel bodies (vecmath.h): a formula written once as a template over the lane type
// V computes the same bits for an element with V = float (here, and on a device) as with V =
// __m256 (vecmath.h adds those overloads).
template <class V>
V load(const float* p);
template <>
LOCKSTEP_HD inline float load<float>(const float* p) {
  return *p;
}
template <class V>
V splat(float x);
template <>
LOCKSTEP_HD inline float splat<float>(float x) {
  return x;
}
LOCKSTEP_HD inline void store(float* p, float v) { *p = v; }
LOCKSTEP_HD inline float fma(float a, float b, float c) { return hd::fma(a, b, c); }

}  // namespace lockstep::vm
