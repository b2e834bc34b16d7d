// Causal self-attention with grouped-query heads, computed flash-style.
//
// Layout: the fused QKV projection output, qkv (B, T, (NH + 2*NKV) * HS): per token, NH query
// heads, then NKV key heads, then NKV value heads, HS each. Query head h reads key/value head
// h / (NH / NKV). Softmax scale 1/sqrt(HS); position t attends to positions 0..t.
//
// Packed documents (doc_start, optional, (B, T) int32): query t attends to keys doc_start[b, t]
// .. t only (a block-diagonal causal mask; Megatron's reset_attention_mask). Requires
// 0 <= doc_start[b, t] <= t. Masked keys take the same path as the causal ones (score -inf,
// p = 0 exactly), and key blocks that lie before the document start of every query of a query
// block are skipped; skipping them only drops exact-zero terms, so the per-element arithmetic
// below is unchanged. With doc_start = nullptr the kernel is plain causal attention, bit for bit
// what it was before documents existed.
//
// Forward: keys in blocks of kAttnBlock positions, online softmax (running max m and sum l, the
// output accumulator rescaled when the max grows), never the full T x T score matrix. Saves
// lse (B, NH, T) = log-sum-exp of each query's scaled scores. Backward recomputes the
// probabilities as exp(score - lse), with D_t = dot(dout_t, out_t) and dS = P * (dP - D).
//
// Arithmetic, which fixes every bit (scale = 1/sqrt(HS) rounded to float):
//   qs = q * scale (rounded once); a score s_tj is one FMA chain over d = 0..HS-1 of
//   k_j[d] * qs_t[d]; keys after the query get s = -inf, hence p = 0 exactly. exp is vm::exp.
//   Forward, per key block in order 0, 1, ...: m' = max(m, max of the block's scores);
//   p = exp(s - m') (shifted by 0 instead while m' is still -inf: the query has seen no key); l = fma(l, exp(m - m'),
//   sum of the block's p in key order); acc = acc * exp(m - m'), then acc += p * v_j as one FMA chain over the block's
//   keys in order. At the end out = acc / l and lse = m + log(l). Backward: D_t = 8 lane-partial FMA chains over d,
//   combined in vm::hsum's order; dP_tj is one FMA chain over d of v_j[d] * dout_t[d]; dS = p * (dP - D). dv_j and dk_j
//   are FMA chains over (query head of the group, then query position ascending) of p * dout_t and dS * qs_t; dq_t is
//   one FMA chain over keys 0..t of dS * k_j, then times scale.
//
// Work split and determinism: the forward is split over (b, query head, query block of kAttnBlock
// positions); the backward over (b, kv head): one thread computes dk and dv of that kv head and dq
// of its NH/NKV query heads, so no output is written by two threads and there are no atomics (the
// backward therefore has B*NKV parallel units). Block sizes are constants, so the bits do not
// depend on the thread count. The AVX2 form and the portable form (detail::) perform the same IEEE
// operations lane by lane and give the same bits. Scratch is thread-local and grows to the largest
// shape seen (the backward holds k, v, dk, dv of one (b, kv head): 4*T*HS floats), so steady-state
// calls do not allocate.
//
// Context parallelism (parallel/context_parallel.h): the _chunks forms compute only some query rows
// (chunks of each sample's positions) against the whole sequence's keys and values. Query blocks
// are cut at the multiples of kBlk, so each query sees the same key blocks, in the same order, with
// the same arithmetic as in the whole-sequence call: a query row's out, lse and dq are bitwise the
// whole-sequence ones (more masked keys in a tile only add exact zeros). dk and dv hold only the
// given queries' contributions; summed over the ranks that hold the other queries, they equal the
// whole-sequence gradients up to the association of that sum.
//
// Query segments (determinism = "layout" with layout_token_segments,
// docs/design/reductions.md#token-segments-everywhere): with query_segments = G > 0 the backward cuts each sample's
// queries into G canonical segments (core/tree_sum.h canonical_segments(T, G); G <= T) and computes dk, dv per segment,
// each one FMA chain from zero over (query head of the group, then query position ascending) of that segment's queries,
// then sums a chunk's segments along the canonical tree over them. Query blocks are also cut at the segments (dq, out
// and lse keep their bits). Every chunk must be whole segments; when each chunk's segments are an aligned power-of-two
// block of the G (context parallelism's chunks with 2 cp dividing G), the canonical tree over the chunks' results in
// position order is, bit for bit, the whole-sequence call's tree over the G segments (parallel/context_parallel.h
// reduce_scatter_dkv).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>
#include "lockstep/kernels/op.h"

namespace lockstep {

inline constexpr int64_t kAttnBlock = 64;

// Global positions [begin, end) of each chunk of query rows, ascending and disjoint; the local rows
// of a sample are the chunks' positions back to back (Tl rows in all).
using QueryChunks = std::vector<std::pair<int64_t, int64_t>>;

// The ops, as a backend binds them (kernels/ops.h).
struct AttentionOps {
  // out (B, T, NH*HS), lse (B, NH, T).
  Op<void(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS,
          const int32_t* doc_start)>
      attention_forward{"attention_forward"};
  // dqkv (B, T, (NH + 2*NKV)*HS) is assigned. out and lse are what attention_forward returned.
  // query_segments: dk and dv in that many query segments per sample (above); 0: one chain.
  Op<void(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int64_t B, int64_t T,
          int64_t NH, int64_t NKV, int64_t HS, const int32_t* doc_start, int64_t query_segments)>
      attention_backward{"attention_backward"};
  // qkv (B, Tl, (NH + 2*NKV)*HS): the local rows (only the query columns are read); kv (B, T,
  // 2*NKV*HS): every position's key heads, then value heads. out (B, Tl, NH*HS), lse (B, NH, Tl).
  // doc_start (B, T) over the global positions.
  Op<void(float* out, float* lse, const float* qkv, const float* kv, int64_t B, int64_t T, const QueryChunks& chunks,
          int64_t NH, int64_t NKV, int64_t HS, const int32_t* doc_start)>
      attention_forward_chunks{"attention_forward_chunks"};
  // The query columns of dqkv (B, Tl, ...) and all of dkv (B, T, 2*NKV*HS) are assigned: the local
  // queries' gradient and their contributions to every key's and value's. With query_segments, dkv
  // is (chunks, B, T, 2*NKV*HS): each chunk's tree over its segments, kept apart.
  Op<void(float* dqkv, float* dkv, const float* dout, const float* qkv, const float* kv, const float* out,
          const float* lse, int64_t B, int64_t T, const QueryChunks& chunks, int64_t NH, int64_t NKV, int64_t HS,
          const int32_t* doc_start, int64_t query_segments)>
      attention_backward_chunks{"attention_backward_chunks"};

  // Ring attention (parallel/context_attention.h): the local query rows (q_chunks, as above) against
  // only the keys and values at k_chunks' positions, kv (B, Tk, 2*NKV*HS) their rows back to back.
  // out (B, Tl, NH*HS), lse (B, NH, Tl): the attention over the keys each query sees among them; a
  // query that sees none gets out 0 and lse -inf.
  Op<void(float* out, float* lse, const float* qkv, const float* kv, int64_t B, int64_t T, const QueryChunks& q_chunks,
          const QueryChunks& k_chunks, int64_t NH, int64_t NKV, int64_t HS, const int32_t* doc_start)>
      attention_forward_partial{"attention_forward_partial"};
  // Its backward, given the merged out and lse of every key: the query columns of dqkv get these
  // keys' contributions to dq added (one FMA chain over these keys, then times scale, then added);
  // dkv (B, Tk, 2*NKV*HS) is assigned these queries' contributions to these keys.
  Op<void(float* dqkv, float* dkv, const float* dout, const float* qkv, const float* kv, const float* out,
          const float* lse, int64_t B, int64_t T, const QueryChunks& q_chunks, const QueryChunks& k_chunks, int64_t NH,
          int64_t NKV, int64_t HS, const int32_t* doc_start)>
      attention_backward_partial{"attention_backward_partial"};
  // (out, lse) <- the attention over both key sets: with m = max(lse, part_lse),
  // L = m + logf(expf(lse - m) + expf(part_lse - m)), out = fma(part_out, expf(part_lse - L), out * expf(lse - L)),
  // lse = L; a side at -inf (no keys) takes no part. out (B, Tq, NH*HS), lse (B, NH, Tq).
  Op<void(float* out, float* lse, const float* part_out, const float* part_lse, int64_t B, int64_t Tq, int64_t NH,
          int64_t HS)>
      attention_merge{"attention_merge"};

  template <class F>
  void each(F&& f) {
    f(attention_forward), f(attention_backward), f(attention_forward_chunks), f(attention_backward_chunks);
    f(attention_forward_partial), f(attention_backward_partial), f(attention_merge);
  }
};

}  // namespace lockstep
