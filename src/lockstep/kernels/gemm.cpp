// The GEMM operands' and options' host helpers (kernels/gemm.h), the same for every backend.
#include "lockstep/kernels/gemm.h"

#include "lockstep/kernels/quantize.h"

namespace lockstep {

GemmOperand gemm_operand(const QuantizedTensor& q, Trans t, int64_t row0, int64_t col0) {
  return {GemmOperand::Kind::quantized, &q, q.cols, t, row0, col0};
}

GemmOperand gemm_operand_at(const GemmOperand& o, int64_t rows, int64_t cols) {
  GemmOperand v = o;
  switch (o.kind) {
    case GemmOperand::Kind::f32:
      v.data = static_cast<const float*>(o.data) + rows * o.ld + cols;
      break;
    case GemmOperand::Kind::bf16:
      v.data = static_cast<const bf16*>(o.data) + rows * o.ld + cols;
      break;
    case GemmOperand::Kind::quantized:
      v.row0 += rows;
      v.col0 += cols;
      break;
  }
  return v;
}

void k_segment_bounds(KSegmentBounds& b, const KSegments& seg, int64_t K) {
  const int64_t S = seg.segments, X = seg.sections, f = K / (S * X);
  b.sections.assign(static_cast<size_t>(X), K / X);
  b.segments.clear();
  for (int64_t x = 0; x < X; ++x)
    for (int64_t s = 0; s <= S; ++s) b.segments.push_back(s * f);
}

}  // namespace lockstep
