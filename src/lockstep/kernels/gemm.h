// The GEMM ops of the compute seam (kernels/ops.h): C(M, N) = init + op(A)(M, K) * op(B)(K, N).
//
// Layouts are row-major. op(A) = A (M x K, leading dimension lda) for Trans::N, or the transpose of
// A stored K x M for Trans::T; likewise op(B) = B (K x N) or the transpose of B stored N x K. A
// linear layer y = x W^T with W stored (out, in) is gemm(y, x, N, W, T); its input gradient is
// gemm(dx, dy, N, W, N) and its weight gradient gemm(dW, dy, T, x, N, accumulate).
//
// Determinism guarantee (what every caller may rely on, and tests check bitwise):
//   Each output element is one sequential chain of fused multiply-adds over k = 0, 1, ..., K-1:
//       acc = init;  for k in 0..K-1: acc = fma(op(A)[i][k], op(B)[k][j], acc);  C[i][j] = acc
//   with init = C[i][j] (accumulate), else bias[j] (bias given), else 0. So:
//   - the result is bitwise independent of the thread count, of how M and N are partitioned into
//     tiles, of the cache blocking, and of the instruction set (the AVX-512, AVX2 and portable
//     micro-kernels give the same bits);
//   - accumulating two calls over K-ranges [0, K1) then [K1, K) equals one call over [0, K): a
//     gradient summed over micro-batches is the same as over their concatenation.
//   With k_segments = {s0 = 0, s1, ..., sS = K} (caller-given boundaries), each segment is its own
//   chain P_s started from 0, the S chains are summed along the canonical tree (core/tree_sum.h),
//   and C = init + tree(P_0 .. P_{S-1}) (C = the tree itself without an init, so a -0 stays -0):
//   how determinism = "layout" combines a reduction that tensor parallelism splits along K
//   (row-parallel layers), so that ranks holding blocks of consecutive segments reproduce it with a
//   tree_sum over the group.
//   With k_sections = {w_0, ..., w_{J-1}} as well (summing to K), K is the concatenation of J
//   sections, each cut into the same S segments: k_segments then holds J x (S + 1) boundaries,
//   section j's at [j (S + 1), (j + 1) (S + 1)), each list running from 0 to w_j. Segment s's
//   chain runs over section 0's part [b_0s, b_0(s+1)), then section 1's, ... (one chain, from
//   0), and the chains are summed as above: the input gradient of a fused column-parallel
//   projection ([Q | K | V], [gate | up]), whose ranks hold a slice of every section.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "lockstep/core/dtype.h"
#include "lockstep/kernels/op.h"

namespace lockstep {

enum class Trans : uint8_t { N, T };

struct GemmOptions {
  bool accumulate = false;              // init = C (else bias or 0)
  const float* bias = nullptr;          // (N), init when not accumulating
  std::span<const int64_t> k_segments;  // empty: one chain over all of K
  std::span<const int64_t> k_sections;  // with k_segments: the widths of K's sections (empty: one)
};

// ---- Operands in low precision
//
// One operand of a GEMM as it is stored: fp32, bf16, or a QuantizedTensor (FP8 / MXFP8 / NVFP4
// codes with their scales, kernels/quantize.h). op(X) reads the stored matrix as is (Trans::N)
// or its transpose (Trans::T), with the same meaning as gemm()'s A and B. Low-precision operands
// are decoded to fp32 while the GEMM packs its panels (no extra pass over memory, and the memory
// read is the codes', not fp32's); the arithmetic is the fp32 GEMM's.
//
// Determinism guarantee: gemm() on operands equals, bit for bit, gemm() on the fp32 matrices that
// the operands stand for: a bf16 value widened exactly, a quantised one dequantised exactly as
// dequantize() does (value = (decode(code) * block_scale) * tensor_scale in fp32). So the FMA-chain
// guarantee above holds unchanged (threads, tiling, micro-kernel, split-K, k_segments).
struct QuantizedTensor;

struct GemmOperand {
  enum class Kind : uint8_t { f32, bf16, quantized };
  Kind kind = Kind::f32;
  const void* data = nullptr;  // const float*, const bf16*, or const QuantizedTensor*
  int64_t ld = 0;              // row length of the storage (a QuantizedTensor: its cols)
  Trans trans = Trans::N;
  int64_t row0 = 0, col0 = 0;  // a QuantizedTensor operand: the view's origin in the stored matrix
};
inline GemmOperand gemm_operand(const float* x, int64_t ld, Trans t) { return {GemmOperand::Kind::f32, x, ld, t}; }
inline GemmOperand gemm_operand(const bf16* x, int64_t ld, Trans t) { return {GemmOperand::Kind::bf16, x, ld, t}; }
// The view of q that starts at stored element (row0, col0) (a slice along K or along M / N).
GemmOperand gemm_operand(const QuantizedTensor& q, Trans t, int64_t row0 = 0, int64_t col0 = 0);
// o's view moved by (rows, cols) in its storage (e.g. one expert's rows of a stacked operand).
GemmOperand gemm_operand_at(const GemmOperand& o, int64_t rows, int64_t cols);

// One product of a batch: C = init + op(A) op(B), sizes and layouts as gemm()'s; init = C
// (accumulate), else bias (when given), else 0.
struct GemmBatchItem {
  float* C;
  int64_t ldc;
  const float* A;
  int64_t lda;
  Trans ta;
  const float* B;
  int64_t ldb;
  Trans tb;
  int64_t M, N, K;
  bool accumulate = false;
  const float* bias = nullptr;
  // Operands in any storage (gemm_operand): when a_src (b_src) is set (data not null) it replaces
  // A, lda, ta (B, ldb, tb), and the guarantee of the GemmOperand overload of gemm() holds.
  GemmOperand a_src{}, b_src{};
  // As GemmOptions' (the caller's memory, read during the call): C = init + the canonical tree
  // over the segments' chains. The segmented products of a batch share its parallel region too.
  std::span<const int64_t> k_segments{}, k_sections{};
};

// ---- Grouped GEMM over the experts of an MoE layer: one call runs every local expert's matrix
// product on its own contiguous block of rows.
//
// Rows of the expert input are grouped by expert: expert e owns rows [offsets[e], offsets[e+1]).
//   grouped_gemm:        C[rows of e] (init) + A[rows of e] op(W_e)   (forward, input gradient)
//   grouped_gemm_wgrad:  dW_e (+)= dY[rows of e]^T X[rows of e]       (weight gradient)
// W is (E, Nout, K) for op = T (a linear layer's weight) or (E, K, Nout) for op = N.
//
// All experts' products run in one parallel region (gemm_batch): their rectangles are
// shared among the threads, instead of one region (and one wait for the slowest thread) per expert.
//
// Determinism guarantee: each expert's product is bitwise what one gemm call on its rows
// gives (each output element is one sequential FMA chain over K, independent of threads and
// tiling), and every output row (grouped_gemm) or weight matrix (wgrad) belongs to exactly one
// expert, so no element is written twice and no reduction crosses experts. The bias gradient sums
// an expert's rows in row order, one thread per (expert, column block). An expert with no rows
// writes nothing (grouped_gemm) or leaves dW_e unchanged (wgrad).

// determinism = "layout" (docs/design/reductions.md#expert-k-segments): the products whose K (an expert's hidden units)
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
// seg's cut of K as gemm options: k_segments (sections x (segments + 1) boundaries), k_sections.
struct KSegmentBounds {
  std::vector<int64_t> segments, sections;
  void apply(GemmOptions& opt) const {
    opt.k_segments = segments;
    opt.k_sections = sections;
  }
};
// Into `bounds` (its vectors reused), or as a value.
void k_segment_bounds(KSegmentBounds& bounds, const KSegments& seg, int64_t K);
inline KSegmentBounds k_segment_bounds(const KSegments& seg, int64_t K) {
  KSegmentBounds b;
  k_segment_bounds(b, seg, K);
  return b;
}

// The ops, as a backend binds them (kernels/ops.h).
struct GemmOps {
  // C(M, N) = init + op(A)(M, K) * op(B)(K, N), A and B in any storage; options above.
  Op<void(float* C, int64_t ldc, const GemmOperand& A, const GemmOperand& B, int64_t M, int64_t N, int64_t K,
          const GemmOptions& opt)>
      gemm{"gemm"};
  // Every item of the batch in one parallel region: each item is cut into rectangles of C and all
  // the rectangles of all items are shared among the threads (largest first). Bitwise the same as
  // calling gemm() on each item (the guarantee above holds per item, k_segments included); items
  // must not overlap in C.
  // For many small products (an MoE layer's experts), this replaces one region per product.
  Op<void(const GemmBatchItem* items, int64_t count)> gemm_batch{"gemm_batch"};
  // C (R, Nout) with R = offsets[E], A the (R, K) input; W every expert stacked, (E * Nout, K) for
  // W.trans = T or (E * K, Nout) for N (expert e reads its rows through a view). accumulate: C
  // starts from its own values; else from bias[e] (bias (E, Nout) or null) or 0.
  Op<void(float* C, const GemmOperand& A, const GemmOperand& W, const float* bias, const int64_t* offsets, int64_t E,
          int64_t Nout, int64_t K, bool accumulate)>
      grouped_gemm{"grouped_gemm"};
  // dW_e (Nout, K) += dY_e^T X_e for every expert: dY (R, Nout) read transposed, X (R, K) as is
  // (their trans is ignored), dW (E, Nout, K).
  Op<void(float* dW, const GemmOperand& dY, const GemmOperand& X, const int64_t* offsets, int64_t E, int64_t Nout,
          int64_t K)>
      grouped_gemm_wgrad{"grouped_gemm_wgrad"};
  // dbias_e (Nout) += column sums of dY_e (rows in order), dY (R, Nout).
  Op<void(float* dbias, const float* dY, const int64_t* offsets, int64_t E, int64_t Nout)> grouped_bias_grad{
      "grouped_bias_grad"};
  // As grouped_gemm (not accumulating); segments a power of two, K divisible by segments x sections.
  // Bitwise one gemm() per expert with the options of k_segment_bounds (k_segments and k_sections), in one parallel
  // region for all experts.
  Op<void(float* C, const GemmOperand& A, const GemmOperand& W, const float* bias, const int64_t* offsets, int64_t E,
          int64_t Nout, int64_t K, const KSegments& seg)>
      grouped_gemm_segmented{"grouped_gemm_segmented"};

  template <class F>
  void each(F&& f) {
    f(gemm), f(gemm_batch), f(grouped_gemm), f(grouped_gemm_wgrad), f(grouped_bias_grad), f(grouped_gemm_segmented);
  }
};

}  // namespace lockstep
