// Learning rate at optimizer step s (counting from 1), computed in double:
//   warmup (s <= warmup_steps): lr * s / warmup_steps
//   constant: lr
//   cosine:   min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2, p = (s - warmup) / (steps - warmup)
//   wsd:      lr until the last decay_steps steps (default 20% of steps), then linear to min_lr
#pragma once

#include <cstdint>

#include "lockstep/config/config.h"

namespace lockstep {

double learning_rate(const TrainConfig& t, int64_t step);

}  // namespace lockstep
