// The lockstep binary: exit codes and the one-line errors a user sees.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>

#include "testing.h"

namespace lockstep {
namespace {

using testing::read_file;
using testing::TempDir;

using Result = testing::CliResult;
constexpr auto run = testing::run_cli;

TEST(Cli, HelpListsCommandsAndConfigKeys) {
  TempDir dir;
  Result r = run(dir, "help");
  EXPECT_EQ(r.status, 0);
  EXPECT_NE(r.out.find("lockstep train [-c FILE.toml]"), std::string::npos) << r.out;
  r = run(dir, "help config");
  EXPECT_EQ(r.status, 0);
  EXPECT_NE(r.out.find("model.num_layers = 4"), std::string::npos) << r.out;
}

TEST(Cli, TrainsWithConfigAndOverrides) {
  TempDir dir;
  const Result r = run(dir, std::string("train -c ") + LOCKSTEP_SOURCE_DIR +
                                "/configs/debug.toml train.steps=2 train.eval_interval=0 train.out_dir=run");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_NE(r.out.find("step 2/2"), std::string::npos) << r.out;
  EXPECT_TRUE(std::filesystem::exists(dir.path("run/fingerprints/rank-00000.jsonl")));
}

TEST(Cli, BadInputsGiveOneLineAndExitTwo) {
  TempDir dir;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"train -c missing.toml", "lockstep: error: cannot open config file 'missing.toml': No such file or directory\n"},
      {"train model.num_layers=x", "lockstep: error: command line: model.num_layers=x: expected an integer\n"},
      {"train --threads 2", "lockstep: error: command line: unknown option '--threads' (see `lockstep help`)\n"},
      {"train --nproc 0", "lockstep: error: command line: --nproc needs a positive number of ranks, got '0'\n"},
      {"train parallel.tensor=2", "lockstep: error: parallel: world size 1 is not divisible by tensor (2) x context (1) x pipeline (1)\n"},
      {"train dist.backend=nccl", "lockstep: error: command line: dist.backend = \"nccl\": expected one of auto, threads, mpi\n"},
      {"train -c", "lockstep: error: command line: -c needs a file name\n"},
      {"frobnicate", "lockstep: error: unknown command 'frobnicate' (see `lockstep help`)\n"},
      {"train train.steps=0", "lockstep: error: config: train.steps = 0: must be positive\n"},
  };
  for (const auto& [args, expected] : cases) {
    const Result r = run(dir, args);
    EXPECT_EQ(r.status, 2) << args;
    EXPECT_EQ(r.err, expected) << args;
  }
  EXPECT_FALSE(std::filesystem::exists(dir.path("runs"))) << "a failed start writes no run directory";
}

}  // namespace
}  // namespace lockstep
