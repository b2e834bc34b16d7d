#include "lockstep/train/run_dir.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string_view>

#include "lockstep/core/error.h"

namespace lockstep {

void create_run_dir(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(dir) / "fingerprints", ec);
  if (ec) user_error("train.out_dir = \"", dir, "\": cannot create the run directory: ", ec.message());
}

void write_file_atomic(const std::string& path, const std::string& content) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) user_error("cannot write '", tmp, "': ", std::strerror(errno));
  size_t done = 0;
  while (done < content.size()) {
    const ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      user_error("cannot write '", tmp, "': ", std::strerror(err));
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    user_error("cannot write '", tmp, "': ", std::strerror(err));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    user_error("cannot rename '", tmp, "' to '", path, "': ", std::strerror(err));
  }
}

void cut_jsonl_after_step(const std::string& path, int64_t step) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return;
  std::string text;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, n);
  std::fclose(f);
  // Every line starts {"step":N (json_line.h writes keys in order); a line without it is kept
  // only before the cut (nothing else writes these files).
  std::string kept;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find('\n', at);
    if (end == std::string::npos) break;  // a torn last line (the run was killed mid-write) goes
    const std::string_view line(text.data() + at, end - at);
    constexpr std::string_view key = "{\"step\":";
    if (line.substr(0, key.size()) == key && std::strtoll(line.data() + key.size(), nullptr, 10) > step) break;
    kept.append(text, at, end + 1 - at);
    at = end + 1;
  }
  if (kept.size() != text.size()) write_file_atomic(path, kept);
}

LineLog::LineLog(const std::string& path, bool append) : path_(path), f_(std::fopen(path.c_str(), append ? "a" : "w")) {
  if (!f_) user_error("cannot open '", path, "' for writing: ", std::strerror(errno));
}

LineLog::~LineLog() {
  if (f_) std::fclose(f_);
}

void LineLog::write(const std::string& line) {
  if (std::fwrite(line.data(), 1, line.size(), f_) != line.size() || std::fflush(f_) != 0)
    user_error("cannot write '", path_, "': ", std::strerror(errno));
}

}  // namespace lockstep
