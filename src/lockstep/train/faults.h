// Injected faults, for testing that a job survives them (docs/faults.md): a rank that fails at a
// given step (debug.fail_at_step, fail_rank, fail_in, fail_mode) and a rank that is slow in every
// step (debug.slow_rank, slow_ms).
//
// A failure fires once per run directory: the failing rank first writes RUN/injected_fault.json, and
// a run that finds it there does not fail again, so the restarted job (which redoes the step from its
// last checkpoint) runs through. Under the threads backend a rank is a thread, which cannot die
// alone: "kill" ends the process, every rank with it, as a crash of that process would.
#pragma once

#include <cstdint>
#include <string>

#include "lockstep/config/config.h"

namespace lockstep {

class FaultInjector {
 public:
  FaultInjector(const DebugConfig& dbg, const std::string& run_dir, int rank);

  // In the step, after this rank's forward and backward: the injected delay, and the failure when
  // debug.fail_in = "step" names this step and rank.
  void in_step(int64_t step) const;
  // In a save, after this rank wrote its part of the step's checkpoint and before the commit: the
  // failure when debug.fail_in = "save" names this step and rank.
  void in_save(int64_t step) const;

 private:
  void fail(int64_t step, const char* where) const;

  const DebugConfig& dbg_;
  std::string marker_;  // RUN/injected_fault.json
  int rank_;
};

}  // namespace lockstep
