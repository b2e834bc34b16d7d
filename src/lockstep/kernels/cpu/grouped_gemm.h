// Grouped GEMM over the experts of an MoE layer: one call runs every local expert's matrix
// product on its own contiguous block of rows.
//
// Rows of the expert input are grouped by expert: expert e owns rows [offsets[e], offsets[e+1]).
//   grouped_gemm:        C[rows of e] (init) + A[rows of e] op(W_e)   (forward, input gradient)
//   grouped_gemm_wgrad:  dW_e (+)= dY[rows of e]^T X[rows of e]       (weight gradient)
// W is (E, Nout, K) for op = T (a linear layer's weight) or (E, K, Nout) for op = N.
//
// All experts' products run in one parallel region (gemm_batch, gemm.h): their rectangles are
// shared among the threads, instead of one region (and one wait for the slowest thread) per expert.
//
// Determinism guarantee: each expert's product is bitwise what one lockstep::gemm call on its rows
// gives (gemm.h: each output element is one sequential FMA chain over K, independent of threads and
// tiling), and every output row (grouped_gemm) or weight matrix (wgrad) belongs to exactly one
// expert, so no element is written twice and no reduction crosses experts. The bias gradient sums
// an expert's rows in row order, one thread per (expert, column block). An expert with no rows
// writes nothing (grouped_gemm) or leaves dW_e unchanged (wgrad).
#pragma once

#include <cstdint>
#include <vector>

#include "lockstep/kernels/cpu/gemm.h"

namespace lockstep {

// C (R, Nout) with R = offsets[E]; A (R, K); W_e = W + e * Nout * K; bias (E, Nout) or null.
// accumulate: C starts from its own values; else from bias[e] (or 0).
void grouped_gemm(float* C, const float* A, const float* W, Trans tw, const float* bias,
                  const int64_t* offsets, int64_t E, int64_t Nout, int64_t K, bool accumulate);

// dW_e (Nout, K) += dY_e^T X_e for every expert: dY (R, Nout), X (R, K), dW (E, Nout, K).
// dbias_e (Nout) += column sums of dY_e when dbias is not null (rows in order).
void grouped_gemm_wgrad(float* dW, float* dbias, const float* dY, const float* X,
                        const int64_t* offsets, int64_t E, int64_t Nout, int64_t K);

// The same products with operands in any storage (gemm.h GemmOperand: fp32, bf16 or quantised,
// decoded while packing). A is the (R, K) input; W holds every expert stacked, (E * Nout, K) for
// W.trans = T or (E * K, Nout) for N, e.g. one QuantizedTensor of all experts' weights (expert e
// reads its rows through a view; with 16x16 or 128x128 blocks, keep Nout (K) a multiple of the
// block so that no block spans two experts). dY (R, Nout) and X (R, K) likewise (their trans is
// ignored: dY is read transposed, X as is). Bitwise what the fp32 functions above give on the
// dequantised operands. The bias gradient is left to grouped_bias_grad (it sums the fp32 dY).
void grouped_gemm(float* C, const GemmOperand& A, const GemmOperand& W, const float* bias,
                  const int64_t* offsets, int64_t E, int64_t Nout, int64_t K, bool accumulate);
void grouped_gemm_wgrad(float* dW, const GemmOperand& dY, const GemmOperand& X,
                        const int64_t* offsets, int64_t E, int64_t Nout, int64_t K);

// dbias_e (Nout) += column sums of dY_e (rows in order), dY (R, Nout); what grouped_gemm_wgrad
// does with a non-null dbias.
void grouped_bias_grad(float* dbias, const float* dY, const int64_t* offsets, int64_t E, int64_t Nout);

// determinism = "layout" (docs/determinism.md): the products whose K (an expert's hidden units)
// expert tensor parallelism splits, cut into canonical segments. K is `sections` equal sections
// (SwiGLU's [gate | up]: 2, else 1), each cut into `segments` equal slices; segment s is slice s of
// every section, one FMA chain from zero over them in section order (an accumulating product
// continues a chain, gemm.h). Per expert, each output element is
//     C = tree over s of the segments' chains (core/tree_sum.h), then bias[e] + C when bias is given
// So a rank holding a block of consecutive segments (a subtree: segments and the block powers of
// two) computes its block's tree with no bias, the group sums the blocks with ReduceOp::tree_sum and
// adds the bias after: bitwise the single-process result, whatever the number of ranks.
struct KSegments {
  int64_t segments = 0;  // 0: off
  int64_t sections = 1;
  bool on() const { return segments > 0; }
};
// As grouped_gemm (not accumulating); segments a power of two, K divisible by segments x sections.
// Bitwise one gemm() per expert with the options of k_segment_bounds (gemm.h's k_segments and
// k_sections), in one parallel region for all experts.
void grouped_gemm_segmented(float* C, const GemmOperand& A, const GemmOperand& W, const float* bias,
                            const int64_t* offsets, int64_t E, int64_t Nout, int64_t K, const KSegments& seg);
// seg's cut of K as gemm options: k_segments (sections x (segments + 1) boundaries), k_sections.
struct KSegmentBounds {
  std::vector<int64_t> segments, sections;
  void apply(GemmOptions& opt) const {
    opt.k_segments = segments;
    opt.k_sections = sections;
  }
};
KSegmentBounds k_segment_bounds(const KSegments& seg, int64_t K);

}  // namespace lockstep
