#include "lockstep/parallel/pipeline/schedule.h"

#include <algorithm>
#include <map>
#include <tuple>

#include "lockstep/core/error.h"

namespace lockstep {

std::vector<PipelineAction> pipeline_schedule(const std::string& kind, int p, int v, int64_t m, int stage) {
  LOCKSTEP_CHECK(p >= 1 && v >= 1 && m >= 1 && stage >= 0 && stage < p, "pipeline_schedule(", p, ", ", v, ", ", m, ", ",
                 stage, ")");
  std::vector<PipelineAction> a;
  if (kind == "all_forward_all_backward") {
    LOCKSTEP_CHECK(v == 1, "all_forward_all_backward has no virtual stages");
    for (int64_t i = 0; i < m; ++i) a.push_back({true, 0, i});
    for (int64_t i = 0; i < m; ++i) a.push_back({false, 0, i});
    return a;
  }
  LOCKSTEP_CHECK(kind == "1f1b", "unknown pipeline schedule ", kind);
  if (v > 1 && m % p)
    user_error("interleaved pipeline (parallel.virtual_pipeline = ", v, "): the micro-batches per rank (", m,
               " = train.global_batch / (train.micro_batch x data-parallel size)) must be a multiple of "
               "parallel.pipeline = ",
               p);
  // Virtual micro-batch k: forward of chunk (k mod pv) / p on micro-batch (k / pv) p + k mod p; the
  // k-th backward runs the chunks in reverse.
  const int64_t total = m * v, pv = static_cast<int64_t>(p) * v;
  auto fwd = [&](int64_t k) { return PipelineAction{true, static_cast<int>((k % pv) / p), (k / pv) * p + k % p}; };
  auto bwd = [&](int64_t k) {
    return PipelineAction{false, v - 1 - static_cast<int>((k % pv) / p), (k / pv) * p + k % p};
  };
  int64_t warmup = v == 1 ? p - stage - 1 : (m == p ? total : static_cast<int64_t>(p - stage - 1) * 2 + (v - 1) * p);
  warmup = std::min(warmup, total);
  for (int64_t k = 0; k < warmup; ++k) a.push_back(fwd(k));
  for (int64_t k = 0; k < total - warmup; ++k) {
    a.push_back(fwd(warmup + k));
    a.back().with_next = v > 1;
    a.push_back(bwd(k));
  }
  for (int64_t k = total - warmup; k < total; ++k) a.push_back(bwd(k));
  return a;
}

int64_t max_in_flight(const std::vector<PipelineAction>& actions) {
  // A micro-batch is in flight from its first forward to its last backward on this rank.
  std::map<int64_t, int> forwards, backwards;
  for (const PipelineAction& x : actions) ++(x.forward ? forwards : backwards)[x.micro];
  std::map<int64_t, int> seen_f, seen_b;
  int64_t live = 0, peak = 0;
  for (const PipelineAction& x : actions) {
    if (x.forward && seen_f[x.micro]++ == 0) peak = std::max(peak, ++live);
    if (!x.forward && ++seen_b[x.micro] == backwards[x.micro]) --live;
  }
  return peak;
}

double analytic_bubble(int p, int v, int64_t m) {
  return static_cast<double>(p - 1) / static_cast<double>(static_cast<int64_t>(v) * m + p - 1);
}

double simulated_bubble(const std::string& kind, int p, int v, int64_t m, double tf, double tb) {
  std::vector<std::vector<PipelineAction>> plan(static_cast<size_t>(p));
  for (int r = 0; r < p; ++r) plan[static_cast<size_t>(r)] = pipeline_schedule(kind, p, v, m, r);
  // Finish time of (forward?, model chunk, micro); a rank runs its actions in order.
  std::map<std::tuple<bool, int64_t, int64_t>, double> done;
  std::vector<size_t> next(static_cast<size_t>(p), 0);
  std::vector<double> clock(static_cast<size_t>(p), 0.0);
  const int64_t chunks = static_cast<int64_t>(p) * v;
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      auto& i = next[static_cast<size_t>(r)];
      while (i < plan[static_cast<size_t>(r)].size()) {
        const PipelineAction& x = plan[static_cast<size_t>(r)][i];
        const int64_t mc = static_cast<int64_t>(x.chunk) * p + r;  // model chunk
        double ready = clock[static_cast<size_t>(r)];
        // Forward needs the previous model chunk's forward; backward the next one's backward, or
        // on the last model chunk its own forward.
        std::tuple<bool, int64_t, int64_t> dep{true, -1, 0};
        if (x.forward && mc > 0) dep = {true, mc - 1, x.micro};
        if (!x.forward)
          dep = mc + 1 < chunks ? std::tuple<bool, int64_t, int64_t>{false, mc + 1, x.micro}
                                : std::tuple<bool, int64_t, int64_t>{true, mc, x.micro};
        if (std::get<1>(dep) >= 0) {
          auto it = done.find(dep);
          if (it == done.end()) break;
          ready = std::max(ready, it->second);
        }
        clock[static_cast<size_t>(r)] = ready + (x.forward ? tf : tb);
        done[{x.forward, mc, x.micro}] = clock[static_cast<size_t>(r)];
        ++i;
        progress = true;
      }
    }
  }
  for (int r = 0; r < p; ++r)
    LOCKSTEP_CHECK(next[static_cast<size_t>(r)] == plan[static_cast<size_t>(r)].size(), "pipeline schedule deadlocks");
  const double end = *std::max_element(clock.begin(), clock.end());
  const double busy = static_cast<double>(m * v) * (tf + tb);
  return 1.0 - busy / end;
}

}  // namespace lockstep
