// The RoPE table (kernels/rope.h): computed once on the host, in double, for every backend (a GPU
// uploads it), so that no kernel calls the libm's pow, sin or cos.
#include "lockstep/kernels/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "lockstep/core/error.h"

namespace lockstep {

double yarn_mscale(double scale, double k) { return scale <= 1.0 ? 1.0 : 0.1 * k * std::log(scale) + 1.0; }

double rope_attention_factor(const RopeScaling& s) {
  if (!s.yarn) return 1.0;
  if (s.mscale != 0.0 && s.mscale_all_dim != 0.0)
    return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim);
  return yarn_mscale(s.factor, 1.0);
}

double rope_inv_freq(int64_t i, int64_t HS, double theta, const RopeScaling& s) {
  const double inv_freq = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(HS));
  if (s.factor == 1.0 && !s.yarn) return inv_freq;
  if (s.yarn) {
    const double dim = static_cast<double>(HS);
    auto correction = [&](double rotations) {
      return dim * std::log(s.original_max_position / (rotations * 2.0 * std::numbers::pi)) / (2.0 * std::log(theta));
    };
    const double low = std::max(std::floor(correction(s.beta_fast)), 0.0);
    double high = std::min(std::ceil(correction(s.beta_slow)), dim - 1.0);
    if (low == high) high += 0.001;
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    return ramp * inv_freq / s.factor + (1.0 - ramp) * inv_freq;
  }
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
  const double a = rope_attention_factor(scaling);
  for (int64_t i = 0; i < half; ++i) {
    const double inv_freq = rope_inv_freq(i, HS, theta, scaling);
    for (int64_t t = 0; t < T; ++t) {
      const double angle = static_cast<double>(t) * inv_freq;
      cos[t * half + i] = static_cast<float>(a * std::cos(angle));
      sin[t * half + i] = static_cast<float>(a * std::sin(angle));
    }
  }
}

}  // namespace lockstep
