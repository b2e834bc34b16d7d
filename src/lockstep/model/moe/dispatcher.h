// Token dispatch: the step between routing and the experts, and its mirror, the combine.
//
// A dispatcher turns a routing decision (K expert choices per token, some dropped by capacity) into
// expert-input rows grouped by expert, runs the permutation, and after the experts combines each
// token's expert outputs with its routing weights. LocalDispatcher keeps every expert in this
// process; the expert-parallel ones (allgather_dispatcher.h, alltoall_dispatcher.h) derive from
// ExpertParallelDispatcher below.
//
// Layout: expert e owns rows [offsets()[e], offsets()[e + 1]); inside an expert, tokens are in token
// order (then choice order). With padding to capacity every expert owns exactly `capacity` rows and
// the rows past its tokens are zeros whose outputs are ignored.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "lockstep/kernels/ops.h"

namespace lockstep {

class Dispatcher {
 public:
  // ops: the device's (kernels/ops.h) that permute and combine the rows.
  explicit Dispatcher(const Ops& ops) : ops_(ops) {}
  virtual ~Dispatcher() = default;
  // Builds the layout of a micro-batch from idx (N, K) and kept (N, K).
  virtual void plan(const int32_t* idx, const uint8_t* kept, int64_t N) = 0;
  // expert_in (rows(), C) = the routed tokens of x (N, C).
  virtual void dispatch(float* expert_in, const float* x) const = 0;
  // The same, running `meanwhile` while the tokens are in flight (moe.shared_expert_overlap); a
  // dispatcher without an exchange runs it after. meanwhile must not touch x's rows or expert_in.
  virtual void dispatch(float* expert_in, const float* x, const std::function<void()>& meanwhile) const {
    dispatch(expert_in, x);
    meanwhile();
  }
  // dx (N, C) += the gradient of dispatch from dexpert_in (rows(), C).
  virtual void dispatch_backward(float* dx, const float* dexpert_in) const = 0;
  // The same, running `meanwhile` while the rows are in flight (moe.delay_wgrad_compute); a dispatcher
  // without an exchange runs it first. meanwhile must not touch dx or dexpert_in.
  virtual void dispatch_backward(float* dx, const float* dexpert_in, const std::function<void()>& meanwhile) const {
    meanwhile();
    dispatch_backward(dx, dexpert_in);
  }
  // out (N, C) = base + sum over kept choices k (in order) of probs[t, k] * expert_out[row].
  virtual void combine(float* out, const float* base, const float* expert_out, const float* probs) const = 0;
  // dexpert_out (rows(), C) and dprobs (N, K) from dout (N, C).
  virtual void combine_backward(float* dexpert_out, float* dprobs, const float* dout, const float* expert_out,
                                const float* probs) const = 0;
  // The same, running `meanwhile` while the rows are in flight (moe.shared_expert_overlap's backward); a
  // dispatcher without an exchange runs it first. meanwhile must not touch dexpert_out or dprobs.
  virtual void combine_backward(float* dexpert_out, float* dprobs, const float* dout, const float* expert_out,
                                const float* probs, const std::function<void()>& meanwhile) const {
    meanwhile();
    combine_backward(dexpert_out, dprobs, dout, expert_out, probs);
  }

  virtual int64_t rows() const = 0;
  virtual const int64_t* offsets() const = 0;  // (E + 1), local experts
  // Kept tokens this rank routed to each of the layer's experts (all of them, not only the local
  // ones; no padding).
  virtual const std::vector<int64_t>& tokens_per_expert() const = 0;
  // Expert-parallel ranks whose tokens the rows hold (1 for the local dispatcher). Inside an
  // expert, the rows of source rank s come before those of s + 1: segments() (E_local x sources + 1)
  // gives the rows of (local expert e, source s) at [e * sources + s], so that an expert's weight
  // gradient can be summed per source rank (experts.h).
  virtual int64_t sources() const { return 1; }
  virtual const int64_t* segments() const { return offsets(); }
  // Most rows a micro-batch can need (arena sizing).
  virtual int64_t max_rows() const = 0;
  // Bytes this rank has sent to other ranks so far (communication volume).
  virtual int64_t bytes_sent() const { return 0; }
  // determinism = "layout": from here on the combine and the dispatch backward add a token's K
  // choices exactly as the single-process LocalDispatcher does. Only the all-gather dispatcher
  // sums them differently otherwise; the others already do.
  virtual void set_layout_invariant() {}
  // determinism = "layout": from the next plan on, also count the rows of each (local expert,
  // source) block per token segment of the source: its tokens (a block of N / tp of the
  // micro-batch under tensor parallelism) cut into L canonical segments (core/tree_sum.h
  // canonical_segments), so that an expert's weight gradient can be computed per (micro-batch,
  // token segment) (experts.h). Inside a block the rows are in token order, so each segment's rows
  // are consecutive; padding rows (capacity) count to the last segment. 0: off.
  virtual void set_token_segments(int64_t L) { L_ = L; }
  int64_t token_segments_per_source() const { return L_; }
  // (E_local x sources() x L + 1): the rows of (local expert e, source s, token segment l) are
  // [t[(e sources + s) L + l], t[(e sources + s) L + l + 1]); null when off.
  const int64_t* token_segments() const { return L_ ? tsegs_.data() : nullptr; }

 protected:
  const Ops& ops_;
  int64_t L_ = 0;
  std::vector<int64_t> tsegs_;
};

// Token t's canonical segment among L segments of N tokens (L > 0), for t = 0 .. N - 1: the l
// with canonical_segments(N, L)[l] <= t < [l + 1], i.e. the largest l with floor(l N / L) <= t,
// l N < (t + 1) L.
inline int64_t token_segment(int64_t t, int64_t N, int64_t L) { return ((t + 1) * L - 1) / N; }

class LocalDispatcher final : public Dispatcher {
 public:
  // capacity: rows per expert when padding (pad = true), else unused.
  LocalDispatcher(const Ops& ops, int64_t E, int64_t K, int64_t C, int64_t max_tokens, int64_t capacity, bool pad);

  void plan(const int32_t* idx, const uint8_t* kept, int64_t N) override;
  void dispatch(float* expert_in, const float* x) const override;
  void dispatch_backward(float* dx, const float* dexpert_in) const override;
  void combine(float* out, const float* base, const float* expert_out, const float* probs) const override;
  void combine_backward(float* dexpert_out, float* dprobs, const float* dout, const float* expert_out,
                        const float* probs) const override;

  int64_t rows() const override { return offsets_[E_]; }
  const int64_t* offsets() const override { return offsets_.data(); }
  const std::vector<int64_t>& tokens_per_expert() const override { return counts_; }
  int64_t max_rows() const override;
  int64_t max_rows_for(int64_t tokens) const;
  const std::vector<int32_t>& slots() const { return slot_; }
  const std::vector<int32_t>& row_choices() const { return row_choice_; }

 private:
  int64_t E_, K_, C_, N_ = 0, capacity_;
  bool pad_;
  std::vector<int64_t> counts_, offsets_;
  std::vector<int32_t> slot_;        // (N, K): row of each choice, -1 when dropped
  std::vector<int32_t> row_choice_;  // (rows): t * K + k, -1 for padding
};

class Communicator;

// What the expert-parallel dispatchers (all-gather, all-to-all) share: the ep group of S ranks, this
// rank's El = E / S experts, its own tokens laid out over all E experts (the source layout), the
// received rows by local expert (offsets) and by (local expert, source) (segments), and the bytes
// this rank sent.
class ExpertParallelDispatcher : public Dispatcher {
 public:
  int64_t rows() const override { return offsets_[El_]; }
  const int64_t* offsets() const override { return offsets_.data(); }
  const std::vector<int64_t>& tokens_per_expert() const override { return local_.tokens_per_expert(); }
  int64_t sources() const override { return S_; }
  const int64_t* segments() const override { return segments_.data(); }
  int64_t max_rows() const override { return max_rows_; }
  int64_t bytes_sent() const override { return bytes_sent_; }
  const LocalDispatcher& source_layout() const { return local_; }
  void set_token_segments(int64_t L) override {
    L_ = L;
    local_.set_token_segments(L);
  }

 protected:
  // max_rows: every source sends at most all its choices, and at most `capacity` rows per expert.
  ExpertParallelDispatcher(const Ops& ops, Communicator& ep, int64_t E, int64_t K, int64_t C, int64_t max_tokens,
                           int64_t capacity, bool pad);

  Communicator& ep_;
  int64_t E_, El_, S_, C_, max_rows_;
  LocalDispatcher local_;  // this rank's tokens over all E experts
  std::vector<int64_t> offsets_, segments_;
  mutable int64_t bytes_sent_ = 0;
};

}  // namespace lockstep
