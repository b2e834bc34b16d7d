#include "lockstep/model/norm.h"

#include "lockstep/core/trace.h"
#include "lockstep/kernels/device.h"
#include "lockstep/tensor/precision.h"

namespace lockstep {

Norm::Norm(ParamStore& ps, Arena& arena, const std::string& name, bool rms_, int64_t C_, int64_t N, float eps_)
    : name(name), rms(rms_), C(C_), eps(eps_) {
  w = ps.add(name + ".weight", {C}, Init::ones);
  ps.set_token_sum(w);
  if (!rms) {
    b = ps.add(name + ".bias", {C}, Init::zeros);
    ps.set_token_sum(b);
    mean = arena.reserve(N);
  }
  rstd = arena.reserve(N);
}

void Norm::set_sequence_parallel(ParamStore& ps) const {
  ps.set_sequence_parallel(w);
  if (b >= 0) ps.set_sequence_parallel(b);
}

void Norm::forward(const ParamStore& ps, const Arena& arena, float* out, const float* inp, int64_t N) const {
  const Ops& ops = ps.device().ops;
  if (rms)
    ops.rmsnorm_forward(out, arena(rstd), inp, ps.weight(w), N, C, eps);
  else
    ops.layernorm_forward(out, arena(mean), arena(rstd), inp, ps.weight(w), ps.weight(b), N, C, eps);
  ps.precision().round(out, N * C);
  trace_out(name, out, N * C);
}

void Norm::backward(const ParamStore& ps, const Arena& arena, float* dinp, const float* dout, const float* inp,
                    int64_t N) const {
  const Ops& ops = ps.device().ops;
  const int64_t segments = ps.token_segments(w);
  // Under context parallelism each piece of the rank's rows separately (ParamStore::token_pieces).
  const int64_t K = ps.token_pieces(w), n = N / K;
  for (int64_t k = 0; k < K; ++k) {
    const int64_t r = k * n;
    if (rms)
      ops.rmsnorm_backward(dinp + r * C, ps.grad_piece(w, k), dout + r * C, inp + r * C, ps.weight(w), arena(rstd) + r,
                           n, C, segments);
    else
      ops.layernorm_backward(dinp + r * C, ps.grad_piece(w, k), ps.grad_piece(b, k), dout + r * C, inp + r * C,
                             ps.weight(w), arena(mean) + r, arena(rstd) + r, n, C, segments);
  }
  ps.precision().round(dinp, N * C);
  trace_grad_in(name, dinp, N * C);
}

}  // namespace lockstep
