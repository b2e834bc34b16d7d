#include "lockstep/model/attention.h"

#include <cmath>

#include "lockstep/comm/communicator.h"
#include "lockstep/core/trace.h"
#include "lockstep/core/tree_sum.h"
#include "lockstep/kernels/device.h"
#include "lockstep/tensor/precision.h"

namespace lockstep {

RopeScaling rope_scaling_of(const ModelConfig& m) {
  RopeScaling s;  // factor 1: none
  if (m.rope_scaling == "none") return s;
  s.factor = m.rope_scaling_factor;
  s.original_max_position = static_cast<double>(m.rope_original_max_position_embeddings);
  s.low_freq_factor = m.rope_low_freq_factor;
  s.high_freq_factor = m.rope_high_freq_factor;
  s.yarn = m.rope_scaling == "yarn";
  s.beta_fast = m.rope_yarn_beta_fast;
  s.beta_slow = m.rope_yarn_beta_slow;
  s.mscale = m.rope_yarn_mscale;
  s.mscale_all_dim = m.rope_yarn_mscale_all_dim;
  return s;
}

AttentionLayer::AttentionLayer(ParamStore& ps, Arena& arena, const std::string& prefix, const ModelConfig& m,
                               int64_t B_, int64_t T_, const TensorParallel& tp_, const ContextParallel& cp_,
                               const AttentionLayer* scratch_of)
    : B(B_),
      T(T_),
      C(m.hidden_size),
      NH(m.num_heads / tp_.size),
      NKV(m.query_groups() / tp_.size),
      HS(m.head_dim()),
      Tg(T_ * cp_.size),
      rope(m.position_embedding == "rope"),
      tp(tp_),
      cp(cp_) {
  const int64_t N = B * T;
  const float std = static_cast<float>(m.init_std);
  // Residual projections start smaller so the residual stream's variance does not grow with
  // depth (GPT-2, Megatron's scaled init): std / sqrt(2 * layers).
  const float out_std = static_cast<float>(m.init_std / std::sqrt(2.0 * static_cast<double>(m.num_layers)));
  norm = Norm(ps, arena, prefix + "attn_norm", m.normalization == "rmsnorm", C, tp.rows(N),
              static_cast<float>(m.norm_eps));
  if (tp.sequence) norm.set_sequence_parallel(ps);
  const int64_t q = m.num_heads * HS, kv = m.query_groups() * HS;
  if (m.multi_latent_attention)
    mla = LatentProjections(ps, arena, prefix, m, N, NH, tp, scratch_of ? &scratch_of->mla : nullptr);
  else
    qkv = Linear::column(ps, tp, prefix + "attn.qkv", C, {q, kv, kv}, m.bias || m.add_qkv_bias, std);
  if (m.qk_layernorm) {
    qk_norm = true;
    const float eps = static_cast<float>(m.norm_eps);
    q_norm = Norm(ps, arena, prefix + "attn.q_norm", true, HS, N * NH, eps);
    k_norm = Norm(ps, arena, prefix + "attn.k_norm", true, HS, N * NKV, eps);
    // Every tensor-parallel rank normalises its own heads: under "run" the weights' gradients are
    // partial sums over the group; under "layout" whole (head_norm_backward).
    if (tp.on() && !tp.layout()) q_norm.set_sequence_parallel(ps), k_norm.set_sequence_parallel(ps);
    if (tp.layout()) {
      const int64_t S = tp.segments, heads = std::max(NH, NKV) * tp.size;
      head_rows = scratch_of && scratch_of->qk_norm ? scratch_of->head_rows : arena.reserve_scratch(3 * N * HS + N);
      head_sums = scratch_of && scratch_of->qk_norm ? scratch_of->head_sums
                                                    : arena.reserve_scratch((heads + heads / tp.size + 1) * S * HS);
    }
    qk_in = arena.reserve(N * (NH + NKV) * HS);
    qk_tmp = scratch_of && scratch_of->qk_norm ? scratch_of->qk_tmp : arena.reserve_scratch(2 * N * (NH + NKV) * HS);
  }
  proj = Linear::row(ps, tp, prefix + "attn.proj", m.num_heads * m.value_dim(), C, m.bias, out_std);
  if (mla.on()) {
    att_c = arena.reserve(N * mla.out_width());
    datt_full = scratch_of && scratch_of->mla.on() ? scratch_of->datt_full : arena.reserve_scratch(N * NH * HS);
  }
  core_name = prefix + "attn.core";
  normed = arena.reserve(tp.rows(N) * C);
  qkv_out = arena.reserve(N * qkv_width());
  att = arena.reserve(N * NH * HS);
  lse = arena.reserve(B * NH * T);
  if (tp.on()) partial = arena.reserve(N * C);
  if (tp.sequence) gathered = arena.reserve(N * C);
  if (cp.on())
    context = ContextAttention(cp, arena, B, Tg, NH, NKV, HS, tp.token_segments,
                               scratch_of && scratch_of->cp.on() ? &scratch_of->context : nullptr);
}

void AttentionLayer::forward(const ParamStore& ps, const Arena& arena, float* resid_out, const float* resid_in,
                             const float* rope_cos, const float* rope_sin, const int32_t* positions,
                             const int32_t* doc_start) const {
  const int64_t N = B * T;
  norm.forward(ps, arena, arena(normed), resid_in, tp.rows(N));
  const float* x = enter_column_parallel(tp, tp.sequence ? arena(gathered) : nullptr, arena(normed), N, C);
  const Precision& p = ps.precision();
  if (mla.on())
    mla.forward(ps, arena, arena(qkv_out), x, rope_cos, rope_sin, Tg, positions);
  else
    qkv.forward(ps, arena(qkv_out), x, N);
  if (qk_norm) {
    const Ops& ops = ps.device().ops;
    float *in = arena(qk_in), *out = arena(qk_tmp);
    gather_qk(ops, in, arena(qkv_out));
    q_norm.forward(ps, arena, out, in, N * NH);
    k_norm.forward(ps, arena, out + N * NH * HS, in + N * NH * HS, N * NKV);
    scatter_qk(ops, arena(qkv_out), out);
  }
  if (rope && !mla.on()) {
    ps.device().ops.rope_forward(arena(qkv_out), rope_cos, rope_sin, N, Tg, NH + NKV, HS, qkv_width(), positions);
    p.round(arena(qkv_out), N * qkv_width());
  }
  if (cp.on()) {
    context.forward(ps.device().ops, p, arena, arena(att), arena(lse), arena(qkv_out), doc_start);
  } else {
    ps.device().ops.attention_forward(arena(att), arena(lse), arena(qkv_out), B, T, NH, NKV, HS, doc_start);
  }
  p.round(arena(att), N * NH * HS);
  trace_out(core_name, arena(att), N * NH * HS);
  const float* heads = arena(att);
  if (mla.on()) mla.compact(ps.device().ops, arena(att_c), heads), heads = arena(att_c);
  proj.forward_residual(ps, tp, resid_out, resid_in, heads, N, tp.on() ? arena(partial) : nullptr);
}

void AttentionLayer::backward(const ParamStore& ps, const Arena& arena, float* dresid, const float* resid_in,
                              const float* rope_cos, const float* rope_sin, const AttentionScratch& s,
                              const int32_t* positions, const int32_t* doc_start) const {
  const int64_t N = B * T;
  // The full output gradient (gathered into dnorm, free until qkv's backward).
  const float* dy = leave_row_parallel_backward(tp, s.dnorm, dresid, N, C);
  proj.backward(ps, s.datt, dy, mla.on() ? arena(att_c) : arena(att), N);
  const float* datt = s.datt;
  if (mla.on()) mla.expand(ps.device().ops, arena(datt_full), s.datt), datt = arena(datt_full);
  if (cp.on()) {
    // layout_token_segments: dK, dV in the sequence's token segments, S / B per sample.
    context.backward(ps.device().ops, arena, s.dqkv, datt, arena(qkv_out), arena(att), arena(lse), doc_start,
                     tp.token_segments ? tp.segments / B : 0);
  } else {
    // layout_token_segments: dK, dV in the micro-batch's token segments, S / B per sample.
    ps.device().ops.attention_backward(s.dqkv, datt, arena(qkv_out), arena(att), arena(lse), B, T, NH, NKV, HS,
                                       doc_start, tp.token_segments ? tp.segments / B : 0);
  }
  if (mla.on()) {
    // The latent projections undo RoPE themselves; their input gradient is this rank's part.
    trace_grad_in(core_name, s.dqkv, N * qkv_width());
    const float* x = tp.sequence ? arena(gathered) : arena(normed);
    mla.backward(ps, arena, s.dnorm, s.dqkv, x, rope_cos, rope_sin, Tg, positions);
    norm.backward(ps, arena, dresid, enter_column_parallel_backward(tp, s.datt, s.dnorm, N, C), resid_in, tp.rows(N));
    return;
  }
  if (rope) ps.device().ops.rope_backward(s.dqkv, rope_cos, rope_sin, N, Tg, NH + NKV, HS, qkv_width(), positions);
  ps.precision().round(s.dqkv, N * qkv_width());
  trace_grad_in(core_name, s.dqkv, N * qkv_width());
  if (qk_norm) {
    const Ops& ops = ps.device().ops;
    const int64_t heads = N * (NH + NKV) * HS;
    float *dout = arena(qk_tmp), *din = dout + heads;
    const float* in = arena(qk_in);
    gather_qk(ops, dout, s.dqkv);
    ops.fill(din, heads, -0.0f);  // backward adds into it; -0 is the identity of that sum
    if (tp.layout()) {
      head_norm_backward(ps, arena, k_norm, din + N * NH * HS, dout + N * NH * HS, in + N * NH * HS, NKV);
      head_norm_backward(ps, arena, q_norm, din, dout, in, NH);
    } else {
      k_norm.backward(ps, arena, din + N * NH * HS, dout + N * NH * HS, in + N * NH * HS, N * NKV);
      q_norm.backward(ps, arena, din, dout, in, N * NH);
    }
    scatter_qk(ops, s.dqkv, din);
  }
  const float* dnorm = qkv.backward(ps, tp, s.datt, s.dnorm, s.dqkv, tp.sequence ? arena(gathered) : arena(normed), N);
  norm.backward(ps, arena, dresid, dnorm, resid_in, tp.rows(N));
}

void AttentionLayer::head_norm_backward(const ParamStore& ps, const Arena& arena, const Norm& n, float* din,
                                        const float* dout, const float* in, int64_t heads) const {
  const Ops& ops = ps.device().ops;
  const int64_t N = B * T, K = ps.token_pieces(n.w), tokens = N / K, G = tp.size;
  float* dout_h = arena(head_rows);
  float* in_h = dout_h + N * HS;
  float* din_h = in_h + N * HS;
  float* rstd_h = din_h + N * HS;
  const float* rstd = arena(n.rstd);
  for (int64_t k = 0; k < K; ++k) {
    const std::vector<int64_t> bounds = canonical_segments(tokens, ps.token_segments(n.w));
    const int64_t S = std::max<int64_t>(1, static_cast<int64_t>(bounds.size()) - 1);
    // own: (S, heads, HS) this rank's heads' sums per segment; all: (G, S, heads, HS) the group's;
    // leaves: (S, HS) the segments' sums over all heads.
    float* all = arena(head_sums);
    float* own = G > 1 ? all + G * S * heads * HS : all;
    float* leaves = own + S * heads * HS;
    ops.fill(own, S * heads * HS, 0.0f);
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t r0 = k * tokens * heads + h;  // the piece's first row of head h; rows `heads` apart
      ops.copy_rows(dout_h, HS, dout + r0 * HS, heads * HS, tokens, HS);
      ops.copy_rows(in_h, HS, in + r0 * HS, heads * HS, tokens, HS);
      ops.copy_rows(rstd_h, 1, rstd + r0, heads, tokens, 1);
      ops.fill(din_h, tokens * HS, -0.0f);
      for (int64_t s = 0; s < S; ++s) {
        const int64_t b0 = bounds.empty() ? 0 : bounds[s], b1 = bounds.empty() ? tokens : bounds[s + 1];
        ops.rmsnorm_backward(din_h + b0 * HS, own + (s * heads + h) * HS, dout_h + b0 * HS, in_h + b0 * HS,
                             ps.weight(n.w), rstd_h + b0, b1 - b0, HS, 0);
      }
      ops.copy_rows(din + r0 * HS, heads * HS, din_h, HS, tokens, HS);
    }
    if (G > 1) tp.comm->all_gather(all, own, S * heads * HS);
    // Segment s: the group's heads in head order (rank r's heads after rank r - 1's), into leaf s.
    for (int64_t s = 0; s < S; ++s) {
      float* leaf = leaves + s * HS;
      ops.copy(leaf, all + s * heads * HS, HS);
      for (int64_t h = 1; h < G * heads; ++h)
        ops.add(leaf, leaf, all + (((h / heads) * S + s) * heads + h % heads) * HS, HS);
    }
    // The canonical tree over the segments, added to the piece's gradient.
    auto tree = [&](auto&& self, float* x, int64_t L) -> void {
      if (L <= 1) return;
      const int64_t half = canonical_split(L);
      self(self, x, half);
      self(self, x + half * HS, L - half);
      ops.add(x, x, x + half * HS, HS);
    };
    tree(tree, leaves, S);
    float* g = ps.grad_piece(n.w, k);
    ops.add(g, g, leaves, HS);
  }
  ps.precision().round(din, N * heads * HS);
  trace_grad_in(n.name, din, N * heads * HS);
}

void AttentionLayer::gather_qk(const Ops& ops, float* heads, const float* rows) const {
  const int64_t N = B * T;
  ops.copy_rows(heads, NH * HS, rows, qkv_width(), N, NH * HS);
  ops.copy_rows(heads + N * NH * HS, NKV * HS, rows + NH * HS, qkv_width(), N, NKV * HS);
}

void AttentionLayer::scatter_qk(const Ops& ops, float* rows, const float* heads) const {
  const int64_t N = B * T;
  ops.copy_rows(rows, qkv_width(), heads, NH * HS, N, NH * HS);
  ops.copy_rows(rows + NH * HS, qkv_width(), heads + N * NH * HS, NKV * HS, N, NKV * HS);
}

}  // namespace lockstep
