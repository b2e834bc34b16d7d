// `lockstep diff RUN_A RUN_B`: where two runs stop being bitwise identical.
//
// Reads RUN/fingerprints/rank-*.jsonl of both runs (train/fingerprint.h) and walks the steps they
// share in order, rank by rank, field by field in file order. The first field that differs is
// reported with its step, its rank and the rank's mesh coordinates (dp/tp/pp/ep/cp), and both
// values (fp64 fields as their hex bits and as numbers). Runs of different lengths are compared
// over their common steps. Runs with different rank counts or coordinates (different layouts) are
// compared on the global quantities only (loss, lm_loss, aux_loss, mtp_loss, grad_norm, lr, which
// every rank records), and the report says that per-rank hashes were not compared.
//
// When both runs were traced (debug.trace = "modules": RUN/trace/rank-NNNNN.jsonl, model/trace.h),
// the report also names the first module record (step, micro-batch, module, out / grad_in) whose
// hash differs while every record before it, its inputs included, matched.
#pragma once

#include <string>

namespace lockstep {

struct RunDiff {
  bool identical = false;  // over the common steps (and traces, when both runs have them)
  std::string report;      // lines for the user, each ending in '\n'
};

// UserError naming the directory, file and line when a run directory, its fingerprint files or a
// line in them is missing or malformed, or when the runs share no step.
RunDiff diff_runs(const std::string& run_a, const std::string& run_b);

}  // namespace lockstep
