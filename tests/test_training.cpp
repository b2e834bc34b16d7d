// End-to-end training: the determinism guarantee checked bitwise on fingerprint files (same job
// twice; 1 vs 2 threads), the run directory's contents, learning on the built-in corpus, and the
// text data source.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "lockstep/config/config.h"
#include "lockstep/core/error.h"
#include "lockstep/train/fingerprint.h"
#include "lockstep/train/trainer.h"
#include "model_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

using testing::quiet_train;
using testing::read_file;
using testing::TempDir;
using testing::train_ranks;

Config debug_job(const std::string& out_dir, std::vector<std::string> extra = {}) {
  extra.push_back("train.out_dir=" + out_dir);
  return load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/debug.toml", extra);
}

int count_lines(const std::string& text) { return static_cast<int>(std::count(text.begin(), text.end(), '\n')); }

TEST(TrainDeterminism, SameJobTwiceGivesIdenticalFingerprints) {
  TempDir dir;
  for (const char* run : {"a", "b"}) quiet_train(debug_job(dir.path(run), {"train.steps=6", "train.threads=2"}));
  const std::string a = read_file(fingerprint_path(dir.path("a"), 0));
  EXPECT_EQ(count_lines(a), 6);
  EXPECT_EQ(a, read_file(fingerprint_path(dir.path("b"), 0)));
}

TEST(TrainDeterminism, OneAndTwoThreadsGiveIdenticalFingerprints) {
  for (const char* preset : {"gpt2", "llama"}) {
    SCOPED_TRACE(preset);
    TempDir dir;
    const std::vector<std::string> keys = {"train.steps=4", std::string("model.preset=") + preset,
                                           "model.num_query_groups=2"};
    auto with = [&](const char* threads) {
      std::vector<std::string> k = keys;
      k.push_back(std::string("train.threads=") + threads);
      return k;
    };
    quiet_train(debug_job(dir.path("t1"), with("1")));
    quiet_train(debug_job(dir.path("t2"), with("2")));
    const std::string one = read_file(fingerprint_path(dir.path("t1"), 0));
    EXPECT_EQ(count_lines(one), 4);
    EXPECT_EQ(one, read_file(fingerprint_path(dir.path("t2"), 0)));
  }
}

TEST(TrainDeterminism, ADifferentSeedChangesTheFingerprints) {
  TempDir dir;
  quiet_train(debug_job(dir.path("a"), {"train.steps=2"}));
  quiet_train(debug_job(dir.path("b"), {"train.steps=2", "train.seed=99"}));
  EXPECT_NE(read_file(fingerprint_path(dir.path("a"), 0)), read_file(fingerprint_path(dir.path("b"), 0)));
}

TEST(Training, RunDirectoryHoldsResolvedConfigMetricsAndFingerprints) {
  TempDir dir;
  const Config c = debug_job(dir.path("run"), {"train.steps=4", "train.eval_interval=2"});
  quiet_train(c);
  const std::string resolved = read_file(dir.path("run/config.toml"));
  EXPECT_EQ(config_to_toml(load_config(dir.path("run/config.toml"), {})), resolved);
  const std::string metrics = read_file(dir.path("run/metrics.jsonl"));
  EXPECT_EQ(count_lines(metrics), 4 + 2);  // 4 steps, evaluations at steps 2 and 4
  for (const char* key : {"\"step\":4", "\"loss\":", "\"grad_norm\":", "\"lr\":", "\"tokens_per_s\":", "\"mfu\":",
                          "\"peak_mem_mb\":", "\"eval_loss\":"})
    EXPECT_NE(metrics.find(key), std::string::npos) << key;
  const std::string fp = read_file(fingerprint_path(dir.path("run"), 0));
  for (const char* key : {"\"loss\":\"", "\"grad_norm\":\"", "\"params\":\"", "\"grads\":\"", "\"optimizer\":\"",
                          "\"rng\":\"", "\"dp\":0"})
    EXPECT_NE(fp.find(key), std::string::npos) << key;
  EXPECT_FALSE(std::filesystem::exists(dir.path("run/config.toml.tmp")));
}

// The device's memory high-water mark (every rank's, and the largest) and the step's host syncs: on
// moe-debug over 2 ranks (one micro-batch each, 2 MoE layers) one loss and two routings, then the
// grad norm, the token statistics and the fingerprint: 6. Evaluation's syncs are not counted.
TEST(Training, MetricsHoldTheDeviceMemoryPeakAndTheHostSyncs) {
  TempDir dir;
  const Config c = load_config(str(LOCKSTEP_SOURCE_DIR, "/configs/moe-debug.toml"),
                               {"train.steps=2", "train.eval_interval=1", "train.out_dir=" + dir.path("run")});
  train_ranks(2, c);
  std::istringstream in(read_file(dir.path("run/metrics.jsonl")));
  int steps = 0;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("eval_loss")) continue;
    ++steps;
    ASSERT_EQ(j["alloc_peak_mb_ranks"].size(), 2u) << line;
    const double a = j["alloc_peak_mb_ranks"][0], b = j["alloc_peak_mb_ranks"][1];
    EXPECT_GT(a, 1.0);
    EXPECT_EQ(j["alloc_peak_mb"].get<double>(), std::max(a, b));
    EXPECT_EQ(j["host_syncs"].get<int64_t>(), 6) << line;
  }
  EXPECT_EQ(steps, 2);
}

TEST(Training, DebugModelLearnsTheBuiltInCorpus) {
  TempDir dir;
  const TrainSummary s = quiet_train(debug_job(dir.path("run")));
  EXPECT_GT(s.first_loss, 5.0);  // about ln 256 = 5.55 at init
  EXPECT_LT(s.last_loss, s.first_loss - 2.0);
  EXPECT_LT(s.last_eval_loss, s.first_loss - 2.0);
}

TEST(Training, TextSourceReadsAFileAsBytes) {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 400; ++i) text += "the quick brown fox jumps over the lazy dog " + std::to_string(i % 10) + "\n";
  const std::string file = dir.write("corpus.txt", text);
  const TrainSummary s = quiet_train(debug_job(dir.path("run"), {"train.steps=3", "data.source=text:" + file}));
  EXPECT_EQ(s.steps, 3);
  EXPECT_GT(s.last_eval_loss, 0.0);
}

TEST(Training, TextSourceErrorsNameTheFile) {
  TempDir dir;
  try {
    quiet_train(debug_job(dir.path("run"), {"data.source=text:" + dir.path("nope.txt")}));
    FAIL() << "expected an error";
  } catch (const lockstep::UserError& e) {
    EXPECT_NE(std::string(e.what()).find(dir.path("nope.txt")), std::string::npos) << e.what();
  }
  const std::string tiny = dir.write("tiny.txt", "too short");
  try {
    quiet_train(debug_job(dir.path("run"), {"data.source=text:" + tiny}));
    FAIL() << "expected an error";
  } catch (const lockstep::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("tiny.txt' has 9 bytes"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(dir.path("run"))) << "nothing is written when the input is bad";
}

}  // namespace
}  // namespace lockstep
