// Linear layer y = x W^T (+ b), W stored (out, in) as in PyTorch and Megatron. Under tensor
// parallelism (parallel/tensor_parallel.h) a column-parallel layer holds its rank's output rows
// (of each section of a fused projection) and a row-parallel one its rank's input columns; in and
// out are then this rank's sizes.
//
// determinism = "layout" (tp.layout(), also on one process): the layer's tensor-parallel reduction
// is cut into the canonical segments (TensorParallel::k_segments): a row-parallel layer's forward
// over its inputs, a column-parallel layer's input gradient over its outputs, each section
// (Q, K, V; gate, up) cut alike, segment s running over slice s of every section in turn. Each
// rank sums its segments along the canonical tree, the group with a tree_sum, and the residual and
// bias are added to the sum (never into a GEMM chain), so the bits do not depend on tp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "lockstep/parallel/tensor_parallel.h"
#include "lockstep/tensor/param_table.h"

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
  // starts from residual + b; under "layout", (residual + b) + the tree of the segments' chains).
  // y may alias residual.
  void forward_residual(const ParamStore& ps, float* y, const float* residual, const float* x, int64_t N) const;
  // Row-parallel forward_residual: y (this rank's rows of the residual stream, out) = residual + b +
  // the sum over the tensor-parallel group of x W^T (partial: (N, out) scratch; y must not alias
  // residual).
  void forward_residual(const ParamStore& ps, const TensorParallel& tp, float* y, const float* residual, const float* x,
                        int64_t N, float* partial) const;
  // dx (N, in) = dy W (assigned); dW += dy^T x; db += column sums of dy (in token segments when the
  // bias is a token sum under determinism = "layout": ParamStore::token_segments).
  void backward(const ParamStore& ps, float* dx, const float* dy, const float* x, int64_t N) const;
  // Column-parallel backward: the above into dfull (N, in), this rank's partial input gradient,
  // then summed over the group (enter_column_parallel_backward, drows: (rows(N), in) under sequence
  // parallelism); returns this rank's rows of the sum.
  float* backward(const ParamStore& ps, const TensorParallel& tp, float* drows, float* dfull, const float* dy,
                  const float* x, int64_t N) const;

  std::string name;  // "layers.0.attn.qkv": parameter prefix and trace name (core/trace.h)
  int w = -1, b = -1;
  int64_t in = 0, out = 0;
  // determinism = "layout": the boundaries of this rank's canonical segments of the reduction that
  // tensor parallelism splits (GemmOptions::k_segments): fprop's K of a row-parallel layer, dgrad's
  // of a column-parallel one, with the widths of its output sections (k_sections); else empty.
  std::vector<int64_t> fprop_segments, dgrad_segments, dgrad_sections;
  bool split = false;  // tensor parallelism splits the layer (under "layout" its sum is rounded, not each part)
};

}  // namespace lockstep
