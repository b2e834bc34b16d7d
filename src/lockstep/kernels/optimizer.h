// AdamW on FP32 master weights, and the global gradient norm.
//
// adamw_update follows torch.optim.AdamW exactly, operation for operation:
//   g = grad * grad_scale               (grad_scale carries gradient clipping)
//   p = p * (1 - lr * weight_decay)     (decoupled weight decay)
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g * g
//   p = p - (lr / (1 - beta1^step)) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
// Elementwise, so trivially deterministic. The update also reports, in the same pass, whether any
// parameter it wrote is not finite (inf or NaN): the trainer's non-finite guard (docs/faults.md).
// A moment stored in bf16 (the precision-aware optimizer, AdamwHashedItem::m_bf16 / v_bf16) is read
// exactly into fp32, updated as above, and rounded back to nearest, ties to even (core/dtype.h).
//
// sum_of_squares: fixed blocks of kNormBlock elements, each summed in double over 16 fixed lanes
// (element i to lane i % 16, lanes combined in one fixed tree), block sums added in block order in
// double: the value depends on n and the data only, never on the thread count.
#pragma once

#include <cstdint>

#include "lockstep/core/dtype.h"
#include "lockstep/core/exact_sum.h"
#include "lockstep/kernels/op.h"

namespace lockstep {

struct AdamW {
  float lr = 3e-4f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
};

inline constexpr int64_t kNormBlock = 16384;

// One range of the hashed AdamW update (OptimizerOps::adamw_update_hashed).
struct AdamwHashedItem {
  float* param;
  float* m;
  float* v;
  const float* grad;
  int64_t n;
  AdamW hp;
  int64_t state_begin, state_end;
  uint64_t* hashes;  // [4]
  // The moments stored in bf16 here instead of m, v (null: fp32 at m, v); their hashes are of the
  // bf16 bytes.
  bf16* m_bf16 = nullptr;
  bf16* v_bf16 = nullptr;
};

// The ops, as a backend binds them (kernels/ops.h).
struct OptimizerOps {
  // step counts from 1. Returns whether any updated parameter is not finite.
  Op<bool(float* param, float* m, float* v, const float* grad, int64_t n, const AdamW& hp, int64_t step,
          float grad_scale)>
      adamw_update{"adamw_update"};
  // Each item's update (as adamw_update's, the same bits) on one thread, and XXH3-64 of the item's
  // gradient (as read) and of m and v (as written) over its elements [state_begin, state_end) into
  // hashes[0], [1], [2], and of its parameters (as written) over all n into hashes[3]: the update runs
  // at most 16384 elements at a time and each piece is hashed right after it, while it is in cache,
  // instead of in another pass over memory. The items go to the threads whole, in the given order
  // (largest first is the caller's choice): the hashes do not depend on which thread ran an item.
  // Returns whether any updated parameter of any item is not finite.
  Op<bool(const AdamwHashedItem* items, int64_t count, int64_t step, float grad_scale)> adamw_update_hashed{
      "adamw_update_hashed"};
  // The hashes adamw_update_hashed writes, of the state as it is, without updating it (hp and the
  // step are not read): a skipped step's fingerprint (train.on_nonfinite = "skip_step").
  Op<void(const AdamwHashedItem* items, int64_t count)> adam_state_hashes{"adam_state_hashes"};
  // The grad norm's sum of squares under determinism = "run" (header comment).
  Op<double(const float* x, int64_t n)> sum_of_squares{"sum_of_squares"};
  // Under "layout": the sum of x[i]^2 exactly (core/exact_sum.h), the same for any split of x.
  Op<ExactSum(const float* x, int64_t n)> exact_sum_of_squares{"exact_sum_of_squares"};

  template <class F>
  void each(F&& f) {
    f(adamw_update), f(adamw_update_hashed), f(adam_state_hashes), f(sum_of_squares), f(exact_sum_of_squares);
  }
};

}  // namespace lockstep
