// What a run reports about itself: the GEMM peak that MFU is measured against, a step's line of
// metrics.jsonl, and the progress lines on the terminal (rank 0's).
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "lockstep/comm/communicator.h"
#include "lockstep/config/config.h"
#include "lockstep/kernels/device.h"
#include "lockstep/model/moe/moe_layer.h"
#include "lockstep/train/json_line.h"

namespace lockstep {

struct TrainSummary;

// Best GFLOP/s of a square GEMM on the current thread pool, measured once per process and pool size.
double measure_gemm_peak(const Ops& ops);

// A step's metrics as the trainer measured them.
struct StepMetrics {
  int64_t step = 0;
  double loss = 0, lm_loss = 0, aux_loss = 0, mtp_loss = 0, grad_norm = 0, lr = 0;
  double seconds = 0, tokens_per_s = 0, mfu = 0;
  double comm_wait_seconds = 0;    // of this rank's step, blocked in communication (Communicator::wait_seconds)
  std::vector<MoeTokenStats> moe;  // per MoE layer: tokens each expert processed
  // Bytes rank 0 sent this step: in its tp group; by its token dispatchers (expert parallelism); in
  // its etp and cp groups. -1 where that parallelism is off.
  int64_t tp_bytes = -1, ep_bytes = -1, etp_bytes = -1, cp_bytes = -1;
  // The global batch's tokens with a target (data.eod_mask_loss, data.packing = "thd"); -1 otherwise.
  int64_t loss_tokens = -1;
  // The non-finite guard (train.on_nonfinite): the quantity that was not finite ("loss",
  // "grad_norm"; empty: none), in which case the step was skipped (no update); the run's skipped
  // steps so far; whether an updated parameter of this rank is not finite.
  std::string nonfinite;
  int64_t skipped_steps = 0;
  bool params_nonfinite = false;
};

// The step's line of metrics.jsonl up to its per-stage and per-rank fields, with this process's
// peak resident memory (read now).
JsonLine metrics_line(const StepMetrics& m);

// A pipeline stage's step: the fraction of the schedule spent waiting for messages, the micro-batches
// whose activations it held at once (arena slots), the activation memory (those slots plus backward
// scratch) and one micro-batch's saved activations (a slot), in MiB.
struct StageMetrics {
  double wait_fraction = 0, in_flight = 0, activation_mb = 0, slot_mb = 0;
};
// Adds every stage's StageMetrics as "pp.<stage>.*" (an all-gather over the pipeline group).
void add_stage_metrics(JsonLine& line, Communicator& pp, const StageMetrics& mine);
// Every rank's step time and time waiting in collectives, in rank order, and the first rank whose
// updated parameters are not finite (StepMetrics::params_nonfinite; -1 if none).
struct RankTimes {
  std::vector<double> step_ms, comm_wait_ms;
  int first_nonfinite = -1;
};
// Adds every rank's device memory high-water mark, step time and time waiting in collectives (m, this
// rank's), and the most host syncs of any rank this step (kernels/device.h; an all-gather over world,
// and the step's host syncs are taken; it carries the non-finite flags too). Returns the ranks' times.
RankTimes add_rank_metrics(JsonLine& line, Communicator& world, Device& device, const StepMetrics& m);

std::string duration_text(double seconds);

// The progress lines: rank 0 prints to `out`, a live line rewritten in place when it is a terminal;
// the other ranks print into a sink.
class Progress {
 public:
  Progress(std::FILE* out, bool leader);
  std::FILE* out() const { return out_; }
  bool live() const { return live_; }
  // After each step, with its evaluation's loss if one ran: on a terminal always; otherwise at the
  // first and the last step, every train.log_interval steps and with an evaluation.
  void step(const TrainConfig& tc, const StepMetrics& m, double elapsed_s, std::optional<double> eval_loss);
  void stopping(int64_t step, int64_t exit_interval);
  // A line of its own (below the live line on a terminal).
  void warning(const std::string& line);
  void done(const TrainSummary& summary, double elapsed_s);

 private:
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> sink_;
  std::FILE* out_;
  bool live_;
};

}  // namespace lockstep
