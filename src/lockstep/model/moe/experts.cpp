#include "lockstep/model/moe/experts.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "lockstep/comm/communicator.h"
#include "lockstep/core/error.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/kernels/device.h"
#include "lockstep/parallel/context_parallel.h"
#include "lockstep/tensor/precision.h"

namespace lockstep {

thread_local FloatBuffer GroupedExperts::unit_leaves;
thread_local std::vector<float*> GroupedExperts::unit_pieces;
thread_local std::vector<float> GroupedExperts::combine_scratch;
thread_local FloatBuffer GroupedExperts::chunk_recv;

GroupedExperts::GroupedExperts(ParamStore& ps, Arena& arena, const std::string& prefix, const ModelConfig& m,
                               int64_t E_, int64_t F_global, int64_t max_rows, const ExpertShard& shard)
    : E(E_),
      C(m.hidden_size),
      F(F_global / shard.etp_size),
      sources(shard.sources),
      self(shard.first / E_ * shard.etp_size + shard.etp_rank),
      swiglu(m.activation == "swiglu"),
      has_proj_bias(m.bias),
      inert_padding(shard.inert_padding),
      etp_size(shard.etp_size),
      layout_segments(shard.segments),
      tp_size(shard.tp_size),
      cp_size(shard.cp_size),
      tp(shard.tp),
      etp_group(shard.etp),
      groups(shard.sources) {
  device_ = &ps.device();
  ops_ = &device_->ops;
  const int64_t E_global = shard.E_global ? shard.E_global : E, first = shard.first;
  const int64_t P = shard.etp_size, r = shard.etp_rank;
  if (shard.segments) {  // the config names the keys; these are the invariants the segments need
    LOCKSTEP_CHECK(shard.segments % P == 0 && F_global % shard.segments == 0, "expert width ", F_global,
                   ", layout segments ", shard.segments, ", expert tensor parallel size ", P);
    kseg = KSegments{shard.segments / P, swiglu ? 2 : 1};
  }
  const float std = static_cast<float>(m.init_std);
  const float out_std = static_cast<float>(m.init_std / std::sqrt(2.0 * static_cast<double>(m.num_layers)));
  const int64_t Fw = fc_width(), Fw_global = swiglu ? 2 * F_global : F_global;
  auto add = [&](const std::string& name, Shape global, std::vector<ParamBox> boxes, Init init, float sd, bool decay) {
    return ps.add_part(prefix + name, std::move(global), std::move(boxes), init, sd, decay, /*expert=*/true);
  };
  // fc: per expert, this rank's rows of each section (gate, up), so that an expert's local rows
  // are [gate slice | up slice] back to back. One box for all local experts when unsplit.
  auto fc_boxes = [&](std::vector<int64_t> inner) {
    std::vector<ParamBox> boxes;
    std::vector<int64_t> at(inner.size() + 2, 0), dims = {E, Fw};
    dims.insert(dims.end(), inner.begin(), inner.end());
    if (P == 1) {
      at[0] = first;
      return std::vector<ParamBox>{ParamBox{at, Shape(dims)}};
    }
    dims[0] = 1;
    dims[1] = F;
    for (int64_t e = 0; e < E; ++e)
      for (int64_t sec = 0; sec < (swiglu ? 2 : 1); ++sec) {
        at[0] = first + e;
        at[1] = sec * F_global + r * F;
        boxes.push_back({at, Shape(dims)});
      }
    return boxes;
  };
  fc_w = add("fc.weight", {E_global, Fw_global, C}, fc_boxes({C}), Init::normal, std, true);
  if (m.bias) fc_b = add("fc.bias", {E_global, Fw_global}, fc_boxes({}), Init::zeros, 0.0f, false);
  proj_w = add("proj.weight", {E_global, C, F_global}, {ParamBox{{first, 0, r * F}, Shape{E, C, F}}}, Init::normal,
               out_std, true);
  // The row-parallel proj's bias is added once, by etp rank 0, to its partial sum.
  if (m.bias && r == 0)
    proj_b = add("proj.bias", {E_global, C}, {ParamBox{{first, 0}, Shape{E, C}}}, Init::zeros, 0.0f, false);
  if (kseg.on()) {  // low precision's canonical pieces of the hidden units (tensor/precision.h)
    const KSegmentBounds fc = k_segment_bounds(kseg, Fw);
    ps.set_layout_cut(fc_w, 1, layout_cut(fc.segments, fc.sections));
    ps.set_layout_cut(proj_w, 2, k_segment_bounds(KSegments{kseg.segments, 1}, F).segments);
  }
  fc_out = arena.reserve(max_rows * fc_width());
  act = arena.reserve(max_rows * F);
  if (sources > 1) {
    dfc_w.resize(sources * E * Fw * C);
    dproj_w.resize(sources * E * C * F);
    if (fc_b >= 0) dfc_b.resize(sources * E * Fw);
    if (proj_b >= 0) dproj_b.resize(sources * E * C);
    // Under context parallelism these gradients take no token pieces: the experts run on each micro-batch
    // group's rows in token order (group_token_order), and combine_token_pieces leaves them alone.
    for (int i : {fc_w, fc_b, proj_w, proj_b})
      if (i >= 0) ps.set_module_pieces(i);
    // Run mode: every micro-batch's blocks summed in source order (set_layout replaces it).
    for (int k = 0; k < 4; ++k)
      if (block_buffer(k).size())
        source_sums[k] = ExpertSourceSum::rank_order(E, sources, block_buffer(k).size() / (E * sources));
  }
}

void GroupedExperts::begin_step() {
  for (FloatBuffer* b : {&dfc_w, &dfc_b, &dproj_w, &dproj_b})
    if (b->size()) ops_->fill(b->data(), b->size(), 0.0f);
  work.micro = 0;
}

void GroupedExperts::set_layout(int64_t micros, int64_t leaves, int64_t first, const std::vector<float*>& pieces,
                                Communicator* partner_group, ExpertTpSum tp_sum_) {
  const int64_t T = tp_size * cp_size;  // the sources that share a micro-batch
  partners = nullptr;
  LOCKSTEP_CHECK(tp_sum_ == ExpertTpSum::on_first ||
                     (sources == 1 && tp_size > 1 && cp_size == 1 && (tp_sum_ == ExpertTpSum::parts) == (micros == 1)),
                 "experts: the tp ranks' parts go to the data-parallel reduction as they are only with one micro-batch"
                 " per rank (",
                 micros, "), or as chunks with several, with one source (", sources,
                 ") under tensor parallelism without context parallelism");
  tp_sum = tp_sum_;
  if (layout_segments) {
    // The config refuses the layouts these do not hold for (docs/determinism.md#what-layout-refuses).
    token_L = layout_segments / T;
    const bool part = sources > 1 && sources < T;  // the group holds part of a micro-batch's tp x cp ranks
    LOCKSTEP_CHECK(layout_segments % T == 0 && (sources == 1 || sources % T == 0 || part) &&
                       (sources > 1 || tp_size == 1 || tp) &&
                       (!part || (T % sources == 0 && partner_group && partner_group->size() * sources == T)),
                   "expert token segments: ", sources, " sources, tensor-parallel size ", tp_size,
                   ", context-parallel size ", cp_size);
    if (part) partners = partner_group;
    cp_partners = part && cp_size > 1;
  }
  if (sources == 1) return;  // data parallelism sums these gradients with the others
  groups = token_L ? std::max<int64_t>(sources / T, 1) : sources;
  layout_micros = micros;
  // The per-block buffers hold E x groups blocks (the constructor sized them for E x sources).
  const int64_t Fw = fc_width(), kept = E * groups;
  for (const auto& [b, per] :
       {std::pair<FloatBuffer*, int64_t>{&dfc_w, Fw * C}, {&dproj_w, C * F}, {&dfc_b, Fw}, {&dproj_b, C}})
    if (b->size() && b->size() != kept * per) b->resize(kept * per);
  // G: the sources, or under tensor or context parallelism the micro-batch groups they make (see the header).
  const int64_t G = groups, n = G * micros, L = leaves ? leaves : n;
  // Group g's micro-batches [first + g A, first + (g + 1) A) as pieces of the canonical tree over
  // the step's L (one piece each when A is a power of two and the group's block is a subtree).
  std::vector<std::vector<int64_t>> mine;  // per group, relative to its first micro-batch
  std::vector<int64_t> bounds;             // every group's pieces, as leaves of the step
  for (int64_t g = 0; g < G; ++g) {
    const int64_t a = first + g * micros;
    std::vector<int64_t> b = canonical_pieces(L, a, a + micros);
    bounds.insert(bounds.end(), b.begin() + (g ? 1 : 0), b.end());
    for (int64_t& x : b) x -= a;
    mine.push_back(std::move(b));
  }
  // The expert group's block as its canonical pieces; each is a subtree holding whole group pieces, the
  // canonical tree over its own leaves with them as its leaves.
  const std::vector<int64_t> group = canonical_pieces(L, first, first + n);
  LOCKSTEP_CHECK(pieces.size() + 2 == group.size(), "experts: ", pieces.size(), " piece buffers for ", group.size() - 1,
                 " pieces of the expert group's micro-batches");
  std::vector<ExpertSourceSum::GroupPiece> group_pieces;
  if (bounds.size() - 1 > static_cast<size_t>(G) || group.size() > 2) {
    size_t at = 0;
    for (size_t j = 0; j + 1 < group.size(); ++j) {
      std::vector<int64_t> local;
      const size_t from = at;
      while (bounds[at] < group[j + 1]) local.push_back(bounds[at++] - group[j]);
      local.push_back(group[j + 1] - group[j]);
      group_pieces.push_back({PieceTree(group[j + 1] - group[j], local), static_cast<int64_t>(from),
                              static_cast<int64_t>(at), j < pieces.size() ? pieces[j] : nullptr});
    }
  }
  for (int k = 0; k < 4; ++k)
    if (block_buffer(k).size())
      source_sums[k] =
          ExpertSourceSum::tree(*device_, E, G, block_buffer(k).size() / (E * G), micros, mine, group_pieces);
}

namespace {

// Leaf g's out[g] (n) = the canonical tree over the `per` blocks of fine (leaves x per, n) that
// follow g x per (into fine's first block of each leaf, then copied), a few thousand elements of
// every block at a time so that the tree's levels run in cache.
void tree_over_blocks(const Ops& ops, float* const* out, const float* fine, int64_t leaves, int64_t per, int64_t n) {
  std::vector<const float*> at(static_cast<size_t>(per));
  for (int64_t g = 0; g < leaves; ++g) {
    for (int64_t s = 0; s < per; ++s) at[static_cast<size_t>(s)] = fine + (g * per + s) * n;
    ops.tree_sum(out[g], at.data(), per, n);
  }
}

// Leaf g's bias gradient db[g] (nout) assigned: the canonical tree over its `per` token segments of the
// column sums of dy over each segment's rows, in row order (rows as token_segment_wgrad's).
void token_segment_bias(const Ops& ops, float* const* db, const float* dy, const int64_t* rows, int64_t leaves,
                        int64_t per, int64_t nout) {
  thread_local std::vector<float> bias;
  bias.assign(static_cast<size_t>(leaves * per * nout), 0.0f);
  ops.grouped_bias_grad(bias.data(), dy, rows, leaves * per, nout);
  tree_over_blocks(ops, db, bias.data(), leaves, per, nout);
}

// Layout mode (fp32 / bf16 operands): leaf g's weight gradient dw[g] (nout, nin) assigned, the
// canonical tree over its `per` token segments of dy^T x over each segment's rows, every segment a
// chain from zero (kernels/cpu/gemm.h); db[g] (nout) likewise with the column sums of dy in row
// order (db null: no bias). rows: (leaves x per + 1) boundaries (leaf g's segments are g x per ..
// (g + 1) x per - 1). Every leaf is one segmented product (gemm.h k_segments) and all of them one
// batch: each tile of a dw runs its segments' chains and their tree in cache and is written once.
void token_segment_wgrad(const Ops& ops, float* const* dw, float* const* db, const float* dy, const float* x,
                         const int64_t* rows, int64_t leaves, int64_t per, int64_t nout, int64_t nin) {
  thread_local std::vector<int64_t> bounds;  // leaf g's segments relative to its first row, (per + 1) each
  thread_local std::vector<GemmBatchItem> items;
  bounds.resize(static_cast<size_t>(leaves * (per + 1)));
  items.clear();
  for (int64_t g = 0; g < leaves; ++g) {
    const int64_t r0 = rows[g * per];
    int64_t* b = bounds.data() + g * (per + 1);
    for (int64_t s = 0; s <= per; ++s) b[s] = rows[g * per + s] - r0;
    // K = 0 (no rows) writes the zero.
    GemmBatchItem it{dw[g], nin, dy + r0 * nout, nout, Trans::T, x + r0 * nin, nin, Trans::N, nout, nin, b[per]};
    it.k_segments = std::span<const int64_t>(b, static_cast<size_t>(per + 1));
    items.push_back(it);
  }
  ops.gemm_batch(items.data(), leaves);
  if (db) token_segment_bias(ops, db, dy, rows, leaves, per, nout);
}

}  // namespace

void GroupedExperts::group_token_order(const ParamStore& ps, const int64_t* token_segments, int64_t rows) {
  // A micro-batch group's T = tp x cp sources (world-rank order: tp fastest) hold its cp x U token
  // units (U = max(2B, tp) per cp rank, K consecutive ones per tp rank, parallel/context_parallel.h
  // unit_holder), each unit L / K of its source's token segments; in token order they are the
  // micro-batch's segments.
  const int64_t T = tp_size * cp_size, G = groups, L = token_L;
  const int64_t U = std::max<int64_t>(ps.chunk_pieces(), tp_size), K = U / tp_size, per = L / K;
  LOCKSTEP_CHECK(ps.pieced() && U % ps.chunk_pieces() == 0 && U % tp_size == 0 && L % K == 0 && sources == G * T,
                 "experts: ", sources, " sources of ", U, " token units per cp rank over ", T, " ranks, ", L,
                 " token segments each");
  const int64_t R = token_segments[E * sources * L];
  LOCKSTEP_CHECK(R == rows, "experts: ", R, " rows in the token segments, ", rows, " in the offsets");
  work.cp_order.resize(static_cast<size_t>(R));
  work.cp_bounds.resize(static_cast<size_t>(E * G * cp_size * U * per + 1));
  int64_t at = 0, b = 0;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < cp_size * U; ++j) {
        const auto [q, piece] = unit_holder(cp_size, U / ps.chunk_pieces(), K, tp_size, j);
        const int64_t* t = token_segments + (e * sources + g * T + q) * L + piece * per;
        for (int64_t i = 0; i < per; ++i) {
          work.cp_bounds[static_cast<size_t>(b++)] = at;
          for (int64_t r = t[i]; r < t[i + 1]; ++r) work.cp_order[static_cast<size_t>(at++)] = r;
        }
      }
  work.cp_bounds[static_cast<size_t>(b)] = at;
  LOCKSTEP_CHECK(at == R, "experts: the token units hold ", at, " of ", R, " rows");
}

const Precision::ExpertBlocks* GroupedExperts::quantised_blocks(const Precision& p, const int64_t* segments) {
  if (layout_micros == 0 || sources == 1 || p.recipe(fc_w) == Precision::Recipe::none) return nullptr;
  LOCKSTEP_CHECK(segments, "quantised expert blocks without segments");
  if (groups == sources) {
    work.qblocks = Precision::ExpertBlocks{segments, sources, self, layout_micros};
    return &work.qblocks;
  }
  // Tensor parallelism: the T consecutive sources of a micro-batch group (tp_size of them, or with
  // partners the group's G; see the header) hold its tokens in order, so their rows of expert e are
  // the micro-batch's rows of e (with partners, the group's part of them), one block. With padding,
  // each source's padding sits after its rows: FP8's token segments leave it at the end of the
  // source's last one, zero rows (with biases their activations zeroed: inert_padding); NVFP4's one
  // chain per block would not, and the config refuses that.
  const int64_t T = sources / groups;
  work.group_segments.resize(static_cast<size_t>(E * groups + 1));
  for (int64_t k = 0; k <= E * groups; ++k) work.group_segments[static_cast<size_t>(k)] = segments[k * T];
  work.qblocks = Precision::ExpertBlocks{work.group_segments.data(), groups, self / T, layout_micros};
  return &work.qblocks;
}

void GroupedExperts::forward(const ParamStore& ps, const Arena& arena, float* out, const float* x,
                             const int64_t* offsets, const int64_t* segments, const int64_t* token_segments) {
  if (!in_token_order(token_segments)) return forward_rows(ps, arena, out, x, offsets, segments);
  // The rows in the micro-batch groups' token order, and the outputs back (group_token_order).
  const int64_t R = offsets[E];
  group_token_order(ps, token_segments, R);
  work.tok_in.grow(R * C);
  work.tok_out.grow(R * C);
  ops_->gather_rows(work.tok_in.data(), x, nullptr, work.cp_order.data(), R, C);
  forward_rows(ps, arena, work.tok_out.data(), work.tok_in.data(), offsets, segments);
  ops_->scatter_rows(out, work.tok_out.data(), work.cp_order.data(), R, C);
}

void GroupedExperts::forward_rows(const ParamStore& ps, const Arena& arena, float* out, const float* x,
                                  const int64_t* offsets, const int64_t* segments) {
  Precision& p = ps.precision();
  const int64_t R = offsets[E];
  const Precision::ExpertBlocks* qb = quantised_blocks(p, segments);
  const Precision::RowShare* rows_share = row_share(p, offsets);
  p.grouped_fprop(ps, fc_w, fc_b, arena(fc_out), x, offsets, E, fc_width(), C, qb, {}, false, rows_share);
  if (swiglu)
    ps.device().ops.swiglu_forward(arena(act), arena(fc_out), R, F);
  else
    ps.device().ops.gelu_forward(arena(act), arena(fc_out), R * F);
  p.round(arena(act), R * F);
  if (inert_padding) ops_->zero_rows_of_zeros(arena(act), x, R, F, C);
  // Layout mode: the tree over the K segments; under expert tensor parallelism this rank's raw part.
  p.grouped_fprop(ps, proj_w, proj_b, out, arena(act), offsets, E, C, F, qb, KSegments{kseg.segments, 1}, partial(),
                  rows_share);
}

void GroupedExperts::finish_proj(const ParamStore& ps, Communicator& etp, float* out, const int64_t* offsets) {
  const int64_t R = offsets[E];
  if (has_proj_bias) {
    proj_bias.grow(E * C);
    if (proj_b >= 0) ops_->copy(proj_bias.data(), ps.weight(proj_b), E * C);
    etp.broadcast(proj_bias.data(), E * C, 0);
    ops_->add_group_bias(out, proj_bias.data(), offsets, E, C);
  }
  ps.precision().round(out, R * C);
}

namespace {

// g[0, n) = -0: what a rank that does not hold a gradient gives a reduction (v + -0 = v exactly).
void give_minus_zero(const Ops& ops, float* g, int64_t n) { ops.fill(g, n, -0.0f); }

// This rank's subtree of a micro-batch's token segments (g, n), summed over `group` along the
// canonical tree: the micro-batch's leaf. Group rank 0 keeps it; the others give -0, which the
// expert data-parallel reduction (the group's ranks adjacent in it: each run a subtree) adds
// exactly, v + -0 = v, or as pieces leaves out (their blocks empty: DataParallel::set_layout).
void keep_on_first(const Ops& ops, Communicator& group, float* g, int64_t n) {
  group.all_reduce(g, n, ReduceOp::tree_sum);
  if (group.rank() != 0) give_minus_zero(ops, g, n);
}

// g[0, n) = -0 but for the elements [begin, end) this rank keeps.
void give_minus_zero_outside(const Ops& ops, float* g, int64_t n, int64_t begin, int64_t end) {
  give_minus_zero(ops, g, begin);
  give_minus_zero(ops, g + end, n - end);
}

// As keep_on_first, but each group rank keeps its chunk of the leaf (ExpertTpSum::slices, tp_chunk).
void keep_chunk(const Ops& ops, Communicator& group, float* g, int64_t n) {
  group.reduce_scatter_in_place(g, n, ReduceOp::tree_sum);
  const auto [c0, c1] = tp_chunk(n, group.rank(), group.size());
  give_minus_zero_outside(ops, g, n, c0, c1);
}

}  // namespace

std::vector<int64_t> balanced_ranges(const std::vector<int64_t>& rows, int64_t P) {
  constexpr int64_t kExpertCost = 16;  // an expert's passes that do not scale with its rows, in rows
  const int64_t E = static_cast<int64_t>(rows.size());
  std::vector<int64_t> prefix(static_cast<size_t>(E + 1), 0), b(static_cast<size_t>(P + 1), E);
  for (int64_t e = 0; e < E; ++e)
    prefix[static_cast<size_t>(e + 1)] = prefix[static_cast<size_t>(e)] + rows[static_cast<size_t>(e)] + kExpertCost;
  b[0] = 0;
  for (int64_t r = 1; r < P; ++r) {
    int64_t e = b[static_cast<size_t>(r - 1)];
    // Past every boundary no farther from r / P of the total (P x prefix against r x total: exact).
    while (e < E && std::llabs(P * prefix[static_cast<size_t>(e + 1)] - r * prefix.back()) <=
                        std::llabs(P * prefix[static_cast<size_t>(e)] - r * prefix.back()))
      ++e;
    b[static_cast<size_t>(r)] = e;
  }
  return b;
}

void GroupedExperts::reduce_over_tp(const ParamStore& ps, int w, int b, int64_t nw, int64_t nb) {
  for (const auto& [i, n] : {std::pair<int, int64_t>{w, E * nw}, std::pair<int, int64_t>{b, E * nb}})
    if (i >= 0) {
      if (tp_sum != ExpertTpSum::slices) {
        keep_on_first(*ops_, *tp, ps.grad(i), n);
        continue;
      }
      // DataParallel pushes the parameter's tp_chunk (push_grads): the same bounds.
      const ParamSpec& spec = ps.specs()[static_cast<size_t>(i)];
      LOCKSTEP_CHECK(spec.shape.numel() == n, "experts: ", spec.name, " has ", spec.shape.numel(),
                     " elements, its gradient ", n);
      keep_chunk(*ops_, *tp, ps.grad(i), n);
    }
}

Communicator* GroupedExperts::share_group(const Precision& p) const {
  if (!token_L || p.recipe(fc_w) != Precision::Recipe::nvfp4 || (sources == 1 ? tp_size == 1 : !partners))
    return nullptr;
  LOCKSTEP_CHECK(cp_size == 1 && (sources > 1 || tp),
                 "nvfp4 experts split over a micro-batch's ranks under context parallelism (refused by the config)");
  return sources == 1 ? tp : partners;
}

const Precision::RowShare* GroupedExperts::row_share(const Precision& p, const int64_t* offsets, bool from_forward) {
  Communicator* group = share_group(p);
  if (!group) return nullptr;
  const int64_t P = group->size(), q = group->rank();
  std::vector<int64_t> mine(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e)
    mine[static_cast<size_t>(e)] = work.token_rows ? work.token_rows[e] : offsets[e + 1] - offsets[e];
  if (from_forward) {
    LOCKSTEP_CHECK(work.share_counts_valid && static_cast<int64_t>(work.share_counts.size()) == P * E &&
                       std::equal(mine.begin(), mine.end(), work.share_counts.begin() + q * E),
                   "experts: backward's row counts are not those its forward gathered");
    work.share_counts_valid = false;
  } else {
    work.share_counts.resize(static_cast<size_t>(P * E));
    group->all_gather(work.share_counts.data(), mine.data(), E);
    work.share_counts_valid = true;
  }
  work.share_first.assign(static_cast<size_t>(E), 0);
  work.share_total.assign(static_cast<size_t>(E), 0);
  for (int64_t r = 0; r < P; ++r)
    for (int64_t e = 0; e < E; ++e) {
      const int64_t n = work.share_counts[static_cast<size_t>(r * E + e)];
      if (r < q) work.share_first[static_cast<size_t>(e)] += n;
      work.share_total[static_cast<size_t>(e)] += n;
    }
  // Padded: every rank's rows of e, and the micro-batch's, are the capacity.
  if (work.token_rows)
    for (int64_t e = 0; e < E; ++e) {
      LOCKSTEP_CHECK(work.share_total[static_cast<size_t>(e)] <= offsets[e + 1] - offsets[e], "expert ", e, ": ",
                     work.share_total[static_cast<size_t>(e)], " tokens over a capacity of ",
                     offsets[e + 1] - offsets[e]);
      work.share_total[static_cast<size_t>(e)] = offsets[e + 1] - offsets[e];
    }
  work.share = Precision::RowShare{work.share_first.data(), work.share_total.data()};  // what the GEMMs read
  return &work.share;
}

void GroupedExperts::gathered_wgrad(Precision& p, int w, float* dw, float* db, const float* dy, const float* in,
                                    const int64_t* offsets, int64_t nout, int64_t nin) {
  Communicator& group = *share_group(p);
  const int64_t P = group.size(), q = group.rank();
  // Group rank r computes experts [owned[r], owned[r + 1]): consecutive ranges of about equal work
  // (rows, plus a few for each expert's own passes), from the gathered counts, the same on every
  // rank. Which rank computes an expert does not change its bits (its whole gradient, as one
  // process computes it); the balance keeps the ranks from waiting on each other at the gather.
  const std::vector<int64_t> owned = balanced_ranges(work.share_total, P);
  const auto lo = [&](int64_t r) { return owned[static_cast<size_t>(r)]; };
  const int64_t e0 = lo(q), e1 = lo(q + 1);
  const auto count = [&](int64_t r, int64_t e) { return work.share_counts[static_cast<size_t>(r * E + e)]; };
  // Token rows sent to each rank (its experts' rows here) and received from each (this rank's
  // experts' rows there, source-major); with padding the sent rows are packed (send_order).
  std::vector<int64_t> send(static_cast<size_t>(P), 0), recv(static_cast<size_t>(P), 0), send_order;
  for (int64_t r = 0; r < P; ++r) {
    for (int64_t e = lo(r); e < lo(r + 1); ++e) send[static_cast<size_t>(r)] += count(q, e);
    for (int64_t e = e0; e < e1; ++e) recv[static_cast<size_t>(r)] += count(r, e);
  }
  if (work.token_rows)
    for (int64_t e = 0; e < E; ++e)
      for (int64_t i = 0; i < count(q, e); ++i) send_order.push_back(offsets[e] + i);
  // The gathered rows, expert-major (goff: where each owned expert's start): each expert's token
  // rows from rank 0, 1, ..., then its padding up to share_total (the header). from[i]: the
  // received row of gathered row i, or -1 - j for this rank's own row j (padding).
  std::vector<int64_t> goff(static_cast<size_t>(e1 - e0 + 1), 0), from;
  for (int64_t e = e0; e < e1; ++e)
    goff[static_cast<size_t>(e - e0 + 1)] =
        goff[static_cast<size_t>(e - e0)] + work.share_total[static_cast<size_t>(e)];
  from.resize(static_cast<size_t>(goff.back()));
  int64_t at = 0;                                           // the next received row
  std::vector<int64_t> fill(goff.begin(), goff.end() - 1);  // each owned expert's next gathered row
  for (int64_t r = 0; r < P; ++r)
    for (int64_t e = e0; e < e1; ++e)
      for (int64_t i = 0; i < count(r, e); ++i) from[static_cast<size_t>(fill[static_cast<size_t>(e - e0)]++)] = at++;
  for (int64_t e = e0; e < e1; ++e)  // padding: this rank's own padding rows of e (at least as many)
    for (int64_t j = offsets[e] + count(q, e);
         fill[static_cast<size_t>(e - e0)] < goff[static_cast<size_t>(e - e0 + 1)]; ++j)
      from[static_cast<size_t>(fill[static_cast<size_t>(e - e0)]++)] = -1 - j;
  const auto gather = [&](FloatBuffer& dst, const float* src, int64_t n) {
    std::vector<int64_t> s(send), r(recv);
    for (int64_t& k : s) k *= n;
    for (int64_t& k : r) k *= n;
    const float* sent = src;
    if (work.token_rows) {
      work.gathered_send.resize(send_order.size() * static_cast<size_t>(n));
      ops_->gather_rows(work.gathered_send.data(), src, nullptr, send_order.data(),
                        static_cast<int64_t>(send_order.size()), n);
      sent = work.gathered_send.data();
    }
    work.gathered_recv.grow(at * n);
    group.all_to_allv(work.gathered_recv.data(), r, sent, s);
    dst.grow(goff.back() * n);
    ops_->gather_rows(dst.data(), work.gathered_recv.data(), src, from.data(), goff.back(), n);
  };
  gather(work.gathered_dy, dy, nout);
  gather(work.gathered_x, in, nin);
  p.grouped_wgrad_gathered(w, dw, db, work.gathered_dy.data(), work.gathered_x.data(), goff.data(), e0, e1, nout, nin,
                           etp_group);
  // The micro-batch's gradients on group rank 0, the others -0 (what keep_on_first leaves, the sum
  // over the group of each owner's experts and -0 elsewhere, exactly): rank 0 receives each owner's
  // experts in place (back to back in rank order: the experts' order after its own), the owners
  // then give -0.
  for (const auto& [g, n] : {std::pair<float*, int64_t>{dw, nout * nin}, std::pair<float*, int64_t>{db, nout}}) {
    if (!g) continue;
    if (tp_sum == ExpertTpSum::parts) {  // each owner keeps its experts, -0 elsewhere: the data-parallel tree adds them
      give_minus_zero_outside(*ops_, g, E * n, e0 * n, e1 * n);
      continue;
    }
    if (tp_sum == ExpertTpSum::slices) {  // each rank's tp_chunk from the owners of its elements, -0 elsewhere
      const int64_t N = E * n;
      const auto overlap = [](int64_t a0, int64_t a1, std::pair<int64_t, int64_t> b) {
        return std::max<int64_t>(0, std::min(a1, b.second) - std::max(a0, b.first));
      };
      const auto chunk = [&](int64_t r) { return tp_chunk(N, static_cast<int>(r), static_cast<int>(P)); };
      const auto [c0, c1] = chunk(q);
      std::vector<int64_t> sent(static_cast<size_t>(P)), received(static_cast<size_t>(P));
      for (int64_t r = 0; r < P; ++r) {  // the owned experts and the chunks both tile [0, N) in rank order
        sent[static_cast<size_t>(r)] = overlap(e0 * n, e1 * n, chunk(r));
        received[static_cast<size_t>(r)] = overlap(lo(r) * n, lo(r + 1) * n, {c0, c1});
      }
      chunk_recv.grow(c1 - c0);
      group.all_to_allv(chunk_recv.data(), received, g + e0 * n, sent);
      ops_->copy(g + c0, chunk_recv.data(), c1 - c0);
      give_minus_zero_outside(*ops_, g, N, c0, c1);
      continue;
    }
    std::vector<int64_t> sent(static_cast<size_t>(P), 0), received(static_cast<size_t>(P), 0);
    if (q != 0)
      sent[0] = (e1 - e0) * n;
    else
      for (int64_t r = 1; r < P; ++r) received[static_cast<size_t>(r)] = (lo(r + 1) - lo(r)) * n;
    group.all_to_allv(g + (q == 0 ? lo(1) : 0) * n, received, g + e0 * n, sent);
    if (q != 0) give_minus_zero(*ops_, g, E * n);
  }
}

void GroupedExperts::backward(const ParamStore& ps, const Arena& arena, float* dx, const float* dout, const float* x,
                              const int64_t* offsets, const int64_t* segments, const ExpertsScratch& s,
                              const int64_t* token_segments) {
  if (!in_token_order(token_segments))
    return backward_rows(ps, arena, dx, dout, x, offsets, segments, s, token_segments);
  // As forward: in the groups' token order, whose token segments are the groups' S in order.
  const int64_t R = offsets[E];
  group_token_order(ps, token_segments, R);
  work.tok_in.grow(R * C);
  work.tok_out.grow(R * C);
  work.tok_dx.grow(R * C);
  ops_->gather_rows(work.tok_in.data(), x, nullptr, work.cp_order.data(), R, C);
  ops_->gather_rows(work.tok_out.data(), dout, nullptr, work.cp_order.data(), R, C);
  backward_rows(ps, arena, work.tok_dx.data(), work.tok_out.data(), work.tok_in.data(), offsets, segments, s,
                work.cp_bounds.data());
  ops_->scatter_rows(dx, work.tok_dx.data(), work.cp_order.data(), R, C);
}

// Layout mode (fp32 and FP8 weights): the micro-batch's gradients per token segment, the tree over
// them (see the header). Returns whether the blocks go on to the source sum (several sources).
bool GroupedExperts::token_segment_gradients(const WgradArgs& a, int w, int b, FloatBuffer& dw, FloatBuffer& db,
                                             const float* dy, const float* in, int64_t nout, int64_t nin) {
  const ParamStore& ps = *a.ps;
  Precision& p = ps.precision();
  const int64_t S = sources, G = groups;
  const Precision::ExpertBlocks* qb = a.qb;
  const int64_t* offsets = a.offsets;
  const int64_t* token_segments = a.token_segments;
  const Precision::Recipe recipe = p.recipe(w);
  // Layout mode: per micro-batch, the tree over its token segments (see the header); with one
  // source under context parallelism, per token piece of the rank's rows (K of them: leaf e K + k
  // is expert e's piece k, into the parameter's grad_piece k).
  // (With several sources under context parallelism the rows are in the groups' token order here,
  // token_segments their S segments: group_token_order.) FP8 recipes quantise along the tokens
  // segment by segment (the blocks qb, or each expert's rows with one source).
  // A block's segments: the micro-batch's S, or with partners the group's sources' part of them.
  // With partners under context parallelism: a leaf per (expert, source, token unit) (see the header).
  const int64_t units = cp_partners ? std::max<int64_t>(ps.chunk_pieces(), tp_size) / tp_size : 1;
  const int64_t K = S == 1 ? ps.token_pieces(w) : units;
  const int64_t per = S == 1 || cp_partners ? token_L / K : std::min(S, tp_size * cp_size) * token_L;
  const int64_t leaves = cp_partners ? E * S * units : E * G * K;
  work.dw_leaves.resize(static_cast<size_t>(leaves));
  work.db_leaves.resize(static_cast<size_t>(leaves));
  // With partners under CP, piece j = s units + k of all E experts (piece-major): the weights'
  // pieces, then the biases'; unit_dw / unit_db: where piece j starts.
  const int64_t pieces_per_rank = S * units;
  const auto unit_dw = [&](int64_t j) { return unit_leaves.data() + j * E * nout * nin; };
  const auto unit_db = [&](int64_t j) { return unit_dw(pieces_per_rank) + j * E * nout; };
  if (cp_partners) {
    unit_leaves.grow(pieces_per_rank * E * (nout * nin + (b >= 0 ? nout : 0)));
    for (int64_t g = 0; g < leaves; ++g) {
      const int64_t e = g / pieces_per_rank, j = g % pieces_per_rank;
      work.dw_leaves[static_cast<size_t>(g)] = unit_dw(j) + e * nout * nin;
      if (b >= 0) work.db_leaves[static_cast<size_t>(g)] = unit_db(j) + e * nout;
    }
  } else {
    for (int64_t g = 0; g < leaves; ++g) {
      // Block g / K of the buffer: expert e with one source, (expert, micro-batch group) with several.
      const int64_t block = g / K, k = g % K;
      work.dw_leaves[static_cast<size_t>(g)] = (S == 1 ? ps.grad_piece(w, k) : dw.data()) + block * nout * nin;
      if (b >= 0) work.db_leaves[static_cast<size_t>(g)] = (S == 1 ? ps.grad_piece(b, k) : db.data()) + block * nout;
    }
  }
  if (recipe == Precision::Recipe::none) {
    token_segment_wgrad(ps.device().ops, work.dw_leaves.data(), b < 0 ? nullptr : work.db_leaves.data(), dy, in,
                        token_segments, leaves, per, nout, nin);
  } else {
    p.grouped_wgrad_segments(w, work.dw_leaves.data(), dy, in, token_segments, leaves, per, qb, offsets, E, nout, nin);
    if (b >= 0) token_segment_bias(ps.device().ops, work.db_leaves.data(), dy, token_segments, leaves, per, nout);
  }
  if (S == 1) {
    // Context parallelism's pieces are combined over the group (combine_token_pieces).
    if (tp_size > 1 && !ps.pieced() && tp_sum != ExpertTpSum::parts) reduce_over_tp(ps, w, b, nout * nin, nout);
    return false;
  }
  if (cp_partners) {  // the micro-batch's leaf: the tree over its token units, held by the partners
    const int64_t U = units * tp_size, sub = U / ps.chunk_pieces();
    const auto leaf = [&](int64_t g) {
      const auto [q, k] = unit_holder(cp_size, sub, units, tp_size, g);
      return std::pair<int64_t, int64_t>{q / S, (q % S) * units + k};
    };
    unit_pieces.resize(static_cast<size_t>(pieces_per_rank));
    for (int64_t j = 0; j < pieces_per_rank; ++j) unit_pieces[static_cast<size_t>(j)] = unit_dw(j);
    combine_held_pieces(*ops_, *partners, dw.data(), unit_pieces.data(), E * nout * nin, pieces_per_rank, cp_size * U,
                        leaf, combine_scratch);
    if (b >= 0) {
      for (int64_t j = 0; j < pieces_per_rank; ++j) unit_pieces[static_cast<size_t>(j)] = unit_db(j);
      combine_held_pieces(*ops_, *partners, db.data(), unit_pieces.data(), E * nout, pieces_per_rank, cp_size * U, leaf,
                          combine_scratch);
    }
  } else if (partners) {  // the micro-batch's leaf from the groups' parts (see the header)
    keep_on_first(*ops_, *partners, dw.data(), E * G * nout * nin);
    if (b >= 0) keep_on_first(*ops_, *partners, db.data(), E * G * nout);
  }
  return true;
}

// One micro-batch's weight gradients of parameter w (and bias b, or -1): into the block buffers
// dw, db (or, with one source, the parameter gradients themselves), then the buffers' source sums.
void GroupedExperts::weight_gradients(const WgradArgs& a, int w, int b, FloatBuffer& dw, FloatBuffer& db,
                                      const float* dy, const float* in, int64_t nout, int64_t nin, int which) {
  const ParamStore& ps = *a.ps;
  Precision& p = ps.precision();
  const int64_t S = sources, G = groups;
  const Precision::ExpertBlocks* qb = a.qb;
  const Precision::RowShare* rows_share = a.rows_share;
  const int64_t* offsets = a.offsets;
  const int64_t* segments = a.segments;
  const int64_t* token_segments = a.token_segments;
  const Precision::Recipe recipe = p.recipe(w);
  if (token_L && token_segments && recipe != Precision::Recipe::nvfp4) {
    if (!token_segment_gradients(a, w, b, dw, db, dy, in, nout, nin)) return;
  } else if (S == 1) {
    if (rows_share) return gathered_wgrad(p, w, ps.grad(w), b >= 0 ? ps.grad(b) : nullptr, dy, in, offsets, nout, nin);
    LOCKSTEP_CHECK((tp_size == 1 && cp_size == 1) || !token_L,
                   "nvfp4 expert gradients under context parallelism (refused by the config)");
    return p.grouped_wgrad(ps, w, b, dy, in, offsets, E, nout, nin);
  } else if (qb && rows_share) {  // partners: one block per expert (G = 1), of the group's rows
    LOCKSTEP_CHECK(G == 1, "gathered nvfp4 expert gradients with ", G, " blocks per expert");
    gathered_wgrad(p, w, dw.data(), b >= 0 ? db.data() : nullptr, dy, in, offsets, nout, nin);
  } else if (qb) {
    p.grouped_wgrad_blocks(w, dw.data(), b >= 0 ? db.data() : nullptr, dy, in, *qb, E, nout, nin);
  } else if (recipe != Precision::Recipe::none) {  // run mode: blocks of the per-expert tensors
    const Precision::ExpertBlocks run{segments, S, self, 0, offsets};
    p.grouped_wgrad_blocks(w, dw.data(), b >= 0 ? db.data() : nullptr, dy, in, run, E, nout, nin);
  } else {
    const Ops& ops = ps.device().ops;
    ops.grouped_gemm_wgrad(dw.data(), gemm_operand(dy, nout, Trans::T), gemm_operand(in, nin, Trans::N), segments,
                           E * S, nout, nin);
    if (b >= 0) ops.grouped_bias_grad(db.data(), dy, segments, E * S, nout);
  }
  source_sums[which]->add(*ops_, ps, w, dw.data(), work.micro);
  if (b >= 0) source_sums[which + 1]->add(*ops_, ps, b, db.data(), work.micro);
}

void GroupedExperts::backward_rows(const ParamStore& ps, const Arena& arena, float* dx, const float* dout,
                                   const float* x, const int64_t* offsets, const int64_t* segments,
                                   const ExpertsScratch& s, const int64_t* token_segments) {
  Precision& p = ps.precision();
  const int64_t R = offsets[E], Fw = fc_width();
  // With several sources (expert parallelism) the weight gradients go per (expert, source) block,
  // then the rank-order sum (quantised per block in layout mode; see the header).
  // The blocks go to the buffer's source sum (parallel/reduction/expert_sources.h), which writes the
  // parameter gradients when it has them. which: the weight's buffer (0 fc, 2 proj), its bias's next.
  const Precision::ExpertBlocks* qb = quantised_blocks(p, segments);
  const Precision::RowShare* rows_share = row_share(p, offsets, /*from_forward=*/true);
  const WgradArgs args{&ps, qb, rows_share, offsets, segments, token_segments};
  p.grouped_dgrad(ps, proj_w, s.dact, dout, offsets, E, C, F, qb, {}, false, rows_share);
  // The rows whose activation forward zeroed (inert_padding) pass no gradient back to the fc.
  if (inert_padding) ops_->zero_rows_of_zeros(s.dact, x, R, F, C);
  weight_gradients(args, proj_w, proj_b, dproj_w, dproj_b, dout, arena(act), C, F, 2);
  if (swiglu)
    ps.device().ops.swiglu_backward(s.dfc, arena(fc_out), s.dact, R, F);
  else
    ps.device().ops.gelu_backward(s.dfc, arena(fc_out), s.dact, R * F);
  p.round(s.dfc, R * Fw);
  // Layout mode: K = the hidden units of each section, segmented (a raw part under etp).
  p.grouped_dgrad(ps, fc_w, dx, s.dfc, offsets, E, Fw, C, qb, kseg, partial(), rows_share);
  const float* dfc = s.dfc;
  auto fc_wgrad = [this, args, dfc, x, Fw] {
    weight_gradients(args, fc_w, fc_b, dfc_w, dfc_b, dfc, x, Fw, C, 0);
    ++work.micro;
  };
  if (delay_wgrad)
    pending_wgrad_ = fc_wgrad;
  else
    fc_wgrad();
}

void GroupedExperts::finish_wgrad() {
  LOCKSTEP_CHECK(pending_wgrad_, "experts: finish_wgrad without a delayed weight gradient");
  const std::function<void()> run = std::move(pending_wgrad_);
  pending_wgrad_ = nullptr;
  run();
}

}  // namespace lockstep
