#include "lockstep/kernels/cpu/rope.h"

#include <cmath>

#include "lockstep/core/error.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/kernels/cpu/vecmath.h"

namespace lockstep {

namespace {

// Rotates each pair (lo[i], hi[i]) by +angle, or by -angle (kInverse: the transpose, which is the
// backward of the rotation). Negating sin is exact, so both directions share one formula.
template <bool kInverse>
void rope_rotate(float* x, const float* cos, const float* sin, int64_t N, int64_t T, int64_t heads, int64_t HS,
                 int64_t row_stride, const int32_t* positions) {
  LOCKSTEP_CHECK(HS % 2 == 0, "rope head size must be even, got ", HS);
  LOCKSTEP_CHECK(heads * HS <= row_stride, "rope: ", heads, " heads of ", HS, " do not fit a row of ", row_stride);
  if (positions)
    for (int64_t n = 0; n < N; ++n)
      LOCKSTEP_CHECK(positions[n] >= 0 && positions[n] < T, "rope: position ", positions[n], " of row ", n,
                     " is outside the table [0, ", T, ")");
  const int64_t half = HS / 2;
  parallel_for(N, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t pos = positions ? positions[n] : n % T;
      const float* c = cos + pos * half;
      const float* s = sin + pos * half;
      for (int64_t h = 0; h < heads; ++h) {
        float* lo = x + n * row_stride + h * HS;
        float* hi = lo + half;
        vm::for_lanes(0, half, [&]<class V>(int64_t i, V) {
          const V a = vm::load<V>(lo + i);
          const V b = vm::load<V>(hi + i);
          const V cv = vm::load<V>(c + i);
          const V sv = kInverse ? -vm::load<V>(s + i) : vm::load<V>(s + i);
          vm::store(lo + i, vm::fma(a, cv, -(b * sv)));
          vm::store(hi + i, vm::fma(b, cv, a * sv));
        });
      }
    }
  });
}

}  // namespace

void rope_forward(float* x, const float* cos, const float* sin, int64_t N, int64_t T, int64_t heads, int64_t HS,
                  int64_t row_stride, const int32_t* positions) {
  rope_rotate<false>(x, cos, sin, N, T, heads, HS, row_stride, positions);
}

void rope_backward(float* dx, const float* cos, const float* sin, int64_t N, int64_t T, int64_t heads, int64_t HS,
                   int64_t row_stride, const int32_t* positions) {
  rope_rotate<true>(dx, cos, sin, N, T, heads, HS, row_stride, positions);
}

}  // namespace lockstep
