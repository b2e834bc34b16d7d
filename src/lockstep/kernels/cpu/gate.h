// The CPU shared-expert gate kernels (kernels/gate.h states the contract).
#pragma once

#include <cstdint>

#include "lockstep/kernels/gate.h"

namespace lockstep {

void gate_forward(float* out, float* g, const float* base, const float* x, const float* w, const float* y, int64_t N,
                  int64_t C);
void gate_backward(float* dy, float* dlogit, const float* dout, const float* y, const float* g, bool gated, int64_t N,
                   int64_t C);
void gate_weight_grad(float* dw, const float* dlogit, const float* x, int64_t N, int64_t C, int64_t segments);
void gate_input_grad(float* dx, const float* dx_expert, const float* dlogit, const float* w, int64_t N, int64_t C);

}  // namespace lockstep
