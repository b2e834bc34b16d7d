#include "lockstep/kernels/cpu/permute.h"

#include <cmath>
#include <cstring>

#include "lockstep/core/thread_pool.h"

namespace lockstep {

void permute_forward(float* out, const float* inp, const int32_t* row_choice, int64_t R, int64_t K, int64_t C) {
  parallel_for(R, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* o = out + r * C;
      if (row_choice[r] < 0)
        std::memset(o, 0, static_cast<size_t>(C) * sizeof(float));
      else
        std::memcpy(o, inp + (row_choice[r] / K) * C, static_cast<size_t>(C) * sizeof(float));
    }
  });
}

void permute_backward(float* dinp, const float* dout, const int32_t* slot, int64_t N, int64_t K, int64_t C) {
  parallel_for(N, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* d = dinp + t * C;
      for (int64_t k = 0; k < K; ++k) {
        const int32_t r = slot[t * K + k];
        if (r < 0) continue;
        const float* g = dout + r * C;
        for (int64_t c = 0; c < C; ++c) d[c] += g[c];
      }
    }
  });
}

void combine_forward(float* out, const float* base, const float* expert_out, const int32_t* slot, const float* probs,
                     int64_t N, int64_t K, int64_t C) {
  parallel_for(N, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* o = out + t * C;
      if (o != base + t * C) std::memcpy(o, base + t * C, static_cast<size_t>(C) * sizeof(float));
      for (int64_t k = 0; k < K; ++k) {
        const int32_t r = slot[t * K + k];
        if (r < 0) continue;
        const float p = probs[t * K + k];
        const float* y = expert_out + r * C;
        for (int64_t c = 0; c < C; ++c) o[c] = std::fma(p, y[c], o[c]);
      }
    }
  });
}

void combine_backward(float* dexpert_out, float* dprobs, const float* dout, const float* expert_out,
                      const int32_t* slot, const int32_t* row_choice, const float* probs, int64_t N, int64_t R,
                      int64_t K, int64_t C) {
  parallel_for(R, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* d = dexpert_out + r * C;
      const int32_t choice = row_choice[r];
      if (choice < 0) {
        std::memset(d, 0, static_cast<size_t>(C) * sizeof(float));
        continue;
      }
      const float p = probs[choice];
      const float* g = dout + (choice / K) * C;
      for (int64_t c = 0; c < C; ++c) d[c] = p * g[c];
    }
  });
  parallel_for(N, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t k = 0; k < K; ++k) {
        const int32_t r = slot[t * K + k];
        float acc = 0.0f;
        if (r >= 0) {
          const float* y = expert_out + r * C;
          const float* g = dout + t * C;
          for (int64_t c = 0; c < C; ++c) acc = std::fma(g[c], y[c], acc);
        }
        dprobs[t * K + k] = acc;
      }
    }
  });
}

}  // namespace lockstep
