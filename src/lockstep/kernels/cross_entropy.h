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
//
// determinism = "layout" (docs/design/reductions.md#vocabulary-segments) sums in another, canonical form, so that
// splitting the vocabulary over tensor-parallel ranks does not change a bit. The vocabulary [0, vocab_size) is cut into
// S canonical segments (S = layout_segments), segment s = [s x vocab_size / S, (s + 1) x vocab_size / S) (floor); per
// row:
//   M    = the row's max (exact in any order; -0 is read as +0),
//   Z_s  = the sum of exp(x - M) over segment s, its own chain from zero (the 32-lane order of a
//          chunk below, over the whole segment),
//   Z    = the canonical tree over s of Z_s (core/tree_sum.h),
//   loss = (M + log Z) - x[target],   dlogits = exp(x - M) x (grad_scale / Z) - [v == target] grad_scale.
// A shard of the vocabulary that holds segments [s0, s0 + n) (n a power of two, s0 a multiple of
// n: a subtree of the canonical tree) computes the tree over its own segments; shards combine the
// per-row max with a max and the partial trees with ReduceOp::tree_sum (the target logit: the
// owner's value, -0 elsewhere, which adds exactly). One process calls the same functions with the
// whole vocabulary as its shard, so every shard count gives the one-process bits.
#pragma once

#include <cstdint>
#include "lockstep/kernels/op.h"

namespace lockstep {

inline constexpr int64_t kXentChunk = 2048;

// The ops, as a backend binds them (kernels/ops.h).
struct CrossEntropyOps {
  // logits (N, V) with leading dimension ld; losses (N).
  Op<void(float* losses, const float* logits, const int32_t* targets, int64_t N, int64_t V, int64_t ld)>
      cross_entropy_forward{"cross_entropy_forward"};
  Op<void(float* losses, float* logits, const int32_t* targets, int64_t N, int64_t V, int64_t ld, float grad_scale)>
      cross_entropy_forward_backward{"cross_entropy_forward_backward"};
  // Vocab-parallel pieces (parallel/tensor_parallel.h): this rank holds the logits (N, V) of the
  // vocabulary columns [vocab_begin, vocab_begin + V) of vocab_size.
  // stats (N, 3): per row, this shard's log-sum-exp pair (max, sum of exp(x - max)), chunked as
  // above, and the target's logit when this shard owns it (else 0). cmax: (N, chunks of V) scratch.
  // With store, the logits are overwritten by exp(x - chunk max) for cross_entropy_shard_backward.
  // UserError naming a target >= vocab_size before anything is written.
  Op<void(float* stats, float* cmax, float* logits, const int32_t* targets, int64_t N, int64_t V, int64_t ld,
          int64_t vocab_begin, int64_t vocab_size, bool store)>
      cross_entropy_shard_lse{"cross_entropy_shard_lse"};
  // stats: (P, N, 3), every shard's, in vocabulary order: per row, the pairs combined left to right
  // exactly as chunks are (so with shards of whole kXentChunk chunks the loss has the single-shard
  // bits), the target logits summed; lse (N, 2) receives the combined pair and losses (N) the loss.
  Op<void(float* losses, float* lse, const float* stats, const int32_t* targets, int64_t N, int64_t P)>
      cross_entropy_combine{"cross_entropy_combine"};
  // logits (stored exps) <- (softmax - one-hot) x grad_scale, with the global pair lse (N, 2).
  Op<void(float* logits, const float* cmax, const float* lse, const int32_t* targets, int64_t N, int64_t V, int64_t ld,
          int64_t vocab_begin, float grad_scale)>
      cross_entropy_shard_backward{"cross_entropy_shard_backward"};
  // ---- The layout form (header comment). This shard holds the logits (N, V) of the vocabulary
  // columns [vocab_begin, vocab_begin + V) of vocab_size, cut into `segments` canonical segments.
  // rowmax (N) <- each row's max over this shard, -0 as +0 (reduce with ReduceOp::max). UserError
  // naming a target >= vocab_size before anything is written.
  Op<void(float* rowmax, const float* logits, const int32_t* targets, int64_t N, int64_t V, int64_t ld,
          int64_t vocab_size)>
      cross_entropy_segments_max{"cross_entropy_segments_max"};
  // stats (N, 2) <- per row, the canonical tree over this shard's segments of their sums of
  // exp(x - rowmax), and the target's logit when this shard owns it, else -0 (reduce both with
  // ReduceOp::tree_sum). rowmax: the global max. With store, the logits are overwritten by
  // exp(x - rowmax) for cross_entropy_segments_backward. The shard must be a whole subtree of
  // segments (checked).
  Op<void(float* stats, float* logits, const float* rowmax, const int32_t* targets, int64_t N, int64_t V, int64_t ld,
          int64_t vocab_begin, int64_t vocab_size, int64_t segments, bool store)>
      cross_entropy_segments_sum{"cross_entropy_segments_sum"};
  // losses (N) from the global rowmax and stats.
  Op<void(float* losses, const float* rowmax, const float* stats, const int32_t* targets, int64_t N)>
      cross_entropy_segments_loss{"cross_entropy_segments_loss"};
  // logits (stored exps) <- (softmax - one-hot) x grad_scale, with the global stats.
  Op<void(float* logits, const float* stats, const int32_t* targets, int64_t N, int64_t V, int64_t ld,
          int64_t vocab_begin, float grad_scale)>
      cross_entropy_segments_backward{"cross_entropy_segments_backward"};
  // The whole layout form on one process (vocab_begin 0, V = vocab_size): losses, and with
  // backward the logits overwritten by their gradient. scratch: 3N floats.
  Op<void(float* losses, float* logits, const int32_t* targets, int64_t N, int64_t V, int64_t ld, int64_t segments,
          bool backward, float grad_scale, float* scratch)>
      cross_entropy_segments{"cross_entropy_segments"};

  template <class F>
  void each(F&& f) {
    f(cross_entropy_forward), f(cross_entropy_forward_backward), f(cross_entropy_shard_lse), f(cross_entropy_combine),
        f(cross_entropy_shard_backward), f(cross_entropy_segments_max), f(cross_entropy_segments_sum),
        f(cross_entropy_segments_loss), f(cross_entropy_segments_backward), f(cross_entropy_segments);
  }
};

}  // namespace lockstep
