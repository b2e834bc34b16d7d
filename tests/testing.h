// Shared helpers for the test suite: deterministic random inputs, comparison against
// double-precision references, and central finite differences.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "lockstep/core/error.h"
#include "lockstep/core/philox.h"
#include "lockstep/core/thread_pool.h"

namespace lockstep::testing {

// Runs fn() with a pool of `threads` bound to this thread.
template <typename Fn>
void with_threads(int threads, Fn&& fn) {
  ThreadPool pool(threads);
  ThreadPool::Bind bind(&pool);
  fn();
}

// n normal values * scale, drawn from Philox keyed by (seed, name).
inline std::vector<float> randn(int64_t n, uint64_t seed, const std::string& name = "test", float scale = 1.0f) {
  std::vector<float> v(static_cast<size_t>(n));
  RandomStream(seed, purpose_id(name)).fill_normal(v.data(), n, scale);
  return v;
}

// n integers uniform in [0, V) (token ids, targets), from Philox keyed by (seed, name).
inline std::vector<int32_t> random_ints(int64_t n, int64_t V, uint64_t seed, const std::string& name) {
  const RandomStream rng(seed, purpose_id(name));
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[i] = static_cast<int32_t>(rng.bits(i) % V);
  return t;
}

inline std::vector<double> to_double(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

// Largest |got - ref| / (atol + |ref|) over the elements; a value <= 1 means within tolerance.
// Reports the first offending index through `where`.
inline ::testing::AssertionResult all_close(const float* got, const double* ref, int64_t n, double rtol, double atol,
                                            const std::string& what = "") {
  for (int64_t i = 0; i < n; ++i) {
    const double d = std::abs(static_cast<double>(got[i]) - ref[i]);
    if (!(d <= atol + rtol * std::abs(ref[i]))) {
      return ::testing::AssertionFailure()
             << what << "[" << i << "]: got " << got[i] << ", reference " << ref[i] << " (|diff| " << d << " > atol "
             << atol << " + rtol " << rtol << " * |ref|)";
    }
  }
  return ::testing::AssertionSuccess();
}
inline ::testing::AssertionResult all_close(const std::vector<float>& got, const std::vector<double>& ref, double rtol,
                                            double atol, const std::string& what = "") {
  if (got.size() != ref.size()) return ::testing::AssertionFailure() << what << ": size mismatch";
  return all_close(got.data(), ref.data(), static_cast<int64_t>(got.size()), rtol, atol, what);
}

// Largest |got - ref| over the tensor's largest |ref| (elements near zero are judged on the tensor's
// scale): how the oracle tests (Hugging Face, Megatron) measure a tensor's error.
inline double relative_error(const std::vector<float>& got, const std::vector<float>& ref) {
  double err = 0, scale = 1e-30;
  for (size_t i = 0; i < ref.size(); ++i) {
    err = std::max(err, std::abs(static_cast<double>(got[i]) - ref[i]));
    scale = std::max(scale, std::abs(static_cast<double>(ref[i])));
  }
  return err / scale;
}

inline ::testing::AssertionResult bitwise_equal(const float* a, const float* b, int64_t n,
                                                const std::string& what = "") {
  for (int64_t i = 0; i < n; ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
      return ::testing::AssertionFailure() << what << "[" << i << "]: " << a[i] << " vs " << b[i] << " differ in bits";
    }
  }
  return ::testing::AssertionSuccess();
}
inline ::testing::AssertionResult bitwise_equal(const std::vector<float>& a, const std::vector<float>& b,
                                                const std::string& what = "") {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << what << ": size mismatch";
  return bitwise_equal(a.data(), b.data(), static_cast<int64_t>(a.size()), what);
}

// Central differences of a scalar function of x (in double): g[i] = (f(x+h e_i) - f(x-h e_i)) / 2h.
inline std::vector<double> finite_difference(const std::function<double(const std::vector<double>&)>& f,
                                             std::vector<double> x, double h = 1e-5) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double xi = x[i];
    x[i] = xi + h;
    const double fp = f(x);
    x[i] = xi - h;
    const double fm = f(x);
    x[i] = xi;
    g[i] = (fp - fm) / (2 * h);
  }
  return g;
}

// A fresh directory under the system temp dir, removed with its contents at scope exit.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name =
        std::string("lockstep-") + (info ? std::string(info->test_suite_name()) + "-" + info->name() : "test");
    for (char& c : name)
      if (c == '/') c = '_';
    // The pid keeps concurrent runs of the same test (two builds, ctest -j) out of each other's way.
    path_ = std::filesystem::temp_directory_path() / (name + "-" + std::to_string(::getpid()));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string path(const std::string& leaf = "") const {
    return leaf.empty() ? path_.string() : (path_ / leaf).string();
  }
  std::string write(const std::string& leaf, const std::string& content) const {
    std::ofstream(path(leaf), std::ios::binary) << content;
    return path(leaf);
  }

 private:
  std::filesystem::path path_;
};

inline std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The message of the UserError that fn() throws, or "(no error)".
inline std::string user_error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const UserError& e) {
    return e.what();
  }
  return "(no error)";
}

// Runs the lockstep binary with `args` in `dir`; exit status, stdout and stderr.
struct CliResult {
  int status;
  std::string out, err;
};
inline CliResult run_cli(const TempDir& dir, const std::string& args) {
  const std::string cmd =
      std::string("cd '") + dir.path() + "' && '" + LOCKSTEP_BINARY + "' " + args + " >out.txt 2>err.txt";
  const int raw = std::system(cmd.c_str());
  return {WIFEXITED(raw) ? WEXITSTATUS(raw) : -1, read_file(dir.path("out.txt")), read_file(dir.path("err.txt"))};
}

// Starts the lockstep binary with `args` in the background, its stdout and stderr into `output`;
// returns its pid (for kill and waitpid).
inline pid_t spawn_cli(const std::vector<std::string>& args, const std::string& output = "/dev/null") {
  const pid_t pid = fork();
  if (pid == 0) {
    std::vector<char*> argv = {const_cast<char*>(LOCKSTEP_BINARY)};
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    const int fd = open(output.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    execv(LOCKSTEP_BINARY, argv.data());
    _exit(127);
  }
  return pid;
}

}  // namespace lockstep::testing
