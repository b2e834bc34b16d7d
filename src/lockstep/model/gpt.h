// The GPT decoder: embedding -> L x (attention sublayer, MLP sublayer) -> final norm -> output
// head -> softmax cross-entropy. Two flavours from one code path (model.preset): gpt2 (learned
// positions, LayerNorm, GELU, biases, tied head) and llama (RoPE, RMSNorm, SwiGLU, no biases,
// grouped-query attention, untied head).
//
// Explicit forward/backward per module (no autograd). Parameter gradients accumulate over
// micro-batches; activation gradients are assigned, except the residual stream's, which sums.
// Parameter names (the table in params()): embedding.word.weight (V, C), embedding.position.weight
// (T, C), layers.<l>.{attn_norm,mlp_norm}.{weight,bias}, layers.<l>.attn.qkv.{weight,bias}
// ((NH + 2*NKV)*HS, C), layers.<l>.attn.proj.*, layers.<l>.mlp.fc.* (F or 2F for SwiGLU, C),
// layers.<l>.mlp.proj.*, final_norm.*, output.weight (V, C; untied only).
//
// The output head and the loss run together, in chunks of rows: logits for a chunk, the loss and
// its gradient in place (cross_entropy.h), then the chunk's contribution to d(final norm) and to
// the head's weight gradient. The full (N, V) logits never exist at once, and by the GEMM's
// accumulate-split property the chunk size does not change a single bit.
#pragma once

#include <cstdint>
#include <vector>

#include "lockstep/config/config.h"
#include "lockstep/model/arena.h"
#include "lockstep/model/attention.h"
#include "lockstep/model/mlp.h"
#include "lockstep/model/norm.h"
#include "lockstep/model/param_table.h"

namespace lockstep {

class GPT {
 public:
  // B: sequences per micro-batch; T = m.seq_length. Declares and allocates every parameter (not
  // yet initialised: call params().init(seed)) and the activation arena.
  GPT(const ModelConfig& m, int64_t B);

  // One micro-batch, forward and backward. tokens, targets: (B, T). Parameter gradients
  // accumulate; the loss gradient is scaled by grad_scale (1 / tokens in the global batch).
  // Returns the mean loss over the micro-batch's tokens.
  double forward_backward(const int32_t* tokens, const int32_t* targets, float grad_scale);
  // Forward only; mean loss.
  double evaluate(const int32_t* tokens, const int32_t* targets);

  ParamStore& params() { return params_; }
  const ParamStore& params() const { return params_; }
  // Model FLOPs per token for forward + backward: 6 x (matmul parameters) + 6 x L x T x C for
  // causal attention (QK^T and PV over T/2 keys on average).
  double flops_per_token() const;
  int64_t activation_bytes() const { return arena_.total_floats() * 4; }

 private:
  void forward(const int32_t* tokens);
  void head(const int32_t* targets, bool backward, float grad_scale);
  void backward(const int32_t* tokens);

  ModelConfig m_;
  int64_t B_, T_, C_, V_, L_, N_;
  int64_t head_rows_;  // rows of logits per chunk
  ParamStore params_;
  Arena arena_;
  int wte_ = -1, wpe_ = -1, out_ = -1;
  std::vector<AttentionLayer> attn_;
  std::vector<MlpLayer> mlp_;
  Norm final_norm_;
  std::vector<float> rope_cos_, rope_sin_;
  // Activations: resid[l] is layer l's input (N, C), resid[L] the last output; mid[l] the residual
  // between the attention and MLP sublayers.
  std::vector<ArenaSlice> resid_, mid_;
  ArenaSlice final_out_, logits_, losses_;
  // Backward scratch, shared by all layers.
  ArenaSlice dresid_, dfinal_, dnorm_, datt_, dqkv_, dact_, dfc_;
  std::vector<int32_t> order_;
};

}  // namespace lockstep
