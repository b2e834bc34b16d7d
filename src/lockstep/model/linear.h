// Linear layer y = x W^T (+ b), W stored (out, in) as in PyTorch and Megatron.
#pragma once

#include <cstdint>
#include <string>

#include "lockstep/model/param_table.h"

namespace lockstep {

struct Linear {
  Linear() = default;
  // Declares "<name>.weight" (out, in) and, when bias, "<name>.bias" (out).
  Linear(ParamStore& ps, const std::string& name, int64_t in, int64_t out, bool bias, float init_std);

  // y (N, out) = x W^T + b.
  void forward(const ParamStore& ps, float* y, const float* x, int64_t N) const;
  // y (N, out) = residual + b + x W^T: the residual add fused into the GEMM (the GEMM's chain
  // starts from residual + b). y may alias residual.
  void forward_residual(const ParamStore& ps, float* y, const float* residual, const float* x, int64_t N) const;
  // dx (N, in) = dy W (assigned); dW += dy^T x; db += column sums of dy.
  void backward(const ParamStore& ps, float* dx, const float* dy, const float* x, int64_t N) const;

  std::string name;  // "layers.0.attn.qkv": parameter prefix and trace name (model/trace.h)
  int w = -1, b = -1;
  int64_t in = 0, out = 0;
};

}  // namespace lockstep
