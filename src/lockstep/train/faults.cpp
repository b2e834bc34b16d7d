#include "lockstep/train/faults.h"

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <thread>

#include "lockstep/train/json_line.h"
#include "lockstep/train/run_dir.h"

namespace lockstep {

FaultInjector::FaultInjector(const DebugConfig& dbg, const std::string& run_dir, int rank)
    : dbg_(dbg), marker_(run_dir + "/injected_fault.json"), rank_(rank) {}

void FaultInjector::in_step(int64_t step) const {
  if (dbg_.slow_ms > 0 && rank_ == dbg_.slow_rank)
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(dbg_.slow_ms));
  if (dbg_.fail_in == "step") fail(step, "step");
}

void FaultInjector::in_save(int64_t step) const {
  if (dbg_.fail_in == "save") fail(step, "save");
}

void FaultInjector::fail(int64_t step, const char* where) const {
  if (step != dbg_.fail_at_step || rank_ != dbg_.fail_rank) return;
  std::error_code ec;
  if (std::filesystem::exists(marker_, ec)) return;  // it fired in an earlier run of this directory
  JsonLine record;
  record.add("step", step).add("rank", rank_).add("in", where).add("mode", dbg_.fail_mode);
  write_file_atomic(marker_, record.str());
  std::fprintf(stderr, "lockstep: debug.fail_at_step = %lld: rank %d %s in the %s\n", static_cast<long long>(step),
               rank_, dbg_.fail_mode == "kill" ? "kills itself (SIGKILL)" : "hangs", where);
  std::fflush(stderr);
  if (dbg_.fail_mode == "kill") std::raise(SIGKILL);
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

}  // namespace lockstep
