// Surviving faults (docs/faults.md): `lockstep train --max-restarts N` restarts a job whose rank
// was killed (mid-step, mid-save) or hung, from its newest checkpoint, and the restarted job's
// fingerprints and final checkpoint equal the uninterrupted job's; what is not restarted; injected
// faults fire once; per-rank step and wait times in metrics.jsonl and the straggler warning.
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

struct RestartCase {
  int ranks;
  const char* fault;  // debug.* keys
  int64_t resume_step;
  const char* cause;
};

// The job is killed (or hangs) once; the supervisor restarts it from the newest checkpoint and it
// finishes with the uninterrupted job's bits.
void expect_restart_equals_uninterrupted(const RestartCase& c) {
  TempDir dir;
  train_whole(dir, c.ranks, "whole");
  const testing::CliResult r = train_cli(dir, c.ranks, "--max-restarts 1", c.fault);
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const std::string line = std::string("lockstep: restart 1 of 1: the job ") + c.cause +
                           "; resuming from run/checkpoints/step-00000002 (step 2)\n";
  EXPECT_NE(r.out.find(line), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("lockstep: resumed from run/checkpoints/step-00000002"), std::string::npos) << r.out;
  expect_same_run(dir.path("whole"), dir.path("run"), c.ranks);
  const std::vector<nlohmann::json> restarts = json_lines(dir.path("run/restarts.jsonl"));
  ASSERT_EQ(restarts.size(), 1u);
  EXPECT_EQ(restarts[0]["restart"], 1);
  EXPECT_EQ(restarts[0]["resume_step"], c.resume_step);
  EXPECT_EQ(restarts[0]["cause"], std::string(c.cause));
  EXPECT_TRUE(fs::exists(dir.path("run/injected_fault.json")));
}

TEST(Restart, KilledMidStepResumesBitwise) {
  expect_restart_equals_uninterrupted({1, "debug.fail_at_step=3", 2, "was killed by signal 9 (SIGKILL)"});
}

TEST(Restart, KilledMidSaveResumesBitwise) {
  expect_restart_equals_uninterrupted(
      {1, "debug.fail_at_step=4 debug.fail_in=save", 2, "was killed by signal 9 (SIGKILL)"});
}

TEST(Restart, TwoRanksKilledMidStepResumeBitwise) {
  expect_restart_equals_uninterrupted(
      {2, "debug.fail_at_step=3 debug.fail_rank=1", 2, "was killed by signal 9 (SIGKILL)"});
}

TEST(Restart, TwoRanksKilledMidSaveResumeBitwise) {
  expect_restart_equals_uninterrupted(
      {2, "debug.fail_at_step=4 debug.fail_rank=1 debug.fail_in=save", 2, "was killed by signal 9 (SIGKILL)"});
}

// A hung rank: the other's collective times out, the process exits with the rank-failure status.
TEST(Restart, AHungRankTimesOutAndTheJobResumesBitwise) {
  expect_restart_equals_uninterrupted({2,
                                       "debug.fail_at_step=3 debug.fail_rank=1 debug.fail_mode=hang dist.timeout_s=2",
                                       2, "exited with status 75 (a rank failed)"});
}

// Killed before its first checkpoint: the restart starts the job again as it first started.
TEST(Restart, WithoutACheckpointTheJobStartsAgain) {
  TempDir dir;
  train_whole(dir, 1, "whole");
  const testing::CliResult r = train_cli(dir, 1, "--max-restarts 2", "debug.fail_at_step=1");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("lockstep: restart 1 of 2: the job was killed by signal 9 (SIGKILL); it wrote no checkpoint "
                       "yet: starting it again from the beginning\n"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("restart 2"), std::string::npos) << r.out;
  expect_same_run(dir.path("whole"), dir.path("run"), 1);
}

// What is not restarted: a user error (exit 2) and a job out of restarts.
TEST(Restart, NotAfterAUserErrorNorBeyondMaxRestarts) {
  TempDir dir;
  testing::CliResult r = train_cli(dir, 1, "--max-restarts 3", "train.resume=nowhere");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.err,
            "lockstep: error: train.resume = \"nowhere\": checkpoint 'nowhere' does not exist or is not a directory\n");
  EXPECT_EQ(r.out.find("restart"), std::string::npos) << r.out;
  r = train_cli(dir, 1, "--max-restarts 0", "debug.fail_at_step=1");
  EXPECT_EQ(r.status, 128 + SIGKILL) << r.out << r.err;
  EXPECT_NE(r.err.find("lockstep: error: the job was killed by signal 9 (SIGKILL); not restarted: --max-restarts 0 "
                       "allows none\n"),
            std::string::npos)
      << r.err;
  EXPECT_FALSE(fs::exists(dir.path("run/restarts.jsonl")));
}

// SIGTERM to the supervisor stops the job: passed on to the child, which is not restarted.
TEST(Restart, ASupervisorAskedToStopStopsTheJob) {
  TempDir dir;
  const std::vector<std::string> args = {"train",
                                         "--max-restarts",
                                         "3",
                                         "-c",
                                         kConfig,
                                         "train.steps=100000",
                                         "train.eval_interval=0",
                                         "train.threads=1",
                                         "train.out_dir=" + dir.path("run")};
  const pid_t pid = testing::spawn_cli(args, dir.path("out.txt"));
  ASSERT_GE(pid, 0);
  const auto t0 = std::chrono::steady_clock::now();
  while (!fs::exists(dir.path("run/metrics.jsonl")) && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30))
    usleep(10000);
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM);
  EXPECT_EQ(read_file(dir.path("out.txt")).find("restart"), std::string::npos);
}

TEST(Restart, BadCommandLinesGiveOneLine) {
  TempDir dir;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"train --max-restarts -1", "command line: --max-restarts needs a number of restarts >= 0, got '-1'"},
      {"train --max-restarts", "command line: --max-restarts needs a number of restarts >= 0, got ''"},
      {"train dist.backend=mpi --max-restarts 1",
       "--max-restarts under mpirun would restart one process of the job: supervise the whole job with `lockstep "
       "launch --max-restarts N -- mpirun ... lockstep train ...`"},
      {"launch --max-restarts 1 mpirun -n 2",
       "command line: launch: unexpected 'mpirun' before `--` (usage: lockstep launch --max-restarts N -- mpirun -n "
       "2 build/lockstep train ...)"},
      {"launch --max-restarts 1",
       "command line: launch: the command to run goes after `--` (usage: lockstep launch --max-restarts N -- mpirun "
       "-n 2 build/lockstep train ...)"},
      {"launch -- mpirun lockstep train",
       "command line: launch: --max-restarts N is missing (usage: lockstep launch --max-restarts N -- mpirun -n 2 "
       "build/lockstep train ...)"},
      {"launch --max-restarts 1 -- mpirun -n 2 ls",
       "command line: launch: the command must run `lockstep train ...`, with lockstep train's arguments last (got "
       "'mpirun -n 2 ls')"},
      {"launch --max-restarts 1 -- mpirun -n 2 lockstep train --max-restarts 1",
       "command line: launch: the supervised lockstep train has --max-restarts too: give it to launch only"},
      {"launch --max-restarts 1 -- mpirun lockstep train train.steps=0", "config: train.steps = 0: must be positive"},
      {"train debug.fail_at_step=3 train.steps=2",
       "config: debug.fail_at_step = 3: must be in [0, train.steps = 2] (0 = never)"},
      {"train debug.fail_at_step=3 debug.fail_in=save train.save_interval=2",
       "config: debug.fail_in = \"save\": no checkpoint is saved at debug.fail_at_step = 3 (train.save_interval = 2)"},
      {"train --nproc 2 debug.fail_at_step=3 debug.fail_rank=2", "debug.fail_rank = 2: the job has 2 rank(s)"},
      {"train debug.fail_at_step=3 debug.fail_mode=hang",
       "debug.fail_mode = \"hang\" needs more than one rank: a hung rank is noticed by the others' collectives "
       "timing out"},
      {"train debug.slow_ms=-1", "config: debug.slow_ms = -1: must be >= 0 (0 = off)"},
      {"train train.straggler_threshold=-0.5",
       "config: train.straggler_threshold = -0.5: must be >= 0 (0 = never warn)"},
  };
  for (const auto& [args, expected] : cases) {
    const testing::CliResult r = run_cli(dir, args);
    EXPECT_EQ(r.status, 2) << args;
    EXPECT_EQ(r.err, "lockstep: error: " + expected + "\n") << args;
  }
  EXPECT_FALSE(fs::exists(dir.path("runs"))) << "a failed start writes no run directory";
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
