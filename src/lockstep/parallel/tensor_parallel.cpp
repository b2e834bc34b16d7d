#include "lockstep/parallel/tensor_parallel.h"

#include <algorithm>
#include <cstring>

#include "lockstep/comm/communicator.h"
#include "lockstep/core/error.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/core/tree_sum.h"
#include "lockstep/kernels/device.h"

namespace lockstep {

TensorParallel::TensorParallel(Communicator* group, bool sequence_parallel)
    : comm(group),
      rank(group ? group->rank() : 0),
      size(group ? group->size() : 1),
      sequence(sequence_parallel && size > 1) {}

int TensorParallel::column_weight(ParamStore& ps, const std::string& name, const std::vector<int64_t>& sections,
                                  int64_t in, float std) const {
  int64_t out = 0;
  for (int64_t s : sections) out += s;
  if (!on()) return ps.add(name, {out, in}, Init::normal, std, true);
  std::vector<ParamBox> boxes;
  int64_t at = 0;
  for (int64_t s : sections) {
    boxes.push_back({{at + rank * (s / size), 0}, {s / size, in}});
    at += s;
  }
  return ps.add_part(name, {out, in}, std::move(boxes), Init::normal, std, true);
}

int TensorParallel::column_bias(ParamStore& ps, const std::string& name, const std::vector<int64_t>& sections) const {
  int64_t out = 0;
  for (int64_t s : sections) out += s;
  if (!on()) return ps.add(name, {out}, Init::zeros);
  std::vector<ParamBox> boxes;
  int64_t at = 0;
  for (int64_t s : sections) {
    boxes.push_back({{at + rank * (s / size)}, {s / size}});
    at += s;
  }
  return ps.add_part(name, {out}, std::move(boxes), Init::zeros);
}

int TensorParallel::row_weight(ParamStore& ps, const std::string& name, int64_t out, int64_t in, float std) const {
  if (!on()) return ps.add(name, {out, in}, Init::normal, std, true);
  return ps.add_part(name, {out, in}, {{{0, rank * (in / size)}, {out, in / size}}}, Init::normal, std, true);
}

int TensorParallel::vocab_weight(ParamStore& ps, const std::string& name, int64_t V, int64_t C, float std) const {
  if (!on()) return ps.add(name, {V, C}, Init::normal, std, true);
  return ps.add_part(name, {V, C}, {{{vocab_begin(V), 0}, {V / size, C}}}, Init::normal, std, true);
}

std::vector<int64_t> TensorParallel::k_segments(const std::vector<int64_t>& sections) const {
  std::vector<int64_t> b;
  if (!layout()) return b;
  LOCKSTEP_CHECK(segments % size == 0, "layout_segments = ", segments, " is not divisible by the tensor-parallel size ",
                 size);
  for (const int64_t K : sections) {
    LOCKSTEP_CHECK(K % size == 0, "a tensor-parallel reduction over ", K, " elements on ", size, " ranks");
    // This rank's K / size items cut into S / size segments: segments [rank, rank + 1) x S / size of
    // the whole (core/tree_sum.h canonical_segments).
    const std::vector<int64_t> mine = canonical_segments(K / size, segments / size);
    b.insert(b.end(), mine.begin(), mine.end());
  }
  return b;
}

namespace {
// The group's sum: in rank order, or along the canonical tree over ranks under "layout".
ReduceOp tp_sum(const TensorParallel& tp) { return tp.layout() ? ReduceOp::tree_sum : ReduceOp::sum; }
}  // namespace

void reduce_from_tp(const TensorParallel& tp, float* x, int64_t n) {
  if (tp.on()) tp.comm->all_reduce(x, n, tp_sum(tp));
}

void gather_from_sp(const TensorParallel& tp, float* full, const float* rows, int64_t n_rows, int64_t C) {
  tp.comm->all_gather(full, rows, n_rows * C);
}

void scatter_to_sp(const TensorParallel& tp, float* rows, const float* full, int64_t n_rows, int64_t C) {
  tp.comm->reduce_scatter(rows, full, n_rows * C, tp_sum(tp));
}

const float* enter_column_parallel(const TensorParallel& tp, float* full, const float* x, int64_t N, int64_t C) {
  if (!tp.sequence) {
    copy_to_tp(tp);
    return x;
  }
  gather_from_sp(tp, full, x, N / tp.size, C);
  return full;
}

float* leave_row_parallel(const TensorParallel& tp, float* rows, float* partial, int64_t N, int64_t C) {
  if (!tp.sequence) {
    reduce_from_tp(tp, partial, N * C);
    return partial;
  }
  scatter_to_sp(tp, rows, partial, N / tp.size, C);
  return rows;
}

// Each region's backward is the other region's forward: the mirrored pairs.
float* enter_column_parallel_backward(const TensorParallel& tp, float* drows, float* dfull, int64_t N, int64_t C) {
  return leave_row_parallel(tp, drows, dfull, N, C);
}

const float* leave_row_parallel_backward(const TensorParallel& tp, float* dfull, const float* drows, int64_t N,
                                         int64_t C) {
  return enter_column_parallel(tp, dfull, drows, N, C);
}

void vocab_parallel_local_tokens(const TensorParallel& tp, int32_t* local, const int32_t* tokens, int64_t N,
                                 int64_t V) {
  for (int64_t n = 0; n < N; ++n)
    if (tokens[n] < 0 || tokens[n] >= V)
      user_error("embedding: token ", tokens[n], " at position ", n, " is outside the vocabulary [0, ", V, ")");
  const int64_t lo = tp.vocab_begin(V), hi = lo + V / tp.size;
  for (int64_t n = 0; n < N; ++n)
    local[n] = tokens[n] >= lo && tokens[n] < hi ? static_cast<int32_t>(tokens[n] - lo) : -1;
}

void vocab_parallel_embedding_forward(const Ops& ops, const TensorParallel& tp, float* out, int32_t* local,
                                      const int32_t* tokens, const float* wte, int64_t N, int64_t C, int64_t V) {
  vocab_parallel_local_tokens(tp, local, tokens, N, V);
  ops.lookup_rows(out, wte, local, N, C, tp.layout() ? -0.0f : 0.0f);
}

void vocab_parallel_embedding(const Ops& ops, const TensorParallel& tp, float* x, float* partial, int32_t* local,
                              const int32_t* tokens, const float* wte, const float* wpe, const int32_t* positions,
                              int64_t N, int64_t T, int64_t C, int64_t V) {
  vocab_parallel_embedding_forward(ops, tp, partial, local, tokens, wte, N, C, V);
  const float* sum = leave_row_parallel(tp, x, partial, N, C);
  const int64_t rows = tp.rows(N), row0 = tp.sequence ? tp.rank * rows : 0;
  ops.add_positions(x, sum, wpe, positions, row0, rows, T, C);
}

void vocab_parallel_embedding_backward(const TensorParallel& tp, const ParamStore& ps, int wte, int wpe, int32_t* order,
                                       float* dfull, const float* dx, int32_t* local, const int32_t* tokens,
                                       const int32_t* positions, int64_t B, int64_t T, int64_t C, int64_t V,
                                       int64_t P) {
  const int64_t N = B * T;
  const float* d = tp.on() ? leave_row_parallel_backward(tp, dfull, dx, N, C) : dx;
  const int32_t* ids = tokens;
  if (tp.on()) {
    vocab_parallel_local_tokens(tp, local, tokens, N, V);
    ids = local;
  }
  const int64_t K = ps.token_pieces(wte), rows = N / K;
  for (int64_t k = 0; k < K; ++k)
    ps.device().ops.embedding_backward(ps.grad_piece(wte, k), wpe >= 0 ? ps.grad_piece(wpe, k) : nullptr, order,
                                       d + k * rows * C, ids + k * rows, K > 1 ? 1 : B, K > 1 ? rows : T, C,
                                       positions ? positions + k * rows : nullptr, P, ps.token_segments(wte),
                                       wpe >= 0 ? ps.token_segments(wpe) : 0);
}

void vocab_parallel_cross_entropy(const Ops& ops, const TensorParallel& tp, float* losses, float* logits,
                                  const int32_t* targets, int64_t N, int64_t V, int64_t ld, bool backward,
                                  float grad_scale, std::vector<float>& scratch) {
  const int64_t Vl = V / tp.size;
  if (tp.layout()) {
    // The canonical vocabulary segments (cross_entropy.h): the global max first (exact), then each
    // segment's sum of exponentials, this rank's a subtree, combined over the group with tree_sum.
    if (static_cast<int64_t>(scratch.size()) < 3 * N) scratch.resize(static_cast<size_t>(3 * N));
    float* rowmax = scratch.data();
    float* stats = rowmax + N;
    ops.cross_entropy_segments_max(rowmax, logits, targets, N, Vl, ld, V);
    if (tp.on()) tp.comm->all_reduce(rowmax, N, ReduceOp::max);
    ops.cross_entropy_segments_sum(stats, logits, rowmax, targets, N, Vl, ld, tp.vocab_begin(V), V, tp.segments,
                                   backward);
    if (tp.on()) tp.comm->all_reduce(stats, 2 * N, ReduceOp::tree_sum);
    ops.cross_entropy_segments_loss(losses, rowmax, stats, targets, N);
    if (backward) ops.cross_entropy_segments_backward(logits, stats, targets, N, Vl, ld, tp.vocab_begin(V), grad_scale);
    return;
  }
  const int64_t chunks = (Vl + kXentChunk - 1) / kXentChunk;
  const int64_t need = 3 * N + 3 * N * tp.size + N * chunks + 2 * N;
  if (static_cast<int64_t>(scratch.size()) < need) scratch.resize(static_cast<size_t>(need));
  float* mine = scratch.data();
  float* all = mine + 3 * N;
  float* cmax = all + 3 * N * tp.size;
  float* lse = cmax + N * chunks;
  ops.cross_entropy_shard_lse(mine, cmax, logits, targets, N, Vl, ld, tp.vocab_begin(V), V, backward);
  tp.comm->all_gather(all, mine, 3 * N);
  ops.cross_entropy_combine(losses, lse, all, targets, N, tp.size);
  if (backward) ops.cross_entropy_shard_backward(logits, cmax, lse, targets, N, Vl, ld, tp.vocab_begin(V), grad_scale);
}

void reduce_sequence_parallel_grads(const TensorParallel& tp, ParamStore& ps, int first, int end) {
  // Context parallelism's token pieces (layout mode): combined over tp x cp with the cp ranks'
  // pieces instead (parallel/context_parallel.h combine_token_pieces).
  if (!tp.on() || ps.pieced()) return;
  if (end < 0) end = static_cast<int>(ps.specs().size());
  std::vector<int> params;
  int64_t n = 0;
  for (int i = first; i < end; ++i)
    if (ps.specs()[i].role.sequence_parallel) {
      params.push_back(i);
      n += ps.specs()[i].shape.numel();
    }
  if (params.empty()) return;  // the same on every rank of the group: one table
  std::vector<float> packed(static_cast<size_t>(n));
  int64_t at = 0;
  for (int p : params) {
    const int64_t k = ps.specs()[p].shape.numel();
    ps.device().ops.copy(packed.data() + at, ps.grad(p), k);
    at += k;
  }
  tp.comm->all_reduce(packed.data(), n, tp.layout() ? ReduceOp::tree_sum : ReduceOp::sum);
  at = 0;
  for (int p : params) {
    const int64_t k = ps.specs()[p].shape.numel();
    ps.device().ops.copy(ps.grad(p), packed.data() + at, k);
    at += k;
  }
}

}  // namespace lockstep
