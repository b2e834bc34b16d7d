// The RoPE table (kernels/rope.h): computed once on the host, in double, for every backend (a GPU
// uploads it), so that no kernel calls the libm's pow, sin or cos.
#include "lockstep/kernels/rope.h"

#include <cmath>
#include <numbers>

#include "lockstep/core/error.h"

namespace lockstep {

double rope_inv_freq(int64_t i, int64_t HS, double theta, const RopeScaling& s) {
  const double inv_freq = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(HS));
  if (s.factor == 1.0) return inv_freq;
  const double wavelen = 2.0 * std::numbers::pi / inv_freq;
  const double low_wavelen = s.original_max_position / s.low_freq_factor;
  const double high_wavelen = s.original_max_position / s.high_freq_factor;
  if (wavelen < high_wavelen) return inv_freq;
  if (wavelen > low_wavelen) return inv_freq / s.factor;
  const double smooth =
      (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
  return (1.0 - smooth) * inv_freq / s.factor + smooth * inv_freq;
}

void rope_table(float* cos, float* sin, int64_t T, int64_t HS, double theta, const RopeScaling& scaling) {
  LOCKSTEP_CHECK(HS % 2 == 0, "rope head size must be even, got ", HS);
  const int64_t half = HS / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double inv_freq = rope_inv_freq(i, HS, theta, scaling);
    for (int64_t t = 0; t < T; ++t) {
      const double angle = static_cast<double>(t) * inv_freq;
      cos[t * half + i] = static_cast<float>(std::cos(angle));
      sin[t * half + i] = static_cast<float>(std::sin(angle));
    }
  }
}

}  // namespace lockstep
