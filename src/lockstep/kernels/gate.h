// The shared expert's sigmoid gate of the compute seam (kernels/ops.h; moe.shared_expert_gate, as in
// Qwen2-MoE): per token a scalar g_t = sigmoid(<x_t, w>), the shared expert's output scaled by it.
// Each token is computed by one thread: <x_t, w> is one FMA chain over C in order, the sigmoid
// 1 / (1 + exp(-dot)) with glibc's expf, bit for bit (core/libm.h); the weight gradient sums the tokens in token order
// (or, with token segments, per segment from zero along the canonical tree, core/tree_sum.h). So every thread count
// gives the same bits.
#pragma once

#include <cstdint>

#include "lockstep/kernels/op.h"

namespace lockstep {

struct GateOps {
  // g (N) = sigmoid(<x_t, w>) (w null: 1) and out (N, C) = base + g_t y_t (w null: base + y).
  Op<void(float* out, float* g, const float* base, const float* x, const float* w, const float* y, int64_t N,
          int64_t C)>
      gate_forward{"gate_forward"};
  // dy (N, C) = g_t dout_t and dlogit (N) = <dout_t, y_t> g_t (1 - g_t) (gated), or dy = dout.
  Op<void(float* dy, float* dlogit, const float* dout, const float* y, const float* g, bool gated, int64_t N,
          int64_t C)>
      gate_backward{"gate_backward"};
  // dw (C) += sum over tokens t of dlogit_t x_t: in token order (segments 0), or per canonical token
  // segment from zero, the segments along the canonical tree, then added.
  Op<void(float* dw, const float* dlogit, const float* x, int64_t N, int64_t C, int64_t segments)> gate_weight_grad{
      "gate_weight_grad"};
  // dx (N, C) += dx_expert + dlogit_t w (w null: + 0).
  Op<void(float* dx, const float* dx_expert, const float* dlogit, const float* w, int64_t N, int64_t C)>
      gate_input_grad{"gate_input_grad"};

  template <class F>
  void each(F&& f) {
    f(gate_forward), f(gate_backward), f(gate_weight_grad), f(gate_input_grad);
  }
};

}  // namespace lockstep
