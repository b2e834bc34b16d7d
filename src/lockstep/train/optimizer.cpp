#include "lockstep/train/optimizer.h"

#include <algorithm>
#include <cmath>

#include "lockstep/core/error.h"
#include "lockstep/core/hash.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/kernels/device.h"

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
    : owned_(std::move(owned)),
      first_(ps.specs().size(), -1),
      begin_(ps.specs().size(), 0),
      end_(ps.specs().size(), 0),
      oc_(oc) {
  int64_t n = 0;
  for (const ParamRange& r : owned_) {
    LOCKSTEP_CHECK(r.param >= 0 && r.param < static_cast<int>(ps.specs().size()), "no parameter ", r.param);
    LOCKSTEP_CHECK(first_[r.param] < 0, "parameter ", ps.specs()[r.param].name, " owned twice");
    LOCKSTEP_CHECK(0 <= r.begin && r.begin < r.end && r.end <= ps.specs()[r.param].shape.numel(), "bad range of ",
                   ps.specs()[r.param].name);
    first_[r.param] = n;
    begin_[r.param] = r.begin;
    end_[r.param] = r.end;
    n += r.end - r.begin;
  }
  for (const ParamSpec& p : ps.specs()) decay_.push_back(p.decay);
  m_bf16_ = oc.exp_avg_dtype == "bf16";
  v_bf16_ = oc.exp_avg_sq_dtype == "bf16";
  m_.set_allocator(&ps.device().memory());
  v_.set_allocator(&ps.device().memory());
  m_.resize(m_bf16_ ? (n + 1) / 2 : n);
  v_.resize(v_bf16_ ? (n + 1) / 2 : n);
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
  const double norm = std::sqrt(ps.device().ops.sum_of_squares(ps.grads(), ps.total()));
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

bool Optimizer::update(ParamStore& ps, int64_t step, double lr, float grad_scale, const std::vector<ParamRange>& ranges,
                       ShardHashes* hashes) {
  return pass(ps, step, lr, grad_scale, ranges, hashes, true);
}

void Optimizer::hash_state(ParamStore& ps, const std::vector<ParamRange>& ranges, ShardHashes& hashes) {
  pass(ps, 1, 0.0, 1.0f, ranges, &hashes, false);
}

bool Optimizer::pass(ParamStore& ps, int64_t step, double lr, float grad_scale, const std::vector<ParamRange>& ranges,
                     ShardHashes* hashes, bool update) {
  bool nonfinite = false;
  // Ranges with a bf16 moment that are not hashed: items of the hashed update (its hashes unused).
  std::vector<AdamwHashedItem> low;
  auto plain = [&](int p, int64_t begin, int64_t end) {
    if (end <= begin || !update) return;
    const int64_t s = state_index(p, begin);
    if (m_bf16_ || v_bf16_)
      low.push_back({ps.value(p) + begin, m32(s), v32(s), ps.grad(p) + begin, end - begin, hyperparameters(p, lr), 0, 0,
                     nullptr, m16(s), v16(s)});
    else
      nonfinite |= ps.device().ops.adamw_update(ps.value(p) + begin, m32(s), v32(s), ps.grad(p) + begin, end - begin,
                                                hyperparameters(p, lr), step, grad_scale);
  };
  if (hashes) {
    hashes->m_size_ = m_bf16_ ? sizeof(bf16) : sizeof(float);
    hashes->v_size_ = v_bf16_ ? sizeof(bf16) : sizeof(float);
  }
  std::vector<ShardHashes::Block*> blocks;  // to update and hash
  for (const ParamRange& r : ranges) {
    const size_t p = static_cast<size_t>(r.param);
    const bool covered =
        hashes && p + 1 < hashes->first_block_.size() && hashes->first_block_[p] < hashes->first_block_[p + 1];
    const int64_t lo = covered ? hashes->blocks_[hashes->first_block_[p]].begin : 0;
    const int64_t hi = covered ? hashes->blocks_[hashes->first_block_[p + 1] - 1].end : 0;
    if (!covered || hi <= r.begin || lo >= r.end) {
      plain(r.param, r.begin, r.end);
      continue;
    }
    LOCKSTEP_CHECK(lo >= r.begin && hi <= r.end, "the fingerprinted part of ", ps.specs()[p].name,
                   " is split over two updates");
    plain(r.param, r.begin, lo);
    plain(r.param, hi, r.end);
    for (size_t b = hashes->first_block_[p]; b < hashes->first_block_[p + 1]; ++b)
      blocks.push_back(&hashes->blocks_[b]);
  }
  // Whole blocks to whichever thread claims them, largest first: each block's hashes are the same
  // whichever thread computes them.
  std::stable_sort(blocks.begin(), blocks.end(), [](const ShardHashes::Block* a, const ShardHashes::Block* b) {
    return a->end - a->begin > b->end - b->begin;
  });
  std::vector<AdamwHashedItem> items;
  std::vector<uint64_t> out(4 * blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    const ShardHashes::Block& b = *blocks[i];
    const int64_t s = state_index(b.param, b.begin);
    items.push_back({ps.value(b.param) + b.begin, m32(s), v32(s), ps.grad(b.param) + b.begin, b.end - b.begin,
                     hyperparameters(b.param, lr), b.state_begin - b.begin, b.state_end - b.begin, out.data() + 4 * i,
                     m16(s), v16(s)});
  }
  // The unhashed bf16 ranges in one call, shared among the threads like the hashed ones.
  std::vector<uint64_t> unused(4 * low.size());
  for (size_t i = 0; i < low.size(); ++i) low[i].hashes = unused.data() + 4 * i;
  if (!low.empty())
    nonfinite |= ps.device().ops.adamw_update_hashed(low.data(), static_cast<int64_t>(low.size()), step, grad_scale);
  if (update)
    nonfinite |=
        ps.device().ops.adamw_update_hashed(items.data(), static_cast<int64_t>(items.size()), step, grad_scale);
  else
    ps.device().ops.adam_state_hashes(items.data(), static_cast<int64_t>(items.size()));
  for (size_t i = 0; i < blocks.size(); ++i) {
    ShardHashes::Block& b = *blocks[i];
    b.grad = out[4 * i], b.m = out[4 * i + 1], b.v = out[4 * i + 2], b.value = out[4 * i + 3], b.done = true;
  }
  return nonfinite;
}

ShardHashes::ShardHashes(std::vector<ParamRange> shard, const ParamStore* params)
    : shard_(std::move(shard)), params_(params != nullptr) {
  size_t nparams = params ? params->specs().size() : 0;
  for (const ParamRange& r : shard_) nparams = std::max(nparams, static_cast<size_t>(r.param) + 1);
  LOCKSTEP_CHECK(!params || nparams == params->specs().size(),
                 "a shard range names a parameter the table does not have");
  std::vector<const ParamRange*> range_of(nparams, nullptr);
  for (const ParamRange& r : shard_) {
    LOCKSTEP_CHECK(!range_of[static_cast<size_t>(r.param)], "parameter ", r.param, " twice in a shard");
    range_of[static_cast<size_t>(r.param)] = &r;
  }
  for (size_t p = 0; p < nparams; ++p) {
    first_block_.push_back(blocks_.size());
    const ParamRange* r = range_of[p];
    if (params && r) LOCKSTEP_CHECK(r->begin >= 0 && r->end <= params->specs()[p].shape.numel());
    const int64_t lo = params ? 0 : r ? r->begin : 0;
    const int64_t hi = params ? params->specs()[p].shape.numel() : r ? r->end : 0;
    for (int64_t b = lo; b < hi;) {
      const int64_t next = BlockHasher::block_end(b, hi);
      const int64_t sb = r ? std::clamp(r->begin, b, next) : b, se = r ? std::clamp(r->end, sb, next) : b;
      blocks_.push_back({static_cast<int>(p), b, next, sb, se});
      b = next;
    }
  }
  first_block_.push_back(blocks_.size());
}

void ShardHashes::check_done() const {
  for (const Block& b : blocks_)
    LOCKSTEP_CHECK(b.done, "parameter ", b.param, " elements [", b.begin, ", ", b.end,
                   ") were not updated, so not hashed");
}

// (hash, length) of the shard's part of each block, in shard range order.
std::vector<uint64_t> ShardHashes::state_pairs(uint64_t Block::*hash, size_t size) const {
  check_done();
  std::vector<uint64_t> pairs;
  for (const ParamRange& r : shard_) {
    const auto p = static_cast<size_t>(r.param);
    for (size_t i = first_block_[p]; i < first_block_[p + 1]; ++i) {
      const Block& b = blocks_[i];
      if (b.state_end > b.state_begin)
        pairs.insert(pairs.end(), {b.*hash, static_cast<uint64_t>(b.state_end - b.state_begin) * size});
    }
  }
  return pairs;
}

uint64_t ShardHashes::grads() const { return combine_block_hashes(state_pairs(&Block::grad)); }

uint64_t ShardHashes::moments() const {
  std::vector<uint64_t> pairs = state_pairs(&Block::m, m_size_);
  const std::vector<uint64_t> v = state_pairs(&Block::v, v_size_);
  pairs.insert(pairs.end(), v.begin(), v.end());
  return combine_block_hashes(pairs);
}

std::vector<uint64_t> ShardHashes::params() const {
  LOCKSTEP_CHECK(params_, "these shard hashes do not cover the parameters");
  check_done();
  std::vector<uint64_t> pairs;
  for (const Block& b : blocks_)
    pairs.insert(pairs.end(), {b.value, static_cast<uint64_t>(b.end - b.begin) * sizeof(float)});
  return pairs;
}

void Optimizer::state_shards(const ParamStore& ps, std::vector<StateShard>& out, bool dp_first, bool tp_first,
                             bool edp_first) {
  for (const ParamRange& r : owned_) {
    if (r.end <= r.begin) continue;
    const std::string& name = ps.specs()[r.param].name;
    const int64_t s = first_[r.param];
    ps.shards_of(out, r.param, "optim/exp_avg/" + name, r.begin, r.end, m_bf16_ ? (void*)m16(s) : m32(s), dp_first,
                 tp_first, edp_first, m_bf16_ ? DType::bf16 : DType::f32);
    ps.shards_of(out, r.param, "optim/exp_avg_sq/" + name, r.begin, r.end, v_bf16_ ? (void*)v16(s) : v32(s), dp_first,
                 tp_first, edp_first, v_bf16_ ? DType::bf16 : DType::f32);
  }
}

uint64_t Optimizer::hash(const std::vector<ParamRange>& ranges) const {
  BlockHasher h;
  for (const bool first : {true, false})
    for (const ParamRange& r : ranges) {
      if (r.end <= r.begin) continue;
      const int64_t s = state_index(r.param, r.begin);
      const bool low = first ? m_bf16_ : v_bf16_;
      const void* at = first ? (low ? (const void*)m16(s) : m32(s)) : (low ? (const void*)v16(s) : v32(s));
      h.update_elements(at, r.begin, r.end, low ? sizeof(bf16) : sizeof(float));
    }
  return h.digest();
}

}  // namespace lockstep
