// Tensor and sequence parallelism (Megatron semantics) over the tensor-parallel group.
//
// Tensor parallelism splits every matmul of a layer over the tp ranks of the group:
//   column-parallel (QKV, MLP fc): rank r holds rows [r, r + 1) x out / tp of W (out, in), of each
//     section separately for fused projections ([Q | K | V], SwiGLU's [gate | up]); its output is
//     this rank's columns of y, so attention heads and KV groups, and the MLP's hidden units, split;
//   row-parallel (attention proj, MLP proj): rank r holds columns [r, r + 1) x in / tp of W; each
//     rank's product is a partial sum of y, reduced over the group; the bias is added once, after
//     the reduction;
//   vocab-parallel embedding and output head: rank r owns vocabulary rows [r, r + 1) x V / tp; the
//     lookup zeroes ids outside them and the group sums; the loss combines each rank's per-row
//     (max, sum of exponentials, target logit) so that the full logits never exist on one rank.
//
// Communication comes in mirrored pairs, the backward of each being the other:
//   copy_to_tp      forward: identity (every rank holds the full input)   backward: reduce_from_tp
//   reduce_from_tp  forward: all-reduce (sum of the partial outputs)     backward: copy_to_tp
// and, with sequence parallelism (parallel.sequence_parallel), which shards the residual stream,
// norms and position embedding along the tokens (rank r holds rows [r, r + 1) x N / tp of the
// (B x T, C) activations: the sequence when B = 1):
//   gather_from_sp         forward: all-gather of the row shards          backward: scatter_to_sp
//   scatter_to_sp          forward: reduce-scatter of the partial rows    backward: gather_from_sp
// so a layer reads: norm (local rows) -> gather_from_sp / copy_to_tp -> column-parallel ->
// row-parallel -> scatter_to_sp / reduce_from_tp -> + residual (local rows).
//
// Determinism: every reduction is the communicator's rank-order sum (comm/communicator.h), so a
// layout gives the same bits run to run, with any thread count, on threads and mpi. Against the
// single-process run the row-parallel sums and the vocabulary's softmax sums associate per rank
// first, so losses agree to rounding. Under determinism = "layout" (segments > 0) each reduction
// this group splits along K is cut into S canonical segments (k_segments), each rank sums its
// block of them along the canonical tree, and the group's reductions (reduce_from_tp,
// scatter_to_sp and so the regions' entries and exits) are ReduceOp::tree_sum: the bits of one
// process computing the same S segments, whatever the group's size
// (docs/design/reductions.md#tensor-parallel-k-segments).
#pragma once

#include <cstdint>
#include <vector>

#include "lockstep/tensor/param_table.h"

namespace lockstep {

struct Ops;

class Communicator;

struct TensorParallel {
  Communicator* comm = nullptr;  // the tensor-parallel group (comm/mesh.h MeshGroup::tp); null: none
  int rank = 0, size = 1;
  bool sequence = false;  // sequence parallelism
  // determinism = "layout": the canonical segment count S (config layout_segments) of every
  // reduction this group splits, each rank holding S / size consecutive segments; 0 under "run".
  // Set on one process too, so that it computes the same segments.
  int64_t segments = 0;
  // determinism = "layout" with layout_token_segments: every weight gradient is a token sum in S
  // token segments (GradRole::token_sum on every parameter) and attention's dK, dV are summed in
  // S / B query segments per sample (kernels/cpu/attention.h), in every layout.
  bool token_segments = false;

  TensorParallel() = default;
  TensorParallel(Communicator* group, bool sequence_parallel);
  bool on() const { return size > 1; }
  bool layout() const { return segments > 0; }
  // Rows of the (N, C) residual stream this rank holds: N / size with sequence parallelism, else N.
  int64_t rows(int64_t N) const { return sequence ? N / size : N; }

  // Declares column-parallel weights: W (sum of sections, in), this rank's slice of each section
  // (sections: the fused projection's parts, each split evenly); the bias the same way.
  int column_weight(ParamStore& ps, const std::string& name, const std::vector<int64_t>& sections, int64_t in,
                    float std) const;
  int column_bias(ParamStore& ps, const std::string& name, const std::vector<int64_t>& sections) const;
  // Declares a row-parallel weight: W (out, in), this rank's columns (the bias is replicated).
  int row_weight(ParamStore& ps, const std::string& name, int64_t out, int64_t in, float std) const;
  // Declares a vocab-parallel table (V, C): this rank's vocabulary rows.
  int vocab_weight(ParamStore& ps, const std::string& name, int64_t V, int64_t C, float std) const;
  // This rank's vocabulary range [vocab_begin(V), vocab_begin(V) + V / size).
  int64_t vocab_begin(int64_t V) const { return rank * (V / size); }
  // determinism = "layout": the canonical cut of a reduction over K elements that this group
  // splits (K global, size | K, each rank holding its K / size consecutive ones). Segment s of S
  // is [floor(s K / S), floor((s + 1) K / S)); this rank holds segments [rank, rank + 1) x S / size
  // (a subtree of the canonical tree over S), and the S / size + 1 boundaries of its segments,
  // relative to its own slice, are returned (GemmOptions::k_segments). With several sections (a
  // fused projection: each section split over the group and cut into S segments separately) the
  // sections' lists are concatenated (GemmOptions::k_sections). Empty under "run": one chain.
  std::vector<int64_t> k_segments(const std::vector<int64_t>& sections) const;
};

// The mirrored pairs. x, dx: (n) in place; rows: this rank's row shard (rows, C), full: (size x rows, C).
inline void copy_to_tp(const TensorParallel&) {}
void reduce_from_tp(const TensorParallel& tp, float* x, int64_t n);
void gather_from_sp(const TensorParallel& tp, float* full, const float* rows, int64_t n_rows, int64_t C);
void scatter_to_sp(const TensorParallel& tp, float* rows, const float* full, int64_t n_rows, int64_t C);

// Into a column-parallel region: the full (N, C) input of this rank's column slice. Without
// sequence parallelism that is x itself (copy_to_tp); with it, x's rows are gathered into full.
const float* enter_column_parallel(const TensorParallel& tp, float* full, const float* x, int64_t N, int64_t C);
// Its backward: dfull (N, C) holds this rank's partial input gradient; returns the summed gradient
// of this rank's rows: dfull itself, all-reduced (reduce_from_tp), or, with sequence parallelism,
// reduced into drows (scatter_to_sp).
float* enter_column_parallel_backward(const TensorParallel& tp, float* drows, float* dfull, int64_t N, int64_t C);
// Out of a row-parallel region: partial (N, C) holds this rank's partial sums; returns this rank's
// rows of the sum: partial all-reduced (reduce_from_tp), or, with sequence parallelism, reduced
// into rows (scatter_to_sp).
float* leave_row_parallel(const TensorParallel& tp, float* rows, float* partial, int64_t N, int64_t C);
// Its backward: the full (N, C) output gradient from this rank's rows: drows itself (copy_to_tp)
// or gathered into dfull (gather_from_sp).
const float* leave_row_parallel_backward(const TensorParallel& tp, float* dfull, const float* drows, int64_t N,
                                         int64_t C);

// Vocab-parallel embedding. out (N, C) = wte[tokens] for the tokens in this rank's vocabulary
// range, 0 elsewhere (-0 under determinism = "layout", the identity of addition: the sum over the
// group is then the one row bit for bit, a -0 included) (wte: this rank's (V / size, C) rows; local (N) receives
// vocab_parallel_local_tokens); UserError naming the token when a token is outside [0, V) (on every
// rank, before anything is written). The caller sums over the group.
void vocab_parallel_embedding_forward(const Ops& ops, const TensorParallel& tp, float* out, int32_t* local,
                                      const int32_t* tokens, const float* wte, int64_t N, int64_t C, int64_t V);
// The whole vocab-parallel embedding into this rank's rows x (rows(N), C): the lookup above into
// partial (N, C), summed over the group as a row-parallel output is (exact: one term is non-zero),
// plus the replicated position embedding wpe (null: none) at positions[n] (null: n % T).
void vocab_parallel_embedding(const Ops& ops, const TensorParallel& tp, float* x, float* partial, int32_t* local,
                              const int32_t* tokens, const float* wte, const float* wpe, const int32_t* positions,
                              int64_t N, int64_t T, int64_t C, int64_t V);
// Its backward from dx (this rank's rows; without tensor parallelism the plain embedding's): the
// full gradient (gathered into dfull (N, C) under sequence parallelism) into this rank's vocabulary
// rows of parameter wte's gradient and into wpe's (-1: none; the same on every rank), in their
// token segments (ParamStore::token_segments) and per token piece of the rank's rows
// (ParamStore::token_pieces: context parallelism under layout_token_segments). order, local: (N) scratch.
void vocab_parallel_embedding_backward(const TensorParallel& tp, const ParamStore& ps, int wte, int wpe, int32_t* order,
                                       float* dfull, const float* dx, int32_t* local, const int32_t* tokens,
                                       const int32_t* positions, int64_t B, int64_t T, int64_t C, int64_t V,
                                       int64_t P = 0);
// local (N): each token's row in this rank's table, -1 outside its range (for embedding_backward).
void vocab_parallel_local_tokens(const TensorParallel& tp, int32_t* local, const int32_t* tokens, int64_t N, int64_t V);

// Vocab-parallel softmax cross-entropy over logits (N, V / size) (this rank's vocabulary columns,
// leading dimension ld): losses (N), the same on every rank; with backward, the logits are
// overwritten by their gradient (softmax - one-hot) x grad_scale. One all-gather of N
// (max, sum of exponentials, target logit) triples; each row's are combined in rank order.
// determinism = "layout" (tp.layout(), also on one process: tp.size = 1): the canonical vocabulary
// segments of cross_entropy.h instead, the one-process bits for every tp: an all-reduce (max) of
// the N row maxima, then an all-reduce (tree_sum) of N (sum of exponentials, target logit) pairs.
// scratch: grown on the first call, reused after (steady-state steps do not allocate).
void vocab_parallel_cross_entropy(const Ops& ops, const TensorParallel& tp, float* losses, float* logits,
                                  const int32_t* targets, int64_t N, int64_t V, int64_t ld, bool backward,
                                  float grad_scale, std::vector<float>& scratch);

// The sequence-parallel parameters' gradients (GradRole::sequence_parallel: partial sums over each
// rank's rows: the norms under sequence parallelism, an MoE layer's norm, router and shared expert
// under any tensor parallelism) among parameters [first, end) (end < 0: to the end of the table)
// summed over the group, in table order (one all-reduce). "run": once per step, after the
// data-parallel reduction. "layout" (tp.layout()): the rank's partial is the tree over its token
// segments (ParamStore::token_segments), so the sum is a ReduceOp::tree_sum, and it runs for every
// micro-batch before the micro-batch's gradients become its leaf of the data-parallel tree (the
// trainer's grads-ready hook), as one process has them; under context parallelism (ParamStore::pieced)
// not here but with the cp ranks' token pieces (combine_token_pieces).
void reduce_sequence_parallel_grads(const TensorParallel& tp, ParamStore& ps, int first = 0, int end = -1);

}  // namespace lockstep
