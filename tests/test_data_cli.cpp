// End to end through the binary: `lockstep preprocess` a small JSONL corpus, then train two
// steps on indexed:PREFIX; bad data is one line on stderr and exit status 2.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include "testing.h"

namespace lockstep {
namespace {

using testing::read_file;
using testing::TempDir;

using Result = testing::CliResult;
constexpr auto run = testing::run_cli;

std::string corpus() {
  std::string s;
  for (int i = 0; i < 200; ++i)
    s += "{\"text\": \"Document " + std::to_string(i) + ": the quick brown fox jumps over the lazy dog, " +
         std::string(static_cast<size_t>(i % 50), 'z') + " caf\\u00e9 \\ud83d\\ude42.\"}\n";
  return s;
}

TEST(DataCli, PreprocessThenTrainOnIndexedData) {
  TempDir dir;
  dir.write("corpus.jsonl", corpus());
  Result r = run(dir, "preprocess --input corpus.jsonl --output data/corpus --append-eod --workers 2");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("200 documents"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("model.vocab_size >= 259"), std::string::npos) << r.out;
  ASSERT_TRUE(std::filesystem::exists(dir.path("data/corpus.idx")));

  const std::string train = std::string("train -c ") + LOCKSTEP_SOURCE_DIR +
                            "/configs/debug.toml data.source=indexed:data/corpus data.split=90,10 "
                            "model.vocab_size=259 train.steps=2 train.eval_interval=2 train.out_dir=run";
  r = run(dir, train);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("indexed 'data/corpus' (200 documents"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("step 2/2"), std::string::npos) << r.out;
  const std::string fp = read_file(dir.path("run/fingerprints/rank-00000.jsonl"));
  // The same job again gives the same bits.
  r = run(dir, train + "2");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(read_file(dir.path("run2/fingerprints/rank-00000.jsonl")), fp);

  // The end-of-document id 256 does not fit a 256-token vocabulary.
  r = run(dir,
          std::string("train -c ") + LOCKSTEP_SOURCE_DIR +
              "/configs/debug.toml data.source=indexed:data/corpus data.split=90,10 train.steps=1 train.out_dir=bad");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("lockstep: error: indexed dataset data 'data/corpus.bin': token 256"), std::string::npos)
      << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

TEST(DataCli, PreprocessErrorsAreOneLine) {
  TempDir dir;
  dir.write("bad.jsonl", "{\"text\": \"fine\"}\n{\"text\": 3}\n");
  Result r = run(dir, "preprocess --input bad.jsonl --output out/ds");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.err, "lockstep: error: preprocess: bad.jsonl:2: expected a JSON object with a string \"text\"\n");
  EXPECT_FALSE(std::filesystem::exists(dir.path("out/ds.bin")));
  r = run(dir, "preprocess --input bad.jsonl --output out/ds --workers 0");
  EXPECT_EQ(r.err, "lockstep: error: command line: --workers needs a positive number, got '0'\n");
  r = run(dir, "preprocess --input bad.jsonl --output out/ds --tokenizer wordpiece");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("tokenizer 'wordpiece'"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace lockstep
