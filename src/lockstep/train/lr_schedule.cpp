#include "lockstep/train/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace lockstep {

double learning_rate(const TrainConfig& t, int64_t step) {
  if (step <= t.warmup_steps) return t.lr * static_cast<double>(step) / static_cast<double>(t.warmup_steps);
  if (t.lr_schedule == "constant") return t.lr;
  if (t.lr_schedule == "cosine") {
    const double span = static_cast<double>(std::max<int64_t>(t.steps - t.warmup_steps, 1));
    const double p = std::min(1.0, static_cast<double>(step - t.warmup_steps) / span);
    return t.min_lr + (t.lr - t.min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * p));
  }
  // wsd: warmup, stable, decay.
  const int64_t decay = t.decay_steps ? t.decay_steps : std::max<int64_t>(t.steps / 5, 1);
  const int64_t decay_start = t.steps - decay;
  if (step <= decay_start) return t.lr;
  const double p = std::min(1.0, static_cast<double>(step - decay_start) / static_cast<double>(decay));
  return t.lr + (t.min_lr - t.lr) * p;
}

}  // namespace lockstep
