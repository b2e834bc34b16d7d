#include "lockstep/train/module_trace.h"

#include <algorithm>
#include <filesystem>
#include <regex>

#include "lockstep/core/error.h"
#include "lockstep/train/fingerprint.h"

namespace lockstep {

void check_injection(const std::vector<std::string>& modules, const DebugConfig& dbg) {
  if (std::find(modules.begin(), modules.end(), dbg.inject_module()) != modules.end()) return;
  // Briefly: each layer's names once, with its index as N.
  static const std::regex layer_index("layers\\.[0-9]+\\.");
  std::vector<std::string> kinds;
  for (const std::string& m : modules) {
    std::string kind = std::regex_replace(m, layer_index, "layers.N.");
    if (std::find(kinds.begin(), kinds.end(), kind) == kinds.end()) kinds.push_back(std::move(kind));
  }
  std::string names;
  for (const std::string& k : kinds) names += (names.empty() ? "" : ", ") + k;
  user_error(dbg.injection_key(), " = \"", dbg.injection(), "\": the model has no module '", dbg.inject_module(),
             "'; its modules are: ", names, " (N: a layer index)");
}

std::vector<std::string> stages_module_names(Communicator& pp, const std::vector<std::string>& mine) {
  std::string joined;
  for (const std::string& m : mine) joined += m + '\n';
  std::vector<std::string> names;
  for (const std::string& stage : all_gather_strings(pp, joined))
    for (size_t at = 0, end; (end = stage.find('\n', at)) != std::string::npos; at = end + 1)
      names.push_back(stage.substr(at, end - at));
  return names;
}

StepTrace::StepTrace(const DebugConfig& dbg, const std::vector<std::string>& my_modules, const std::string& run_dir,
                     int rank, bool resuming, int64_t resumed_step)
    : inject_module_(dbg.inject_module()),
      injects_here_(dbg.inject_step() > 0 &&
                    std::find(my_modules.begin(), my_modules.end(), inject_module_) != my_modules.end()) {
  const bool tracing = dbg.trace == "modules";
  if (tracing || dbg.inject_step() > 0)
    trace_ = std::make_unique<ModuleTrace>(tracing, dbg.inject_step(), inject_module_, !dbg.inject_nan.empty());
  if (tracing) {
    const std::string path = trace_path(run_dir, rank);
    std::error_code ec;
    std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
    if (resuming) cut_jsonl_after_step(path, resumed_step);
    log_ = std::make_unique<LineLog>(path, resuming);
  }
}

void StepTrace::after_traced(bool first_step) {
  if (trace_ && first_step && injects_here_)
    LOCKSTEP_CHECK(
        std::find(trace_->modules().begin(), trace_->modules().end(), inject_module_) != trace_->modules().end(),
        "GPT::module_names() lists '", inject_module_, "', which the forward did not trace");
  if (!log_) return;
  const std::vector<ModuleTrace::Record> records = trace_->take_records();
  if (first_nonfinite_.empty())
    for (const ModuleTrace::Record& r : records)
      if (r.nonfinite) {
        first_nonfinite_ =
            str(r.module, r.grad_in ? "'s input gradient" : "'s output", ", step ", r.step, " micro-batch ", r.micro);
        break;
      }
  log_->write(trace_lines(records));
}

}  // namespace lockstep
