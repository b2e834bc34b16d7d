#include "lockstep/parallel/context_parallel.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <functional>
#include <tuple>

#include "lockstep/comm/communicator.h"
#include "lockstep/core/error.h"
#include "lockstep/core/tree_sum.h"
#include "lockstep/kernels/device.h"

namespace lockstep {

ContextParallel::ContextParallel(Communicator* group, Communicator* tp_cp)
    : comm(group),
      rank(group ? group->rank() : 0),
      size(group ? group->size() : 1),
      sequence_group(tp_cp),
      sequence_tp(tp_cp ? tp_cp->size() / size : 1) {
  LOCKSTEP_CHECK(!tp_cp || (tp_cp->size() % size == 0 && tp_cp->rank() / sequence_tp == rank &&
                            tp_cp->rank() == rank * sequence_tp + tp_cp->rank() % sequence_tp),
                 "context parallelism: rank ", tp_cp ? tp_cp->rank() : 0, " of a tp x cp group of ",
                 tp_cp ? tp_cp->size() : 0, " is not cp rank ", rank, " of ", size, " (tp the faster)");
}

void ContextParallel::set_comm_type(const std::string& type, Communicator* a2a_group, Communicator* ring_group) {
  comm_type = type;
  a2a = a2a_group, ring = ring_group;
  a2a_size = a2a ? a2a->size() : 1, a2a_rank = a2a ? a2a->rank() : 0;
  ring_size = ring ? ring->size() : size / a2a_size, ring_rank = ring ? ring->rank() : rank / a2a_size;
  LOCKSTEP_CHECK(a2a_size * ring_size == size && rank == ring_rank * a2a_size + a2a_rank,
                 "context parallelism: cp rank ", rank, " of ", size, " is not ring rank ", ring_rank, " of ",
                 ring_size, " x a2a rank ", a2a_rank, " of ", a2a_size);
}

QueryChunks balanced_chunks(int64_t T, int64_t P, int64_t r) {
  LOCKSTEP_CHECK(T % (2 * P) == 0, "context parallelism: ", T, " positions do not split into 2 x ", P, " chunks");
  const int64_t c = chunk_tokens(P, T);
  const int64_t late = late_chunk(P, r);
  return {{r * c, (r + 1) * c}, {late * c, (late + 1) * c}};
}

QueryChunks ContextParallel::ring_chunks(int64_t T, int64_t P, int64_t r) const {
  if (!units || units->bounds.empty()) return balanced_chunks(T, P, r);
  QueryChunks out, late;
  const std::vector<int64_t>& u = units->bounds;
  for (size_t k = 0; k + 1 < u.size(); ++k) {
    const int64_t c = (u[k + 1] - u[k]) / (2 * P);
    out.push_back({u[k] + r * c, u[k] + (r + 1) * c});
    out.push_back({u[k] + (2 * P - 1 - r) * c, u[k] + (2 * P - r) * c});
  }
  return out;
}

void ContextParallel::set_documents(const int32_t* tokens, int64_t T, int32_t eod, int64_t pad) {
  LOCKSTEP_CHECK(units && pad % (2 * size) == 0 && T % pad == 0, "context parallelism: documents padded to ", pad,
                 " in ", T, " positions do not cut into 2 x ", size, " chunks");
  std::vector<int64_t>& u = units->bounds;
  u.assign(1, 0);
  for (int64_t p = pad; p < T; p += pad)
    if (tokens[p - 1] == eod && tokens[p] != eod) u.push_back(p);
  u.push_back(T);
  units->local.clear();
  for (const auto& [begin, end] : chunks(T))
    for (int64_t t = begin; t < end; ++t) units->local.push_back(t);
}

int64_t ContextParallel::global_row(int64_t n, int64_t T) const {
  const int64_t Tl = local(T);
  if (units && !units->bounds.empty()) return n / Tl * T + units->local[static_cast<size_t>(n % Tl)];
  const int64_t c = chunk_tokens(size, T), j = n % Tl;
  const int64_t chunk = j < c ? rank : late_chunk(size, rank);
  return n / Tl * T + chunk * c + j % c;
}

void ContextParallel::positions(int32_t* pos, int64_t B, int64_t T) const {
  for (int64_t n = 0; n < B * local(T); ++n) pos[n] = static_cast<int32_t>(global_row(n, T) % T);
}

void ContextParallel::take_local(int32_t* local, const int32_t* global, int64_t B, int64_t T) const {
  const QueryChunks ch = chunks(T);
  for (int64_t b = 0; b < B; ++b)
    for (const auto& [begin, end] : ch) {
      std::memcpy(local, global + b * T + begin, static_cast<size_t>(end - begin) * sizeof(int32_t));
      local += end - begin;
    }
}

namespace {
// Rank r's local rows (B, T / size, W) to their global positions in (B, T, W) (to_global: dst is
// the global tensor, src the local rows), or back (dst local, src global).
void move_rows(const Ops& ops, const ContextParallel& cp, int r, float* dst, const float* src, bool to_global,
               int64_t B, int64_t T, int64_t W) {
  const QueryChunks ch = cp.chunks(T, r);
  const int64_t Tl = cp.local(T);
  // Each sample's chunks, a block of rows each: local row l (consecutive) <-> global row b T + begin.
  std::vector<int64_t> local, global, rows;
  for (int64_t b = 0, l = 0; b < B; ++b)
    for (const auto& [begin, end] : ch) {
      local.push_back(l);
      global.push_back(b * T + begin);
      rows.push_back(end - begin);
      l += end - begin;
    }
  LOCKSTEP_CHECK(local.empty() || local.back() + rows.back() == B * Tl, "context parallelism: chunks of ", Tl, " rows");
  const auto blocks = static_cast<int64_t>(rows.size());
  if (to_global)
    ops.copy_row_blocks(dst, global.data(), src, local.data(), rows.data(), blocks, W);
  else
    ops.copy_row_blocks(dst, local.data(), src, global.data(), rows.data(), blocks, W);
}
}  // namespace

void all_gather_sequence(const Ops& ops, const ContextParallel& cp, float* global, float* buf, const float* local,
                         int64_t B, int64_t T, int64_t W) {
  const int64_t n = B * cp.local(T) * W;
  cp.comm->all_gather(buf, local, n);
  for (int r = 0; r < cp.size; ++r) move_rows(ops, cp, r, global, buf + r * n, true, B, T, W);
}

void gather_kv(const Ops& ops, const ContextParallel& cp, float* kv, float* buf, const float* qkv, int64_t B, int64_t T,
               int64_t NH, int64_t NKV, int64_t HS) {
  const int64_t KV = 2 * NKV * HS, C3 = (NH + 2 * NKV) * HS, Tl = cp.local(T), n = B * Tl * KV;
  float* mine = buf + cp.size * n;
  // This rank's K and V columns, packed (B, Tl, KV); then every rank's block into its positions.
  ops.copy_rows(mine, KV, qkv + NH * HS, C3, B * Tl, KV);
  all_gather_sequence(ops, cp, kv, buf, mine, B, T, KV);
}

void reduce_scatter_dkv(const Ops& ops, const ContextParallel& cp, float* dqkv, float* buf, const float* dkv, int64_t B,
                        int64_t T, int64_t NH, int64_t NKV, int64_t HS) {
  const int64_t KV = 2 * NKV * HS, C3 = (NH + 2 * NKV) * HS, Tl = cp.local(T), n = B * Tl * KV;
  float* mine = buf + cp.size * n;
  // Block r: this rank's contributions to rank r's rows, in rank r's local order.
  for (int r = 0; r < cp.size; ++r) move_rows(ops, cp, r, buf + r * n, dkv, false, B, T, KV);
  cp.comm->reduce_scatter(mine, buf, n);
  ops.copy_rows(dqkv + NH * HS, C3, mine, KV, B * Tl, KV);
}

void reduce_scatter_dkv_pieces(const Ops& ops, const ContextParallel& cp, float* dqkv, float* buf, const float* dkv,
                               int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS) {
  const int64_t KV = 2 * NKV * HS, C3 = (NH + 2 * NKV) * HS, Tl = cp.local(T), n = B * Tl * KV, P = cp.size;
  float* send = buf;
  float* recv = send + 2 * P * n;
  float* mine = recv + 2 * P * n;
  // Block (r, e): this rank's chunk e's tree (early, late) at rank r's rows, in rank r's local order.
  for (int r = 0; r < P; ++r)
    for (int64_t e = 0; e < 2; ++e)
      move_rows(ops, cp, r, send + (2 * r + e) * n, dkv + e * B * T * KV, false, B, T, KV);
  cp.comm->all_to_all(recv, send, 2 * n);
  // Chunk c's tree came from its holder's early or late block (chunk_holder); the canonical tree
  // over the 2P chunks in position order is the one-process tree over the query segments.
  LOCKSTEP_CHECK(P <= kMaxContext, "context parallelism: ", P, " ranks");
  const float* leaves[2 * kMaxContext];
  for (int64_t c = 0; c < 2 * P; ++c) {
    const ChunkHolder h = chunk_holder(P, c);
    leaves[c] = recv + (2 * h.rank + h.side) * n;
  }
  ops.tree_sum(mine, leaves, 2 * P, n);
  ops.copy_rows(dqkv + NH * HS, C3, mine, KV, B * Tl, KV);
}

int64_t dkv_pieces_buffer(const ContextParallel& cp, int64_t B, int64_t T, int64_t NKV, int64_t HS) {
  return (4 * cp.size + 1) * B * cp.local(T) * 2 * NKV * HS;
}

namespace {
// The canonical tree over L leaves held as pieces by the ranks of `group`: each rank's K pieces of
// `total` floats at piece(k), leaf(g) = {the group rank holding leaf g (token order), its piece
// there}. The ranks sum a slice of the elements each and send the roots to the keepers (group ranks
// 0 .. keepers - 1), which write the root to out (out may be piece 0: tree_sum reads each leaf before
// it writes the root); the others write -0. acc (fold_token_pieces): the root is added into acc (on
// the keepers) and out zeroed instead. clear: pieces 1 .. K - 1 zeroed after (the gradient's pieces,
// for the next micro-batch).
template <class PieceAt, class Leaf>
void combine_pieces(const Ops& ops, Communicator& group, const PieceAt& piece, float* out_all, int64_t total, int64_t K,
                    int64_t L, int keepers, const Leaf& leaf, std::vector<float>& scratch, float* acc, bool clear) {
  LOCKSTEP_CHECK(L <= 2 * kMaxContext && std::has_single_bit(static_cast<uint64_t>(L)), "context parallelism: ", L,
                 " token pieces");
  const int64_t R = group.size();
  const int me = group.rank();
  const bool keep = me < keepers;
  // Each rank sums one slice of the elements (slice q of n: canonical segment q of R): every rank
  // sends each other rank its K pieces' part in that rank's slice, sums its own slice from the R
  // ranks' pieces (its own read in place, the others' at block q, or q - 1 past this rank), and
  // sends that root to the keepers, which so hold the whole root. One message per piece and slice,
  // from the pieces themselves.
  const auto block = [me](int q) { return q > me ? q - 1 : q; };
  // Element-wise, so the range goes in chunks of at most kCombineChunk elements: the scratch stays
  // ((R - 1) K + depth) x (kCombineChunk / R + 1) floats, whatever the range (a vocabulary-sized
  // embedding or head).
  const int64_t chunk = std::min(total, kCombineChunk), slice_max = chunk / R + 1;
  scratch.resize(static_cast<size_t>((R - 1) * K * slice_max));
  float* recv = scratch.data();
  std::vector<Communicator::Message> sends, recvs;
  for (int64_t c0 = 0; c0 < total; c0 += chunk) {
    const int64_t n = std::min(chunk, total - c0);
    // Slice q of the chunk's n elements: canonical segment q of R (tree_sum.h's even cut).
    const std::vector<int64_t> cut = canonical_segments(n, R);
    const auto slice = [&cut](int64_t q) {
      return std::pair<int64_t, int64_t>{cut[static_cast<size_t>(q)], cut[static_cast<size_t>(q + 1)]};
    };
    const auto [s0, s1] = slice(me);
    const int64_t m = s1 - s0;
    constexpr int64_t F = sizeof(float);
    sends.clear();
    recvs.clear();
    for (int q = 0; q < R; ++q) {
      if (q == me) continue;
      const auto [q0, q1] = slice(q);
      for (int64_t k = 0; k < K; ++k) {
        if (q1 > q0) sends.push_back({q, 0, piece(k) + c0 + q0, (q1 - q0) * F});
        if (m > 0) recvs.push_back({q, 0, recv + (block(q) * K + k) * m, m * F});
      }
    }
    group.send_recv_batch_async(sends, recvs).wait();
    float* out = out_all + c0;
    const float* leaves[2 * kMaxContext];
    for (int64_t g = 0; g < L; ++g) {
      const auto [q, k] = leaf(g);
      leaves[g] = q == me ? piece(k) + c0 + s0 : recv + (block(static_cast<int>(q)) * K + k) * m;
    }
    ops.tree_sum(out + s0, leaves, L, m);
    // The keepers gather the slices' roots (the exchange above is complete: out may take them).
    sends.clear();
    recvs.clear();
    for (int q = 0; q < R; ++q) {
      if (q == me) continue;
      const auto [q0, q1] = slice(q);
      if (q < keepers && m > 0) sends.push_back({q, 1, out + s0, m * F});
      if (keep && q1 > q0) recvs.push_back({q, 1, out + q0, (q1 - q0) * F});
    }
    group.send_recv_batch_async(sends, recvs).wait();
    if (acc) {
      if (keep) ops.add(acc + c0, acc + c0, out, n);
      ops.fill(out, n, 0.0f);
    } else if (!keep) {
      ops.fill(out, n, -0.0f);
    }
    if (clear)
      for (int64_t k = 1; k < K; ++k) ops.fill(piece(k) + c0, n, 0.0f);
  }
}

// combine_pieces over the parameters [first, end) alike, whose gradients hold K pieces each (the
// root into the gradient, piece 0).
template <class Leaf>
void combine_param_pieces(Communicator& group, ParamStore& ps, int first, int end, int64_t K, int64_t L, int keepers,
                          const Leaf& leaf, std::vector<float>& scratch, float* acc = nullptr) {
  const auto& specs = ps.specs();
  const int64_t lo = specs[first].offset;
  const int64_t hi = end < static_cast<int>(specs.size()) ? specs[end].offset : ps.total();
  combine_pieces(
      ps.device().ops, group, [&](int64_t k) { return ps.grad_piece(first, k); }, ps.grad(first), hi - lo, K, L,
      keepers, leaf, scratch, acc, true);
}
}  // namespace

void combine_held_pieces(const Ops& ops, Communicator& group, float* out, float* const* pieces, int64_t n, int64_t K,
                         int64_t L, const std::function<std::pair<int64_t, int64_t>(int64_t)>& leaf,
                         std::vector<float>& scratch) {
  combine_pieces(
      ops, group, [pieces](int64_t k) { return pieces[k]; }, out, n, K, L, 1, leaf, scratch, nullptr, false);
}

std::pair<int64_t, int64_t> unit_holder(int64_t P, int64_t sub, int64_t K, int64_t tp, int64_t g) {
  const int64_t s = g / (2 * P * sub);
  const ChunkHolder h = chunk_holder(P, g / sub % (2 * P));
  const int64_t u = (2 * s + h.side) * sub + g % sub;
  return {h.rank * tp + u / K, u % K};
}

void combine_token_pieces(const ContextParallel& cp, ParamStore& ps, int first, int end, std::vector<float>& scratch) {
  if (!cp.on() || !ps.pieced()) return;
  const int64_t P = cp.size, C = ps.chunk_pieces();  // C = 2B: the cp rank's chunks
  const auto& specs = ps.specs();
  // Runs of alike parameters (tp ranks' shares of the rows, or the cp rank's whole rows; experts or
  // not), a call each; the folded ones are the model's (fold_token_pieces), the module_pieces ones
  // their module's.
  const auto kind = [&](int i) {
    const ParamSpec& p = specs[static_cast<size_t>(i)];
    return std::tuple(ps.sequence_tp(i), p.role.pieces != GradRole::Pieces::combined, p.expert);
  };
  for (int a = first, b = first; a < end; a = b) {
    const auto [shares, theirs, expert] = kind(a);
    while (b < end && kind(b) == kind(a)) ++b;
    if (theirs) continue;
    // The micro-batch's P U units (U per cp rank, U / C per chunk), K per tp rank of the run's group.
    const int64_t K = ps.token_pieces(a), U = ps.token_units(a), sub = U / C, tp = shares ? cp.sequence_tp : 1;
    LOCKSTEP_CHECK(!shares || (cp.sequence_group && U == std::max<int64_t>(C, tp)),
                   "context parallelism: tp ranks' shares of the pieces without their tp x cp group of ", tp,
                   " tp ranks");
    const auto leaf = [P, sub, K, tp](int64_t g) { return unit_holder(P, sub, K, tp, g); };
    // An expert's tp ranks are replicas in its expert data-parallel group, which adds the kept sum
    // once: tp rank 0 of cp rank 0 keeps it (one keeper); a sequence-parallel parameter's every tp
    // rank of cp rank 0, each reducing its replica over dp x cp.
    const int keepers = shares && !expert ? static_cast<int>(tp) : 1;
    combine_param_pieces(shares ? *cp.sequence_group : *cp.comm, ps, a, b, K, P * U, keepers, leaf, scratch);
  }
}

void fold_token_pieces(const ContextParallel& cp, ParamStore& ps, int i, float* acc, std::vector<float>& scratch) {
  LOCKSTEP_CHECK(!ps.sequence_tp(i) && ps.token_pieces(i) == ps.chunk_pieces(), "context parallelism: parameter ",
                 ps.specs()[static_cast<size_t>(i)].name, " folds the cp rank's whole rows");
  const int64_t P = cp.size, C = ps.chunk_pieces();
  combine_param_pieces(
      *cp.comm, ps, i, i + 1, C, P * C, 1, [P, C](int64_t g) { return unit_holder(P, 1, C, 1, g); }, scratch, acc);
}

void finish_folded_pieces(const ContextParallel& cp, ParamStore& ps, int i, float* acc) {
  const int64_t n = ps.specs()[static_cast<size_t>(i)].shape.numel();
  const Ops& ops = ps.device().ops;
  if (cp.rank == 0)
    ops.copy(ps.grad(i), acc, n);
  else
    ops.fill(ps.grad(i), n, -0.0f);
  ops.fill(acc, n, 0.0f);
}

}  // namespace lockstep
