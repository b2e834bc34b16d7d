// Multi-token prediction (DeepSeek-V3, Megatron Core's MultiTokenPredictionLayer): D extra depths
// after the main model, depth k predicting the token k + 1 positions ahead.
//
// Depth k = 1..D, over the same N = B x T positions as the main model (h_0: the main model's
// output after its final norm, the input of the output head):
//   e   = enorm(embed(t_{i+k}))            (N, C) the shared word (and position i) embedding
//   x   = [e | hnorm(h_{k-1})] W^T          (N, C) eh_proj: W (C, 2C), no bias
//   h_k = final_norm(layer(x))             (N, C) layer: one transformer layer (attention + MLP
//                                                  sublayers, the model's flavour)
//   L_k = mean over valid i of CE(head(h_k)_i, t_{i+k+1})   the shared output head
// Within a sequence, t_{i+k} for i + k >= T wraps around (Megatron rolls the input ids); those
// positions have no target (i + k + 1 > T), and under causal attention they cannot influence a
// valid one. Targets masked in the batch (negative) stay masked, shifted with the tokens.
// The MTP loss is (mtp_loss_scaling_factor / D) * sum_k L_k, added to the training loss.
//
// The depth's layer is built like the model's last decoder layer, as Megatron builds it from that
// layer's spec: when that one is MoE (DeepSeek-V3), the depth's MLP sublayer is an MoE sublayer
// (model/moe/moe_layer.h) with the model's MoE settings, numbered L + k - 1 among the MoE layers (its
// router jitter, token statistics "moe.<L+k-1>.*"); its load-balancing losses join aux_loss().
//
// Parameters: mtp.layers.<k-1>.{enorm, hnorm, eh_proj, attn_norm, attn.*, mlp_norm, mlp.* or moe.*,
// final_norm} (the embedding and the output head are the main model's).
//
// Tensor parallelism (parallel/tensor_parallel.h): the depth's attention and MLP split like the
// main model's, its embedding lookup is vocab-parallel; with sequence parallelism the depth's
// activations (and eh_proj, on this rank's rows) hold this rank's rows of the (N, C) stream.
//
// Context parallelism (parallel/context_parallel.h): the depth holds the rank's T = seq_length / cp
// positions per sample, as the main model; the hidden states stay where they are, only the token
// ids and targets move along the sequence (GPT::mtp shifts them over the whole sequence and takes
// this rank's positions), and the depth's attention all-gathers its keys and values over the cp
// group like a main layer's.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "lockstep/config/config.h"
#include "lockstep/model/arena.h"
#include "lockstep/model/attention.h"
#include "lockstep/model/mlp.h"
#include "lockstep/model/moe/moe_layer.h"
#include "lockstep/model/norm.h"
#include "lockstep/tensor/param_table.h"

namespace lockstep {

struct MtpScratch {
  float* dx;    // (N, C) gradient of the depth's residual stream
  float* de;    // (N, C) d(enorm output)
  float* dhn;   // (N, C) d(hnorm output)
  float* demb;  // (N, C) d(embedding)
  MlpScratch mlp;
  AttentionScratch attn;
  const MoeScratch* moe;  // the model's MoE scratch (an MoE depth)
};

// What an MoE depth's router needs of the pass (MoeLayer::forward).
struct MtpPass {
  bool training = false;
  uint64_t seed = 0;
  int64_t step = 0, micro = 0;
};

struct MtpLayer {
  MtpLayer() = default;
  // depth: k - 1 (0-based), the index in the parameter names.
  // T: the positions per sample this rank holds (seq_length / cp). moe: the MoE sublayer's settings
  // and groups when the model's last decoder layer is MoE; null for the dense MLP.
  MtpLayer(ParamStore& ps, Arena& arena, int64_t depth, const ModelConfig& m, int64_t B, int64_t T,
           const TensorParallel& tp = TensorParallel{}, const ContextParallel& cp = ContextParallel{},
           const MoeConfig* moe = nullptr, const MoeGroups& groups = MoeGroups{});

  // tokens_k (N): the inputs t_{i+k}. h_prev (N, C): h_{k-1}. Writes h_k (out()).
  void forward(const ParamStore& ps, const Arena& arena, const int32_t* tokens_k, const float* h_prev, int wte, int wpe,
               const int32_t* positions, const int32_t* doc_start, const float* rope_cos, const float* rope_sin,
               const MtpPass& pass, int32_t* local_tokens = nullptr) const;
  // dh (N, C): d(h_k) (clobbered). dh_prev (N, C) += d(h_{k-1}); parameter gradients (the shared
  // embedding's too) accumulate. order: (N) scratch for the embedding's segment sums. aux_scale: the
  // MoE sublayer's load-balancing loss gradient scale (MoeLayer::backward).
  void backward(const ParamStore& ps, const Arena& arena, float* dh_prev, float* dh, const int32_t* tokens_k,
                const float* h_prev, int wte, int wpe, const int32_t* positions, const int32_t* doc_start,
                const float* rope_cos, const float* rope_sin, const MtpScratch& s, int32_t* order, float aux_scale,
                int32_t* local_tokens = nullptr) const;

  const float* out(const Arena& arena) const { return arena(h); }

  int64_t B = 0, T = 0, N = 0, C = 0, V = 0;
  int64_t Tg = 0;  // positions per sample of the whole sequence (the position embedding's rows)
  Norm enorm, hnorm, final_norm;
  int proj_w = -1;        // (C, 2C): columns [0, C) act on e, [C, 2C) on hnorm(h_{k-1})
  std::string proj_name;  // "mtp.layers.<k-1>.eh_proj", for the trace (core/trace.h)
  // The names forward traces, in order (core/trace.h).
  void trace_names(std::vector<std::string>& out) const {
    out.insert(out.end(), {enorm.name, hnorm.name, proj_name});
    attn.trace_names(out);
    if (moe)
      moe->trace_names(out);
    else
      mlp.trace_names(out);
    out.push_back(final_norm.name);
  }
  AttentionLayer attn;
  MlpLayer mlp;                         // the dense depth's (default-constructed with moe)
  std::unique_ptr<MoeLayer> moe;        // the MoE depth's
  ArenaSlice emb, e, hn, x, mid, y, h;  // saved for backward, (rows, C) each
  TensorParallel tp;
  int64_t rows = 0;        // tp.rows(N)
  ArenaSlice emb_partial;  // tensor parallelism: the lookup's partial sums (N, C)
};

}  // namespace lockstep
