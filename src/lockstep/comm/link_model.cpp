#include "lockstep/comm/link_model.h"

#include <algorithm>

namespace lockstep {

double LinkModel::wire_seconds(int from, int to, int64_t bytes) const {
  const LinkLevel& l = same_node(from, to) ? spec_.intra : spec_.inter;
  if (l.bytes_per_s <= 0) return 0;
  return l.latency_s + static_cast<double>(bytes) / l.bytes_per_s;
}

LinkModel::Clock::time_point LinkModel::deliver(int from, int to, int64_t bytes, Clock::time_point start) {
  const auto wire =
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(wire_seconds(from, to, bytes)));
  std::lock_guard<std::mutex> lock(mu_);
  Clock::time_point& free = link_free_[to];
  free = std::max(free, start) + wire;
  return free;
}

}  // namespace lockstep
