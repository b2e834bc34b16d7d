// End-to-end training: the determinism guarantee checked bitwise on fingerprint files (same job
// twice; 1 vs 2 threads), the run directory's contents, learning on the built-in corpus, and the
// text data source.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
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
using testing::user_error_of;

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

// The non-finite guard (train.on_nonfinite, docs/faults.md).

std::vector<nlohmann::json> metrics_lines(const std::string& run_dir) {
  std::vector<nlohmann::json> lines;
  std::istringstream in(read_file(run_dir + "/metrics.jsonl"));
  for (std::string line; std::getline(in, line);) {
    nlohmann::json j = nlohmann::json::parse(line);
    if (!j.contains("eval_loss")) lines.push_back(std::move(j));
  }
  return lines;
}

std::vector<std::string> checkpoint_dirs(const std::string& run_dir) {
  std::vector<std::string> names;
  if (!std::filesystem::exists(run_dir + "/checkpoints")) return names;
  for (const auto& e : std::filesystem::directory_iterator(run_dir + "/checkpoints"))
    names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// The NonFiniteError train() raises, or "(no error)".
std::string nonfinite_error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const NonFiniteError& e) {
    return e.what();
  }
  return "(no error)";
}

// The example: lr = 1e30 trains to a NaN loss at step 2. The job stops there with status 4
// and one error line; step 1's checkpoint is the newest and keep_last = 1 keeps it.
TEST(NonFiniteGuard, AHugeLearningRateStopsTheRunWithOneLineAndStatus4) {
  TempDir dir;
  const testing::CliResult r =
      testing::run_cli(dir, str("train -c ", LOCKSTEP_SOURCE_DIR,
                                "/configs/debug.toml train.lr=1e30 train.warmup_steps=0 train.steps=5 "
                                "train.save_interval=1 train.keep_last=1 train.eval_interval=0 train.out_dir=run"));
  EXPECT_EQ(r.status, 4) << r.err;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_EQ(r.err.rfind("lockstep: error: step 2: the loss is nan; the update was not applied", 0), 0u) << r.err;
  EXPECT_NE(r.err.find("no checkpoint of this state"), std::string::npos) << r.err;
  EXPECT_EQ(checkpoint_dirs(dir.path("run")), std::vector<std::string>{"step-00000001"});
  const std::vector<nlohmann::json> m = metrics_lines(dir.path("run"));
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m[1]["nonfinite"], "loss");
  EXPECT_TRUE(m[1]["loss"].is_null());
}

// A learning rate whose step overflows: step 1's update writes inf; the run stops before saving it.
TEST(NonFiniteGuard, NonFiniteUpdatedParametersStopTheRunInEitherMode) {
  for (const char* mode : {"stop", "skip_step"}) {
    TempDir dir;
    const Config c =
        debug_job(dir.path("run"), {"train.lr=1e38", "train.warmup_steps=0", "train.steps=3", "train.save_interval=1",
                                    "train.eval_interval=0", str("train.on_nonfinite=", mode)});
    const std::string error = nonfinite_error_of([&] { quiet_train(c); });
    EXPECT_EQ(error.rfind("step 1: the parameters AdamW updated are not finite (rank 0 first)", 0), 0u) << error;
    EXPECT_TRUE(checkpoint_dirs(dir.path("run")).empty()) << mode;
  }
}

// With module tracing the error names the first module whose output went non-finite; on 2 ranks
// every rank stops at the same step and one error comes out.
TEST(NonFiniteGuard, ModuleTracingNamesTheFirstNonFiniteModule) {
  TempDir dir;
  const Config c = debug_job(dir.path("run"), {"train.steps=4", "train.eval_interval=0", "train.save_interval=1",
                                               "debug.trace=modules", "debug.inject_nan=3:layers.0.mlp.fc"});
  const std::string error = nonfinite_error_of([&] { train_ranks(2, c); });
  EXPECT_EQ(error.rfind("step 3: the loss is nan", 0), 0u) << error;
  EXPECT_NE(error.find("first non-finite: layers.0.mlp.fc's output, step 3 micro-batch 0"), std::string::npos) << error;
  EXPECT_EQ(checkpoint_dirs(dir.path("run")), (std::vector<std::string>{"step-00000001", "step-00000002"}));
  EXPECT_NE(read_file(dir.path("run/trace/rank-00000.jsonl")).find("\"nonfinite\":true"), std::string::npos);
}

// skip_step: the NaN step changes no state (its fingerprint's parameter and moment hashes are the
// previous step's), later steps train on, and the run is deterministic and resumes bitwise across
// the skipped step (the checkpoint carries the count Adam's step leaves out).
TEST(NonFiniteGuard, SkipStepLeavesTheStateAsItWasAndResumesBitwise) {
  TempDir dir;
  const std::vector<std::string> keys = {"train.steps=6", "train.eval_interval=0", "train.save_interval=2",
                                         "train.on_nonfinite=skip_step", "debug.inject_nan=3:layers.0.attn.qkv"};
  quiet_train(debug_job(dir.path("a"), keys));
  quiet_train(debug_job(dir.path("b"), keys));
  const std::string fp = read_file(fingerprint_path(dir.path("a"), 0));
  EXPECT_EQ(fp, read_file(fingerprint_path(dir.path("b"), 0)));
  std::vector<std::string> resumed_keys = keys;
  resumed_keys.push_back("train.exit_interval=4");
  quiet_train(debug_job(dir.path("c"), resumed_keys));
  resumed_keys.back() = "train.resume=auto";
  quiet_train(debug_job(dir.path("c"), resumed_keys));
  EXPECT_EQ(read_file(fingerprint_path(dir.path("c"), 0)), fp) << "resumed across the skipped step";

  const std::vector<nlohmann::json> m = metrics_lines(dir.path("a"));
  ASSERT_EQ(m.size(), 6u);
  EXPECT_EQ(m[2]["nonfinite"], "loss");
  EXPECT_EQ(m[2]["skipped"], true);
  for (size_t i = 3; i < 6; ++i) {
    EXPECT_EQ(m[i]["skipped_steps"], 1) << i;
    EXPECT_TRUE(std::isfinite(m[i]["loss"].get<double>())) << i;
  }
  const std::vector<FingerprintLine> lines = read_fingerprint_lines(fingerprint_path(dir.path("a"), 0));
  ASSERT_EQ(lines.size(), 6u);
  for (const char* field : {"params", "optimizer"})
    EXPECT_EQ(*lines[2].find(field), *lines[1].find(field)) << field << ": the skipped step changed the state";
  EXPECT_NE(*lines[3].find("params"), *lines[2].find("params"));
}

TEST(NonFiniteGuard, BadInjectionsAreNamed) {
  TempDir dir;
  EXPECT_EQ(user_error_of([&] { debug_job(dir.path("run"), {"debug.inject_nan=x:layers.0.attn.qkv"}); }),
            "config: debug.inject_nan = \"x:layers.0.attn.qkv\": expected \"STEP:MODULE\" with STEP >= 1, e.g. "
            "\"3:layers.1.attn.qkv\"");
  EXPECT_EQ(
      user_error_of([&] {
        debug_job(dir.path("run"), {"debug.inject_nan=1:layers.0.attn.qkv", "debug.inject_ulp=1:layers.0.attn.qkv"});
      }),
      "config: debug.inject_ulp and debug.inject_nan are both set: inject one thing at a time");
  EXPECT_NE(user_error_of([&] {
              debug_job(dir.path("run"), {"train.on_nonfinite=ignore"});
            }).find("train.on_nonfinite = \"ignore\": expected one of stop, skip_step"),
            std::string::npos);
}

// model.rope_scaling = "llama3" reaches the model's RoPE table: with an original context shorter
// than the sequence the losses change from the first step; bad values are named.
TEST(Training, Llama3RopeScalingChangesTheRunAndBadValuesAreNamed) {
  TempDir dir;
  const std::vector<std::string> llama = {"model.preset=llama", "train.steps=2", "train.eval_interval=0"};
  std::vector<std::string> scaled = llama;
  scaled.insert(scaled.end(), {"model.rope_scaling=llama3", "model.rope_original_max_position_embeddings=16",
                               "model.rope_scaling_factor=4"});
  quiet_train(debug_job(dir.path("a"), llama));
  quiet_train(debug_job(dir.path("b"), scaled));
  const std::vector<FingerprintLine> a = read_fingerprint_lines(fingerprint_path(dir.path("a"), 0));
  const std::vector<FingerprintLine> b = read_fingerprint_lines(fingerprint_path(dir.path("b"), 0));
  ASSERT_EQ(a.size(), 2u);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_NE(*a[0].find("loss"), *b[0].find("loss"));
  EXPECT_EQ(user_error_of([&] { debug_job(dir.path("c"), {"model.rope_scaling=llama3"}); }),
            "config: model.rope_scaling = \"llama3\" needs model.position_embedding = \"rope\"");
  EXPECT_EQ(
      user_error_of([&] {
        debug_job(dir.path("c"), {"model.preset=llama", "model.rope_scaling=llama3", "model.rope_low_freq_factor=4"});
      }),
      "config: model.rope_low_freq_factor = 4 and model.rope_high_freq_factor = 4: need 0 < low < high");
}

}  // namespace
}  // namespace lockstep
