// Expert tensor parallelism (parallel.expert_tensor): each expert's MLP split over the P ranks of
// the expert-tensor-parallel group (etp, comm/mesh.h), Megatron's semantics:
//
//   fc   (C -> F, or C -> 2F as [gate | up] for SwiGLU): column-parallel, rank r holds the hidden
//        units [r, r + 1) x F / P (of the gate and of the up section separately);
//   proj (F -> C): row-parallel, rank r holds the input columns of its hidden units; its outputs are
//        partial sums over the group; the bias lives on etp rank 0 only, which adds it to its part.
//
// The ranks of an etp group hold the same experts but route different tokens (their own micro-
// batches, or their own sequence shard under tensor parallelism), so around the experts:
//
//   gather:          every rank's dispatched rows (after the expert-parallel exchange) go to every
//                    rank of the group (an all-gather with per-rank row counts), then are regrouped
//                    by local expert; inside an expert, by source (ep source s, etp rank p) in the
//                    order j = s x P + p, which is world-rank order in the tp-ep group
//   experts:         the grouped GEMMs on this rank's slices of every expert
//   reduce_scatter:  each rank's rows go back to it from every rank as partial sums, added in rank
//                    order ((y_0 + y_1) + ...) (an all-to-all + ordered local sum, as the
//                    communicator's reduce-scatter)
//
// and in backward the mirror pair: the gradient of the expert outputs is gathered (the backward of a
// reduce-scatter), the input gradients, partial over the fc slices, are reduce-scattered (the
// backward of a gather). The weight gradients of this rank's slices then come from every token of
// the group: per (expert, source) segment, summed in source order (experts.h), so no token's
// expert work or gradient is counted twice and none is missing.
//
// Determinism: the regroup is a copy in a fixed order and the sums run in rank order, so a layout is
// bitwise reproducible run to run, on any backend. Against one rank the proj output sums its F / P
// slices per rank first, so results agree to rounding. determinism = "layout" (set_layout_invariant):
// the ranks' parts are each the canonical tree over their block of K segments (experts.h), and
// reduce_scatter sums them along the canonical tree over the P ranks (ReduceOp::tree_sum's order)
// instead of the left fold, which makes the single-process tree over all segments.
#pragma once

#include <cstdint>
#include <vector>

#include "lockstep/core/tensor.h"
#include "lockstep/kernels/ops.h"

namespace lockstep {

class Communicator;

class ExpertTensorParallel {
 public:
  // etp: the group (P ranks); El: local experts; S: expert-parallel sources of the dispatcher's rows;
  // max_rows: the most rows the dispatcher gives one rank.
  // ops: the device's (kernels/ops.h) that regroup and sum the rows.
  ExpertTensorParallel(const Ops& ops, Communicator& etp, int64_t El, int64_t S, int64_t C, int64_t max_rows);

  // After the dispatcher's plan: segments (El x S + 1) of this rank's rows by (local expert, ep
  // source). Exchanges them over the group (a small all-gather) and lays out the gathered rows.
  // token_segments (El x S x L + 1, layout mode; Dispatcher::token_segments) or null: the same per
  // token segment, gathered too (token_segments() then lays out the gathered rows likewise).
  void plan(const int64_t* segments, const int64_t* token_segments = nullptr, int64_t L = 0);
  // all (rows(), C) = every rank's rows (C columns each) regrouped by local expert.
  void gather(float* all, const float* mine) const;
  // mine (this rank's rows, C) = the rank-order sum over the group of the partial rows in `all`.
  void reduce_scatter(float* mine, const float* all) const;
  // determinism = "layout": reduce_scatter sums along the canonical tree over ranks.
  void set_layout_invariant() { tree_ = true; }

  int64_t rows() const { return offsets_[El_]; }
  const int64_t* offsets() const { return offsets_.data(); }    // (El + 1)
  const int64_t* segments() const { return segments_.data(); }  // (El x S x P + 1)
  // (El x S x P x L + 1): rows of (local expert, ep source, etp rank, token segment); null unless
  // plan had token segments.
  const int64_t* token_segments() const { return L_ ? tsegs_.data() : nullptr; }
  int64_t sources() const { return S_ * P_; }
  int64_t max_rows() const { return P_ * max_rows_; }

 private:
  // Rows by etp rank (the exchange's layout) <-> rows by local expert and source.
  void regroup(float* by_expert, const float* by_rank) const;
  void ungroup(float* by_rank, const float* by_expert) const;

  Communicator& etp_;
  int64_t El_, S_, C_, P_, r_, max_rows_;
  bool tree_ = false;
  std::vector<int64_t> peer_segments_;  // (P, El x S + 1) every rank's segments
  std::vector<int64_t> peer_rows_;      // (P) rows of each rank
  std::vector<int64_t> peer_at_;        // (P) first row of each rank's block in the exchange layout
  std::vector<int64_t> offsets_, segments_;
  const Ops& ops_;
  // (El x S x P): block b's first row in the rank-major exchange layout and its rows (segments_
  // holds its first row in the expert-major one).
  std::vector<int64_t> block_rank_row_, block_rows_;
  int64_t L_ = 0;  // token segments per source (layout mode), 0: off
  std::vector<int64_t> peer_tsegs_, tsegs_;
  FloatBuffer send_, recv_;  // (P x max_rows, C) each
};

}  // namespace lockstep
