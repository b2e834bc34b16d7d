// Surviving faults: injected faults fire once; per-rank step and wait times in metrics.jsonl and the
// straggler warning.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "lockstep/comm/threads/thread_transport.h"
#include "lockstep/config/config.h"
#include "lockstep/train/checkpoint.h"
#include "lockstep/train/fingerprint.h"
#include "lockstep/train/stragglers.h"
#include "lockstep/train/trainer.h"
#include "model_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

namespace fs = std::filesystem;
using testing::read_file;
using testing::run_cli;
using testing::TempDir;
using testing::train_ranks;

const std::string kConfig = std::string(LOCKSTEP_SOURCE_DIR) + "/configs/debug.toml";

// 4 steps, a checkpoint every 2; with two ranks, each takes 2 micro-batches of 2 sequences of the
// global batch of 8.
std::vector<std::string> job_keys(int ranks) {
  std::vector<std::string> keys = {"train.steps=4", "train.eval_interval=0", "train.threads=1", "train.save_interval=2",
                                   "data.synthetic_bytes=65536"};
  if (ranks > 1) keys.push_back("train.micro_batch=2");
  return keys;
}

std::string joined(const std::vector<std::string>& keys) {
  std::string s;
  for (const std::string& k : keys) s += " " + k;
  return s;
}

// The uninterrupted job, in process.
void train_whole(const TempDir& dir, int ranks, const std::string& run) {
  std::vector<std::string> keys = job_keys(ranks);
  keys.push_back("train.out_dir=" + dir.path(run));
  train_ranks(ranks, load_config(kConfig, keys));
}

// `lockstep train` with the job's keys and `extra` in dir (out_dir "run").
testing::CliResult train_cli(const TempDir& dir, int ranks, const std::string& options, const std::string& extra) {
  return run_cli(dir, "train " + options + (ranks > 1 ? " --nproc " + std::to_string(ranks) : "") + " -c " + kConfig +
                          joined(job_keys(ranks)) + " train.out_dir=run " + extra);
}

// Both runs' fingerprints (every rank's, 4 steps) and final checkpoints' data files are the same bytes.
void expect_same_run(const std::string& whole, const std::string& run, int ranks) {
  for (int r = 0; r < ranks; ++r) {
    const std::string fp = read_file(fingerprint_path(run, r));
    EXPECT_EQ(std::count(fp.begin(), fp.end(), '\n'), 4) << "rank " << r;
    EXPECT_EQ(read_file(fingerprint_path(whole, r)), fp) << "rank " << r;
  }
  const std::string a = checkpoint_dir(whole + "/checkpoints", 4), b = checkpoint_dir(run + "/checkpoints", 4);
  ASSERT_EQ(latest_checkpoint(run + "/checkpoints"), b);
  int files = 0;
  for (const auto& e : fs::directory_iterator(a)) {
    if (e.path().extension() != ".bin") continue;
    ++files;
    EXPECT_EQ(read_file(e.path().string()), read_file(b + "/" + e.path().filename().string())) << e.path();
  }
  EXPECT_GT(files, 0);
  EXPECT_EQ(read_checkpoint_metadata(a).info.samples_consumed, read_checkpoint_metadata(b).info.samples_consumed);
  for (const auto& e : fs::directory_iterator(run + "/checkpoints"))
    EXPECT_NE(e.path().extension(), ".tmp") << "a partial checkpoint is left: " << e.path();
}

std::vector<nlohmann::json> json_lines(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::istringstream in(read_file(path));
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

// Without a supervisor: the fault leaves the save of step 4 partial (step-00000004.tmp, rank 0's file
// in it) and step 2 the newest checkpoint; run again, it does not fire (RUN/injected_fault.json), the
// save of step 4 removes the partial one, and the bits are the uninterrupted job's.
TEST(FaultInjection, AKillMidSaveLeavesAPartialCheckpointAndFiresOnce) {
  TempDir dir;
  train_whole(dir, 1, "whole");
  const std::string fault = "debug.fail_at_step=4 debug.fail_in=save";
  testing::CliResult r = train_cli(dir, 1, "", fault);
  EXPECT_EQ(r.status, 128 + SIGKILL) << r.out << r.err;
  EXPECT_EQ(r.err.rfind("lockstep: debug.fail_at_step = 4: rank 0 kills itself (SIGKILL) in the save\n", 0), 0u)
      << r.err;
  EXPECT_TRUE(fs::exists(dir.path("run/checkpoints/step-00000004.tmp/rank-00000.bin")));
  EXPECT_EQ(latest_checkpoint(dir.path("run/checkpoints")), checkpoint_dir(dir.path("run/checkpoints"), 2));
  EXPECT_EQ(nlohmann::json::parse(read_file(dir.path("run/injected_fault.json"))),
            nlohmann::json::parse(R"({"step":4,"rank":0,"in":"save","mode":"kill"})"));
  r = train_cli(dir, 1, "", fault + " train.resume=auto");
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  expect_same_run(dir.path("whole"), dir.path("run"), 1);
}

// ---- stragglers ----

// Rank times (step ms, wait ms) of `steps` steps in which rank `slow` computes `slow_ms` and the
// others 10 ms; every rank's step takes as long as the slowest.
std::string feed(StragglerWatch& w, int ranks, int slow, double slow_ms, int steps, int64_t first_step = 1) {
  std::string warnings;
  for (int s = 0; s < steps; ++s) {
    std::vector<double> step_ms(ranks, std::max(10.0, slow_ms) + 1), wait_ms(ranks);
    for (int r = 0; r < ranks; ++r) wait_ms[r] = step_ms[r] - (r == slow ? slow_ms : 10.0);
    warnings += w.add(first_step + s, step_ms, wait_ms);
  }
  return warnings;
}

TEST(Stragglers, WarnsOfARankPersistentlySlowerThanTheMedianOfTheOthers) {
  StragglerWatch watch(0.2);
  EXPECT_EQ(feed(watch, 4, 2, 11.9, 30), "") << "19% slower: within the threshold";
  StragglerWatch slow(0.2);
  EXPECT_EQ(feed(slow, 4, 2, 12.5, 9), "") << "fewer steps than the window";
  EXPECT_EQ(feed(slow, 4, 2, 12.5, 1, 10),
            "lockstep: warning: rank 2 is slow: over steps 1-10 it computed 12.5 ms per step (step time less time "
            "waiting in collectives), 1.25x the other ranks' median of 10.0 ms (train.straggler_threshold = 0.2)");
  EXPECT_EQ(feed(slow, 4, 2, 12.5, 9, 11), "") << "the window starts again after a warning";
  EXPECT_NE(feed(slow, 4, 2, 12.5, 1, 20), "");
  StragglerWatch off(0);
  EXPECT_EQ(feed(off, 4, 2, 100, 30), "") << "threshold 0: never";
  StragglerWatch alone(0.2);
  EXPECT_EQ(alone.add(1, {50}, {0}), "");
  for (int s = 2; s <= 20; ++s) EXPECT_EQ(alone.add(s, {50}, {0}), "") << "one rank: no others to compare with";
  // One slow step in the window does not make a straggler (medians).
  StragglerWatch blip(0.2);
  std::string w = feed(blip, 2, 1, 50, 1);
  w += feed(blip, 2, 1, 10, 9, 2);
  EXPECT_EQ(w, "");
}

// Two thread ranks, rank 1 sleeping 40 ms per step: every metrics line has both ranks' step and
// wait times, rank 0 waits for rank 1, and the terminal says rank 1 is slow.
TEST(Stragglers, PerRankTimesInMetricsAndTheWarningOfAnInjectedStraggler) {
  TempDir dir;
  std::vector<std::string> keys = {"train.steps=12",      "train.eval_interval=0",           "train.threads=1",
                                   "train.micro_batch=2", "data.synthetic_bytes=65536",      "debug.slow_rank=1",
                                   "debug.slow_ms=40",    "train.out_dir=" + dir.path("run")};
  std::FILE* out = std::tmpfile();
  run_threads(2, 60, [&](Communicator& comm) { train(load_config(kConfig, keys), out, comm); });
  std::rewind(out);
  std::string text;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, out)) > 0;) text.append(buf, n);
  std::fclose(out);
  EXPECT_NE(text.find("lockstep: warning: rank 1 is slow: over steps 1-10 it computed "), std::string::npos) << text;
  const std::vector<nlohmann::json> lines = json_lines(dir.path("run/metrics.jsonl"));
  ASSERT_EQ(lines.size(), 12u);
  int waited = 0;
  for (const nlohmann::json& j : lines) {
    const std::vector<double> step = j["step_ms_ranks"], wait = j["comm_wait_ms_ranks"];
    ASSERT_EQ(step.size(), 2u);
    ASSERT_EQ(wait.size(), 2u);
    for (int r = 0; r < 2; ++r) {
      EXPECT_GE(wait[r], 0);
      EXPECT_LE(wait[r], step[r]);
    }
    EXPECT_GE(step[1] - wait[1], 40) << "rank 1 sleeps 40 ms in its step";
    waited += wait[0] >= 30;  // for rank 1, most steps
  }
  EXPECT_GE(waited, 9);
  // Without it, or with the warning off: no warning.
  keys.back() = "train.out_dir=" + dir.path("off");
  keys.push_back("train.straggler_threshold=0");
  out = std::tmpfile();
  run_threads(2, 60, [&](Communicator& comm) { train(load_config(kConfig, keys), out, comm); });
  std::rewind(out);
  text.clear();
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, out)) > 0;) text.append(buf, n);
  std::fclose(out);
  EXPECT_EQ(text.find("warning"), std::string::npos) << text;
}

}  // namespace
}  // namespace lockstep
