// The CPU grouped GEMM over an MoE layer's experts (kernels/gemm.h states the contract): every
// expert's product in one parallel region through gemm_batch.
#pragma once

#include <cstdint>
#include <vector>

#include "lockstep/kernels/cpu/gemm.h"

namespace lockstep {

// C (R, Nout) with R = offsets[E]; A (R, K); W_e = W + e * Nout * K; bias (E, Nout) or null.
// accumulate: C starts from its own values; else from bias[e] (or 0).
void grouped_gemm(float* C, const float* A, const float* W, Trans tw, const float* bias, const int64_t* offsets,
                  int64_t E, int64_t Nout, int64_t K, bool accumulate);

// dW_e (Nout, K) += dY_e^T X_e for every expert: dY (R, Nout), X (R, K), dW (E, Nout, K).
// dbias_e (Nout) += column sums of dY_e when dbias is not null (rows in order).
void grouped_gemm_wgrad(float* dW, float* dbias, const float* dY, const float* X, const int64_t* offsets, int64_t E,
                        int64_t Nout, int64_t K);

// The same products with operands in any storage (gemm.h GemmOperand: fp32, bf16 or quantised,
// decoded while packing). A is the (R, K) input; W holds every expert stacked, (E * Nout, K) for
// W.trans = T or (E * K, Nout) for N, e.g. one QuantizedTensor of all experts' weights (expert e
// reads its rows through a view; with 16x16 or 128x128 blocks, keep Nout (K) a multiple of the
// block so that no block spans two experts). dY (R, Nout) and X (R, K) likewise (their trans is
// ignored: dY is read transposed, X as is). Bitwise what the fp32 functions above give on the
// dequantised operands. The bias gradient is left to grouped_bias_grad (it sums the fp32 dY).
void grouped_gemm(float* C, const GemmOperand& A, const GemmOperand& W, const float* bias, const int64_t* offsets,
                  int64_t E, int64_t Nout, int64_t K, bool accumulate);
void grouped_gemm_wgrad(float* dW, const GemmOperand& dY, const GemmOperand& X, const int64_t* offsets, int64_t E,
                        int64_t Nout, int64_t K);

// dbias_e (Nout) += column sums of dY_e (rows in order), dY (R, Nout); what grouped_gemm_wgrad
// does with a non-null dbias.
void grouped_bias_grad(float* dbias, const float* dY, const int64_t* offsets, int64_t E, int64_t Nout);

// As grouped_gemm (not accumulating); segments a power of two, K divisible by segments x sections.
// Bitwise one gemm() per expert with the options of k_segment_bounds (gemm.h's k_segments and
// k_sections), in one parallel region for all experts.
void grouped_gemm_segmented(float* C, const GemmOperand& A, const GemmOperand& W, const float* bias,
                            const int64_t* offsets, int64_t E, int64_t Nout, int64_t K, const KSegments& seg);

}  // namespace lockstep
