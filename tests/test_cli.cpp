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
      {"train parallel.tensor=2",
       "lockstep: error: parallel: world size 1 is not divisible by tensor (2) x context (1) x pipeline (1)\n"},
      {"train dist.backend=nccl",
       "lockstep: error: command line: dist.backend = \"nccl\": expected one of auto, threads, mpi\n"},
      {"train -c", "lockstep: error: command line: -c needs a file name\n"},
      {"frobnicate", "lockstep: error: unknown command 'frobnicate' (see `lockstep help`)\n"},
      {"train train.steps=0", "lockstep: error: config: train.steps = 0: must be positive\n"},
      // Sizes that depend on the world: checked before any rank starts, so no "rank N:" raced to say it.
      {"train --nproc 3 moe.num_experts=4 parallel.expert=2",
       "lockstep: error: parallel: world size 3 is not divisible by expert_tensor (1) x expert (2) x pipeline (1)\n"},
      {"train --nproc 4 train.global_batch=8 train.micro_batch=4",
       "lockstep: error: train.global_batch = 8 is not divisible by train.micro_batch (4) x data-parallel size (4 = 4 "
       "ranks / (parallel.tensor x parallel.context x parallel.pipeline = 1))\n"},
      {"train --nproc 2 parallel.pipeline=2 parallel.virtual_pipeline=2 train.global_batch=8 train.micro_batch=8",
       "lockstep: error: interleaved pipeline (parallel.virtual_pipeline = 2): the micro-batches per rank (1 = "
       "train.global_batch / (train.micro_batch x data-parallel size)) must be a multiple of parallel.pipeline = 2\n"},
      {std::string("train -c ") + LOCKSTEP_SOURCE_DIR +
           "/configs/debug.toml debug.inject_ulp=1:layers.0.nope train.out_dir=runs/x",
       "lockstep: error: debug.inject_ulp = \"1:layers.0.nope\": the model has no module 'layers.0.nope'; its modules "
       "are: "
       "embedding, layers.N.attn_norm, layers.N.attn.qkv, layers.N.attn.core, layers.N.attn.proj, layers.N.mlp_norm, "
       "layers.N.mlp.fc, layers.N.mlp.act, layers.N.mlp.proj, final_norm, output (N: a layer index)\n"},
      {"diff nowhere elsewhere", "lockstep: error: 'nowhere': no such run directory\n"},
      {"diff out.txt err.txt", "lockstep: error: 'out.txt': not a directory (lockstep diff takes run directories)\n"},
      {"diff .", "lockstep: error: command line: lockstep diff needs two run directories, got 1\n"},
      {"diff . .", "lockstep: error: '.' has no fingerprints/ directory (not a lockstep run directory?)\n"},
      {"ckpt inspect nowhere", "lockstep: error: checkpoint 'nowhere' does not exist or is not a directory\n"},
      {"ckpt inspect .",
       "lockstep: error: '.' is not a checkpoint (no metadata.json) and holds no complete step-NNNNNNNN checkpoint\n"},
      {"ckpt export .",
       "lockstep: error: usage: lockstep ckpt inspect DIR | verify DIR | export DIR OUT.safetensors | export DIR OUT "
       "--format hf [--tokenizer TOKENIZER_JSON_OR_DIR]\n"},
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
