// Element types and their exact conversions.
//
// bf16: the upper 16 bits of an IEEE fp32. fp32 -> bf16 rounds to nearest, ties to even; NaN stays
// NaN (quiet), infinities stay infinite. bf16 -> fp32 is exact.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace lockstep {

enum class DType : uint8_t { f32, bf16 };

constexpr size_t dtype_size(DType t) { return t == DType::f32 ? 4 : 2; }
constexpr std::string_view dtype_name(DType t) { return t == DType::f32 ? "f32" : "bf16"; }

struct bf16 {
  uint16_t bits;
};

inline bf16 to_bf16(float x) {
  uint32_t u = std::bit_cast<uint32_t>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

inline float to_f32(bf16 x) { return std::bit_cast<float>(static_cast<uint32_t>(x.bits) << 16); }

}  // namespace lockstep
