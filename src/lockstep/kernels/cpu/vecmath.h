// Elementary functions with exactly specified arithmetic: each scalar function and its AVX2 twin
// perform the same IEEE operations in the same order (explicit FMAs, no libm), so a value is
// bitwise the same whether a kernel computes it in a vector lane or in a scalar tail loop, and
// whatever the thread split. Accuracy: exp within 2 ulp of the true value on [-87.3, 88.3].
//
// exp(x): x < -87.3 gives exactly 0 (so exp(-inf) = 0 in masked softmax); x is clamped at 88.3
// above; NaN stays NaN (a diverging run must show NaN, not a tiny number). Range reduction x = n*ln2 + r, |r| <= ln2/2, Cephes' degree-6 polynomial, then 2^n from
// the exponent bits.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LOCKSTEP_AVX2 1
#endif

namespace lockstep::vm {

inline constexpr float kExpLo = -87.3f;
inline constexpr float kExpHi = 88.3f;
inline constexpr float kLog2e = 1.44269504088896341f;
inline constexpr float kLn2Hi = 0.693359375f;
inline constexpr float kLn2Lo = -2.12194440e-4f;
inline constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f,
                       kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

inline float exp(float x) {
  const bool underflow = x < kExpLo;
  // The clamps mirror _mm256_max_ps(lo, x) and _mm256_min_ps(hi, x), which pass a NaN x through.
  x = kExpLo > x ? kExpLo : x;
  x = kExpHi < x ? kExpHi : x;
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fma(n, -kLn2Hi, x);
  r = std::fma(n, -kLn2Lo, r);
  float p = kP0;
  p = std::fma(p, r, kP1);
  p = std::fma(p, r, kP2);
  p = std::fma(p, r, kP3);
  p = std::fma(p, r, kP4);
  p = std::fma(p, r, kP5);
  const float r2 = r * r;
  p = std::fma(p, r2, r) + 1.0f;
  // A NaN n must not reach the integer conversion (undefined); p is NaN then anyway.
  const int32_t ni = n == n ? static_cast<int32_t>(n) : 0;
  const float scale = std::bit_cast<float>((ni + 127) << 23);
  return underflow ? 0.0f : p * scale;
}

// Logistic sigmoid 1 / (1 + exp(-x)).
inline float sigmoid(float x) { return 1.0f / (1.0f + exp(-x)); }

#ifdef LOCKSTEP_AVX2
inline __m256 exp(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(kExpLo), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_set1_ps(kExpHi), _mm256_max_ps(_mm256_set1_ps(kExpLo), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kP0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
  const __m256 r2 = _mm256_mul_ps(r, r);
  p = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(underflow, y);
}

inline __m256 sigmoid(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 neg = _mm256_xor_ps(x, _mm256_set1_ps(-0.0f));
  return _mm256_div_ps(one, _mm256_add_ps(one, exp(neg)));
}

// Horizontal sums in one fixed order: lanes (0+4, 1+5, 2+6, 3+7), then (0+2, 1+3), then (0+1).
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// kernels/cpu/quantize.h scaled() in lanes: d x s, or s where s is a NaN (a quantised block's
// multiplier or scale), whatever the operand order of the product.
inline __m256 scaled(__m256 d, __m256 s) {
  return _mm256_blendv_ps(_mm256_mul_ps(d, s), s, _mm256_cmp_ps(s, s, _CMP_UNORD_Q));
}
#endif

// The same horizontal-sum order for 8 scalar partial sums, for portable paths that mirror an
// AVX2 reduction lane by lane.
inline float hsum8(const float* p) {
  const float a0 = p[0] + p[4], a1 = p[1] + p[5], a2 = p[2] + p[6], a3 = p[3] + p[7];
  const float b0 = a0 + a2, b1 = a1 + a3;
  return b0 + b1;
}

// Lane-generic kernel bodies: write a formula once as a template over the lane type V (float, or
// __m256 under AVX2) and both instantiations compute the same bits for an element. GCC's vector
// extensions give __m256 the operators + - * / and unary minus, one IEEE operation per lane (a
// float operand is broadcast); these overloads supply the rest.
template <class V> V load(const float* p);
template <> inline float load<float>(const float* p) { return *p; }
template <class V> V splat(float x);
template <> inline float splat<float>(float x) { return x; }
inline void store(float* p, float v) { *p = v; }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
#ifdef LOCKSTEP_AVX2
template <> inline __m256 load<__m256>(const float* p) { return _mm256_loadu_ps(p); }
template <> inline __m256 splat<__m256>(float x) { return _mm256_set1_ps(x); }
inline void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline __m256 fma(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
#endif

// f(i, V{}) over [begin, end): with V = __m256 for elements i..i+7 while 8 remain (AVX2), then
// with V = float for each remaining element.
template <class F>
inline void for_lanes(int64_t begin, int64_t end, F&& f) {
  int64_t i = begin;
#ifdef LOCKSTEP_AVX2
  for (; i + 8 <= end; i += 8) f(i, __m256{});
#endif
  for (; i < end; ++i) f(i, 0.0f);
}

}  // namespace lockstep::vm
