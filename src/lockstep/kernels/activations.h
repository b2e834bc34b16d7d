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
#include "lockstep/kernels/op.h"

namespace lockstep {

// The ops, as a backend binds them (kernels/ops.h).
struct ActivationOps {
  Op<void(float* out, const float* inp, int64_t n)> gelu_forward{"gelu_forward"};
  Op<void(float* dinp, const float* inp, const float* dout, int64_t n)> gelu_backward{"gelu_backward"};
  Op<void(float* out, const float* inp, int64_t N, int64_t H)> swiglu_forward{"swiglu_forward"};
  Op<void(float* dinp, const float* inp, const float* dout, int64_t N, int64_t H)> swiglu_backward{"swiglu_backward"};

  template <class F>
  void each(F&& f) {
    f(gelu_forward), f(gelu_backward), f(swiglu_forward), f(swiglu_backward);
  }
};

}  // namespace lockstep
