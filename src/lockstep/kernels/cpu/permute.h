// The CPU permute kernels (kernels/permute.h states the contract).
#pragma once

#include <cstdint>
#include "lockstep/kernels/permute.h"

namespace lockstep {

void permute_forward(float* out, const float* inp, const int32_t* row_choice, int64_t R, int64_t K, int64_t C);
void permute_backward(float* dinp, const float* dout, const int32_t* slot, int64_t N, int64_t K, int64_t C);
void combine_forward(float* out, const float* base, const float* expert_out, const int32_t* slot, const float* probs,
                     int64_t N, int64_t K, int64_t C);
void combine_backward(float* dexpert_out, float* dprobs, const float* dout, const float* expert_out,
                      const int32_t* slot, const int32_t* row_choice, const float* probs, int64_t N, int64_t R,
                      int64_t K, int64_t C);

}  // namespace lockstep
