#include "lockstep/model/param_table.h"

#include <algorithm>
#include <cstring>

#include "lockstep/core/philox.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/model/precision.h"

namespace lockstep {

int ParamStore::add(std::string name, Shape shape, Init init, float std, bool decay, bool expert) {
  LOCKSTEP_CHECK(values_.size() == 0, "parameter '", name, "' declared after allocation");
  LOCKSTEP_CHECK(find(name) < 0, "parameter '", name, "' declared twice");
  // Each parameter starts on a 64-byte boundary so kernels see aligned rows.
  const int64_t offset = (total_ + 15) / 16 * 16;
  total_ = offset + shape.numel();
  specs_.push_back({std::move(name), std::move(shape), init, std, decay, offset, expert});
  return static_cast<int>(specs_.size()) - 1;
}

void ParamStore::allocate() {
  values_.resize(total_);
  grads_.resize(total_);
}

void ParamStore::init(uint64_t seed) {
  for (const ParamSpec& p : specs_) {
    float* v = values_.data() + p.offset;
    const int64_t n = p.shape.numel();
    switch (p.init) {
      case Init::normal: RandomStream(seed, purpose_id("init/" + p.name)).fill_normal(v, n, p.std); break;
      case Init::zeros: std::fill(v, v + n, 0.0f); break;
      case Init::ones: std::fill(v, v + n, 1.0f); break;
    }
  }
}

void ParamStore::zero_grads() {
  float* g = grads_.data();
  parallel_for(total_, [&](int64_t b, int64_t e) { std::memset(g + b, 0, static_cast<size_t>(e - b) * sizeof(float)); });
}

void ParamStore::use_bf16_weights() {
  LOCKSTEP_CHECK(values_.size() != 0, "bf16 weights before allocation");
  weights_.resize(total_);
}

void ParamStore::sync_weights(int first, int end) {
  if (weights_.size() == 0 || first >= end) return;
  const int64_t lo = specs_[first].offset;
  const int64_t hi = specs_[end - 1].offset + specs_[end - 1].shape.numel();
  const float* v = values_.data() + lo;
  float* w = weights_.data() + lo;
  parallel_for(hi - lo, [&](int64_t b, int64_t e) {
    std::memcpy(w + b, v + b, static_cast<size_t>(e - b) * sizeof(float));
    round_to_bf16(w + b, e - b);
  });
}

Precision& ParamStore::precision() const {
  // Plain fp32 keeps no state, so modules used without a model may share one.
  static Precision fp32;
  return precision_ ? *precision_ : fp32;
}

int ParamStore::find(const std::string& name) const {
  for (size_t i = 0; i < specs_.size(); ++i)
    if (specs_[i].name == name) return static_cast<int>(i);
  return -1;
}

}  // namespace lockstep
