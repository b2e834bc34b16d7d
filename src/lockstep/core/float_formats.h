// The narrow floating-point formats of FP8 / MX / NVFP4 training, bit-exact.
//
// Element formats (a code is one byte; E2M1 uses the low 4 bits, sign in bit 3):
//   format  bits     bias  max finite  smallest subnormal  inf / NaN
//   E4M3    S EEEE MMM   7        448        2^-9          no inf; NaN = S.1111.111 (0x7F, 0xFF)
//   E5M2    S EEEEE MM  15      57344        2^-16         IEEE: S.11111.00 = inf, S.11111.{01,10,11} NaN
//   E2M1    S EE M       1          6        0.5           none: values 0 0.5 1 1.5 2 3 4 6 (signed)
// Scale format:
//   E8M0    EEEEEEEE   127   2^127        (no subnormals)  0xFF = NaN; code c is 2^(c - 127); no zero,
//                                                           no sign
//
// decode is exact (every code's value is an fp32). encode rounds an fp32 to the nearest code, ties
// to the even code (the one whose lowest mantissa bit is 0), keeps the sign of zero (-0 -> S=1, 0)
// and maps NaN to NaN (E4M3 0x7F, E5M2 0x7E, with the input's sign). Overflow (the rounded
// magnitude is above max finite, or the input is +-inf):
//   Overflow::saturate   -> +-max finite. What TransformerEngine does (CUDA's __NV_SATFINITE cast)
//                           and what the OCP MX v1.0 quantisation algorithm prescribes (clamp to the
//                           element format's max normal).
//   Overflow::nonfinite  -> E4M3: NaN (it has no inf); E5M2: +-inf (IEEE). The OCP FP8 spec's
//                           non-saturating mode.
// E2M1 has neither inf nor NaN: it always saturates, and a NaN input encodes as +-6 (the quantisers
// carry NaN through the block scale instead, so a NaN in a block makes the whole block NaN).
//
// All functions are pure: the same input gives the same bits on every thread and machine.
//
// Host and device: the scalar encoders and decoders (encode, decode, encode_stochastic, the
// encode_/decode_ E4M3 / E5M2 / E2M1 forms, encode_saturating, encode_stochastic_as, encode_e8m0,
// decode_e8m0) are LOCKSTEP_HD (core/hd.h): integer and exact fp32 operations only, the same bits on
// a GPU compiled with -ftz=false (subnormal inputs and the subnormal ranges of the formats), NaN
// results included (built from integers). They are the definition; decode_table() and the AVX2
// encoders in kernels/cpu/quantize.cpp are checked against them. elem_format_name() and
// decode_table() are host only.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

#include "lockstep/core/hd.h"

namespace lockstep {

// The element formats of quantised tensors.
enum class ElemFormat : uint8_t { e4m3, e5m2, e2m1 };

enum class Overflow : uint8_t { saturate, nonfinite };

std::string_view elem_format_name(ElemFormat f);  // "e4m3", "e5m2", "e2m1"

// Largest finite value: 448, 57344, 6.
LOCKSTEP_HD constexpr float max_finite(ElemFormat f) {
  return f == ElemFormat::e4m3 ? 448.0f : f == ElemFormat::e5m2 ? 57344.0f : 6.0f;
}
// The exponent of the largest power of two not above max_finite (8, 15, 2): emax_elem of the OCP
// MX spec, used by its shared-scale rule X = 2^(floor(log2(amax)) - emax_elem).
LOCKSTEP_HD constexpr int max_exponent(ElemFormat f) {
  return f == ElemFormat::e4m3 ? 8 : f == ElemFormat::e5m2 ? 15 : 2;
}

// decode_table(f)[code] == decode(f, code) for all 256 codes (E2M1: only the low nibble counts, so
// entries 16..255 repeat 0..15). For kernels that decode in bulk (host).
const std::array<float, 256>& decode_table(ElemFormat f);

// ---- The encoders with the format fixed at compile time (kernels that encode in bulk), and the
// steps they share with encode() and encode_stochastic() below.

namespace float_formats_detail {

// A sign-magnitude binary format with E exponent and M mantissa bits.
struct Layout {
  int E, M, bias;
  uint32_t max_mag;  // magnitude bits (exponent field << M | mantissa) of the largest finite value
  uint8_t nan_mag;   // magnitude bits of the NaN that encode() produces
  uint8_t inf_mag;   // magnitude bits of infinity, or 0 when the format has none
  LOCKSTEP_HD constexpr int emin() const { return 1 - bias; }
  LOCKSTEP_HD constexpr int sign_shift() const { return E + M; }
};

LOCKSTEP_HD constexpr Layout layout(ElemFormat f) {
  switch (f) {
    case ElemFormat::e4m3:
      return {4, 3, 7, 0x7E, 0x7F, 0};
    case ElemFormat::e5m2:
      return {5, 2, 15, 0x7B, 0x7E, 0x7C};
    case ElemFormat::e2m1:
      break;
  }
  return {2, 1, 1, 0x7, 0x7, 0};  // no NaN: a NaN saturates (see the top of this file)
}

// 2^e for a normal fp32 exponent: multiplying by it is exact.
LOCKSTEP_HD constexpr float pow2(int e) { return hd::bit_cast<float>(static_cast<uint32_t>(e + 127) << 23); }

// The magnitude bits of the largest representable value not above |x| = a (finite), and the exact
// fraction of the way from it to the next one. In the normal range the fp32 bits are truncated to M
// mantissa bits (a's exponent field lines up with the target's after rebiasing) and the fraction is
// the dropped bits / 2^(23 - M); below the smallest normal, |x| is scaled so that the subnormal
// quantum becomes 1 and split into integer and fraction. Every step is exact in fp32.
struct Truncated {
  uint32_t mag;
  float frac;  // in [0, 1)
};

template <ElemFormat F>
LOCKSTEP_HD inline Truncated truncate(uint32_t a) {
  constexpr Layout L = layout(F);
  const int e = static_cast<int>(a >> 23) - 127;
  if (e >= L.emin()) {
    constexpr int sh = 23 - L.M;
    const uint32_t r = a >> sh;  // (fp32 exponent field << M) | top M mantissa bits
    const uint32_t mag = r - (static_cast<uint32_t>(127 - L.bias) << L.M);
    return {mag, static_cast<float>(a & ((1u << sh) - 1)) * pow2(-sh)};
  }
  const float r = hd::bit_cast<float>(a) * pow2(L.M - L.emin());  // < 2^M
  const auto n = static_cast<uint32_t>(r);
  return {n, r - static_cast<float>(n)};
}

// Non-short-circuit operators: on data the comparison is a coin toss, so a branch would mispredict
// half the time (it made encoding 3x slower).
struct NearestEven {
  LOCKSTEP_HD bool operator()(const Truncated& t) const {
    return (t.frac > 0.5f) | ((t.frac == 0.5f) & ((t.mag & 1u) != 0));
  }
};

// Sign, NaN and infinity, then the truncated magnitude plus one when up(truncated) says so (a carry
// into the exponent field is still the right code), then the overflow rule.
template <ElemFormat F, typename Up>
LOCKSTEP_HD inline uint8_t encode_with(float x, Overflow overflow, Up up) {
  constexpr Layout L = layout(F);
  const uint32_t u = hd::bit_cast<uint32_t>(x);
  const auto sign = static_cast<uint8_t>((u >> 31) << L.sign_shift());
  const uint32_t a = u & 0x7fffffffu;
  const auto overflowed = [&] {
    if (overflow == Overflow::saturate || F == ElemFormat::e2m1) return static_cast<uint8_t>(sign | L.max_mag);
    return static_cast<uint8_t>(sign | (L.inf_mag ? L.inf_mag : L.nan_mag));
  };
  if (a > 0x7f800000u) return static_cast<uint8_t>(sign | L.nan_mag);
  if (a == 0x7f800000u) return overflowed();
  const Truncated t = truncate<F>(a);
  const uint32_t mag = t.mag + (up(t) ? 1u : 0u);
  if (mag > L.max_mag) return overflowed();
  return static_cast<uint8_t>(sign | mag);
}

}  // namespace float_formats_detail

// encode(F, x) (saturating), the format fixed at compile time.
template <ElemFormat F>
LOCKSTEP_HD inline uint8_t encode_saturating(float x) {
  return float_formats_detail::encode_with<F>(x, Overflow::saturate, float_formats_detail::NearestEven{});
}

// encode_stochastic(F, x, random_bits), the format fixed at compile time.
template <ElemFormat F>
LOCKSTEP_HD inline uint8_t encode_stochastic_as(float x, uint32_t random_bits) {
  // p = frac exactly (the gap hi - lo is a power of two); the draw is exact in fp32 too.
  const float draw = static_cast<float>(random_bits >> 8) * 0x1p-24f;
  return float_formats_detail::encode_with<F>(
      x, Overflow::saturate, [draw](const float_formats_detail::Truncated& t) { return draw < t.frac; });
}

// ---- Encode and decode with the format chosen at run time

// The nearest code (ties to even) under the overflow rule.
LOCKSTEP_HD inline uint8_t encode(ElemFormat f, float x, Overflow overflow = Overflow::saturate) {
  using namespace float_formats_detail;
  switch (f) {
    case ElemFormat::e4m3:
      return encode_with<ElemFormat::e4m3>(x, overflow, NearestEven{});
    case ElemFormat::e5m2:
      return encode_with<ElemFormat::e5m2>(x, overflow, NearestEven{});
    case ElemFormat::e2m1:
      break;
  }
  return encode_with<ElemFormat::e2m1>(x, overflow, NearestEven{});
}

// The exact value of a code: a NaN code gives the quiet NaN 0x7fc00000 with the code's sign.
LOCKSTEP_HD inline float decode(ElemFormat f, uint8_t code) {
  const float_formats_detail::Layout L = float_formats_detail::layout(f);
  const uint32_t mag = code & ((1u << (L.E + L.M)) - 1);
  const uint32_t sign = static_cast<uint32_t>((code >> L.sign_shift()) & 1u) << 31;
  const uint32_t exp = mag >> L.M, mant = mag & ((1u << L.M) - 1);
  uint32_t bits;
  if ((f == ElemFormat::e4m3 && mag == 0x7F) || (f == ElemFormat::e5m2 && exp == 31 && mant != 0)) {
    bits = 0x7fc00000u;
  } else if (f == ElemFormat::e5m2 && exp == 31) {
    bits = 0x7f800000u;
  } else if (exp == 0) {  // zero or subnormal: mant quanta of 2^(emin - M), exact in fp32
    bits = hd::bit_cast<uint32_t>(static_cast<float>(mant) * float_formats_detail::pow2(L.emin() - L.M));
  } else {  // normal: rebias the exponent, widen the mantissa
    bits = (static_cast<uint32_t>(static_cast<int>(exp) - L.bias + 127) << 23) | (mant << (23 - L.M));
  }
  return hd::bit_cast<float>(bits | sign);
}

LOCKSTEP_HD inline uint8_t encode_e4m3(float x, Overflow o = Overflow::saturate) {
  return encode(ElemFormat::e4m3, x, o);
}
LOCKSTEP_HD inline uint8_t encode_e5m2(float x, Overflow o = Overflow::saturate) {
  return encode(ElemFormat::e5m2, x, o);
}
LOCKSTEP_HD inline uint8_t encode_e2m1(float x) { return encode(ElemFormat::e2m1, x); }
LOCKSTEP_HD inline float decode_e4m3(uint8_t c) { return decode(ElemFormat::e4m3, c); }
LOCKSTEP_HD inline float decode_e5m2(uint8_t c) { return decode(ElemFormat::e5m2, c); }
LOCKSTEP_HD inline float decode_e2m1(uint8_t c) { return decode(ElemFormat::e2m1, c); }

// Stochastic rounding to the format: |x| lies between two neighbouring representable magnitudes
// lo <= |x| <= hi; the result is hi with probability p = (|x| - lo) / (hi - lo), else lo, where the
// draw is `random_bits`: round up iff (random_bits >> 8) * 2^-24 < p. p is computed exactly in
// fp32, so the expectation equals |x| up to the 24-bit quantisation of the uniform draw (a bias below
// 2^-24 * (hi - lo)). Magnitudes above max finite saturate (no randomness); NaN as encode(). Same
// random_bits -> same code, so keying the bits by a global element index makes the result
// independent of how the work is split.
LOCKSTEP_HD inline uint8_t encode_stochastic(ElemFormat f, float x, uint32_t random_bits) {
  switch (f) {
    case ElemFormat::e4m3:
      return encode_stochastic_as<ElemFormat::e4m3>(x, random_bits);
    case ElemFormat::e5m2:
      return encode_stochastic_as<ElemFormat::e5m2>(x, random_bits);
    case ElemFormat::e2m1:
      break;
  }
  return encode_stochastic_as<ElemFormat::e2m1>(x, random_bits);
}

// ---- E8M0 scales

// How a positive fp32 that is not a power of two becomes one.
//   down:    2^floor(log2 x)  (the OCP MX spec's rule for the shared scale)
//   up:      2^ceil(log2 x)   (TransformerEngine's MXFP8 rule: the scaled block never saturates)
//   nearest: the nearer of the two in value (x >= 1.5 * 2^floor goes up), ties to the even code
enum class ScaleRounding : uint8_t { down, up, nearest };

// Code of 2^e for x > 0 (e = code - 127); exponents outside [-127, 127] clamp to codes 0 / 254;
// x == 0 (a block of zeros: any scale will do; -0 too) gives code 0; NaN, inf and negative x give
// 0xFF.
LOCKSTEP_HD inline uint8_t encode_e8m0(float x, ScaleRounding rounding = ScaleRounding::down) {
  const uint32_t u = hd::bit_cast<uint32_t>(x);
  const uint32_t a = u & 0x7fffffffu;
  if (a == 0) return 0;
  if ((u >> 31) != 0 || a >= 0x7f800000u) return 0xFF;  // negative, inf, NaN
  // x = 1.f * 2^k with the fraction bits f (23 of them): k = floor(log2 x).
  int k;
  uint32_t frac;
  if ((a >> 23) != 0) {
    k = static_cast<int>(a >> 23) - 127;
    frac = a & 0x7fffffu;
  } else {  // subnormal: a * 2^-149, shift the leading one up to bit 23
    const int shift = hd::countl_zero(a) - 8;
    k = -126 - shift;
    frac = (a << shift) & 0x7fffffu;
  }
  if (frac != 0) {
    switch (rounding) {
      case ScaleRounding::down:
        break;
      case ScaleRounding::up:
        ++k;
        break;
      case ScaleRounding::nearest:
        // 1.f above 1.5 goes up; exactly 1.5 goes to the even code (k + 127 even).
        if (frac > 0x400000u || (frac == 0x400000u && ((k + 127) & 1))) ++k;
        break;
    }
  }
  k = k < -127 ? -127 : k > 127 ? 127 : k;
  return static_cast<uint8_t>(k + 127);
}

// 2^(code - 127) (code 0 is 2^-127, an fp32 subnormal, still exact); 0xFF: NaN (0x7fc00000).
LOCKSTEP_HD inline float decode_e8m0(uint8_t code) {
  if (code == 0xFF) return hd::bit_cast<float>(0x7fc00000u);
  if (code == 0) return hd::bit_cast<float>(0x00400000u);  // 2^-127
  return hd::bit_cast<float>(static_cast<uint32_t>(code) << 23);
}

}  // namespace lockstep
