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
//
// Tensor parallelism (parallel/tensor_parallel.h): each rank holds its slice of the attention and
// MLP matmuls, and the vocabulary rows [r, r + 1) x V / tp of the embedding and output head (the
// lookup and the loss combine over the group); with sequence parallelism the residual stream, the
// norms and the position embedding hold this rank's rows of the (B x T, C) activations.
//
// Context parallelism (parallel/context_parallel.h): the callers pass whole (B, seq_length)
// micro-batches; the model keeps its rank's two chunks of each sample (T = seq_length / cp rows per
// sample), embeds them at their global positions, and its attention gathers keys and values over
// the cp group. The LM loss it returns is its rows' share: the sum over them divided by the
// micro-batch's token count, to be summed over the cp group.
//
// Pipeline parallelism (parallel/pipeline/pipeline.h): a rank builds only its part of the model
// (StagePart): its model chunks' layers (parameter names keep the global layer index), the embedding
// on the first stage, the final norm, head, loss and MTP depths on the last. A last stage that
// needs the word embedding (tied head, MTP) holds a copy (GradRole::stage_copy); under
// determinism = "layout" one stage holds it too (StagePart::split_embedding). The chunk
// functions run one chunk of one micro-batch; select_slot picks the in-flight micro-batch whose
// activations they use (model/arena.h). forward_backward is chunk 0's forward then its backward.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "lockstep/config/config.h"
#include "lockstep/core/exact_sum.h"
#include "lockstep/kernels/device.h"
#include "lockstep/model/arena.h"
#include "lockstep/model/attention.h"
#include "lockstep/model/mlp.h"
#include "lockstep/model/moe/moe_layer.h"
#include "lockstep/model/mtp.h"
#include "lockstep/model/norm.h"
#include "lockstep/parallel/context_parallel.h"
#include "lockstep/parallel/pipeline/stage.h"
#include "lockstep/parallel/tensor_parallel.h"
#include "lockstep/tensor/param_table.h"
#include "lockstep/tensor/precision.h"

namespace lockstep {

class Communicator;

// Activation recompute (train.recompute_granularity = "full", Megatron's full recompute): the
// layers of each model chunk are cut into groups, "uniform": runs of num_layers consecutive layers,
// "block": the chunk's first num_layers layers, one group each (the others keep their activations).
// A group keeps only its input; its layers' saved activations live in the arena's recompute region
// (model/arena.h), and backward runs the group's forward again (replay: no aux losses, counters or
// trace records taken twice) right before the group's backward. The replayed forward computes the
// same bits, so every gradient, loss and fingerprint is the one without recompute.
//
// Selective recompute (train.recompute_granularity = "selective", train.recompute_modules): the
// named sublayers of every layer not in a full-recompute group, each its own group, their input
// (the residual stream between the sublayers) kept: "mlp" a dense layer's MLP, "moe" an MoE
// sublayer (replayed as above).
struct Recompute {
  std::string method;  // "uniform" | "block"; "" = none
  int64_t num_layers = 0;
  bool mlp = false, moe = false;  // selective
  static Recompute of(const TrainConfig& t) {
    Recompute r;
    if (t.recompute_granularity == "full") r.method = t.recompute_method, r.num_layers = t.recompute_num_layers;
    if (t.recompute_granularity == "selective")
      for (const std::string& name : t.recompute_module_list()) r.mlp |= name == "mlp", r.moe |= name == "moe";
    return r;
  }
};

class GPT final : public PipelineStage {
 public:
  // B: sequences per micro-batch; T = m.seq_length. Declares and allocates every parameter (not
  // yet initialised: call params().init(seed)) and the activation arena. With moe.num_experts > 0
  // the layers moe.layer_freq selects have an MoE sublayer (model/moe/moe_layer.h) instead of the
  // MLP; with 0 the model is the dense one, bit for bit. precision: the numerics of forward and
  // backward (tensor/precision.h); the default is fp32.
  // tp: the tensor-parallel group (none by default). ep: the expert-parallel group (null = every
  // expert on this rank; moe_layer.h): the table then holds only this rank's experts. etp: the
  // expert-tensor-parallel group (null = whole experts; moe/expert_tensor_parallel.h). device: where
  // the parameters, activations and ops live (kernels/device.h; null: a CPU device of the model's own).
  GPT(const ModelConfig& m, int64_t B, const MoeConfig& moe = MoeConfig{},
      const PrecisionConfig& precision = PrecisionConfig{}, const TensorParallel& tp = TensorParallel{},
      Communicator* ep = nullptr, Communicator* etp = nullptr, const StagePart& part = StagePart{},
      const ContextParallel& cp = ContextParallel{}, Device* device = nullptr,
      const Recompute& recompute = Recompute{});

  // One micro-batch, forward and backward. tokens, targets: (B, T). Parameter gradients
  // accumulate; the loss gradient is scaled by grad_scale (1 / tokens in the global batch).
  // Returns the mean LM loss over the micro-batch's tokens whose target is >= 0 (negative targets,
  // e.g. data.eod_mask_loss, have loss 0 and no gradient; grad_scale is then 1 / the unmasked
  // tokens of the global batch). The MoE load-balancing losses
  // (aux_loss()) are part of the training loss: their gradients are scaled by grad_scale * B * T,
  // i.e. the loss is lm_loss + the mean over micro-batches of aux_loss().
  double forward_backward(const int32_t* tokens, const int32_t* targets, float grad_scale);
  // Forward only; mean LM loss (no router jitter, no step statistics).
  double evaluate(const int32_t* tokens, const int32_t* targets);
  // Packed documents (data/documents.h): from here on every forward derives the positions
  // (reset_position_ids) and the attention's document starts (reset_attention_mask) of each
  // token from the tokens and the end-of-document id eod.
  // cp_pad: packed documents cut per document under context parallelism (ContextParallel::per_document),
  // the multiple the data padded each to.
  void set_documents(int32_t eod, bool reset_position_ids, bool reset_attention_mask, int64_t cp_pad = 0);
  // The MoE auxiliary losses of the last forward, summed over layers (0 for a dense model); with
  // MTP depths that are MoE (model/mtp.h) theirs too, once the depths have run (forward_backward,
  // evaluate; under pipelining after the last chunk's backward_chunk: mtp_aux_loss()).
  double aux_loss() const override { return aux_loss_; }
  // The same, each layer's term added exactly (determinism = "layout"): pipeline stages that each
  // hold some of the layers merge to the bits of one process.
  const ExactSum& aux_loss_exact() const override { return aux_exact_; }
  // The multi-token prediction loss of the last forward_backward or evaluate (model/mtp.h):
  // (mtp_loss_scaling_factor / D) * sum over depths of each depth's mean loss; 0 without MTP. It is
  // part of the training loss like aux_loss(): its gradients are scaled by grad_scale * B * T.
  // Context parallelism: this rank's share (its positions' losses over the micro-batch's count of
  // each depth's targets), summed over the cp group like lm_loss.
  double mtp_loss() const override { return mtp_loss_; }
  // The MTP depths' MoE aux losses of their last run (part of aux_loss(), above).
  double mtp_aux_loss() const override { return mtp_aux_exact_.value(); }
  const ExactSum& mtp_aux_loss_exact() const override { return mtp_aux_exact_; }

  // MoE bookkeeping around an optimizer step: begin_step before its micro-batches (router jitter
  // draws from (seed, layer, step, global element index); clears the step's counters; with bf16
  // weights, the step's first forward refreshes their copy from the master values, range by range
  // as the params-needed hook delivers them), finish_step
  // after the optimizer (expert-bias update; returns each MoE layer's tokens-per-expert statistics;
  // under determinism = "layout", delayed scaling's once-per-step update, tensor/precision.h).
  // first_micro: the global index of this rank's first micro-batch in the step (data parallelism:
  // rank r's micro-batch m is the step's micro-batch r x micro-batches per rank + m), so that the
  // router jitter is the same whatever the layout. dp: where the step's expert token counts are
  // summed (the data-parallel group, so that every replica applies the same expert-bias update);
  // null = this rank's counts only.
  void begin_step(uint64_t seed, int64_t step, int64_t first_micro = 0);
  std::vector<MoeTokenStats> finish_step(double bias_update_rate, Communicator* dp = nullptr);
  // Called by backward as parameter gradients become final: every parameter of the table in
  // [first, end) has had its last contribution of this micro-batch, so data parallelism can start
  // reducing them while backward goes on (parallel/data_parallel.h). Table order is forward order,
  // so the calls come in decreasing ranges and together cover the table once per micro-batch.
  void set_grads_ready_hook(std::function<void(int first, int end)> hook) { grads_ready_ = std::move(hook); }
  // Called by forward before it reads parameters [first, end) of the table (in increasing ranges
  // covering the table): data parallelism waits there for parameters still being all-gathered.
  void set_params_needed_hook(std::function<void(int first, int end)> hook) { params_needed_ = std::move(hook); }
  // The fingerprint's hash of the parameters and, for MoE models, the expert biases (state the
  // optimizer does not own): BlockHasher over each parameter's values in table order, then each
  // layer's expert biases. From `param_blocks`, the parameters' (hash, length) block pairs in that
  // order (ShardHashes::params(), taken in the update), or with none from param_block_hashes().
  uint64_t state_hash() const { return state_hash(param_block_hashes()); }
  uint64_t state_hash(const std::vector<uint64_t>& param_blocks) const;
  // The same over the dense parameters and expert biases only (experts = false) or the experts'
  // parameters only (true): the state the dense / expert data-parallel replicas share.
  uint64_t state_hash(const std::vector<uint64_t>& param_blocks, bool experts) const;
  // The parameters' block pairs in one pass of their own.
  std::vector<uint64_t> param_block_hashes() const;
  // Every MoE layer: decoder layer l's at l (null where dense or not on this pipeline stage), then
  // the MTP depths' (model/mtp.h) on the last stage.
  const std::vector<MoeLayer*>& moe_layers() const { return moe_all_; }
  // The model's state for checkpoints (core/state_shard.h): the parameters (ParamStore::
  // state_shards: dp_first, tp_first say whether this rank is the first replica that writes them)
  // and the MoE expert biases (replicated: written by the first replica). Delayed scaling's amax
  // histories and scales are reduced over each tensor's group (in either mode: tp x dp x cp for a
  // dense tensor, etp x edp for an expert), so every rank holding a tensor holds the same history:
  // whole tensors "buffer/fp8.<tensor>.amax_history" (history) and "buffer/fp8.<tensor>.scale" (1),
  // an expert named by its index in the layer, written by the first replica (etp_first: the first
  // expert-tensor-parallel rank), as in the single process; any layout reads them back.
  void state_shards(std::vector<StateShard>& out, bool dp_first, bool tp_first, bool edp_first = true,
                    bool etp_first = true);

  // Pipeline parallelism. Chunk c of this rank, one micro-batch (micro: its index among this
  // rank's micro-batches of the step), under the selected slot. forward_chunk: input from
  // chunk_input(c) (or the embedding of tokens on the first chunk of the first stage), output in
  // chunk_output(c). backward_chunk: the output gradient from chunk_output_grad(c) (or the loss
  // on the last chunk of the last stage, whose mean LM loss it returns; 0 elsewhere), the input
  // gradient in chunk_input_grad() (valid until the next backward_chunk). Each buffer is
  // activation_floats() floats: this rank's rows of the (B x T, C) residual stream.
  int num_chunks() const override { return static_cast<int>(part_.chunks.size()); }
  void select_slot(int k) override;
  float* chunk_input(int c) override { return arena_(resid_[static_cast<size_t>(part_.chunks[c].first)]); }
  const float* chunk_output(int c) const override {
    return arena_(resid_[static_cast<size_t>(part_.chunks[c].second)]);
  }
  float* chunk_output_grad(int c) override { return arena_(grad_in_[static_cast<size_t>(c)]); }
  const float* chunk_input_grad() const override { return arena_(dresid_); }
  int64_t activation_floats() const override { return Nl_ * C_; }
  void forward_chunk(int c, const int32_t* tokens, int64_t micro, bool training = true) override;
  double backward_chunk(int c, const int32_t* tokens, const int32_t* targets, float grad_scale, int64_t micro) override;
  // Forward only, on the last stage after its last chunk's forward_chunk(training = false): the
  // mean LM loss (mtp_loss() too).
  double evaluate_head(const int32_t* tokens, const int32_t* targets) override;
  // Before an evaluation's forwards: the bf16 weights are refreshed, no step statistics.
  void begin_evaluation() override;
  // Bytes of activation memory held now: the slots the schedule used (one micro-batch's saved
  // activations each) and the backward scratch.
  int64_t activation_bytes_held() const { return arena_.allocated_floats() * 4; }
  int64_t slot_activation_bytes() const { return arena_.total_floats() * 4; }
  int activation_slots() const { return arena_.slots(); }
  // The table index range of the parameters shared with another stage (the embedding on the first
  // stage, its copies on the last): their gradients are summed over the pair before the update.
  std::vector<int> shared_params() const override;
  // StagePart::split_embedding: the (owner, copy) pairs this rank holds both of; sum_split_grads makes
  // both gradients owner's + copy's, as Pipeline::sum_shared_grads does across stages.
  std::vector<std::pair<int, int>> split_params() const;
  void sum_split_grads();

  ParamStore& params() override { return params_; }
  Device& device() const { return *device_; }
  const ParamStore& params() const { return params_; }
  // determinism = "layout", from the grads-ready hook: parameters [first, end) of the micro-batch
  // whose backward just reported them become its whole gradient, before it is the micro-batch's
  // leaf of the data-parallel tree: the sequence-parallel ones summed over tp
  // (reduce_sequence_parallel_grads), context parallelism's token pieces combined
  // (combine_token_pieces, with the scratch fold_token_pieces uses too).
  void complete_micro_batch_grads(int first, int end);
  // Model FLOPs per token for forward + backward: 6 x (matmul parameters) + 6 x L x T x C for
  // causal attention (QK^T and PV over T/2 keys on average).
  double flops_per_token() const;
  // The module names a training micro-batch's forward traces on this rank (core/trace.h), in
  // execution order: what debug.inject_ulp may name, known before anything runs.
  std::vector<std::string> module_names() const;
  int64_t activation_bytes() const {
    return (arena_.total_floats() + arena_.scratch_floats() + arena_.recompute_floats()) * 4;
  }

  // layout_token_segments: the head's weight gradient, planned once (plan_head in gpt.cpp): row chunks
  // of at most head_rows_ that end on a segment bound (or inside a segment longer than a chunk), and
  // each chunk's products into the gradient. head_leaf_: a leaf (a segment's or a block's tree) and
  // the tree's partial sums of levels head_first_level_ and up (the lowest a push uses: a long
  // segment's part pushes at level 0), none when every product is a whole piece.
  struct HeadStep {
    int64_t b0, end;  // rows [b0, end): `count` segments of piece `piece` from its segment c, or a part of one
    int64_t piece, c, count;
    std::vector<int64_t> bounds;  // the block's segment bounds relative to b0 (k_segments), when whole or count > 1
    bool whole;                   // a whole piece: C = C + the tree over its segments, in the product
    bool accumulate;              // a later part of a segment longer than a chunk
    bool push;                    // completes a block (or a long segment): pushed through the piece's tree
    bool last;                    // with push: the piece's last block, whose root is added to its gradient
  };
  struct HeadChunk {
    int64_t r0, rows;
    std::vector<HeadStep> steps;
  };
  // The plan for N rows of segment bounds wseg (S + 1), per_piece segments a piece (a pure function:
  // tests check its invariants).
  static std::vector<HeadChunk> plan_head(int64_t N, int64_t head_rows, const std::vector<int64_t>& wseg,
                                          int64_t per_piece);

 private:
  // Output head + loss over x (N, C) into losses_; with backward, dx (N, C) = d(loss)/dx.
  void head(const float* x, const int32_t* targets, float* dx, bool backward, float grad_scale);
  // The MTP depths after the main head: forward, losses, and with backward their gradients (the
  // depth-1 input's added to d(final norm output)). tokens, targets: the whole micro-batch's (B,
  // seq_length); the shifted ids cross the context-parallel ranks' chunks, so each depth's are
  // shifted over the whole sequence and this rank's positions taken.
  void mtp(const int32_t* tokens, const int32_t* targets, bool backward, float aux_scale);

  std::unique_ptr<Device> own_device_;
  Device* device_;
  ModelConfig m_;
  StagePart part_;
  Precision precision_;
  TensorParallel tp_;
  ContextParallel cp_;
  int64_t B_, T_, C_, V_, L_, N_;  // T_: positions per sample this rank holds (seq_length / cp)
  int64_t Tg_;                     // seq_length
  int64_t heads_width_;            // num_heads x (query + value head size) / 2: the attention core's FLOPs per position
  int64_t Vl_, Nl_;    // this rank's vocabulary rows and residual-stream rows (tensor / sequence parallelism)
  int64_t head_rows_;  // rows of logits per chunk
  // determinism = "layout": the canonical vocabulary segments of the head's input gradient
  // (TensorParallel::k_segments over V; empty under "run").
  std::vector<int64_t> head_segments_;
  ParamStore params_;
  Arena arena_;
  int wte_ = -1, wpe_ = -1, out_ = -1;  // wte_, wpe_: the lookup's (first stage)
  // The word and position embedding the tied head and the MTP depths use (last stage): a copy
  // (GradRole::stage_copy) on a last stage that is not the first or under split_embedding; else
  // wte_, wpe_.
  int head_wte_ = -1, head_wpe_ = -1;
  std::vector<AttentionLayer> attn_;
  std::vector<MlpLayer> mlp_;                   // dense layers (default-constructed on MoE layers)
  std::vector<std::unique_ptr<MoeLayer>> moe_;  // MoE layers (null on dense layers)
  std::vector<MoeLayer*> moe_all_;              // moe_layers()
  Norm final_norm_;
  std::vector<float> rope_cos_, rope_sin_;
  // Activations: resid[l] is layer l's input (N, C), resid[L] the last output; mid[l] the residual
  // between the attention and MLP sublayers (a recompute group's in its region but its input's).
  // Under pipeline parallelism only this rank's layers' entries are reserved; grad_in_[c]: chunk
  // c's output gradient as received from the next stage.
  std::vector<ArenaSlice> resid_, mid_, grad_in_;
  ArenaSlice final_out_, logits_, losses_;
  // layout_token_segments: the head's plan (plan_head), its lowest push level and its leaf (above).
  std::vector<HeadChunk> head_plan_;
  int head_first_level_ = 0;
  ArenaSlice head_leaf_;
  // Tensor parallelism: the embedding's partial lookup and, with sequence parallelism, the gathered
  // final norm output and the head's partial input gradient (each (N, C)); local token ids.
  ArenaSlice emb_partial_, final_full_, head_dfull_;
  std::vector<int32_t> local_tokens_;
  std::vector<float> loss_scratch_;  // vocab_parallel_cross_entropy's
  // Backward scratch, shared by all layers.
  ArenaSlice dresid_, dfinal_, dnorm_, datt_, dqkv_, dact_, dfc_;
  std::vector<int32_t> order_;
  MoeScratch moe_scratch_{};
  ArenaSlice moe_dnorm_, moe_drouter_, moe_dlogits_, moe_dprobs_, moe_drows_, moe_drows_in_, moe_dact_, moe_dfc_,
      sh_dout_, sh_dact_, sh_dfc_, sh_dx_;
  double aux_loss_ = 0;
  ExactSum aux_exact_;
  // Multi-token prediction: depths, their inputs and targets ((D, N) each), backward scratch;
  // context parallelism: a depth's shifted inputs and targets over the whole sequence ((2, B, seq_length)).
  std::vector<std::unique_ptr<MtpLayer>> mtp_;
  std::vector<int32_t> mtp_tokens_, mtp_targets_, mtp_shifted_;
  ArenaSlice mtp_dh_, mtp_dnext_, mtp_dx_, mtp_de_, mtp_dhn_, mtp_demb_;
  double mtp_loss_ = 0;
  ExactSum mtp_aux_exact_;
  // Packed documents: (N) each, filled by forward when the flag is on; null pointers otherwise.
  int32_t eod_ = -1;
  int64_t cp_pad_ = 0;
  std::vector<int32_t> positions_, doc_start_;
  const int32_t* positions() const { return positions_.empty() ? nullptr : positions_.data(); }
  const int32_t* doc_start() const { return doc_start_.empty() ? nullptr : doc_start_.data(); }
  // Packed documents: positions_ and doc_start_ for this micro-batch's tokens (the whole
  // micro-batch's, (B, seq_length)).
  void layout_documents(const int32_t* tokens);
  bool reset_positions_ = false;
  // Context parallelism: positions_ holds the rows' global positions (or their positions in their
  // documents), doc_start_ the whole sequence's (B, seq_length); the micro-batch's positions in
  // documents; this rank's tokens and targets.
  std::vector<int32_t> full_positions_, cp_tokens_, cp_targets_;
  const int32_t* local(const int32_t* global, std::vector<int32_t>& buf) const;
  // The micro-batch's per-token losses (losses_, this rank's rows) summed and divided by `count`
  // (0 when count is 0): this rank's share under context parallelism; with layout_token_segments the
  // whole micro-batch's on cp rank 0, 0 on the others (gathered into cp_losses_).
  double micro_batch_mean(int64_t count) const;
  // The mean LM loss of the micro-batch: over its targets >= 0 (masked positions hold loss 0).
  double lm_loss(const int32_t* targets) const;
  // Context parallelism under layout: the gathered per-token losses (B, Tg) and the gather's buffer.
  mutable std::vector<float> cp_losses_;
  // Context parallelism's token pieces with MTP: the parameters that get several token-segment trees
  // per micro-batch (GradRole::Pieces::model_folds) and their sums so far; fold_pieces(i) folds in i's last tree
  // (nothing for the others).
  std::vector<std::pair<int, std::vector<float>>> folded_;
  std::vector<float> piece_scratch_;  // combine_token_pieces' / fold_token_pieces', kept across calls
  void fold_pieces(int param);
  uint64_t seed_ = 0;
  int64_t step_ = 0, micro_ = 0;
  // The table ranges: the embedding [0, embed_end_), layer l's [layer_first_[l], layer_end_[l])
  // (local layers only), the final norm, head and MTP [head_first_, end).
  std::vector<int> layer_first_, layer_end_;
  int embed_end_ = 0, head_first_ = 0;
  std::function<void(int, int)> grads_ready_, params_needed_;
  // Forward reads parameters [first, end) next: the params-needed hook, then (the chunk's first
  // forward of a step) the refresh of their bf16 copy.
  void need_params(int first, int end, bool stale);
  // Activation recompute: layer l's group [group_start_[l], group_end_[l]) (-1: kept), and the
  // group's forward again (Recompute).
  std::vector<int64_t> group_start_, group_end_;
  void recompute(int64_t first, int64_t end);
  // Selective recompute: whether layer l's MLP or MoE sublayer is replayed before its backward.
  std::vector<char> sublayer_recompute_;
  void recompute_sublayer(int64_t l);
  // Layer l's second sublayer, mid_[l] -> resid_[l + 1] (replay: MoeLayer::forward's).
  void mlp_or_moe_forward(int64_t l, bool training, bool replay);
  std::vector<char> weights_stale_;  // per chunk
  int64_t first_micro_ = 0;
};

}  // namespace lockstep
