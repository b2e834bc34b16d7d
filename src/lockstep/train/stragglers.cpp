#include "lockstep/train/stragglers.h"

#include <algorithm>
#include <cstdio>

namespace lockstep {

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

}  // namespace

std::string StragglerWatch::add(int64_t step, const std::vector<double>& step_ms,
                                const std::vector<double>& comm_wait_ms) {
  const size_t ranks = step_ms.size();
  if (threshold_ <= 0 || ranks < 2) return "";
  if (window_.empty()) first_step_ = step;
  std::vector<double> compute(ranks);
  for (size_t r = 0; r < ranks; ++r) compute[r] = std::max(0.0, step_ms[r] - comm_wait_ms[r]);
  window_.push_back(std::move(compute));
  if (window_.size() < static_cast<size_t>(kWindow)) return "";
  std::vector<double> typical(ranks);  // each rank's median over the window
  for (size_t r = 0; r < ranks; ++r) {
    std::vector<double> v;
    for (const std::vector<double>& s : window_) v.push_back(s[r]);
    typical[r] = median(v);
  }
  int slowest = -1;
  double worst = 1 + threshold_, others_ms = 0;
  for (size_t r = 0; r < ranks; ++r) {
    std::vector<double> others = typical;
    others.erase(others.begin() + static_cast<std::ptrdiff_t>(r));
    const double m = median(others);
    if (m > 0 && typical[r] / m > worst) slowest = static_cast<int>(r), worst = typical[r] / m, others_ms = m;
  }
  const int64_t from = first_step_;
  if (slowest < 0) {
    window_.pop_front();
    ++first_step_;
    return "";
  }
  window_.clear();
  char text[320];
  std::snprintf(text, sizeof text,
                "lockstep: warning: rank %d is slow: over steps %lld-%lld it computed %.1f ms per step (step time "
                "less time waiting in collectives), %.2fx the other ranks' median of %.1f ms "
                "(train.straggler_threshold = %g)",
                slowest, static_cast<long long>(from), static_cast<long long>(step), typical[slowest], worst, others_ms,
                threshold_);
  return text;
}

}  // namespace lockstep
