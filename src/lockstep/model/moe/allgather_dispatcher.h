// The all-gather token dispatcher of expert parallelism (moe.token_dispatcher = "allgather",
// Megatron's default).
//
// The S ranks of the expert-parallel group each hold E / S experts and route their own N tokens.
// Per micro-batch:
//
//   plan:      all-gather of the routing (choices and capacity decisions, N x K each) over the
//              group; the rows of every local expert are the choices of the S x N gathered tokens
//              that picked it: expert-major, source order inside an expert, token order inside a
//              source (padded to capacity per source with moe.pad_expert_input_to_capacity)
//   dispatch:  all-gather of the tokens (N x C), permute into those rows
//   experts:   grouped GEMM over the local experts (experts.h)
//   combine:   all-gather of the routing probabilities; each rank sums, per gathered token, probs x
//              output over the choices its experts hold (k order); reduce-scatter over the group
//              (rank-order sum) brings each token's sum back to its rank, added to the residual
//   backward:  all-gather of d(output); expert-row gradients and d(probs) here; reduce-scatters of
//              d(probs) (one non-zero contribution per choice: exact) and of d(input)
//
// Capacity is computed per source rank from its own micro-batch (as the all-to-all dispatcher does
// and Megatron does), so the same choices are dropped as without expert parallelism.
//
// Determinism: the expert rows are bitwise the single-rank ones (one grouped-GEMM row each), and
// the reductions are rank-order sums (comm/communicator.h), so a run is bitwise reproducible. The
// combine, though, adds a token's K weighted outputs in two levels (per rank, then over ranks, then
// to the residual) where the single process adds them to the residual one by one: the output
// differs from the single-process one by rounding (a few ulp). The all-to-all dispatcher combines
// on the source rank in the single-process order and has no such difference.
//
// With set_layout_invariant() (determinism = "layout") the combine and the dispatch backward
// reduce-scatter each choice's row instead ((S N, K, C), the rows of choices held elsewhere filled
// with -0, which adds exactly: x + -0 = x for every x) and the source rank adds its tokens' K rows
// in k order like the local dispatcher; d(probs) fills those entries with -0 too. K times the bytes
// of those two reduce-scatters, and the single-process bits.
#pragma once

#include <cstdint>
#include <vector>

#include "lockstep/core/tensor.h"
#include "lockstep/model/moe/dispatcher.h"

namespace lockstep {

class Communicator;

class AllGatherDispatcher final : public ExpertParallelDispatcher {
 public:
  AllGatherDispatcher(const Ops& ops, Communicator& ep, int64_t E, int64_t K, int64_t C, int64_t max_tokens,
                      int64_t capacity, bool pad);

  void plan(const int32_t* idx, const uint8_t* kept, int64_t N) override;
  void dispatch(float* expert_in, const float* x) const override;
  void dispatch_backward(float* dx, const float* dexpert_in) const override;
  void combine(float* out, const float* base, const float* expert_out, const float* probs) const override;
  void combine_backward(float* dexpert_out, float* dprobs, const float* dout, const float* expert_out,
                        const float* probs) const override;
  void set_layout_invariant() override;

 private:
  // Layout mode: src (rows(), C) placed at their gathered choices in choice_rows_ (-0 elsewhere),
  // reduce-scattered into mine_rows_ (N, K, C), this rank's tokens' choice rows.
  void gather_choice_rows(const float* src) const;
  // Counts an all-gather or reduce-scatter of n elements of `bytes` each per rank.
  void count(int64_t n, int64_t bytes) const { bytes_sent_ += (S_ - 1) * n * bytes; }

  int64_t K_, N_ = 0, capacity_;
  bool pad_;
  std::vector<int32_t> idx_all_;            // (S N, K) gathered choices
  std::vector<uint8_t> kept_all_;           // (S N, K)
  std::vector<int32_t> slot_, row_choice_;  // (S N, K) row of each gathered choice or -1; (rows) choice or -1
  std::vector<int64_t> choice_row_;         // (rows) row_choice_ as a row index (layout mode's scatter)
  FloatBuffer gathered_;                    // (S N, C) tokens, then d(output)
  FloatBuffer partial_;                     // (S N, C) per-rank sums before the reduce-scatter
  FloatBuffer mine_;                        // (N, C) this rank's block after it
  FloatBuffer probs_all_, dprobs_all_;      // (S N, K); probs saved for backward
  bool exact_ = false;                      // set_layout_invariant()
  FloatBuffer choice_rows_, mine_rows_;     // (S N, K, C), (N, K, C) in layout mode
  mutable std::vector<int32_t> own_slot_;   // (N, K): t K + k when kept, else -1
};

}  // namespace lockstep
