// LayerNorm and RMSNorm over the last dimension C of N rows.
//
//   layernorm: out = (x - mean) * rstd * weight + bias,  rstd = 1 / sqrt(var + eps), biased var
//   rmsnorm:   out = x * rstd * weight,                  rstd = 1 / sqrt(mean(x^2) + eps)
//
// Forward saves per-row statistics (mean, rstd) for backward. Backward *adds* into dinp (the
// norm's input is the residual stream, whose gradient is a sum) and into dweight / dbias
// (parameter gradients accumulate over micro-batches).
//
// Determinism: row statistics are sums over C in one fixed order per row; dweight/dbias are
// column sums over the N rows taken in row order, each column owned by one thread. Bits do not
// depend on the thread count.
// segments > 0 (determinism = "layout", docs/design/reductions.md#token-sum-parameters): the rows are cut into that
// many token segments (core/tree_sum.h canonical_segments), each segment's column sums start from zero, and the
// segments are summed along the canonical tree before they are added into dweight / dbias. A rank of a
// sequence-parallel group holding rows [p N / P, (p + 1) N / P) with S / P segments then holds a subtree of the
// S-segment tree over all N rows: ReduceOp::tree_sum over the group gives the one-process bits. segments = 1 is the
// unsegmented sum; 0 is today's form.
#pragma once

#include <cstdint>
#include "lockstep/kernels/op.h"

namespace lockstep {

// The ops, as a backend binds them (kernels/ops.h).
struct NormOps {
  Op<void(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias, int64_t N,
          int64_t C, float eps)>
      layernorm_forward{"layernorm_forward"};
  Op<void(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp, const float* weight,
          const float* mean, const float* rstd, int64_t N, int64_t C, int64_t segments)>
      layernorm_backward{"layernorm_backward"};
  Op<void(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C, float eps)>
      rmsnorm_forward{"rmsnorm_forward"};
  Op<void(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight, const float* rstd,
          int64_t N, int64_t C, int64_t segments)>
      rmsnorm_backward{"rmsnorm_backward"};

  template <class F>
  void each(F&& f) {
    f(layernorm_forward), f(layernorm_backward), f(rmsnorm_forward), f(rmsnorm_backward);
  }
};

}  // namespace lockstep
