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
struct RopeScaling {
  double factor = 1.0;
  double low_freq_factor = 1.0, high_freq_factor = 4.0;
  double original_max_position = 8192.0;
};

// The frequency of pair i: theta^(-2i/HS), scaled (in double).
double rope_inv_freq(int64_t i, int64_t HS, double theta, const RopeScaling& scaling = {});

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
