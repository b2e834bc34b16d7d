#include "lockstep/train/optimizer.h"

#include <cmath>

#include "lockstep/core/hash.h"
#include "lockstep/kernels/cpu/optimizer.h"

namespace lockstep {

Optimizer::Optimizer(const ParamStore& ps, const OptimizerConfig& oc) : m_(ps.total()), v_(ps.total()), oc_(oc) {}

double Optimizer::step(ParamStore& ps, int64_t step, double lr) {
  const double norm = std::sqrt(sum_of_squares(ps.grads(), ps.total()));
  float scale = 1.0f;
  if (oc_.clip_grad > 0) {
    const double coeff = oc_.clip_grad / (norm + 1e-6);
    if (coeff < 1.0) scale = static_cast<float>(coeff);
  }
  for (const ParamSpec& p : ps.specs()) {
    AdamW hp;
    hp.lr = static_cast<float>(lr);
    hp.beta1 = static_cast<float>(oc_.beta1);
    hp.beta2 = static_cast<float>(oc_.beta2);
    hp.eps = static_cast<float>(oc_.eps);
    hp.weight_decay = p.decay ? static_cast<float>(oc_.weight_decay) : 0.0f;
    adamw_update(ps.values() + p.offset, m_.data() + p.offset, v_.data() + p.offset, ps.grads() + p.offset,
                 p.shape.numel(), hp, step, scale);
  }
  return norm;
}

uint64_t Optimizer::hash() const {
  Hasher h;
  h.update(m_.data(), static_cast<size_t>(m_.size()) * sizeof(float));
  h.update(v_.data(), static_cast<size_t>(v_.size()) * sizeof(float));
  return h.digest();
}

}  // namespace lockstep
