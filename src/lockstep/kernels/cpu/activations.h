// Activations, elementwise, with exactly specified arithmetic (vecmath.h): the AVX2 body and the
// scalar tail compute the same bits.
//
//   gelu (tanh approximation): gelu(x) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3),
//     evaluated as x * sigmoid(2u) (the same function).
//   swiglu: inp (N, 2H) holds [gate | up] per row; out (N, H) = silu(gate) * up,
//     silu(g) = g * sigmoid(g).
//
// Backward assigns dinp.
#pragma once

#include <cstdint>

namespace lockstep {

void gelu_forward(float* out, const float* inp, int64_t n);
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n);

void swiglu_forward(float* out, const float* inp, int64_t N, int64_t H);
void swiglu_backward(float* dinp, const float* inp, const float* dout, int64_t N, int64_t H);

}  // namespace lockstep
