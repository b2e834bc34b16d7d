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
#pragma once

#include <array>
#include <bit>
#include <cstdint>
#include <string_view>

namespace lockstep {

// The element formats of quantised tensors.
enum class ElemFormat : uint8_t { e4m3, e5m2, e2m1 };

enum class Overflow : uint8_t { saturate, nonfinite };

std::string_view elem_format_name(ElemFormat f);  // "e4m3", "e5m2", "e2m1"

// Largest finite value: 448, 57344, 6.
constexpr float max_finite(ElemFormat f) {
  return f == ElemFormat::e4m3 ? 448.0f : f == ElemFormat::e5m2 ? 57344.0f : 6.0f;
}
// The exponent of the largest power of two not above max_finite (8, 15, 2): emax_elem of the OCP
// MX spec, used by its shared-scale rule X = 2^(floor(log2(amax)) - emax_elem).
constexpr int max_exponent(ElemFormat f) {
  return f == ElemFormat::e4m3 ? 8 : f == ElemFormat::e5m2 ? 15 : 2;
}

uint8_t encode(ElemFormat f, float x, Overflow overflow = Overflow::saturate);
float decode(ElemFormat f, uint8_t code);

inline uint8_t encode_e4m3(float x, Overflow o = Overflow::saturate) { return encode(ElemFormat::e4m3, x, o); }
inline uint8_t encode_e5m2(float x, Overflow o = Overflow::saturate) { return encode(ElemFormat::e5m2, x, o); }
inline uint8_t encode_e2m1(float x) { return encode(ElemFormat::e2m1, x); }
inline float decode_e4m3(uint8_t c) { return decode(ElemFormat::e4m3, c); }
inline float decode_e5m2(uint8_t c) { return decode(ElemFormat::e5m2, c); }
inline float decode_e2m1(uint8_t c) { return decode(ElemFormat::e2m1, c); }

// decode_table(f)[code] == decode(f, code) for all 256 codes (E2M1: only the low nibble counts, so
// entries 16..255 repeat 0..15). For kernels that decode in bulk.
const std::array<float, 256>& decode_table(ElemFormat f);

// Stochastic rounding to the format: |x| lies between two neighbouring representable magnitudes
// lo <= |x| <= hi; the result is hi with probability p = (|x| - lo) / (hi - lo), else lo, where the
// draw is `random_bits`: round up iff (random_bits >> 8) * 2^-24 < p. p is computed exactly in
// fp32, so the expectation equals |x| up to the 24-bit quantisation of the uniform draw (a bias below
// 2^-24 * (hi - lo)). Magnitudes above max finite saturate (no randomness); NaN as encode(). Same
// random_bits -> same code, so keying the bits by a global element index makes the result
// independent of how the work is split.
uint8_t encode_stochastic(ElemFormat f, float x, uint32_t random_bits);

// ---- E8M0 scales

// How a positive fp32 that is not a power of two becomes one.
//   down:    2^floor(log2 x)  (the OCP MX spec's rule for the shared scale)
//   up:      2^ceil(log2 x)   (TransformerEngine's MXFP8 rule: the scaled block never saturates)
//   nearest: the nearer of the two in value (x >= 1.5 * 2^floor goes up), ties to the even code
enum class ScaleRounding : uint8_t { down, up, nearest };

// Code of 2^e for x > 0 (e = code - 127); exponents outside [-127, 127] clamp to codes 0 / 254;
// x == 0 (a block of zeros: any scale will do) gives code 0; NaN, inf and negative x give 0xFF.
uint8_t encode_e8m0(float x, ScaleRounding rounding = ScaleRounding::down);
// 2^(code - 127) (code 0 is 2^-127, an fp32 subnormal, still exact); 0xFF: NaN.
float decode_e8m0(uint8_t code);

// ---- Inline encoders, for kernels that encode in bulk: the same bits as encode(f, x) (saturating)
// and encode_stochastic(f, x, bits), with the format fixed at compile time.

namespace float_formats_detail {

// A sign-magnitude binary format with E exponent and M mantissa bits.
struct Layout {
  int E, M, bias;
  uint32_t max_mag;  // magnitude bits (exponent field << M | mantissa) of the largest finite value
  uint8_t nan_mag;   // magnitude bits of the NaN that encode() produces
  uint8_t inf_mag;   // magnitude bits of infinity, or 0 when the format has none
  constexpr int emin() const { return 1 - bias; }
  constexpr int sign_shift() const { return E + M; }
};

constexpr Layout layout(ElemFormat f) {
  switch (f) {
    case ElemFormat::e4m3: return {4, 3, 7, 0x7E, 0x7F, 0};
    case ElemFormat::e5m2: return {5, 2, 15, 0x7B, 0x7E, 0x7C};
    case ElemFormat::e2m1: break;
  }
  return {2, 1, 1, 0x7, 0x7, 0};  // no NaN: a NaN saturates (see the top of this file)
}

// 2^e for a normal fp32 exponent: multiplying by it is exact.
constexpr float pow2(int e) { return std::bit_cast<float>(static_cast<uint32_t>(e + 127) << 23); }

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
inline Truncated truncate(uint32_t a) {
  constexpr Layout L = layout(F);
  const int e = static_cast<int>(a >> 23) - 127;
  if (e >= L.emin()) {
    constexpr int sh = 23 - L.M;
    const uint32_t r = a >> sh;  // (fp32 exponent field << M) | top M mantissa bits
    const uint32_t mag = r - (static_cast<uint32_t>(127 - L.bias) << L.M);
    return {mag, static_cast<float>(a & ((1u << sh) - 1)) * pow2(-sh)};
  }
  const float r = std::bit_cast<float>(a) * pow2(L.M - L.emin());  // < 2^M
  const auto n = static_cast<uint32_t>(r);
  return {n, r - static_cast<float>(n)};
}

// Non-short-circuit operators: on data the comparison is a coin toss, so a branch would mispredict
// half the time (it made encoding 3x slower).
struct NearestEven {
  bool operator()(const Truncated& t) const { return (t.frac > 0.5f) | ((t.frac == 0.5f) & ((t.mag & 1u) != 0)); }
};

// Sign, NaN and infinity, then the truncated magnitude plus one when up(truncated) says so (a carry
// into the exponent field is still the right code), then the overflow rule.
template <ElemFormat F, typename Up>
inline uint8_t encode_with(float x, Overflow overflow, Up up) {
  constexpr Layout L = layout(F);
  const uint32_t u = std::bit_cast<uint32_t>(x);
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

template <ElemFormat F>
inline uint8_t encode_saturating(float x) {
  return float_formats_detail::encode_with<F>(x, Overflow::saturate, float_formats_detail::NearestEven{});
}

template <ElemFormat F>
inline uint8_t encode_stochastic_as(float x, uint32_t random_bits) {
  // p = frac exactly (the gap hi - lo is a power of two); the draw is exact in fp32 too.
  const float draw = static_cast<float>(random_bits >> 8) * 0x1p-24f;
  return float_formats_detail::encode_with<F>(x, Overflow::saturate,
                                              [draw](const float_formats_detail::Truncated& t) { return draw < t.frac; });
}

}  // namespace lockstep
