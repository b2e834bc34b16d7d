// The training loop: global batch = micro-batch x accumulation steps; AdamW on FP32 master
// weights with global grad-norm clipping; LR schedule; held-out evaluation; live progress;
// metrics.jsonl and fingerprints/rank-NNNNN.jsonl in the run directory.
//
// Determinism (determinism = "run"): the loss, grad norm, parameters and optimizer state of
// every step are a pure function of the config; the thread count changes nothing (checked by
// comparing fingerprint files in tests). determinism = "layout": also the data-parallel size, the
// micro-batches' spread and the process count change nothing (docs/determinism.md).
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "lockstep/comm/mesh.h"
#include "lockstep/config/config.h"
#include "lockstep/core/exact_sum.h"
#include "lockstep/core/state_shard.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/data/dataset.h"
#include "lockstep/kernels/device.h"
#include "lockstep/model/gpt.h"
#include "lockstep/parallel/data_parallel.h"
#include "lockstep/parallel/pipeline/pipeline.h"
#include "lockstep/train/checkpoint.h"
#include "lockstep/train/faults.h"
#include "lockstep/train/fingerprint.h"
#include "lockstep/train/metrics.h"
#include "lockstep/train/module_trace.h"
#include "lockstep/train/optimizer.h"
#include "lockstep/train/parallelize.h"
#include "lockstep/train/run_dir.h"
#include "lockstep/train/stragglers.h"
#include "lockstep/train/tensorboard.h"

namespace lockstep {

struct TrainSummary {
  int64_t steps = 0;
  double first_loss = 0, last_loss = 0;
  double last_eval_loss = -1;  // -1 when no evaluation ran
  double tokens_per_s = 0;     // median over steps after the first
  double mfu = 0;              // against the GEMM peak measured at start
};

// Trains per the config on this rank of `comm`; progress goes to `out` (a live line when it is a
// terminal) from rank 0 only. Rank 0 writes config.toml and metrics.jsonl, every rank its
// fingerprints/rank-NNNNN.jsonl with its mesh coordinates (parallel.* over comm.size()). The ranks
// are data parallel (parallel/data_parallel.h): each takes its own micro-batches of the global
// batch (train.global_batch must divide by train.micro_batch x the data-parallel size), gradients
// are summed over the group, and the replicas check at every step that their parameters and loss
// agree bit for bit (an all-reduce of a checksum).
TrainSummary train(const Config& config, std::FILE* out, Communicator& comm);
// The mesh of world_size ranks for config.parallel, after the checks that depend on the world size
// (the sizes multiply out; the global batch splits over the data-parallel ranks; determinism =
// "layout"'s micro-batch tree). train() calls it on every rank; `lockstep train --nproc N` calls it
// first, so that a bad layout is one error line that no rank's thread raced to report.
Mesh checked_mesh(const Config& config, int world_size);
// The same on one rank (a world of one thread).
TrainSummary train(const Config& config, std::FILE* out);

// One rank's training run; train() constructs one and runs it. The constructor builds the mesh's
// groups and the model, applies the parallel plan to it (parallelize.h), initialises the weights or
// restores a checkpoint, and opens the run directory. run() trains to train.steps, each step:
// forward-backward over the rank's micro-batches, reduce, step the optimizer, evaluate, log, save.
// Every rank of the world does the same collectives in the same order, so every rank constructs a
// Trainer and runs it. Construct and run it on one thread: the constructor binds its thread pool to
// the calling thread.
class Trainer {
 public:
  Trainer(const Config& config, std::FILE* out, Communicator& world);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  TrainSummary run();

 private:
  // Sums over this rank's micro-batches of the LM loss (token-weighted with eod_mask_loss), the aux
  // and the MTP losses; `exact` the same, exactly (layout mode).
  struct LossSums {
    double sums[3] = {0, 0, 0};
    ExactSum exact[3];
  };
  struct StepOutcome {
    StepMetrics metrics;
    StageMetrics stage;  // pipeline parallelism
  };

  // Set-up (trainer.cpp, checkpointing.cpp).
  void restore();
  void init_weights();  // train.init_from (checkpointing.cpp)
  void open_run_dir();
  void print_banner() const;
  std::string checkpoints_root() const { return config_.train.out_dir + "/checkpoints"; }
  uint64_t first_sample_of(int64_t step) const;

  // The step (step.cpp).
  StepOutcome train_step(int64_t step);
  int64_t fetch(uint64_t first_sample, int64_t micro, int32_t* tokens, int32_t* targets) const;
  int64_t count_loss_tokens(uint64_t first_sample);
  LossSums forward_backward(int64_t step, uint64_t first_sample, float grad_scale);
  LossSums forward_backward_pipelined(int64_t step, uint64_t first_sample, float grad_scale, StageMetrics& stage);
  void reduce_grads();
  void reduce_losses(LossSums& sums, int64_t loss_tokens, StepMetrics& m);
  ShardHashes optimizer_step(int64_t step, StepMetrics& m);
  void record_fingerprint(const StepMetrics& m, uint64_t first_sample, const ShardHashes& hashes);
  void write_fingerprint(Fingerprint fp, std::vector<uint64_t> param_blocks);
  void write_pending_fingerprint();
  void check_replicas(Communicator& group, const Fingerprint& fp, uint64_t params);
  int64_t dispatch_total() const;

  // After the step (trainer.cpp, evaluate.cpp, checkpointing.cpp).
  // Returns the first rank whose updated parameters are not finite, -1 if none.
  int log_step(const StepOutcome& outcome);
  // The non-finite guard after a logged step (train.on_nonfinite): throws NonFiniteError to stop.
  void guard_nonfinite(const StepMetrics& m, int nonfinite_rank);
  double evaluate();
  double evaluate_and_log(int64_t step);
  void save_checkpoint(int64_t step, double lr, bool exit_now);

  const Config& config_;
  ParallelGroups groups_;
  Progress progress_;
  const int threads_;  // of this rank's pool: ranks on one machine share its cores
  ThreadPool pool_;
  ThreadPool::Bind bind_pool_;
  // The rank's device: its ops run on the pool bound above; the model's memory comes from it.
  const std::unique_ptr<Device> device_;
  const std::unique_ptr<Dataset> data_;
  GPT model_;
  DataParallel dp_;
  const std::unique_ptr<Pipeline> pipeline_;  // null without pipeline parallelism
  Optimizer optimizer_;

  const int64_t accum_;  // micro-batches per rank and step
  // This rank's micro-batches of the global batch are the step's first_micro_ ... + accum_ - 1: a
  // pure function of (step, dp rank, micro).
  const int64_t first_micro_;
  std::vector<int32_t> tokens_, targets_;  // a micro-batch's (B, T)

  // The state a checkpoint holds, and where the run resumed from.
  std::vector<StateShard> state_;
  std::string resume_dir_;  // empty: a fresh run
  CheckpointInfo resumed_;
  int64_t start_step_ = 1;
  int64_t skipped_steps_ = 0;  // steps whose update the non-finite guard skipped, this run and before

  std::unique_ptr<LineLog> metrics_;  // rank 0's metrics.jsonl
  // Rank 0's TensorBoard events file (train.tensorboard): the lines of metrics.jsonl.
  std::unique_ptr<TensorBoardWriter> tensorboard_;
  std::unique_ptr<LineLog> fingerprints_;
  std::unique_ptr<CheckpointSaver> saver_;
  std::unique_ptr<StepTrace> trace_;
  // With the parameter gather overlapped, a step's parameters are complete once the next step's first
  // forward has run: its fingerprint waits until then.
  std::optional<Fingerprint> pending_fingerprint_;

  double peak_gflops_ = 0;
  double flops_per_token_ = 0;  // of the whole model (every pipeline stage's part)
  std::vector<double> step_seconds_;
  // Bytes this rank's token dispatchers had sent at the last step (training steps only: evaluation's
  // are skipped).
  int64_t dispatch_bytes_before_ = 0;
  TrainSummary summary_;
  FaultInjector faults_;  // debug.fail_*, debug.slow_*
  StragglerWatch stragglers_;
};

}  // namespace lockstep
