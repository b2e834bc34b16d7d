// The MoE sublayer, in its steps: norm -> route -> dispatch -> experts -> combine (+ shared expert),
// added to the residual stream. It replaces the MLP sublayer on the layers moe.layer_freq selects.
//
//   x = norm(resid_in)                      (N, C)
//   logits = (x * jitter) W_r^T             (N, E), jitter = 1 in evaluation or when eps = 0
//   idx, probs = route_topk(logits)         (N, K); capacity drops some choices
//   rows = dispatch(x)                      (R, C) grouped by expert
//   y = experts(rows)                       (R, C) grouped GEMMs
//   resid_out = resid_in [+ shared(x)] + sum_k probs[t, k] * y[row(t, k)]
// The load-balancing losses of the router are added to the training loss (aux_loss()); their
// gradients enter the router logits in backward, scaled like the loss's (aux_scale).
//
// Parameters: <prefix>mlp_norm.*, <prefix>moe.router.weight (E, C), <prefix>moe.experts.*,
// <prefix>moe.shared.* (experts.h, shared_experts.h). The expert bias (E) is a buffer, not a
// parameter: the optimizer never sees it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "lockstep/config/config.h"
#include "lockstep/model/arena.h"
#include "lockstep/model/moe/dispatcher.h"
#include "lockstep/model/moe/experts.h"
#include "lockstep/model/moe/router.h"
#include "lockstep/model/moe/shared_experts.h"
#include "lockstep/model/norm.h"

namespace lockstep {

class Communicator;

// Backward scratch shared by every MoE layer of a model.
struct MoeScratch {
  float* dnorm;       // (N, C)
  float* drouter_x;   // (N, C)
  float* dlogits;     // (N, E)
  float* dprobs;      // (N, K)
  float* drows;       // (R, C)
  float* drows_in;    // (R, C)
  ExpertsScratch experts;
  SharedExpertScratch shared;
};

// Tokens each expert processed over a step (after capacity), for metrics.
struct MoeTokenStats {
  int64_t layer = 0;
  int64_t min = 0, max = 0;
  double imbalance = 0;  // max / mean
};

class MoeLayer {
 public:
  // ep: the expert-parallel group (null or size 1: every expert here). With S > 1 ranks this rank
  // holds experts [r E/S, (r + 1) E/S) and moe.token_dispatcher exchanges the tokens.
  MoeLayer(ParamStore& ps, Arena& arena, const std::string& prefix, int64_t layer, const ModelConfig& m,
           const MoeConfig& moe, int64_t B, int64_t T, Communicator* ep = nullptr);

  // training: jitter on, counts recorded for the step's statistics, the expert bias update and the
  // global aux loss. micro: index of the micro-batch in the step (jitter's global element index).
  void forward(const ParamStore& ps, const Arena& arena, float* resid_out, const float* resid_in,
               bool training, uint64_t seed, int64_t step, int64_t micro);
  void backward(const ParamStore& ps, const Arena& arena, float* dresid, const float* resid_in,
                const MoeScratch& s, float aux_scale) const;

  // Start of an optimizer step: clears the step's token counts and the global aux loss tracker.
  void begin_step();
  // End of a step: the expert-bias update from the step's counts, summed over `dp` when given (the
  // data-parallel replicas then apply the same update); returns the step's statistics.
  MoeTokenStats finish_step(double bias_update_rate, Communicator* dp = nullptr);

  const AuxLosses& aux_losses() const { return aux_; }
  const std::vector<float>& expert_bias() const { return expert_bias_; }
  // The expert bias for checkpoints: "buffer/layers.<l>.moe.router.expert_bias" (E).
  void state_shards(std::vector<StateShard>& out, bool writer);
  // This rank's tokens laid out over all the layer's experts (routing, capacity, padding).
  const LocalDispatcher& dispatcher() const { return *source_layout_; }
  // Bytes the dispatcher has sent to other expert-parallel ranks so far.
  int64_t dispatch_bytes_sent() const { return dispatcher_->bytes_sent(); }
  const int32_t* topk_idx() const { return idx_.data(); }

  // Sizes of the scratch this layer's backward needs.
  int64_t max_rows() const { return dispatcher_->max_rows(); }
  int64_t expert_fc_width() const { return experts_.fc_width(); }
  int64_t expert_ffn() const { return experts_.F; }
  int64_t shared_fc_width() const { return shared_ ? shared_->fc_width() : 0; }
  int64_t shared_ffn() const { return shared_ ? shared_->F : 0; }
  double matmul_params_per_token() const;  // for the FLOP count: router, K experts, shared

 private:
  RouterSpec spec_;
  // Trace names (model/trace.h): "<prefix>moe" (the sublayer's output, the gradient of its normed
  // input), "<prefix>moe.router" (logits), "<prefix>moe.experts" (expert output rows).
  std::string name_, router_name_, experts_name_;
  int64_t layer_, B_, T_, N_, C_, E_, K_;
  double jitter_eps_;
  bool expert_bias_on_;
  Norm norm_;
  int router_w_ = -1;
  GroupedExperts experts_;
  std::unique_ptr<SharedExpert> shared_;
  std::unique_ptr<Dispatcher> dispatcher_;
  const LocalDispatcher* source_layout_ = nullptr;
  ArenaSlice normed_, router_x_, logits_, probs_, rows_in_, rows_out_, jitter_;
  std::vector<int32_t> idx_;
  std::vector<uint8_t> kept_;
  std::vector<float> expert_bias_;
  std::vector<int64_t> counts_seq_;                 // (B, E) aux-loss routing map counts
  std::vector<int64_t> step_counts_;                // (E) tokens processed this step
  std::vector<int64_t> global_counts_sum_;          // (E) aux routing counts over the step
  int64_t global_micro_ = 0;
  std::vector<float> global_counts_;                // (E) running mean used by this micro-batch
  bool jittered_ = false;
  AuxLosses aux_;
};

}  // namespace lockstep
