// Errors. Two kinds, kept apart on purpose:
//   UserError      - bad input from a user (config key, value, file, command line). The CLI prints
//                    its message as one line and exits non-zero. Say what is wrong and name it.
//   InternalError  - a broken invariant inside lockstep (LOCKSTEP_CHECK). Carries file and line.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace lockstep {

// Concatenates the arguments with operator<< (g++ 12 has no <format>).
template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

class UserError : public std::runtime_error {
 public:
  explicit UserError(const std::string& msg) : std::runtime_error(msg) {}
};

// A training run stopped by its non-finite guard (train.on_nonfinite, docs/faults.md): the CLI's
// exit status 4. Every rank raises it at the same step; `report` is false on all but one (rank 0),
// so that one line is printed.
class NonFiniteError : public std::runtime_error {
 public:
  NonFiniteError(const std::string& msg, bool report) : std::runtime_error(msg), report_(report) {}
  bool report() const { return report_; }

 private:
  bool report_;
};

class InternalError : public std::logic_error {
 public:
  explicit InternalError(const std::string& msg) : std::logic_error(msg) {}
};

template <typename... Args>
[[noreturn]] void user_error(const Args&... args) {
  throw UserError(str(args...));
}

namespace detail {
template <typename... Args>
[[noreturn]] void check_failed(const char* file, int line, const char* cond, const Args&... args) {
  throw InternalError(
      str("internal error at ", file, ":", line, ": check `", cond, "` failed", sizeof...(args) ? ": " : "", args...));
}
}  // namespace detail

}  // namespace lockstep

// LOCKSTEP_CHECK(cond, "message parts", value, ...): internal invariant, always on (also in
// Release); message parts are streamed together.
#define LOCKSTEP_CHECK(cond, ...)                                                             \
  do {                                                                                        \
    if (!(cond)) [[unlikely]]                                                                 \
      ::lockstep::detail::check_failed(__FILE__, __LINE__, #cond __VA_OPT__(, ) __VA_ARGS__); \
  } while (0)
