// TensorBoard event files (train.tensorboard = true): rank 0 writes
// RUN/tensorboard/events.out.tfevents.<unix time>.<hostname> beside metrics.jsonl, one Event per line
// of metrics.jsonl holding every number of the line as a scalar. Hand-encoded, no protobuf library:
//   file      records, each: uint64 length, uint32 masked CRC of those 8 bytes, the data, uint32 masked
//             CRC of the data (little-endian; masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8, c the
//             CRC-32C of core/crc32c.h)
//   data      an Event (TensorFlow's event.proto): wall_time (field 1, double), step (2, int64), and
//             file_version (3, string; "brain.Event:2", the file's first record) or summary (5)
//   summary   a Summary: value (1, repeated Summary.Value: tag (1, string), simple_value (2, float))
// TensorBoard reads every events file of the directory and merges them by step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace lockstep {

// A TFRecord's masked CRC-32C of n bytes.
uint32_t tfrecord_crc(const void* data, size_t n);
// data framed as one TFRecord.
std::string tfrecord(const std::string& data);

// The records of a TFRecord file up to the first one that does not verify.
struct TfRecords {
  std::vector<std::string> records;  // each verified record's data, in file order
  std::string error;                 // why reading stopped before the end (byte offset, what); "" if it did not
};
// UserError when the file cannot be opened.
TfRecords read_tfrecords(const std::string& path);

// An Event as lockstep writes them.
struct TensorBoardEvent {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;                            // the first event's; "" in the others
  std::vector<std::pair<std::string, float>> scalars;  // the summary's (tag, simple_value)
};
std::string encode_event(const TensorBoardEvent& event);
// Fields it does not know are skipped, as protobuf does; UserError when data is not a well-formed
// message.
TensorBoardEvent decode_event(const std::string& data);

// The scalar's tag of a metrics.jsonl key: the numbered groups name their number (moe.3.imbalance ->
// moe/layer3/imbalance, pp.1.wait_fraction -> pp/stage1/wait_fraction), other keys are their own tag.
std::string tensorboard_tag(const std::string& key);

// Rank 0's events file of a run. Each write() is one record, flushed.
class TensorBoardWriter {
 public:
  // Creates dir when missing and a new file in it (a name already there gets a suffix .1, .2, ...),
  // whose first event holds the file_version. UserError naming the path when it cannot.
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  const std::string& path() const { return path_; }
  // One Event from a line of metrics.jsonl (train/json_line.h): its "step", and every other number as a
  // scalar tagged tensorboard_tag(key); an array one scalar per element (NAME_ranks: NAME/rankI,
  // other keys KEY/I); null (a non-finite value) as NaN; other values are left out.
  void write(const std::string& json_line);

 private:
  void append(const TensorBoardEvent& event);

  std::string path_;
  std::FILE* f_ = nullptr;
};

// Drops the events after `step` from every events file in dir, rewriting a file atomically where it
// changes, as cut_jsonl_after_step (run_dir.h) does for metrics.jsonl: a run resumed from step's
// checkpoint adds a new file, and the directory then holds each step once. A file's records from the
// first one that does not verify (a torn last record of a killed run) are dropped too. Nothing happens
// when dir does not exist.
void cut_tensorboard_after_step(const std::string& dir, int64_t step);

}  // namespace lockstep
