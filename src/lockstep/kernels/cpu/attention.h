// Causal self-attention with grouped-query heads, computed flash-style.
//
// Layout: the fused QKV projection output, qkv (B, T, (NH + 2*NKV) * HS): per token, NH query
// heads, then NKV key heads, then NKV value heads, HS each. Query head h reads key/value head
// h / (NH / NKV). Softmax scale 1/sqrt(HS); position t attends to positions 0..t.
//
// Forward: keys in blocks of kAttnBlock positions, online softmax (running max and sum, the output
// accumulator rescaled when the max grows), never the full T x T score matrix. Saves lse (B, NH, T)
// = log-sum-exp of each query's scaled scores. Backward recomputes the probabilities as
// exp(score - lse), with D_t = dot(dout_t, out_t) and dS = P * (dP - D).
//
// Arithmetic, which fixes every bit: q is scaled once (q * scale, rounded); a score is one FMA chain
// over d = 0..HS-1. The forward visits key blocks 0, 1, ... in order; within a block a row's
// max and sum use a fixed lane order (vm::hsum), and out_t += p * v is one FMA chain over the keys
// in order. In the backward, dv_j and dk_j are FMA chains over (query head of the group, then query
// position ascending), and dq_t is one FMA chain over the keys 0..t, times scale at the end.
//
// Work split and determinism: the forward is split over (b, query head, query block of kAttnBlock
// positions); the backward over (b, kv head): one thread computes dk and dv of that kv head and dq
// of its NH/NKV query heads, so no output is written by two threads and there are no atomics. Block
// sizes are constants, so the bits do not depend on the thread count. The AVX2 form and the
// portable form (detail::) perform the same IEEE operations lane by lane and give the same bits.
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

namespace detail {
// The portable forms, exposed so tests can check them against the AVX2 forms bitwise.
void attention_forward_portable(float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                                int64_t NH, int64_t NKV, int64_t HS);
void attention_backward_portable(float* dqkv, const float* dout, const float* qkv,
                                 const float* out, const float* lse, int64_t B, int64_t T,
                                 int64_t NH, int64_t NKV, int64_t HS);
}  // namespace detail

}  // namespace lockstep
