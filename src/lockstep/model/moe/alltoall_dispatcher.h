// The all-to-all token dispatcher of expert parallelism (moe.token_dispatcher = "alltoall").
//
// The S ranks of the expert-parallel group each hold E / S experts (rank s: experts
// [s * E/S, (s + 1) * E/S)) and route their own tokens over all E experts. Per micro-batch:
//
//   plan:      this rank's layout over all E experts (LocalDispatcher: rows grouped by expert,
//              tokens in token order, capacity and padding applied on this rank's tokens), then an
//              all-to-all of the per-expert row counts (E/S per peer)
//   dispatch:  permute into that layout; all-to-allv: the rows of rank d's experts go to d; the
//              received blocks (source-major) are regrouped by local expert (expert-major, source
//              order inside an expert, each source's rows in its token order)
//   experts:   grouped GEMM over the local experts (experts.h)
//   combine:   the inverse regroup, the reverse all-to-allv back to the source rank, and there the
//              local combine: base + sum over k in order of probs[t, k] * y (permute.h)
//   backward:  the same exchanges mirrored (combine_backward's rows forward, dispatch_backward's
//              rows back)
//
// Routing probabilities do not travel: the combine, where they are applied, runs on the source
// rank, which holds them (the experts do not apply them; experts.h). Capacity is computed per source
// rank from its own micro-batch (as Megatron does), so a rank drops exactly the choices it drops
// when it runs as a data-parallel rank without expert parallelism.
//
// Payload (set_bf16_payload, under precision.params = "bf16"): the rows travel as bf16 words, half the
// bytes, where that keeps every bit: the dispatched rows (the norm's output) and the expert outputs are
// bf16 values already, and the combine's backward rows are rounded to bf16 on arrival anyway (the
// sender rounds them instead: the same rounding, once). The experts' input gradients stay fp32 on the
// wire: the source rank sums each token's k rows before rounding, as one process does.
//
// Determinism: every expert output row is one grouped-GEMM row (bitwise independent of which rank
// computes it and of the other rows), the combine runs on the source rank in the single-process
// order, and the regroup is a copy; so the forward is bitwise the one of the same micro-batch on a
// single rank. Each (expert, source) block is a separate segment (segments()), so the weight
// gradient can be accumulated per source and summed in rank order (experts.h). With token
// segments (layout mode, set_token_segments) the count exchange carries the rows per (expert,
// token segment) instead of per expert: El x L counts per peer.
#pragma once

#include <cstdint>
#include <vector>

#include "lockstep/comm/communicator.h"
#include "lockstep/core/tensor.h"
#include "lockstep/model/moe/dispatcher.h"

namespace lockstep {

class Communicator;

class AllToAllDispatcher final : public ExpertParallelDispatcher {
 public:
  // ep: the expert-parallel group (S ranks); E: experts of the layer (divisible by S); the rest as
  // LocalDispatcher's.
  AllToAllDispatcher(const Ops& ops, Communicator& ep, int64_t E, int64_t K, int64_t C, int64_t max_tokens,
                     int64_t capacity, bool pad);

  void set_bf16_payload(bool on);
  void plan(const int32_t* idx, const uint8_t* kept, int64_t N) override;
  void dispatch(float* expert_in, const float* x) const override;
  // The exchange runs on the rank's progress thread while meanwhile() runs here.
  void dispatch(float* expert_in, const float* x, const std::function<void()>& meanwhile) const override;
  void dispatch_backward(float* dx, const float* dexpert_in) const override;
  void dispatch_backward(float* dx, const float* dexpert_in, const std::function<void()>& meanwhile) const override;
  void combine(float* out, const float* base, const float* expert_out, const float* probs) const override;
  // expert_out is not read: the combine's own copy of the outputs on the source rank is.
  void combine_backward(float* dexpert_out, float* dprobs, const float* dout, const float* expert_out,
                        const float* probs) const override;
  void combine_backward(float* dexpert_out, float* dprobs, const float* dout, const float* expert_out,
                        const float* probs, const std::function<void()>& meanwhile) const override;

 private:
  // Rows received from each source (source-major) <-> rows by local expert (expert-major).
  void regroup(float* by_expert, const float* by_source) const;
  void ungroup(float* by_source, const float* by_expert) const;
  // One all-to-allv of rows: out_rows[r] rows from rank r, in_rows[r] rows to rank r.
  void exchange(float* out, const std::vector<int64_t>& out_rows, const float* in, const std::vector<int64_t>& in_rows,
                bool bf16 = false) const;
  // bf16: the rows as bf16 words (in rounded by pack_bf16; out unpacked by finish_exchange after the
  // wait).
  Work exchange_async(float* out, const std::vector<int64_t>& out_rows, const float* in,
                      const std::vector<int64_t>& in_rows, bool bf16 = false) const;
  void finish_exchange(float* out, const std::vector<int64_t>& out_rows, bool bf16) const;

  std::vector<int64_t> send_rows_, recv_rows_;  // (S) rows to / from each rank
  std::vector<int64_t> recv_counts_;            // (S, El) rows of (source, local expert)
  std::vector<int64_t> recv_tcounts_;           // (S, El, L) the same per token segment (layout mode)
  std::vector<int64_t> recv_at_;                // (S, El) first row of each block in the source-major buffer
  // (El, S): block (e, s)'s first row in the source-major buffer and its rows (segments_ holds its
  // first row in the expert-major one).
  std::vector<int64_t> block_source_row_, block_rows_;
  FloatBuffer send_, recv_;  // (local rows, C) source layout / (max rows, C) received
  FloatBuffer back_;         // (local rows, C) expert outputs returned (saved for backward)
  bool bf16_ = false;        // set_bf16_payload
  mutable std::vector<uint16_t> send_words_, recv_words_;  // the bf16 payload's buffers
};

}  // namespace lockstep
