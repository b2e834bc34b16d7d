// Data movement ops of the compute seam (kernels/ops.h): fills, copies, row gathers and scatters,
// transposes. They move values and compute nothing, so every backend gives the same bits; each
// output element is written once (no two rows of a scatter may land on the same row).
#pragma once

#include <cstdint>

#include "lockstep/kernels/op.h"

namespace lockstep {

struct CopyOps {
  // x[0, n) = value (a -0 fill is the identity a reduction adds exactly: v + -0 = v).
  Op<void(float* x, int64_t n, float value)> fill{"fill"};
  // dst[0, n) = src[0, n); the ranges do not overlap.
  Op<void(float* dst, const float* src, int64_t n)> copy{"copy"};
  // `width` columns of `rows` rows: dst row r (stride ld_dst) = src row r (stride ld_src).
  Op<void(float* dst, int64_t ld_dst, const float* src, int64_t ld_src, int64_t rows, int64_t width)> copy_rows{
      "copy_rows"};
  // dst row r (width) = src row index[r] when index[r] >= 0, else alt row -1 - index[r].
  Op<void(float* dst, const float* src, const float* alt, const int64_t* index, int64_t rows, int64_t width)>
      gather_rows{"gather_rows"};
  // dst row index[r] (width) = src row r, for index[r] >= 0 (the others are skipped).
  Op<void(float* dst, const float* src, const int64_t* index, int64_t rows, int64_t width)> scatter_rows{
      "scatter_rows"};
  // Block b: rows[b] rows of width floats from src row src_row[b] to dst row dst_row[b].
  Op<void(float* dst, const int64_t* dst_row, const float* src, const int64_t* src_row, const int64_t* rows,
          int64_t blocks, int64_t width)>
      copy_row_blocks{"copy_row_blocks"};
  // out (cols, rows) = x (rows, cols)^T.
  Op<void(float* out, const float* x, int64_t rows, int64_t cols)> transpose{"transpose"};
  // Row n of out (C) = row ids[n] of table, or `missing` everywhere when ids[n] < 0 (a vocabulary
  // shard's lookup of the tokens it holds).
  Op<void(float* out, const float* table, const int32_t* ids, int64_t N, int64_t C, float missing)> lookup_rows{
      "lookup_rows"};

  template <class F>
  void each(F&& f) {
    f(fill), f(copy), f(copy_rows), f(gather_rows), f(scatter_rows), f(copy_row_blocks), f(transpose), f(lookup_rows);
  }
};

}  // namespace lockstep
