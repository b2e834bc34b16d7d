#include "lockstep/kernels/cpu/elementwise.h"

#include <algorithm>
#include <bit>

#include "lockstep/core/dtype.h"
#include "lockstep/core/thread_pool.h"

namespace lockstep {

void add(float* y, const float* a, const float* b, int64_t n) {
  parallel_for(n, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) y[i] = a[i] + b[i];
  });
}

void multiply(float* y, const float* a, const float* b, int64_t n) {
  parallel_for(n, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) y[i] = a[i] * b[i];
  });
}

void add_product(float* y, const float* a, const float* b, int64_t n) {
  parallel_for(n, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) y[i] += a[i] * b[i];
  });
}

void add_bias_rows(float* y, const float* x, const float* bias, float zero, const float* sum, int64_t rows,
                   int64_t cols) {
  parallel_for(rows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * cols;
      float* yr = y + r * cols;
      if (sum) {
        const float* sr = sum + r * cols;
        for (int64_t j = 0; j < cols; ++j) yr[j] = (xr[j] + (bias ? bias[j] : zero)) + sr[j];
      } else {
        for (int64_t j = 0; j < cols; ++j) yr[j] = xr[j] + (bias ? bias[j] : zero);
      }
    }
  });
}

void add_group_bias(float* y, const float* bias, const int64_t* offsets, int64_t G, int64_t cols) {
  const int64_t R = offsets[G];
  parallel_for(R, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* b = bias + (std::upper_bound(offsets, offsets + G + 1, i) - offsets - 1) * cols;
      float* yr = y + i * cols;
      for (int64_t j = 0; j < cols; ++j) yr[j] = b[j] + yr[j];
    }
  });
}

void round_bf16(float* y, const float* x, int64_t n) {
  parallel_for(n, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) y[i] = to_f32(to_bf16(x[i]));
  });
}

void pack_bf16(uint16_t* y, const float* x, int64_t n) {
  parallel_for(n, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) y[i] = to_bf16(x[i]).bits;
  });
}

void unpack_bf16(float* y, const uint16_t* x, int64_t n) {
  parallel_for(n, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) y[i] = to_f32(bf16{x[i]});
  });
}

void zero_rows_of_zeros(float* act, const float* x, int64_t R, int64_t F, int64_t C) {
  parallel_for(R, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * C;
      uint32_t bits = 0;
      for (int64_t j = 0; j < C; ++j) bits |= std::bit_cast<uint32_t>(xr[j]) & 0x7fffffffu;
      if (bits == 0) std::fill(act + r * F, act + (r + 1) * F, 0.0f);
    }
  });
}

}  // namespace lockstep
