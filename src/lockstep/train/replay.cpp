#include "lockstep/train/replay.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "lockstep/comm/threads/thread_transport.h"
#include "lockstep/config/config.h"
#include "lockstep/core/error.h"
#include "lockstep/train/build_info.h"
#include "lockstep/train/checkpoint.h"
#include "lockstep/train/fingerprint.h"
#include "lockstep/train/run_diff.h"
#include "lockstep/train/run_dir.h"
#include "lockstep/train/trainer.h"

namespace lockstep {

namespace {

namespace fs = std::filesystem;

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The keys replay sets itself.
const char* const kReplayKeys[] = {"train.out_dir",       "train.resume",        "train.exit_interval",
                                   "train.save_interval", "train.eval_interval", "debug.trace"};

void check_build(const std::string& run, const Config& config) {
  const std::string file = run + "/build.json";
  if (!fs::exists(file))
    user_error("replay: '", file, "' is missing: the run was recorded by an older lockstep, so its build cannot be ",
               "checked");
  const std::string diff = current_build(config.data).difference(BuildInfo::parse(read_text(file), file));
  if (!diff.empty())
    user_error("replay: '", run, "' was trained by another build or on other data (", diff,
               "): a replay would not reproduce it; replay with the build and data that trained it");
}

// The newest complete checkpoint before `step`: (its step, its directory).
std::pair<int64_t, std::string> checkpoint_before(const std::string& run, int64_t step) {
  const auto all = complete_checkpoints(run + "/checkpoints");
  std::pair<int64_t, std::string> best{-1, ""};
  for (const auto& c : all)
    if (c.first < step) best = c;
  if (best.first >= 0) return best;
  std::string held;
  for (const auto& c : all) held += str(held.empty() ? "" : ", ", fs::path(c.second).filename().string());
  user_error("replay: '", run, "/checkpoints' holds no complete checkpoint before step ", step,
             held.empty() ? " (it holds none)" : str(" (it holds ", held, ")"));
}

// Rank 0's trace records of step N, micro-batch 0, largest max |x| first: the statistics' table.
std::string largest_outputs(const std::string& out, int64_t step) {
  const std::string path = trace_path(out, 0);
  if (!fs::exists(path)) return "";
  struct Row {
    std::string module;
    double max_abs, norm;
  };
  std::vector<Row> rows;
  for (const FingerprintLine& l : read_fingerprint_lines(path)) {
    const std::string *micro = l.find("micro"), *kind = l.find("kind"), *module = l.find("module");
    const std::string *max_abs = l.find("max_abs"), *norm = l.find("norm");
    if (l.step != step || !micro || *micro != "0" || !kind || *kind != "out" || !module || !max_abs || !norm) continue;
    const auto number = [](const std::string& s) { return s == "null" ? std::nan("") : std::stod(s); };
    rows.push_back({*module, number(*max_abs), number(*norm)});
  }
  std::stable_sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) {
    return std::isnan(a.max_abs) > std::isnan(b.max_abs) || (!std::isnan(b.max_abs) && a.max_abs > b.max_abs);
  });
  std::string s = str("replay: step ", step, ", micro-batch 0, rank 0: the largest module outputs (all in ", path,
                      ", with input gradients)\n");
  for (size_t i = 0; i < std::min<size_t>(rows.size(), 5); ++i) {
    char line[256];
    std::snprintf(line, sizeof line, "  %-32s max |x| %-12.6g norm %.6g\n", rows[i].module.c_str(), rows[i].max_abs,
                  rows[i].norm);
    s += line;
  }
  return s;
}

// The router's load at `step` from the replay's metrics.jsonl: each MoE layer's tokens per expert
// (least, most) and imbalance (most / mean).
std::string router_load(const std::string& out, int64_t step) {
  std::istringstream in(read_text(out + "/metrics.jsonl"));
  for (std::string text; std::getline(in, text);) {
    const nlohmann::json l = nlohmann::json::parse(text, nullptr, false);
    if (!l.is_object() || l.value("step", int64_t{-1}) != step || l.contains("eval_loss")) continue;
    std::string s;
    for (int layer = 0; layer < 1024; ++layer) {
      const std::string key = str("moe.", layer, ".");
      if (!l.contains(key + "imbalance")) continue;
      s += str("  layer ", layer, ": tokens per expert ", l.value(key + "tokens_min", int64_t{0}), "..",
               l.value(key + "tokens_max", int64_t{0}), ", imbalance ", l.value(key + "imbalance", 0.0), "\n");
    }
    return s.empty() ? "" : str("replay: step ", step, ": the router's load\n", s);
  }
  return "";
}

}  // namespace

ReplayResult replay(const ReplayOptions& o, std::FILE* progress) {
  const std::string config_file = o.run + "/config.toml";
  if (!fs::exists(config_file)) user_error("replay: '", o.run, "' is not a run directory (no config.toml)");
  for (const std::string& kv : o.overrides)
    for (const char* key : kReplayKeys)
      if (kv.rfind(str(key, "="), 0) == 0) user_error("replay: ", key, " is set by replay itself");
  check_build(o.run, load_config(config_file, {}));

  const std::string fingerprints = fingerprint_path(o.run, 0);
  if (!fs::exists(fingerprints)) user_error("replay: '", fingerprints, "' is missing");
  const std::vector<FingerprintLine> recorded = read_fingerprint_lines(fingerprints);
  const int64_t last = recorded.empty() ? 0 : recorded.back().step;
  if (o.step < 1 || o.step > last)
    user_error("replay: --step ", o.step, " is not a step the run recorded (1 .. ", last, " in ", fingerprints, ")");
  const auto [from, checkpoint] = checkpoint_before(o.run, o.step);

  ReplayResult r;
  r.out = o.out.empty() ? str(o.run, "/replay-step-", o.step) : o.out;
  r.from_step = from;
  if (fs::exists(r.out)) user_error("replay: '", r.out, "' exists: remove it or choose another with --out");
  std::vector<std::string> keys = o.overrides;
  for (const std::string& kv :
       {str("train.out_dir=", r.out), str("train.resume=", checkpoint), str("train.exit_interval=", o.step),
        std::string("train.save_interval=0"), std::string("train.eval_interval=0"), std::string("debug.trace=modules")})
    keys.push_back(kv);
  const Config config = load_config(config_file, keys);
  const int world = read_checkpoint_metadata(checkpoint).info.layout.world;
  checked_mesh(config, world);

  std::string stopped;
  try {
    run_threads(world, config.dist.timeout_s, [&](Communicator& comm) { train(config, progress, comm); });
  } catch (const NonFiniteError& e) {
    stopped = e.what();  // the step being replayed may be the one that stopped the run
  }
  const RunDiff d = diff_runs(o.run, r.out);
  r.reproduced = d.identical;
  std::string overrides;
  for (const std::string& kv : o.overrides) overrides += " " + kv;
  r.report = str("replay: ", o.run, " steps ", from + 1, "..", o.step, " from ", checkpoint, " on ", world,
                 world == 1 ? " rank" : " ranks", overrides.empty() ? "" : ", with" + overrides, ", in ", r.out, "\n");
  if (!stopped.empty()) r.report += str("replay: the non-finite guard stopped it: ", stopped, "\n");
  if (overrides.empty())
    r.report += d.identical ? str("replay: reproduces the run's fingerprints bit for bit\n")
                            : str("replay: does NOT reproduce the run:\n", d.report);
  else
    r.report += str("replay: against the run:\n", d.report);
  r.report += largest_outputs(r.out, o.step) + router_load(r.out, o.step);
  write_file_atomic(r.out + "/replay.txt", r.report);
  return r;
}

}  // namespace lockstep
