// The trainer's optimizer, reusable on its own (the reference tests drive it directly): global
// grad-norm clipping, then AdamW (kernels/optimizer.h) on the parameter elements it owns, with
// weight decay on the parameters the table marks for it (weight matrices, not biases or norms).
// Clipping follows torch.nn.utils.clip_grad_norm_: scale = clip / (norm + 1e-6) when that is below
// 1; the scale enters AdamW as grad_scale, so the gradients themselves stay untouched.
//
// It owns every element of the table, or (optimizer.distributed, ZeRO-1) one data-parallel rank's
// shard of it (parallel/data_parallel.h): a list of ParamRanges, at most one per parameter. The
// Adam moments exist for the owned elements only; with fp32 parameters the master weights are the
// parameters themselves, updated in place where owned. Megatron's precision-aware optimizer: each
// moment is stored in fp32 or bf16 (optimizer.exp_avg_dtype, exp_avg_sq_dtype); the update runs in
// fp32 and rounds a bf16 moment back to nearest, ties to even (kernels/optimizer.h), so it stays as
// deterministic as the fp32 one; checkpoints hold the moments in their storage type.
//
// Determinism: the update is elementwise, so an element's new value does not depend on which
// ranges it was updated in (the distributed and the replicated optimizer give the same bits).
#pragma once

#include <cstdint>
#include <vector>

#include "lockstep/config/config.h"
#include "lockstep/core/tensor.h"
#include "lockstep/kernels/optimizer.h"
#include "lockstep/tensor/param_table.h"

namespace lockstep {

// The fingerprint's hashes of the state AdamW touches, computed inside the update
// (Optimizer::update with a ShardHashes), each block hashed while it is in cache instead of in
// more passes over memory:
//   - of a rank's shard (parallel/data_parallel.h: shard()) of the gradients, as AdamW reads them
//     (before clipping), and of both Adam moments after the update;
//   - with `params` (the replicated optimizer, which updates every parameter of the table whole),
//     of every parameter's values after the update: GPT::state_hash combines them with the expert
//     biases, and no pass over the parameters of its own is left.
// The blocks are each parameter's own grid (BlockHasher::update_elements), and the values those of
// BlockHasher over the same elements: grads() = each shard range's gradients in range order;
// moments() = each range's first moments, then each range's second moments; params() the (hash,
// length) pairs of every parameter's values in table order. So they do not depend on the thread
// count, nor on which update call (bucket) covered which range.
class ShardHashes {
 public:
  explicit ShardHashes(std::vector<ParamRange> shard, const ParamStore* params = nullptr);
  // Each needs every block hashed (each range, with `params` each parameter, updated once since
  // construction); params() needs `params`.
  uint64_t grads() const;
  uint64_t moments() const;
  std::vector<uint64_t> params() const;
  bool has_params() const { return params_; }

 private:
  friend class Optimizer;
  // One work item of the update: elements [begin, end) of a parameter, inside one block of its
  // grid; [state_begin, state_end) the part of them in the shard (possibly none).
  struct Block {
    int param;
    int64_t begin, end, state_begin, state_end;
    uint64_t grad = 0, m = 0, v = 0, value = 0;
    bool done = false;
  };
  std::vector<ParamRange> shard_;
  bool params_ = false;
  std::vector<Block> blocks_;        // parameter order, then element order
  std::vector<size_t> first_block_;  // per parameter, and one past the last
  void check_done() const;
  // Bytes of a first and of a second moment (the optimizer's storage, set by its update).
  size_t m_size_ = sizeof(float), v_size_ = sizeof(float);
  std::vector<uint64_t> state_pairs(uint64_t Block::*hash, size_t size = sizeof(float)) const;
};

class Optimizer {
 public:
  // Owns every element of ps; state zeroed.
  Optimizer(const ParamStore& ps, const OptimizerConfig& oc);
  // Owns `owned` (at most one range per parameter); state zeroed.
  Optimizer(const ParamStore& ps, const OptimizerConfig& oc, std::vector<ParamRange> owned);

  // Single rank: clips by the norm of every gradient and updates everything it owns (which must be
  // everything); step counts from 1. Returns the gradient norm before clipping.
  double step(ParamStore& ps, int64_t step, double lr);
  // The clip factor for a global gradient norm (1 when no clipping applies).
  float clip_scale(double grad_norm) const;
  // AdamW on the owned elements, reading their gradients from ps.grads(). Returns whether any
  // updated parameter is not finite (found in the update's own pass).
  bool update(ParamStore& ps, int64_t step, double lr, float grad_scale) {
    return update(ps, step, lr, grad_scale, owned_);
  }
  // The same on `ranges`, which must be owned. With `hashes`: also hashes those of their elements
  // that hashes covers (each parameter's covered part must lie inside one of `ranges` or outside
  // all).
  bool update(ParamStore& ps, int64_t step, double lr, float grad_scale, const std::vector<ParamRange>& ranges,
              ShardHashes* hashes = nullptr);
  // The hashes update() would take, of the state as it is, without updating it: a skipped step's
  // fingerprint (train.on_nonfinite = "skip_step").
  void hash_state(ParamStore& ps, const std::vector<ParamRange>& ranges, ShardHashes& hashes);

  const std::vector<ParamRange>& owned() const { return owned_; }
  int64_t state_bytes() const { return (m_.size() + v_.size()) * int64_t(sizeof(float)); }

  // BlockHasher of the first moments then the second moments of `ranges` (owned elements), in
  // list order, each on its parameter's grid: ShardHashes::moments() in one pass of its own.
  uint64_t hash(const std::vector<ParamRange>& ranges) const;
  // The same over everything owned.
  uint64_t hash() const { return hash(owned_); }

  // The moments of the owned ranges for checkpoints (core/state_shard.h): "optim/exp_avg/<name>"
  // and "optim/exp_avg_sq/<name>", pieces of the parameter's global tensor (ParamStore::shards_of).
  // dp_first: this rank writes its pieces (true on every rank of a distributed optimizer, whose
  // ranges are disjoint; on the first data-parallel replica of a replicated one); tp_first as in
  // shards_of, edp_first as dp_first for the experts. The master weights are the parameters (fp32 values, also under
  // bf16 weights).
  void state_shards(const ParamStore& ps, std::vector<StateShard>& out, bool dp_first, bool tp_first, bool edp_first);

 private:
  // Offset in m_ / v_ of element e of parameter p (which must be owned).
  int64_t state_index(int p, int64_t e) const;
  // update (AdamW and the hashes) or hash_state (the hashes only).
  bool pass(ParamStore& ps, int64_t step, double lr, float grad_scale, const std::vector<ParamRange>& ranges,
            ShardHashes* hashes, bool update);
  AdamW hyperparameters(int p, double lr) const;

  std::vector<ParamRange> owned_;
  std::vector<int64_t> first_;        // per parameter: state offset of its owned range, -1 = none
  std::vector<int64_t> begin_, end_;  // per parameter: its owned range
  std::vector<bool> decay_;
  // The moments: fp32, or (optimizer.exp_avg_dtype / exp_avg_sq_dtype = "bf16") bf16 values packed
  // two to a float of the buffer, which then holds half as many floats.
  FloatBuffer m_, v_;
  bool m_bf16_ = false, v_bf16_ = false;
  float* m32(int64_t s) const { return m_bf16_ ? nullptr : m_.data() + s; }
  float* v32(int64_t s) const { return v_bf16_ ? nullptr : v_.data() + s; }
  bf16* m16(int64_t s) const { return m_bf16_ ? reinterpret_cast<bf16*>(m_.data()) + s : nullptr; }
  bf16* v16(int64_t s) const { return v_bf16_ ? reinterpret_cast<bf16*>(v_.data()) + s : nullptr; }
  OptimizerConfig oc_;
};

}  // namespace lockstep
