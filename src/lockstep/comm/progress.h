// The progress thread of a rank: runs the rank's communication operations one after another, in
// the order they were posted, so that the caller can compute while they run (Work handles).
// Shared by every communicator (group) of the rank.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace lockstep {

struct OpState {
  std::function<void()> run;
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
};

class ProgressThread {
 public:
  ProgressThread();
  ~ProgressThread();  // finishes the queued operations, then joins
  ProgressThread(const ProgressThread&) = delete;
  ProgressThread& operator=(const ProgressThread&) = delete;

  std::shared_ptr<OpState> post(std::function<void()> run);

 private:
  void loop();

  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<OpState>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace lockstep
