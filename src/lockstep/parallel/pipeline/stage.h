// What a pipeline schedule drives (pipeline.h): one rank's part of the model, run one model chunk
// of one micro-batch at a time. The model implements it (model/gpt.h); the pipeline knows nothing
// else of the model.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "lockstep/core/exact_sum.h"

namespace lockstep {

class ParamStore;

// The part of the model a rank builds. Default: the whole model.
struct StagePart {
  std::vector<std::pair<int64_t, int64_t>> chunks;  // [first, end) global layers of each local chunk; {} = all
  bool first = true;                                // the embedding (before chunk 0)
  bool last = true;                                 // the final norm, head, loss and MTP depths (after the last chunk)
  // determinism = "layout", a part that is first and last (one stage): the head and the MTP depths
  // use their own copy of the word (and position) embedding, as a pipeline's last stage does, so
  // that the lookups' gradient and theirs are summed over micro-batches apart and added after the
  // data-parallel reduction (sum_split_grads), as the stages of a pipeline add theirs.
  bool split_embedding = false;
};

class PipelineStage {
 public:
  virtual ~PipelineStage() = default;
  // Chunk c of this rank, one micro-batch (micro: its index among this rank's micro-batches of the
  // step), under the selected activation slot (one per micro-batch in flight). forward_chunk: input
  // from chunk_input(c) (or the embedding of tokens on the first chunk of the first stage), output
  // in chunk_output(c). backward_chunk: the output gradient from chunk_output_grad(c) (or the loss
  // on the last chunk of the last stage, whose mean LM loss it returns; 0 elsewhere), the input
  // gradient in chunk_input_grad() (valid until the next backward_chunk). Each buffer is
  // activation_floats() floats: this rank's rows of the (B x T, C) residual stream.
  virtual int num_chunks() const = 0;
  virtual void select_slot(int k) = 0;
  virtual float* chunk_input(int c) = 0;
  virtual const float* chunk_output(int c) const = 0;
  virtual float* chunk_output_grad(int c) = 0;
  virtual const float* chunk_input_grad() const = 0;
  virtual int64_t activation_floats() const = 0;
  virtual void forward_chunk(int c, const int32_t* tokens, int64_t micro, bool training = true) = 0;
  virtual double backward_chunk(int c, const int32_t* tokens, const int32_t* targets, float grad_scale,
                                int64_t micro) = 0;
  // The last forward_chunk's MoE aux loss (and exactly), the last backward_chunk's MTP loss and the
  // aux loss of its MTP depths' MoE sublayers (last stage, last chunk; exactly too).
  virtual double aux_loss() const = 0;
  virtual const ExactSum& aux_loss_exact() const = 0;
  virtual double mtp_loss() const = 0;
  virtual double mtp_aux_loss() const = 0;
  virtual const ExactSum& mtp_aux_loss_exact() const = 0;
  // Before an evaluation's forwards; after the last chunk's forward_chunk(training = false) on the
  // last stage: the mean LM loss (mtp_loss() too).
  virtual void begin_evaluation() = 0;
  virtual double evaluate_head(const int32_t* tokens, const int32_t* targets) = 0;
  // The parameters, and the indices of those shared with another stage (the embedding on the first
  // stage, its copies on the last): their gradients are summed over the pair before the update.
  virtual ParamStore& params() = 0;
  virtual std::vector<int> shared_params() const = 0;
};

}  // namespace lockstep
