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
//
// Parallel layouts (docs/parallelism.md, MoE parallel folding): the layer reads the ranks through
// two meshes. Attention around it uses the dense one (tp, cp, dp); the experts the expert one (etp,
// ep, edp) over the same ranks.
//   tensor parallelism (tp = P > 1): every rank of the tp group routes its own N / P tokens (rows
//     [r, r + 1) x N / P of the micro-batch): with sequence parallelism those are the rows it holds;
//     without, it takes them from the replicated input and all-gathers its output rows over the
//     group (backward: takes its rows of the replicated gradient and all-gathers its input
//     gradient rows), so no expert work or gradient is duplicated over tp. The norm, router and
//     shared expert are replicated over tp and see only the rank's rows: their gradients are
//     partial sums, summed over the group once per step (GradRole::sequence_parallel,
//     reduce_sequence_parallel_grads; under context parallelism in layout mode their token pieces
//     are combined over tp x cp instead, combine_token_pieces). The load-balancing losses need the whole micro-batch's
//     statistics: the router logits (E per token) are all-gathered over the group, so every rank
//     computes the single-process aux losses and the gradient of its own rows;
//   context parallelism (cp, parallel/context_parallel.h): the layer holds its rank's T / cp positions
//     of each sample (T = B x T / cp tokens, split over tp as above); the logits are all-gathered
//     over the cp group too, into the whole micro-batch's order, so every rank computes the
//     single-process aux losses (sequence aux loss per whole sequence) and the gradient of its rows;
//   expert parallelism (ep): the dispatcher exchanges those tokens over the ep group;
//   expert tensor parallelism (etp): the dispatched rows are gathered over the etp group and each
//     expert's hidden units split over it (expert_tensor_parallel.h).
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
#include "lockstep/parallel/context_parallel.h"
#include "lockstep/parallel/tensor_parallel.h"

namespace lockstep {

class Communicator;
class ExpertTensorParallel;

// The groups an MoE layer uses (null or size 1: none).
struct MoeGroups {
  TensorParallel tp;            // the dense tensor-parallel group (and sequence parallelism)
  Communicator* ep = nullptr;   // expert parallel
  Communicator* etp = nullptr;  // expert tensor parallel
  ContextParallel cp;           // context parallel (the dense mesh's)
};

// Backward scratch shared by every MoE layer of a model.
struct MoeScratch {
  float* dnorm;      // (N, C)
  float* drouter_x;  // (N, C)
  float* dlogits;    // (N, E)
  float* dprobs;     // (N, K)
  float* drows;      // (R, C)
  float* drows_in;   // (R, C)
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
  // groups.ep: with S > 1 ranks this rank holds experts [r E/S, (r + 1) E/S) and
  // moe.token_dispatcher exchanges the tokens; groups.tp, groups.etp: see above. resid_in / out
  // are (N, C), or this rank's (N / tp, C) rows under sequence parallelism.
  MoeLayer(ParamStore& ps, Arena& arena, const std::string& prefix, int64_t layer, const ModelConfig& m,
           const MoeConfig& moe, int64_t B, int64_t T, const MoeGroups& groups = MoeGroups{});
  ~MoeLayer();

  // training: jitter on, counts recorded for the step's statistics, the expert bias update and the
  // global aux loss. micro: index of the micro-batch in the step (jitter's global element index).
  // replay: the micro-batch's forward again (activation recompute, model/gpt.h), after its first:
  // the same routing, dispatch and outputs, its aux losses and counts not taken again.
  void forward(const ParamStore& ps, const Arena& arena, float* resid_out, const float* resid_in, bool training,
               uint64_t seed, int64_t step, int64_t micro, bool replay = false);
  void backward(const ParamStore& ps, const Arena& arena, float* dresid, const float* resid_in, const MoeScratch& s,
                float aux_scale);

  // Start of an optimizer step: clears the step's token counts and the global aux loss tracker.
  void begin_step();
  // The ranks holding the step's other micro-batches (the dense data-parallel x context-parallel
  // group): the global aux loss sums each micro-batch's counts over them, as Megatron's over its
  // tp x dp x cp group (tp is in already: every tp rank counts the whole micro-batch). Training
  // forwards then all-reduce E counts over dp per MoE layer and micro-batch (docs/moe.md).
  void set_data_parallel(Communicator* dp);
  // The global aux loss's counts of the last forward: the running mean over the step's
  // micro-batches so far, summed over the data-parallel group (E).
  const std::vector<float>& global_counts() const { return global_counts_; }
  // determinism = "layout", `micros` micro-batches per rank and step: under expert parallelism the
  // experts sum their gradients over micro-batches and sources themselves (experts.h; the group's
  // block of the step's `leaves` starts at `first`, `pieces`, `partners` and `tp_sum` as GroupedExperts::set_layout's).
  void set_layout(int64_t micros, int64_t leaves = 0, int64_t first = 0, const std::vector<float*>& pieces = {},
                  Communicator* partners = nullptr, ExpertTpSum tp_sum = ExpertTpSum::on_first) {
    experts_.set_layout(micros, leaves, first, pieces, partners, tp_sum);
    layout_invariant_ = true;
    make_layout_invariant(*dispatcher_);
    for (Micro& slot : slots_)  // under pipelining, the other in-flight micro-batches' dispatchers
      if (slot.dispatcher) make_layout_invariant(*slot.dispatcher);
  }
  // End of a step: the expert-bias update from the step's counts, summed over the tp group and over
  // `dp` when given (the data-parallel replicas then apply the same update); returns the step's
  // statistics.
  MoeTokenStats finish_step(double bias_update_rate, Communicator* dp = nullptr);

  const AuxLosses& aux_losses() const { return aux_; }
  const std::vector<float>& expert_bias() const { return expert_bias_; }
  // The expert bias for checkpoints: "buffer/<prefix>moe.router.expert_bias" (E): layers.<l>. of a
  // decoder layer, mtp.layers.<k>. of a multi-token prediction depth.
  void state_shards(std::vector<StateShard>& out, bool writer);
  // This rank's tokens laid out over all the layer's experts (routing, capacity, padding).
  const LocalDispatcher& dispatcher() const { return *source_layout_; }
  // Bytes the dispatcher has sent to other expert-parallel ranks so far.
  int64_t dispatch_bytes_sent() const;
  // Pipeline parallelism: the routing, dispatch plan and aux-loss state of in-flight micro-batch
  // slot k (model/arena.h) from here on; slot 0 is the one a single micro-batch uses.
  void select(int k);
  // Tokens this rank routes per micro-batch: N, or N / tp under tensor parallelism.
  int64_t routed_tokens() const { return Nl_; }
  const int32_t* topk_idx() const { return idx_.data(); }

  // Sizes of the scratch this layer's backward needs: rows reaching the experts (gathered over etp),
  // the experts' local widths.
  int64_t max_rows() const;
  int64_t expert_fc_width() const { return experts_.fc_width(); }
  int64_t expert_ffn() const { return experts_.F; }
  int64_t shared_fc_width() const { return shared_ ? shared_->fc_width() : 0; }
  int64_t shared_ffn() const { return shared_ ? shared_->F : 0; }
  double matmul_params_per_token() const;  // for the FLOP count: router, K experts, shared
  // The names forward traces (core/trace.h).
  void trace_names(std::vector<std::string>& out) const {
    out.insert(out.end(), {norm_.name, router_name_});
    if (shared_ && shared_overlap_) out.insert(out.end(), {shared_->fc.name, shared_->proj.name});
    out.push_back(experts_name_);
    if (shared_ && !shared_overlap_) out.insert(out.end(), {shared_->fc.name, shared_->proj.name});
    out.push_back(name_);
  }

 private:
  const Ops* ops_;
  std::vector<int64_t> jitter_rows_;  // each row's token in the step's batch (the jitter's draws)
  RouterSpec spec_;
  // Trace names (core/trace.h): "<prefix>moe" (the sublayer's output, the gradient of its normed
  // input), "<prefix>moe.router" (logits), "<prefix>moe.experts" (expert output rows).
  std::string name_, router_name_, experts_name_;
  int64_t layer_, B_, T_, N_, C_, E_, K_;
  double jitter_eps_;
  bool expert_bias_on_;
  int64_t F_;  // expert width (all of it; this rank may compute a slice)
  TensorParallel tp_;
  ContextParallel cp_;
  int64_t Tg_ = 0;     // positions of a whole sequence (T_ x cp)
  int64_t Nl_, row0_;  // tokens this rank routes: rows [row0_, row0_ + Nl_) of the micro-batch
  Norm norm_;
  int router_w_ = -1;
  GroupedExperts experts_;
  std::unique_ptr<SharedExpert> shared_;
  std::unique_ptr<Dispatcher> dispatcher_;
  std::unique_ptr<ExpertTensorParallel> etp_;  // null without expert tensor parallelism
  const LocalDispatcher* source_layout_ = nullptr;
  ArenaSlice normed_, router_x_, logits_, probs_, rows_in_, rows_out_, jitter_;
  // Tensor parallelism: the micro-batch's logits (N, E) for the aux losses, this rank's output rows
  // without sequence parallelism (Nl, C); expert tensor parallelism: the gathered rows (in, out).
  ArenaSlice all_logits_, own_out_, etp_in_, etp_out_;
  // Context parallelism: the rank's logits (N, E) gathered over tp, and the cp all-gather's buffer.
  ArenaSlice cp_logits_, cp_buf_;
  // The micro-batch's row (b x Tg + global position) of local row n (context parallelism: n itself
  // otherwise).
  int64_t global_row(int64_t n) const { return cp_.on() ? cp_.global_row(n, Tg_) : n; }
  std::vector<int32_t> idx_;
  std::vector<uint8_t> kept_;
  std::vector<float> expert_bias_;
  std::vector<int64_t> counts_seq_;         // (B, E) aux-loss routing map counts
  std::vector<int64_t> step_counts_;        // (E) tokens processed this step
  std::vector<int64_t> global_counts_sum_;  // (E) aux routing counts over the step (and dp)
  std::vector<int64_t> micro_counts_;       // (E) the last micro-batch's, summed over dp
  int64_t global_micro_ = 0;
  Communicator* data_parallel_ = nullptr;  // set_data_parallel(); null: one replica
  std::vector<float> global_counts_;       // (E) running mean used by this micro-batch
  bool jittered_ = false;
  AuxLosses aux_;
  // The per-micro-batch state above (dispatcher_, etp_ ... aux_) of the slots not selected;
  // slot_'s entry is empty while its state is in the members.
  struct Micro {
    std::unique_ptr<Dispatcher> dispatcher;
    std::unique_ptr<ExpertTensorParallel> etp;
    const LocalDispatcher* source_layout = nullptr;
    std::vector<int32_t> idx;
    std::vector<uint8_t> kept;
    std::vector<int64_t> counts_seq;
    std::vector<float> global_counts;
    bool jittered = false;
    AuxLosses aux;
    GroupedExperts::SharedCounts shared_counts;  // the experts' forward row counts (NVFP4 under TP)
  };
  std::vector<Micro> slots_;
  int slot_ = 0;
  MoeGroups groups_;
  int64_t capacity_ = 0;  // an expert's capacity (rows kept per micro-batch; the rows padded to)
  bool pad_ = false;
  // determinism = "layout" under tensor / context parallelism with a capacity: the capacity and the
  // drop decision are the micro-batch's (one process's), not the rank's tokens' (Megatron's, run
  // mode). batch_*: the micro-batch's routing and drop mask (B x Tg, K), scratch of forward.
  bool batch_capacity_ = false;
  std::vector<int32_t> batch_idx_;
  std::vector<float> batch_probs_;
  std::vector<uint8_t> batch_kept_;
  void drop_over_micro_batch(const float* batch_logits);  // kept_ from the micro-batch's drop mask
  std::string dispatcher_kind_;
  bool bf16_payload_ = false;    // precision.params = "bf16": the all-to-all's rows travel as bf16 words
  bool shared_overlap_ = false;  // moe.shared_expert_overlap
  // dx += the dispatch's backward of dexpert_in, with the experts' delayed weight gradient
  // (moe.delay_wgrad_compute) while its rows are in flight.
  void dispatch_backward(float* dx, const float* dexpert_in);
  bool layout_invariant_ = false;  // set_layout(): every dispatcher made, now or later, sums exactly
  void make_dispatcher();          // dispatcher_, source_layout_ and etp_ for one micro-batch
  // Layout mode: d sums exactly and its plans count each expert's rows per token segment (experts.h).
  void make_layout_invariant(Dispatcher& d) {
    d.set_layout_invariant();
    d.set_token_segments(experts_.token_segments_per_source());
  }
  void swap_micro(Micro& other);
};

}  // namespace lockstep
