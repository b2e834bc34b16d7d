// The run directory (train.out_dir): config.toml (resolved), metrics.jsonl, fingerprints/.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace lockstep {

// Creates dir and dir/fingerprints; UserError naming train.out_dir when it cannot.
void create_run_dir(const std::string& dir);

// Writes content to path through a temporary file in the same directory, fsynced, then renamed
// over path: readers see the old file or the new one, never half of one.
void write_file_atomic(const std::string& path, const std::string& content);

// Keeps the lines of a JSON-lines file (metrics.jsonl, fingerprints) whose "step" is at most step,
// rewriting it atomically (write_file_atomic): a run resumed from step's checkpoint continues the
// file where the uninterrupted run had it. Nothing happens when the file does not exist.
void cut_jsonl_after_step(const std::string& path, int64_t step);

// An append-only line log (JSON lines), flushed after every line; truncated when opened, or
// appended to with append = true (a resumed run).
class LineLog {
 public:
  explicit LineLog(const std::string& path, bool append = false);
  ~LineLog();
  LineLog(const LineLog&) = delete;
  LineLog& operator=(const LineLog&) = delete;
  void write(const std::string& line);

 private:
  std::string path_;
  std::FILE* f_ = nullptr;
};

}  // namespace lockstep
