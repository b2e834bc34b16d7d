// TensorBoard event files (train/tensorboard.h): CRC-32C against its check value, the record framing
// and Event bytes against what TensorBoard's own Python code writes, a trained run's file walked record
// by record (lengths and both CRCs) and its events against metrics.jsonl, corruption detected, and a
// resumed run that leaves each step once in the directory.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "lockstep/config/config.h"
#include "lockstep/core/crc32c.h"
#include "lockstep/train/tensorboard.h"
#include "model_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

namespace fs = std::filesystem;
using testing::quiet_train;
using testing::read_file;
using testing::TempDir;

std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i < hex.size(); i += 2) out += static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16));
  return out;
}

Config moe_job(const std::string& out_dir, std::vector<std::string> extra = {}) {
  for (const char* kv : {"train.steps=6", "train.eval_interval=3", "train.tensorboard=true", "train.threads=1"})
    extra.push_back(kv);
  extra.push_back("train.out_dir=" + out_dir);
  return load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/moe-debug.toml", extra);
}

std::vector<std::string> events_files(const std::string& dir) {
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir)) files.push_back(e.path().string());
  std::sort(files.begin(), files.end());  // as TensorBoard orders them
  return files;
}

// Walks a file's records by the format's definition (not read_tfrecords): every length and both
// masked CRCs must verify and the records must fill the file exactly. Returns the records' data.
std::vector<std::string> walk_records(const std::string& path) {
  const std::string text = read_file(path);
  auto masked = [](const char* p, size_t n) {
    const uint32_t c = crc32c(p, n);
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
  };
  auto u32 = [&](size_t at) {
    uint32_t v;
    std::memcpy(&v, text.data() + at, 4);  // x86-64: little-endian, as the format
    return v;
  };
  std::vector<std::string> records;
  size_t at = 0;
  while (at < text.size()) {
    EXPECT_GE(text.size() - at, 16u) << path << " byte " << at;
    uint64_t length;
    std::memcpy(&length, text.data() + at, 8);
    EXPECT_EQ(u32(at + 8), masked(text.data() + at, 8)) << path << " byte " << at << ": length CRC";
    EXPECT_LE(at + 12 + length + 4, text.size()) << path << " byte " << at;
    if (at + 12 + length + 4 > text.size()) break;
    EXPECT_EQ(u32(at + 12 + length), masked(text.data() + at + 12, length)) << path << " byte " << at << ": data CRC";
    records.push_back(text.substr(at + 12, length));
    at += 12 + length + 4;
  }
  EXPECT_EQ(at, text.size()) << path;
  return records;
}

// metrics.jsonl's lines as (step, {tag: float value}), the tags as the writer names them.
std::vector<std::pair<int64_t, std::map<std::string, float>>> metrics_lines(const std::string& run) {
  std::vector<std::pair<int64_t, std::map<std::string, float>>> lines;
  std::istringstream in(read_file(run + "/metrics.jsonl"));
  for (std::string text; std::getline(in, text);) {
    const nlohmann::json line = nlohmann::json::parse(text);
    std::map<std::string, float> values;
    for (const auto& [key, v] : line.items()) {
      if (key == "step") continue;
      if (v.is_number()) values[tensorboard_tag(key)] = static_cast<float>(v.get<double>());
      // Per-rank arrays (alloc_peak_mb_ranks, step_ms_ranks, ...): one tag per rank.
      const std::string suffix = "_ranks";
      if (v.is_array() && key.size() > suffix.size() &&
          key.compare(key.size() - suffix.size(), suffix.size(), suffix) == 0)
        for (size_t r = 0; r < v.size(); ++r)
          values[key.substr(0, key.size() - suffix.size()) + "/rank" + std::to_string(r)] =
              static_cast<float>(v[r].get<double>());
    }
    lines.emplace_back(line["step"].get<int64_t>(), values);
  }
  return lines;
}

std::map<std::string, float> scalars_of(const TensorBoardEvent& e) {
  return std::map<std::string, float>(e.scalars.begin(), e.scalars.end());
}

TEST(TensorBoard, Crc32cMeetsItsCheckValue) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c("56789", 5, crc32c("1234", 4)), 0xE3069283u);  // continued
  EXPECT_EQ(crc32c("", 0), 0u);
}

// The expected bytes are what TensorBoard's Python code makes of the same input (bench/.venv):
// masked_crc32c from tensorboard.compat.tensorflow_stub.pywrap_tensorflow around b"hello", and
// event_pb2.Event(...).SerializeToString().
TEST(TensorBoard, RecordsAndEventsAreTheBytesTensorBoardWrites) {
  EXPECT_EQ(tfrecord("hello"), from_hex("0500000000000000eab2043e68656c6c6fbb1f1c19"));
  const TensorBoardEvent scalar{.wall_time = 1.5, .step = 3, .file_version = "", .scalars = {{"loss", 2.0f}}};
  EXPECT_EQ(encode_event(scalar), from_hex("09000000000000f83f10032a0d0a0b0a046c6f73731500000040"));
  const TensorBoardEvent first{.wall_time = 1.5, .step = 0, .file_version = "brain.Event:2", .scalars = {}};
  EXPECT_EQ(encode_event(first), from_hex("09000000000000f83f1a0d627261696e2e4576656e743a32"));
  const TensorBoardEvent back = decode_event(encode_event(scalar));
  EXPECT_EQ(back.wall_time, 1.5);
  EXPECT_EQ(back.step, 3);
  EXPECT_EQ(scalars_of(back), scalars_of(scalar));
  EXPECT_EQ(decode_event(encode_event(first)).file_version, "brain.Event:2");
}

TEST(TensorBoard, TagsNameTheNumberedGroups) {
  EXPECT_EQ(tensorboard_tag("loss"), "loss");
  EXPECT_EQ(tensorboard_tag("moe.3.imbalance"), "moe/layer3/imbalance");
  EXPECT_EQ(tensorboard_tag("pp.1.wait_fraction"), "pp/stage1/wait_fraction");
  EXPECT_EQ(tensorboard_tag("other.2.x"), "other.2.x");
}

TEST(TensorBoard, WriterTurnsEveryNumberOfALineIntoAScalar) {
  TempDir dir;
  std::string path;
  {
    TensorBoardWriter w(dir.path("tb"));
    path = w.path();
    w.write(R"({"step":5,"loss":2.5,"bad":null,"syncs":9,"mem_ranks":[1.5,2],"v":[3],"name":"text"})"
            "\n");
  }
  const TfRecords file = read_tfrecords(path);
  ASSERT_EQ(file.error, "");
  ASSERT_EQ(file.records.size(), 2u);
  const TensorBoardEvent e = decode_event(file.records[1]);
  EXPECT_EQ(e.step, 5);
  std::map<std::string, float> s = scalars_of(e);
  ASSERT_EQ(s.size(), 6u);
  EXPECT_TRUE(std::isnan(s["bad"]));
  EXPECT_EQ(s["loss"], 2.5f);
  EXPECT_EQ(s["syncs"], 9.0f);
  EXPECT_EQ(s["mem/rank0"], 1.5f);
  EXPECT_EQ(s["mem/rank1"], 2.0f);
  EXPECT_EQ(s["v/0"], 3.0f);
}

// A trained MoE run's events file: the name, every record, the first event's file_version, then one
// event per metrics.jsonl line with its step and exactly its numbers.
TEST(TensorBoard, TrainedRunWritesMetricsAsEvents) {
  TempDir dir;
  const std::string run = dir.path("run");
  quiet_train(moe_job(run));
  const std::vector<std::string> files = events_files(run + "/tensorboard");
  ASSERT_EQ(files.size(), 1u);
  const std::string name = fs::path(files[0]).filename().string();
  EXPECT_TRUE(std::regex_match(name, std::regex(R"(events\.out\.tfevents\.\d{10}\..+)"))) << name;

  const std::vector<std::string> records = walk_records(files[0]);
  const TfRecords read = read_tfrecords(files[0]);
  EXPECT_EQ(read.error, "");
  EXPECT_EQ(read.records, records);
  ASSERT_FALSE(records.empty());
  const TensorBoardEvent first = decode_event(records[0]);
  EXPECT_EQ(first.file_version, "brain.Event:2");
  EXPECT_TRUE(first.scalars.empty());
  EXPECT_GT(first.wall_time, 1.7e9);

  const auto lines = metrics_lines(run);
  ASSERT_EQ(lines.size(), 6u + 2u);  // six steps, two evaluations
  ASSERT_EQ(records.size(), 1 + lines.size());
  std::set<std::string> tags;
  for (size_t i = 0; i < lines.size(); ++i) {
    const TensorBoardEvent e = decode_event(records[i + 1]);
    EXPECT_EQ(e.step, lines[i].first);
    EXPECT_GE(e.wall_time, first.wall_time);
    EXPECT_EQ(scalars_of(e), lines[i].second) << "step " << e.step;
    for (const auto& [tag, v] : e.scalars) tags.insert(tag);
  }
  for (const char* tag : {"loss", "lm_loss", "aux_loss", "mtp_loss", "grad_norm", "lr", "step_ms", "tokens_per_s",
                          "mfu", "alloc_peak_mb", "alloc_peak_mb/rank0", "host_syncs", "eval_loss",
                          "moe/layer0/imbalance", "moe/layer1/tokens_min", "moe/layer1/tokens_max"})
    EXPECT_TRUE(tags.count(tag)) << tag;
}

// One changed byte anywhere in a record (its length, either CRC, its data) stops the reader at that
// record, which it names; so does a file cut short.
TEST(TensorBoard, ReaderDetectsACorruptedByte) {
  TempDir dir;
  const std::string good = tfrecord("first record") + tfrecord("second record") + tfrecord("third");
  const size_t second = tfrecord("first record").size();
  const size_t size = tfrecord("second record").size();
  for (size_t at = second; at < second + size; ++at) {
    std::string bad = good;
    bad[at] = static_cast<char>(bad[at] ^ 0x10);
    const TfRecords r = read_tfrecords(dir.write("bad", bad));
    ASSERT_EQ(r.records, std::vector<std::string>{"first record"}) << "byte " << at;
    EXPECT_EQ(r.error.rfind("byte " + std::to_string(second) + ": ", 0), 0u) << r.error;
  }
  const TfRecords cut = read_tfrecords(dir.write("cut", good.substr(0, good.size() - 3)));
  EXPECT_EQ(cut.records.size(), 2u);
  EXPECT_NE(cut.error.find("cut off"), std::string::npos) << cut.error;
  EXPECT_EQ(read_tfrecords(dir.write("good", good)).records.size(), 3u);
  EXPECT_NE(testing::user_error_of([&] { read_tfrecords(dir.path("missing")); }).find("missing"), std::string::npos);
  EXPECT_NE(testing::user_error_of([] { decode_event("\x2a\x7f"); }).find("malformed Event"), std::string::npos);
}

// Killed after step 6 with a torn last record, resumed from step 3's checkpoint: the first file keeps
// steps up to 3, the new file has 4 to 6, and the directory holds each step once with
// metrics.jsonl's values.
TEST(TensorBoard, ResumedRunLeavesEachStepOnce) {
  TempDir dir;
  const std::string run = dir.path("run");
  quiet_train(moe_job(run, {"train.save_interval=3"}));
  const std::string first = events_files(run + "/tensorboard").at(0);
  const std::string text = read_file(first);
  dir.write("run/tensorboard/" + fs::path(first).filename().string(), text.substr(0, text.size() - 5));
  quiet_train(moe_job(run, {"train.save_interval=3", "train.resume=" + run + "/checkpoints/step-00000003"}));

  const std::vector<std::string> files = events_files(run + "/tensorboard");
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(files[0], first);
  std::vector<int64_t> steps;
  std::map<int64_t, std::map<std::string, float>> by_step;
  for (const std::string& f : files) {
    std::vector<int64_t> mine;
    for (const std::string& data : walk_records(f)) {
      const TensorBoardEvent e = decode_event(data);
      if (!e.file_version.empty()) continue;
      mine.push_back(e.step);
      for (const auto& [tag, v] : e.scalars) by_step[e.step][tag] = v;
    }
    ASSERT_FALSE(mine.empty());
    EXPECT_EQ(f == first ? mine.back() : mine.front(), f == first ? 3 : 4) << f;
    steps.insert(steps.end(), mine.begin(), mine.end());
  }
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 3, 4, 5, 6, 6}));  // each step, and its evaluation
  std::map<int64_t, std::map<std::string, float>> want;
  for (const auto& [step, values] : metrics_lines(run)) want[step].insert(values.begin(), values.end());
  EXPECT_EQ(by_step, want);
}

}  // namespace
}  // namespace lockstep
