// The CPU elementwise kernels (kernels/elementwise.h states the contract).
#pragma once

#include <cstdint>

#include "lockstep/kernels/elementwise.h"

namespace lockstep {

void add(float* y, const float* a, const float* b, int64_t n);
void multiply(float* y, const float* a, const float* b, int64_t n);
void add_product(float* y, const float* a, const float* b, int64_t n);
void add_bias_rows(float* y, const float* x, const float* bias, float zero, const float* sum, int64_t rows,
                   int64_t cols);
void add_group_bias(float* y, const float* bias, const int64_t* offsets, int64_t G, int64_t cols);
void round_bf16(float* y, const float* x, int64_t n);
void pack_bf16(uint16_t* y, const float* x, int64_t n);
void unpack_bf16(float* y, const uint16_t* x, int64_t n);
void zero_rows_of_zeros(float* act, const float* x, int64_t R, int64_t F, int64_t C);

}  // namespace lockstep
