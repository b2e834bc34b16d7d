// The flat parameter table: every parameter of the model declared once (name, shape, init, weight
// decay), laid out in declaration order in one contiguous fp32 buffer; gradients mirror it in a
// second buffer. The table drives allocation, init, the optimizer, fingerprints, and later
// checkpoints and data-parallel buckets.
//
// A rank may hold only part of a parameter (tensor parallelism: a column- or row-parallel slice of
// a weight, a vocabulary range of the embedding). The spec then names the global tensor
// (global_shape) and the boxes of it this rank stores: the local tensor is the boxes' row-major
// flattenings back to back (one box, except a fused projection whose sections are split
// separately, e.g. QKV's [Q | K | V] rows: rank r holds its slice of each). Checkpoints save and
// reshard by those boxes.
//
// Init is a pure function of (seed, parameter name, GLOBAL element index): element g of the global
// tensor is Philox(seed, purpose "init/<name>").normal(g) * std, so a rank holding boxes draws
// exactly the values the whole tensor has there (tensor parallelism initialises the weights a
// single process does). Adding, removing or reordering other parameters changes nothing about p.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/core/state_shard.h"
#include "lockstep/core/tensor.h"
#include "lockstep/tensor/context_chunks.h"

namespace lockstep {

class Device;
class Precision;

enum class Init : uint8_t { normal, zeros, ones };

// A box of a global tensor: its corner (one entry per dimension) and its shape.
struct ParamBox {
  std::vector<int64_t> offset;
  Shape shape;
};

// A parameter's role in the gradient reductions: how its gradient is summed across ranks, token
// pieces and stages, and how the gradient norm and checkpoints count it. The module that owns the
// parameter sets it once, when the parallel plan is applied (ParamStore::set_*); the reduction code
// (parallel/, parallel/reduction/, tensor/precision.h) reads it and the layers never test the
// determinism mode themselves. The mechanisms are in docs/design/reductions.md.
struct GradRole {
  // Every tensor-parallel rank holds the same values (norms, position embeddings, biases of
  // row-parallel layers): the gradient norm counts them once.
  bool tp_replicated = true;
  // Replicated, but each tensor-parallel rank computes its gradient from its own sequence shard
  // (sequence parallelism: norms): the gradients are summed over the tensor-parallel group.
  bool sequence_parallel = false;
  // Pipeline parallelism: the last stage's copy of a parameter the first stage owns (the word
  // embedding of a tied output head or of the MTP depths; under determinism = "layout" one stage
  // holds both, add_copy): its gradient is summed with the owner's before the update, so both stay
  // equal; the gradient norm and checkpoints count the owner's only.
  bool stage_copy = false;
  // Its gradient is a sum over the micro-batch's tokens that a layout may split over the
  // tensor-parallel ranks (sequence_parallel in some layout): every norm, an MoE layer's router and
  // shared expert, MTP's eh_proj. Under determinism = "layout" it is computed in token segments
  // (ParamStore::token_segments) in every layout, one process included.
  bool token_sum = false;
  // Who combines context parallelism's token pieces of its gradient (ParamStore::pieced):
  //   combined:        combine_token_pieces (parallel/context_parallel.h), after the backward;
  //   model_folds:     several token-segment trees per micro-batch (the output head's weight and the
  //                    MTP depths' embedding copies: one tree per head or depth), which the model
  //                    folds in one by one (fold_token_pieces);
  //   module_combines: the module combines them itself (the MoE experts when several ranks' rows
  //                    reach them, model/moe/experts.h).
  enum class Pieces : uint8_t { combined, model_folds, module_combines };
  Pieces pieces = Pieces::combined;
  // determinism = "layout": the dimension of a weight that tensor (or expert tensor) parallelism
  // splits (a column-parallel weight's out, dim 0, or an expert fc's, dim 1; a row-parallel one's in,
  // the last dim) and this rank's canonical pieces of it: local boundaries 0 = b0 < ... = width,
  // each section's slice cut into its canonical segments (TensorParallel::k_segments). Low-precision
  // scaling blocks stay inside a piece (tensor/precision.h). -1 / empty: none.
  int cut_dim = -1;
  std::vector<int64_t> cut = {};
};

struct ParamSpec {
  std::string name;  // "layers.0.attn.qkv.weight"
  Shape shape;
  Init init;
  float std;                    // Init::normal only
  bool decay;                   // weight decay applies (weight matrices, not biases or norms)
  int64_t offset;               // in floats, into the flat buffers
  bool expert;                  // an MoE expert's: data parallelism reduces it over the expert data-parallel group
  Shape global_shape;           // the whole tensor (= shape unless this rank holds a part)
  std::vector<ParamBox> boxes;  // what this rank holds of it, in local storage order
  GradRole role;                // how its gradient is reduced and counted
  bool partial() const { return !(shape == global_shape); }
};

// Elements [begin, end) of parameter `param`, counted in the parameter's flattened (row-major)
// elements: a rank's share of a parameter under the distributed optimizer (Megatron's "flattened
// range").
struct ParamRange {
  int param;
  int64_t begin, end;
};

class ParamStore {
 public:
  ParamStore();
  ~ParamStore();
  ParamStore(ParamStore&&) noexcept;
  ParamStore& operator=(ParamStore&&) noexcept;
  // Declares a parameter; returns its index. Only before allocate().
  int add(std::string name, Shape shape, Init init, float std = 0.0f, bool decay = false, bool expert = false);
  // Declares this rank's part of the global tensor global_shape: the boxes, back to back (local
  // shape: the first box's shape with dimension 0 summed over the boxes; the boxes must agree on
  // the other dimensions). The part is tensor-parallel (not tp_replicated). expert: as add()'s (an
  // expert-parallel rank's experts are one box along dimension 0).
  int add_part(std::string name, Shape global_shape, std::vector<ParamBox> boxes, Init init, float std = 0.0f,
               bool decay = false, bool expert = false);
  // Marks parameter i as sequence-parallel (GradRole::sequence_parallel).
  void set_sequence_parallel(int i) { specs_[static_cast<size_t>(i)].role.sequence_parallel = true; }
  // Marks parameter i as a sum over tokens (GradRole::token_sum).
  void set_token_sum(int i) { specs_[static_cast<size_t>(i)].role.token_sum = true; }
  // Marks parameter i's pieces as folded by the model (GradRole::Pieces::model_folds).
  void set_folded(int i) { specs_[static_cast<size_t>(i)].role.pieces = GradRole::Pieces::model_folds; }
  // Marks parameter i's pieces as combined by its module (GradRole::Pieces::module_combines).
  void set_module_pieces(int i) { specs_[static_cast<size_t>(i)].role.pieces = GradRole::Pieces::module_combines; }
  // determinism = "layout": S canonical segments (TensorParallel::segments; 0 under "run") over a
  // tensor-parallel group of tp ranks, this rank tp_rank.
  void set_layout_segments(int64_t S, int tp, int tp_rank) {
    layout_segments_ = S;
    tp_size_ = tp;
    tp_rank_ = tp_rank;
  }
  // Layout mode, not pieced: the first of the micro-batch's tokens that parameter i's rows are
  // (a sequence-parallel parameter's are the tp rank's N / tp: tp_rank x rows; 0 otherwise), and
  // how many the micro-batch has.
  int64_t rows_token(int i, int64_t rows) const { return tp_share(i) ? tp_rank_ * rows : 0; }
  int64_t rows_tokens(int i, int64_t rows) const { return tp_share(i) ? tp_size_ * rows : rows; }
  // The token segments parameter i's gradient is computed in over this rank's rows of a
  // micro-batch (core/tree_sum.h canonical_segments; each segment from zero, summed along the
  // canonical tree): 0 (one chain: "run", or not a token sum), S over all N tokens, or S / tp over
  // the N / tp rows of a sequence-parallel parameter, which its tp group then sums with
  // ReduceOp::tree_sum (the one-process tree over S segments).
  int64_t token_segments(int i) const {
    const ParamSpec& p = specs_[static_cast<size_t>(i)];
    if (!layout_segments_ || !p.role.token_sum) return 0;
    if (pieced()) return layout_segments_ / cp_size_ / token_units(i);
    return p.role.sequence_parallel ? layout_segments_ / tp_size_ : layout_segments_;
  }
  // Context parallelism under determinism = "layout" (layout_token_segments): a cp rank's rows are
  // `pieces` blocks of consecutive rows (its two chunks of every sample), each a subtree of the
  // micro-batch's canonical tree over the token segments. Every token-sum gradient is then computed
  // per piece (token_segments(i) segments each) into grad_piece(i, k), and the group combines the
  // pieces (parallel/context_parallel.h combine_token_pieces). Under sequence parallelism, and in an
  // MoE model under tensor parallelism (sequence_tp: the tp size splitting a cp rank's rows; 1
  // otherwise), a sequence_tp(i) parameter's rows are a tp rank's share: the cp rank's rows cut into
  // max(pieces, sequence_tp) units, a subtree each, of which every tp rank holds its consecutive
  // token_pieces(i) (the tp x cp group combines them). cp_rank, sample_tokens: the rank and the
  // tokens of a whole sample, for piece_token. Before allocate().
  void set_token_pieces(int64_t pieces, int cp, int cp_rank, int64_t sample_tokens, int sequence_tp) {
    pieces_ = pieces;
    cp_size_ = cp;
    cp_rank_ = cp_rank;
    sample_tokens_ = sample_tokens;
    sequence_tp_ = sequence_tp;
  }
  // Pieced: the micro-batch token (sample b x its tokens + position) that the cp rank's piece k
  // starts at (piece 2b: sample b's early chunk, cp_rank; 2b + 1: its late one, 2 cp - 1 - cp_rank),
  // and the micro-batch's tokens.
  int64_t piece_token(int64_t k) const {
    const int64_t chunk = k % 2 == 0 ? cp_rank_ : late_chunk(cp_size_, cp_rank_);
    return k / 2 * sample_tokens_ + chunk * chunk_tokens(cp_size_, sample_tokens_);
  }
  // Pieced: the micro-batch token that parameter i's piece k starts at (piece_token(k), or for a tp
  // rank's share its unit tp_rank x token_pieces(i) + k of the cp rank's token_units(i)).
  int64_t unit_token(int i, int64_t k) const {
    if (!sequence_tp(i)) return piece_token(k);
    const int64_t U = token_units(i), sub = U / pieces_, u = tp_rank_ * token_pieces(i) + k;
    return piece_token(u / sub) + u % sub * (chunk_tokens(cp_size_, sample_tokens_) / sub);
  }
  int64_t micro_batch_tokens() const { return pieces_ / 2 * sample_tokens_; }
  bool pieced() const { return pieces_ > 1; }
  // The pieces of a cp rank's rows (set_token_pieces' pieces: its two chunks of every sample).
  int64_t chunk_pieces() const { return pieces_; }
  // Parameter i's pieces of the rank's rows (1 when not pieced): N rows make pieces of N / that.
  int64_t token_pieces(int i) const { return token_units(i) / (sequence_tp(i) ? sequence_tp_ : 1); }
  // Pieced: the units a cp rank's rows are cut into for parameter i's gradient (its tp ranks' pieces).
  int64_t token_units(int i) const { return sequence_tp(i) ? std::max<int64_t>(pieces_, sequence_tp_) : pieces_; }
  // Pieced: whether parameter i's pieces are a tp rank's share of the cp rank's rows: a sequence-parallel
  // parameter's, or under tensor parallelism an MoE expert's that every tp rank holds whole and feeds
  // its own share of the rows (expert and expert tensor parallelism 1: split experts combine their
  // pieces themselves, GradRole::Pieces::module_combines, model/moe/experts.h).
  bool sequence_tp(int i) const {
    const ParamSpec& p = specs_[static_cast<size_t>(i)];
    return sequence_tp_ > 1 &&
           (p.role.sequence_parallel || (p.expert && p.role.pieces != GradRole::Pieces::module_combines));
  }
  // Piece k's gradient of parameter i (piece 0 is grad(i)). Pieces 1 .. are live only while the
  // backward of parameter i's window runs (set_piece_windows): each is a window-sized buffer that
  // the combine leaves zeroed for the next window.
  float* grad_piece(int i, int64_t k) const {
    return k == 0 ? grad(i) : pieces_grads_[static_cast<size_t>(k - 1)].data() + specs_[i].offset - piece_base_[i];
  }
  // Pieced: the runs of parameters [first, end), covering the table in order, whose pieces are
  // combined together before the next run's gradients are computed (the model's grads-ready ranges:
  // the head, each layer, the embedding), so pieces 1 .. need only the largest run's size. Without
  // it, one window: the whole table. Before allocate().
  void set_piece_windows(const std::vector<std::pair<int, int>>& runs);
  // Sets parameter i's canonical pieces (GradRole::cut_dim, cut).
  void set_layout_cut(int i, int dim, std::vector<int64_t> bounds) {
    specs_[static_cast<size_t>(i)].role.cut_dim = dim;
    specs_[static_cast<size_t>(i)].role.cut = std::move(bounds);
  }
  // Marks parameter i as a pipeline stage's copy (GradRole::stage_copy).
  void set_stage_copy(int i) { specs_[static_cast<size_t>(i)].role.stage_copy = true; }
  // Declares a stage copy of parameter `owner` in the same table (the one parameter whose name
  // appears twice: find() names the owner): its name, shapes, boxes and init, so it draws the
  // owner's values. Only before allocate().
  int add_copy(int owner);
  // Allocates the value and gradient buffers (zeroed).
  void allocate();
  // Draws every parameter from its Philox stream (in parallel over the current thread pool).
  void init(uint64_t seed);
  void zero_grads();

  const std::vector<ParamSpec>& specs() const { return specs_; }
  int64_t total() const { return total_; }
  float* value(int i) const { return values_.data() + specs_[i].offset; }
  float* grad(int i) const { return grads_.data() + specs_[i].offset; }
  float* values() const { return values_.data(); }
  float* grads() const { return grads_.data(); }
  int find(const std::string& name) const;  // -1 when absent
  // For checkpoints (core/state_shard.h): elements [begin, end) of parameter i's local storage (its
  // boxes back to back), held at data, as pieces of the global tensor `name`: one per box they
  // meet, each a flat range of its box. writer: this rank writes them if it is the first replica:
  // dp_first for dense parameters (edp_first, of the expert data-parallel group, for MoE experts'),
  // and also tp_first for those every tensor-parallel rank holds whole (tp_replicated).
  void shards_of(std::vector<StateShard>& out, int i, const std::string& name, int64_t begin, int64_t end, void* data,
                 bool dp_first, bool tp_first, bool edp_first, DType dtype = DType::f32) const;
  // Every parameter, whole, as "param/<name>" (shards_of).
  void state_shards(std::vector<StateShard>& out, bool dp_first, bool tp_first, bool edp_first) const;

  // Mixed precision (tensor/precision.h). With bf16 weights on, weight(i) is the bf16 rounding of
  // value(i), the copy forward and backward read, refreshed from the fp32 master values by
  // sync_weights() (parameters [first, end) of the table); otherwise weight(i) is value(i).
  void use_bf16_weights();
  void sync_weights(int first, int end);
  const float* weight(int i) const { return (weights_.size() ? weights_.data() : values_.data()) + specs_[i].offset; }
  // The device the buffers live on and the modules run their ops on (kernels/device.h): the model's
  // (set by its owner, which outlives this store, before allocate()), or with none a CPU device of
  // the store's own, for modules used without a model.
  void set_device(Device* d) { device_ = d; }
  Device& device() const;
  // The numerics the modules compute in: the model's Precision (set by its owner, which outlives
  // this store), or plain fp32 when none is set.
  // Modules call its GEMMs through a const store: the scaling state they update is the model's.
  void set_precision(Precision* p) { precision_ = p; }
  Precision& precision() const;

 private:
  std::vector<ParamSpec> specs_;
  int64_t total_ = 0;
  FloatBuffer values_, grads_;
  FloatBuffer weights_;  // bf16 compute copy; empty without bf16 weights
  Precision* precision_ = nullptr;
  Device* device_ = nullptr;
  mutable std::unique_ptr<Device> own_device_;
  int64_t layout_segments_ = 0;
  int tp_size_ = 1, tp_rank_ = 0;
  // Not pieced: whether parameter i's rows are a tp rank's N / tp of the micro-batch (sequence_tp(i)
  // is the pieced counterpart: a tp rank's share of a cp rank's rows).
  bool tp_share(int i) const { return tp_size_ > 1 && specs_[static_cast<size_t>(i)].role.sequence_parallel; }
  int64_t pieces_ = 1;
  int cp_size_ = 1, cp_rank_ = 0, sequence_tp_ = 1;
  int64_t sample_tokens_ = 0;
  std::vector<FloatBuffer> pieces_grads_;  // pieces 1 .. pieces_ - 1, window_ floats each
  std::vector<int64_t> piece_base_;        // per parameter: its window's first offset
  int64_t window_ = -1;                    // -1: one window, the whole table
};

}  // namespace lockstep
