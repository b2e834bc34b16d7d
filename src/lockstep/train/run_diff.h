// `lockstep diff RUN_A RUN_B`: where two runs stop being bitwise identical.
//
// Reads RUN/fingerprints/rank-*.jsonl of both runs (train/fingerprint.h) and walks the steps they
// share in order, rank by rank, field by field in file order. The first field that differs is
// reported with its step, its rank and the rank's mesh coordinates (dp/tp/pp/ep/cp), and both
// values (fp64 fields as their hex bits and as numbers). Runs of different lengths are compared
// over their common steps. Runs with different rank counts or coordinates (different layouts) are
// compared on rank 0 of each run over what every rank records alike: the fp64 scalars (loss,
// lm_loss, aux_loss, mtp_loss, grad_norm, lr) and the RNG state, plus the parameters' hash when
// neither run's config.toml splits the parameters (tensor / pipeline / expert / expert-tensor
// parallelism; data and context parallel ranks hold every parameter). The report lists the fields
// it did not compare and why (each rank hashes its own shard of the gradients and optimizer state).
//
// When both runs were traced (debug.trace = "modules": RUN/trace/rank-NNNNN.jsonl, core/trace.h),
// the report also names the first module record (step, micro-batch, module, out / grad_in) whose
// hash differs while every record before it, its inputs included, matched.
#pragma once

#include <cstdint>
#include <string>

namespace lockstep {

struct RunDiff {
  bool identical = false;  // over the common steps (and traces, when both runs have them)
  std::string report;      // lines for the user, each ending in '\n'
  // The first step whose fingerprints differ (the report's "first difference"); -1 when none does.
  int64_t first_step = -1;
};

// UserError naming the directory, file and line when a run directory, its fingerprint files or a
// line in them is missing or malformed, or when the runs share no step.
RunDiff diff_runs(const std::string& run_a, const std::string& run_b);

}  // namespace lockstep
