#include "lockstep/kernels/cpu/optimizer.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <vector>

#include "lockstep/core/error.h"
#include "lockstep/core/hash.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/kernels/cpu/vecmath.h"

namespace lockstep {

namespace {
// fp32 scalars of one update, derived once per step.
struct AdamWScalars {
  float decay, b1, c1, b2, c2, step_size, bc2_sqrt, eps, grad_scale;
};

// Plain IEEE operations in the header's order; the compiler vectorises this loop without changing
// a bit (-ffp-contract=off, no fast-math). The scalars come by value so that it can keep them in
// registers. Returns whether a written parameter is not finite: an OR over the exponent test (an
// integer reduction, which vectorises; a float one would not without reassociation).
bool adamw_range(float* __restrict p, float* __restrict m, float* __restrict v, const float* __restrict grad, int64_t n,
                 const AdamWScalars s) {
  uint32_t nonfinite = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] * s.grad_scale;
    const float pi = p[i] * s.decay;
    const float mi = s.b1 * m[i] + s.c1 * g;
    const float vi = s.b2 * v[i] + s.c2 * g * g;
    m[i] = mi;
    v[i] = vi;
    const float pn = pi - s.step_size * mi / (std::sqrt(vi) / s.bc2_sqrt + s.eps);
    p[i] = pn;
    nonfinite |= (std::bit_cast<uint32_t>(pn) & 0x7f800000u) == 0x7f800000u;
  }
  return nonfinite != 0;
}
}  // namespace

namespace {
AdamWScalars adamw_scalars(const AdamW& hp, int64_t step, float grad_scale) {
  LOCKSTEP_CHECK(step >= 1, "AdamW step counts from 1, got ", step);
  // Scalars as torch computes them: in double (Python floats), rounded once to fp32 when they
  // meet the fp32 tensors.
  const double lr = hp.lr, b1 = hp.beta1, b2 = hp.beta2, steps = static_cast<double>(step);
  return AdamWScalars{
      .decay = static_cast<float>(1.0 - lr * static_cast<double>(hp.weight_decay)),
      .b1 = hp.beta1,
      .c1 = static_cast<float>(1.0 - b1),
      .b2 = hp.beta2,
      .c2 = static_cast<float>(1.0 - b2),
      .step_size = static_cast<float>(lr / (1.0 - std::pow(b1, steps))),
      .bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(b2, steps))),
      .eps = hp.eps,
      .grad_scale = grad_scale,
  };
}
}  // namespace

bool adamw_update(float* param, float* m, float* v, const float* grad, int64_t n, const AdamW& hp, int64_t step,
                  float grad_scale) {
  const AdamWScalars s = adamw_scalars(hp, step, grad_scale);
  std::atomic<bool> nonfinite{false};
  parallel_for(n, [&](int64_t begin, int64_t end) {
    if (adamw_range(param + begin, m + begin, v + begin, grad + begin, end - begin, s))
      nonfinite.store(true, std::memory_order_relaxed);
  });
  return nonfinite.load();
}

bool adamw_update_hashed(const AdamwHashedItem& t, bool update, int64_t step, float grad_scale) {
  const int64_t n = t.n, state_begin = t.state_begin, state_end = t.state_end;
  float *param = t.param, *m = t.m, *v = t.v;
  const float* grad = t.grad;
  uint64_t* hashes = t.hashes;
  LOCKSTEP_CHECK(0 <= state_begin && state_begin <= state_end && state_end <= n);
  const AdamWScalars s = update ? adamw_scalars(t.hp, step, grad_scale) : AdamWScalars{};
  bool nonfinite = false;
  // 4 x 64 KiB per piece: the piece's gradient, m, v and parameters stay in L2 until hashed. The
  // pieces also end where the hashed state range does.
  constexpr int64_t kPiece = 16384;
  // A bf16 moment: the piece's values widened into fp32 here, updated, rounded back.
  thread_local std::vector<float> wide_m, wide_v;
  auto widen = [](std::vector<float>& w, const bf16* x, int64_t len) {
    w.resize(static_cast<size_t>(len));
    for (int64_t j = 0; j < len; ++j) w[static_cast<size_t>(j)] = to_f32(x[j]);
    return w.data();
  };
  Hasher g, mh, vh, ph;
  for (int64_t i = 0; i < n;) {
    int64_t next = std::min(i + kPiece, n);
    for (const int64_t cut : {state_begin, state_end})
      if (cut > i && cut < next) next = cut;
    const int64_t len = next - i;
    if (update) {
      float* mi = t.m_bf16 ? widen(wide_m, t.m_bf16 + i, len) : m + i;
      float* vi = t.v_bf16 ? widen(wide_v, t.v_bf16 + i, len) : v + i;
      if (adamw_range(param + i, mi, vi, grad + i, len, s)) nonfinite = true;
      for (int64_t j = 0; t.m_bf16 && j < len; ++j) t.m_bf16[i + j] = to_bf16(mi[j]);
      for (int64_t j = 0; t.v_bf16 && j < len; ++j) t.v_bf16[i + j] = to_bf16(vi[j]);
    }
    const size_t bytes = static_cast<size_t>(len) * sizeof(float), half = static_cast<size_t>(len) * sizeof(bf16);
    ph.update(param + i, bytes);
    if (i >= state_begin && next <= state_end) {
      g.update(grad + i, bytes);
      if (t.m_bf16)
        mh.update(t.m_bf16 + i, half);
      else
        mh.update(m + i, bytes);
      if (t.v_bf16)
        vh.update(t.v_bf16 + i, half);
      else
        vh.update(v + i, bytes);
    }
    i = next;
  }
  hashes[0] = g.digest();
  hashes[1] = mh.digest();
  hashes[2] = vh.digest();
  hashes[3] = ph.digest();
  return nonfinite;
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

namespace {
// Each item on one thread, whole (the pool's threads claim them in order). update: AdamW and the
// hashes, else the hashes only. Returns whether an updated parameter is not finite.
bool hashed_items(const AdamwHashedItem* items, int64_t count, int64_t step, float grad_scale, bool update) {
  std::atomic<bool> nonfinite{false};
  auto run = [&](int64_t i) {
    if (adamw_update_hashed(items[i], update, step, grad_scale)) nonfinite.store(true, std::memory_order_relaxed);
  };
  ThreadPool* pool = ThreadPool::current();
  if (pool && pool->threads() > 1 && count > 1) {
    pool->run_parts(count, run);
  } else {
    for (int64_t i = 0; i < count; ++i) run(i);
  }
  return nonfinite.load();
}
}  // namespace

bool adamw_update_hashed_items(const AdamwHashedItem* items, int64_t count, int64_t step, float grad_scale) {
  return hashed_items(items, count, step, grad_scale, true);
}

void adam_state_hashes(const AdamwHashedItem* items, int64_t count) { hashed_items(items, count, 1, 1.0f, false); }

}  // namespace lockstep
