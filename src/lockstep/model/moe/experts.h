// The routed experts of one MoE layer: E MLPs (fc: C -> F, or C -> 2F as [gate | up] for SwiGLU;
// GELU / SwiGLU; proj: F -> C), run as one grouped GEMM per projection over the dispatcher's rows
// (kernels/cpu/grouped_gemm.h). The routing weight is not applied here: the combine multiplies each
// expert output by it (Megatron's unpermute; Megatron's grouped MLP folds it into the activation,
// which for a linear proj is the same function).
//
// Parameters: <prefix>fc.weight (E, Fw, C), fc.bias (E, Fw), proj.weight (E, C, F), proj.bias (E, C);
// biases only with model.bias.
#pragma once

#include <string>

#include "lockstep/config/config.h"
#include "lockstep/model/arena.h"
#include "lockstep/model/param_table.h"

namespace lockstep {

struct ExpertsScratch {
  float* dact;  // (R, F)
  float* dfc;   // (R, Fw)
};

struct GroupedExperts {
  GroupedExperts() = default;
  // max_rows: the most dispatched rows a micro-batch can have.
  GroupedExperts(ParamStore& ps, Arena& arena, const std::string& prefix, const ModelConfig& m, int64_t E,
                 int64_t F, int64_t max_rows);

  // out (R, C) = expert_e(x) on the rows of each expert e.
  void forward(const ParamStore& ps, const Arena& arena, float* out, const float* x, const int64_t* offsets) const;
  // dx (R, C) assigned; parameter gradients accumulate.
  void backward(const ParamStore& ps, const Arena& arena, float* dx, const float* dout, const float* x,
                const int64_t* offsets, const ExpertsScratch& s) const;

  int64_t fc_width() const { return swiglu ? 2 * F : F; }

  int fc_w = -1, fc_b = -1, proj_w = -1, proj_b = -1;
  int64_t E = 0, C = 0, F = 0;
  bool swiglu = false;
  ArenaSlice fc_out, act;  // (R, Fw), (R, F), saved for backward
};

}  // namespace lockstep
