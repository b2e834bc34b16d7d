#include "lockstep/train/optimizer.h"

#include <algorithm>
#include <cmath>

#include "lockstep/core/error.h"
#include "lockstep/core/hash.h"
#include "lockstep/core/thread_pool.h"
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

AdamW Optimizer::hyperparameters(int p, double lr) const {
  AdamW hp;
  hp.lr = static_cast<float>(lr);
  hp.beta1 = static_cast<float>(oc_.beta1);
  hp.beta2 = static_cast<float>(oc_.beta2);
  hp.eps = static_cast<float>(oc_.eps);
  hp.weight_decay = decay_[p] ? static_cast<float>(oc_.weight_decay) : 0.0f;
  return hp;
}

void Optimizer::update(ParamStore& ps, int64_t step, double lr, float grad_scale, const std::vector<ParamRange>& ranges,
                       ShardHashes* hashes) {
  auto plain = [&](int p, int64_t begin, int64_t end) {
    if (end <= begin) return;
    const int64_t s = state_index(p, begin);
    adamw_update(ps.value(p) + begin, m_.data() + s, v_.data() + s, ps.grad(p) + begin, end - begin, hyperparameters(p, lr),
                 step, grad_scale);
  };
  std::vector<ShardHashes::Block*> blocks;  // to update and hash
  for (const ParamRange& r : ranges) {
    const int h = hashes ? hashes->range_of(r.param) : -1;
    const ParamRange* in = h >= 0 ? &hashes->ranges_[static_cast<size_t>(h)] : nullptr;
    if (!in || in->end <= r.begin || in->begin >= r.end) {
      plain(r.param, r.begin, r.end);
      continue;
    }
    LOCKSTEP_CHECK(in->begin >= r.begin && in->end <= r.end, "the fingerprinted shard of ", ps.specs()[r.param].name,
                   " is split over two updates");
    plain(r.param, r.begin, in->begin);
    plain(r.param, in->end, r.end);
    for (size_t b = hashes->first_block_[static_cast<size_t>(h)]; b < hashes->first_block_[static_cast<size_t>(h) + 1]; ++b)
      blocks.push_back(&hashes->blocks_[b]);
  }
  // Whole blocks to whichever thread claims them, largest first: each block's hashes are the same
  // whichever thread computes them.
  std::stable_sort(blocks.begin(), blocks.end(),
                   [](const ShardHashes::Block* a, const ShardHashes::Block* b) { return a->end - a->begin > b->end - b->begin; });
  auto run = [&](int64_t i) {
    ShardHashes::Block& b = *blocks[static_cast<size_t>(i)];
    const int p = hashes->ranges_[static_cast<size_t>(b.range)].param;
    const int64_t s = state_index(p, b.begin);
    uint64_t out[3];
    adamw_update_hashed(ps.value(p) + b.begin, m_.data() + s, v_.data() + s, ps.grad(p) + b.begin, b.end - b.begin,
                        hyperparameters(p, lr), step, grad_scale, out);
    b.grad = out[0], b.m = out[1], b.v = out[2], b.done = true;
  };
  const auto n = static_cast<int64_t>(blocks.size());
  ThreadPool* pool = ThreadPool::current();
  if (pool && pool->threads() > 1 && n > 1) {
    pool->run_parts(n, run);
  } else {
    for (int64_t i = 0; i < n; ++i) run(i);
  }
}

ShardHashes::ShardHashes(std::vector<ParamRange> ranges) : ranges_(std::move(ranges)) {
  constexpr int64_t kBlock = static_cast<int64_t>(BlockHasher::kHashBlockBytes / sizeof(float));
  for (size_t i = 0; i < ranges_.size(); ++i) {
    const ParamRange& r = ranges_[i];
    if (static_cast<size_t>(r.param) >= range_of_param_.size()) range_of_param_.resize(static_cast<size_t>(r.param) + 1, -1);
    LOCKSTEP_CHECK(range_of_param_[static_cast<size_t>(r.param)] < 0, "parameter ", r.param, " twice in a shard");
    range_of_param_[static_cast<size_t>(r.param)] = static_cast<int>(i);
    first_block_.push_back(blocks_.size());
    for (int64_t b = r.begin; b < r.end; b += kBlock) blocks_.push_back({static_cast<int>(i), b, std::min(r.end, b + kBlock)});
  }
  first_block_.push_back(blocks_.size());
}

int ShardHashes::range_of(int param) const {
  return static_cast<size_t>(param) < range_of_param_.size() ? range_of_param_[static_cast<size_t>(param)] : -1;
}

void ShardHashes::check_done() const {
  for (const Block& b : blocks_)
    LOCKSTEP_CHECK(b.done, "parameter ", ranges_[static_cast<size_t>(b.range)].param, " elements [", b.begin, ", ", b.end,
                   ") of the shard were not updated, so not hashed");
}

uint64_t ShardHashes::grads() const {
  check_done();
  std::vector<uint64_t> pairs;
  for (const Block& b : blocks_) pairs.insert(pairs.end(), {b.grad, static_cast<uint64_t>(b.end - b.begin) * sizeof(float)});
  return combine_block_hashes(pairs);
}

uint64_t ShardHashes::moments() const {
  check_done();
  std::vector<uint64_t> pairs;
  for (const bool second : {false, true})
    for (const Block& b : blocks_)
      pairs.insert(pairs.end(), {second ? b.v : b.m, static_cast<uint64_t>(b.end - b.begin) * sizeof(float)});
  return combine_block_hashes(pairs);
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
