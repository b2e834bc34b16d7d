// The trainer's optimizer step, reusable on its own (the reference tests drive it directly):
// global grad-norm clipping, then AdamW (kernels/cpu/optimizer.h) on every parameter of the table,
// with weight decay on the parameters the table marks for it (weight matrices, not biases or
// norms). Clipping follows torch.nn.utils.clip_grad_norm_: scale = clip / (norm + 1e-6) when that
// is below 1; the scale enters AdamW as grad_scale, so the gradients themselves stay untouched.
//
// Determinism: the norm is sum_of_squares' fixed-order reduction; the update is elementwise.
#pragma once

#include <cstdint>

#include "lockstep/config/config.h"
#include "lockstep/core/tensor.h"
#include "lockstep/model/param_table.h"

namespace lockstep {

class Optimizer {
 public:
  // State (m, v) sized for ps, zeroed.
  Optimizer(const ParamStore& ps, const OptimizerConfig& oc);

  // Clips by the global norm and applies AdamW to every parameter; step counts from 1. Returns the
  // gradient norm before clipping.
  double step(ParamStore& ps, int64_t step, double lr);

  // xxh3 of the first then second moments.
  uint64_t hash() const;

 private:
  FloatBuffer m_, v_;
  OptimizerConfig oc_;
};

}  // namespace lockstep
