// Module tracing (debug.trace = "modules") and one-ulp injection (debug.inject_ulp): the tools that
// find where two runs part.
//
// Every module calls trace_out on its output after its forward and trace_grad_in on the gradient
// of its input after its backward, one call per site. With a ModuleTrace bound to the calling
// thread (ModuleTrace::Bind, one per rank like the thread pool), each call records the XXH3 of the
// buffer's exact bits with the step, the micro-batch and the module's name ("layers.3.attn.qkv"),
// in execution order; the trainer writes the records to RUN/trace/rank-NNNNN.jsonl
// (train/fingerprint.h) and `lockstep diff` reads them back. Under pipeline parallelism each record
// also carries its model chunk (the pipeline sets it per action, set_action), so that diff can put
// the stages' records in the order of the data: a micro-batch's forward chunk by chunk, then its
// backward in reverse. With none bound (the default) a hook is
// one thread-local load and a branch: no hashing, no allocation.
//
// Injection flips the lowest mantissa bit of the first element of one module's output (a change of
// one ulp) in the first micro-batch of one step, on every rank, before it is hashed and before
// anything reads it: the smallest perturbation there is, for tests and docs/determinism.md.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace lockstep {

class ModuleTrace {
 public:
  struct Record {
    int64_t step = 0, micro = 0;
    std::string module;
    bool grad_in = false;  // the gradient of the module's input, else its output
    uint64_t hash = 0;
    int64_t chunk = -1;      // the model chunk (0 .. pipeline x virtual_pipeline - 1); -1 without a pipeline
    bool backward = false;   // recorded in a pipeline's backward action (the head's loss output is)
    bool nonfinite = false;  // the buffer holds an inf or a NaN (the non-finite guard names the first)
    // Statistics for spike replay (lockstep replay): the buffer's L2 norm (summed in double, in
    // order) and largest |value| (NaN when it holds one).
    double norm = 0;
    float max_abs = 0;
  };

  // record: keep a Record per hook. inject_step > 0: flip one ulp of inject_module's output there
  // (nan: set it to NaN instead, for the non-finite guard's tests).
  ModuleTrace(bool record, int64_t inject_step, std::string inject_module, bool nan = false);

  // The micro-batch the next hooks belong to.
  void set_position(int64_t step, int64_t micro);
  // Within the step: the micro-batch, model chunk and pass of the pipeline action about to run.
  void set_action(int64_t micro, int64_t chunk, bool backward);
  void out(std::string_view module, float* y, int64_t n);
  void grad_in(std::string_view module, const float* dx, int64_t n);

  // The records since the last call, in execution order.
  std::vector<Record> take_records() { return std::exchange(records_, {}); }
  // Whether the injection happened (checked by the trainer: a name that matches no module is an
  // error, not a silent no-op).
  bool injected() const { return injected_; }
  // The modules of the first micro-batch traced, in order (for error messages).
  const std::vector<std::string>& modules() const { return modules_; }

  // RAII: makes `trace` (may be null: tracing off) the current thread's trace.
  class Bind {
   public:
    explicit Bind(ModuleTrace* trace);
    ~Bind();
    Bind(const Bind&) = delete;
    Bind& operator=(const Bind&) = delete;

   private:
    ModuleTrace* prev_;
  };

  static ModuleTrace* current() { return current_; }

  // RAII: a recomputed forward (activation recompute, model/gpt.h) runs inside: its outputs are
  // not recorded again, and an injected bit flip is applied again, so that the recomputed values
  // are the ones the first forward made.
  class Replay {
   public:
    Replay() : t_(current_) {
      if (t_) t_->replay_ = true;
    }
    ~Replay() {
      if (t_) t_->replay_ = false;
    }
    Replay(const Replay&) = delete;
    Replay& operator=(const Replay&) = delete;

   private:
    ModuleTrace* t_;
  };

 private:
  inline static thread_local ModuleTrace* current_ = nullptr;
  bool record_;
  int64_t inject_step_;
  std::string inject_module_;
  bool inject_nan_;
  bool injected_ = false;
  int64_t step_ = 0, micro_ = 0, chunk_ = -1, first_step_ = -1;
  bool backward_ = false;
  bool replay_ = false;
  std::vector<Record> records_;
  std::vector<std::string> modules_;
};

// The hooks (n: floats in the buffer).
inline void trace_out(std::string_view module, float* y, int64_t n) {
  if (ModuleTrace* t = ModuleTrace::current()) [[unlikely]]
    t->out(module, y, n);
}
inline void trace_grad_in(std::string_view module, const float* dx, int64_t n) {
  if (ModuleTrace* t = ModuleTrace::current()) [[unlikely]]
    t->grad_in(module, dx, n);
}

}  // namespace lockstep
