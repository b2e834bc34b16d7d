#include "lockstep/kernels/cpu/grouped_gemm.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <span>
#include <vector>

#include "lockstep/core/error.h"
#include "lockstep/core/thread_pool.h"

namespace lockstep {

namespace {
// Column block of the bias gradient: one thread sums these columns of one expert over its rows.
constexpr int64_t kBiasColBlock = 64;
}  // namespace

void grouped_gemm(float* C, const float* A, const float* W, Trans tw, const float* bias, const int64_t* offsets,
                  int64_t E, int64_t Nout, int64_t K, bool accumulate) {
  grouped_gemm(C, gemm_operand(A, K, Trans::N), gemm_operand(W, tw == Trans::N ? Nout : K, tw), bias, offsets, E, Nout,
               K, accumulate);
}

void grouped_gemm_wgrad(float* dW, float* dbias, const float* dY, const float* X, const int64_t* offsets, int64_t E,
                        int64_t Nout, int64_t K) {
  grouped_gemm_wgrad(dW, gemm_operand(dY, Nout, Trans::T), gemm_operand(X, K, Trans::N), offsets, E, Nout, K);
  if (dbias) grouped_bias_grad(dbias, dY, offsets, E, Nout);
}

namespace {
// One batch item per expert with rows: C[rows of e] = init + A[rows of e] op(W_e), init C
// (accumulate), else bias[e] (when given), else 0; K cut as segments / sections (empty: one chain).
void expert_batch(float* C, const GemmOperand& A, const GemmOperand& W, const float* bias, const int64_t* offsets,
                  int64_t E, int64_t Nout, int64_t K, bool accumulate, std::span<const int64_t> segments = {},
                  std::span<const int64_t> sections = {}) {
  thread_local std::vector<GemmBatchItem> items;
  items.clear();
  const int64_t w_rows = W.trans == Trans::T ? Nout : K;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = offsets[e], rows = offsets[e + 1] - r0;
    if (rows == 0) continue;
    GemmBatchItem it{C + r0 * Nout, Nout, nullptr, 0, Trans::N, nullptr, 0, W.trans, rows, Nout, K};
    it.a_src = gemm_operand_at(A, r0, 0);
    it.a_src.trans = Trans::N;
    it.b_src = gemm_operand_at(W, e * w_rows, 0);
    it.accumulate = accumulate;
    if (!accumulate && bias) it.bias = bias + e * Nout;
    it.k_segments = segments;
    it.k_sections = sections;
    items.push_back(it);
  }
  gemm_batch(items.data(), static_cast<int64_t>(items.size()));
}

}  // namespace

void grouped_gemm(float* C, const GemmOperand& A, const GemmOperand& W, const float* bias, const int64_t* offsets,
                  int64_t E, int64_t Nout, int64_t K, bool accumulate) {
  expert_batch(C, A, W, bias, offsets, E, Nout, K, accumulate);
}

void grouped_gemm_wgrad(float* dW, const GemmOperand& dY, const GemmOperand& X, const int64_t* offsets, int64_t E,
                        int64_t Nout, int64_t K) {
  thread_local std::vector<GemmBatchItem> items;
  items.clear();
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = offsets[e], rows = offsets[e + 1] - r0;
    if (rows == 0) continue;
    GemmBatchItem it{dW + e * Nout * K, K, nullptr, 0, Trans::T, nullptr, 0, Trans::N, Nout, K, rows};
    it.a_src = gemm_operand_at(dY, r0, 0);
    it.a_src.trans = Trans::T;
    it.b_src = gemm_operand_at(X, r0, 0);
    it.b_src.trans = Trans::N;
    it.accumulate = true;
    items.push_back(it);
  }
  gemm_batch(items.data(), static_cast<int64_t>(items.size()));
}

void grouped_bias_grad(float* dbias, const float* dY, const int64_t* offsets, int64_t E, int64_t Nout) {
  // dbias_e[c] += dY[r, c] over the expert's rows in order, every (expert, column block) in one region.
  const int64_t blocks = (Nout + kBiasColBlock - 1) / kBiasColBlock;
  parallel_for(E * blocks, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t e = u / blocks, c0 = (u % blocks) * kBiasColBlock, c1 = std::min(Nout, c0 + kBiasColBlock);
      float* db = dbias + e * Nout;
      for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) {
        const float* g = dY + r * Nout;
        for (int64_t c = c0; c < c1; ++c) db[c] += g[c];
      }
    }
  });
}

void grouped_gemm_segmented(float* C, const GemmOperand& A, const GemmOperand& W, const float* bias,
                            const int64_t* offsets, int64_t E, int64_t Nout, int64_t K, const KSegments& seg) {
  const int64_t S = seg.segments, X = seg.sections;
  LOCKSTEP_CHECK(std::has_single_bit(static_cast<uint64_t>(S)) && X > 0 && K % (S * X) == 0,
                 "grouped_gemm_segmented: K = ", K, " not divisible by ", S, " segments (a power of two) x ", X,
                 " sections");
  // One segmented product per expert (gemm.h k_segments / k_sections), all in one batch: each tile
  // runs its segments' chains and their tree in cache, and C is written once.
  thread_local KSegmentBounds bounds;  // kept across calls
  k_segment_bounds(bounds, seg, K);
  expert_batch(C, A, W, bias, offsets, E, Nout, K, false, bounds.segments, bounds.sections);
}

}  // namespace lockstep
