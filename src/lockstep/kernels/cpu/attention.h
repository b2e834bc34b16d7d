// Causal self-attention with grouped-query heads, computed flash-style.
//
// Layout: the fused QKV projection output, qkv (B, T, (NH + 2*NKV) * HS): per token, NH query
// heads, then NKV key heads, then NKV value heads, HS each. Query head h reads key/value head
// h / (NH / NKV). Softmax scale 1/sqrt(HS); position t attends to positions 0..t.
//
// Forward: keys in blocks of kAttnBlock positions, online softmax (running max and sum), never the
// full T x T score matrix. Saves lse (B, NH, T) = log-sum-exp of each query's scaled scores.
// Backward recomputes the scores from q, k and lse.
//
// Determinism: the block size is a constant; the work is split over (b, kv-head) pairs, and each
// pair's forward and backward run on one thread in one fixed order, so dq, dk and dv are written
// without atomics and the bits do not depend on the thread count.
#pragma once

#include <cstdint>

namespace lockstep {

inline constexpr int64_t kAttnBlock = 64;

// out (B, T, NH*HS), lse (B, NH, T).
void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t NH,
                       int64_t NKV, int64_t HS);

// dqkv (B, T, (NH + 2*NKV)*HS) is assigned. out and lse are what attention_forward returned.
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                        const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS);

}  // namespace lockstep
