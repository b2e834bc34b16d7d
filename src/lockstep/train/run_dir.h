// The run directory (train.out_dir): config.toml (resolved), metrics.jsonl, fingerprints/.
#pragma once

#include <cstdio>
#include <string>

namespace lockstep {

// Creates dir and dir/fingerprints; UserError naming train.out_dir when it cannot.
void create_run_dir(const std::string& dir);

// Writes content to path through a temporary file in the same directory, fsynced, then renamed
// over path: readers see the old file or the new one, never half of one.
void write_file_atomic(const std::string& path, const std::string& content);

// An append-only line log (JSON lines), truncated when opened, flushed after every line.
class LineLog {
 public:
  explicit LineLog(const std::string& path);
  ~LineLog();
  LineLog(const LineLog&) = delete;
  LineLog& operator=(const LineLog&) = delete;
  void write(const std::string& line);

 private:
  std::string path_;
  std::FILE* f_ = nullptr;
};

}  // namespace lockstep
