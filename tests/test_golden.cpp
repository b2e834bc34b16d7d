// Golden fingerprints of the tiny presets (tests/golden.h): each job trains 3 steps and must give the
// fingerprints committed under tests/golden/presets/, bit for bit. The determinism matrix's rows are
// checked against tests/golden/matrix/ in test_determinism_matrix.cpp.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "golden.h"
#include "lockstep/comm/threads/thread_transport.h"
#include "lockstep/config/config.h"
#include "lockstep/train/trainer.h"
#include "testing.h"

namespace lockstep {
namespace {

struct Job {
  const char* name;
  const char* config;  // in configs/
  std::vector<std::string> overrides;
  int ranks = 1;
};

void PrintTo(const Job& job, std::ostream* os) { *os << job.name; }

const Job kJobs[] = {
    {"debug_run", "debug.toml", {}},
    {"debug_layout", "debug.toml", {"determinism=layout"}},
    {"llama_tiny_run", "llama-tiny.toml", {}},
    {"llama_tiny_layout", "llama-tiny.toml", {"determinism=layout"}},
    {"moe_debug_run", "moe-debug.toml", {}},
    {"moe_debug_layout", "moe-debug.toml", {"determinism=layout"}},
    {"mixtral_tiny_run", "mixtral-tiny.toml", {}},
    {"mixtral_tiny_layout", "mixtral-tiny.toml", {"determinism=layout"}},
    {"deepseek_tiny_run", "deepseek-tiny.toml", {}},
    {"deepseek_tiny_layout", "deepseek-tiny.toml", {"determinism=layout"}},
    {"moe_debug_bf16_run", "moe-debug.toml", {"precision.params=bf16"}},
    {"moe_debug_bf16_layout", "moe-debug.toml", {"precision.params=bf16", "determinism=layout"}},
    {"moe_debug_fp8_blockwise_run", "moe-debug.toml", {"precision.params=bf16", "precision.fp8=blockwise"}},
    {"moe_debug_fp8_blockwise_layout",
     "moe-debug.toml",
     {"precision.params=bf16", "precision.fp8=blockwise", "determinism=layout"}},
    {"moe_debug_nvfp4_run", "moe-debug.toml", {"precision.params=bf16", "precision.fp4=nvfp4"}},
    {"moe_debug_nvfp4_layout",
     "moe-debug.toml",
     {"precision.params=bf16", "precision.fp4=nvfp4", "determinism=layout"}},
    {"moe_debug_tp2_ep2_layout",
     "moe-debug.toml",
     {"determinism=layout", "parallel.tensor=2", "parallel.expert=2", "train.micro_batch=2"},
     4},
    {"debug_pp2_run", "debug.toml", {"parallel.pipeline=2", "train.micro_batch=2"}, 2},
    {"moe_debug_pp2_layout", "moe-debug.toml", {"determinism=layout", "parallel.pipeline=2", "train.micro_batch=2"}, 2},
};

class Golden : public ::testing::TestWithParam<Job> {};

TEST_P(Golden, FingerprintsMatchTheCommittedOnes) {
  const Job& job = GetParam();
  const testing::TempDir dir;
  std::vector<std::string> keys = job.overrides;
  for (const char* k : {"train.steps=3", "train.eval_interval=0", "train.threads=2"}) keys.emplace_back(k);
  keys.push_back("train.out_dir=" + dir.path("run"));
  const Config c = load_config(str(LOCKSTEP_SOURCE_DIR, "/configs/", job.config), keys);
  std::FILE* sink = std::fopen("/dev/null", "w");
  run_threads(job.ranks, c.dist.timeout_s, [&](Communicator& comm) { train(c, sink, comm); });
  std::fclose(sink);
  EXPECT_TRUE(testing::matches_golden("presets", job.name, testing::read_fingerprints(dir.path("run"), job.ranks)));
}

INSTANTIATE_TEST_SUITE_P(Jobs, Golden, ::testing::ValuesIn(kJobs),
                         [](const ::testing::TestParamInfo<Job>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace lockstep
