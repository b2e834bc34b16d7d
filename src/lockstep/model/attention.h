// The attention sublayer: norm -> fused QKV projection -> QK layernorm (model.qk_layernorm: RMSNorm
// of each query and key head, one weight of head size for the queries and one for the keys, as
// Qwen3) -> RoPE (llama) -> causal GQA attention -> output projection, added to the residual stream.
// Multi-head latent attention (model.multi_latent_attention, model/mla.h) replaces the QKV
// projection and RoPE with its latent projections; the core and the output projection stay. Tensor parallelism
// (parallel/tensor_parallel.h): QKV column-parallel (this rank's heads and KV groups), proj row-parallel; with sequence
// parallelism the norm and the residual stream hold this rank's rows only. Context parallelism
// (parallel/context_parallel.h): the layer holds T = seq_length / cp positions per sample (its
// rank's two chunks); the attention core crosses the group as parallel.cp_comm_type says
// (model/context_attention.h).
#pragma once

#include <string>
#include <vector>

#include "lockstep/config/config.h"
#include "lockstep/kernels/rope.h"
#include "lockstep/model/arena.h"
#include "lockstep/model/context_attention.h"
#include "lockstep/model/linear.h"
#include "lockstep/model/mla.h"
#include "lockstep/model/norm.h"
#include "lockstep/parallel/context_parallel.h"

namespace lockstep {

// The model's RoPE frequency scaling (kernels/rope.h) from its model.rope_* keys.
RopeScaling rope_scaling_of(const ModelConfig& m);

struct AttentionScratch {
  float* dnorm;  // (N, C)
  float* datt;   // (N, max(C, NH x HS)) (under sequence parallelism also the gathered output gradient)
  float* dqkv;   // (N, QKV)
};

struct AttentionLayer {
  AttentionLayer() = default;
  AttentionLayer(ParamStore& ps, Arena& arena, const std::string& prefix, const ModelConfig& m, int64_t B, int64_t T,
                 const TensorParallel& tp = TensorParallel{}, const ContextParallel& cp = ContextParallel{},
                 const AttentionLayer* scratch_of = nullptr);

  // resid_out (N, C) = resid_in + proj(attention(qkv(norm(resid_in)))) (this rank's rows under
  // sequence parallelism).
  // positions (N) (RoPE) and doc_start (B, T) (attention): packed documents (data/documents.h);
  // null = plain positions and causal attention. Context parallelism: positions are the rows'
  // global positions (never null) and doc_start is over the whole sequence (B, seq_length).
  void forward(const ParamStore& ps, const Arena& arena, float* resid_out, const float* resid_in, const float* rope_cos,
               const float* rope_sin, const int32_t* positions = nullptr, const int32_t* doc_start = nullptr) const;
  // dresid (N, C) holds d(resid_out) and receives d(resid_in) (the skip passes it through; the
  // branch adds its part).
  void backward(const ParamStore& ps, const Arena& arena, float* dresid, const float* resid_in, const float* rope_cos,
                const float* rope_sin, const AttentionScratch& s, const int32_t* positions = nullptr,
                const int32_t* doc_start = nullptr) const;

  int64_t qkv_width() const { return (NH + 2 * NKV) * HS; }

  Norm norm;
  Linear qkv, proj;
  bool qk_norm = false;
  Norm q_norm, k_norm;    // over (N x NH) and (N x NKV) rows of HS, token-major
  LatentProjections mla;  // multi-head latent attention: in place of qkv (and of RoPE)
  std::string core_name;  // "<prefix>attn.core": RoPE + attention, for the trace (core/trace.h)
  // The names forward traces, in order (core/trace.h).
  void trace_names(std::vector<std::string>& out) const {
    out.push_back(norm.name);
    if (mla.on())
      mla.trace_names(out);
    else
      out.push_back(qkv.name);
    if (qk_norm) out.insert(out.end(), {q_norm.name, k_norm.name});
    out.insert(out.end(), {core_name, proj.name});
  }
  int64_t B = 0, T = 0, C = 0, NH = 0, NKV = 0, HS = 0;  // NH, NKV: this rank's heads and KV groups
  int64_t Tg = 0;                                        // positions per sample of the whole sequence (T x cp)
  bool rope = false;
  TensorParallel tp;
  ContextParallel cp;
  // Context parallelism: the attention core across the cp group, by parallel.cp_comm_type (its scratch
  // shared with the constructor's scratch_of).
  ContextAttention context;
  ArenaSlice normed, qkv_out, att, lse;  // saved for backward
  ArenaSlice gathered, partial;          // tensor parallelism: the gathered norm output, proj's partial sums
  ArenaSlice att_c, datt_full;           // MLA: the output heads without padding (saved); its gradient padded
  ArenaSlice qk_in;                      // QK layernorm: the queries' and keys' heads before it, saved
  ArenaSlice qk_tmp;                     // QK layernorm: their normalised values or gradients (scratch)
  // QK layernorm: copies the query and key heads of qkv_out's rows (stride qkv_width) to or from a
  // buffer of (N x NH) query rows then (N x NKV) key rows.
  void gather_qk(const Ops& ops, float* heads, const float* rows) const;
  void scatter_qk(const Ops& ops, float* rows, const float* heads) const;
  // QK layernorm under determinism = "layout": a norm's backward over (N x heads) token-major rows
  // (heads: this rank's) with its weight's gradient taken head by head, so that tensor parallelism,
  // which splits the heads, keeps one process's bits: in each token segment (per token piece), each
  // head's rows summed in token order, those sums added over all the group's heads in head order
  // (all-gathered), then the canonical tree over the segments. Every rank gets the whole gradient.
  void head_norm_backward(const ParamStore& ps, const Arena& arena, const Norm& n, float* din, const float* dout,
                          const float* in, int64_t heads) const;
  ArenaSlice head_rows, head_sums;  // its scratch: one head's rows, the segments' per-head sums
};

}  // namespace lockstep
