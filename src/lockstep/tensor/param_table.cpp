#include "lockstep/tensor/param_table.h"

#include <algorithm>
#include <cstring>

#include "lockstep/core/error.h"
#include "lockstep/core/philox.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/kernels/device.h"
#include "lockstep/tensor/precision.h"

namespace lockstep {

int ParamStore::add(std::string name, Shape shape, Init init, float std, bool decay, bool expert) {
  LOCKSTEP_CHECK(values_.size() == 0, "parameter '", name, "' declared after allocation");
  LOCKSTEP_CHECK(find(name) < 0, "parameter '", name, "' declared twice");
  // Each parameter starts on a 64-byte boundary so kernels see aligned rows.
  const int64_t offset = (total_ + 15) / 16 * 16;
  total_ = offset + shape.numel();
  ParamSpec spec{std::move(name), shape, init, std, decay, offset, expert, shape, {}, {}};
  spec.boxes.push_back({std::vector<int64_t>(static_cast<size_t>(shape.rank()), 0), std::move(shape)});
  specs_.push_back(std::move(spec));
  return static_cast<int>(specs_.size()) - 1;
}

int ParamStore::add_copy(int owner) {
  ParamSpec spec = specs_.at(static_cast<size_t>(owner));
  LOCKSTEP_CHECK(values_.size() == 0, "parameter '", spec.name, "' copied after allocation");
  spec.offset = (total_ + 15) / 16 * 16;
  total_ = spec.offset + spec.shape.numel();
  spec.role.stage_copy = true;
  specs_.push_back(std::move(spec));
  return static_cast<int>(specs_.size()) - 1;
}

int ParamStore::add_part(std::string name, Shape global_shape, std::vector<ParamBox> boxes, Init init, float std,
                         bool decay, bool expert) {
  LOCKSTEP_CHECK(!boxes.empty(), "parameter '", name, "' declared with no box");
  std::vector<int64_t> dims = boxes[0].shape.dims();
  dims[0] = 0;
  for (const ParamBox& b : boxes) {
    LOCKSTEP_CHECK(b.shape.rank() == global_shape.rank() && b.offset.size() == b.shape.dims().size(), "parameter '",
                   name, "': box rank differs from the tensor's");
    for (size_t d = 0; d < b.offset.size(); ++d) {
      LOCKSTEP_CHECK(
          b.offset[d] >= 0 && b.offset[d] + b.shape[static_cast<int>(d)] <= global_shape[static_cast<int>(d)],
          "parameter '", name, "': box outside the tensor in dimension ", d);
      LOCKSTEP_CHECK(d == 0 || b.shape[static_cast<int>(d)] == dims[d], "parameter '", name,
                     "': boxes differ in dimension ", d);
    }
    dims[0] += b.shape[0];
  }
  const int i = add(std::move(name), Shape(dims), init, std, decay, expert);
  specs_.back().global_shape = std::move(global_shape);
  specs_.back().boxes = std::move(boxes);
  specs_.back().role.tp_replicated = false;
  return i;
}

void ParamStore::allocate() {
  Allocator* memory = &device().memory();
  values_.set_allocator(memory);
  grads_.set_allocator(memory);
  weights_.set_allocator(memory);
  values_.resize(total_);
  grads_.resize(total_);
  if (window_ < 0) {
    piece_base_.assign(specs_.size(), 0);
    window_ = total_;
  }
  for (int64_t k = 1; k < pieces_; ++k) pieces_grads_.emplace_back(window_, memory);
}

void ParamStore::set_piece_windows(const std::vector<std::pair<int, int>>& runs) {
  const int n = static_cast<int>(specs_.size());
  piece_base_.assign(specs_.size(), 0);
  window_ = 0;
  int next = 0;
  for (const auto& [first, end] : runs) {
    LOCKSTEP_CHECK(first == next && end >= first && end <= n, "piece windows: run [", first, ", ", end,
                   ") after parameter ", next, " of ", n);
    if (first == end) continue;
    const int64_t lo = specs_[static_cast<size_t>(first)].offset;
    const int64_t hi = end < n ? specs_[static_cast<size_t>(end)].offset : total_;
    for (int i = first; i < end; ++i) piece_base_[static_cast<size_t>(i)] = lo;
    window_ = std::max(window_, hi - lo);
    next = end;
  }
  LOCKSTEP_CHECK(next == n, "piece windows cover ", next, " of ", n, " parameters");
}

namespace {
// Draws the boxes of p by global element index: each run of elements contiguous in both the box
// and the global tensor (whole rows when the box spans the trailing dimensions) is one fill.
void init_normal(const RandomStream& rng, const ParamSpec& p, float* v) {
  const std::vector<int64_t>& g = p.global_shape.dims();
  const size_t R = g.size();
  for (const ParamBox& b : p.boxes) {
    const int64_t n = b.shape.numel();
    if (R == 0 || n == 0) {
      rng.fill_normal(v, n, p.std);
      v += n;
      continue;
    }
    // The innermost dimensions the box spans whole form one contiguous run together with the
    // first dimension it cuts.
    size_t d0 = R - 1;
    while (d0 > 0 && b.offset[d0] == 0 && b.shape.dims()[d0] == g[d0]) --d0;
    int64_t run = 1;
    for (size_t d = d0; d < R; ++d) run *= b.shape.dims()[d];
    std::vector<int64_t> idx(R, 0);  // the run's start in box coordinates (dimensions < d0)
    for (int64_t at = 0; at < n; at += run) {
      int64_t first = 0;
      for (size_t d = 0; d < R; ++d) first = first * g[d] + b.offset[d] + idx[d];
      rng.fill_normal(v + at, run, p.std, static_cast<uint64_t>(first));
      for (size_t d = d0; d-- > 0;) {
        if (++idx[d] < b.shape.dims()[d]) break;
        idx[d] = 0;
      }
    }
    v += n;
  }
}
}  // namespace

void ParamStore::init(uint64_t seed) {
  for (const ParamSpec& p : specs_) {
    float* v = values_.data() + p.offset;
    const int64_t n = p.shape.numel();
    // A copy of a parameter of this table (add_copy; find() names the owner, declared first) takes
    // the values the owner drew: the same bits as drawing them again, without the second draw.
    const int owner = p.role.stage_copy ? find(p.name) : -1;
    if (owner >= 0 && value(owner) != v) {
      std::memcpy(v, value(owner), static_cast<size_t>(n) * sizeof(float));
      continue;
    }
    switch (p.init) {
      case Init::normal:
        init_normal(RandomStream(seed, purpose_id("init/" + p.name)), p, v);
        break;
      case Init::zeros:
        std::fill(v, v + n, 0.0f);
        break;
      case Init::ones:
        std::fill(v, v + n, 1.0f);
        break;
    }
  }
}

void ParamStore::zero_grads() { device().ops.fill(grads_.data(), total_, 0.0f); }

void ParamStore::use_bf16_weights() {
  LOCKSTEP_CHECK(values_.size() != 0, "bf16 weights before allocation");
  weights_.resize(total_);
}

void ParamStore::sync_weights(int first, int end) {
  if (weights_.size() == 0 || first >= end) return;
  const int64_t lo = specs_[first].offset;
  const int64_t hi = specs_[end - 1].offset + specs_[end - 1].shape.numel();
  device().ops.round_bf16(weights_.data() + lo, values_.data() + lo, hi - lo);
}

Device& ParamStore::device() const {
  if (device_) return *device_;
  if (!own_device_) own_device_ = Device::cpu();
  return *own_device_;
}

ParamStore::~ParamStore() = default;
ParamStore::ParamStore() = default;
ParamStore::ParamStore(ParamStore&&) noexcept = default;
ParamStore& ParamStore::operator=(ParamStore&&) noexcept = default;

Precision& ParamStore::precision() const {
  // Plain fp32 keeps no state, so modules used without a model may share one.
  static Precision fp32;
  return precision_ ? *precision_ : fp32;
}

void ParamStore::shards_of(std::vector<StateShard>& out, int i, const std::string& name, int64_t begin, int64_t end,
                           void* data, bool dp_first, bool tp_first, bool edp_first, DType dtype) const {
  const ParamSpec& p = specs_[static_cast<size_t>(i)];
  int64_t at = 0;  // the box's first element in local storage
  for (const ParamBox& b : p.boxes) {
    const int64_t n = b.shape.numel();
    const int64_t lo = std::max(begin, at), hi = std::min(end, at + n);
    if (lo < hi) {
      const bool writer =
          (p.expert ? edp_first : dp_first) && (tp_first || !p.role.tp_replicated) && !p.role.stage_copy;
      StateShard s =
          whole_tensor(name, p.global_shape,
                       static_cast<char*>(data) + static_cast<size_t>(lo - begin) * dtype_size(dtype), writer, dtype);
      s.box_offset = b.offset;
      s.box_shape = b.shape;
      s.flat_begin = lo - at;
      s.flat_end = hi - at;
      out.push_back(std::move(s));
    }
    at += n;
  }
}

void ParamStore::state_shards(std::vector<StateShard>& out, bool dp_first, bool tp_first, bool edp_first) const {
  for (size_t i = 0; i < specs_.size(); ++i)
    shards_of(out, static_cast<int>(i), "param/" + specs_[i].name, 0, specs_[i].shape.numel(),
              value(static_cast<int>(i)), dp_first, tp_first, edp_first);
}

int ParamStore::find(const std::string& name) const {
  for (size_t i = 0; i < specs_.size(); ++i)
    if (specs_[i].name == name) return static_cast<int>(i);
  return -1;
}

}  // namespace lockstep
