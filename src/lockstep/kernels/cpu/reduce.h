// The CPU reductions over several buffers (kernels/reduce.h states the contract).
#pragma once

#include <cstdint>

#include "lockstep/kernels/reduce.h"

namespace lockstep {

void tree_sum(float* out, const float* const* leaves, int64_t L, int64_t n);
void ordered_sum(float* out, const float* const* leaves, int64_t L, int64_t n);
void piece_tree_sum(float* out, const float* const* pieces, const PieceTree& tree, int64_t n);
void tree_fold(float* dst, const float* x, uint64_t held, float* const* levels, int64_t n, float* zero);
void tree_push_block(float* out, const float* x, int64_t c, int level, bool last, int64_t n, float* stack,
                     int first_level);

}  // namespace lockstep
