// Module tracing and ulp injection for training runs (debug.trace, debug.inject_ulp; core/trace.h):
// the trace bound around each training micro-batch (a pipeline's whole step) and its file
// RUN/trace/rank-NNNNN.jsonl.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/comm/communicator.h"
#include "lockstep/config/config.h"
#include "lockstep/core/trace.h"
#include "lockstep/train/run_dir.h"

namespace lockstep {

// UserError unless debug.inject_ulp names one of `modules` (the forward's, of every pipeline stage):
// a misspelt name is an error, not a run without the injection. Called before the run directory
// exists.
void check_injection(const std::vector<std::string>& modules, const DebugConfig& dbg);
// Under pipeline parallelism: every stage's module names, in stage order (an all-gather over pp).
std::vector<std::string> stages_module_names(Communicator& pp, const std::vector<std::string>& mine);

class StepTrace {
 public:
  // my_modules: the modules of this rank's part of the model. Opens the trace file when
  // debug.trace = "modules" (appending after resumed_step when resuming).
  StepTrace(const DebugConfig& dbg, const std::vector<std::string>& my_modules, const std::string& run_dir, int rank,
            bool resuming, int64_t resumed_step);
  // Null when neither tracing nor injecting.
  ModuleTrace* get() const { return trace_.get(); }
  void set_position(int64_t step, int64_t micro) {
    if (trace_) trace_->set_position(step, micro);
  }
  // After each traced micro-batch (or a pipeline's whole step): writes the records, and in the first
  // step checks that the rank whose part holds the injected module has traced it.
  void after_traced(bool first_step);
  // The first record whose buffer held an inf or a NaN since the trace began, in execution order
  // (this rank's): "module's output, step S micro-batch M"; empty when none or not tracing.
  const std::string& first_nonfinite() const { return first_nonfinite_; }

 private:
  std::string inject_module_;
  bool injects_here_;
  std::unique_ptr<ModuleTrace> trace_;
  std::unique_ptr<LineLog> log_;
  std::string first_nonfinite_;
};

}  // namespace lockstep
