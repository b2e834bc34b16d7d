#include "lockstep/model/mlp.h"

#include <cmath>

#include "lockstep/kernels/cpu/activations.h"
#include "lockstep/model/precision.h"
#include "lockstep/model/trace.h"

namespace lockstep {

MlpLayer::MlpLayer(ParamStore& ps, Arena& arena, const std::string& prefix, const ModelConfig& m, int64_t N_)
    : N(N_), C(m.hidden_size), F(m.ffn_hidden()), swiglu(m.activation == "swiglu") {
  const float std = static_cast<float>(m.init_std);
  const float out_std = static_cast<float>(m.init_std / std::sqrt(2.0 * static_cast<double>(m.num_layers)));
  norm = Norm(ps, arena, prefix + "mlp_norm", m.normalization == "rmsnorm", C, N, static_cast<float>(m.norm_eps));
  fc = Linear(ps, prefix + "mlp.fc", C, fc_width(), m.bias, std);
  proj = Linear(ps, prefix + "mlp.proj", F, C, m.bias, out_std);
  act_name = prefix + "mlp.act";
  normed = arena.reserve(N * C);
  fc_out = arena.reserve(N * fc_width());
  act = arena.reserve(N * F);
}

void MlpLayer::forward(const ParamStore& ps, const Arena& arena, float* resid_out, const float* resid_in) const {
  norm.forward(ps, arena, arena(normed), resid_in, N);
  fc.forward(ps, arena(fc_out), arena(normed), N);
  if (swiglu) swiglu_forward(arena(act), arena(fc_out), N, F);
  else gelu_forward(arena(act), arena(fc_out), N * F);
  ps.precision().round(arena(act), N * F);
  trace_out(act_name, arena(act), N * F);
  proj.forward_residual(ps, resid_out, resid_in, arena(act), N);
}

void MlpLayer::backward(const ParamStore& ps, const Arena& arena, float* dresid, const float* resid_in,
                        const MlpScratch& s) const {
  proj.backward(ps, s.dact, dresid, arena(act), N);
  if (swiglu) swiglu_backward(s.dfc, arena(fc_out), s.dact, N, F);
  else gelu_backward(s.dfc, arena(fc_out), s.dact, N * F);
  ps.precision().round(s.dfc, N * fc_width());
  trace_grad_in(act_name, s.dfc, N * fc_width());
  fc.backward(ps, s.dnorm, s.dfc, arena(normed), N);
  norm.backward(ps, arena, dresid, s.dnorm, resid_in, N);
}

}  // namespace lockstep
