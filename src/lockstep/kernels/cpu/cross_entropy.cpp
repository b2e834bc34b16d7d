#include "lockstep/kernels/cpu/cross_entropy.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "lockstep/core/error.h"
#include "lockstep/core/libm.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/core/tree_sum.h"
#include "lockstep/kernels/cpu/vecmath.h"

namespace lockstep {

namespace {

// Reductions over a chunk use 32 lanes (four 8-wide accumulators, for instruction-level
// parallelism): element i of the 32-aligned body goes to lane i % 32; lanes are combined as
// (a0 op a1) op (a2 op a3), then in vecmath's horizontal order; the tail (< 32 elements) follows
// in element order. The portable path mirrors this lane by lane, so both give the same bits.
constexpr int64_t kLanes = 32;

// max(a, b) with the semantics of _mm256_max_ps(a, b), so that the portable path matches it even
// for signed zeros.
inline float max_ps(float a, float b) { return a > b ? a : b; }

// (M, S) <- the log-sum-exp pair of (M, S) followed by (m, s): the combine of consecutive chunks
// within a row, and of vocabulary shards across ranks.
inline void combine(float& M, float& S, float m, float s) {
  const float Mn = max_ps(M, m);
  S = S * vm::exp(M - Mn) + s * vm::exp(m - Mn);
  M = Mn;
}

float chunk_max(const float* x, int64_t len) {
  const int64_t body = len / kLanes * kLanes;
  float m;
#ifdef LOCKSTEP_AVX2
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 a0 = ninf, a1 = ninf, a2 = ninf, a3 = ninf;
  for (int64_t i = 0; i < body; i += kLanes) {
    a0 = _mm256_max_ps(a0, _mm256_loadu_ps(x + i));
    a1 = _mm256_max_ps(a1, _mm256_loadu_ps(x + i + 8));
    a2 = _mm256_max_ps(a2, _mm256_loadu_ps(x + i + 16));
    a3 = _mm256_max_ps(a3, _mm256_loadu_ps(x + i + 24));
  }
  m = vm::hmax(_mm256_max_ps(_mm256_max_ps(a0, a1), _mm256_max_ps(a2, a3)));
#else
  float a[kLanes];
  for (float& v : a) v = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < body; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) a[j] = max_ps(a[j], x[i + j]);
  }
  float l[8];
  for (int k = 0; k < 8; ++k) l[k] = max_ps(max_ps(a[k], a[8 + k]), max_ps(a[16 + k], a[24 + k]));
  const float h0 = max_ps(l[0], l[4]), h1 = max_ps(l[1], l[5]), h2 = max_ps(l[2], l[6]), h3 = max_ps(l[3], l[7]);
  m = max_ps(max_ps(h0, h2), max_ps(h1, h3));
#endif
  for (int64_t i = body; i < len; ++i) m = max_ps(m, x[i]);
  return m;
}

// Sum of exp(x[i] - shift) over the chunk; with kStore, also writes each exp(x[i] - shift) to
// e[i] (e may alias x).
template <bool kStore>
float chunk_sum_exp(float* e, const float* x, int64_t len, float shift) {
  const int64_t body = len / kLanes * kLanes;
  float s;
#ifdef LOCKSTEP_AVX2
  const __m256 vs = _mm256_set1_ps(shift);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < body; i += kLanes) {
    const __m256 e0 = vm::exp(_mm256_sub_ps(_mm256_loadu_ps(x + i), vs));
    const __m256 e1 = vm::exp(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), vs));
    const __m256 e2 = vm::exp(_mm256_sub_ps(_mm256_loadu_ps(x + i + 16), vs));
    const __m256 e3 = vm::exp(_mm256_sub_ps(_mm256_loadu_ps(x + i + 24), vs));
    if constexpr (kStore) {
      _mm256_storeu_ps(e + i, e0);
      _mm256_storeu_ps(e + i + 8, e1);
      _mm256_storeu_ps(e + i + 16, e2);
      _mm256_storeu_ps(e + i + 24, e3);
    }
    a0 = _mm256_add_ps(a0, e0);
    a1 = _mm256_add_ps(a1, e1);
    a2 = _mm256_add_ps(a2, e2);
    a3 = _mm256_add_ps(a3, e3);
  }
  s = vm::hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#else
  float a[kLanes] = {};
  for (int64_t i = 0; i < body; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) {
      const float v = vm::exp(x[i + j] - shift);
      if constexpr (kStore) e[i + j] = v;
      a[j] += v;
    }
  }
  float l[8];
  for (int k = 0; k < 8; ++k) l[k] = (a[k] + a[8 + k]) + (a[16 + k] + a[24 + k]);
  s = vm::hsum8(l);
#endif
  for (int64_t i = body; i < len; ++i) {
    const float v = vm::exp(x[i] - shift);
    if constexpr (kStore) e[i] = v;
    s += v;
  }
  return s;
}

// The log-sum-exp pair (M, S) of one row of V logits: chunk by chunk, an online (max, sum) pair
// per chunk, chunks combined left to right (combine()). With kStore, e (may alias x) receives
// exp(x - chunk max) and cmax each chunk's max, for the gradient pass. cmax: one float per chunk.
template <bool kStore>
void row_lse(float* e, const float* x, int64_t V, float* cmax, float& M, float& S) {
  int64_t c = 0;
  for (int64_t j = 0; j < V; j += kXentChunk, ++c) {
    const int64_t len = std::min(kXentChunk, V - j);
    const float m = chunk_max(x + j, len);
    // A fully masked chunk (all -inf) contributes nothing; shifting by 0 keeps its exps at 0
    // instead of exp(-inf - -inf) = NaN.
    const float shift = m == -std::numeric_limits<float>::infinity() ? 0.0f : m;
    const float s = chunk_sum_exp<kStore>(kStore ? e + j : nullptr, x + j, len, shift);
    cmax[c] = m;
    if (j == 0) {
      M = m;
      S = s;
    } else {
      combine(M, S, m, s);
    }
  }
}

// The gradient pass: e holds exp(x - chunk max) (row_lse<true>); each chunk is rescaled by
// exp(chunk max - M) / S x grad_scale, so each logit goes through exp once.
void row_grad(float* e, int64_t V, const float* cmax, float M, float S, float grad_scale) {
  int64_t c = 0;
  for (int64_t j = 0; j < V; j += kXentChunk, ++c) {
    const int64_t len = std::min(kXentChunk, V - j);
    const float k = vm::exp(cmax[c] - M) / S * grad_scale;
    float* __restrict g = e + j;
    for (int64_t i = 0; i < len; ++i) g[i] *= k;
  }
}

// Loss of one row. With kBackward, the row is overwritten with its gradient. cmax: scratch of one
// float per chunk.
template <bool kBackward>
float row_loss(float* grad, const float* x, int64_t V, int32_t target, float grad_scale, float* cmax) {
  const float xt = x[target];
  float M = 0.0f, S = 0.0f;
  row_lse<kBackward>(grad, x, V, cmax, M, S);
  if constexpr (kBackward) {
    row_grad(grad, V, cmax, M, S, grad_scale);
    grad[target] -= grad_scale;
  }
  return (M + libm::logf(S)) - xt;
}

void check_targets(const int32_t* targets, int64_t N, int64_t V) {
  for (int64_t n = 0; n < N; ++n) {
    if (targets[n] >= V) {
      user_error("cross_entropy: target ", targets[n], " at row ", n, " is outside the vocabulary [0, ", V, ")");
    }
  }
}

template <bool kBackward>
void cross_entropy(float* losses, float* grad, const float* logits, const int32_t* targets, int64_t N, int64_t V,
                   int64_t ld, float grad_scale) {
  check_targets(targets, N, V);
  const int64_t chunks = (V + kXentChunk - 1) / kXentChunk;
  parallel_for(N, [&](int64_t begin, int64_t end) {
    std::vector<float> cmax(static_cast<size_t>(chunks));
    for (int64_t n = begin; n < end; ++n) {
      if (targets[n] < 0) {
        losses[n] = 0.0f;
        if constexpr (kBackward) std::fill(grad + n * ld, grad + n * ld + V, 0.0f);
        continue;
      }
      losses[n] = row_loss<kBackward>(kBackward ? grad + n * ld : nullptr, logits + n * ld, V, targets[n], grad_scale,
                                      cmax.data());
    }
  });
}

}  // namespace

void cross_entropy_forward(float* losses, const float* logits, const int32_t* targets, int64_t N, int64_t V,
                           int64_t ld) {
  cross_entropy<false>(losses, nullptr, logits, targets, N, V, ld, 0.0f);
}

void cross_entropy_forward_backward(float* losses, float* logits, const int32_t* targets, int64_t N, int64_t V,
                                    int64_t ld, float grad_scale) {
  cross_entropy<true>(losses, logits, logits, targets, N, V, ld, grad_scale);
}

void cross_entropy_shard_lse(float* stats, float* cmax, float* logits, const int32_t* targets, int64_t N, int64_t V,
                             int64_t ld, int64_t vocab_begin, int64_t vocab_size, bool store) {
  check_targets(targets, N, vocab_size);
  const int64_t chunks = (V + kXentChunk - 1) / kXentChunk;
  parallel_for(N, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      float* st = stats + 3 * n;
      float* x = logits + n * ld;
      const int64_t t = static_cast<int64_t>(targets[n]) - vocab_begin;
      st[2] = t >= 0 && t < V && targets[n] >= 0 ? x[t] : 0.0f;
      if (store)
        row_lse<true>(x, x, V, cmax + n * chunks, st[0], st[1]);
      else
        row_lse<false>(nullptr, x, V, cmax + n * chunks, st[0], st[1]);
    }
  });
}

void cross_entropy_combine(float* losses, float* lse, const float* stats, const int32_t* targets, int64_t N,
                           int64_t P) {
  parallel_for(N, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      float M = stats[3 * n], S = stats[3 * n + 1], xt = stats[3 * n + 2];
      for (int64_t r = 1; r < P; ++r) {
        const float* st = stats + 3 * (r * N + n);
        combine(M, S, st[0], st[1]);
        xt += st[2];
      }
      lse[2 * n] = M;
      lse[2 * n + 1] = S;
      losses[n] = targets[n] < 0 ? 0.0f : (M + libm::logf(S)) - xt;
    }
  });
}

void cross_entropy_shard_backward(float* logits, const float* cmax, const float* lse, const int32_t* targets, int64_t N,
                                  int64_t V, int64_t ld, int64_t vocab_begin, float grad_scale) {
  const int64_t chunks = (V + kXentChunk - 1) / kXentChunk;
  parallel_for(N, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      float* g = logits + n * ld;
      if (targets[n] < 0) {
        std::fill(g, g + V, 0.0f);
        continue;
      }
      row_grad(g, V, cmax + n * chunks, lse[2 * n], lse[2 * n + 1], grad_scale);
      const int64_t t = static_cast<int64_t>(targets[n]) - vocab_begin;
      if (t >= 0 && t < V) g[t] -= grad_scale;
    }
  });
}

// ---- The layout form.

void cross_entropy_segments_max(float* rowmax, const float* logits, const int32_t* targets, int64_t N, int64_t V,
                                int64_t ld, int64_t vocab_size) {
  check_targets(targets, N, vocab_size);
  parallel_for(N, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float m = V > 0 ? chunk_max(logits + n * ld, V) : -std::numeric_limits<float>::infinity();
      rowmax[n] = m == 0.0f ? 0.0f : m;  // a max of +0 and -0 depends on the order: read both as +0
    }
  });
}

void cross_entropy_segments_sum(float* stats, float* logits, const float* rowmax, const int32_t* targets, int64_t N,
                                int64_t V, int64_t ld, int64_t vocab_begin, int64_t vocab_size, int64_t segments,
                                bool store) {
  const int64_t S = segments;
  const auto bound = [&](int64_t s) { return s * vocab_size / S; };
  // This shard's segments [s0, s0 + n): its columns must be exactly theirs, and a subtree. Segment s
  // starts at bound(s) = floor(s vocab_size / S), so the first segment starting at or after column c
  // is ceil(c S / vocab_size).
  const auto first_at = [&](int64_t c) { return (c * S + vocab_size - 1) / vocab_size; };
  const int64_t s0 = first_at(vocab_begin), n = first_at(vocab_begin + V) - s0;
  LOCKSTEP_CHECK(S > 0 && n > 0 && bound(s0) == vocab_begin && bound(s0 + n) == vocab_begin + V &&
                     std::has_single_bit(static_cast<uint64_t>(n)) && s0 % n == 0,
                 "cross_entropy_segments_sum: the columns [", vocab_begin, ", ", vocab_begin + V, ") of ", vocab_size,
                 " are not a subtree of ", S, " segments");
  parallel_for(N, [&](int64_t begin, int64_t end) {
    std::vector<float> z(static_cast<size_t>(n)), stack(static_cast<size_t>(tree_sum_stack(n)));
    std::vector<const float*> leaves(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; ++j) leaves[static_cast<size_t>(j)] = &z[static_cast<size_t>(j)];
    for (int64_t r = begin; r < end; ++r) {
      float* x = logits + r * ld;
      const int64_t t = static_cast<int64_t>(targets[r]) - vocab_begin;
      // Read before the exps overwrite it; -0 on the shards without the target: x + -0 = x.
      const float xt = targets[r] >= 0 && t >= 0 && t < V ? x[t] : -0.0f;
      const float m = rowmax[r];
      // A fully masked row (all -inf) shifts by 0: its exps are 0, not exp(-inf - -inf) = NaN.
      const float shift = m == -std::numeric_limits<float>::infinity() ? 0.0f : m;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t c0 = bound(s0 + j) - vocab_begin, len = bound(s0 + j + 1) - vocab_begin - c0;
        z[static_cast<size_t>(j)] =
            store ? chunk_sum_exp<true>(x + c0, x + c0, len, shift) : chunk_sum_exp<false>(nullptr, x + c0, len, shift);
      }
      tree_sum(stats + 2 * r, leaves.data(), n, 1, stack.data());
      stats[2 * r + 1] = xt;
    }
  });
}

void cross_entropy_segments_loss(float* losses, const float* rowmax, const float* stats, const int32_t* targets,
                                 int64_t N) {
  for (int64_t n = 0; n < N; ++n)
    losses[n] = targets[n] < 0 ? 0.0f : (rowmax[n] + libm::logf(stats[2 * n])) - stats[2 * n + 1];
}

void cross_entropy_segments_backward(float* logits, const float* stats, const int32_t* targets, int64_t N, int64_t V,
                                     int64_t ld, int64_t vocab_begin, float grad_scale) {
  parallel_for(N, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      float* __restrict g = logits + n * ld;
      if (targets[n] < 0) {
        std::fill(g, g + V, 0.0f);
        continue;
      }
      const float k = grad_scale / stats[2 * n];
      for (int64_t i = 0; i < V; ++i) g[i] *= k;
      const int64_t t = static_cast<int64_t>(targets[n]) - vocab_begin;
      if (t >= 0 && t < V) g[t] -= grad_scale;
    }
  });
}

void cross_entropy_segments(float* losses, float* logits, const int32_t* targets, int64_t N, int64_t V, int64_t ld,
                            int64_t segments, bool backward, float grad_scale, float* scratch) {
  float* rowmax = scratch;
  float* stats = scratch + N;
  cross_entropy_segments_max(rowmax, logits, targets, N, V, ld, V);
  cross_entropy_segments_sum(stats, logits, rowmax, targets, N, V, ld, 0, V, segments, backward);
  cross_entropy_segments_loss(losses, rowmax, stats, targets, N);
  if (backward) cross_entropy_segments_backward(logits, stats, targets, N, V, ld, 0, grad_scale);
}

}  // namespace lockstep
