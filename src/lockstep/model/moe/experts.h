// The routed experts of one MoE layer: E MLPs (fc: C -> F, or C -> 2F as [gate | up] for SwiGLU;
// GELU / SwiGLU; proj: F -> C), run as one grouped GEMM per projection over the dispatcher's rows
// (kernels/cpu/grouped_gemm.h). The routing weight is not applied here: the combine multiplies each
// expert output by it (Megatron's unpermute; Megatron's grouped MLP folds it into the activation,
// which for a linear proj is the same function).
//
// Parameters: <prefix>fc.weight (E, Fw, C), fc.bias (E, Fw), proj.weight (E, C, F), proj.bias (E, C);
// biases only with model.bias. Under expert parallelism a rank holds the box of its experts
// [first, first + E) of the layer's E_global (param_table.h's global_shape and boxes), drawn at
// init exactly as the whole tensors would be. Under expert tensor parallelism (P ranks,
// expert_tensor_parallel.h) it holds, of each of its experts, the fc rows of its F / P hidden units
// (one box per expert and section: [gate | up] stay contiguous per expert, as the grouped GEMM
// reads them) and the proj columns of the same units; proj.bias only on etp rank 0.
//
// Weight gradients with several source ranks (sources > 1, expert parallelism): the rows of an
// expert come from the micro-batches of S ranks. Each (expert, source) block accumulates into its
// own buffer over the step's micro-batches, and after each backward the parameter gradient is the
// rank-order sum of the S buffers: ((g_0 + g_1) + g_2) + ... Each g_s is bitwise the gradient rank s
// accumulates for that expert when it computes all experts itself (the same rows in the same order,
// one FMA chain per element), and a data-parallel all-reduce sums those in the same order
// (comm/communicator.h): so expert parallelism over S ranks gives the expert gradients of data
// parallelism over the same S ranks bit for bit.
//
// determinism = "layout" (set_layout(A), A micro-batches per rank and step): each (expert, source)
// block is the gradient of ONE micro-batch of that source, computed from zero, and is pushed as a
// leaf into its own canonical-tree sum over the source's A micro-batches (core/tree_sum.h). After
// the last micro-batch the parameter gradient is the canonical tree over the S sources' sums: the
// expert-parallel group's micro-batches are the S sources' blocks of A in source order, so with A a
// power of two that is the canonical tree over the group's S x A micro-batches, bit for bit the
// single-process sum of their expert gradients. Otherwise (A not a power of two, or the group's S x
// A micro-batches not a subtree of the step's: S not a power of two with several expert
// data-parallel replicas) the sources' blocks are cut into their canonical pieces of the step's
// tree (core/tree_sum.h: each source's tree keeps a sum per piece), and each canonical piece of the
// group's block is the tree over the sources' pieces it holds: the parameter gradient leaves as the
// group's pieces (the last in ps.grad, the others in DataParallel's tables), which the expert
// data-parallel reduction combines with the other groups' along the step's tree
// (Communicator::*_pieces). Until the last micro-batch the parameter gradient
// stays zero; data parallelism leaves these parameters to this class in that mode and reduces
// them over the expert data-parallel group along the canonical tree (data_parallel.h). Under expert
// tensor parallelism the sources are the etp x ep ranks whose rows the group gathers (in world-rank
// order, so their micro-batches are consecutive): the same blocks and trees.
//
// Token segments (layout mode, fp32 / bf16 weights): what one process computes as micro-batch m's
// gradient of expert e is the canonical tree over the S = layout_segments token segments of m (core/
// tree_sum.h canonical_segments over its N tokens), each segment one FMA chain from zero over e's
// rows from that segment (and likewise each bias gradient's column sums), so that tensor
// parallelism, whose ranks route N / tp tokens each (whole segments), can rebuild it. The
// dispatcher gives the rows per (expert, source, token segment of the source's N / tp tokens)
// (Dispatcher::token_segments, token_segments_per_source() = S / tp of them; S / (tp cp) under
// context parallelism, below). With several sources
// the tp_size consecutive ones that share a micro-batch (the tp ranks of one dp rank, world-rank
// order) make one leaf, the tree over their S segments, so the (expert, source) blocks above become
// (expert, micro-batch group) blocks: groups = sources / tp_size of them per expert. With one
// source and tp_size > 1 the rank sums its own S / tp segments, reduce_over_tp sums those over the
// tp group per micro-batch (ReduceOp::tree_sum) and the ranks but tp rank 0 give -0, which the
// expert data-parallel reduction over the tp x dp ranks adds exactly
// (docs/design/reductions.md#expert-tp-parts-and-slices); with one micro-batch per rank and step that reduction sums
// the ranks' subtrees itself (set_layout's tp_sum = parts) and reduce_over_tp is skipped, and with a subtree of
// micro-batches per rank each micro-batch's sum is spread over the tp ranks, rank r keeping chunk r of each parameter
// (tp_sum = slices: a reduce-scatter, -0 elsewhere, the data-parallel tree pushed on the chunk only). The FP8 recipes
// take the same token segments (Precision::grouped_wgrad_segments: each segment quantised along the tokens on its own),
// with several sources per (expert, micro-batch group) block (its tp sources' rows back to back, the micro-batch's rows
// of the expert in token order; quantised_blocks), with one source per expert of the rank's rows (their per-tensor amax
// reduced over tp x cp by the trainer's groups). NVFP4 keeps one quantised chain per (expert, micro-batch) block (its
// Hadamard blocks run along the block's rows): with one source under tp each rank quantises its rows as their part of
// the micro-batch's (row_share, Precision::RowShare) and the weight gradients gather each expert's rows on one tp rank
// (gathered_wgrad); under cp the config refuses it. Context parallelism (one source; ExpertShard::cp_size): the rank's
// rows are its token pieces (ParamStore::token_pieces: its chunks, or under tp its tp share of them), S / (tp cp)
// segments in all; each (expert, piece) is a leaf, the tree over the piece's segments written to the parameter's
// grad_piece, and the model combines the pieces over tp x cp (parallel/context_parallel.h
// combine_token_pieces: one rank keeps the sum, the others -0) instead of reduce_over_tp. With
// several sources a micro-batch group is its tp x cp consecutive sources (groups = sources / (tp cp)),
// whose rows of an expert are not in token order (each source's are its token units): backward takes
// them in the micro-batch's token order first (group_token_order), and the leaf is the tree over the
// micro-batch's S segments as above; the model leaves these pieces alone (GradRole::Pieces::module_combines).
// An expert x expert-tensor group smaller than the tp group (G = sources dividing tp_size): its
// sources are G consecutive tp ranks of one micro-batch, whose G x S / tp segments are an aligned
// subtree of the micro-batch's; the group's leaf per micro-batch is that
// subtree, summed along the canonical tree over the tp / G groups holding the same experts for the
// other tp ranks (set_layout's `partners`, ReduceOp::tree_sum), the first keeping the micro-batch's
// leaf and the others giving -0 (groups = 1), which the expert data-parallel reduction over the
// partners (adjacent in it, each run of them a subtree) adds exactly, or, when the blocks go as
// pieces, leaves out (the others' blocks empty), as in the one-source case. NVFP4 quantises the
// group's rows as their part of the micro-batch's and gathers each expert's rows from the partners
// for its weight gradients, as with one source (row_share, gathered_wgrad). Under context
// parallelism (G dividing tp x cp; the partners are the tp x cp group's ranks with the same expert
// coordinates) a group's sources hold scattered token units, no subtree: each rank's leaves are one
// per (expert, source, token unit), the tree over the unit's token segments (an aligned subtree of
// the micro-batch's), combined over the partners along the canonical tree over the micro-batch's
// units in token order (parallel/context_parallel.h combine_held_pieces, unit_holder), the first
// partner keeping the leaf and the others -0 as above (cp_partners).
//
// The two GEMMs whose K is the hidden units (proj forward, fc input gradient) are cut into canonical
// K segments in layout mode (ExpertShard::segments = S, config layout_segments; kernels/cpu/
// grouped_gemm.h grouped_gemm_segmented): segment s is slice s of the hidden units (for SwiGLU's fc,
// of the gate and of the up section, one chain), the segments summed along the canonical tree. Under
// expert tensor parallelism over P ranks, rank r holds segments [r S/P, (r + 1) S/P) (its hidden
// units) and its outputs are the raw tree over them (partial(): no bias, not rounded); the group
// sums them with ReduceOp::tree_sum (expert_tensor_parallel.h), then finish_proj adds the proj bias
// and rounds: bitwise one process. Quantised expert GEMMs (fp8 / fp4) are segmented the same way
// (gemm.h k_segments per expert or block), the etp sources' blocks as below.
//
// Quantised recipes (fp8 / fp4) in layout mode with several sources (expert parallelism): one
// process quantises expert e's rows of one micro-batch as one tensor, so every quantised GEMM here
// runs per (expert, source) block, each block its own tensor (Precision::ExpertBlocks: its own
// scale, blocks along its own tokens, stochastic rounding keyed by its source's micro-batch and the
// expert's index in the layer), and the weight gradient of each block is that block's: under FP8
// the tree over its token segments (above), under NVFP4 the quantised wgrad of the whole block. In
// run mode the forward and input-gradient GEMMs quantise each expert's rows of all sources as one
// tensor, and the weight gradient of each (expert, source) block is quantised as
// the data-parallel rank that computes it alone would (Precision::ExpertBlocks::whole): per-tensor
// scaling reads the block's rows of the expert's tensors (their scale is data parallelism's reduced
// amax), block recipes quantise the block on its own; with the rank-order sum above that is
// data parallelism's quantised expert gradient bit for bit (FP8; NVFP4's run-mode keys are per rank).
#pragma once

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "lockstep/config/config.h"
#include "lockstep/core/tree_sum.h"
#include "lockstep/kernels/ops.h"
#include "lockstep/model/arena.h"
#include "lockstep/parallel/reduction/expert_sources.h"
#include "lockstep/parallel/reduction/expert_tp_sum.h"
#include "lockstep/tensor/param_table.h"
#include "lockstep/tensor/precision.h"

namespace lockstep {

class Communicator;

struct ExpertsScratch {
  float* dact;  // (R, F)
  float* dfc;   // (R, Fw)
};

// Which part of a layer's experts a rank holds.
struct ExpertShard {
  int64_t first = 0, E_global = 0;     // experts [first, first + E) of E_global (0: E, all of them)
  int64_t sources = 1;                 // ranks whose rows reach these experts (dispatcher / etp sources())
  int64_t etp_rank = 0, etp_size = 1;  // the slice of each expert's hidden units
  int64_t segments = 0;                // determinism = "layout": canonical K segments of the whole hidden width
                                       // and canonical token segments of a micro-batch
  int64_t tp_size = 1;                 // tensor parallelism: each source routes N / tp_size tokens
  Communicator* tp = nullptr;          // the tp group (layout mode with one source: see above)
  int64_t cp_size = 1;                 // context parallelism: a rank's rows are N / cp_size tokens of 2B pieces
  bool inert_padding = false;          // determinism = "layout", padding to capacity and biases: see forward
  Communicator* etp = nullptr;         // the expert-tensor group (etp_size > 1)
};

struct GroupedExperts {
  GroupedExperts() = default;
  // E local experts of width F_global (this rank computes F_global / etp_size of it); max_rows: the
  // most rows a micro-batch can give these experts.
  GroupedExperts(ParamStore& ps, Arena& arena, const std::string& prefix, const ModelConfig& m, int64_t E,
                 int64_t F_global, int64_t max_rows, const ExpertShard& shard = ExpertShard{});

  // out (R, C) = expert_e(x) on the rows of each expert e. segments, token_segments: as backward's,
  // the same for a micro-batch's forward and backward (which run in the same row order).
  // inert_padding (layout mode, moe.pad_expert_input_to_capacity with model.bias): a row of x that
  // is all zeros (every padding row) gets a zero activation instead of the fc bias's, so that the
  // padding rows, which each tp x cp rank places after its own rows of an expert, are zero rows
  // wherever they fall (for the quantised recipes' scales and blocks, as without biases); backward
  // zeroes the same rows' activation gradient. A real token's row is all zeros only if its
  // normalised hidden state is: then it gets the same, a constant zero activation.
  void forward(const ParamStore& ps, const Arena& arena, float* out, const float* x, const int64_t* offsets,
               const int64_t* segments, const int64_t* token_segments);
  // dx (R, C) assigned; parameter gradients accumulate. segments: (E x sources + 1) rows of
  // (expert e, source s) at [e * sources + s] (= offsets with one source). token_segments (layout
  // mode): (E x sources x token_segments_per_source() + 1) rows of (expert, source, token segment)
  // (Dispatcher::token_segments).
  void backward(const ParamStore& ps, const Arena& arena, float* dx, const float* dout, const float* x,
                const int64_t* offsets, const int64_t* segments, const ExpertsScratch& s,
                const int64_t* token_segments);
  // moe.delay_wgrad_compute: backward leaves the fc weight gradient (and the micro-batch's count) to
  // finish_wgrad(), which the layer runs while the dispatch backward's rows are in flight (Megatron's
  // delay_wgrad_compute). The same arithmetic in the same order: the bits do not change.
  bool delay_wgrad = false;
  void finish_wgrad();
  // Start of an optimizer step: clears the per-source gradient buffers (sources > 1).
  void begin_step();
  // determinism = "layout" with `micros` micro-batches per rank and step (sources > 1 only; see
  // above). The group's S x micros micro-batches are [first, first + S micros) of the step's
  // `leaves` (0: the group holds them all); when that block is not a subtree, `pieces` (one per
  // canonical piece of it but the last, table-shaped like ps.grads(): DataParallel::expert_pieces)
  // receive those pieces' gradients at the expert parameters' offsets, ps.grad the last one's.
  // partners: an expert x expert-tensor group smaller than the tp x cp group (G = sources dividing
  // tp x cp, see the header), the tp cp / G ranks holding these experts for the micro-batch's other
  // tp x cp ranks.
  // tp_sum (DataParallel::expert_tp_sum; one source under tensor parallelism): how each micro-batch's
  // gradients are summed over the tp ranks. on_first: onto tp rank 0, the others -0 (reduce_over_tp;
  // NVFP4: gathered_wgrad's owners send their experts to rank 0). parts (one micro-batch per rank and
  // step): the data-parallel reduction over the tp x dp ranks adds the tp ranks' parts along the
  // canonical tree, so each rank keeps its own part (the tree over its token segments; NVFP4: its
  // owned experts' whole gradients, -0 elsewhere) and neither runs. slices: tp rank r keeps chunk r
  // of each expert parameter (tp_chunk), the others' parts of it summed in (a reduce-scatter;
  // NVFP4: the ranks that computed whole experts send each rank the elements of its chunk), -0
  // elsewhere.
  void set_layout(int64_t micros, int64_t leaves = 0, int64_t first = 0, const std::vector<float*>& pieces = {},
                  Communicator* partners = nullptr, ExpertTpSum tp_sum = ExpertTpSum::on_first);
  // Layout mode: the token segments per source the weight gradients need (segments / (tp_size x
  // cp_size)), 0 otherwise (run mode).
  int64_t token_segments_per_source() const { return token_L; }
  // Layout mode under expert tensor parallelism: forward's output and backward's dx are this rank's
  // raw partial sums (the tree over its K segments), to be summed over the group with tree_sum.
  bool partial() const { return kseg.on() && etp_size > 1; }
  // After that sum: out (rows of `offsets`, C) = proj bias (etp rank 0's, broadcast over the group
  // etp) + out, rounded; what one process's segmented proj does after its tree.
  void finish_proj(const ParamStore& ps, Communicator& etp, float* out, const int64_t* offsets);

  int64_t fc_width() const { return swiglu ? 2 * F : F; }
  // Layout mode with several sources and a quantised recipe: the (expert, source) blocks the
  // quantised GEMMs run on (see above); else null.
  const Precision::ExpertBlocks* quantised_blocks(const Precision& p, const int64_t* segments);

  // Layout mode, one source under tensor parallelism: the micro-batch's weight gradients of w and
  // b (nw, nb elements per expert) from this rank's token segments (see the header).
  void reduce_over_tp(const ParamStore& ps, int w, int b, int64_t nw, int64_t nb);
  // NVFP4 in layout mode with an expert x expert-tensor group smaller than tp (one source under
  // tensor parallelism: the experts on every tp rank; or partners, without context parallelism): the
  // ranks that hold parts of a micro-batch's rows of these experts, in token order (tp, or the
  // partners); else null.
  Communicator* share_group(const Precision& p) const;
  // Padding to capacity with one source: the rows of each expert that hold tokens (the first of its
  // rows; the dispatcher's tokens_per_expert), for the next forward or backward; null: all of them.
  void set_token_rows(const int64_t* rows) { work.token_rows = sources == 1 ? rows : nullptr; }
  // Their shares of each expert's rows of the micro-batch (Precision::RowShare, from the counts
  // gathered over share_group); else null. A collective over the group in forward; backward reuses
  // the counts its micro-batch's forward gathered (from_forward; checked against this rank's own).
  // With padding (token_rows) the shares count the token rows, and the micro-batch's rows of an
  // expert are the tp ranks' token rows in rank order, then padding to the capacity, which each
  // rank's rows are too.
  const Precision::RowShare* row_share(const Precision& p, const int64_t* offsets, bool from_forward = false);
  // The forward's gathered counts, kept for its micro-batch's backward: a pipeline schedule's
  // micro-batches in flight each keep their own (MoeLayer::select swaps them in and out).
  struct SharedCounts {
    std::vector<int64_t> counts;
    bool valid = false;
  };
  void swap_shared_counts(SharedCounts& other) {
    std::swap(other.counts, work.share_counts);
    std::swap(other.valid, work.share_counts_valid);
  }
  // Then the weight gradients of w into dw (E, nout, nin) and db (E, nout) or null (dy (R, nout), in
  // (R, nin)): group rank q gathers the rows of its experts (a consecutive range; the ranges hold
  // about equal numbers of the micro-batch's rows) from all P ranks of the group (all-to-all, in rank
  // order: the micro-batch's order; with padding their token rows, then as many of its own padding
  // rows as fill the capacity: every padding row is the same computation on a zero row, the
  // one-process padding rows' bits), computes their whole NVFP4 gradients as one process does
  // (Precision::grouped_wgrad_gathered), and group rank 0 receives every rank's experts (the others
  // then hold -0: what keep_on_first leaves); with set_layout's tp_sum = parts each rank keeps its own
  // experts instead, -0 elsewhere, and with slices each rank receives its chunk of every expert's
  // gradient from the ranks that computed it, -0 elsewhere.
  void gathered_wgrad(Precision& p, int w, float* dw, float* db, const float* dy, const float* in,
                      const int64_t* offsets, int64_t nout, int64_t nin);

  int fc_w = -1, fc_b = -1, proj_w = -1, proj_b = -1;
  int64_t E = 0, C = 0, F = 0, sources = 1;    // F: this rank's hidden units per expert
  int64_t self = 0;                            // this rank's index among the sources: ep index x etp + etp rank
  bool swiglu = false, has_proj_bias = false;  // proj.bias (held by etp rank 0 only)
  bool inert_padding = false;                  // ExpertShard::inert_padding
  int64_t etp_size = 1;
  KSegments kseg;                                         // this rank's K segments (layout mode)
  int64_t layout_segments = 0, tp_size = 1, cp_size = 1;  // ExpertShard's
  Communicator* tp = nullptr;
  Communicator* etp_group = nullptr;  // ExpertShard::etp
  int64_t token_L = 0;                // token segments per source (layout mode), 0: off
  Communicator* partners = nullptr;   // set_layout's: part of a micro-batch's tp ranks per group
  // Blocks per expert of the per-block buffers below: the sources (run mode, quantised), or the
  // micro-batch groups they make (sources / (tp_size x cp_size), token segments under tensor or
  // context parallelism).
  int64_t groups = 1;
  FloatBuffer proj_bias;  // (E, C) etp rank 0's proj bias, for finish_proj
  // Per-source weight gradients (E x sources blocks each; E x groups under layout), sources > 1 only.
  FloatBuffer dfc_w, dfc_b, dproj_w, dproj_b;
  // How each buffer's blocks become the parameter gradient (run: rank order; layout: trees over the
  // step's micro-batches), in the order fc weight, fc bias, proj weight, proj bias; sources > 1.
  int64_t layout_micros = 0;
  std::unique_ptr<ExpertSourceSum> source_sums[4];
  FloatBuffer& block_buffer(int k) { return *std::array<FloatBuffer*, 4>{&dfc_w, &dfc_b, &dproj_w, &dproj_b}[k]; }
  // The state one micro-batch's forward and backward build and use: its index in the step, the
  // quantised blocks, the token-segment leaves, the row shares and gathered rows, the rows in token
  // order (context parallelism); kept here so that steady-state steps do not allocate.
  struct Work {
    int64_t micro = 0;
    Precision::ExpertBlocks qblocks;
    std::vector<int64_t> group_segments;       // quantised under tp: (E x groups + 1) micro-batch blocks
    std::vector<float*> dw_leaves, db_leaves;  // token segments: each leaf's gradients
    // row_share's: every group rank's token rows of each expert (P x E), this rank's first row and the
    // micro-batch's rows per expert (share points at the last two); gathered_wgrad's rows (packed to
    // send with padding, received, then in expert order).
    std::vector<int64_t> share_counts, share_first, share_total;
    bool share_counts_valid = false;  // share_counts are this micro-batch's forward's
    Precision::RowShare share;
    const int64_t* token_rows = nullptr;  // set_token_rows'
    std::vector<float> gathered_send;
    FloatBuffer gathered_recv, gathered_dy, gathered_x;
    // Context parallelism with several sources (layout mode): forward and backward run on the rows
    // of each (expert, micro-batch group) in the micro-batch's token order (cp_order: the expert rows
    // in that order, cp_bounds: the (E x groups x S + 1) boundaries of its S token segments there), in
    // the tok_* buffers, and their outputs go back to the dispatcher's order.
    std::vector<int64_t> cp_order, cp_bounds;
    FloatBuffer tok_in, tok_out, tok_dx;
  };
  Work work;
  std::function<void()> pending_wgrad_;  // delay_wgrad: backward's fc weight gradient, for finish_wgrad
  // Context parallelism with several sources (layout mode): Work's rows in token order are used.
  bool in_token_order(const int64_t* token_segments) const {
    return token_segments && token_L && sources > 1 && cp_size > 1 && !cp_partners;
  }
  // Partners under context parallelism (set_layout): each micro-batch's leaves per (expert, source,
  // token unit), combined over the partners (combine_held_pieces). The leaves' buffer (units x the
  // local experts' gradient) and the combine's scratch are the rank's, shared by its MoE layers
  // (a rank's thread runs their weight gradients one at a time).
  bool cp_partners = false;
  ExpertTpSum tp_sum = ExpertTpSum::on_first;  // set_layout's
  static thread_local FloatBuffer unit_leaves;
  static thread_local std::vector<float*> unit_pieces;
  static thread_local std::vector<float> combine_scratch;
  static thread_local FloatBuffer chunk_recv;  // gathered_wgrad's chunk under ExpertTpSum::slices (likewise the rank's)
  void group_token_order(const ParamStore& ps, const int64_t* token_segments, int64_t rows);
  void forward_rows(const ParamStore& ps, const Arena& arena, float* out, const float* x, const int64_t* offsets,
                    const int64_t* segments);
  void backward_rows(const ParamStore& ps, const Arena& arena, float* dx, const float* dout, const float* x,
                     const int64_t* offsets, const int64_t* segments, const ExpertsScratch& s,
                     const int64_t* token_segments);
  ArenaSlice fc_out, act;  // (R, Fw), (R, F), saved for backward
  // What one backward's weight gradients read.
  struct WgradArgs {
    const ParamStore* ps;
    const Precision::ExpertBlocks* qb;
    const Precision::RowShare* rows_share;
    const int64_t *offsets, *segments, *token_segments;
  };
  void weight_gradients(const WgradArgs& a, int w, int b, FloatBuffer& dw, FloatBuffer& db, const float* dy,
                        const float* in, int64_t nout, int64_t nin, int which);
  bool token_segment_gradients(const WgradArgs& a, int w, int b, FloatBuffer& dw, FloatBuffer& db, const float* dy,
                               const float* in, int64_t nout, int64_t nin);

 private:
  Device* device_ = nullptr;  // ParamStore::device
  const Ops* ops_ = nullptr;  // its ops
};

// P + 1 boundaries 0 = b_0 <= ... <= b_P = E cutting E experts with rows[e] rows each into
// consecutive ranges of about equal cost rows[e] + 16 (an expert's passes that do not scale with
// its rows): b_r is the boundary nearest r / P of the total cost (ties to the later one). A pure
// function of rows, so every rank that has the counts cuts the same ranges (gathered_wgrad).
std::vector<int64_t> balanced_ranges(const std::vector<int64_t>& rows, int64_t P);

}  // namespace lockstep
