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

#include "lockstep/comm/mesh.h"
#include "lockstep/config/config.h"

namespace lockstep {

class Communicator;

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

}  // namespace lockstep
