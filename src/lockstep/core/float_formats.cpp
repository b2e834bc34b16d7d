#include "lockstep/core/float_formats.h"

#include <bit>
#include <cmath>
#include <limits>

namespace lockstep {

std::string_view elem_format_name(ElemFormat f) {
  switch (f) {
    case ElemFormat::e4m3: return "e4m3";
    case ElemFormat::e5m2: return "e5m2";
    case ElemFormat::e2m1: break;
  }
  return "e2m1";
}

namespace {
template <ElemFormat F>
uint8_t encode_as(float x, Overflow overflow) {
  return overflow == Overflow::saturate ? encode_saturating<F>(x)
                                        : float_formats_detail::encode_with<F>(x, overflow, float_formats_detail::NearestEven{});
}
}  // namespace

uint8_t encode(ElemFormat f, float x, Overflow overflow) {
  switch (f) {
    case ElemFormat::e4m3: return encode_as<ElemFormat::e4m3>(x, overflow);
    case ElemFormat::e5m2: return encode_as<ElemFormat::e5m2>(x, overflow);
    case ElemFormat::e2m1: break;
  }
  return encode_as<ElemFormat::e2m1>(x, overflow);
}

uint8_t encode_stochastic(ElemFormat f, float x, uint32_t random_bits) {
  switch (f) {
    case ElemFormat::e4m3: return encode_stochastic_as<ElemFormat::e4m3>(x, random_bits);
    case ElemFormat::e5m2: return encode_stochastic_as<ElemFormat::e5m2>(x, random_bits);
    case ElemFormat::e2m1: break;
  }
  return encode_stochastic_as<ElemFormat::e2m1>(x, random_bits);
}

namespace {
std::array<float, 256> make_table(ElemFormat f) {
  const float_formats_detail::Layout L = float_formats_detail::layout(f);
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
