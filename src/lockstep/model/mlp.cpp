#include "lockstep/model/mlp.h"

#include <cmath>

#include "lockstep/core/trace.h"
#include "lockstep/kernels/device.h"
#include "lockstep/tensor/precision.h"

namespace lockstep {

MlpLayer::MlpLayer(ParamStore& ps, Arena& arena, const std::string& prefix, const ModelConfig& m, int64_t N_,
                   const TensorParallel& tp_)
    : N(N_), C(m.hidden_size), F(m.ffn_hidden() / tp_.size), swiglu(m.activation == "swiglu"), tp(tp_) {
  const float std = static_cast<float>(m.init_std);
  const float out_std = static_cast<float>(m.init_std / std::sqrt(2.0 * static_cast<double>(m.num_layers)));
  norm =
      Norm(ps, arena, prefix + "mlp_norm", m.normalization == "rmsnorm", C, tp.rows(N), static_cast<float>(m.norm_eps));
  if (tp.sequence) norm.set_sequence_parallel(ps);
  const int64_t Fg = m.ffn_hidden();
  fc = Linear::column(ps, tp, prefix + "mlp.fc", C, swiglu ? std::vector<int64_t>{Fg, Fg} : std::vector<int64_t>{Fg},
                      m.bias, std);
  proj = Linear::row(ps, tp, prefix + "mlp.proj", Fg, C, m.bias, out_std);
  act_name = prefix + "mlp.act";
  normed = arena.reserve(tp.rows(N) * C);
  fc_out = arena.reserve(N * fc_width());
  act = arena.reserve(N * F);
  if (tp.on()) partial = arena.reserve(N * C);
  if (tp.sequence) gathered = arena.reserve(N * C);
}

void MlpLayer::forward(const ParamStore& ps, const Arena& arena, float* resid_out, const float* resid_in) const {
  norm.forward(ps, arena, arena(normed), resid_in, tp.rows(N));
  const float* x = enter_column_parallel(tp, tp.sequence ? arena(gathered) : nullptr, arena(normed), N, C);
  fc.forward(ps, arena(fc_out), x, N);
  if (swiglu)
    ps.device().ops.swiglu_forward(arena(act), arena(fc_out), N, F);
  else
    ps.device().ops.gelu_forward(arena(act), arena(fc_out), N * F);
  ps.precision().round(arena(act), N * F);
  trace_out(act_name, arena(act), N * F);
  proj.forward_residual(ps, tp, resid_out, resid_in, arena(act), N, tp.on() ? arena(partial) : nullptr);
}

void MlpLayer::backward(const ParamStore& ps, const Arena& arena, float* dresid, const float* resid_in,
                        const MlpScratch& s) const {
  // The full output gradient (gathered into dnorm, free until fc's backward).
  const float* dy = leave_row_parallel_backward(tp, s.dnorm, dresid, N, C);
  proj.backward(ps, s.dact, dy, arena(act), N);
  if (swiglu)
    ps.device().ops.swiglu_backward(s.dfc, arena(fc_out), s.dact, N, F);
  else
    ps.device().ops.gelu_backward(s.dfc, arena(fc_out), s.dact, N * F);
  ps.precision().round(s.dfc, N * fc_width());
  trace_grad_in(act_name, s.dfc, N * fc_width());
  const float* dnorm = fc.backward(ps, tp, s.dact, s.dnorm, s.dfc, tp.sequence ? arena(gathered) : arena(normed), N);
  norm.backward(ps, arena, dresid, dnorm, resid_in, tp.rows(N));
}

}  // namespace lockstep
