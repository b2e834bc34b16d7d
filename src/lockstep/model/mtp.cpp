#include "lockstep/model/mtp.h"

#include <cstring>

#include "lockstep/core/trace.h"
#include "lockstep/core/tree_sum.h"
#include "lockstep/kernels/device.h"
#include "lockstep/tensor/precision.h"

namespace lockstep {

MtpLayer::MtpLayer(ParamStore& ps, Arena& arena, int64_t depth, const ModelConfig& m, int64_t B_, int64_t T_,
                   const TensorParallel& tp_, const ContextParallel& cp, const MoeConfig* moe_config,
                   const MoeGroups& groups)
    : B(B_), T(T_), N(B_ * T_), C(m.hidden_size), V(m.vocab_size), Tg(T_ * cp.size), tp(tp_), rows(tp_.rows(B_ * T_)) {
  const std::string prefix = "mtp.layers." + std::to_string(depth) + ".";
  const bool rms = m.normalization == "rmsnorm";
  const float eps = static_cast<float>(m.norm_eps);
  enorm = Norm(ps, arena, prefix + "enorm", rms, C, rows, eps);
  hnorm = Norm(ps, arena, prefix + "hnorm", rms, C, rows, eps);
  proj_w = ps.add(prefix + "eh_proj.weight", {C, 2 * C}, Init::normal, static_cast<float>(m.init_std), true);
  ps.set_token_sum(proj_w);  // a sum over the stream's rows, which sequence parallelism splits
  proj_name = prefix + "eh_proj";
  attn = AttentionLayer(ps, arena, prefix, m, B, T, tp, cp);
  if (moe_config)
    moe = std::make_unique<MoeLayer>(ps, arena, prefix, m.num_layers + depth, m, *moe_config, B, T, groups);
  else
    mlp = MlpLayer(ps, arena, prefix, m, N, tp);
  final_norm = Norm(ps, arena, prefix + "final_norm", rms, C, rows, eps);
  // Sequence parallelism: these see this rank's rows only, so their gradients are partial sums.
  if (tp.sequence) {
    for (const Norm* n : {&enorm, &hnorm, &final_norm}) n->set_sequence_parallel(ps);
    ps.set_sequence_parallel(proj_w);
  }
  // One reserve per slice, in this order (a loop over their addresses trips g++ 12's -Wstringop-overflow).
  emb = arena.reserve(rows * C), e = arena.reserve(rows * C), hn = arena.reserve(rows * C);
  x = arena.reserve(rows * C), mid = arena.reserve(rows * C), y = arena.reserve(rows * C), h = arena.reserve(rows * C);
  if (tp.on()) emb_partial = arena.reserve(N * C);
}

void MtpLayer::forward(const ParamStore& ps, const Arena& arena, const int32_t* tokens_k, const float* h_prev, int wte,
                       int wpe, const int32_t* positions, const int32_t* doc_start, const float* rope_cos,
                       const float* rope_sin, const MtpPass& pass, int32_t* local_tokens) const {
  const Precision& p = ps.precision();
  const Ops& ops = ps.device().ops;
  const int64_t N = rows;  // this rank's rows of the stream from here on
  if (tp.on())
    vocab_parallel_embedding(ops, tp, arena(emb), arena(emb_partial), local_tokens, tokens_k, ps.weight(wte),
                             wpe >= 0 ? ps.weight(wpe) : nullptr, positions, this->N, T, C, V);
  else
    ops.embedding_forward(arena(emb), tokens_k, ps.weight(wte), wpe >= 0 ? ps.weight(wpe) : nullptr, B, T, C, V,
                          positions, Tg);
  p.round(arena(emb), N * C);
  enorm.forward(ps, arena, arena(e), arena(emb), N);
  hnorm.forward(ps, arena, arena(hn), h_prev, N);
  // x = [e | hn] W^T as two GEMMs over the halves of K: by the GEMM's accumulate-split property
  // this is bitwise the product with the concatenation, which is never built.
  const float* w = ps.weight(proj_w);
  GemmOptions acc;
  acc.accumulate = true;
  gemm_f32(ops, arena(x), C, arena(e), C, Trans::N, w, 2 * C, Trans::T, N, C, C);
  gemm_f32(ops, arena(x), C, arena(hn), C, Trans::N, w + C, 2 * C, Trans::T, N, C, C, acc);
  p.round(arena(x), N * C);
  trace_out(proj_name, arena(x), N * C);
  attn.forward(ps, arena, arena(mid), arena(x), rope_cos, rope_sin, positions, doc_start);
  if (moe)
    moe->forward(ps, arena, arena(y), arena(mid), pass.training, pass.seed, pass.step, pass.micro);
  else
    mlp.forward(ps, arena, arena(y), arena(mid));
  final_norm.forward(ps, arena, arena(h), arena(y), N);
}

void MtpLayer::backward(const ParamStore& ps, const Arena& arena, float* dh_prev, float* dh, const int32_t* tokens_k,
                        const float* h_prev, int wte, int wpe, const int32_t* positions, const int32_t* doc_start,
                        const float* rope_cos, const float* rope_sin, const MtpScratch& s, int32_t* order,
                        float aux_scale, int32_t* local_tokens) const {
  const Ops& ops = ps.device().ops;
  const int64_t N = rows;  // this rank's rows of the stream
  ops.fill(s.dx, N * C, 0.0f);
  final_norm.backward(ps, arena, s.dx, dh, arena(y), N);
  if (moe)
    moe->backward(ps, arena, s.dx, arena(mid), *s.moe, aux_scale);
  else
    mlp.backward(ps, arena, s.dx, arena(mid), s.mlp);
  attn.backward(ps, arena, s.dx, arena(x), rope_cos, rope_sin, s.attn, positions, doc_start);
  // eh_proj: d[e | hn] = dx W, dW += dx^T [e | hn], each half on its own columns.
  const float* w = ps.weight(proj_w);
  GemmOptions acc;
  acc.accumulate = true;
  gemm_f32(ops, s.de, C, s.dx, C, Trans::N, w, 2 * C, Trans::N, N, C, C);
  gemm_f32(ops, s.dhn, C, s.dx, C, Trans::N, w + C, 2 * C, Trans::N, N, C, C);
  ps.precision().round(s.de, N * C);
  ps.precision().round(s.dhn, N * C);
  // determinism = "layout": the weight gradient in token segments (ParamStore::token_segments), per
  // token piece of the rank's rows (ParamStore::token_pieces: context parallelism).
  const int64_t K = ps.token_pieces(proj_w), n = N / K;
  const std::vector<int64_t> bounds = canonical_segments(n, ps.token_segments(proj_w));
  acc.k_segments = bounds;
  for (int64_t k = 0; k < K; ++k) {
    float* dw = ps.grad_piece(proj_w, k);
    const float* dxk = s.dx + k * n * C;
    gemm_f32(ops, dw, 2 * C, dxk, C, Trans::T, arena(e) + k * n * C, C, Trans::N, C, C, n, acc);
    gemm_f32(ops, dw + C, 2 * C, dxk, C, Trans::T, arena(hn) + k * n * C, C, Trans::N, C, C, n, acc);
  }
  trace_grad_in(proj_name, s.dhn, N * C);
  hnorm.backward(ps, arena, dh_prev, s.dhn, h_prev, N);
  ops.fill(s.demb, N * C, 0.0f);
  enorm.backward(ps, arena, s.demb, s.de, arena(emb), N);
  vocab_parallel_embedding_backward(tp, ps, wte, wpe, order, s.attn.dnorm, s.demb, local_tokens, tokens_k, positions, B,
                                    T, C, V, Tg);
}

}  // namespace lockstep
