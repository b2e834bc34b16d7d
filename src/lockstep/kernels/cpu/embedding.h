// The CPU embedding kernels (kernels/embedding.h states the contract).
#pragma once

#include <cstdint>
#include "lockstep/kernels/embedding.h"

namespace lockstep {

void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B, int64_t T,
                       int64_t C, int64_t V, const int32_t* positions = nullptr, int64_t P = 0);
void embedding_backward(float* dwte, float* dwpe, int32_t* order, const float* dout, const int32_t* tokens, int64_t B,
                        int64_t T, int64_t C, const int32_t* positions = nullptr, int64_t P = 0, int64_t segments = 0,
                        int64_t pos_segments = 0);
void bias_backward(float* dbias, const float* dout, int64_t N, int64_t C, int64_t segments = 0);
void add_positions(float* x, const float* sum, const float* wpe, const int32_t* positions, int64_t row0, int64_t rows,
                   int64_t T, int64_t C);

}  // namespace lockstep
