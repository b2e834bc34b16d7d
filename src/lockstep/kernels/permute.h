// Token permutation for MoE dispatch and the combine that undoes it.
//
// A dispatch layout (built by the dispatcher, model/moe/dispatcher.h) maps N tokens with K routing
// choices each onto R expert-input rows, grouped by expert, tokens in token order inside an expert:
//   slot[t * K + k]  row holding token t's k-th choice, or -1 when capacity dropped it
//   row_choice[r]    t * K + k for the choice row r holds, or -1 for a padding row
//
// Determinism guarantee: every output row is written by one thread. Where a token gathers from
// several rows (permute_backward, combine_forward) it sums them itself in k order, in FP32, starting
// from its own base value: no atomics, no scatter-add, bits independent of the thread count.
#pragma once

#include <cstdint>
#include "lockstep/kernels/op.h"

namespace lockstep {

// The ops, as a backend binds them (kernels/ops.h).
struct PermuteOps {
  // out (R, C): row r = inp[token of r], zeros for padding rows.
  Op<void(float* out, const float* inp, const int32_t* row_choice, int64_t R, int64_t K, int64_t C)> permute_forward{
      "permute_forward"};
  // dinp (N, C) += sum over k (in order) of dout[slot[t, k]] (dropped choices add nothing).
  Op<void(float* dinp, const float* dout, const int32_t* slot, int64_t N, int64_t K, int64_t C)> permute_backward{
      "permute_backward"};
  // out (N, C) = base + sum over k in order of probs[t, k] * expert_out[slot[t, k]]:
  //   acc = base[t, c]; for k: acc = fma(probs[t, k], expert_out[slot, c], acc). out may alias base.
  Op<void(float* out, const float* base, const float* expert_out, const int32_t* slot, const float* probs, int64_t N,
          int64_t K, int64_t C)>
      combine_forward{"combine_forward"};
  // dexpert_out (R, C) = probs[choice] * dout[token] (zeros for padding rows);
  // dprobs (N, K) = <dout[t], expert_out[slot[t, k]]> (one FMA chain over c; 0 when dropped).
  Op<void(float* dexpert_out, float* dprobs, const float* dout, const float* expert_out, const int32_t* slot,
          const int32_t* row_choice, const float* probs, int64_t N, int64_t R, int64_t K, int64_t C)>
      combine_backward{"combine_backward"};

  template <class F>
  void each(F&& f) {
    f(permute_forward), f(permute_backward), f(combine_forward), f(combine_backward);
  }
};

}  // namespace lockstep
