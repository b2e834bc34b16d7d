// Softmax cross-entropy over a vocabulary of V, fused with its gradient.
//
// Per row n: loss[n] = logsumexp(logits[n, :]) - logits[n, target[n]]. The log-sum-exp is computed
// chunked over the vocabulary (kXentChunk columns at a time, an online (max, sum) pair per chunk,
// chunks combined left to right) - the same combine a vocab-parallel loss uses across ranks.
// The forward-backward form overwrites the logits in place with
//     dlogits[n, v] = (softmax[n, v] - [v == target[n]]) * grad_scale,
// so the logits gradient never needs a second full-size buffer. Rows whose target is negative are
// ignored: loss 0, gradient 0. A target >= V raises UserError naming it and its row, before
// anything is written.
//
// Determinism: each row is owned by one thread and reduced in a fixed order.
#pragma once

#include <cstdint>

namespace lockstep {

inline constexpr int64_t kXentChunk = 2048;

// logits (N, V) with leading dimension ld; losses (N).
void cross_entropy_forward(float* losses, const float* logits, const int32_t* targets, int64_t N,
                           int64_t V, int64_t ld);
void cross_entropy_forward_backward(float* losses, float* logits, const int32_t* targets,
                                    int64_t N, int64_t V, int64_t ld, float grad_scale);

}  // namespace lockstep
