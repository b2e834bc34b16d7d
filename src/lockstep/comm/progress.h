// The progress thread of a rank: runs the rank's communication operations one after another, in
// the order they were posted, so that the caller can compute while they run (Work handles).
// Shared by every communicator (group) of the rank. A caller that waits for an operation nothing
// has started yet, with nothing running before it (a blocking collective: posted, then waited
// at once), runs it on its own thread instead (run_here): still one operation at a time, in post
// order, but without the two thread wake-ups of a hand-over, which on a busy machine cost more
// than a small collective itself.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace lockstep {

class ProgressThread;

struct OpState {
  ProgressThread* owner = nullptr;  // the thread it was posted to
  std::function<void()> run;
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
  // The rank's time blocked in Work::wait, in ns (its progress thread's counter, which the operation
  // shares so that a wait ending after the thread is gone still counts safely).
  std::shared_ptr<std::atomic<int64_t>> waited_ns;
};

class ProgressThread {
 public:
  ProgressThread();
  ~ProgressThread();  // finishes the queued operations, then joins
  ProgressThread(const ProgressThread&) = delete;
  ProgressThread& operator=(const ProgressThread&) = delete;

  std::shared_ptr<OpState> post(std::function<void()> run);
  // When op is the next to run and none is running, runs it on the calling thread and returns
  // true (op done, its error stored); else false.
  bool run_here(const std::shared_ptr<OpState>& op);
  // Seconds the rank's threads have spent blocked in Work::wait on this thread's operations: running
  // one on the caller's thread (run_here) and waiting for peers, summed over waiting threads.
  double waited_seconds() const { return static_cast<double>(waited_ns_->load()) * 1e-9; }

 private:
  void loop();
  static void execute(OpState& op);  // runs op, then marks it done and wakes its waiters

  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<OpState>> queue_;
  bool stop_ = false;
  bool running_ = false;  // an operation is running, here or on a caller's thread (run_here)
  const std::shared_ptr<std::atomic<int64_t>> waited_ns_ = std::make_shared<std::atomic<int64_t>>(0);
  std::thread thread_;
};

}  // namespace lockstep
