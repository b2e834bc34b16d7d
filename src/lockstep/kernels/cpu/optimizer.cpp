#include "lockstep/kernels/cpu/optimizer.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "lockstep/core/error.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/kernels/cpu/vecmath.h"

namespace lockstep {

void adamw_update(float* param, float* m, float* v, const float* grad, int64_t n,
                  const AdamW& hp, int64_t step, float grad_scale) {
  LOCKSTEP_CHECK(step >= 1, "AdamW step counts from 1, got ", step);
  // Scalars as torch computes them: in double (Python floats), rounded once to fp32 when they
  // meet the fp32 tensors.
  const double lr = hp.lr;
  const float decay = static_cast<float>(1.0 - lr * static_cast<double>(hp.weight_decay));
  const float b1 = hp.beta1, b2 = hp.beta2, eps = hp.eps;
  const float c1 = static_cast<float>(1.0 - static_cast<double>(hp.beta1));
  const float c2 = static_cast<float>(1.0 - static_cast<double>(hp.beta2));
  const double steps = static_cast<double>(step);
  const float step_size =
      static_cast<float>(lr / (1.0 - std::pow(static_cast<double>(hp.beta1), steps)));
  const float bc2_sqrt =
      static_cast<float>(std::sqrt(1.0 - std::pow(static_cast<double>(hp.beta2), steps)));
  parallel_for(n, [&](int64_t begin, int64_t end) {
    float* __restrict p = param;
    float* __restrict pm = m;
    float* __restrict pv = v;
    const float* __restrict pg = grad;
    // Plain IEEE operations in the header's order; the compiler vectorises this loop without
    // changing a bit (-ffp-contract=off, no fast-math).
    for (int64_t i = begin; i < end; ++i) {
      const float g = pg[i] * grad_scale;
      const float pi = p[i] * decay;
      const float mi = b1 * pm[i] + c1 * g;
      const float vi = b2 * pv[i] + c2 * g * g;
      pm[i] = mi;
      pv[i] = vi;
      p[i] = pi - step_size * mi / (std::sqrt(vi) / bc2_sqrt + eps);
    }
  });
}

namespace {
// One block's sum of squares in double over 16 lanes (four 4-wide accumulators): element i of the
// 16-aligned body goes to lane i % 16, lanes combine as (a0 + a1) + (a2 + a3), then
// (l0 + l2) + (l1 + l3); the tail follows in order. The portable path mirrors it lane by lane.
// Products of two floats are exact in double.
double block_sum_of_squares(const float* x, int64_t len) {
  const int64_t body = len / 16 * 16;
  double s;
#ifdef LOCKSTEP_AVX2
  __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < body; i += 16) {
    const __m256d x0 = _mm256_cvtps_pd(_mm_loadu_ps(x + i));
    const __m256d x1 = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4));
    const __m256d x2 = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 8));
    const __m256d x3 = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 12));
    a0 = _mm256_add_pd(a0, _mm256_mul_pd(x0, x0));
    a1 = _mm256_add_pd(a1, _mm256_mul_pd(x1, x1));
    a2 = _mm256_add_pd(a2, _mm256_mul_pd(x2, x2));
    a3 = _mm256_add_pd(a3, _mm256_mul_pd(x3, x3));
  }
  const __m256d l = _mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3));
  const __m128d h = _mm_add_pd(_mm256_castpd256_pd128(l), _mm256_extractf128_pd(l, 1));
  s = _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
#else
  double a[16] = {};
  for (int64_t i = 0; i < body; i += 16) {
    for (int j = 0; j < 16; ++j) {
      const double xi = x[i + j];
      a[j] += xi * xi;
    }
  }
  double l[4];
  for (int k = 0; k < 4; ++k) l[k] = (a[k] + a[4 + k]) + (a[8 + k] + a[12 + k]);
  s = (l[0] + l[2]) + (l[1] + l[3]);
#endif
  for (int64_t i = body; i < len; ++i) {
    const double xi = x[i];
    s += xi * xi;
  }
  return s;
}
}  // namespace

double sum_of_squares(const float* x, int64_t n) {
  const int64_t blocks = (n + kNormBlock - 1) / kNormBlock;
  std::vector<double> sums(static_cast<size_t>(blocks));
  parallel_for(blocks, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      sums[b] = block_sum_of_squares(x + b * kNormBlock, std::min(kNormBlock, n - b * kNormBlock));
    }
  });
  double total = 0.0;
  for (double s : sums) total += s;
  return total;
}

}  // namespace lockstep
