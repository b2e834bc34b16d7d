#include "lockstep/core/philox.h"

#include <cmath>
#include <numbers>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "lockstep/core/hash.h"
#include "lockstep/core/thread_pool.h"

namespace lockstep {

uint64_t purpose_id(std::string_view name) { return hash_bytes(name.data(), name.size()); }

uint64_t mix_purpose(uint64_t purpose, uint64_t value) { return hash_bytes(&value, sizeof value, purpose); }

void RandomStream::blocks8(uint64_t first_block, uint32_t* out) const {
#if defined(__AVX2__)
  // Lane i holds block first_block + i: the counter words c0..c3 and the rounds of
  // philox4x32_10_rounds, with each 32 x 32 -> 64 multiply done on the even lanes and on the odd
  // lanes.
  const uint64_t b = first_block;
  __m256i c0 = _mm256_setr_epi32(static_cast<int>(b), static_cast<int>(b + 1), static_cast<int>(b + 2),
                                 static_cast<int>(b + 3), static_cast<int>(b + 4), static_cast<int>(b + 5),
                                 static_cast<int>(b + 6), static_cast<int>(b + 7));
  __m256i c1 = _mm256_setr_epi32(static_cast<int>(b >> 32), static_cast<int>((b + 1) >> 32),
                                 static_cast<int>((b + 2) >> 32), static_cast<int>((b + 3) >> 32),
                                 static_cast<int>((b + 4) >> 32), static_cast<int>((b + 5) >> 32),
                                 static_cast<int>((b + 6) >> 32), static_cast<int>((b + 7) >> 32));
  __m256i c2 = _mm256_set1_epi32(static_cast<int>(purpose_)), c3 = _mm256_set1_epi32(static_cast<int>(purpose_ >> 32));
  uint32_t k0 = static_cast<uint32_t>(seed_), k1 = static_cast<uint32_t>(seed_ >> 32);
  using namespace philox_detail;
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(kM0)), m1 = _mm256_set1_epi32(static_cast<int>(kM1));
  const auto mulhilo8 = [](__m256i a, __m256i m, __m256i& hi, __m256i& lo) {
    const __m256i even = _mm256_mul_epu32(a, m), odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
    lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
    hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
  };
  for (int round = 0; round < 10; ++round) {
    __m256i hi0, lo0, hi1, lo1;
    mulhilo8(c0, m0, hi0, lo0);
    mulhilo8(c2, m1, hi1, lo1);
    c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), _mm256_set1_epi32(static_cast<int>(k0)));
    c1 = lo1;
    c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), _mm256_set1_epi32(static_cast<int>(k1)));
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  // Transpose (word, block) to (block, word).
  const __m256i t0 = _mm256_unpacklo_epi32(c0, c1), t1 = _mm256_unpackhi_epi32(c0, c1);
  const __m256i t2 = _mm256_unpacklo_epi32(c2, c3), t3 = _mm256_unpackhi_epi32(c2, c3);
  const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);  // blocks 0 4, 1 5
  const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);  // blocks 2 6, 3 7
  auto* o = reinterpret_cast<__m256i*>(out);
  _mm256_storeu_si256(o + 0, _mm256_permute2x128_si256(u0, u1, 0x20));
  _mm256_storeu_si256(o + 1, _mm256_permute2x128_si256(u2, u3, 0x20));
  _mm256_storeu_si256(o + 2, _mm256_permute2x128_si256(u0, u1, 0x31));
  _mm256_storeu_si256(o + 3, _mm256_permute2x128_si256(u2, u3, 0x31));
#else
  for (uint64_t i = 0; i < 8; ++i) {
    const std::array<uint32_t, 4> w = block(first_block + i);
    for (int j = 0; j < 4; ++j) out[4 * i + j] = w[j];
  }
#endif
}

float RandomStream::normal(uint64_t index) const {
  const auto w = block(index >> 1);
  const double u1 = (static_cast<double>(w[0]) + 0.5) * 0x1p-32;  // (0, 1): log is finite
  const double u2 = static_cast<double>(w[1]) * 0x1p-32;
  const double r = std::sqrt(-2.0 * std::log(u1));
  const double theta = 2.0 * std::numbers::pi * u2;
  return static_cast<float>((index & 1) ? r * std::sin(theta) : r * std::cos(theta));
}

void RandomStream::fill_normal(float* out, int64_t n, float stddev, uint64_t first) const {
  parallel_for(n, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) out[i] = normal(first + static_cast<uint64_t>(i)) * stddev;
  });
}

}  // namespace lockstep
