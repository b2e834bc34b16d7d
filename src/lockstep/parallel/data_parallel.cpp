#include "lockstep/parallel/data_parallel.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "lockstep/core/error.h"
#include "lockstep/core/exact_sum.h"
#include "lockstep/kernels/device.h"

namespace lockstep {

DataParallel::DataParallel(ParamStore& ps, Communicator& dense, Communicator& expert, const DdpConfig& ddp,
                           bool distributed)
    : ps_(ps), dense_(dense), expert_(expert), ddp_(ddp), distributed_(distributed), bucket_of_(ps.specs().size(), -1) {
  const std::vector<ParamSpec>& specs = ps.specs();
  // Fill one open bucket per buffer from the end of the table; close it once it is big enough.
  std::vector<Bucket> open(2);
  auto close = [&](Bucket& b) {
    if (b.params.empty()) return;
    std::reverse(b.params.begin(), b.params.end());
    buckets_.push_back(std::move(b));
    b = Bucket{};
  };
  for (int i = static_cast<int>(specs.size()) - 1; i >= 0; --i) {
    Bucket& b = open[specs[i].expert ? 1 : 0];
    b.comm = specs[i].expert ? &expert_ : &dense_;
    b.params.push_back(i);
    b.size += specs[i].shape.numel();
    if (b.size >= ddp.bucket_size) close(b);
  }
  close(open[0]);
  close(open[1]);
  // Backward completes a bucket when it reaches the bucket's first parameter.
  std::stable_sort(buckets_.begin(), buckets_.end(),
                   [](const Bucket& a, const Bucket& b) { return a.params.front() > b.params.front(); });
  for (size_t k = 0; k < buckets_.size(); ++k) {
    Bucket& b = buckets_[k];
    int64_t at = 0;
    for (int p : b.params) {
      b.at.push_back(at);
      at += specs[p].shape.numel();
      bucket_of_[p] = static_cast<int>(k);
    }
    const int P = b.comm->size();
    b.chunk = (b.size + P - 1) / P;
    b.mine = chunk_ranges(b, b.comm->rank());
    shard_.insert(shard_.end(), b.mine.begin(), b.mine.end());
    // The replicated optimizer all-reduces a bucket of consecutive parameters where it lies in the
    // table (the alignment gaps between them hold zeros), without packing.
    bool consecutive = true;
    for (size_t i = 1; i < b.params.size(); ++i) consecutive = consecutive && b.params[i] == b.params[i - 1] + 1;
    if (!distributed_ && consecutive) {
      const ParamSpec& last = specs[b.params.back()];
      b.in_place = specs[b.params.front()].offset;
      b.in_place_size = last.offset + last.shape.numel() - b.in_place;
    } else if (P > 1) {
      b.packed.resize(b.chunk * P);  // zeroed: the padding stays zero
      b.chunk_buf.resize(b.chunk);
    }
  }
}

std::vector<ParamRange> DataParallel::chunk_ranges(const Bucket& b, int r) const {
  const int64_t lo = r * b.chunk, hi = std::min(b.size, (r + 1) * b.chunk);
  std::vector<ParamRange> ranges;
  for (size_t i = 0; i < b.params.size(); ++i) {
    const int64_t n = ps_.specs()[b.params[i]].shape.numel();
    const int64_t begin = std::max(lo, b.at[i]), end = std::min(hi, b.at[i] + n);
    if (begin < end) ranges.push_back({b.params[i], begin - b.at[i], end - b.at[i]});
  }
  return ranges;
}

std::vector<ParamRange> DataParallel::optimizer_ranges() const {
  if (distributed_) return shard_;
  std::vector<ParamRange> all;
  for (size_t i = 0; i < ps_.specs().size(); ++i) all.push_back({static_cast<int>(i), 0, ps_.specs()[i].shape.numel()});
  return all;
}

namespace {

// The bounds (group.size() + 1) of the group's blocks of micro-batches when only some ranks keep
// theirs: rank j holds `micros` micro-batches from block_j x micros if it keeps them (replica 0 of
// its block), else an empty block. Gathered over the group; the kept blocks must tile the total in
// rank order.
std::vector<int64_t> kept_blocks(Communicator& group, int block, int replica, int64_t micros, int64_t total,
                                 const char* who) {
  const int D = group.size();
  const int me[2] = {block, replica};
  std::vector<int> all(static_cast<size_t>(2 * D));
  group.all_gather(all.data(), me, 2);
  std::vector<int64_t> blocks = {0};
  for (int j = 0; j < D; ++j) {
    const bool keeps = all[static_cast<size_t>(2 * j + 1)] == 0;
    const int64_t first = all[static_cast<size_t>(2 * j)] * micros;
    LOCKSTEP_CHECK(!keeps || blocks.back() == first, who, " group rank ", j, " holds micro-batches from ", first,
                   " after ", blocks.back());
    blocks.push_back(keeps ? first + micros : blocks.back());
  }
  LOCKSTEP_CHECK(blocks.back() == total, "the ", who, " group's kept blocks hold ", blocks.back(), " of ", total,
                 " micro-batches");
  return blocks;
}

}  // namespace

void DataParallel::set_layout(int64_t micros, Communicator* world, bool experts_summed, int expert_partners) {
  world_ = world;
  experts_summed_ = experts_summed;
  micro_ = pushed_ = 0;
  // Rank r's block of micro-batches as pieces of the canonical tree over the step's; when every
  // block is one piece (a subtree) the tree over ranks is the canonical one (tree_sum).
  const int P = dense_.size();
  std::vector<int64_t> mine;
  bool subtrees = true;
  for (int r = 0; r < P; ++r) {
    const std::vector<int64_t> b = canonical_pieces(P * micros, r * micros, (r + 1) * micros);
    subtrees = subtrees && b.size() == 2;
    if (r == dense_.rank())
      for (int64_t x : b) mine.push_back(x - r * micros);
  }
  blocks_.clear();
  dense_keeps_ = true;
  if (cp_size_ > 1 && (!subtrees || !std::has_single_bit(static_cast<uint64_t>(micros)))) {
    // Context parallelism with blocks that are not subtrees: the tree over the step's micro-batches
    // (P / cp blocks), cp rank 0 of each dp rank giving its block as pieces, the other cp ranks (-0)
    // empty blocks. The dense group is gathered to find each rank's block (bounds in rank order).
    const int64_t D = P / cp_size_;
    mine.clear();
    for (int64_t x : canonical_pieces(D * micros, cp_dp_rank_ * micros, (cp_dp_rank_ + 1) * micros))
      mine.push_back(x - cp_dp_rank_ * micros);
    blocks_ = kept_blocks(dense_, cp_dp_rank_, cp_rank_, micros, D * micros, "dense");
    dense_keeps_ = cp_rank_ == 0;
  } else if (!subtrees) {
    for (int r = 0; r <= P; ++r) blocks_.push_back(r * micros);
  }
  tree_.reset(ps_.device(), ps_.total(), mine);
  // The expert group's blocks, when the model sums the experts: G micro-batches per rank.
  expert_blocks_.clear();
  expert_pieces_.clear();
  expert_first_ = expert_held_ = 0;
  expert_keeps_ = true;
  const int tp_size = tp_ ? tp_->size() : 1;
  const bool has_experts =
      std::any_of(ps_.specs().begin(), ps_.specs().end(), [](const ParamSpec& p) { return p.expert; });
  if (experts_summed) {
    // The step's micro-batches: P / cp per micro-batch slot (a cp group shares each micro-batch). Runs
    // of expert_partners ranks share a block (the first holds its sum, the others -0).
    const int p = expert_partners, D = expert_.size() / p;
    const int64_t total = P / cp_size_ * micros, G = total / D;
    expert_first_ = expert_.rank() / p * G;
    bool whole = true;
    for (int g = 0; g < D; ++g) whole = whole && canonical_pieces(total, g * G, (g + 1) * G).size() == 2;
    LOCKSTEP_CHECK(p >= 1 && expert_.size() % p == 0 && std::has_single_bit(static_cast<unsigned>(p)),
                   "layout: expert groups of ", p, " partners over ", expert_.size(), " ranks");
    if (!whole) {
      // As pieces: each rank's block, or with partners the first partner's and the others' empty
      // (they hold -0; their model still fills tables, which go nowhere).
      if (p == 1) {
        for (int g = 0; g <= D; ++g) expert_blocks_.push_back(g * G);
      } else {
        expert_blocks_ = kept_blocks(expert_, expert_.rank() / p, expert_.rank() % p, G, total, "expert");
        expert_keeps_ = expert_.rank() % p == 0;
      }
      // The experts' tables are written at the expert parameters' offsets only, the dense tree's
      // held pieces at the others' (push_grads skips the experts): the first tables are the tree's
      // buffers, only the pieces beyond the tree's get buffers of their own.
      expert_held_ = static_cast<int64_t>(canonical_pieces(total, expert_first_, expert_first_ + G).size()) - 2;
      for (int64_t k = tree_.pieces() - 1; k < expert_held_; ++k) expert_pieces_.emplace_back(ps_.total());
    }
  } else if (!blocks_.empty() && expert_.size() != P / cp_size_ && has_experts) {
    // MoE under tensor or context parallelism without expert (tensor) parallelism: the expert group
    // is the data-parallel ranks with each one's tp x cp replicas; tp rank 0 of cp rank 0 holds the
    // micro-batches' expert gradients, the others -0 (model/moe/experts.h reduce_over_tp, parallel/
    // context_parallel.h combine_token_pieces). As pieces, that rank gives its data-parallel rank's
    // block and the others an empty one.
    const int tp_rank = tp_ ? tp_->rank() : 0;
    const int replica = tp_rank + tp_size * cp_rank_;
    const int block = cp_size_ > 1 ? cp_dp_rank_ : dense_.rank();
    expert_blocks_ = kept_blocks(expert_, block, replica, micros, P / cp_size_ * micros, "expert");
    expert_keeps_ = replica == 0;
  }
  // (slices: every chunk's holders are one per tp group, each tp group an aligned subtree of the
  // expert reduction's tree over tp x dp, which needs tp a power of two: the config's layout_segments,
  // a power of two, is a multiple of tp.)
  const bool tp_replicas = !experts_summed && cp_size_ == 1 && tp_size > 1 && blocks_.empty() &&
                           expert_.size() == P * tp_size && has_experts;
  LOCKSTEP_CHECK(!tp_replicas || std::has_single_bit(static_cast<unsigned>(tp_size)), "layout: tensor-parallel size ",
                 tp_size, " is no power of two");
  expert_tp_sum_ = !tp_replicas ? ExpertTpSum::on_first : micros == 1 ? ExpertTpSum::parts : ExpertTpSum::slices;
  for (Bucket& b : buckets_) {
    // The expert group is the dense one unless the model sums the experts (expert parallelism).
    const bool experts = experts_summed && b.comm == &expert_;
    b.pieced = experts ? !expert_blocks_.empty() : !blocks_.empty();
    b.packed_pieces.clear();
    const int64_t K = experts                                ? (expert_keeps_ ? expert_held_ + 1 : 0)
                      : b.comm == &expert_ && !expert_keeps_ ? 0
                      : b.comm == &dense_ && !dense_keeps_   ? 0
                                                             : tree_.pieces();
    if (b.pieced && b.in_place < 0)
      for (int64_t k = 0; k + 1 < K; ++k) b.packed_pieces.emplace_back(b.chunk * b.comm->size());
  }
}

void DataParallel::set_full_grads(const std::vector<int>& params) {
  for (int p : params) buckets_[static_cast<size_t>(bucket_of_[p])].full = true;
}

void DataParallel::begin_micro(int64_t micro) {
  if (!world_) return;
  if (micro > 0) check_pushed();
  micro_ = micro;
  pushed_ = 0;
}

void DataParallel::check_pushed() const {
  // Pipelined, the whole step's pushes are counted (a stage's chunks interleave micro-batches).
  const int64_t expected = static_cast<int64_t>(ps_.specs().size()) * (pipelined() ? tree_.leaves() : 1);
  LOCKSTEP_CHECK(pushed_ == expected, "determinism = \"layout\": backward reported ", pushed_, " of ", expected,
                 " parameter gradients final", pipelined() ? " in the step" : str(" in micro-batch ", micro_));
}

void DataParallel::begin_last_micro() {
  for (Bucket& b : buckets_) b.pending = static_cast<int>(b.params.size());
  posted_in_backward_ = 0;
  armed_ = ddp_.overlap_grad_reduce;
}

void DataParallel::grads_ready(int first, int end) {
  if (world_) push_grads(first, end, micro_);
  post_ready(first, end);
}

void DataParallel::push_grads(int first, int end, int64_t micro) {
  // Runs of consecutive parameters this tree sums, each pushed as one range.
  const std::vector<ParamSpec>& specs = ps_.specs();
  auto ours = [&](int p) { return !(experts_summed_ && specs[p].expert); };
  auto chunked = [&](int p) { return expert_tp_sum_ == ExpertTpSum::slices && specs[p].expert; };
  for (int p = first; p < end;) {
    if (!ours(p)) {
      ++p;
      continue;
    }
    if (chunked(p)) {  // this rank's chunk; the model gave -0 elsewhere
      const auto [c0, c1] = tp_chunk(specs[p].shape.numel(), tp_->rank(), tp_->size());
      tree_.push(micro, ps_.grads(), specs[p].offset + c0, specs[p].offset + c1);
      ++p;
      continue;
    }
    int q = p;
    while (q < end && ours(q) && !chunked(q)) ++q;
    tree_.push(micro, ps_.grads(), specs[p].offset, specs[q - 1].offset + specs[q - 1].shape.numel());
    p = q;
  }
  pushed_ += end - first;
}

void DataParallel::post_ready(int first, int end) {
  if (!armed_) return;
  for (int p = first; p < end; ++p) {
    Bucket& b = buckets_[static_cast<size_t>(bucket_of_[p])];
    LOCKSTEP_CHECK(b.pending > 0, "gradient of ", ps_.specs()[p].name, " reported final twice in one backward");
    if (--b.pending == 0) {
      post(b);
      ++posted_in_backward_;
    }
  }
}

void DataParallel::copy_bucket(const Bucket& b, float* table, float* packed, Into into) const {
  for (size_t i = 0; i < b.params.size(); ++i) {
    float* t = table + ps_.specs()[b.params[i]].offset;
    float* p = packed + b.at[i];
    const int64_t n = ps_.specs()[b.params[i]].shape.numel();
    if (into == Into::packed)
      ps_.device().ops.copy(p, t, n);
    else
      ps_.device().ops.copy(t, p, n);
  }
}

void DataParallel::copy_chunk(Bucket& b, float* table, Into into) const {
  const int64_t lo = b.comm->rank() * b.chunk;
  for (const ParamRange& r : b.mine) {
    const size_t i = static_cast<size_t>(std::find(b.params.begin(), b.params.end(), r.param) - b.params.begin());
    float* t = table + ps_.specs()[r.param].offset + r.begin;
    float* c = b.chunk_buf.data() + (b.at[i] + r.begin - lo);
    if (into == Into::packed)
      ps_.device().ops.copy(c, t, r.end - r.begin);
    else
      ps_.device().ops.copy(t, c, r.end - r.begin);
  }
}

void DataParallel::post(Bucket& b) {
  if (b.gathering) finish_gather(b);  // the packed buffer is the gather's destination
  b.posted = true;
  const int P = b.comm->size();
  if (P == 1) return;
  if (b.pieced) {
    post_pieces(b);
    return;
  }
  if (b.in_place >= 0) {
    b.work = b.comm->all_reduce_async(ps_.grads() + b.in_place, b.in_place_size, reduce_op());
    return;
  }
  copy_bucket(b, ps_.grads(), Into::packed);
  b.work = distributed_ && !b.full
               ? b.comm->reduce_scatter_async(b.chunk_buf.data(), b.packed.data(), b.chunk, reduce_op())
               : b.comm->all_reduce_async(b.packed.data(), b.size, reduce_op());
}

std::vector<float*> DataParallel::expert_pieces() {
  std::vector<float*> tables;
  const int64_t shared = tree_.pieces() - 1;  // the dense tree's held pieces (set_layout)
  for (int64_t k = 0; k < expert_held_; ++k)
    tables.push_back(k < shared ? tree_.piece(k) : expert_pieces_[static_cast<size_t>(k - shared)].data());
  return tables;
}

void DataParallel::post_pieces(Bucket& b) {
  // This rank's pieces: the held sums (the tree's, or the experts' tables), then the last one in
  // ps.grads().
  // The experts' own blocks (expert_blocks_) when the model sums them or tensor parallelism replicates
  // the dense ranks in their group; there a replica other than tp rank 0 gives no pieces.
  const bool experts = b.comm == &expert_ && !expert_blocks_.empty();
  const bool none = experts ? !expert_keeps_ : b.comm == &dense_ && !dense_keeps_;
  const std::vector<int64_t>& blocks = experts ? expert_blocks_ : blocks_;
  std::vector<float*> held = experts && experts_summed_ && !none ? expert_pieces() : std::vector<float*>{};
  if (!(experts && experts_summed_) && !none)
    for (int64_t k = 0; k + 1 < tree_.pieces(); ++k) held.push_back(tree_.piece(k));
  std::vector<const float*> pieces;
  if (b.in_place >= 0) {
    for (float* h : held) pieces.push_back(h + b.in_place);
    if (!none) pieces.push_back(ps_.grads() + b.in_place);
    b.work = b.comm->all_reduce_pieces_async(ps_.grads() + b.in_place, pieces, b.in_place_size, blocks);
    return;
  }
  for (size_t k = 0; k < held.size(); ++k) {
    float* packed = b.packed_pieces[k].data();
    copy_bucket(b, held[k], packed, Into::packed);
    pieces.push_back(packed);
  }
  if (!none) {
    copy_bucket(b, ps_.grads(), Into::packed);
    pieces.push_back(b.packed.data());
  }
  b.work = distributed_ && !b.full ? b.comm->reduce_scatter_pieces_async(b.chunk_buf.data(), pieces, b.chunk, blocks)
                                   : b.comm->all_reduce_pieces_async(b.packed.data(), pieces, b.size, blocks);
}

void DataParallel::finish_grad_sync() {
  if (world_) check_pushed();
  if (pipelined()) pushed_ = 0;
  for (Bucket& b : buckets_)
    if (!b.posted) post(b);
  for (Bucket& b : buckets_) {
    b.posted = false;
    if (b.comm->size() == 1) continue;
    b.work.wait();
    if (distributed_ && !b.full)
      copy_chunk(b, ps_.grads(), Into::table);
    else if (b.in_place < 0)
      copy_bucket(b, ps_.grads(), Into::table);
  }
  armed_ = false;
}

double DataParallel::chunk_sum_of_squares(bool expert, int r) const {
  double s = 0;
  const bool skip_replicated = tp_ && tp_->rank() > 0;
  for (const Bucket& b : buckets_) {
    if ((b.comm == &expert_) != expert) continue;
    for (const ParamRange& x : chunk_ranges(b, r))
      if (!(skip_replicated && ps_.specs()[x.param].role.tp_replicated) && !ps_.specs()[x.param].role.stage_copy)
        s += ps_.device().ops.sum_of_squares(ps_.grad(x.param) + x.begin, x.end - x.begin);
  }
  return s;
}

double DataParallel::grad_norm() {
  ps_.device().host_sync("grad_norm");
  if (world_) {
    // Every element once over the world: this rank's chunk of each of its buckets (tensor-parallel
    // replicas on tp rank 0 only), summed exactly.
    ExactSum sum;
    const bool skip_replicated = tp_ && tp_->rank() > 0;
    for (const Bucket& b : buckets_)
      for (const ParamRange& x : b.mine)
        if (!(skip_replicated && ps_.specs()[x.param].role.tp_replicated) && !ps_.specs()[x.param].role.stage_copy)
          sum.merge(ps_.device().ops.exact_sum_of_squares(ps_.grad(x.param) + x.begin, x.end - x.begin));
    all_reduce_exact(*world_, &sum, 1);
    return std::sqrt(sum.value());
  }
  double part[2] = {0, 0};  // dense, expert
  for (const bool expert : {false, true}) {
    Communicator& comm = expert ? expert_ : dense_;
    const bool any =
        std::any_of(buckets_.begin(), buckets_.end(), [&](const Bucket& b) { return (b.comm == &expert_) == expert; });
    if (!any) continue;
    const int P = comm.size();
    std::vector<double> chunks(static_cast<size_t>(P));
    if (distributed_ && P > 1) {
      // Only the owner holds a chunk's summed gradients.
      const double mine = chunk_sum_of_squares(expert, comm.rank());
      comm.all_gather(chunks.data(), &mine, 1);
    } else {
      for (int r = 0; r < P; ++r) chunks[static_cast<size_t>(r)] = chunk_sum_of_squares(expert, r);
    }
    double sum = 0;
    for (double c : chunks) sum += c;
    part[expert] = sum;
  }
  // Each tp rank holds its slices of the dense parameters (the replicated ones counted on tp rank
  // 0 only); the experts are split over the tp-ep group instead.
  if (tp_ && tp_->size() > 1) {
    std::vector<double> ranks(static_cast<size_t>(tp_->size()));
    tp_->all_gather(ranks.data(), &part[0], 1);
    part[0] = 0;
    for (double t : ranks) part[0] += t;
  }
  if (ep_ && ep_->size() > 1) ep_->all_reduce(&part[1], 1);
  double total = part[0] + part[1];
  if (pp_ && pp_->size() > 1) {
    std::vector<double> stages(static_cast<size_t>(pp_->size()));
    pp_->all_gather(stages.data(), &total, 1);
    total = 0;
    for (double t : stages) total += t;
  }
  return std::sqrt(total);
}

void DataParallel::step(const Update& update) {
  if (!distributed_) {
    update(optimizer_ranges());
    return;
  }
  gathered_in_forward_ = 0;
  // Forward order (the reverse of backward's), so that the gather forward needs first runs first.
  for (auto it = buckets_.rbegin(); it != buckets_.rend(); ++it) {
    Bucket& b = *it;
    update(b.mine);
    if (b.comm->size() == 1) continue;
    copy_chunk(b, ps_.values(), Into::packed);
    b.work = b.comm->all_gather_async(b.packed.data(), b.chunk_buf.data(), b.chunk);
    b.gathering = true;
    if (!ddp_.overlap_param_gather) finish_gather(b);
  }
}

void DataParallel::finish_gather(Bucket& b) {
  b.work.wait();
  b.gathering = false;
  copy_bucket(b, ps_.values(), Into::table);
}

void DataParallel::params_needed(int first, int end) {
  for (int p = first; p < end; ++p) {
    Bucket& b = buckets_[static_cast<size_t>(bucket_of_[p])];
    if (!b.gathering) continue;
    finish_gather(b);
    ++gathered_in_forward_;
  }
}

void DataParallel::wait_params() {
  for (auto it = buckets_.rbegin(); it != buckets_.rend(); ++it)
    if (it->gathering) finish_gather(*it);
}

}  // namespace lockstep
