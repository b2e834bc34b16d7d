// The CPU optimizer kernels (kernels/optimizer.h states the contract).
#pragma once

#include <cstdint>
#include "lockstep/kernels/optimizer.h"

namespace lockstep {

bool adamw_update(float* param, float* m, float* v, const float* grad, int64_t n, const AdamW& hp, int64_t step,
                  float grad_scale);
// One item of adamw_update_hashed; update false: hashes only, no update (adam_state_hashes).
bool adamw_update_hashed(const AdamwHashedItem& t, bool update, int64_t step, float grad_scale);
double sum_of_squares(const float* x, int64_t n);

// The items of kernels/optimizer.h's adamw_update_hashed shared among the pool's threads.
bool adamw_update_hashed_items(const AdamwHashedItem* items, int64_t count, int64_t step, float grad_scale);
void adam_state_hashes(const AdamwHashedItem* items, int64_t count);

}  // namespace lockstep
