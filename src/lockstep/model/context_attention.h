// Attention's core (the scaled dot-product attention between RoPE and the output projection) under
// context parallelism, by parallel.cp_comm_type (Megatron's cp_comm_type). Every cp rank holds its
// two chunks of each sample (parallel/context_parallel.h); what crosses the group differs:
//
//   all_gather  keys and values all-gathered into the whole sequence (B, T, 2 NKV HS), kept for
//               backward; partial dK, dV reduce-scattered (context_parallel.h gather_kv). A query row's
//               output is bitwise the single process's; memory per rank does not fall with cp.
//   a2a         (Ulysses) an all-to-all trades the sequence shard for a head shard: each rank gets
//               the whole sequence of NH / cp query heads and NKV / cp key/value groups, runs the
//               single-process kernel on them and trades back. Each head's arithmetic is the single
//               process's, so out, lse, dQ, dK and dV are its bits in run and in layout mode (query
//               segments included). Needs heads and query groups divisible by tp x cp.
//   p2p         ring attention: the rank's keys and values go around the ring (to cp rank + 1)
//               while each rank attends to the chunks it holds (attention_forward_partial) and merges
//               the partial results by log-sum-exp (attention_merge) in ring order; the next chunk is
//               in flight during the compute. Backward passes the keys and values around again with
//               their accumulating dK, dV, which end on their home rank after one more hop. Never
//               more than the rank's own and two remote chunks (the one computed on and the one
//               arriving) resident. Deterministic in run mode (fixed ring order); the sums' association
//               depends on cp, so layout mode refuses it (config/config.cpp).
//   a2a+p2p     the all-to-all inside groups of A consecutive cp ranks
//               (parallel.hierarchical_context_parallel_sizes "A,P"), the ring across the P groups:
//               after the all-to-all, group o holds chunks o and 2P - 1 - o of T / (2P) positions
//               (its ranks' chunks are adjacent), a ring of P on NH / A heads.
//
// Activations kept for backward per layer: all_gather the whole-sequence K, V (B, T, 2 NKV HS);
// a2a the head-sharded q, k, v, out and lse (each 1 / cp of the sequence's); p2p only the rank's own
// rows (the layer's qkv, out and lse).
#pragma once

#include <cstdint>
#include <vector>

#include "lockstep/model/arena.h"
#include "lockstep/parallel/context_parallel.h"

namespace lockstep {

class Precision;

struct ContextAttention {
  ContextAttention() = default;
  // B samples of Tg positions (the whole sequence), this tp rank's NH query heads and NKV groups of
  // HS. token_segments: layout_token_segments (all_gather's dK, dV pieces). scratch_of: another
  // layer's, whose scratch this one shares.
  ContextAttention(const ContextParallel& cp, Arena& arena, int64_t B, int64_t Tg, int64_t NH, int64_t NKV, int64_t HS,
                   bool token_segments, const ContextAttention* scratch_of);

  // att (B, T / cp, NH HS) and what backward needs, from the rank's rows qkv (B, T / cp, (NH + 2 NKV) HS)
  // (kept: backward reads it); att is rounded to p's working precision. lse (B, NH, T / cp): all_gather
  // and p2p write it (the others keep their own). doc_start (B, Tg) or null.
  void forward(const Ops& ops, const Precision& p, const Arena& arena, float* att, float* lse, const float* qkv,
               const int32_t* doc_start) const;
  // dqkv (B, T / cp, (NH + 2 NKV) HS) assigned from datt, given forward's qkv, att and lse. segments:
  // query segments per sample (layout_token_segments), 0 otherwise.
  void backward(const Ops& ops, const Arena& arena, float* dqkv, const float* datt, const float* qkv, const float* att,
                const float* lse, const int32_t* doc_start, int64_t segments) const;

  ContextParallel cp;
  int64_t B = 0, Tg = 0, NH = 0, NKV = 0, HS = 0;
  int64_t nh = 0, nkv = 0;  // heads and groups after the all-to-all (NH / A, NKV / A)
  int64_t Tv = 0;           // rows per sample after the all-to-all (A x T / cp)
  // all_gather: the whole K, V (saved), the gather's scratch and the full dK, dV (context_parallel.h).
  ArenaSlice kv, cp_buf, dkv;
  // a2a: the head-sharded q, k, v, out and lse (saved); the all-to-all's send and receive blocks and
  // the head-sharded gradients (scratch).
  ArenaSlice qkv_h, out_h, lse_h, a2a_buf, dout_h, dqkv_h;
  // p2p: two K, V ring buffers; backward's two dK, dV ones and a partial dK, dV, whose room forward uses
  // for its partial out and lse (scratch): 5 x the rank's K, V rows.
  ArenaSlice ring_buf;

 private:
  int64_t width() const { return (nh + 2 * nkv) * HS; }  // a head-sharded qkv row
  // The ring over the group's heads and chunks: out, lse from qkv (B, Tv, width()); its backward.
  void ring_forward(const Ops& ops, const Arena& arena, float* out, float* lse, const float* qkv,
                    const int32_t* doc_start) const;
  void ring_backward(const Ops& ops, const Arena& arena, float* dqkv, const float* dout, const float* qkv,
                     const float* out, const float* lse, const int32_t* doc_start) const;
  // The all-to-all: the rank's rows (B, T / cp, sections of widths w_s, each split in A parts) to the
  // group's rows of part a2a_rank (B, Tv, sum w_s / A), and back.
  void to_heads(const Ops& ops, const Arena& arena, float* heads, const float* rows,
                const std::vector<int64_t>& sections) const;
  void to_rows(const Ops& ops, const Arena& arena, float* rows, const float* heads,
               const std::vector<int64_t>& sections) const;
  struct Ring;
  Ring ring_start(const Ops& ops, const Arena& arena, const float* qkv) const;
  struct Trade;
  Trade trade(const Arena& arena, const std::vector<int64_t>& sections) const;
};

}  // namespace lockstep
