// The numerics the model computes in (precision.* keys), emulated exactly on CPU: which tensors
// are rounded to bf16 and where, and how the GEMMs of the linear layers read their operands.
// docs/precision.md has the same in prose, with the convergence of each mode.
//
// BF16 mixed precision (precision.params = "bf16"), as Megatron Core with Transformer Engine:
//   master weights  the ParamStore's fp32 values; AdamW updates them. Every forward and backward
//                   reads their bf16 copy (ParamStore::weight, round-to-nearest-even, refreshed at
//                   the start of each step): weight matrices, biases, norm weights, embeddings, the
//                   router's weight.
//   activations     rounded to bf16 where a module hands a tensor on (and saves it for backward):
//                   the embedding output; every norm's output; every linear layer's output (qkv,
//                   attention proj, fc, mlp proj, shared expert fc/proj, MTP eh_proj, the experts'
//                   grouped fc/proj), with the residual add the proj fuses (so the residual stream
//                   is bf16); q and k after RoPE; the attention output; the GELU / SwiGLU output;
//                   the MoE layer's output (residual + shared expert + combined experts, rounded
//                   once); the logits of the output head.
//   gradients       the activation gradients at the same boundaries are rounded to bf16: d(logits)
//                   after the loss; every linear layer's input gradient; d(qkv) after attention and
//                   RoPE backward; d(fc) after the activation's backward; the residual stream's
//                   gradient after each norm's backward adds into it; the experts' row gradients
//                   (routing weight times d(output)); the MoE norm output's total gradient.
//   stays fp32      the loss and its softmax (on the bf16 logits), the norms' statistics (mean,
//                   rstd) and arithmetic, the attention softmax and its log-sum-exp, the router
//                   (logits, scores, top-k, aux losses, jitter), routing weights, every GEMM's
//                   accumulation (one fp32 FMA chain), and every parameter gradient: weight
//                   gradients accumulate into the fp32 grad buffer (Megatron's gradient
//                   accumulation fusion), as do norm, bias and embedding gradients.
// With precision.params = "fp32" nothing is rounded and the model is bitwise the fp32 one.
//
// FP8 (precision.fp8) and NVFP4 (precision.fp4), on top of BF16, as Transformer Engine's recipes:
// the three GEMMs of every transformer layer's linear layers (qkv, attention proj, MLP fc and
// proj, shared expert fc and proj) and of every expert (grouped fc and proj, one GEMM per expert)
// read quantised operands (kernels/cpu/quantize.h) through the GEMM's operand decoding (gemm.h):
//   fprop  y  = x  W^T   x: input format, blocks along in;   W: weight format
//   dgrad  dx = dy W     dy: gradient format, along out;     W: weight format, blocks along out
//   wgrad  dW = dy^T x   dy and x: blocks along the tokens (K of this GEMM)
// Input and weight are E4M3, the gradient E5M2 (fp8_format = hybrid) or E4M3 (e4m3); NVFP4 is
// E2M1 throughout. The recipes:
//   delayed     one scale per tensor, (max / amax) / 2^margin with amax from the tensor's history
//               (max over fp8_amax_history_len values, or the most recent); see AmaxHistory.
//   tensorwise  one scale per tensor from its own amax now (current scaling).
//   blockwise   power-of-2 scale per 1x128 block of inputs and gradients, per 128x128 block of
//               weights (DeepSeek-V3).
//   mxfp8       E8M0 scale per 32 elements along K (TE's round-up rule): inputs, gradients and
//               weights each quantised along the K of the GEMM that reads them.
//   nvfp4       E4M3 scale per 16 along K and an FP32 tensor scale; weights in 16x16 blocks; both
//               wgrad inputs through the 16x16 random Hadamard transform along the tokens (zero
//               rows pad each expert to a multiple of 16: they add nothing to dy^T x); gradients
//               stochastically rounded, keyed by (seed, step, tensor, global element index).
// The GEMM output is rounded to bf16 like any linear layer's. Everything else stays as in BF16:
// the router, embedding, output head, attention's QK^T and PV, MTP depths. Under nvfp4 the first
// and last fp4_high_precision_layers transformer layers stay BF16 too. Each expert is its own
// quantised tensor (its own scale and history), as in TE's grouped linear.
//
// Across ranks (set_amax_groups), as Transformer Engine's reduce_amax with Megatron's amax reduction
// group: the amax behind a per-tensor scale (delayed, tensorwise) is the max over every rank that
// holds a piece or a replica of the tensor, so a tensor split by tensor / sequence / context
// parallelism or replicated over data parallelism gets the scale one process would give it:
//   dense tensors    tp x cp x dp (the dense mesh's tp-dp-cp group; pipeline stages hold other
//                    layers)
//   experts          etp x edp (an expert's hidden units are split over etp, its replicas are the
//                    edp ranks; under expert parallelism its tokens already come from the ep group;
//                    with ep x etp < tp x cp the edp ranks include tp x cp ranks of a micro-batch)
// Delayed scaling reduces the micro-batch's staged amax values at end_micro_batch, or the step's at
// end_step (AmaxGroups::per_step), one all-reduce per group for all tensors; tensorwise reduces
// before each quantisation (one all-reduce per linear layer or grouped expert GEMM, every expert's
// value even when it got no tokens, so the ranks' calls pair up). determinism = "layout" scales
// each micro-batch by its own tensors: the trainer leaves the data-parallel replicas out of the
// groups there, except from delayed scaling's once-per-step update (AmaxHistory); an expert x
// expert-tensor group smaller than tp x cp (1, or a divisor of tp) keeps the tp x cp ranks holding
// the same experts, which hold parts of one micro-batch's rows.
// Evaluation's forwards are per rank (ranks may evaluate different batches): they reduce over the
// ranks that share a batch only (tp x cp; experts etp, or those tp x cp ranks). One process, or
// groups of one rank:
// nothing is reduced and the bits are those of the unreduced model.
//
// determinism = "layout" under tensor / expert tensor parallelism: a weight's dimension that the
// layout may split (GradRole::cut: a column-parallel out, a row-parallel in, an expert's hidden
// units) is cut into canonical pieces, each section's slice of each canonical segment, in every
// layout (one process too), and the block recipes (blockwise, mxfp8, nvfp4) quantise every operand
// along such a dimension piece by piece: no scaling block straddles a piece, so none straddles a
// tensor-parallel shard, and each piece is quantised from its own values (into the fp32 values it
// stands for, which the GEMM reads: bitwise what the codes give, gemm.h). NVFP4's tensor scale there
// comes from the amax of the whole tensor (max-reduced over the group: dense tp-cp, experts the
// expert amax group above, per (expert, source) block), and its stochastic rounding keys each element by its index in
// the whole tensor (the global row of a column-parallel shard's out, through its boxes), so a rank's piece draws what
// one process draws. Per-tensor recipes need no pieces: their amax is reduced over the group already. Pieces that are
// multiples of the block leave the recipe's blocks as they were.
//
// Determinism: rounding is elementwise, quantisation is a pure function of the tensor (and of the
// stochastic-rounding key, which holds no thread or rank), max is exact in any order (so the
// reduced amax is the same bits whatever the transport), and the GEMMs keep their guarantee
// (gemm.h), so every mode is bitwise independent of the thread count.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "lockstep/config/config.h"
#include "lockstep/kernels/gemm.h"
#include "lockstep/kernels/quantize.h"

namespace lockstep {

class Communicator;
class Device;
class ParamStore;

// An operand's tokens under layout: cut (boundaries over its tokens, 0 .. n): no block straddles
// one, so a layout's share of whole pieces quantises as one process (a weight gradient's token
// segments, GemmOptions::k_segments; under context parallelism a cp rank's token pieces). first:
// the micro-batch token each piece starts at, of total (NVFP4's stochastic-rounding keys; empty:
// the operand's tokens are the micro-batch's from 0).
struct TokenShare {
  std::span<const int64_t> cut, first;
  int64_t total = 0;
};

// Rounds x (n) to bf16 values in place (round-to-nearest-even, core/dtype.h); serial (callers
// run it on their own part of a parallel loop).
void round_to_bf16(float* x, int64_t n);

// The canonical pieces of K as absolute boundaries (GradRole::cut) from gemm.h's k_segments and
// k_sections (each section's boundaries, offset by the sections before it); empty for none.
std::vector<int64_t> layout_cut(std::span<const int64_t> segments, std::span<const int64_t> sections);

// Delayed scaling's state of one quantised tensor (Transformer Engine's semantics). amax[0] is
// the staging slot: every quantisation of the tensor in a forward-backward pass raises it to the
// tensor's amax, using the current `scale` (a NaN, once staged, stays). After the pass
// (end_micro_batch), the scale becomes (format max / a) / 2^margin with a = max(amax) (algo max)
// or amax[0] (most_recent), kept when a is 0 or not finite; then the history rotates:
// [a0, a1, ..., a(H-1)] -> [0, a2, ..., a(H-1), a0] (the oldest, a1, drops out).
// determinism = "layout" and pipeline parallelism (AmaxGroups::per_step) make the pass a whole
// step: every micro-batch of the step quantises with the scale the step began with, slot 0
// collects the max over all of the step's micro-batches, and end_step reduces it over every rank of
// the step (data-parallel replicas included) and updates once, as Megatron / TE do when the amax
// reduction runs once per step over the data-parallel group. Max is exact, so the step's amax, and
// with it the history, is the same whatever the layout (and the pipeline schedule's order).
struct AmaxHistory {
  std::vector<float> amax;  // (fp8_amax_history_len)
  float scale = 1.0f;
};

class Precision {
 public:
  enum class Recipe : uint8_t { none, delayed, tensorwise, blockwise, mxfp8, nvfp4 };

  Precision() = default;  // fp32
  // Under fp8 / fp4, every weight of a transformer layer's linear layer or experts in ps (by name,
  // layers.<l>.{attn.qkv, attn.proj, mlp.fc, mlp.proj, moe.shared.fc, moe.shared.proj,
  // moe.experts.fc, moe.experts.proj}.weight) gets its GEMM recipe; L: model.num_layers.
  Precision(const PrecisionConfig& pc, const ParamStore& ps, int64_t L);

  // Where amax values are max-reduced (header comment); null or one rank: not reduced. train:
  // training's groups (tp-dp-cp, etp x edp; layout mode: tp-cp, etp); eval: evaluation's (tp-cp,
  // etp). layout (determinism = "layout"): the block recipes quantise in canonical pieces, NVFP4's
  // tensor amax is the whole tensor's (in_pieces, nvfp4_tensor_amax); the trainer sets per_step with
  // it. (In either mode the histories are the same on every rank of a tensor's group.) per_step: delayed scaling
  // updates once per step (AmaxHistory), reducing the step's amax over dense_step / expert_step (tp-dp-cp, etp x edp).
  struct AmaxGroups {
    Communicator* dense = nullptr;
    Communicator* expert = nullptr;
    Communicator* dense_eval = nullptr;
    Communicator* expert_eval = nullptr;
    bool layout = false;
    // Delayed scaling's update once per step (end_step), the staged amax over every micro-batch of
    // the step reduced over these groups: under layout, and under pipeline parallelism, whose
    // schedules run other micro-batches' forwards between a micro-batch's forward and its backward.
    bool per_step = false;
    Communicator* dense_step = nullptr;
    Communicator* expert_step = nullptr;
  };
  void set_amax_groups(const AmaxGroups& g) { groups_ = g; }

  bool bf16() const { return bf16_; }
  // An activation (or activation gradient) handed on at a module boundary: rounded to bf16 in
  // place when activations are bf16.
  void round(float* x, int64_t n) const;
  // The recipe of the GEMMs of weight w (none: bf16 or fp32).
  Recipe recipe(int w) const;

  // Training micro-batches: begin keys stochastic rounding (global micro-batch index `micro` of
  // step `step`) and turns amax recording on; end applies delayed scaling's update, or with
  // AmaxGroups::per_step leaves it to end_step, which every rank calls after the step's last
  // micro-batch.
  // Under pipeline parallelism every forward and backward of a micro-batch begins it again, after
  // select_slot(k): the slot of the micro-batch in flight whose kept operands the GEMMs use.
  void begin_micro_batch(uint64_t seed, int64_t step, int64_t micro);
  void select_slot(int k) { slot_ = k; }
  void end_micro_batch();
  void end_step();
  // Evaluation: quantisation with the current scales, nothing recorded.
  void begin_evaluation() { recording_ = false; }

  // The three GEMMs of a linear layer whose weight is parameter w (out, in) of ps:
  //   fprop  y (N, out) = init + x W^T   (init per opt: bias, or y itself to accumulate)
  //   dgrad  dx (N, in) = dy W            (assigned)
  //   wgrad  dW (out, in) += dy^T x       (fp32, into the grad buffer; in token segments under
  //                                        determinism = "layout" when w is a token sum:
  //                                        ParamStore::token_segments)
  // fprop's and dgrad's outputs are activations (rounded), unless partial: a tensor-parallel
  // rank's part of a sum under determinism = "layout", which the caller rounds once summed (as one
  // process rounds the whole). opt: fprop's init and both GEMMs' canonical segments (k_segments).
  void fprop(const ParamStore& ps, int w, float* y, const float* x, int64_t N, int64_t out, int64_t in,
             const GemmOptions& opt = {}, bool partial = false);
  void dgrad(const ParamStore& ps, int w, float* dx, const float* dy, int64_t N, int64_t out, int64_t in,
             const GemmOptions& opt = {}, bool partial = false);
  void wgrad(const ParamStore& ps, int w, const float* dy, const float* x, int64_t N, int64_t out, int64_t in);

  // determinism = "layout" under expert parallelism (model/moe/experts.h): expert e's rows come in
  // `sources` blocks, block (e, s) = rows [segments[e * sources + s], segments[e * sources + s + 1]),
  // each one micro-batch of source s, whose global index is this rank's micro-batch + (s - self) x
  // micros (the expert-parallel group's micro-batches are its sources' runs of `micros`, in source
  // order). Each block is quantised as one process quantises expert e's rows of that micro-batch:
  // as its own tensor (its own current scale; blocks along its own tokens; stochastic rounding keyed
  // by that micro-batch and the expert's index in the layer), and its GEMMs run on it alone (its
  // weight gradient: FP8 per token segment, grouped_wgrad_segments; NVFP4 grouped_wgrad_blocks).
  // Run mode (determinism = "run") uses blocks for the weight gradient only (grouped_wgrad_blocks
  // with `whole`): fprop and dgrad quantised each expert's rows [whole[e], whole[e + 1]), all
  // sources', as one tensor, and block (e, s)'s wgrad reads its rows of that tensor under per-tensor
  // scaling (delayed, tensorwise: the scale data parallelism's reduced amax gives), or quantises
  // them as their own tensor (blockwise, mxfp8, nvfp4: blocks along the block's own tokens, as the
  // rank that computes its micro-batch alone does); micros = 0 there: every block's stochastic
  // rounding is keyed by this rank's micro-batch.
  struct ExpertBlocks {
    const int64_t* segments = nullptr;  // (E x sources + 1)
    int64_t sources = 1, self = 0, micros = 1;
    const int64_t* whole = nullptr;  // run mode: the experts' offsets (E + 1); else null
  };

  // determinism = "layout", NVFP4, an expert x expert-tensor group of G dividing tp (1: the experts
  // on every tp rank; model/moe/experts.h): the group holds the rows of G of a micro-batch's tp ranks,
  // the partner groups the others', so expert e's rows here (with G > 1 the group's one block per
  // expert) are rows [first[e], first[e] + n_e) of the micro-batch's total[e] rows of e (the tp
  // ranks' rows in rank order: token order, as one process orders them). Their NVFP4 operands are
  // quantised as those parts of the one-process tensors: every expert's amax max-reduced over the
  // expert amax group (the tp ranks holding the same experts: this group, with its etp ranks) in one
  // all-reduce per grouped GEMM (each rank gives every expert's, rows or none, so the calls pair
  // up), the gradient's stochastic rounding keyed at its rows' indices in the whole (a padding row,
  // zero, rounds to zero at whatever index). The weight gradients need the whole tensors:
  // grouped_wgrad_gathered.
  struct RowShare {
    const int64_t* first = nullptr;  // (E)
    const int64_t* total = nullptr;  // (E)
  };

  // The same per expert e over its rows [offsets[e], offsets[e+1]) (kernels/cpu/grouped_gemm.h):
  // weight w (E, out, in), bias b (E, out) or -1; y (R, out), x (R, in). With blocks (quantised
  // recipes only), per (expert, source) block. seg (determinism = "layout"): K (fprop's in, dgrad's
  // out: an expert's hidden units) cut into canonical segments (grouped_gemm.h
  // grouped_gemm_segmented; quantised: the same cut as gemm's k_segments per expert or block);
  // partial: an expert-tensor-parallel rank's part of the sum, without the bias and not rounded (the
  // caller adds and rounds after the group's sum).
  // share: the rows are parts of the micro-batch's (RowShare; NVFP4 only).
  void grouped_fprop(const ParamStore& ps, int w, int b, float* y, const float* x, const int64_t* offsets, int64_t E,
                     int64_t out, int64_t in, const ExpertBlocks* blocks = nullptr, const KSegments& seg = {},
                     bool partial = false, const RowShare* share = nullptr);
  void grouped_dgrad(const ParamStore& ps, int w, float* dx, const float* dy, const int64_t* offsets, int64_t E,
                     int64_t out, int64_t in, const ExpertBlocks* blocks = nullptr, const KSegments& seg = {},
                     bool partial = false, const RowShare* share = nullptr);
  void grouped_wgrad(const ParamStore& ps, int w, int b, const float* dy, const float* x, const int64_t* offsets,
                     int64_t E, int64_t out, int64_t in);
  // NVFP4 under a RowShare: the weight gradients of weight w's experts [e0, e1) from all of the
  // micro-batch's rows of each, gathered here (expert e0 + i's rows [offsets[i], offsets[i + 1]) of dy
  // and x, in the one-process order), each the whole tensor one process transforms and quantises,
  // assigned to expert e's dw (E, out, in) and db (E, out) or null. The amax of each operand is its
  // own rows', max-reduced over etp only (the expert-tensor ranks' slices of the hidden units, which
  // gather the same experts' rows; null: none).
  void grouped_wgrad_gathered(int w, float* dw, float* db, const float* dy, const float* x, const int64_t* offsets,
                              int64_t e0, int64_t e1, int64_t out, int64_t in, Communicator* etp);
  // The weight gradient per block (quantised recipes): dw (E x sources, out, in) and db (E x
  // sources, out) or null, block (e, s) += dy^T x and the column sums of dy over its rows.
  void grouped_wgrad_blocks(int w, float* dw, float* db, const float* dy, const float* x, const ExpertBlocks& blocks,
                            int64_t E, int64_t out, int64_t in);
  // determinism = "layout" (FP8 recipes; model/moe/experts.h): leaf g's weight gradient dw[g] (out,
  // in) assigned, the canonical tree over its `per` token segments of the quantised dy^T x, each
  // segment a chain from zero (gemm.h k_segments); rows: (leaves x per + 1) boundaries, leaf g's
  // segments g x per .. (g + 1) x per - 1, as token_segment_wgrad's. The leaves are the E experts'
  // in order, leaves / E each: with blocks, expert e's block s holds leaves / (E sources) of them in
  // order (usually one: leaf e x sources + s; the partners' token units under context parallelism
  // several, each from its first row of the block; its rows quantised as the block, ExpertBlocks);
  // without, leaf g is part g mod (leaves / E) of expert
  // g / (leaves / E)'s rows [offsets[e], offsets[e + 1]) (context parallelism's token pieces), which
  // fprop and dgrad quantised as one tensor. Block recipes quantise along the tokens segment by
  // segment, per-tensor recipes read the kept operands: no quantisation straddles a token segment,
  // so a tensor-parallel rank's leaf of whole segments is what one process computes of them.
  void grouped_wgrad_segments(int w, float* const* dw, const float* dy, const float* x, const int64_t* rows,
                              int64_t leaves, int64_t per, const ExpertBlocks* blocks, const int64_t* offsets,
                              int64_t E, int64_t out, int64_t in);

  // Delayed scaling's state, one entry per quantised tensor, named
  // "<weight name>[.<expert>].{input,weight,grad}" with the expert's index in the layer
  // (checkpoints, tests). Empty unless delayed. expert: the tensor is an expert's (replicated over
  // etp x edp, not tp x dp x cp).
  struct NamedHistory {
    std::string global_name;
    bool expert;
    AmaxHistory* history;
  };
  std::vector<NamedHistory> amax_histories();

 private:
  // The device of the store the recipe was made for (none for plain fp32, which computes through
  // the store passed to each call).
  Device* device_ = nullptr;
  enum Role : int { input = 0, weight = 1, grad = 2 };
  struct Site {               // one quantised GEMM weight (one expert's)
    std::string global_name;  // the weight's name, with the expert's index in the layer
    uint64_t global_key = 0;  // the SR key: purpose_id(global_name), the same on every layout
    bool expert = false;      // reduced over the expert group
    bool unused = false;      // past the experts of a tensor whose boxes cut them (never quantised, not saved)
    AmaxHistory state[3];
    // determinism = "layout": the canonical pieces of out / in (GradRole::cut; local boundaries,
    // empty: one piece), the global index of each local out row (empty: its own), global out.
    std::vector<int64_t> cut_out, cut_in, out_global;
    int64_t out_len = 0;
    // determinism = "layout", a dense weight: whether every rank of the dense group (tp x cp) holds
    // role r's operands whole (input: tokens x in, weight: out x in, grad: tokens x out), so that
    // NVFP4's tensor amax needs no reduction. The tokens are split by context parallelism's pieces
    // (which layout mode requires under cp > 1) and for a tp rank's share of the rows (a
    // sequence-parallel parameter); out and in by the weight's shard.
    bool whole[3] = {};
    std::vector<float> wf;  // the weight's values quantised in pieces, kept for dgrad (as w)
    float now[3] = {};      // tensorwise, NVFP4 under a RowShare: the reduced amax of each role's latest operand
    // Operands kept from fprop for the backward of the same micro-batch, as TE saves its FP8
    // tensors: the weight when one quantisation serves both of its GEMMs (every recipe but mxfp8),
    // and under per-tensor scaling the input (for wgrad) and the gradient (dgrad, for wgrad). The
    // input is kept per pipeline slot (select_slot): a micro-batch's backward may come after other
    // micro-batches' forwards. The weight and the gradient need no slots: the gradient's dgrad and
    // wgrad run in one backward, and every fprop of a step quantises the weight to the same codes
    // (its values change between steps only, and so do its scales where the forwards of several
    // micro-batches come between a fprop and its dgrad: AmaxGroups::per_step).
    QuantizedTensor w, dy;
    std::vector<QuantizedTensor> block_dy;              // the same per source block (ExpertBlocks)
    std::vector<QuantizedTensor> x;                     // per slot
    std::vector<std::vector<QuantizedTensor>> block_x;  // per slot, per source block
  };
  // x (rows, cols) quantised as role r of site `site` into q, for a GEMM that reads op(x) (t) with
  // its K along x's columns (k_along_cols) or rows; a recipe that blocks only along rows quantises
  // the transpose (in `scratch`) and flips t. usage tells apart the draws of stochastic rounding.
  // rd / cd: what x's rows and columns are (tokens, or the weight's out or in dimension). A site with
  // canonical pieces (in_pieces) quantises them one by one into `scratch`, the fp32 values the
  // operand stands for, which the GEMM reads. tokens (the block recipes under layout): what the
  // tokens dimension is of the micro-batch's, cut into pieces too.
  enum class Dim : uint8_t { tokens, out, in };
  GemmOperand quantise(QuantizedTensor& q, std::vector<float>& scratch, const float* x, int64_t rows, int64_t cols,
                       Trans t, bool k_along_cols, Role r, int64_t site, uint64_t usage, Dim rd, Dim cd,
                       const TokenShare& tokens = {});
  GemmOperand quantise_pieces(std::vector<float>& dst, const float* x, int64_t rows, int64_t cols, Trans t,
                              bool k_along_cols, Role r, int64_t site, uint64_t usage, Dim rd, Dim cd,
                              const TokenShare& tokens = {});
  bool in_pieces(const Site& s) const;
  // NVFP4 under layout: the amax of x (n values, role r's operand), max-reduced over the site's group
  // (the whole tensor's); null otherwise (the quantiser takes x's own). nvfp4_amax_ says where it
  // comes from instead: already reduced into Site::now (a RowShare's grouped GEMM), or x's own rows
  // as the whole tensor's, reduced over gathered_group_ only (grouped_wgrad_gathered).
  // A dense operand that every rank of the group holds whole (Site::whole) is its own reduced amax.
  const float* nvfp4_tensor_amax(float& a, const float* x, int64_t n, const Site& s, Role r);
  enum class Nvfp4Amax : uint8_t { reduce, staged, gathered };
  Nvfp4Amax nvfp4_amax_ = Nvfp4Amax::reduce;
  Communicator* gathered_group_ = nullptr;
  // nvfp4_amax_ (and gathered_group_) for a scope; back to reduce at its end.
  struct Nvfp4AmaxScope {
    Nvfp4AmaxScope(Precision& p, Nvfp4Amax mode, Communicator* group = nullptr) : p(p) {
      p.nvfp4_amax_ = mode;
      p.gathered_group_ = group;
    }
    ~Nvfp4AmaxScope() {
      p.nvfp4_amax_ = Nvfp4Amax::reduce;
      p.gathered_group_ = nullptr;
    }
    Nvfp4AmaxScope(const Nvfp4AmaxScope&) = delete;
    Nvfp4AmaxScope& operator=(const Nvfp4AmaxScope&) = delete;
    Precision& p;
  };
  // NVFP4's stochastic rounding of a gradient (usage tells apart its quantisations); element (r, c)
  // of a piece at global (grow, gcol) of a (grows, gcols) tensor draws index micro x grows x gcols +
  // (grow + r) x gcols + gcol + c.
  StochasticRounding nvfp4_rounding(int64_t site, uint64_t usage, int64_t grows, int64_t gcols, int64_t grow,
                                    int64_t gcol) const;
  bool per_tensor() const;  // delayed or tensorwise: one scale per tensor
  // Tensorwise: Site::now of each (site, role) = amax of its operand x (n values), max-reduced over
  // the sites' group in one all-reduce (all sites of one weight: the same group).
  struct AmaxOf {
    int64_t site;
    Role r;
    const float* x;
    int64_t n;
  };
  // Returns the reduced values too (in the order of `of`).
  std::vector<float> current_amaxes(const std::vector<AmaxOf>& of);
  // Whether a grouped GEMM on weight w takes its NVFP4 amaxes as tensorwise does (current_amaxes,
  // every expert's at once; RowShare), read from Site::now under Nvfp4Amax::staged.
  bool row_share_amaxes(const RowShare* share, const ExpertBlocks* blocks, int w) const;
  // The operand of role r (input or grad) kept for wgrad: the site's, or source block blk's.
  QuantizedTensor& kept(Site& s, Role r, int64_t blk);
  void reduce_amax(float* a, int64_t n, bool expert);
  // Delayed scaling: every history's staged amax, max-reduced over dense / expert, becomes its
  // scale's source; the histories rotate (AmaxHistory).
  void update_histories(Communicator* dense, Communicator* expert);
  // blk: the source block being computed (ExpertBlocks), -1 for none.
  void gemm_fprop(int64_t site, const float* w, float* y, int64_t ldy, const float* x, int64_t N, int64_t out,
                  int64_t in, const GemmOptions& opt, int64_t blk = -1);
  // tokens: dy's rows as the micro-batch's tokens (NVFP4 under context parallelism).
  void gemm_dgrad(int64_t site, const float* w, float* dx, const float* dy, int64_t N, int64_t out, int64_t in,
                  const GemmOptions& opt, int64_t blk = -1, const TokenShare& tokens = {});
  // row0: under per-tensor scaling, the operands are rows [row0, row0 + N) of the kept tensors.
  // accumulate: dw += the product (else dw = it).
  void gemm_wgrad(int64_t site, float* dw, const float* dy, const float* x, int64_t N, int64_t out, int64_t in,
                  std::span<const int64_t> k_segments = {}, int64_t blk = -1, int64_t row0 = 0, bool accumulate = true);
  // NVFP4's weight gradient: the N rows transformed (random Hadamard along the tokens), quantised
  // (tokens: as the micro-batch's; one tensor amax) and multiplied once per output of dw, each of
  // the next N / dw.size() rows (context parallelism's token pieces), in k_segments.
  void gemm_wgrad_nvfp4(int64_t site, std::span<float* const> dw, const float* dy, const float* x, int64_t N,
                        int64_t out, int64_t in, std::span<const int64_t> k_segments, const TokenShare& tokens = {});
  // NVFP4 in layout mode on a share of the micro-batch's tokens: parameter w's N rows as the rank's
  // token pieces (context parallelism) or as a tp rank's rows of a sequence-parallel parameter (the
  // MoE shared expert), into piece_cut_ / piece_first_; an empty share otherwise.
  TokenShare piece_tokens(const ParamStore& ps, int w, int64_t N);
  std::vector<int64_t> piece_cut_, piece_first_;
  std::vector<float*> piece_grads_;  // the pieces' gradients of the NVFP4 weight gradient (scratch)
  // Runs f(e, s, r0, rows) for every non-empty block (e, s) of `blocks` (or every expert of offsets
  // when null: s = -1), with stochastic rounding keyed by the block's micro-batch.
  template <typename F>
  void for_each_block(const int64_t* offsets, const ExpertBlocks* blocks, int64_t E, F f);

  bool bf16_ = false;
  Recipe recipe_ = Recipe::none;
  ElemFormat fwd_ = ElemFormat::e4m3, bwd_ = ElemFormat::e5m2;
  int64_t history_len_ = 1;
  bool most_recent_ = false;
  int margin_ = 0;
  std::vector<int64_t> first_site_;  // per parameter: its first site, -1 when not quantised
  std::vector<Site> sites_;
  bool recording_ = false;
  AmaxGroups groups_;
  uint64_t seed_ = 0;
  int64_t step_ = 0, micro_ = 0;
  int slot_ = 0;
  // Scratch reused across calls: quantised operands, transposed and Hadamard-transformed copies.
  QuantizedTensor qa_, qb_;
  std::vector<float> ta_, tb_, ha_, hb_;
};

}  // namespace lockstep
