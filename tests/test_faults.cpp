// Surviving faults: injected faults fire once.
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

}  // namespace
}  // namespace lockstep
