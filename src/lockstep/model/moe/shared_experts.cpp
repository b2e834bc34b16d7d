#include "lockstep/model/moe/shared_experts.h"

#include <cmath>

#include "lockstep/core/thread_pool.h"
#include "lockstep/core/trace.h"
#include "lockstep/core/tree_sum.h"
#include "lockstep/kernels/device.h"
#include "lockstep/tensor/precision.h"

namespace lockstep {

SharedExpert::SharedExpert(ParamStore& ps, Arena& arena, const std::string& prefix, const ModelConfig& m, int64_t F_,
                           bool use_gate, int64_t N_)
    : N(N_), C(m.hidden_size), F(F_), swiglu(m.activation == "swiglu") {
  const float std = static_cast<float>(m.init_std);
  const float out_std = static_cast<float>(m.init_std / std::sqrt(2.0 * static_cast<double>(m.num_layers)));
  fc = Linear(ps, prefix + "fc", C, fc_width(), m.bias, std);
  proj = Linear(ps, prefix + "proj", F, C, m.bias, out_std);
  if (use_gate) gate_w = ps.add(prefix + "gate.weight", {1, C}, Init::normal, std, true);
  // Sums over the layer's tokens, which tensor parallelism splits (GradRole::token_sum).
  for (int i : {fc.w, fc.b, proj.w, proj.b, gate_w})
    if (i >= 0) ps.set_token_sum(i);
  fc_out = arena.reserve(N * fc_width());
  act = arena.reserve(N * F);
  y = arena.reserve(N * C);
  gate = arena.reserve(N);
  dgate = arena.reserve_scratch(N);
}

void SharedExpert::forward(const ParamStore& ps, const Arena& arena, float* out, const float* base,
                           const float* x) const {
  fc.forward(ps, arena(fc_out), x, N);
  if (swiglu)
    ps.device().ops.swiglu_forward(arena(act), arena(fc_out), N, F);
  else
    ps.device().ops.gelu_forward(arena(act), arena(fc_out), N * F);
  ps.precision().round(arena(act), N * F);
  proj.forward(ps, arena(y), arena(act), N);
  ps.device().ops.gate_forward(out, arena(gate), base, x, gate_w >= 0 ? ps.weight(gate_w) : nullptr, arena(y), N, C);
}

void SharedExpert::branch_backward(const ParamStore& ps, const Arena& arena, const float* dout, const float* x,
                                   const SharedExpertScratch& s) const {
  const Ops& ops = ps.device().ops;
  const float* w = gate_w >= 0 ? ps.weight(gate_w) : nullptr;
  // d(ungated output) = gate * dout; the gate logit's gradient dl_t = <dout_t, y_t> g (1 - g).
  float* dlogit = w ? arena(dgate) : nullptr;
  ops.gate_backward(s.dout, dlogit, dout, arena(y), arena(gate), w != nullptr, N, C);
  ps.precision().round(s.dout, N * C);
  proj.backward(ps, s.dact, s.dout, arena(act), N);
  if (swiglu)
    ops.swiglu_backward(s.dfc, arena(fc_out), s.dact, N, F);
  else
    ops.gelu_backward(s.dfc, arena(fc_out), s.dact, N * F);
  ps.precision().round(s.dfc, N * fc_width());
  fc.backward(ps, s.dx, s.dfc, x, N);
  // dw_gate[c] += sum over tokens (in order) of dlogit_t x[t, c]: one thread per column range.
  // determinism = "layout": per token segment from zero, then the canonical tree over them; under
  // context parallelism per token piece of the rank's rows (ParamStore::token_pieces).
  const int64_t segments = w ? ps.token_segments(gate_w) : 0;
  if (w && segments == 0) ops.gate_weight_grad(ps.grad(gate_w), dlogit, x, N, C, 0);
  if (w && segments > 0) {
    const int64_t K = ps.token_pieces(gate_w), rows = N / K;
    for (int64_t k = 0; k < K; ++k)
      ops.gate_weight_grad(ps.grad_piece(gate_w, k), dlogit + k * rows, x + k * rows * C, rows, C, segments);
  }
}

void SharedExpert::add_input_grad(const ParamStore& ps, const Arena& arena, float* dx,
                                  const SharedExpertScratch& s) const {
  const float* w = gate_w >= 0 ? ps.weight(gate_w) : nullptr;
  ps.device().ops.gate_input_grad(dx, s.dx, w ? arena(dgate) : nullptr, w, N, C);
}

}  // namespace lockstep
