#include "lockstep/kernels/cpu/copy.h"

#include <algorithm>
#include <cstring>

#include "lockstep/core/thread_pool.h"

namespace lockstep {

namespace {
void copy_floats(float* dst, const float* src, int64_t n) {
  std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
}
}  // namespace

void fill(float* x, int64_t n, float value) {
  parallel_for(n, [&](int64_t i0, int64_t i1) { std::fill(x + i0, x + i1, value); });
}

void copy(float* dst, const float* src, int64_t n) {
  parallel_for(n, [&](int64_t i0, int64_t i1) { copy_floats(dst + i0, src + i0, i1 - i0); });
}

void copy_rows(float* dst, int64_t ld_dst, const float* src, int64_t ld_src, int64_t rows, int64_t width) {
  parallel_for(rows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) copy_floats(dst + r * ld_dst, src + r * ld_src, width);
  });
}

void gather_rows(float* dst, const float* src, const float* alt, const int64_t* index, int64_t rows, int64_t width) {
  parallel_for(rows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t i = index[r];
      copy_floats(dst + r * width, i >= 0 ? src + i * width : alt + (-1 - i) * width, width);
    }
  });
}

void scatter_rows(float* dst, const float* src, const int64_t* index, int64_t rows, int64_t width) {
  parallel_for(rows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      if (index[r] >= 0) copy_floats(dst + index[r] * width, src + r * width, width);
  });
}

void copy_row_blocks(float* dst, const int64_t* dst_row, const float* src, const int64_t* src_row, const int64_t* rows,
                     int64_t blocks, int64_t width) {
  parallel_for(blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) copy_floats(dst + dst_row[b] * width, src + src_row[b] * width, rows[b] * width);
  });
}

void transpose(float* out, const float* x, int64_t rows, int64_t cols) {
  parallel_for(cols, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      for (int64_t r = 0; r < rows; ++r) out[c * rows + r] = x[r * cols + c];
  });
}

void lookup_rows(float* out, const float* table, const int32_t* ids, int64_t N, int64_t C, float missing) {
  parallel_for(N, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      float* o = out + n * C;
      if (ids[n] < 0)
        std::fill(o, o + C, missing);
      else
        copy_floats(o, table + static_cast<int64_t>(ids[n]) * C, C);
    }
  });
}

}  // namespace lockstep
