// The MLP sublayer: norm -> fc (C -> F, or C -> 2F as [gate | up] for SwiGLU) -> GELU / SwiGLU ->
// proj (F -> C), added to the residual stream. Tensor parallelism (parallel/tensor_parallel.h): fc
// column-parallel (this rank's F / tp hidden units, of gate and up separately), proj row-parallel;
// with sequence parallelism the norm and the residual stream hold this rank's rows only.
#pragma once

#include <string>
#include <vector>

#include "lockstep/config/config.h"
#include "lockstep/model/arena.h"
#include "lockstep/model/linear.h"
#include "lockstep/model/norm.h"

namespace lockstep {

struct MlpScratch {
  float* dnorm;  // (N, C)
  float* dact;   // (N, F) (at least (N, C) under sequence parallelism: it holds d(norm) of this rank's rows)
  float* dfc;    // (N, F or 2F)
};

struct MlpLayer {
  MlpLayer() = default;
  MlpLayer(ParamStore& ps, Arena& arena, const std::string& prefix, const ModelConfig& m, int64_t N,
           const TensorParallel& tp = TensorParallel{});

  void forward(const ParamStore& ps, const Arena& arena, float* resid_out, const float* resid_in) const;
  void backward(const ParamStore& ps, const Arena& arena, float* dresid, const float* resid_in,
                const MlpScratch& s) const;

  int64_t fc_width() const { return swiglu ? 2 * F : F; }

  Norm norm;
  Linear fc, proj;
  std::string act_name;  // "<prefix>mlp.act", for the trace (core/trace.h)
  // The names forward traces, in order (core/trace.h).
  void trace_names(std::vector<std::string>& out) const {
    out.insert(out.end(), {norm.name, fc.name, act_name, proj.name});
  }
  int64_t N = 0, C = 0, F = 0;  // F: this rank's hidden units
  bool swiglu = false;
  TensorParallel tp;
  ArenaSlice normed, fc_out, act;  // saved for backward
  ArenaSlice gathered, partial;    // tensor parallelism: the gathered norm output, proj's partial sums
};

}  // namespace lockstep
