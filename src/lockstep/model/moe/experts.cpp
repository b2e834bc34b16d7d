#include "lockstep/model/moe/experts.h"

#include <cmath>

#include "lockstep/kernels/cpu/activations.h"
#include "lockstep/model/precision.h"

namespace lockstep {

GroupedExperts::GroupedExperts(ParamStore& ps, Arena& arena, const std::string& prefix, const ModelConfig& m,
                               int64_t E_, int64_t F_, int64_t max_rows)
    : E(E_), C(m.hidden_size), F(F_), swiglu(m.activation == "swiglu") {
  const float std = static_cast<float>(m.init_std);
  const float out_std = static_cast<float>(m.init_std / std::sqrt(2.0 * static_cast<double>(m.num_layers)));
  fc_w = ps.add(prefix + "fc.weight", {E, fc_width(), C}, Init::normal, std, true, /*expert=*/true);
  if (m.bias) fc_b = ps.add(prefix + "fc.bias", {E, fc_width()}, Init::zeros, 0.0f, false, /*expert=*/true);
  proj_w = ps.add(prefix + "proj.weight", {E, C, F}, Init::normal, out_std, true, /*expert=*/true);
  if (m.bias) proj_b = ps.add(prefix + "proj.bias", {E, C}, Init::zeros, 0.0f, false, /*expert=*/true);
  fc_out = arena.reserve(max_rows * fc_width());
  act = arena.reserve(max_rows * F);
}

void GroupedExperts::forward(const ParamStore& ps, const Arena& arena, float* out, const float* x,
                             const int64_t* offsets) const {
  Precision& p = ps.precision();
  const int64_t R = offsets[E];
  p.grouped_fprop(ps, fc_w, fc_b, arena(fc_out), x, offsets, E, fc_width(), C);
  if (swiglu) swiglu_forward(arena(act), arena(fc_out), R, F);
  else gelu_forward(arena(act), arena(fc_out), R * F);
  p.round(arena(act), R * F);
  p.grouped_fprop(ps, proj_w, proj_b, out, arena(act), offsets, E, C, F);
}

void GroupedExperts::backward(const ParamStore& ps, const Arena& arena, float* dx, const float* dout,
                              const float* x, const int64_t* offsets, const ExpertsScratch& s) const {
  Precision& p = ps.precision();
  const int64_t R = offsets[E];
  p.grouped_dgrad(ps, proj_w, s.dact, dout, offsets, E, C, F);
  p.grouped_wgrad(ps, proj_w, proj_b, dout, arena(act), offsets, E, C, F);
  if (swiglu) swiglu_backward(s.dfc, arena(fc_out), s.dact, R, F);
  else gelu_backward(s.dfc, arena(fc_out), s.dact, R * F);
  p.round(s.dfc, R * fc_width());
  p.grouped_dgrad(ps, fc_w, dx, s.dfc, offsets, E, fc_width(), C);
  p.grouped_wgrad(ps, fc_w, fc_b, s.dfc, x, offsets, E, fc_width(), C);
}

}  // namespace lockstep
