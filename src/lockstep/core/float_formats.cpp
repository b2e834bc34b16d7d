#include "lockstep/core/float_formats.h"

#include <bit>
#include <cmath>
#include <limits>

namespace lockstep {

namespace {

// A sign-magnitude binary format with E exponent and M mantissa bits.
struct Layout {
  int E, M, bias;
  uint32_t max_mag;  // magnitude bits (exponent field << M | mantissa) of the largest finite value
  uint8_t nan_mag;   // magnitude bits of the NaN that encode() produces
  uint8_t inf_mag;   // magnitude bits of infinity, or 0 when the format has none
  int emin() const { return 1 - bias; }
  int sign_shift() const { return E + M; }
};

constexpr Layout layout(ElemFormat f) {
  switch (f) {
    case ElemFormat::e4m3: return {4, 3, 7, 0x7E, 0x7F, 0};
    case ElemFormat::e5m2: return {5, 2, 15, 0x7B, 0x7E, 0x7C};
    case ElemFormat::e2m1: break;
  }
  return {2, 1, 1, 0x7, 0x7, 0};  // no NaN: a NaN saturates (see the header)
}

uint8_t overflowed(const Layout& L, uint8_t sign, Overflow overflow) {
  if (overflow == Overflow::saturate || L.E == 2) return static_cast<uint8_t>(sign | L.max_mag);
  return static_cast<uint8_t>(sign | (L.inf_mag ? L.inf_mag : L.nan_mag));
}

// The magnitude bits of the largest representable value not above |x| = a (finite), and the exact
// fraction of the way from it to the next one. In the normal range the fp32 bits are truncated to M
// mantissa bits (a's exponent field lines up with the target's after rebiasing) and the fraction is
// the dropped bits / 2^(23 - M); below the smallest normal, |x| is scaled so that the subnormal
// quantum becomes 1 and split into integer and fraction. Every step is exact in fp32.
// 2^e for a normal fp32 exponent: multiplying by it is exact (no std::ldexp call per element).
inline float pow2(int e) { return std::bit_cast<float>(static_cast<uint32_t>(e + 127) << 23); }

struct Truncated {
  uint32_t mag;
  float frac;  // in [0, 1)
};

Truncated truncate(const Layout& L, uint32_t a) {
  const int e = static_cast<int>(a >> 23) - 127;
  if (e >= L.emin()) {
    const int sh = 23 - L.M;
    const uint32_t r = a >> sh;  // (fp32 exponent field << M) | top M mantissa bits
    const uint32_t mag = r - (static_cast<uint32_t>(127 - L.bias) << L.M);
    return {mag, static_cast<float>(a & ((1u << sh) - 1)) * pow2(-sh)};
  }
  const float r = std::bit_cast<float>(a) * pow2(L.M - L.emin());  // < 2^M
  const auto n = static_cast<uint32_t>(r);
  return {n, r - static_cast<float>(n)};
}

}  // namespace

std::string_view elem_format_name(ElemFormat f) {
  switch (f) {
    case ElemFormat::e4m3: return "e4m3";
    case ElemFormat::e5m2: return "e5m2";
    case ElemFormat::e2m1: break;
  }
  return "e2m1";
}

namespace {
// encode() and encode_stochastic(): sign, NaN and infinity, then the truncated magnitude plus one
// when up(truncated) says so (a carry into the exponent field is still the right code), then the
// overflow rule.
template <typename Up>
uint8_t encode_with(ElemFormat f, float x, Overflow overflow, Up up) {
  const Layout L = layout(f);
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const auto sign = static_cast<uint8_t>((u >> 31) << L.sign_shift());
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint8_t>(sign | L.nan_mag);
  if (a == 0x7f800000u) return overflowed(L, sign, overflow);
  const Truncated t = truncate(L, a);
  const uint32_t mag = t.mag + (up(t) ? 1u : 0u);
  if (mag > L.max_mag) return overflowed(L, sign, overflow);
  return static_cast<uint8_t>(sign | mag);
}
}  // namespace

uint8_t encode(ElemFormat f, float x, Overflow overflow) {
  return encode_with(f, x, overflow, [](const Truncated& t) {
    return t.frac > 0.5f || (t.frac == 0.5f && (t.mag & 1u));
  });
}

uint8_t encode_stochastic(ElemFormat f, float x, uint32_t random_bits) {
  // p = frac exactly (the gap hi - lo is a power of two); the draw is exact in fp32 too.
  const float draw = static_cast<float>(random_bits >> 8) * 0x1p-24f;
  return encode_with(f, x, Overflow::saturate, [draw](const Truncated& t) { return draw < t.frac; });
}

namespace {
std::array<float, 256> make_table(ElemFormat f) {
  const Layout L = layout(f);
  std::array<float, 256> t{};
  const uint32_t mask = (1u << (L.E + L.M)) - 1;
  for (uint32_t code = 0; code < 256; ++code) {
    const uint32_t mag = code & mask;
    const bool negative = (code >> L.sign_shift()) & 1u;
    const int exp = static_cast<int>(mag >> L.M);
    const uint32_t mant = mag & ((1u << L.M) - 1);
    float v;
    if (f == ElemFormat::e4m3 && mag == 0x7F) {
      v = std::numeric_limits<float>::quiet_NaN();
    } else if (f == ElemFormat::e5m2 && exp == 31) {
      v = mant == 0 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
    } else if (exp == 0) {
      v = std::ldexp(static_cast<float>(mant), L.emin() - L.M);
    } else {
      v = std::ldexp(static_cast<float>((1u << L.M) | mant), exp - L.bias - L.M);
    }
    t[code] = negative ? -v : v;
  }
  return t;
}
}  // namespace

const std::array<float, 256>& decode_table(ElemFormat f) {
  static const std::array<float, 256> e4m3 = make_table(ElemFormat::e4m3);
  static const std::array<float, 256> e5m2 = make_table(ElemFormat::e5m2);
  static const std::array<float, 256> e2m1 = make_table(ElemFormat::e2m1);
  return f == ElemFormat::e4m3 ? e4m3 : f == ElemFormat::e5m2 ? e5m2 : e2m1;
}

float decode(ElemFormat f, uint8_t code) { return decode_table(f)[code]; }

uint8_t encode_e8m0(float x, ScaleRounding rounding) {
  if (!(x >= 0.0f) || std::isinf(x)) return 0xFF;  // NaN, negative, inf
  if (x == 0.0f) return 0;
  int e;
  const float m = std::frexp(x, &e);  // x = m * 2^e, m in [0.5, 1): floor(log2 x) = e - 1
  int k = e - 1;
  if (m != 0.5f) {
    switch (rounding) {
      case ScaleRounding::down: break;
      case ScaleRounding::up: ++k; break;
      case ScaleRounding::nearest:
        // 2m in (1, 2): above 1.5 goes up; exactly 1.5 goes to the even code (k + 127 even).
        if (m > 0.75f || (m == 0.75f && ((k + 127) & 1))) ++k;
        break;
    }
  }
  k = k < -127 ? -127 : k > 127 ? 127 : k;
  return static_cast<uint8_t>(k + 127);
}

float decode_e8m0(uint8_t code) {
  if (code == 0xFF) return std::numeric_limits<float>::quiet_NaN();
  if (code == 0) return 0x1p-127f;  // the one subnormal
  return std::bit_cast<float>(static_cast<uint32_t>(code) << 23);
}

}  // namespace lockstep
