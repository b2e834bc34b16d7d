// The CPU quantisers, dequantiser and Hadamard transform (kernels/quantize.h states the contract).
#pragma once

#include <cstdint>

#include "lockstep/kernels/quantize.h"

namespace lockstep {

void dequantize(float* out, int64_t ld, const QuantizedTensor& q);
inline void dequantize(float* out, const QuantizedTensor& q) { dequantize(out, q.cols, q); }
// out[0, len) = the dequantised values of row r, columns [c, c + len), of q (vector lanes where
// there are 8 alike; the same bits as value()). Serial: what dequantize() and the GEMM's operand
// decoding run row by row.
void dequantize_row(const QuantizedTensor& q, int64_t r, int64_t c, int64_t len, float* out);

float amax(const float* x, int64_t n);
void quantize_tensorwise(QuantizedTensor& out, const float* x, int64_t rows, int64_t cols, ElemFormat f, float scale,
                         const StochasticRounding& sr = {});
void quantize_blockwise(QuantizedTensor& out, const float* x, int64_t rows, int64_t cols, ElemFormat f,
                        int64_t block_rows, int64_t block_cols, const StochasticRounding& sr = {});
void quantize_mxfp8(QuantizedTensor& out, const float* x, int64_t rows, int64_t cols, ElemFormat f,
                    ScaleRounding rounding = ScaleRounding::up, int64_t block_cols = 32,
                    const StochasticRounding& sr = {});
void quantize_nvfp4(QuantizedTensor& out, const float* x, int64_t rows, int64_t cols, int64_t block_rows = 1,
                    const StochasticRounding& sr = {}, const float* tensor_amax = nullptr);

void hadamard16(float* out, const float* x, int64_t rows, int64_t cols, HadamardAxis axis);

}  // namespace lockstep
