#include "lockstep/model/moe/experts.h"

#include <cmath>

#include "lockstep/kernels/cpu/activations.h"
#include "lockstep/kernels/cpu/grouped_gemm.h"
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
  const Precision& p = ps.precision();
  const int64_t R = offsets[E];
  grouped_gemm(arena(fc_out), x, ps.weight(fc_w), Trans::T, fc_b >= 0 ? ps.weight(fc_b) : nullptr, offsets, E,
               fc_width(), C, false);
  p.round(arena(fc_out), R * fc_width());
  if (swiglu) swiglu_forward(arena(act), arena(fc_out), R, F);
  else gelu_forward(arena(act), arena(fc_out), R * F);
  p.round(arena(act), R * F);
  grouped_gemm(out, arena(act), ps.weight(proj_w), Trans::T, proj_b >= 0 ? ps.weight(proj_b) : nullptr, offsets, E,
               C, F, false);
  p.round(out, R * C);
}

void GroupedExperts::backward(const ParamStore& ps, const Arena& arena, float* dx, const float* dout,
                              const float* x, const int64_t* offsets, const ExpertsScratch& s) const {
  const Precision& p = ps.precision();
  const int64_t R = offsets[E];
  grouped_gemm(s.dact, dout, ps.weight(proj_w), Trans::N, nullptr, offsets, E, F, C, false);
  p.round(s.dact, R * F);
  grouped_gemm_wgrad(ps.grad(proj_w), proj_b >= 0 ? ps.grad(proj_b) : nullptr, dout, arena(act), offsets, E, C, F);
  if (swiglu) swiglu_backward(s.dfc, arena(fc_out), s.dact, R, F);
  else gelu_backward(s.dfc, arena(fc_out), s.dact, R * F);
  p.round(s.dfc, R * fc_width());
  grouped_gemm(dx, s.dfc, ps.weight(fc_w), Trans::N, nullptr, offsets, E, C, fc_width(), false);
  p.round(dx, R * C);
  grouped_gemm_wgrad(ps.grad(fc_w), fc_b >= 0 ? ps.grad(fc_b) : nullptr, s.dfc, x, offsets, E, fc_width(), C);
}

}  // namespace lockstep
