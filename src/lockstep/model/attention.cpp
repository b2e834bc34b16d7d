#include "lockstep/model/attention.h"

#include <cmath>

#include "lockstep/kernels/cpu/attention.h"
#include "lockstep/kernels/cpu/rope.h"
#include "lockstep/model/precision.h"
#include "lockstep/model/trace.h"

namespace lockstep {

AttentionLayer::AttentionLayer(ParamStore& ps, Arena& arena, const std::string& prefix,
                               const ModelConfig& m, int64_t B_, int64_t T_)
    : B(B_), T(T_), C(m.hidden_size), NH(m.num_heads), NKV(m.query_groups()), HS(m.head_dim()),
      rope(m.position_embedding == "rope") {
  const int64_t N = B * T;
  const float std = static_cast<float>(m.init_std);
  // Residual projections start smaller so the residual stream's variance does not grow with
  // depth (GPT-2, Megatron's scaled init): std / sqrt(2 * layers).
  const float out_std = static_cast<float>(m.init_std / std::sqrt(2.0 * static_cast<double>(m.num_layers)));
  norm = Norm(ps, arena, prefix + "attn_norm", m.normalization == "rmsnorm", C, N, static_cast<float>(m.norm_eps));
  qkv = Linear(ps, prefix + "attn.qkv", C, qkv_width(), m.bias, std);
  proj = Linear(ps, prefix + "attn.proj", NH * HS, C, m.bias, out_std);
  core_name = prefix + "attn.core";
  normed = arena.reserve(N * C);
  qkv_out = arena.reserve(N * qkv_width());
  att = arena.reserve(N * NH * HS);
  lse = arena.reserve(B * NH * T);
}

void AttentionLayer::forward(const ParamStore& ps, const Arena& arena, float* resid_out,
                             const float* resid_in, const float* rope_cos, const float* rope_sin,
                             const int32_t* positions, const int32_t* doc_start) const {
  const int64_t N = B * T;
  norm.forward(ps, arena, arena(normed), resid_in, N);
  qkv.forward(ps, arena(qkv_out), arena(normed), N);
  const Precision& p = ps.precision();
  if (rope) {
    rope_forward(arena(qkv_out), rope_cos, rope_sin, N, T, NH + NKV, HS, qkv_width(), positions);
    p.round(arena(qkv_out), N * qkv_width());
  }
  attention_forward(arena(att), arena(lse), arena(qkv_out), B, T, NH, NKV, HS, doc_start);
  p.round(arena(att), N * NH * HS);
  trace_out(core_name, arena(att), N * NH * HS);
  proj.forward_residual(ps, resid_out, resid_in, arena(att), N);
}

void AttentionLayer::backward(const ParamStore& ps, const Arena& arena, float* dresid,
                              const float* resid_in, const float* rope_cos, const float* rope_sin,
                              const AttentionScratch& s, const int32_t* positions,
                              const int32_t* doc_start) const {
  const int64_t N = B * T;
  proj.backward(ps, s.datt, dresid, arena(att), N);
  attention_backward(s.dqkv, s.datt, arena(qkv_out), arena(att), arena(lse), B, T, NH, NKV, HS, doc_start);
  if (rope) rope_backward(s.dqkv, rope_cos, rope_sin, N, T, NH + NKV, HS, qkv_width(), positions);
  ps.precision().round(s.dqkv, N * qkv_width());
  trace_grad_in(core_name, s.dqkv, N * qkv_width());
  qkv.backward(ps, s.dnorm, s.dqkv, arena(normed), N);
  norm.backward(ps, arena, dresid, s.dnorm, resid_in, N);
}

}  // namespace lockstep
