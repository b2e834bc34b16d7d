// The RoPE table (kernels/rope.h): computed once on the host, in double, for every backend (a GPU
// uploads it), so that no kernel calls the libm's pow, sin or cos.
#include "lockstep/kernels/rope.h"

#include <cmath>

#include "lockstep/core/error.h"

namespace lockstep {

void rope_table(float* cos, float* sin, int64_t T, int64_t HS, double theta) {
  LOCKSTEP_CHECK(HS % 2 == 0, "rope head size must be even, got ", HS);
  const int64_t half = HS / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double inv_freq = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(HS));
    for (int64_t t = 0; t < T; ++t) {
      const double angle = static_cast<double>(t) * inv_freq;
      cos[t * half + i] = static_cast<float>(std::cos(angle));
      sin[t * half + i] = static_cast<float>(std::sin(angle));
    }
  }
}

}  // namespace lockstep
