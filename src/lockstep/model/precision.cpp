#include "lockstep/model/precision.h"

#include "lockstep/core/dtype.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/model/param_table.h"

namespace lockstep {

void round_to_bf16(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = to_f32(to_bf16(x[i]));
}

Precision::Precision(const PrecisionConfig& pc) : bf16_(pc.params == "bf16") {}

void Precision::round(float* x, int64_t n) const {
  if (!bf16_) return;
  parallel_for(n, [&](int64_t i0, int64_t i1) { round_to_bf16(x + i0, i1 - i0); });
}

void Precision::fprop(const ParamStore& ps, int w, float* y, const float* x, int64_t N, int64_t out, int64_t in,
                      const GemmOptions& opt) const {
  gemm(y, x, Trans::N, ps.weight(w), Trans::T, N, out, in, opt);
  round(y, N * out);
}

void Precision::dgrad(const ParamStore& ps, int w, float* dx, const float* dy, int64_t N, int64_t out,
                      int64_t in) const {
  gemm(dx, dy, Trans::N, ps.weight(w), Trans::N, N, in, out);
  round(dx, N * in);
}

void Precision::wgrad(const ParamStore& ps, int w, const float* dy, const float* x, int64_t N, int64_t out,
                      int64_t in) const {
  GemmOptions acc;
  acc.accumulate = true;
  gemm(ps.grad(w), dy, Trans::T, x, Trans::N, out, in, N, acc);
}

}  // namespace lockstep
