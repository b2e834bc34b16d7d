// The CPU rope kernels (kernels/rope.h states the contract).
#pragma once

#include <cstdint>
#include "lockstep/kernels/rope.h"

namespace lockstep {

void rope_forward(float* x, const float* cos, const float* sin, int64_t N, int64_t T, int64_t heads, int64_t HS,
                  int64_t row_stride, const int32_t* positions = nullptr);
void rope_backward(float* dx, const float* cos, const float* sin, int64_t N, int64_t T, int64_t heads, int64_t HS,
                   int64_t row_stride, const int32_t* positions = nullptr);

}  // namespace lockstep
