// The numerics the model computes in (precision.* keys), emulated exactly on CPU: which tensors
// are rounded to bf16 and where, and how the GEMMs of the linear layers read their operands.
//
// BF16 mixed precision (precision.params = "bf16"), as Megatron Core with Transformer Engine:
//   master weights  the ParamStore's fp32 values; AdamW updates them. Every forward and backward
//                   reads their bf16 copy (ParamStore::weight, round-to-nearest-even, refreshed at
//                   the start of each step): weight matrices, biases, norm weights, embeddings, the
//                   router's weight.
//   activations     rounded to bf16 where a module hands a tensor on (and saves it for backward):
//                   the embedding output; every norm's output; every linear layer's output (qkv,
//                   attention proj, fc, mlp proj, shared expert fc/proj, MTP eh_proj, the experts'
//                   grouped fc/proj), with the residual add the proj fuses (so the residual stream
//                   is bf16); q and k after RoPE; the attention output; the GELU / SwiGLU output;
//                   the MoE layer's output (residual + shared expert + combined experts, rounded
//                   once); the logits of the output head.
//   gradients       the activation gradients at the same boundaries are rounded to bf16: d(logits)
//                   after the loss; every linear layer's input gradient; d(qkv) after attention and
//                   RoPE backward; d(fc) after the activation's backward; the residual stream's
//                   gradient after each norm's backward adds into it; the experts' row gradients
//                   (routing weight times d(output)); the MoE norm output's total gradient.
//   stays fp32      the loss and its softmax (on the bf16 logits), the norms' statistics (mean,
//                   rstd) and arithmetic, the attention softmax and its log-sum-exp, the router
//                   (logits, scores, top-k, aux losses, jitter), routing weights, every GEMM's
//                   accumulation (one fp32 FMA chain), and every parameter gradient: weight
//                   gradients accumulate into the fp32 grad buffer (Megatron's gradient
//                   accumulation fusion), as do norm, bias and embedding gradients.
// With precision.params = "fp32" nothing is rounded and the model is bitwise the fp32 one.
//
// Determinism: rounding is elementwise and the GEMMs keep their guarantee (gemm.h), so every mode
// is bitwise independent of the thread count.
#pragma once

#include <cstdint>

#include "lockstep/config/config.h"
#include "lockstep/kernels/cpu/gemm.h"

namespace lockstep {

class ParamStore;

// Rounds x (n) to bf16 values in place (round-to-nearest-even, core/dtype.h); serial (callers
// run it on their own part of a parallel loop).
void round_to_bf16(float* x, int64_t n);

class Precision {
 public:
  Precision() = default;  // fp32
  explicit Precision(const PrecisionConfig& pc);

  bool bf16() const { return bf16_; }
  // An activation (or activation gradient) handed on at a module boundary: rounded to bf16 in
  // place when activations are bf16.
  void round(float* x, int64_t n) const;

  // The three GEMMs of a linear layer whose weight is parameter w (out, in) of ps:
  //   fprop  y (N, out) = init + x W^T   (init per opt: bias, or y itself to accumulate)
  //   dgrad  dx (N, in) = dy W            (assigned)
  //   wgrad  dW (out, in) += dy^T x       (fp32, into the grad buffer)
  // They read the weight's compute copy; fprop's and dgrad's outputs are activations (rounded).
  void fprop(const ParamStore& ps, int w, float* y, const float* x, int64_t N, int64_t out, int64_t in,
             const GemmOptions& opt = {}) const;
  void dgrad(const ParamStore& ps, int w, float* dx, const float* dy, int64_t N, int64_t out, int64_t in) const;
  void wgrad(const ParamStore& ps, int w, const float* dy, const float* x, int64_t N, int64_t out, int64_t in) const;

 private:
  bool bf16_ = false;
};

}  // namespace lockstep
