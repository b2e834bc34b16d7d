#include "lockstep/model/moe/shared_experts.h"

#include <cmath>

#include "lockstep/kernels/device.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/core/tree_sum.h"
#include "lockstep/tensor/precision.h"
#include "lockstep/core/trace.h"

namespace lockstep {

SharedExpert::SharedExpert(ParamStore& ps, Arena& arena, const std::string& prefix, const ModelConfig& m,
                           int64_t F_, bool use_gate, int64_t N_)
    : N(N_), C(m.hidden_size), F(F_), swiglu(m.activation == "swiglu") {
  const float std = static_cast<float>(m.init_std);
  const float out_std = static_cast<float>(m.init_std / std::sqrt(2.0 * static_cast<double>(m.num_layers)));
  fc = Linear(ps, prefix + "fc", C, fc_width(), m.bias, std);
  proj = Linear(ps, prefix + "proj", F, C, m.bias, out_std);
  if (use_gate) gate_w = ps.add(prefix + "gate.weight", {1, C}, Init::normal, std, true);
  // Sums over the layer's tokens, which tensor parallelism splits (ParamSpec::token_sum).
  for (int i : {fc.w, fc.b, proj.w, proj.b, gate_w})
    if (i >= 0) ps.set_token_sum(i);
  fc_out = arena.reserve(N * fc_width());
  act = arena.reserve(N * F);
  y = arena.reserve(N * C);
  gate = arena.reserve(N);
}

void SharedExpert::forward(const ParamStore& ps, const Arena& arena, float* out, const float* base,
                           const float* x) const {
  fc.forward(ps, arena(fc_out), x, N);
  if (swiglu) ps.device().ops.swiglu_forward(arena(act), arena(fc_out), N, F);
  else ps.device().ops.gelu_forward(arena(act), arena(fc_out), N * F);
  ps.precision().round(arena(act), N * F);
  proj.forward(ps, arena(y), arena(act), N);
  const float* w = gate_w >= 0 ? ps.weight(gate_w) : nullptr;
  float* g = arena(gate);
  const float* yy = arena(y);
  parallel_for(N, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float gt = 1.0f;
      if (w) {
        float dot = 0;
        for (int64_t c = 0; c < C; ++c) dot = std::fma(x[t * C + c], w[c], dot);
        gt = 1.0f / (1.0f + std::exp(-dot));
      }
      g[t] = gt;
      for (int64_t c = 0; c < C; ++c) out[t * C + c] = base[t * C + c] + (w ? gt * yy[t * C + c] : yy[t * C + c]);
    }
  });
}

void SharedExpert::backward(const ParamStore& ps, const Arena& arena, float* dx, const float* dout,
                            const float* x, const SharedExpertScratch& s) const {
  const float* g = arena(gate);
  const float* yy = arena(y);
  const float* w = gate_w >= 0 ? ps.weight(gate_w) : nullptr;
  // d(ungated output) = gate * dout; the gate logit's gradient dl_t = <dout_t, y_t> g (1 - g).
  std::vector<float> dlogit(w ? static_cast<size_t>(N) : 0);
  parallel_for(N, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (w) {
        float dot = 0;
        for (int64_t c = 0; c < C; ++c) dot = std::fma(dout[t * C + c], yy[t * C + c], dot);
        dlogit[t] = dot * g[t] * (1.0f - g[t]);
        for (int64_t c = 0; c < C; ++c) s.dout[t * C + c] = g[t] * dout[t * C + c];
      } else {
        for (int64_t c = 0; c < C; ++c) s.dout[t * C + c] = dout[t * C + c];
      }
    }
  });
  ps.precision().round(s.dout, N * C);
  proj.backward(ps, s.dact, s.dout, arena(act), N);
  if (swiglu) ps.device().ops.swiglu_backward(s.dfc, arena(fc_out), s.dact, N, F);
  else ps.device().ops.gelu_backward(s.dfc, arena(fc_out), s.dact, N * F);
  ps.precision().round(s.dfc, N * fc_width());
  fc.backward(ps, s.dx, s.dfc, x, N);
  // dw_gate[c] += sum over tokens (in order) of dlogit_t x[t, c]: one thread per column range.
  // determinism = "layout": per token segment from zero, then the canonical tree over them; under
  // context parallelism per token piece of the rank's rows (ParamStore::token_pieces).
  const int64_t segments = w ? ps.token_segments(gate_w) : 0;
  if (w && segments == 0) {
    float* dw = ps.grad(gate_w);
    parallel_for(C, [&](int64_t c0, int64_t c1) {
      for (int64_t t = 0; t < N; ++t)
        for (int64_t c = c0; c < c1; ++c) dw[c] += dlogit[t] * x[t * C + c];
    });
  }
  if (w && segments > 0) {
    const int64_t K = ps.token_pieces(gate_w), rows = N / K;
    const std::vector<int64_t> bounds = canonical_segments(rows, segments);
    for (int64_t k = 0; k < K; ++k) {
      float* dw = ps.grad_piece(gate_w, k);
      const int64_t r0 = k * rows;
      parallel_for(C, [&](int64_t c0, int64_t c1) {
        add_segment_tree(dw + c0, c1 - c0, bounds, [&](float* leaf, int64_t t0, int64_t t1) {
          for (int64_t t = r0 + t0; t < r0 + t1; ++t)
            for (int64_t c = c0; c < c1; ++c) leaf[c - c0] += dlogit[t] * x[t * C + c];
        });
      });
    }
  }
  parallel_for(N, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t c = 0; c < C; ++c)
        dx[t * C + c] += s.dx[t * C + c] + (w ? dlogit[t] * w[c] : 0.0f);
  });
}

}  // namespace lockstep
