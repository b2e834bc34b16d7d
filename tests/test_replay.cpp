// lockstep replay (train/replay.h): a step re-run from the checkpoint before it reproduces the
// run's fingerprints bit for bit, with module statistics; overrides make the experiment; bad input
// is refused by name. The run directory's build.json (train/build_info.h) is what it checks.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "lockstep/config/config.h"
#include "lockstep/core/error.h"
#include "lockstep/train/build_info.h"
#include "lockstep/train/fingerprint.h"
#include "lockstep/train/replay.h"
#include "lockstep/train/run_diff.h"
#include "model_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

using testing::quiet_train;
using testing::read_file;
using testing::TempDir;
using testing::train_ranks;
using testing::user_error_of;

Config job(const std::string& file, const std::string& out_dir, std::vector<std::string> extra) {
  extra.push_back("train.out_dir=" + out_dir);
  extra.push_back("train.eval_interval=0");
  return load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/" + file, extra);
}

ReplayResult replay_quietly(const std::string& run, int64_t step, std::vector<std::string> overrides = {},
                            std::string out = "") {
  const std::unique_ptr<std::FILE, int (*)(std::FILE*)> sink(std::fopen("/dev/null", "w"), &std::fclose);
  return replay({run, step, std::move(out), std::move(overrides)}, sink.get());
}

TEST(Replay, ReproducesAStepBitForBitWithModuleStatistics) {
  TempDir dir;
  const std::string run = dir.path("run");
  quiet_train(job("moe-debug.toml", run, {"train.steps=6", "train.save_interval=2"}));
  const ReplayResult r = replay_quietly(run, 5);
  EXPECT_TRUE(r.reproduced) << r.report;
  EXPECT_EQ(r.from_step, 4);
  EXPECT_EQ(r.out, run + "/replay-step-5");
  EXPECT_NE(r.report.find("reproduces the run's fingerprints bit for bit"), std::string::npos) << r.report;
  EXPECT_NE(r.report.find("the router's load"), std::string::npos) << r.report;
  EXPECT_EQ(read_file(r.out + "/replay.txt"), r.report);
  // Steps 5 only, traced, every record with its statistics.
  const std::vector<FingerprintLine> fp = read_fingerprint_lines(fingerprint_path(r.out, 0));
  ASSERT_EQ(fp.size(), 1u);
  EXPECT_EQ(fp[0].step, 5);
  const std::vector<FingerprintLine> trace = read_fingerprint_lines(trace_path(r.out, 0));
  ASSERT_FALSE(trace.empty());
  for (const FingerprintLine& l : trace) {
    ASSERT_TRUE(l.find("norm") && l.find("max_abs")) << l.step;
    EXPECT_GE(std::stod(*l.find("max_abs")), 0.0);
  }
}

// Two ranks (tensor parallelism): the replay runs on as many ranks as saved the checkpoint.
TEST(Replay, ReproducesATwoRankRun) {
  TempDir dir;
  const std::string run = dir.path("run");
  train_ranks(2, job("debug.toml", run, {"train.steps=4", "train.save_interval=2", "parallel.tensor=2"}));
  const ReplayResult r = replay_quietly(run, 4);
  EXPECT_TRUE(r.reproduced) << r.report;
  EXPECT_NE(r.report.find("on 2 ranks"), std::string::npos) << r.report;
  EXPECT_TRUE(std::filesystem::exists(fingerprint_path(r.out, 1)));
}

// An override is the experiment: the replay differs from the run from that step on, and two
// replays compare with lockstep diff, which names the first module that differs.
TEST(Replay, OverridesChangeOneThingAndTwoReplaysCompare) {
  TempDir dir;
  const std::string run = dir.path("run");
  quiet_train(job("debug.toml", run, {"train.steps=4", "train.save_interval=2"}));
  const ReplayResult a = replay_quietly(run, 4, {}, dir.path("a"));
  const ReplayResult b = replay_quietly(run, 4, {"model.norm_eps=0.01"}, dir.path("b"));
  EXPECT_TRUE(a.reproduced);
  EXPECT_FALSE(b.reproduced);
  EXPECT_NE(b.report.find("with model.norm_eps=0.01"), std::string::npos) << b.report;
  const RunDiff d = diff_runs(a.out, b.out);
  EXPECT_FALSE(d.identical);
  EXPECT_NE(d.report.find("step 3"), std::string::npos) << d.report;
  EXPECT_NE(d.report.find("module"), std::string::npos) << d.report;
}

// The step that stopped a run (a NaN) replays to the same stop, and its fingerprint matches.
TEST(Replay, ReplaysTheStepThatStoppedTheRun) {
  TempDir dir;
  const std::string run = dir.path("run");
  const Config c =
      job("debug.toml", run, {"train.steps=6", "train.save_interval=2", "debug.inject_nan=5:layers.0.mlp.fc"});
  EXPECT_THROW(quiet_train(c), NonFiniteError);
  const ReplayResult r = replay_quietly(run, 5);
  EXPECT_TRUE(r.reproduced) << r.report;
  EXPECT_NE(r.report.find("the non-finite guard stopped it: step 5: the loss is nan"), std::string::npos) << r.report;
  EXPECT_NE(r.report.find("first non-finite: layers.0.mlp.fc's output, step 5 micro-batch 0"), std::string::npos)
      << r.report;
}

TEST(Replay, RefusesByName) {
  TempDir dir;
  const std::string run = dir.path("run");
  const std::string text = dir.write("corpus.txt", std::string(20000, 'a') + std::string(20000, 'b'));
  quiet_train(job("debug.toml", run, {"train.steps=4", "train.save_interval=2", "data.source=text:" + text}));
  EXPECT_EQ(user_error_of([&] { replay_quietly(run, 2); }),
            str("replay: '", run, "/checkpoints' holds no complete checkpoint before step 2 (it holds step-00000002, ",
                "step-00000004)"));
  EXPECT_EQ(user_error_of([&] { replay_quietly(run, 7); }),
            str("replay: --step 7 is not a step the run recorded (1 .. 4 in ", run, "/fingerprints/rank-00000.jsonl)"));
  EXPECT_EQ(user_error_of([&] { replay_quietly(run, 4, {"train.resume=auto"}); }),
            "replay: train.resume is set by replay itself");
  EXPECT_EQ(user_error_of([&] { replay_quietly(dir.path("nope"), 4); }),
            str("replay: '", dir.path("nope"), "' is not a run directory (no config.toml)"));
  // The data changed since: named with both checksums.
  dir.write("corpus.txt", std::string(20000, 'b') + std::string(20000, 'a'));
  const std::string data = user_error_of([&] { replay_quietly(run, 4); });
  EXPECT_EQ(data.rfind(str("replay: '", run, "' was trained by another build or on other data (data:", text,
                           " was \"40000 bytes, xxh3 "),
                       0),
            0u)
      << data;
  dir.write("corpus.txt", std::string(20000, 'a') + std::string(20000, 'b'));
  // Another compiler recorded.
  std::string build = read_file(run + "/build.json");
  build.replace(build.find("\"g++ "), 5, "\"clang++ ");
  std::ofstream(run + "/build.json") << build;
  EXPECT_NE(user_error_of([&] { replay_quietly(run, 4); }).find("(compiler was \"clang++ "), std::string::npos);
  std::filesystem::remove(run + "/build.json");
  EXPECT_EQ(user_error_of([&] { replay_quietly(run, 4); }),
            str("replay: '", run, "/build.json' is missing: the run was recorded by an older lockstep, so its build ",
                "cannot be checked"));
}

TEST(BuildInfo, RecordsTheBuildAndReadsItBack) {
  DataConfig data;
  const BuildInfo b = current_build(data);
  ASSERT_GE(b.fields.size(), 8u);
  EXPECT_EQ(b.fields[0].first, "commit");
  EXPECT_FALSE(b.fields[0].second.empty());
  const BuildInfo back = BuildInfo::parse(b.json(), "build.json");
  EXPECT_EQ(back.fields, b.fields);
  EXPECT_EQ(b.difference(back), "");
  EXPECT_EQ(user_error_of([] { BuildInfo::parse("[1]", "x.json"); }), "'x.json' is not a JSON object");
  EXPECT_EQ(user_error_of([] { BuildInfo::parse("{\"commit\": 3}", "x.json"); }),
            "'x.json': field 'commit' is not a string");
}

}  // namespace
}  // namespace lockstep
