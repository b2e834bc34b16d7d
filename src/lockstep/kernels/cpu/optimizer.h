// The CPU optimizer kernels (kernels/optimizer.h states the contract).
#pragma once

#include <cstdint>
#include "lockstep/kernels/optimizer.h"

namespace lockstep {

void adamw_update(float* param, float* m, float* v, const float* grad, int64_t n, const AdamW& hp, int64_t step,
                  float grad_scale);
void adamw_update_hashed(float* param, float* m, float* v, const float* grad, int64_t n, const AdamW& hp, int64_t step,
                         float grad_scale, int64_t state_begin, int64_t state_end, uint64_t hashes[4]);
double sum_of_squares(const float* x, int64_t n);

// The items of kernels/optimizer.h's adamw_update_hashed shared among the pool's threads.
void adamw_update_hashed_items(const AdamwHashedItem* items, int64_t count, int64_t step, float grad_scale);

}  // namespace lockstep
