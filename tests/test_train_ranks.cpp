// Training on several ranks (threads backend): until data parallelism exists every rank trains the
// same model on the same data, so every rank's fingerprints equal the single-rank run's, apart
// from the rank's coordinates; rank 0 alone writes config.toml and metrics.jsonl.
#include <gtest/gtest.h>

#include <filesystem>
#include <regex>

#include "lockstep/comm/threads/thread_transport.h"
#include "lockstep/config/config.h"
#include "lockstep/train/fingerprint.h"
#include "lockstep/train/trainer.h"
#include "testing.h"

namespace lockstep {
namespace {

using testing::read_file;
using testing::TempDir;

Config job(const std::string& out_dir) {
  return load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/debug.toml",
                     {"train.steps=2", "train.eval_interval=0", "train.threads=1", "data.synthetic_bytes=65536",
                      "train.out_dir=" + out_dir});
}

TEST(TrainRanks, EveryRankMatchesTheSingleRankRun) {
  TempDir dir;
  std::FILE* sink = std::fopen("/dev/null", "w");
  train(job(dir.path("one")), sink);
  const Config three = job(dir.path("three"));
  run_threads(3, 60, [&](Communicator& comm) { train(three, sink, comm); });
  std::fclose(sink);
  const std::string one = read_file(fingerprint_path(dir.path("one"), 0));
  ASSERT_FALSE(one.empty());
  for (int r = 0; r < 3; ++r) {
    std::string got = read_file(fingerprint_path(dir.path("three"), r));
    // Coordinates of rank r in a world of 3 with every other size 1: dp = r.
    const std::string coords = str("\"rank\":", r, ",\"dp\":", r, ",");
    ASSERT_NE(got.find(coords), std::string::npos) << got;
    got = std::regex_replace(got, std::regex(coords), "\"rank\":0,\"dp\":0,");
    EXPECT_EQ(got, one) << "rank " << r;
  }
  EXPECT_TRUE(std::filesystem::exists(dir.path("three") + "/metrics.jsonl"));
  EXPECT_TRUE(std::filesystem::exists(dir.path("three") + "/config.toml"));
}

}  // namespace
}  // namespace lockstep
