// The CPU activations kernels (kernels/activations.h states the contract).
#pragma once

#include <cstdint>
#include "lockstep/kernels/activations.h"

namespace lockstep {

void gelu_forward(float* out, const float* inp, int64_t n);
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n);
void swiglu_forward(float* out, const float* inp, int64_t N, int64_t H);
void swiglu_backward(float* dinp, const float* inp, const float* dout, int64_t N, int64_t H);

}  // namespace lockstep
