#include "lockstep/model/linear.h"

#include <cstring>

#include "lockstep/core/thread_pool.h"
#include "lockstep/kernels/cpu/embedding.h"
#include "lockstep/kernels/cpu/gemm.h"
#include "lockstep/model/precision.h"
#include "lockstep/model/trace.h"

namespace lockstep {

Linear::Linear(ParamStore& ps, const std::string& name, int64_t in_, int64_t out_, bool bias, float init_std)
    : name(name), in(in_), out(out_) {
  w = ps.add(name + ".weight", {out, in}, Init::normal, init_std, /*decay=*/true);
  if (bias) b = ps.add(name + ".bias", {out}, Init::zeros);
}

void Linear::forward(const ParamStore& ps, float* y, const float* x, int64_t N) const {
  GemmOptions opt;
  if (b >= 0) opt.bias = ps.weight(b);
  ps.precision().fprop(ps, w, y, x, N, out, in, opt);
  trace_out(name, y, N * out);
}

void Linear::forward_residual(const ParamStore& ps, float* y, const float* residual, const float* x,
                              int64_t N) const {
  const float* bias = b >= 0 ? ps.weight(b) : nullptr;
  const int64_t O = out;
  parallel_for(N, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (bias) {
        for (int64_t j = 0; j < O; ++j) y[r * O + j] = residual[r * O + j] + bias[j];
      } else if (y != residual) {
        std::memcpy(y + r * O, residual + r * O, static_cast<size_t>(O) * sizeof(float));
      }
    }
  });
  GemmOptions opt;
  opt.accumulate = true;
  ps.precision().fprop(ps, w, y, x, N, out, in, opt);
  trace_out(name, y, N * out);
}

void Linear::backward(const ParamStore& ps, float* dx, const float* dy, const float* x, int64_t N) const {
  ps.precision().dgrad(ps, w, dx, dy, N, out, in);
  ps.precision().wgrad(ps, w, dy, x, N, out, in);
  if (b >= 0) bias_backward(ps.grad(b), dy, N, out);
  trace_grad_in(name, dx, N * in);
}

}  // namespace lockstep
