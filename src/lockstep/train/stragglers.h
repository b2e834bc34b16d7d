// Straggler detection (train.straggler_threshold): a rank that is persistently slower than the
// others. Every step is as slow as its slowest rank, since the collectives wait for it, so a rank's
// step time says little; its compute time does: the step time less the time it spent waiting in
// collectives (Communicator::wait_seconds). A slow rank computes longer and waits less; the others
// wait for it.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

namespace lockstep {

class StragglerWatch {
 public:
  static constexpr int kWindow = 10;  // steps

  // threshold: train.straggler_threshold (0 = never warn).
  explicit StragglerWatch(double threshold) : threshold_(threshold) {}

  // A step's per-rank step times and times waiting in collectives (ms, rank order). Returns a
  // warning line when, over the last kWindow steps, some rank's median compute time exceeds the
  // median of the other ranks' medians by more than the threshold (the slowest such rank; then
  // the window starts again), else "".
  std::string add(int64_t step, const std::vector<double>& step_ms, const std::vector<double>& comm_wait_ms);

 private:
  double threshold_;
  std::deque<std::vector<double>> window_;  // compute ms per rank, of the last steps
  int64_t first_step_ = 0;                  // of the window
};

}  // namespace lockstep
