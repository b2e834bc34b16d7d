// Context parallelism (Megatron's semantics, Llama-3's all-gather attention) over the cp group.
//
// Each sample's T positions are cut into 2 x cp chunks of T / (2 cp); cp rank r holds chunks r and
// 2 cp - 1 - r (causal load balancing: every rank gets one early and one late chunk, so the causal
// attention work is even). Every module but attention works token by token on the rank's
// B x T / cp rows; positions (learned embedding, RoPE) are the tokens' global positions and the
// causal and document masks compare global positions.
//
// Attention: each rank all-gathers the key and value rows of the group into the whole sequence
// (B, T, 2 NKV HS), then computes its own query rows against every key (kernels/cpu/attention.h
// attention_forward_chunks): a query row sees exactly the keys it sees in one process, in the same
// order, so its output is bitwise the single-process one. Backward: each rank's queries give
// partial dK, dV for every position; a reduce-scatter sums them over the group (rank order) into
// each rank's own rows. The pair is gather_kv / reduce_scatter_dkv, each the other's backward.
//
// The loss is the mean over the micro-batch's tokens: each rank's sum over its rows divided by the
// micro-batch's count, summed over the group with the data-parallel sums (the trainer's dp x cp
// group); parameter gradients are partial sums over the rank's tokens, reduced over dp x cp.
// determinism = "layout" (layout_token_segments): the rank's chunks are whole token segments, and its
// parts of dK, dV and of every weight gradient are combined exactly (reduce_scatter_dkv_pieces,
// combine_token_pieces; docs/design/reductions.md#context-parallel-token-pieces).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "lockstep/kernels/ops.h"
#include "lockstep/tensor/context_chunks.h"
#include "lockstep/tensor/param_table.h"

namespace lockstep {

class Communicator;

// Which rank holds which chunk: chunk_holder, late_chunk (tensor/context_chunks.h).

// Unit g of a micro-batch's 2 P B x sub token units, in token order (sample, chunk c of 2P, sub-unit
// of sub per chunk): chunk c's holder's (chunk_holder) local unit u (local rows: each sample's early
// then late chunk), held by its tp rank u / K (of tp ranks sharing the cp rank's rows; 1: every tp
// rank holds them) as its piece u % K: {the rank in the tp x cp (tp = 1: cp) group, the piece}.
std::pair<int64_t, int64_t> unit_holder(int64_t P, int64_t sub, int64_t K, int64_t tp, int64_t g);

// The two load-balanced chunks of rank r of P ([r, r + 1) and [2P - 1 - r, 2P - r) x T / (2P)).
QueryChunks balanced_chunks(int64_t T, int64_t P, int64_t r);

// Packed documents under context parallelism (data.packing = "thd", run mode, one sample per
// micro-batch): the micro-batch's units, each a document with its padding (the sample's tail padding
// joins the last one), each cut into its own 2 x P chunks so that every rank gets an early and a late
// chunk of every document (Megatron's and Transformer Engine's THD split). Set for each micro-batch
// from its tokens (ContextParallel::set_documents) and shared by every copy of the ContextParallel.
struct DocumentUnits {
  std::vector<int64_t> bounds;  // 0 = b0 < b1 < ... < bk = T; empty: the whole sample, one unit
  std::vector<int64_t> local;   // this rank's local row -> its position in the sample
};

struct ContextParallel {
  Communicator* comm = nullptr;  // the context-parallel group (comm/mesh.h MeshGroup::cp); null: none
  int rank = 0, size = 1;
  // Layout mode under sequence parallelism (or an MoE model under tensor parallelism): the tp x cp
  // group (MeshGroup::tp_cp, tp the faster), whose ranks hold the shares of the sequence_tp
  // parameters' token pieces (combine_token_pieces); null otherwise. sequence_tp: its tp size.
  Communicator* sequence_group = nullptr;
  int sequence_tp = 1;
  // Attention's communication (parallel.cp_comm_type, model/context_attention.h): cp = a2a x ring,
  // cp rank = ring rank x a2a_size + a2a rank. all_gather: ring_size = cp but no ring group.
  std::string comm_type = "all_gather";
  Communicator* a2a = nullptr;   // a2a, a2a+p2p: the all-to-all group (consecutive cp ranks)
  Communicator* ring = nullptr;  // p2p, a2a+p2p: the ring (cp ranks a2a_size apart)
  int a2a_size = 1, a2a_rank = 0, ring_size = 1, ring_rank = 0;

  ContextParallel() = default;
  // tp_cp: the tp x cp group, for the sequence_tp pieces (layout mode, sequence parallelism or an MoE
  // model under tensor parallelism).
  explicit ContextParallel(Communicator* group, Communicator* tp_cp = nullptr);
  // Packed documents (DocumentUnits): from here on the chunks are per unit.
  void cut_documents() { units = std::make_shared<DocumentUnits>(); }
  bool per_document() const { return units != nullptr; }
  // The micro-batch's units from its tokens (T, one sample): a unit ends at each position p, a multiple of
  // pad (which 2 x size divides), that follows an EOD and starts a token that is not EOD.
  void set_documents(const int32_t* tokens, int64_t T, int32_t eod, int64_t pad);
  std::shared_ptr<DocumentUnits> units;
  // The attention's groups: a2a_group (size A) and ring_group (size P) split from the cp group, A x P =
  // size (either may be null for a size of 1).
  void set_comm_type(const std::string& type, Communicator* a2a_group, Communicator* ring_group);
  bool on() const { return size > 1; }
  // Positions per sample a rank holds: T / size.
  int64_t local(int64_t T) const { return T / size; }
  // The two chunks of rank r ([r, r + 1) and [2 size - 1 - r, 2 size - r) x T / (2 size)), of each
  // unit with packed documents, or the whole [0, T) without context parallelism.
  QueryChunks chunks(int64_t T, int r) const { return size == 1 ? QueryChunks{{0, T}} : ring_chunks(T, size, r); }
  QueryChunks chunks(int64_t T) const { return chunks(T, rank); }
  // The same for rank r of a ring of P (P divides size; model/context_attention.h's a2a+p2p).
  QueryChunks ring_chunks(int64_t T, int64_t P, int64_t r) const;
  // The row in the whole micro-batch (b x T + global position) of local row n of B x T / size.
  int64_t global_row(int64_t n, int64_t T) const;
  // The global position of each local row n of B x T / size: (B x T / size).
  void positions(int32_t* pos, int64_t B, int64_t T) const;
  // local (B, T / size) <- this rank's positions of global (B, T).
  void take_local(int32_t* local, const int32_t* global, int64_t B, int64_t T) const;
};

// global (B, T, W) <- every rank's local rows (B, T / size, W), placed at their global positions.
// buf: size x B x T / size x W.
void all_gather_sequence(const Ops& ops, const ContextParallel& cp, float* global, float* buf, const float* local,
                         int64_t B, int64_t T, int64_t W);
// kv (B, T, 2 NKV HS) <- every rank's key and value heads of its local rows of qkv (B, T / size,
// (NH + 2 NKV) HS), placed at their global positions. buf: (size + 1) x B x T / size x 2 NKV HS.
void gather_kv(const Ops& ops, const ContextParallel& cp, float* kv, float* buf, const float* qkv, int64_t B, int64_t T,
               int64_t NH, int64_t NKV, int64_t HS);
// The key and value columns of dqkv (B, T / size, ...) <- the sum over the group, in rank order, of
// each rank's dkv (B, T, 2 NKV HS) at this rank's positions. buf as above.
void reduce_scatter_dkv(const Ops& ops, const ContextParallel& cp, float* dqkv, float* buf, const float* dkv, int64_t B,
                        int64_t T, int64_t NH, int64_t NKV, int64_t HS);
// determinism = "layout" with layout_token_segments: dkv (2, B, T, 2 NKV HS) holds this rank's two
// chunks' trees over their query segments (attention_backward_chunks with query_segments), each a
// subtree of a sample's tree; every rank sends both to each rank's rows (an all-to-all of twice the
// reduce-scatter's blocks) and sums the 2 size chunks' trees along the canonical tree in position
// order: the one-process dK, dV bits. buf: dkv_pieces_buffer floats.
void reduce_scatter_dkv_pieces(const Ops& ops, const ContextParallel& cp, float* dqkv, float* buf, const float* dkv,
                               int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS);
int64_t dkv_pieces_buffer(const ContextParallel& cp, int64_t B, int64_t T, int64_t NKV, int64_t HS);

// determinism = "layout" with layout_token_segments, per micro-batch (the grads-ready hook, before
// the micro-batch's gradients become its leaf of the tree over micro-batches): parameters [first,
// end) hold this rank's 2B token pieces (ParamStore::grad_piece: its two chunks of each sample, each
// the tree over its token segments). Owner per element: rank r sums slice r of the elements (of
// each chunk of at most kCombineChunk), receiving every other rank's pieces of it (one message per
// piece, from the gradients themselves; its own read in place), along the canonical tree over the
// micro-batch's 2 size B pieces in token order (sample, then chunk), and sends the root to cp rank
// 0: the one-process micro-batch gradient, which cp rank 0 keeps while the others hold -0, so the
// dp x cp reduction adds it once, exactly (v + -0 = v). Pieces 1 .. 2B - 1 are zeroed for the next
// range or micro-batch. Wire per call: each rank sends (R - 1) / R of its K pieces of the range (n
// floats each), and each rank but the keepers' its slice of the root to every keeper; scratch
// holds (R - 1) x K x (kCombineChunk / R + 1) floats (K pieces per rank, R ranks in the
// group). Under sequence parallelism the sequence-parallel parameters' pieces are the tp ranks'
// shares of the cp rank's rows (ParamStore::token_units): the ranks of the tp x cp group
// (sequence_group) sum their slices of the micro-batch's size x units of them along the canonical
// tree and send the roots to each tp rank of cp rank 0 (keepers = tp), which keep the sum (the
// replicas every tp rank holds; the others -0). An MoE layer's parameters under tensor parallelism
// are such shares too (ParamStore::sequence_tp); its experts, which every tp rank holds whole and
// their expert data-parallel group adds over tp, are kept by tp rank 0 of cp rank 0 only.
// Parameters the model folds itself (GradRole::Pieces::model_folds) or whose module combines the pieces
// (GradRole::Pieces::module_combines: experts with several sources) are left alone.
inline constexpr int64_t kCombineChunk = int64_t{1} << 18;
void combine_token_pieces(const ContextParallel& cp, ParamStore& ps, int first, int end, std::vector<float>& scratch);
// combine_token_pieces' combine on plain buffers: the canonical tree over the L leaves (token order)
// that the ranks of `group` hold as pieces, K per rank of n floats each (pieces[k]), leaf(g) = {the
// group rank holding leaf g, its piece there}; group rank 0 writes the root to out (not a piece), the
// others -0. The pieces are left as they are. (The MoE experts' partners under context parallelism,
// model/moe/experts.h.)
void combine_held_pieces(const Ops& ops, Communicator& group, float* out, float* const* pieces, int64_t n, int64_t K,
                         int64_t L, const std::function<std::pair<int64_t, int64_t>(int64_t)>& leaf,
                         std::vector<float>& scratch);
// The same for one parameter that gets several token-segment trees per micro-batch (GradRole::Pieces::model_folds:
// one process adds them into the gradient one after another, each the tree over its segments), called
// after each tree: its pieces are combined as above and the sum added into acc (the parameter's
// size; cp rank 0's, the others' untouched), every piece zeroed, piece 0 included. After the last
// tree, finish_folded_pieces makes acc the gradient (cp rank 0; -0 on the others) and zeroes acc: the
// one-process ((0 + tree 1) + tree 2) + ... bit for bit. Wire: one combine per tree.
void fold_token_pieces(const ContextParallel& cp, ParamStore& ps, int i, float* acc, std::vector<float>& scratch);
void finish_folded_pieces(const ContextParallel& cp, ParamStore& ps, int i, float* acc);

// The most context-parallel ranks (config validation keeps parallel.context at or below).
inline constexpr int kMaxContext = 64;

}  // namespace lockstep
