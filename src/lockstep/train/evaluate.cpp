// Held-out evaluation (train.eval_interval, train.eval_batches).
#include "lockstep/comm/communicator.h"
#include "lockstep/data/documents.h"
#include "lockstep/train/trainer.h"

namespace lockstep {

// Data-parallel ranks evaluate every dp_size-th batch; the mean is over all of them. Under expert
// (tensor) parallelism every forward is collective over the ep / etp group, whose ranks may be
// different data-parallel ranks, so each rank runs as many forwards as the busiest one (the extra
// ones count nothing).
double Trainer::evaluate() {
  const TrainConfig& tc = config_.train;
  const DataConfig& dc = config_.data;
  const int64_t dp_size = groups_.mesh.dp(), B = tc.micro_batch, N = B * config_.model.seq_length;
  double sum = 0;
  ExactSum exact;
  const int64_t rounds = groups_.experts_split() ? (tc.eval_batches + dp_size - 1) / dp_size : 0;
  for (int64_t i = groups_.coords.dp, round = 0; i < tc.eval_batches || round < rounds; i += dp_size, ++round) {
    const bool counted = i < tc.eval_batches;
    data_->batch(tokens_.data(), targets_.data(), Split::eval, static_cast<uint64_t>((counted ? i : 0) * B), B);
    if (dc.eod_mask_loss) mask_eod_targets(targets_.data(), tokens_.data(), N, static_cast<int32_t>(dc.eod_token));
    const double loss = pipeline_ ? pipeline_->evaluate(model_, tokens_.data(), targets_.data())
                                  : model_.evaluate(tokens_.data(), targets_.data());
    if (counted) sum += loss, exact.add(loss);
  }
  Communicator& pp = groups_.pp_group;
  Communicator& dense_dp = groups_.dense_dp;
  if (pipeline_) pp.all_reduce(&sum, 1);  // the last stage's losses
  if (config_.determinism == "layout") {
    if (pipeline_) all_reduce_exact(pp, &exact, 1);
    all_reduce_exact(dense_dp, &exact, 1);
    sum = exact.value();
  } else if (dense_dp.size() > 1) {
    dense_dp.all_reduce(&sum, 1);
  }
  return sum / static_cast<double>(tc.eval_batches);
}

// Evaluates the parameters of step `step` and writes the loss to metrics.jsonl (and TensorBoard).
double Trainer::evaluate_and_log(int64_t step) {
  dp_.wait_params();
  const double loss = evaluate();
  device_->take_host_syncs();  // evaluation's are not the next step's
  dispatch_bytes_before_ = dispatch_total();
  summary_.last_eval_loss = loss;
  const std::string line = JsonLine().add("step", step).add("eval_loss", loss, 9).str();
  if (metrics_) metrics_->write(line);
  if (tensorboard_) tensorboard_->write(line);
  return loss;
}

}  // namespace lockstep
