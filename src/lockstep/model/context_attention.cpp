#include "lockstep/model/context_attention.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "lockstep/comm/communicator.h"
#include "lockstep/core/error.h"
#include "lockstep/kernels/ops.h"
#include "lockstep/tensor/precision.h"

namespace lockstep {

ContextAttention::ContextAttention(const ContextParallel& cp_, Arena& arena, int64_t B_, int64_t Tg_, int64_t NH_,
                                   int64_t NKV_, int64_t HS_, bool token_segments, const ContextAttention* scratch_of)
    : cp(cp_), B(B_), Tg(Tg_), NH(NH_), NKV(NKV_), HS(HS_) {
  const int64_t Tl = cp.local(Tg), N = B * Tl, C3 = (NH + 2 * NKV) * HS;
  if (cp.comm_type == "all_gather") {
    const int64_t KV = 2 * NKV * HS;
    nh = NH, nkv = NKV, Tv = Tl;
    kv = arena.reserve(B * Tg * KV);
    if (scratch_of) {
      cp_buf = scratch_of->cp_buf, dkv = scratch_of->dkv;
    } else {
      // layout_token_segments: two chunks' dK, dV and the pieces' all-to-all (reduce_scatter_dkv_pieces).
      cp_buf = arena.reserve_scratch(token_segments ? dkv_pieces_buffer(cp, B, Tg, NKV, HS) : (B * Tg + N) * KV);
      dkv = arena.reserve_scratch((token_segments ? 2 : 1) * B * Tg * KV);
    }
    return;
  }
  const int64_t A = cp.a2a_size, P = cp.ring_size;
  LOCKSTEP_CHECK(NH % A == 0 && NKV % A == 0, "context attention: ", NH, " heads and ", NKV,
                 " query groups do not split over an all-to-all of ", A);
  nh = NH / A, nkv = NKV / A, Tv = A * Tl;
  if (A > 1) {
    qkv_h = arena.reserve(N * C3);
    out_h = arena.reserve(N * NH * HS);
    lse_h = arena.reserve(B * NH * Tl);
    a2a_buf = scratch_of ? scratch_of->a2a_buf : arena.reserve_scratch(2 * N * C3);
    dout_h = scratch_of ? scratch_of->dout_h : arena.reserve_scratch(N * NH * HS);
    dqkv_h = scratch_of ? scratch_of->dqkv_h : arena.reserve_scratch(N * C3);
  }
  if (P > 1) {
    // kv x 2, then backward's dkv x 2 and partial dkv, where forward keeps its partial out and lse.
    const int64_t n = B * Tv * 2 * nkv * HS;
    ring_buf = scratch_of ? scratch_of->ring_buf
                          : arena.reserve_scratch(2 * n + std::max(3 * n, B * Tv * nh * HS + B * nh * Tv));
  }
}

void ContextAttention::forward(const Ops& ops, const Precision& p, const Arena& arena, float* att, float* lse,
                               const float* qkv, const int32_t* doc_start) const {
  if (cp.comm_type == "all_gather") {
    gather_kv(ops, cp, arena(kv), arena(cp_buf), qkv, B, Tg, NH, NKV, HS);
    ops.attention_forward_chunks(att, lse, qkv, arena(kv), B, Tg, cp.chunks(Tg), NH, NKV, HS, doc_start);
    return;
  }
  const bool a2a = cp.a2a_size > 1;
  const float* q = qkv;
  float *out = att, *l = lse;
  if (a2a) {
    to_heads(ops, arena, arena(qkv_h), qkv, {NH * HS, NKV * HS, NKV * HS});
    q = arena(qkv_h), out = arena(out_h), l = arena(lse_h);
  }
  if (cp.ring_size > 1)
    ring_forward(ops, arena, out, l, q, doc_start);
  else  // the whole sequence of the rank's heads, in position order
    ops.attention_forward(out, l, q, B, Tg, nh, nkv, HS, doc_start);
  p.round(out, B * Tv * nh * HS);
  if (a2a) to_rows(ops, arena, att, out, {NH * HS});
}

void ContextAttention::backward(const Ops& ops, const Arena& arena, float* dqkv, const float* datt, const float* qkv,
                                const float* att, const float* lse, const int32_t* doc_start, int64_t segments) const {
  if (cp.comm_type == "all_gather") {
    // layout_token_segments: each chunk's tree over its query segments, combined exactly over the group.
    ops.attention_backward_chunks(dqkv, arena(dkv), datt, qkv, arena(kv), att, lse, B, Tg, cp.chunks(Tg), NH, NKV, HS,
                                  doc_start, segments);
    if (segments)
      reduce_scatter_dkv_pieces(ops, cp, dqkv, arena(cp_buf), arena(dkv), B, Tg, NH, NKV, HS);
    else
      reduce_scatter_dkv(ops, cp, dqkv, arena(cp_buf), arena(dkv), B, Tg, NH, NKV, HS);
    return;
  }
  const bool a2a = cp.a2a_size > 1;
  const float *q = qkv, *out = att, *l = lse, *dout = datt;
  float* dq = dqkv;
  if (a2a) {
    to_heads(ops, arena, arena(dout_h), datt, {NH * HS});
    q = arena(qkv_h), out = arena(out_h), l = arena(lse_h), dout = arena(dout_h), dq = arena(dqkv_h);
  }
  if (cp.ring_size > 1)
    ring_backward(ops, arena, dq, dout, q, out, l, doc_start);
  else
    ops.attention_backward(dq, dout, q, out, l, B, Tg, nh, nkv, HS, doc_start, segments);
  if (a2a) to_rows(ops, arena, dqkv, dq, {NH * HS, NKV * HS, NKV * HS});
}

// The ring's geometry and buffers: this rank's keys and values (its chunks of qkv) copied into cur.
struct ContextAttention::Ring {
  int P, o, next, prev;
  int64_t KV, n;  // a K, V row; the rank's K, V floats
  float *cur, *other;
  QueryChunks mine;
};

ContextAttention::Ring ContextAttention::ring_start(const Ops& ops, const Arena& arena, const float* qkv) const {
  const int P = cp.ring_size, o = cp.ring_rank;
  const int64_t KV = 2 * nkv * HS, n = B * Tv * KV;
  float* cur = arena(ring_buf);
  ops.copy_rows(cur, KV, qkv + nh * HS, width(), B * Tv, KV);
  return Ring{P, o, (o + 1) % P, (o + P - 1) % P, KV, n, cur, cur + n, cp.ring_chunks(Tg, P, o)};
}

void ContextAttention::ring_forward(const Ops& ops, const Arena& arena, float* out, float* lse, const float* qkv,
                                    const int32_t* doc_start) const {
  Ring r = ring_start(ops, arena, qkv);
  const int P = r.P, o = r.o;
  const int64_t n = r.n;
  float *&cur = r.cur, *&other = r.other;
  float* part_out = cur + 2 * n;
  float* part_lse = part_out + B * Tv * nh * HS;
  const QueryChunks& mine = r.mine;
  ops.fill(out, B * Tv * nh * HS, 0.0f);
  ops.fill(lse, B * nh * Tv, -std::numeric_limits<float>::infinity());
  // Step i: the keys and values of ring rank o - i, while those of o - i - 1 arrive.
  for (int i = 0; i < P; ++i) {
    Work arriving;
    if (i + 1 < P) arriving = cp.ring->send_recv_async(cur, n, r.next, other, n, r.prev);
    const QueryChunks keys = cp.ring_chunks(Tg, P, (o - i + P) % P);
    ops.attention_forward_partial(part_out, part_lse, qkv, cur, B, Tg, mine, keys, nh, nkv, HS, doc_start);
    ops.attention_merge(out, lse, part_out, part_lse, B, Tv, nh, HS);
    if (i + 1 < P) arriving.wait(), std::swap(cur, other);
  }
}

void ContextAttention::ring_backward(const Ops& ops, const Arena& arena, float* dqkv, const float* dout,
                                     const float* qkv, const float* out, const float* lse,
                                     const int32_t* doc_start) const {
  Ring r = ring_start(ops, arena, qkv);
  const int P = r.P, o = r.o, next = r.next, prev = r.prev;
  const int64_t KV = r.KV, n = r.n;
  float *&cur = r.cur, *&other = r.other;
  float* dcur = cur + 2 * n;
  float* dother = cur + 3 * n;
  float* part = cur + 4 * n;
  const QueryChunks& mine = r.mine;
  ops.fill(dqkv, B * Tv * width(), 0.0f);  // dq accumulates over the steps; dK, dV are written last
  // Step i: ring rank o - i's keys and values (the next arriving) and their dK, dV so far (the ranks
  // o - i .. o - 1's parts, in that order), to which this rank adds its part and passes them on.
  Work arriving, grads;
  for (int i = 0; i < P; ++i) {
    if (i + 1 < P) arriving = cp.ring->send_recv_async(cur, n, next, other, n, prev);
    const QueryChunks keys = cp.ring_chunks(Tg, P, (o - i + P) % P);
    ops.attention_backward_partial(dqkv, part, dout, qkv, cur, out, lse, B, Tg, mine, keys, nh, nkv, HS, doc_start);
    if (i == 0) {
      ops.copy(dcur, part, n);
    } else {
      grads.wait(), std::swap(dcur, dother);
      ops.add(dcur, dcur, part, n);
    }
    grads = cp.ring->send_recv_async(dcur, n, next, dother, n, prev);
    if (i + 1 < P) arriving.wait(), std::swap(cur, other);
  }
  grads.wait();  // this rank's own dK, dV, every rank's part added, arrive last
  ops.copy_rows(dqkv + nh * HS, width(), dother, KV, B * Tv, KV);
}

namespace {
// The all-to-all's rows: block i (rank i of the group, B x T / cp rows) <-> the group's rows (B, Tv).
// In each unit (the sample, or each packed document: ContextParallel::units) of cp chunks of c
// positions, rank i holds its early then its late chunk (c rows each); the group holds its ranks'
// early chunks back to back (rank 0 first), then their late ones (rank A - 1 first): the group's own
// early and late chunk of the unit, as a ring of cp / A cuts it.
struct RowBlocks {
  std::vector<int64_t> block_row, group_row, rows;
  RowBlocks(const ContextParallel& cp, int64_t A, int64_t B, int64_t Tg) {
    const int64_t Tl = cp.local(Tg), Tv = A * Tl;
    std::vector<int64_t> unit_len;
    if (cp.units && !cp.units->bounds.empty())
      for (size_t k = 0; k + 1 < cp.units->bounds.size(); ++k)
        unit_len.push_back(cp.units->bounds[k + 1] - cp.units->bounds[k]);
    else
      unit_len.push_back(Tg);
    for (int64_t i = 0; i < A; ++i)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t at = 0, at_v = 0; int64_t len : unit_len) {
          const int64_t c = len / (2 * cp.size);
          block_row.insert(block_row.end(), {(i * B + b) * Tl + at, (i * B + b) * Tl + at + c});
          group_row.insert(group_row.end(), {b * Tv + at_v + i * c, b * Tv + at_v + A * c + (A - 1 - i) * c});
          rows.insert(rows.end(), {c, c});
          at += 2 * c, at_v += 2 * A * c;
        }
  }
  int64_t blocks() const { return static_cast<int64_t>(rows.size()); }
};
}  // namespace

// The all-to-all's blocks: A of n = (B x T / cp rows) x (W / A) floats each, sent and received, and the
// column parts of the rank's rows (section s's part j: its columns [j w_s / A, (j + 1) w_s / A)) that
// block j holds back to back.
struct ContextAttention::Trade {
  int64_t A, N, W, n;
  float *send, *recv;
  const std::vector<int64_t>& sections;
  // f(offset in the rank's rows, offset in a block, width) for each section's part of block j.
  template <class F>
  void parts(int64_t j, F&& f) const {
    for (int64_t off = 0, off_h = 0; int64_t w : sections) {
      f(off + j * (w / A), off_h, w / A);
      off += w, off_h += w / A;
    }
  }
};

ContextAttention::Trade ContextAttention::trade(const Arena& arena, const std::vector<int64_t>& sections) const {
  const int64_t A = cp.a2a_size, N = B * cp.local(Tg);
  int64_t W = 0;
  for (int64_t w : sections) W += w;
  float* send = arena(a2a_buf);
  return Trade{A, N, W, N * (W / A), send, send + A * N * (W / A), sections};
}

void ContextAttention::to_heads(const Ops& ops, const Arena& arena, float* heads, const float* rows,
                                const std::vector<int64_t>& sections) const {
  const Trade t = trade(arena, sections);
  for (int64_t j = 0; j < t.A; ++j)
    t.parts(j, [&](int64_t at, int64_t at_h, int64_t w) {
      ops.copy_rows(t.send + j * t.n + at_h, t.W / t.A, rows + at, t.W, t.N, w);
    });
  cp.a2a->all_to_all(t.recv, t.send, t.n);
  const RowBlocks rb(cp, t.A, B, Tg);
  ops.copy_row_blocks(heads, rb.group_row.data(), t.recv, rb.block_row.data(), rb.rows.data(), rb.blocks(), t.W / t.A);
}

void ContextAttention::to_rows(const Ops& ops, const Arena& arena, float* rows, const float* heads,
                               const std::vector<int64_t>& sections) const {
  const Trade t = trade(arena, sections);
  const RowBlocks rb(cp, t.A, B, Tg);
  ops.copy_row_blocks(t.send, rb.block_row.data(), heads, rb.group_row.data(), rb.rows.data(), rb.blocks(), t.W / t.A);
  cp.a2a->all_to_all(t.recv, t.send, t.n);
  for (int64_t j = 0; j < t.A; ++j)
    t.parts(j, [&](int64_t at, int64_t at_h, int64_t w) {
      ops.copy_rows(rows + at, t.W, t.recv + j * t.n + at_h, t.W / t.A, t.N, w);
    });
}

}  // namespace lockstep
