#include "lockstep/kernels/cpu/grouped_gemm.h"

#include "lockstep/kernels/cpu/embedding.h"

namespace lockstep {

void grouped_gemm(float* C, const float* A, const float* W, Trans tw, const float* bias,
                  const int64_t* offsets, int64_t E, int64_t Nout, int64_t K, bool accumulate) {
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = offsets[e], rows = offsets[e + 1] - r0;
    if (rows == 0) continue;
    GemmOptions opt;
    opt.accumulate = accumulate;
    if (!accumulate && bias) opt.bias = bias + e * Nout;
    gemm(C + r0 * Nout, A + r0 * K, Trans::N, W + e * Nout * K, tw, rows, Nout, K, opt);
  }
}

void grouped_gemm_wgrad(float* dW, float* dbias, const float* dY, const float* X,
                        const int64_t* offsets, int64_t E, int64_t Nout, int64_t K) {
  GemmOptions acc;
  acc.accumulate = true;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = offsets[e], rows = offsets[e + 1] - r0;
    if (rows == 0) continue;
    gemm(dW + e * Nout * K, dY + r0 * Nout, Trans::T, X + r0 * K, Trans::N, Nout, K, rows, acc);
    if (dbias) bias_backward(dbias + e * Nout, dY + r0 * Nout, rows, Nout);
  }
}

}  // namespace lockstep
