// Linear layer y = x W^T (+ b), W stored (out, in) as in PyTorch and Megatron. Under tensor
// parallelism (parallel/tensor_parallel.h) a column-parallel layer holds its rank's output rows
// (of each section of a fused projection) and a row-parallel one its rank's input columns; in and
// out are then this rank's sizes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "lockstep/model/param_table.h"
#include "lockstep/parallel/tensor_parallel.h"

namespace lockstep {

struct Linear {
  Linear() = default;
  // Declares "<name>.weight" (out, in) and, when bias, "<name>.bias" (out).
  Linear(ParamStore& ps, const std::string& name, int64_t in, int64_t out, bool bias, float init_std);
  // Column-parallel: the global W (sum of out_sections, in), this rank's slice of each section.
  static Linear column(ParamStore& ps, const TensorParallel& tp, const std::string& name, int64_t in,
                       const std::vector<int64_t>& out_sections, bool bias, float init_std);
  // Row-parallel: the global W (out, in), this rank's in / tp columns; the bias is whole.
  static Linear row(ParamStore& ps, const TensorParallel& tp, const std::string& name, int64_t in, int64_t out,
                    bool bias, float init_std);

  // y (N, out) = x W^T + b.
  void forward(const ParamStore& ps, float* y, const float* x, int64_t N) const;
  // y (N, out) = residual + b + x W^T: the residual add fused into the GEMM (the GEMM's chain
  // starts from residual + b). y may alias residual.
  void forward_residual(const ParamStore& ps, float* y, const float* residual, const float* x, int64_t N) const;
  // Row-parallel forward_residual: y (this rank's rows of the residual stream, out) = residual + b +
  // the sum over the tensor-parallel group of x W^T (partial: (N, out) scratch; y must not alias
  // residual).
  void forward_residual(const ParamStore& ps, const TensorParallel& tp, float* y, const float* residual,
                        const float* x, int64_t N, float* partial) const;
  // dx (N, in) = dy W (assigned); dW += dy^T x; db += column sums of dy.
  void backward(const ParamStore& ps, float* dx, const float* dy, const float* x, int64_t N) const;

  std::string name;  // "layers.0.attn.qkv": parameter prefix and trace name (model/trace.h)
  int w = -1, b = -1;
  int64_t in = 0, out = 0;
};

}  // namespace lockstep
