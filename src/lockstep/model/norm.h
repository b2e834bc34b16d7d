// The norm layer of the model: LayerNorm (weight, bias) or RMSNorm (weight), over the channels.
#pragma once

#include <string>

#include "lockstep/model/arena.h"
#include "lockstep/tensor/param_table.h"

namespace lockstep {

struct Norm {
  Norm() = default;
  // Declares "<name>.weight" (and "<name>.bias" for LayerNorm); reserves the saved statistics.
  Norm(ParamStore& ps, Arena& arena, const std::string& name, bool rms, int64_t C, int64_t N, float eps);

  // Sequence parallelism: this rank normalises its rows only, so its parameter gradients are
  // partial sums (GradRole::sequence_parallel).
  void set_sequence_parallel(ParamStore& ps) const;

  void forward(const ParamStore& ps, const Arena& arena, float* out, const float* inp, int64_t N) const;
  // dinp += d(norm)/d(inp) applied to dout; parameter gradients accumulate, under determinism =
  // "layout" in token segments (the weight and bias are GradRole::token_sum: norms.h,
  // ParamStore::token_segments).
  void backward(const ParamStore& ps, const Arena& arena, float* dinp, const float* dout, const float* inp,
                int64_t N) const;

  std::string name;  // parameter prefix and trace name (core/trace.h)
  bool rms = false;
  int w = -1, b = -1;
  int64_t C = 0;
  float eps = 1e-5f;
  ArenaSlice mean, rstd;  // (N) each; mean unused for RMSNorm
};

}  // namespace lockstep
