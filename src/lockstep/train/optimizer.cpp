#include "lockstep/train/optimizer.h"

#include <cmath>

#include "lockstep/core/error.h"
#include "lockstep/core/hash.h"
#include "lockstep/kernels/cpu/optimizer.h"

namespace lockstep {

namespace {
std::vector<ParamRange> whole_table(const ParamStore& ps) {
  std::vector<ParamRange> all;
  for (size_t i = 0; i < ps.specs().size(); ++i) all.push_back({static_cast<int>(i), 0, ps.specs()[i].shape.numel()});
  return all;
}
}  // namespace

Optimizer::Optimizer(const ParamStore& ps, const OptimizerConfig& oc) : Optimizer(ps, oc, whole_table(ps)) {}

Optimizer::Optimizer(const ParamStore& ps, const OptimizerConfig& oc, std::vector<ParamRange> owned)
    : owned_(std::move(owned)), first_(ps.specs().size(), -1), begin_(ps.specs().size(), 0),
      end_(ps.specs().size(), 0), oc_(oc) {
  int64_t n = 0;
  for (const ParamRange& r : owned_) {
    LOCKSTEP_CHECK(r.param >= 0 && r.param < static_cast<int>(ps.specs().size()), "no parameter ", r.param);
    LOCKSTEP_CHECK(first_[r.param] < 0, "parameter ", ps.specs()[r.param].name, " owned twice");
    LOCKSTEP_CHECK(0 <= r.begin && r.begin < r.end && r.end <= ps.specs()[r.param].shape.numel(),
                   "bad range of ", ps.specs()[r.param].name);
    first_[r.param] = n;
    begin_[r.param] = r.begin;
    end_[r.param] = r.end;
    n += r.end - r.begin;
  }
  for (const ParamSpec& p : ps.specs()) decay_.push_back(p.decay);
  m_.resize(n);
  v_.resize(n);
}

int64_t Optimizer::state_index(int p, int64_t e) const {
  LOCKSTEP_CHECK(first_[p] >= 0 && e >= begin_[p] && e < end_[p], "parameter ", p, " element ", e, " is not owned");
  return first_[p] + (e - begin_[p]);
}

float Optimizer::clip_scale(double grad_norm) const {
  if (oc_.clip_grad > 0) {
    const double coeff = oc_.clip_grad / (grad_norm + 1e-6);
    if (coeff < 1.0) return static_cast<float>(coeff);
  }
  return 1.0f;
}

double Optimizer::step(ParamStore& ps, int64_t step, double lr) {
  LOCKSTEP_CHECK(owned_.size() == ps.specs().size(), "Optimizer::step needs every parameter owned");
  const double norm = std::sqrt(sum_of_squares(ps.grads(), ps.total()));
  update(ps, step, lr, clip_scale(norm));
  return norm;
}

void Optimizer::update(ParamStore& ps, int64_t step, double lr, float grad_scale, const std::vector<ParamRange>& ranges) {
  for (const ParamRange& r : ranges) {
    if (r.end <= r.begin) continue;
    AdamW hp;
    hp.lr = static_cast<float>(lr);
    hp.beta1 = static_cast<float>(oc_.beta1);
    hp.beta2 = static_cast<float>(oc_.beta2);
    hp.eps = static_cast<float>(oc_.eps);
    hp.weight_decay = decay_[r.param] ? static_cast<float>(oc_.weight_decay) : 0.0f;
    const int64_t s = state_index(r.param, r.begin);
    adamw_update(ps.value(r.param) + r.begin, m_.data() + s, v_.data() + s, ps.grad(r.param) + r.begin, r.end - r.begin,
                 hp, step, grad_scale);
  }
}

void Optimizer::state_shards(const ParamStore& ps, std::vector<StateShard>& out, bool dp_first, bool tp_first,
                             bool edp_first) {
  for (const ParamRange& r : owned_) {
    if (r.end <= r.begin) continue;
    const std::string& name = ps.specs()[r.param].name;
    ps.shards_of(out, r.param, "optim/exp_avg/" + name, r.begin, r.end, m_.data() + first_[r.param], dp_first, tp_first, edp_first);
    ps.shards_of(out, r.param, "optim/exp_avg_sq/" + name, r.begin, r.end, v_.data() + first_[r.param], dp_first, tp_first, edp_first);
  }
}

uint64_t Optimizer::hash(const std::vector<ParamRange>& ranges) const {
  BlockHasher h;
  for (const FloatBuffer* state : {&m_, &v_})
    for (const ParamRange& r : ranges)
      if (r.end > r.begin)
        h.update(state->data() + state_index(r.param, r.begin), static_cast<size_t>(r.end - r.begin) * sizeof(float));
  return h.digest();
}

}  // namespace lockstep
