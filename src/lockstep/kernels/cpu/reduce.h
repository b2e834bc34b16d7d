// The CPU reductions over several buffers (kernels/reduce.h states the contract).
#pragma once

#include <cstdint>

#include "lockstep/kernels/reduce.h"

namespace lockstep {

void tree_sum(float* out, const float* const* leaves, int64_t L, int64_t n);
void ordered_sum(float* out, const float* const* leaves, int64_t L, int64_t n);

}  // namespace lockstep
