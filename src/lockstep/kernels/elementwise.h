// Elementwise arithmetic ops of the compute seam (kernels/ops.h). Each output element is the stated
// expression in fp32, every operation rounded on its own (no fused multiply-add unless written as
// fma), so every backend and thread count gives the same bits.
#pragma once

#include <cstdint>

#include "lockstep/kernels/op.h"

namespace lockstep {

struct ElementwiseOps {
  // y[i] = a[i] + b[i] (y may be a or b).
  Op<void(float* y, const float* a, const float* b, int64_t n)> add{"add"};
  // y[i] = a[i] * b[i] (y may be a or b).
  Op<void(float* y, const float* a, const float* b, int64_t n)> multiply{"multiply"};
  // y[i] = y[i] + a[i] * b[i], the product rounded first.
  Op<void(float* y, const float* a, const float* b, int64_t n)> add_product{"add_product"};
  // y (rows, cols) = (x + b) + s per element, b = bias[j] (bias null: b = zero, a +-0 chosen by the
  // caller: -0 leaves x's bits as they are), s = sum[r, j] (sum null: no second add). y may be x.
  Op<void(float* y, const float* x, const float* bias, float zero, const float* sum, int64_t rows, int64_t cols)>
      add_bias_rows{"add_bias_rows"};
  // Rows [offsets[g], offsets[g + 1]) of y (R, cols) += bias row g (bias (G, cols)): y = bias + y.
  Op<void(float* y, const float* bias, const int64_t* offsets, int64_t G, int64_t cols)> add_group_bias{
      "add_group_bias"};
  // y[i] = x[i] rounded to bf16 (round to nearest even), kept in fp32 (y may be x).
  Op<void(float* y, const float* x, int64_t n)> round_bf16{"round_bf16"};
  // y[i] = the bf16 bits of x[i] rounded as round_bf16 rounds it (a payload half the size), and back:
  // y[i] = the fp32 of bf16 bits x[i] (exact). unpack(pack(x)) is round_bf16(x), bit for bit.
  Op<void(uint16_t* y, const float* x, int64_t n)> pack_bf16{"pack_bf16"};
  Op<void(float* y, const uint16_t* x, int64_t n)> unpack_bf16{"unpack_bf16"};
  // Row r of act (R, F) = +0 where row r of x (R, C) is all zeros (+0 or -0); the other rows kept.
  Op<void(float* act, const float* x, int64_t R, int64_t F, int64_t C)> zero_rows_of_zeros{"zero_rows_of_zeros"};

  template <class F>
  void each(F&& f) {
    f(add), f(multiply), f(add_product), f(add_bias_rows), f(add_group_bias), f(round_bf16), f(pack_bf16);
    f(unpack_bf16), f(zero_rows_of_zeros);
  }
};

}  // namespace lockstep
