// Rotary position embedding (RoPE), rotate-half layout (GPT-NeoX / Hugging Face Llama / Megatron
// default): within each head of size HS, element i < HS/2 pairs with element i + HS/2 and the
// pair is rotated by angle pos * theta^(-2i/HS).
//
// Works in place on the fused qkv rows: each of the N = B*T rows holds `heads` rotated heads
// (the query heads then the key heads) at its start, row_stride floats apart; position = row % T,
// or positions[row] when given (packed documents whose positions restart at each document; each
// must lie in [0, T), the rows of the table).
// Backward applies the inverse rotation to the gradient, in place.
#pragma once

#include <cstdint>
#include "lockstep/kernels/op.h"

namespace lockstep {

// Llama 3's frequency scaling for long context (Hugging Face's rope_type "llama3"): with
// wavelength w_i = 2 pi / inv_freq_i and L = original_max_position, frequencies whose wavelength
// exceeds L / low_freq_factor are divided by factor, those below L / high_freq_factor are kept,
// and the band between blends the two: s = (L / w_i - low) / (high - low),
// inv_freq = (1 - s) inv_freq / factor + s inv_freq. factor = 1: off.
//
// YaRN (yarn = true; Hugging Face's rope_type "yarn", Megatron's --rope-type yarn): with
// d(r) = HS ln(L / (2 pi r)) / (2 ln theta), low = floor(d(beta_fast)), high = ceil(d(beta_slow))
// (clamped to [0, HS - 1]; high = low + 0.001 when equal) and ramp_i = clamp((i - low) / (high -
// low), 0, 1): inv_freq = ramp_i inv_freq / factor + (1 - ramp_i) inv_freq. The table's cos and sin
// are multiplied by attention_factor = m(factor, mscale) / m(factor, mscale_all_dim) (or
// m(factor, 1) when either is 0), m(s, k) = 1 for s <= 1, else 0.1 k ln s + 1.
struct RopeScaling {
  double factor = 1.0;
  double low_freq_factor = 1.0, high_freq_factor = 4.0;
  double original_max_position = 8192.0;
  bool yarn = false;
  double beta_fast = 32.0, beta_slow = 1.0, mscale = 1.0, mscale_all_dim = 0.0;
};

// The frequency of pair i: theta^(-2i/HS), scaled (in double).
double rope_inv_freq(int64_t i, int64_t HS, double theta, const RopeScaling& scaling = {});
// YaRN's m(scale, k) and the factor on the table's cos and sin (1 without YaRN).
double yarn_mscale(double scale, double k);
double rope_attention_factor(const RopeScaling& scaling);

// cos, sin: (T, HS/2), angles computed in double and rounded once.
void rope_table(float* cos, float* sin, int64_t T, int64_t HS, double theta, const RopeScaling& scaling = {});

// The ops, as a backend binds them (kernels/ops.h).
struct RopeOps {
  Op<void(float* x, const float* cos, const float* sin, int64_t N, int64_t T, int64_t heads, int64_t HS,
          int64_t row_stride, const int32_t* positions)>
      rope_forward{"rope_forward"};
  Op<void(float* dx, const float* cos, const float* sin, int64_t N, int64_t T, int64_t heads, int64_t HS,
          int64_t row_stride, const int32_t* positions)>
      rope_backward{"rope_backward"};

  template <class F>
  void each(F&& f) {
    f(rope_forward), f(rope_backward);
  }
};

}  // namespace lockstep
