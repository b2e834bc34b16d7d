#include "lockstep/kernels/cpu/norms.h"

#include <algorithm>
#include <cmath>

#include "lockstep/core/thread_pool.h"
#include "lockstep/core/tree_sum.h"
#include "lockstep/kernels/cpu/vecmath.h"

namespace lockstep {
namespace {

// K sums over a row of C elements in one fixed order. step(i, acc), lane-generic (vecmath.h),
// adds the terms of elements [i, i + lanes) into acc[0..K). Element i goes to lane i % 8 of chain
// (i / 8) % 4 while whole 32-element blocks last (four chains hide the add latency); the chains
// are combined as (0 + 1) + (2 + 3); the remaining whole 8-element blocks add into that; the lanes
// are summed in vm::hsum order; the last C % 8 elements add one by one. The portable build runs
// exactly this order with scalar lanes, so both builds give the same bits.
template <int K, class Step>
void row_sums(float* total, int64_t C, Step step) {
  int64_t i = 0;
#ifdef LOCKSTEP_AVX2
  __m256 chain[4][K] = {};
  for (; i + 32 <= C; i += 32)
    for (int c = 0; c < 4; ++c) step(i + 8 * c, chain[c]);
  __m256 acc[K];
  for (int k = 0; k < K; ++k) acc[k] = (chain[0][k] + chain[1][k]) + (chain[2][k] + chain[3][k]);
  for (; i + 8 <= C; i += 8) step(i, acc);
  for (int k = 0; k < K; ++k) total[k] = vm::hsum(acc[k]);
#else
  float chain[4][8][K] = {};
  for (; i + 32 <= C; i += 32)
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 8; ++l) step(i + 8 * c + l, chain[c][l]);
  float acc[8][K];
  for (int l = 0; l < 8; ++l)
    for (int k = 0; k < K; ++k) acc[l][k] = (chain[0][l][k] + chain[1][l][k]) + (chain[2][l][k] + chain[3][l][k]);
  for (; i + 8 <= C; i += 8)
    for (int l = 0; l < 8; ++l) step(i + l, acc[l]);
  for (int k = 0; k < K; ++k) {
    float lanes[8];
    for (int l = 0; l < 8; ++l) lanes[l] = acc[l][k];
    total[k] = vm::hsum8(lanes);
  }
#endif
  for (; i < C; ++i) step(i, total);
}

// kCentered: LayerNorm (subtract the mean, add bias); otherwise RMSNorm.
template <bool kCentered>
void norm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                  int64_t N, int64_t C, float eps) {
  parallel_for(N, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* x = inp + n * C;
      float* o = out + n * C;
      float m = 0.0f;
      if constexpr (kCentered) {
        float sum;
        row_sums<1>(&sum, C, [&]<class V>(int64_t i, V* acc) { acc[0] = acc[0] + vm::load<V>(x + i); });
        m = sum / static_cast<float>(C);
        mean[n] = m;
      }
      // Two passes (mean, then squared deviations): no cancellation when |mean| >> std.
      float sq = 0.0f;
      row_sums<1>(&sq, C, [&]<class V>(int64_t i, V* acc) {
        const V d = vm::load<V>(x + i) - m;
        acc[0] = vm::fma(d, d, acc[0]);
      });
      const float s = 1.0f / std::sqrt(sq / static_cast<float>(C) + eps);
      rstd[n] = s;
      vm::for_lanes(0, C, [&]<class V>(int64_t i, V) {
        const V xhat = (vm::load<V>(x + i) - m) * s;
        if constexpr (kCentered) {
          vm::store(o + i, vm::fma(xhat, vm::load<V>(weight + i), vm::load<V>(bias + i)));
        } else {
          vm::store(o + i, xhat * vm::load<V>(weight + i));
        }
      });
    }
  });
}

// dinp += d(out)/d(inp) applied to dout, row by row.
template <bool kCentered>
void norm_backward_rows(float* dinp, const float* dout, const float* inp, const float* weight, const float* mean,
                        const float* rstd, int64_t N, int64_t C) {
  parallel_for(N, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* x = inp + n * C;
      const float* dy = dout + n * C;
      float* dx = dinp + n * C;
      const float m = kCentered ? mean[n] : 0.0f;
      const float s = rstd[n];
      // sums[0] = sum(g), sums[1] = sum(g * xhat) with g = dout * weight.
      float sums[2] = {0.0f, 0.0f};
      row_sums<kCentered ? 2 : 1>(kCentered ? sums : sums + 1, C, [&]<class V>(int64_t i, V* acc) {
        const V g = vm::load<V>(dy + i) * vm::load<V>(weight + i);
        const V xhat = (vm::load<V>(x + i) - m) * s;
        if constexpr (kCentered) {
          acc[0] = acc[0] + g;
          acc[1] = vm::fma(g, xhat, acc[1]);
        } else {
          acc[0] = vm::fma(g, xhat, acc[0]);
        }
      });
      const float g_mean = sums[0] / static_cast<float>(C);
      const float gx_mean = sums[1] / static_cast<float>(C);
      vm::for_lanes(0, C, [&]<class V>(int64_t i, V) {
        const V g = vm::load<V>(dy + i) * vm::load<V>(weight + i);
        const V xhat = (vm::load<V>(x + i) - m) * s;
        V t;
        if constexpr (kCentered) {
          t = g - (xhat * gx_mean + g_mean);
        } else {
          t = g - xhat * gx_mean;
        }
        vm::store(dx + i, vm::load<V>(dx + i) + t * s);
      });
    }
  });
}

// dweight[j] += sum_n dout[n, j] * xhat[n, j], dbias[j] += sum_n dout[n, j], rows in order. Each
// thread owns a range of columns; a column's arithmetic is the same in a vector lane or in the
// scalar tail, so the column split does not change any bit. segments > 0: each token segment's sums
// from zero, then the canonical tree over the segments (norms.h).
template <bool kCentered>
void norm_backward_columns(float* dweight, float* dbias, const float* dout, const float* inp, const float* mean,
                           const float* rstd, int64_t N, int64_t C, int64_t segments) {
  // Wide column tiles: each row's slice of the tile is one long contiguous run (the prefetchers
  // need it; 256 columns measured 1.7x slower), and the tile's accumulators (16 KiB) stay in L1.
  constexpr int64_t kTile = 2048;
  // Rows [r0, r1) of the tile at column c0 into dw, db.
  const auto rows = [&](float* dw, float* db, int64_t r0, int64_t r1, int64_t c0, int64_t width) {
    for (int64_t n = r0; n < r1; ++n) {
      const float* x = inp + n * C + c0;
      const float* dy = dout + n * C + c0;
      const float m = kCentered ? mean[n] : 0.0f;
      const float s = rstd[n];
      vm::for_lanes(0, width, [&]<class V>(int64_t j, V) {
        const V g = vm::load<V>(dy + j);
        const V xhat = (vm::load<V>(x + j) - m) * s;
        vm::store(dw + j, vm::fma(g, xhat, vm::load<V>(dw + j)));
        if constexpr (kCentered) vm::store(db + j, vm::load<V>(db + j) + g);
      });
    }
  };
  const std::vector<int64_t> bounds = canonical_segments(N, segments);
  parallel_for((C + 7) / 8, [&](int64_t block_begin, int64_t block_end) {
    const int64_t col_end = std::min(block_end * 8, C);
    // Layout: every segment's tile (weight, then bias).
    const int64_t parts = kCentered ? 2 : 1;
    std::vector<float> seg(static_cast<size_t>(segments * parts * kTile));
    for (int64_t c0 = block_begin * 8; c0 < col_end; c0 += kTile) {
      const int64_t width = std::min(kTile, col_end - c0);
      if (segments == 0) {
        alignas(32) float dw[kTile] = {};
        alignas(32) float db[kTile] = {};
        rows(dw, db, 0, N, c0, width);
        for (int64_t j = 0; j < width; ++j) {
          dweight[c0 + j] += dw[j];
          if constexpr (kCentered) dbias[c0 + j] += db[j];
        }
        continue;
      }
      std::fill(seg.begin(), seg.end(), 0.0f);
      for (int64_t k = 0; k < segments; ++k)
        rows(seg.data() + k * kTile, kCentered ? seg.data() + (segments + k) * kTile : nullptr, bounds[k],
             bounds[k + 1], c0, width);
      for (int64_t p = 0; p < parts; ++p) {
        float* sum = seg.data() + p * segments * kTile;  // the tree over the part's segments, into its first
        tree_sum_in_place(sum, segments, kTile, 0, width);
        float* d = p == 0 ? dweight : dbias;
        for (int64_t j = 0; j < width; ++j) d[c0 + j] += sum[j];
      }
    }
  });
}

}  // namespace

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int64_t N, int64_t C, float eps) {
  norm_forward<true>(out, mean, rstd, inp, weight, bias, N, C, eps);
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int64_t N, int64_t C,
                        int64_t segments) {
  norm_backward_rows<true>(dinp, dout, inp, weight, mean, rstd, N, C);
  norm_backward_columns<true>(dweight, dbias, dout, inp, mean, rstd, N, C, segments);
}

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C, float eps) {
  norm_forward<false>(out, nullptr, rstd, inp, weight, nullptr, N, C, eps);
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, int64_t N, int64_t C, int64_t segments) {
  norm_backward_rows<false>(dinp, dout, inp, weight, nullptr, rstd, N, C);
  norm_backward_columns<false>(dweight, nullptr, dout, inp, nullptr, rstd, N, C, segments);
}

}  // namespace lockstep
