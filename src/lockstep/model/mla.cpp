#include "lockstep/model/mla.h"

#include <algorithm>
#include <cmath>

#include "lockstep/comm/communicator.h"
#include "lockstep/kernels/device.h"
#include "lockstep/kernels/rope.h"
#include "lockstep/tensor/precision.h"

namespace lockstep {

LatentProjections::LatentProjections(ParamStore& ps, Arena& arena, const std::string& prefix, const ModelConfig& m,
                                     int64_t N_, int64_t NH_, const TensorParallel& tp,
                                     const LatentProjections* scratch_of)
    : N(N_),
      C(m.hidden_size),
      NH(NH_),
      DN(m.qk_head_dim),
      DR(m.qk_pos_emb_head_dim),
      DV(m.v_head_dim),
      D(m.qk_head_dim + m.qk_pos_emb_head_dim),
      QL(m.q_lora_rank),
      KL(m.kv_lora_rank) {
  const float std = static_cast<float>(m.init_std), eps = static_cast<float>(m.norm_eps);
  const int64_t heads = m.num_heads;
  // Replicated over the tensor-parallel group; under "run" with gradients from this rank's heads only.
  whole_latents = tp.on() && tp.layout();
  group = tp;
  group.sequence = false;
  const bool partial = tp.on() && !whole_latents;
  auto replicated = [&](Linear& l) {
    if (partial) ps.set_sequence_parallel(l.w);
  };
  if (QL > 0) {
    q_down = Linear(ps, prefix + "attn.q_down", C, QL, false, std);
    replicated(q_down);
    q_norm = Norm(ps, arena, prefix + "attn.q_down_norm", true, QL, N, eps);
    if (partial) q_norm.set_sequence_parallel(ps);
    q_up = Linear::column(ps, tp, prefix + "attn.q_up", QL, {heads * D}, false, std);
    cq = arena.reserve(N * QL);
    cq_n = arena.reserve(N * QL);
  } else {
    q = Linear::column(ps, tp, prefix + "attn.q", C, {heads * D}, false, std);
  }
  kv_down = Linear(ps, prefix + "attn.kv_down", C, KL + DR, false, std);
  replicated(kv_down);
  kv_norm = Norm(ps, arena, prefix + "attn.kv_down_norm", true, KL, N, eps);
  if (partial) kv_norm.set_sequence_parallel(ps);
  kv_up = Linear::column(ps, tp, prefix + "attn.kv_up", KL, {heads * (DN + DV)}, false, std);
  c = arena.reserve(N * KL);
  c_n = arena.reserve(N * KL);
  if (m.rope_scaling == "yarn" && m.rope_yarn_mscale_all_dim != 0) {
    const double mscale = yarn_mscale(m.rope_scaling_factor, m.rope_yarn_mscale_all_dim);
    q_scale = static_cast<float>(mscale * mscale);
  }
  const int64_t L = std::max(QL, KL);
  scratch = scratch_of && scratch_of->on()
                ? scratch_of->scratch
                : arena.reserve_scratch(N * (2 * NH * D + NH * (DN + DV) + (KL + DR) + 2 * L + C + 2 * DR));
  if (whole_latents)
    pe_parts =
        scratch_of && scratch_of->on() ? scratch_of->pe_parts : arena.reserve_scratch((tp.size + 1) * N * NH * DR);
}

void LatentProjections::forward(const ParamStore& ps, const Arena& arena, float* qkv_out, const float* x,
                                const float* cos, const float* sin, int64_t T, const int32_t* positions) const {
  const Ops& ops = ps.device().ops;
  const int64_t W = qkv_width(), KV = NH * (DN + DV);
  float* qb = arena(scratch);
  float* kvb = qb + N * NH * D;
  float* ckv = kvb + N * KV;
  ops.fill(qkv_out, N * W, 0.0f);  // the values' padding
  if (QL > 0) {
    q_down.forward(ps, arena(cq), x, N);
    q_norm.forward(ps, arena, arena(cq_n), arena(cq), N);
    q_up.forward(ps, qb, arena(cq_n), N);
  } else {
    q.forward(ps, qb, x, N);
  }
  if (q_scale != 1.0f) scale_queries(ops, arena, qb);
  ops.copy_rows(qkv_out, W, qb, NH * D, N, NH * D);
  kv_down.forward(ps, ckv, x, N);
  ops.copy_rows(arena(c), KL, ckv, KL + DR, N, KL);
  kv_norm.forward(ps, arena, arena(c_n), arena(c), N);
  kv_up.forward(ps, kvb, arena(c_n), N);
  float* k = qkv_out + NH * D;
  float* v = k + NH * D;
  for (int64_t h = 0; h < NH; ++h) {
    ops.copy_rows(k + h * D, W, kvb + h * (DN + DV), KV, N, DN);
    ops.copy_rows(k + h * D + DN, W, ckv + KL, KL + DR, N, DR);  // the shared k_pe
    ops.copy_rows(v + h * D, W, kvb + h * (DN + DV) + DN, KV, N, DV);
  }
  for (int64_t h = 0; h < 2 * NH; ++h) ops.rope_forward(qkv_out + h * D + DN, cos, sin, N, T, 1, DR, W, positions);
  ps.precision().round(qkv_out, N * W);
}

void LatentProjections::scale_queries(const Ops& ops, const Arena& arena, float* q) const {
  const int64_t L = std::max(QL, KL);
  float* factor = arena(scratch) + N * (NH * D + NH * (DN + DV) + (KL + DR) + 2 * L + C + 2 * DR);
  ops.fill(factor, N * NH * D, q_scale);
  ops.multiply(q, q, factor, N * NH * D);
}

void LatentProjections::compact(const Ops& ops, float* att_c, const float* att) const {
  for (int64_t h = 0; h < NH; ++h) ops.copy_rows(att_c + h * DV, NH * DV, att + h * D, NH * D, N, DV);
}

void LatentProjections::expand(const Ops& ops, float* datt, const float* datt_c) const {
  ops.fill(datt, N * NH * D, 0.0f);
  for (int64_t h = 0; h < NH; ++h) ops.copy_rows(datt + h * D, NH * D, datt_c + h * DV, NH * DV, N, DV);
}

void LatentProjections::backward(const ParamStore& ps, const Arena& arena, float* dx, float* dqkv, const float* x,
                                 const float* cos, const float* sin, int64_t T, const int32_t* positions) const {
  const Ops& ops = ps.device().ops;
  const int64_t W = qkv_width(), KV = NH * (DN + DV), L = std::max(QL, KL);
  float* dq = arena(scratch);
  float* dkv = dq + N * NH * D;
  float* dckv = dkv + N * KV;
  float* dlat = dckv + N * (KL + DR);
  float* dlat_in = dlat + N * L;
  float* dx_q = dlat_in + N * L;
  float* dpe = dx_q + N * C;
  float* tmp = dpe + N * DR;
  for (int64_t h = 0; h < 2 * NH; ++h) ops.rope_backward(dqkv + h * D + DN, cos, sin, N, T, 1, DR, W, positions);
  ps.precision().round(dqkv, N * W);
  const float* dk = dqkv + NH * D;
  const float* dv = dk + NH * D;
  ops.copy_rows(dq, NH * D, dqkv, W, N, NH * D);
  if (q_scale != 1.0f) scale_queries(ops, arena, dq);
  for (int64_t h = 0; h < NH; ++h) {
    ops.copy_rows(dkv + h * (DN + DV), KV, dk + h * D, W, N, DN);
    ops.copy_rows(dkv + h * (DN + DV) + DN, KV, dv + h * D, W, N, DV);
  }
  // k_pe feeds every head: its gradient is their sum, in head order (of all the group's heads:
  // gathered, determinism = "layout").
  if (whole_latents) {
    float* own = arena(pe_parts);
    float* all = own + N * NH * DR;
    for (int64_t h = 0; h < NH; ++h) ops.copy_rows(own + h * DR, NH * DR, dk + h * D + DN, W, N, DR);
    group.comm->all_gather(all, own, N * NH * DR);
    ops.copy_rows(dpe, DR, all, NH * DR, N, DR);
    for (int64_t h = 1; h < NH * group.size; ++h) {
      ops.copy_rows(tmp, DR, all + (h / NH) * N * NH * DR + (h % NH) * DR, NH * DR, N, DR);
      ops.add(dpe, dpe, tmp, N * DR);
    }
  } else {
    ops.copy_rows(dpe, DR, dk + DN, W, N, DR);
    for (int64_t h = 1; h < NH; ++h) {
      ops.copy_rows(tmp, DR, dk + h * D + DN, W, N, DR);
      ops.add(dpe, dpe, tmp, N * DR);
    }
  }
  // Keys and values: kv_up, the latent norm (it adds into its input gradient), kv_down.
  // An up projection's input gradient: this rank's heads' part, or (whole_latents) all heads'.
  auto up_backward = [&](const Linear& up, float* dlatent, const float* dy, const float* latent) {
    if (whole_latents)
      up.backward(ps, group, nullptr, dlatent, dy, latent, N);
    else
      up.backward(ps, dlatent, dy, latent, N);
  };
  up_backward(kv_up, dlat, dkv, arena(c_n));
  ops.fill(dlat_in, N * KL, -0.0f);
  kv_norm.backward(ps, arena, dlat_in, dlat, arena(c), N);
  ops.copy_rows(dckv, KL + DR, dlat_in, KL, N, KL);
  ops.copy_rows(dckv + KL, KL + DR, dpe, DR, N, DR);
  kv_down.backward(ps, dx, dckv, x, N);
  // Queries.
  if (QL > 0) {
    up_backward(q_up, dlat, dq, arena(cq_n));
    ops.fill(dlat_in, N * QL, -0.0f);
    q_norm.backward(ps, arena, dlat_in, dlat, arena(cq), N);
    q_down.backward(ps, dx_q, dlat_in, x, N);
  } else {
    up_backward(q, dx_q, dq, x);
  }
  ops.add(dx, dx, dx_q, N * C);
  // Whole on every rank: passed on once (the caller sums the group's).
  if (whole_latents && group.rank != 0) ops.fill(dx, N * C, -0.0f);
}

void LatentProjections::trace_names(std::vector<std::string>& out) const {
  if (QL > 0)
    out.insert(out.end(), {q_down.name, q_norm.name, q_up.name});
  else
    out.push_back(q.name);
  out.insert(out.end(), {kv_down.name, kv_norm.name, kv_up.name});
}

}  // namespace lockstep
