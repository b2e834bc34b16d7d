// The quantised tensor's host-side accessors and the recipes' scalar rules (kernels/quantize.h), the
// same for every backend.
#include "lockstep/kernels/quantize.h"

#include <cmath>

#include "lockstep/core/philox.h"

namespace lockstep {

float QuantizedTensor::block_scale(int64_t br, int64_t bc) const {
  const auto b = static_cast<size_t>(br * grid_cols() + bc);
  switch (scale_format) {
    case ScaleFormat::f32:
      return scales[b];
    case ScaleFormat::e8m0:
      return decode_e8m0(scale_codes[b]);
    case ScaleFormat::e4m3:
      break;
  }
  return decode_e4m3(scale_codes[b]);
}

float QuantizedTensor::value(int64_t r, int64_t c) const {
  return scaled(decode(elem, code(r, c)), block_scale(r / block_rows, c / block_cols)) * tensor_scale;
}

int64_t QuantizedTensor::storage_bytes() const {
  return static_cast<int64_t>(codes.size() + scales.size() * sizeof(float) + scale_codes.size()) +
         (scale_format == ScaleFormat::e4m3 ? static_cast<int64_t>(sizeof(float)) : 0);
}

float fp8_scale_from_amax(float amax_value, ElemFormat f, int margin, float previous) {
  if (!(amax_value > 0.0f) || !std::isfinite(amax_value)) return previous;
  return (max_finite(f) / amax_value) / std::ldexp(1.0f, margin);
}

uint64_t sr_purpose(uint64_t tensor_id, uint64_t step) {
  return mix_purpose(mix_purpose(purpose_id("quantize/stochastic_rounding"), tensor_id), step);
}

const std::array<float, 16>& hadamard16_signs() {
  static const std::array<float, 16> signs = [] {
    std::array<float, 16> s{};
    const RandomStream rng(0, purpose_id("hadamard16/signs"));
    for (int i = 0; i < 16; ++i) s[i] = (rng.bits(i) & 1u) ? -1.0f : 1.0f;
    return s;
  }();
  return signs;
}

}  // namespace lockstep
