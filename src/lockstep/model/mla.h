// Multi-head latent attention's projections (DeepSeek-V2/V3; Megatron's --multi-latent-attention),
// the part of the attention sublayer (model/attention.h) that MLA replaces: from the normed input x
// (N, C) to the queries, keys and values the attention core reads, and back.
//
//   queries:  q_lora_rank > 0: cq = RMSNorm(x Wq_down^T) (q_lora), q = cq Wq_up^T; else q = x Wq^T;
//             each head's q is [q_nope (qk_head_dim) | q_pe (qk_pos_emb_head_dim)]
//   keys, values: [c | k_pe] = x Wkv_down^T (kv_lora + pe), c' = RMSNorm(c),
//             [k_nope_h | v_h] = (c' Wkv_up^T)_h per head (qk_head_dim + v_head_dim)
//   RoPE on q_pe and on k_pe, which is one per token, shared by every head (decoupled RoPE)
//   k_h = [k_nope_h | rope(k_pe)], scale 1 / sqrt(qk_head_dim + qk_pos_emb_head_dim)
//
// The attention core takes one head size D = qk_head_dim + qk_pos_emb_head_dim for queries, keys
// and values, so the values are laid out padded with zeros from v_head_dim to D: qkv_out rows are
// [NH query heads | NH key heads | NH value heads], D floats each (the layout of the standard
// attention with NKV = NH), and the core's output heads carry zeros past v_head_dim, which
// compact() drops before the output projection (NH x v_head_dim inputs). The cost is the padded
// part of P V (D / v_head_dim more work there: 1.5x for DeepSeek-V3's 192 / 128).
//
// Tensor parallelism: Wq / Wq_up and Wkv_up are column-parallel by heads, the output projection
// row-parallel; Wq_down, Wkv_down and the two latent norms are replicated. Under determinism = "run"
// each rank's gradients of them come from its own heads only (partial sums over the group:
// GradRole::sequence_parallel), as does its input gradient, summed over the group by the caller
// with the rest (enter_column_parallel_backward). Under "layout" the sums over heads are taken
// first, in one process's order whatever the group: the latents' gradients are the up projections'
// column-parallel input gradients (their canonical K segments, reduced over the group), the shared
// k_pe's is the sum of all heads' in head order (their parts all-gathered), so every rank computes
// the down projections' and the norms' whole gradients (replicated parameters), and the input
// gradient, whole, is passed on by tp rank 0 (-0 from the others, the identity of the caller's
// sum).
#pragma once

#include <string>
#include <vector>

#include "lockstep/config/config.h"
#include "lockstep/model/arena.h"
#include "lockstep/model/linear.h"
#include "lockstep/model/norm.h"
#include "lockstep/parallel/tensor_parallel.h"

namespace lockstep {

struct LatentProjections {
  LatentProjections() = default;
  // N rows; NH: this rank's heads. scratch_of: another layer's, whose scratch this one shares.
  LatentProjections(ParamStore& ps, Arena& arena, const std::string& prefix, const ModelConfig& m, int64_t N,
                    int64_t NH, const TensorParallel& tp, const LatentProjections* scratch_of);

  bool on() const { return N > 0; }
  int64_t qkv_width() const { return 3 * NH * D; }
  int64_t out_width() const { return NH * DV; }  // the output projection's input: NH x v_head_dim

  // qkv_out (N, qkv_width()) = the queries, keys and padded values of x (N, C), RoPE applied at
  // position row % T or positions[row] (kernels/rope.h; cos, sin: (T, pe / 2)).
  void forward(const ParamStore& ps, const Arena& arena, float* qkv_out, const float* x, const float* cos,
               const float* sin, int64_t T, const int32_t* positions) const;
  // att_c (N, out_width()) = the value part of each head of att (N, NH x D); and its backward,
  // datt (N, NH x D) with zeros past v_head_dim.
  void compact(const Ops& ops, float* att_c, const float* att) const;
  void expand(const Ops& ops, float* datt, const float* datt_c) const;
  // dqkv (N, qkv_width()): the attention core's input gradient (RoPE not yet undone; used as
  // scratch). dx (N, C) = this rank's partial input gradient (assigned); parameter gradients
  // accumulate.
  void backward(const ParamStore& ps, const Arena& arena, float* dx, float* dqkv, const float* x, const float* cos,
                const float* sin, int64_t T, const int32_t* positions) const;

  void trace_names(std::vector<std::string>& out) const;
  // q (N, NH D) *= q_scale.
  void scale_queries(const Ops& ops, const Arena& arena, float* q) const;

  int64_t N = 0, C = 0, NH = 0;
  int64_t DN = 0, DR = 0, DV = 0, D = 0;  // qk_head_dim, qk_pos_emb_head_dim, v_head_dim, DN + DR
  int64_t QL = 0, KL = 0;                 // q_lora_rank (0: no query compression), kv_lora_rank
  // YaRN with rope_yarn_mscale_all_dim (DeepSeek): the softmax scale's extra factor m^2, applied to
  // the queries (scores are linear in them); 1 otherwise.
  float q_scale = 1.0f;
  Linear q, q_down, q_up, kv_down, kv_up;
  Norm q_norm, kv_norm;
  ArenaSlice cq, cq_n, c, c_n;  // saved: the latents before and after their norms
  ArenaSlice scratch;  // q (N, NH D) | kv (N, NH (DN + DV)) | d latents | dx part | dk_pe x 2 | q_scale (N, NH D)
  // determinism = "layout" under tensor parallelism (above): the group without sequence parallelism,
  // and the all-gathered heads' k_pe gradients (tp x (N, NH DR)).
  bool whole_latents = false;
  TensorParallel group;
  ArenaSlice pe_parts;
};

}  // namespace lockstep
