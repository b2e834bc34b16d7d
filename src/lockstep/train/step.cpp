// One training step (Trainer::train_step): forward-backward over this rank's micro-batches, the
// gradient and loss reductions, the optimizer step, and the step's fingerprint.
#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>

#include "lockstep/comm/communicator.h"
#include "lockstep/core/hash.h"
#include "lockstep/core/trace.h"
#include "lockstep/data/documents.h"
#include "lockstep/parallel/tensor_parallel.h"
#include "lockstep/train/lr_schedule.h"
#include "lockstep/train/trainer.h"

namespace lockstep {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

}  // namespace

Trainer::StepOutcome Trainer::train_step(int64_t step) {
  const TrainConfig& tc = config_.train;
  const auto t0 = Clock::now();
  const int64_t tp_bytes_before = groups_.tp_group.bytes_sent(), etp_bytes_before = groups_.etp_group.bytes_sent(),
                cp_bytes_before = groups_.cp_bytes_sent();
  const double wait_before = groups_.world.wait_seconds();
  model_.params().zero_grads();
  const uint64_t first_sample = first_sample_of(step);
  const int64_t loss_tokens = count_loss_tokens(first_sample);
  const float grad_scale = 1.0f / static_cast<float>(std::max<int64_t>(loss_tokens, 1));
  model_.begin_step(tc.seed, step, first_micro_);
  StepOutcome outcome;
  StepMetrics& m = outcome.metrics;
  m.step = step;
  if (config_.data.masked_targets()) m.loss_tokens = loss_tokens;
  LossSums sums = pipeline_ ? forward_backward_pipelined(step, first_sample, grad_scale, outcome.stage)
                            : forward_backward(step, first_sample, grad_scale);
  faults_.in_step(step);
  reduce_grads();
  reduce_losses(sums, loss_tokens, m);
  const ShardHashes hashes = optimizer_step(step, m);
  Communicator* dense_dp = groups_.dense_dp.size() > 1 ? &groups_.dense_dp : nullptr;
  // A skipped step updates no state: the expert biases neither.
  m.moe = model_.finish_step(m.nonfinite.empty() ? config_.moe.router_bias_update_rate : 0.0, dense_dp);
  m.seconds = seconds_since(t0);
  m.comm_wait_seconds = groups_.world.wait_seconds() - wait_before;
  if (step > start_step_ || start_step_ == tc.steps) step_seconds_.push_back(m.seconds);
  const int64_t dispatch_bytes = dispatch_total() - dispatch_bytes_before_;  // this step's
  dispatch_bytes_before_ += dispatch_bytes;
  record_fingerprint(m, first_sample, hashes);

  m.tokens_per_s = static_cast<double>(tc.global_batch * config_.model.seq_length) / m.seconds;
  m.mfu = peak_gflops_ > 0 ? m.tokens_per_s * flops_per_token_ / (peak_gflops_ * 1e9) : 0;
  if (groups_.tp.on()) m.tp_bytes = groups_.tp_group.bytes_sent() - tp_bytes_before;
  if (groups_.ep()) m.ep_bytes = dispatch_bytes;
  if (groups_.etp()) m.etp_bytes = groups_.etp_group.bytes_sent() - etp_bytes_before;
  if (groups_.cp.on()) m.cp_bytes = groups_.cp_bytes_sent() - cp_bytes_before;
  if (pipeline_) {
    outcome.stage.in_flight = static_cast<double>(model_.activation_slots());
    outcome.stage.activation_mb = static_cast<double>(model_.activation_bytes_held()) / (1 << 20);
    outcome.stage.slot_mb = static_cast<double>(model_.slot_activation_bytes()) / (1 << 20);
  }
  return outcome;
}

// Returns the micro-batch's tokens that carry a loss.
int64_t Trainer::fetch(uint64_t first_sample, int64_t micro, int32_t* tokens, int32_t* targets) const {
  const int64_t B = config_.train.micro_batch, N = B * config_.model.seq_length;
  data_->batch(tokens, targets, Split::train, first_sample + static_cast<uint64_t>((first_micro_ + micro) * B), B);
  const DataConfig& dc = config_.data;
  if (dc.eod_mask_loss) return mask_eod_targets(targets, tokens, N, static_cast<int32_t>(dc.eod_token));
  return dc.thd() ? count_targets(targets, N) : N;  // packed documents: no target across them or on padding
}

// The loss is the mean over the global batch's unmasked tokens, so they are counted (over every
// data-parallel rank) before any backward (the loader is a pure function of the sample index:
// fetching twice is exact).
int64_t Trainer::count_loss_tokens(uint64_t first_sample) {
  const int64_t dp_size = groups_.mesh.dp();
  int64_t loss_tokens = config_.train.micro_batch * config_.model.seq_length * accum_ * dp_size;
  if (config_.data.masked_targets()) {
    loss_tokens = 0;
    for (int64_t micro = 0; micro < accum_; ++micro)
      loss_tokens += fetch(first_sample, micro, tokens_.data(), targets_.data());
    if (dp_size > 1) groups_.dp_group.all_reduce(&loss_tokens, 1);
  }
  return loss_tokens;
}

Trainer::LossSums Trainer::forward_backward(int64_t step, uint64_t first_sample, float grad_scale) {
  LossSums s;
  const bool per_token = config_.data.masked_targets();
  // Every rank of a cp group computes the whole micro-batch's aux losses: counted once, on cp rank 0.
  const bool aux_here = groups_.coords.cp == 0;
  for (int64_t micro = 0; micro < accum_; ++micro) {
    const int64_t counted = fetch(first_sample, micro, tokens_.data(), targets_.data());
    dp_.begin_micro(micro);
    if (micro == accum_ - 1) dp_.begin_last_micro();
    trace_->set_position(step, micro);
    double micro_loss = 0;
    {
      ModuleTrace::Bind bind_trace(trace_->get());
      micro_loss = model_.forward_backward(tokens_.data(), targets_.data(), grad_scale);
    }
    trace_->after_traced(step == start_step_);
    write_pending_fingerprint();
    const double micro_sums[3] = {per_token ? micro_loss * static_cast<double>(counted) : micro_loss,
                                  aux_here ? model_.aux_loss() : 0.0, model_.mtp_loss()};
    for (int k = 0; k < 3; ++k) s.sums[k] += micro_sums[k];
    // The aux losses layer by layer, as pipeline stages that hold some of the layers add them.
    s.exact[0].add(micro_sums[0]);
    if (aux_here) s.exact[1].merge(model_.aux_loss_exact());
    s.exact[2].add(micro_sums[2]);
  }
  return s;
}

Trainer::LossSums Trainer::forward_backward_pipelined(int64_t step, uint64_t first_sample, float grad_scale,
                                                      StageMetrics& stage) {
  LossSums s;
  const bool per_token = config_.data.masked_targets();
  const bool aux_here = groups_.coords.cp == 0;
  trace_->set_position(step, 0);
  Pipeline::StepResult piped;
  {
    ModuleTrace::Bind bind_trace(trace_->get());
    piped = pipeline_->run_step(
        model_, grad_scale,
        [this, first_sample](int64_t micro, int32_t* tok, int32_t* tgt) {
          return fetch(first_sample, micro, tok, tgt);
        },
        [this] { dp_.begin_last_micro(); });
  }
  trace_->after_traced(step == start_step_);
  for (int64_t micro = 0; micro < accum_; ++micro) {
    const double lm = piped.lm_loss[static_cast<size_t>(micro)];
    const double term = per_token ? lm * static_cast<double>(piped.counted[static_cast<size_t>(micro)]) : lm;
    s.sums[0] += term;
    s.exact[0].add(term);  // 0 on the stages without the head
  }
  s.sums[1] = aux_here ? piped.aux_loss : 0.0;
  s.sums[2] = piped.mtp_loss;
  if (aux_here) s.exact[1] = piped.aux_exact;
  s.exact[2] = piped.mtp_exact;
  if (config_.determinism != "layout") {
    pipeline_->sum_shared_grads(model_);
    for (int i : model_.shared_params()) dp_.post_ready(i, i + 1);
  }
  write_pending_fingerprint();
  stage.wait_fraction = piped.seconds > 0 ? piped.wait_seconds / piped.seconds : 0.0;
  return s;
}

void Trainer::reduce_grads() {
  const bool layout = config_.determinism == "layout";
  dp_.finish_grad_sync();
  // Layout mode: the word (and position) embedding's lookup part and its head / MTP part, each the
  // canonical tree over the step's micro-batches, are added now
  // (docs/design/reductions.md#the-shared-word-embedding).
  if (layout && pipeline_) pipeline_->sum_shared_grads(model_);
  if (layout) model_.sum_split_grads();
  if (!layout)
    reduce_sequence_parallel_grads(groups_.tp, model_.params());  // layout: per micro-batch, in the grads-ready hook
}

void Trainer::reduce_losses(LossSums& s, int64_t loss_tokens, StepMetrics& m) {
  Communicator& pp = groups_.pp_group;
  Communicator& dense_dp = groups_.dense_dp;
  if (pipeline_) pp.all_reduce(s.sums, 3);  // the LM and MTP losses of the last stage, each stage's aux losses
  if (config_.determinism == "layout") {
    if (pipeline_) all_reduce_exact(pp, s.exact, 3);
    all_reduce_exact(dense_dp, s.exact, 3);
    for (int k = 0; k < 3; ++k) s.sums[k] = s.exact[k].value();
  } else if (dense_dp.size() > 1) {
    dense_dp.all_reduce(s.sums, 3);
  }
  const double micros = static_cast<double>(accum_ * groups_.mesh.dp());
  m.lm_loss =
      s.sums[0] / (config_.data.masked_targets() ? static_cast<double>(std::max<int64_t>(loss_tokens, 1)) : micros);
  m.aux_loss = s.sums[1] / micros;
  m.mtp_loss = s.sums[2] / micros;
  // The training loss: Megatron adds each micro-batch's aux (and MTP) losses with weight 1 / micro-batches.
  m.loss = m.lm_loss + m.aux_loss + m.mtp_loss;
}

// AdamW on the reduced gradients, clipped by their global norm. Returns the fingerprint's hashes of
// the summed gradients and the moments of this rank's shard (the same elements with either
// optimizer), and with the replicated optimizer of every parameter, taken in the update's pass.
ShardHashes Trainer::optimizer_step(int64_t step, StepMetrics& m) {
  m.lr = learning_rate(config_.train, step);
  m.grad_norm = dp_.grad_norm();
  ShardHashes hashes(dp_.shard(), dp_.updates_whole() ? &model_.params() : nullptr);
  // The loss and the grad norm are the same on every rank, so every rank takes the same branch.
  m.nonfinite = !std::isfinite(m.loss) ? "loss" : !std::isfinite(m.grad_norm) ? "grad_norm" : "";
  if (!m.nonfinite.empty()) {
    // Skipped (or, with "stop", the last step): the state stays as it is; its hashes are taken as is.
    ++skipped_steps_;
    m.skipped_steps = skipped_steps_;
    dp_.step([&](const std::vector<ParamRange>& ranges) { optimizer_.hash_state(model_.params(), ranges, hashes); });
    return hashes;
  }
  m.skipped_steps = skipped_steps_;
  const float clip = optimizer_.clip_scale(m.grad_norm);
  const int64_t adam_step = step - skipped_steps_;  // Adam's step count leaves out the skipped steps
  dp_.step([&](const std::vector<ParamRange>& ranges) {
    m.params_nonfinite |= optimizer_.update(model_.params(), adam_step, m.lr, clip, ranges, &hashes);
  });
  return hashes;
}

void Trainer::record_fingerprint(const StepMetrics& m, uint64_t first_sample, const ShardHashes& hashes) {
  const TrainConfig& tc = config_.train;
  Fingerprint fp;
  fp.step = m.step;
  fp.loss = m.loss;
  fp.lm_loss = m.lm_loss;
  fp.aux_loss = m.aux_loss;
  fp.mtp_loss = m.mtp_loss;
  fp.grad_norm = m.grad_norm;
  fp.lr = m.lr;
  fp.grads = hashes.grads();
  fp.optimizer = hashes.moments();
  // The random state of a step: the seed and where the data stream stands.
  const uint64_t rng_state[2] = {tc.seed, first_sample + static_cast<uint64_t>(tc.global_batch)};
  fp.rng = hash_bytes(rng_state, sizeof rng_state);
  const MeshCoordinates& c = groups_.coords;
  fp.rank = groups_.world.rank(), fp.dp = c.dp, fp.tp = c.tp, fp.pp = c.pp, fp.ep = c.ep, fp.cp = c.cp;
  fp.etp = c.etp;
  const bool gather_in_background = config_.optimizer.distributed && config_.ddp.overlap_param_gather;
  if (gather_in_background && m.step < tc.steps)
    pending_fingerprint_ = fp;
  else
    write_fingerprint(fp, hashes.has_params() ? hashes.params() : std::vector<uint64_t>{});
}

void Trainer::write_pending_fingerprint() {
  if (!pending_fingerprint_) return;
  write_fingerprint(*pending_fingerprint_, {});
  pending_fingerprint_.reset();
}

// Writes a step's fingerprint line once the parameters are complete. Data-parallel replicas hold
// the same parameters, expert biases and loss, bit for bit. Under expert parallelism the dense
// replicas (dp) hold different experts: the dense part is compared over dp, the experts over edp.
// param_blocks: the parameters' block hashes taken in the update (the replicated optimizer), or
// empty for a pass over them here (the distributed one: complete only after the all-gather).
void Trainer::write_fingerprint(Fingerprint fp, std::vector<uint64_t> param_blocks) {
  device_->host_sync("fingerprint");
  dp_.wait_params();
  if (param_blocks.empty()) param_blocks = model_.param_block_hashes();
  fp.params = model_.state_hash(param_blocks);
  fingerprints_->write(fp.json());
  if (!groups_.experts_split()) {
    check_replicas(groups_.dense_dp, fp, fp.params);
  } else {
    check_replicas(groups_.dense_dp, fp, model_.state_hash(param_blocks, /*experts=*/false));
    check_replicas(groups_.expert_dp, fp, model_.state_hash(param_blocks, /*experts=*/true));
  }
}

// The replicas agree exactly when max(h) and max(~h) over the group are h and ~h (one tiny all-reduce).
void Trainer::check_replicas(Communicator& group, const Fingerprint& fp, uint64_t params) {
  if (group.size() == 1) return;
  const uint64_t fields[] = {params, std::bit_cast<uint64_t>(fp.loss), std::bit_cast<uint64_t>(fp.grad_norm)};
  const uint64_t h = hash_bytes(fields, sizeof fields);
  uint64_t agree[2] = {h, ~h};
  group.all_reduce(agree, 2, ReduceOp::max);
  if (agree[0] != h || agree[1] != ~h)
    throw CommError(str("rank ", groups_.world.rank(), ": step ", fp.step,
                        ": the data-parallel replicas' parameters or loss differ"));
}

// Bytes this rank's token dispatchers have sent.
int64_t Trainer::dispatch_total() const {
  int64_t n = 0;
  for (const auto& layer : model_.moe_layers())
    if (layer) n += layer->dispatch_bytes_sent();
  return n;
}

}  // namespace lockstep
