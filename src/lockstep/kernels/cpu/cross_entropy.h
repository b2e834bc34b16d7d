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

// Vocab-parallel pieces (parallel/tensor_parallel.h): this rank holds the logits (N, V) of the
// vocabulary columns [vocab_begin, vocab_begin + V) of vocab_size.
// stats (N, 3): per row, this shard's log-sum-exp pair (max, sum of exp(x - max)), chunked as
// above, and the target's logit when this shard owns it (else 0). cmax: (N, chunks of V) scratch.
// With store, the logits are overwritten by exp(x - chunk max) for cross_entropy_shard_backward.
// UserError naming a target >= vocab_size before anything is written.
void cross_entropy_shard_lse(float* stats, float* cmax, float* logits, const int32_t* targets, int64_t N,
                             int64_t V, int64_t ld, int64_t vocab_begin, int64_t vocab_size, bool store);
// stats: (P, N, 3), every shard's, in vocabulary order: per row, the pairs combined left to right
// exactly as chunks are (so with shards of whole kXentChunk chunks the loss has the single-shard
// bits), the target logits summed; lse (N, 2) receives the combined pair and losses (N) the loss.
void cross_entropy_combine(float* losses, float* lse, const float* stats, const int32_t* targets, int64_t N, int64_t P);
// logits (stored exps) <- (softmax - one-hot) x grad_scale, with the global pair lse (N, 2).
void cross_entropy_shard_backward(float* logits, const float* cmax, const float* lse, const int32_t* targets,
                                  int64_t N, int64_t V, int64_t ld, int64_t vocab_begin, float grad_scale);

}  // namespace lockstep
