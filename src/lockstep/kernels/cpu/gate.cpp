#include "lockstep/kernels/cpu/gate.h"

#include <cmath>
#include <vector>

#include "lockstep/core/libm.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/core/tree_sum.h"

namespace lockstep {

void gate_forward(float* out, float* g, const float* base, const float* x, const float* w, const float* y, int64_t N,
                  int64_t C) {
  parallel_for(N, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float gt = 1.0f;
      if (w) {
        float dot = 0;
        for (int64_t c = 0; c < C; ++c) dot = std::fma(x[t * C + c], w[c], dot);
        gt = 1.0f / (1.0f + libm::expf(-dot));
      }
      g[t] = gt;
      for (int64_t c = 0; c < C; ++c) out[t * C + c] = base[t * C + c] + (w ? gt * y[t * C + c] : y[t * C + c]);
    }
  });
}

void gate_backward(float* dy, float* dlogit, const float* dout, const float* y, const float* g, bool gated, int64_t N,
                   int64_t C) {
  parallel_for(N, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (gated) {
        float dot = 0;
        for (int64_t c = 0; c < C; ++c) dot = std::fma(dout[t * C + c], y[t * C + c], dot);
        dlogit[t] = dot * g[t] * (1.0f - g[t]);
        for (int64_t c = 0; c < C; ++c) dy[t * C + c] = g[t] * dout[t * C + c];
      } else {
        for (int64_t c = 0; c < C; ++c) dy[t * C + c] = dout[t * C + c];
      }
    }
  });
}

void gate_weight_grad(float* dw, const float* dlogit, const float* x, int64_t N, int64_t C, int64_t segments) {
  if (segments == 0) {
    parallel_for(C, [&](int64_t c0, int64_t c1) {
      for (int64_t t = 0; t < N; ++t)
        for (int64_t c = c0; c < c1; ++c) dw[c] += dlogit[t] * x[t * C + c];
    });
    return;
  }
  const std::vector<int64_t> bounds = canonical_segments(N, segments);
  parallel_for(C, [&](int64_t c0, int64_t c1) {
    add_segment_tree(dw + c0, c1 - c0, bounds, [&](float* leaf, int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t c = c0; c < c1; ++c) leaf[c - c0] += dlogit[t] * x[t * C + c];
    });
  });
}

void gate_input_grad(float* dx, const float* dx_expert, const float* dlogit, const float* w, int64_t N, int64_t C) {
  parallel_for(N, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t c = 0; c < C; ++c) dx[t * C + c] += dx_expert[t * C + c] + (w ? dlogit[t] * w[c] : 0.0f);
  });
}

}  // namespace lockstep
