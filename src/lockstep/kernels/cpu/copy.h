// The CPU data movement kernels (kernels/copy.h states the contract): parallel over the current
// thread pool by elements or rows.
#pragma once

#include <cstdint>

#include "lockstep/kernels/copy.h"

namespace lockstep {

void fill(float* x, int64_t n, float value);
void copy(float* dst, const float* src, int64_t n);
void copy_rows(float* dst, int64_t ld_dst, const float* src, int64_t ld_src, int64_t rows, int64_t width);
void gather_rows(float* dst, const float* src, const float* alt, const int64_t* index, int64_t rows, int64_t width);
void scatter_rows(float* dst, const float* src, const int64_t* index, int64_t rows, int64_t width);
void copy_row_blocks(float* dst, const int64_t* dst_row, const float* src, const int64_t* src_row, const int64_t* rows,
                     int64_t blocks, int64_t width);
void transpose(float* out, const float* x, int64_t rows, int64_t cols);
void lookup_rows(float* out, const float* table, const int32_t* ids, int64_t N, int64_t C, float missing);

}  // namespace lockstep
