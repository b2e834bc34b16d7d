#include "lockstep/model/linear.h"

#include <cstring>

#include "lockstep/core/thread_pool.h"
#include "lockstep/core/trace.h"
#include "lockstep/kernels/device.h"
#include "lockstep/tensor/precision.h"

namespace lockstep {

Linear::Linear(ParamStore& ps, const std::string& name, int64_t in_, int64_t out_, bool bias, float init_std)
    : name(name), in(in_), out(out_) {
  w = ps.add(name + ".weight", {out, in}, Init::normal, init_std, /*decay=*/true);
  if (bias) b = ps.add(name + ".bias", {out}, Init::zeros);
}

Linear Linear::column(ParamStore& ps, const TensorParallel& tp, const std::string& name, int64_t in,
                      const std::vector<int64_t>& out_sections, bool bias, float init_std) {
  Linear l;
  l.name = name;
  l.in = in;
  for (int64_t s : out_sections) l.out += s / tp.size;
  l.w = tp.column_weight(ps, name + ".weight", out_sections, in, init_std);
  if (bias) l.b = tp.column_bias(ps, name + ".bias", out_sections);
  l.dgrad_segments = tp.k_segments(out_sections);
  if (out_sections.size() > 1 && tp.layout())
    for (int64_t s : out_sections) l.dgrad_sections.push_back(s / tp.size);
  l.split = tp.on();
  ps.set_layout_cut(l.w, 0, layout_cut(l.dgrad_segments, l.dgrad_sections));
  return l;
}

Linear Linear::row(ParamStore& ps, const TensorParallel& tp, const std::string& name, int64_t in, int64_t out,
                   bool bias, float init_std) {
  Linear l;
  l.name = name;
  l.in = in / tp.size;
  l.out = out;
  l.w = tp.row_weight(ps, name + ".weight", out, in, init_std);
  if (bias) l.b = ps.add(name + ".bias", {out}, Init::zeros);
  l.fprop_segments = tp.k_segments({in});
  l.split = tp.on();
  ps.set_layout_cut(l.w, 1, l.fprop_segments);
  return l;
}

void Linear::forward(const ParamStore& ps, float* y, const float* x, int64_t N) const {
  GemmOptions opt;
  if (b >= 0) opt.bias = ps.weight(b);
  ps.precision().fprop(ps, w, y, x, N, out, in, opt);
  trace_out(name, y, N * out);
}

void Linear::forward_residual(const ParamStore& ps, float* y, const float* residual, const float* x, int64_t N) const {
  const Ops& ops = ps.device().ops;
  if (b >= 0)
    ops.add_bias_rows(y, residual, ps.weight(b), 0.0f, nullptr, N, out);
  else if (y != residual)
    ops.copy(y, residual, N * out);
  GemmOptions opt;
  opt.accumulate = true;
  opt.k_segments = fprop_segments;
  ps.precision().fprop(ps, w, y, x, N, out, in, opt);
  trace_out(name, y, N * out);
}

void Linear::forward_residual(const ParamStore& ps, const TensorParallel& tp, float* y, const float* residual,
                              const float* x, int64_t N, float* partial) const {
  if (!tp.on()) return forward_residual(ps, y, residual, x, N);
  LOCKSTEP_CHECK(y != residual, name, ": the row-parallel output may not alias the residual");
  GemmOptions opt;
  opt.k_segments = fprop_segments;
  ps.precision().fprop(ps, w, partial, x, N, out, in, opt, tp.layout());
  const float* sum = leave_row_parallel(tp, y, partial, N, out);
  // -0 is the identity of addition (a residual's -0 stays -0, as one process keeps it).
  ps.device().ops.add_bias_rows(y, residual, b >= 0 ? ps.weight(b) : nullptr, tp.layout() ? -0.0f : 0.0f, sum,
                                tp.rows(N), out);
  ps.precision().round(y, tp.rows(N) * out);
  trace_out(name, y, tp.rows(N) * out);
}

void Linear::backward(const ParamStore& ps, float* dx, const float* dy, const float* x, int64_t N) const {
  GemmOptions opt;
  opt.k_segments = dgrad_segments;
  opt.k_sections = dgrad_sections;
  ps.precision().dgrad(ps, w, dx, dy, N, out, in, opt, split && !dgrad_segments.empty());
  ps.precision().wgrad(ps, w, dy, x, N, out, in);
  if (b >= 0) {
    const int64_t K = ps.token_pieces(b), rows = N / K;
    for (int64_t k = 0; k < K; ++k)
      ps.device().ops.bias_backward(ps.grad_piece(b, k), dy + k * rows * out, rows, out, ps.token_segments(b));
  }
  trace_grad_in(name, dx, N * in);
}

float* Linear::backward(const ParamStore& ps, const TensorParallel& tp, float* drows, float* dfull, const float* dy,
                        const float* x, int64_t N) const {
  backward(ps, dfull, dy, x, N);
  float* sum = enter_column_parallel_backward(tp, drows, dfull, N, in);
  if (split && tp.layout()) ps.precision().round(sum, tp.rows(N) * in);  // the parts were left unrounded
  return sum;
}

}  // namespace lockstep
