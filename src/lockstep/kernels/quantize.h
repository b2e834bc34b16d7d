// The quantisation ops of the compute seam (kernels/ops.h): FP8 / MXFP8 / NVFP4 quantisers, and the 16x16 random
// Hadamard transform.
//
// Every quantiser turns an fp32 matrix x (rows x cols, row-major, contiguous) into a
// QuantizedTensor: one code per element (core/float_formats.h) plus one scale per block of
// block_rows x block_cols elements. What a quantised element stands for (its dequantised value) is
// defined exactly, in fp32:
//
//     value(r, c) = (decode(elem, code(r, c)) * block_scale(r / block_rows, c / block_cols)) * tensor_scale
//
// with each product rounded to fp32 (for E8M0 scales and for E2M1 x E4M3 the first product is exact;
// tensor_scale is 1 except for NVFP4), and a NaN block scale giving its own NaN (scaled(): the
// product of two NaNs is either one, as the compiler orders the operands; the encoders likewise
// encode a NaN multiplier's block as encode(multiplier)). dequantize() and the GEMM's operand decoding (gemm.h) compute
// exactly this, so a GEMM on quantised operands equals the fp32 GEMM on dequantize()'s output, bit
// for bit.
//
// The recipes (x = the element before encoding; amax_b = max |x| over block b; fmax = max_finite):
//   tensorwise   one f32 scale for the whole tensor, given by the caller (current scaling: from
//                amax(x) now; delayed: from an amax history), TransformerEngine's convention:
//                code = encode(x * scale), block_scale = 1 / scale (TE's scale_inv).
//   blockwise    f32 power-of-two scales per block (1x128 for activations and gradients, 128x128 for
//                weights, DeepSeek-V3 / TE Float8BlockScaling): s_b = 2^floor(log2(fmax / amax_b))
//                (fmax / amax_b divided in fp32, then its mantissa cleared; exponent clamped to
//                [-126, 127]; amax_b = 0 gives 1), code = encode(x * s_b), block_scale = 1 / s_b (exact).
//   mxfp8        E8M0 scale per 1x32 block (OCP MX v1.0): ScaleRounding::down is the spec's
//                X = 2^(floor(log2 amax_b) - emax_elem) (values in [fmax, 2^(emax_elem+1)) * X
//                saturate); ScaleRounding::up is TE's X = 2^ceil(log2(amax_b / fmax)) (fp32
//                division; nothing saturates). code = encode(x / X) (exact scaling), block_scale = X.
//   nvfp4        E2M1 elements, an E4M3 scale per 1x16 block (or 16x16 for weights) and an f32 tensor
//                scale. With S = (6 * 448) / amax(x) (fp32; 1 when amax is 0):
//                scale code s_b = encode_e4m3((amax_b / 6) * S), saturating;
//                code = encode_e2m1(x * (S / decode(s_b))) (0 when decode(s_b) is 0);
//                tensor_scale = amax(x) / (6 * 448) (the "FP32 per-tensor scale"; 1 when amax
//                is 0).
// Non-finite input: in the block recipes a NaN or infinite amax_b makes the block's scale NaN, so
// every value of the block dequantises to NaN (nvfp4: a non-finite amax(x), the whole tensor);
// tensorwise encodes elements on their own (NaN stays NaN, +-inf saturates).
//
// Rounding: nearest-even by default, or stochastic (StochasticRounding, for gradients): element
// (r, c) is rounded with core/float_formats.h encode_stochastic() on the 32 Philox bits
//     RandomStream(seed, sr_purpose(tensor_id, step)).bits(index_base + r * global_cols + c)
// a pure function of (seed, step, tensor id, global element index).
//
// Determinism: every element's code and every block's scale is a pure function of the input (and
// of the SR key); blocks are split among threads whole, and amax is a max (exact in any order).
// Results are bitwise identical for any thread count. The quantisers do not allocate once `out`
// has held a tensor of the same shape and recipe.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "lockstep/core/float_formats.h"
#include "lockstep/kernels/op.h"

namespace lockstep {

enum class ScaleFormat : uint8_t { f32, e8m0, e4m3 };

// A row-major matrix of codes with per-block scales; see the header comment for its value.
struct QuantizedTensor {
  ElemFormat elem = ElemFormat::e4m3;
  ScaleFormat scale_format = ScaleFormat::f32;
  int64_t rows = 0, cols = 0;
  int64_t block_rows = 1, block_cols = 1;  // the scale block (tensorwise: rows x cols)
  // Codes, row by row. FP8: one byte per element, (r, c) at r * cols + c. E2M1: two per byte,
  // (r, c) at byte r * row_bytes() + c / 2, even c in the low nibble; a row's odd tail nibble is 0.
  std::vector<uint8_t> codes;
  // Block scales over the grid (grid_rows() x grid_cols(), row-major): `scales` when scale_format
  // is f32, else `scale_codes` (E8M0 or E4M3 codes); the other vector is empty.
  std::vector<float> scales;
  std::vector<uint8_t> scale_codes;
  float tensor_scale = 1.0f;

  int64_t grid_rows() const { return (rows + block_rows - 1) / block_rows; }
  int64_t grid_cols() const { return (cols + block_cols - 1) / block_cols; }
  int64_t row_bytes() const { return elem == ElemFormat::e2m1 ? (cols + 1) / 2 : cols; }
  uint8_t code(int64_t r, int64_t c) const {
    if (elem != ElemFormat::e2m1) return codes[static_cast<size_t>(r * cols + c)];
    return static_cast<uint8_t>((codes[static_cast<size_t>(r * row_bytes() + c / 2)] >> (4 * (c & 1))) & 0xF);
  }
  // The decoded scale of block (br, bc) (exact: an f32, or a decoded E8M0 / E4M3 code).
  float block_scale(int64_t br, int64_t bc) const;
  // The dequantised value of element (r, c), as defined above.
  float value(int64_t r, int64_t c) const;
  // Bytes of codes and scales: what the tensor costs in memory.
  int64_t storage_bytes() const;
};

// d x s, or s when s is a NaN (whatever d is): the first product of value(), independent of operand
// order.
inline float scaled(float d, float s) { return s != s ? s : d * s; }

// TransformerEngine's FP8 scale from an amax (delayed and current per-tensor scaling):
// (max_finite(f) / amax) / 2^margin, or `previous` when amax is 0 or not finite (TE keeps the last
// scale then). `previous` defaults to 1, the initial scale.
float fp8_scale_from_amax(float amax, ElemFormat f, int margin = 0, float previous = 1.0f);

// Off by default; see the header comment for what each field keys.
struct StochasticRounding {
  bool enabled = false;
  uint64_t seed = 0;
  uint64_t step = 0;
  uint64_t tensor_id = 0;   // which tensor (e.g. purpose_id of its name, or layer * 16 + slot)
  int64_t index_base = 0;   // global index of element (0, 0): a shard's offset in the full tensor
  int64_t global_cols = 0;  // row length of the full tensor (0: cols, i.e. not sharded by columns)
};
// The Philox purpose of (tensor_id, step): RandomStream(sr.seed, sr_purpose(...)) draws the bits.
uint64_t sr_purpose(uint64_t tensor_id, uint64_t step);

// ---- Random Hadamard transform (NVFP4's weight-gradient recipe)
//
// Q = H16 * diag(s) / 4, with H16 the 16x16 Sylvester Hadamard matrix (H[i][k] = (-1)^popcount(i&k))
// and s the fixed sign vector hadamard16_signs() (drawn once from Philox, seed 0, purpose
// "hadamard16/signs"). Q is orthogonal (Q Q^T = I exactly: entries are +-1/4). Applied to both
// inputs of the weight-gradient GEMM along its K dimension (tokens), it cancels:
// (Q dY)^T (Q X) = dY^T Q^T Q X = dY^T X, while spreading outliers across 16 tokens before FP4.
// The transform of one 16-vector, in its fixed operation order, is hadamard16_apply
// (kernels/hadamard.h, host and device); every backend's hadamard16 op runs it.

const std::array<float, 16>& hadamard16_signs();
enum class HadamardAxis : uint8_t {
  rows,  // mixes each group of 16 consecutive rows, column by column: out = blockdiag(Q) x
  cols,  // mixes each group of 16 consecutive columns, row by row:   out = x blockdiag(Q)^T
};
// The ops, as a backend binds them (kernels/ops.h).
struct QuantizeOps {
  // code = encode(x * scale) for all elements, f (E4M3 / E5M2), one f32 block scale 1 / scale.
  // scale must be positive and finite.
  Op<void(QuantizedTensor& out, const float* x, int64_t rows, int64_t cols, ElemFormat f, float scale,
          const StochasticRounding& sr)>
      quantize_tensorwise{"quantize_tensorwise"};
  // Power-of-two f32 scale per block_rows x block_cols block (1x128, 128x1 or 128x128; edge blocks
  // may be partial).
  Op<void(QuantizedTensor& out, const float* x, int64_t rows, int64_t cols, ElemFormat f, int64_t block_rows,
          int64_t block_cols, const StochasticRounding& sr)>
      quantize_blockwise{"quantize_blockwise"};
  // E8M0 scale per 1 x block_cols block (32 in the OCP MX spec), elements f (E4M3 / E5M2; E2M1 gives
  // MXFP4).
  Op<void(QuantizedTensor& out, const float* x, int64_t rows, int64_t cols, ElemFormat f, ScaleRounding rounding,
          int64_t block_cols, const StochasticRounding& sr)>
      quantize_mxfp8{"quantize_mxfp8"};
  // NVFP4: E2M1 codes, E4M3 scale per block_rows x 16 block (block_rows 1, or 16 for 2-D weight
  // blocks), f32 tensor scale. tensor_amax: amax(x) of the whole tensor when x is a piece of it (a
  // tensor-parallel shard, or a piece quantised on its own: the tensor scale and S are the whole
  // tensor's); null: amax(x).
  Op<void(QuantizedTensor& out, const float* x, int64_t rows, int64_t cols, int64_t block_rows,
          const StochasticRounding& sr, const float* tensor_amax)>
      quantize_nvfp4{"quantize_nvfp4"};
  // out (rows x cols) = the dequantised values of q. Parallel over rows; bitwise any thread count.
  // Row r of q into out + r * ld.
  Op<void(float* out, int64_t ld, const QuantizedTensor& q)> dequantize{"dequantize"};
  // max |x[i]| over n values; NaN when any is NaN. Parallel; the same bits for any thread count.
  Op<float(const float* x, int64_t n)> amax{"amax"};
  // out (rows x cols) = the transform of x along `axis`, whose length must be a multiple of 16. out
  // may be x. Computed by the fast Walsh-Hadamard butterflies in a fixed order: bitwise any threads.
  Op<void(float* out, const float* x, int64_t rows, int64_t cols, HadamardAxis axis)> hadamard16{"hadamard16"};

  template <class F>
  void each(F&& f) {
    f(quantize_tensorwise), f(quantize_blockwise), f(quantize_mxfp8), f(quantize_nvfp4), f(dequantize), f(amax),
        f(hadamard16);
  }
};

}  // namespace lockstep
