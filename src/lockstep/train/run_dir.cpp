#include "lockstep/train/run_dir.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

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

LineLog::LineLog(const std::string& path) : path_(path), f_(std::fopen(path.c_str(), "w")) {
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
