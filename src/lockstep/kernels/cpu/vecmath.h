// The AVX2 forms of the elementary functions of kernels/math.h: each performs the same IEEE
// operations in the same order as its scalar twin there (explicit FMAs, no libm), so a value is
// bitwise the same whether a kernel computes it in a vector lane or in a scalar tail loop, and
// whatever the thread split. Plus the horizontal reductions and the lane-generic loop for_lanes.
#pragma once

#include <cstdint>

#include "lockstep/kernels/math.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LOCKSTEP_AVX2 1
#endif

namespace lockstep::vm {

#ifdef LOCKSTEP_AVX2
inline __m256 exp(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(kExpLo), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_set1_ps(kExpHi), _mm256_max_ps(_mm256_set1_ps(kExpLo), x));
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
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

// Lane-generic kernel bodies: write a formula once as a template over the lane type V (float, or
// __m256 under AVX2) and both instantiations compute the same bits for an element. GCC's vector
// extensions give __m256 the operators + - * / and unary minus, one IEEE operation per lane (a
// float operand is broadcast); kernels/math.h has the float overloads, these the __m256 ones.
#ifdef LOCKSTEP_AVX2
template <>
inline __m256 load<__m256>(const float* p) {
  return _mm256_loadu_ps(p);
}
template <>
inline __m256 splat<__m256>(float x) {
  return _mm256_set1_ps(x);
}
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
