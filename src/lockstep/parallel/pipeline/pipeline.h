// Pipeline parallelism: the model's layers split over the ranks of the pipeline group, one step's
// micro-batches run through them by a schedule (schedule.h).
//
// Layout: parallel.pipeline x parallel.virtual_pipeline model chunks, with the layers of
// ParallelConfig::chunk_layers; pipeline rank r holds model chunks r, r + p, r + 2p, ... The first
// stage also holds the embedding, the last the final norm, the output head, the loss and the MTP
// depths (Megatron's pre_process / post_process). A last stage that needs the word embedding (tied
// head, MTP) keeps a copy, summed with the first stage's gradient before the update
// (sum_shared_grads: the embedding group, first + last stage, so both copies get the same bits;
// `run` mode sums before the data-parallel reduction, `layout` mode after it: each stage's part is
// then its own canonical tree over micro-batches, docs/design/reductions.md#the-shared-word-embedding).
//
// Context parallelism: each stage's ranks form their own cp groups (a pipeline group links ranks
// with equal tp, cp and dp coordinates); fetch gives every rank the whole micro-batch and the model
// takes its positions, so what passes between stages is the rank's rows of the stream (B x T / cp).
//
// Communication: after each action a rank posts one batch (Communicator::send_recv_batch_async)
// with what the action produced (a chunk's output to the next stage, an input gradient to the
// previous one) and what its next action needs, then waits for it; messages are tagged by the
// receiving model chunk and direction. A stage's batch meets its neighbours' mirrored batches (the
// send_forward_recv_backward / send_backward_recv_forward pairs of Megatron's 1F1B), so neither side
// waits on a send the other has not reached.
//
// Determinism: a micro-batch's forward and backward do the same arithmetic on every schedule and
// every layout of the stages; parameter gradients accumulate over micro-batches in micro-batch
// order, as on one rank (under determinism = "layout" each micro-batch's gradient is pushed as its
// leaf of the canonical tree as the chunk's backward reports it: the tree is fed per micro-batch
// index whatever the schedule). What differs from one rank under `run`: sums over stages (the MoE
// aux loss, the gradient norm, the tied embedding's two gradient halves) are folded stage by stage.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "lockstep/config/config.h"
#include "lockstep/parallel/pipeline/schedule.h"
#include "lockstep/parallel/pipeline/stage.h"

namespace lockstep {

class Communicator;

// The part of the model pipeline rank `stage` builds.
StagePart pipeline_part(const ParallelConfig& pc, int64_t num_layers, int stage);

class Pipeline {
 public:
  // pp: the pipeline group (rank = stage). micro_batches: per rank and step; tokens: per micro-batch.
  Pipeline(Communicator& pp, const ParallelConfig& pc, int64_t micro_batches, int64_t tokens);

  // Fills micro-batch `micro`'s tokens and targets (B, T); returns its tokens that carry a loss.
  using Fetch = std::function<int64_t(int64_t micro, int32_t* tokens, int32_t* targets)>;
  struct StepResult {
    std::vector<double> lm_loss;           // per micro-batch: its mean LM loss (last stage; 0 elsewhere)
    std::vector<int64_t> counted;          // per micro-batch: fetch's count
    double aux_loss = 0, mtp_loss = 0;     // summed over micro-batches (this stage's layers)
    ExactSum aux_exact, mtp_exact;         // the same, exactly (determinism = "layout")
    double seconds = 0, wait_seconds = 0;  // the schedule's time, and the part spent waiting for messages
  };
  // One step's forwards and backwards. before_last_backward runs before the first backward of the
  // rank's last micro-batch (data parallelism arms its bucket reduction there); in_final_backward()
  // tells a grads-ready hook whether the backward running now is a chunk's last of the step.
  StepResult run_step(PipelineStage& model, float grad_scale, const Fetch& fetch,
                      const std::function<void()>& before_last_backward);
  bool in_final_backward() const { return final_backward_; }
  // The micro-batch (0 .. micro_batches - 1) whose backward is running now.
  int64_t backward_micro() const { return backward_micro_; }
  // Forward only, one micro-batch through every stage: the mean LM loss on the last stage, 0 elsewhere.
  double evaluate(PipelineStage& model, const int32_t* tokens, const int32_t* targets);
  // The embedding group: the shared parameters' gradients (GPT::shared_params) become the first
  // stage's plus the last stage's, on both (each needs them whole: under the distributed optimizer
  // in layout mode, after the reduction, DataParallel::set_full_grads).
  void sum_shared_grads(PipelineStage& model);

  const std::vector<PipelineAction>& actions() const { return actions_; }
  int64_t max_in_flight() const { return in_flight_; }

 private:
  Communicator& pp_;
  int p_, v_, stage_;
  int64_t m_, tokens_per_micro_, in_flight_;
  std::vector<PipelineAction> actions_;
  std::vector<std::vector<int32_t>> tokens_, targets_;  // per slot
  bool final_backward_ = false;
  int64_t backward_micro_ = -1;
  int64_t model_chunk(int c) const { return static_cast<int64_t>(c) * p_ + stage_; }
  int slot(int64_t micro) const { return static_cast<int>(micro % in_flight_); }
};

}  // namespace lockstep
