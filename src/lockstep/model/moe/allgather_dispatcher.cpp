#include "lockstep/model/moe/allgather_dispatcher.h"

#include <algorithm>
#include <cstring>

#include "lockstep/comm/communicator.h"
#include "lockstep/core/error.h"
#include "lockstep/core/thread_pool.h"

namespace lockstep {

AllGatherDispatcher::AllGatherDispatcher(const Ops& ops, Communicator& ep, int64_t E, int64_t K, int64_t C,
                                         int64_t max_tokens, int64_t capacity, bool pad)
    : ExpertParallelDispatcher(ops, ep, E, K, C, max_tokens, capacity, pad), K_(K), capacity_(capacity), pad_(pad) {
  const int64_t all = S_ * max_tokens;
  idx_all_.resize(static_cast<size_t>(all * K));
  kept_all_.resize(static_cast<size_t>(all * K));
  slot_.resize(static_cast<size_t>(all * K));
  row_choice_.resize(static_cast<size_t>(max_rows_));
  gathered_.resize(all * C);
  partial_.resize(all * C);
  mine_.resize(max_tokens * C);
  probs_all_.resize(all * K);
  dprobs_all_.resize(all * K);
}

void AllGatherDispatcher::plan(const int32_t* idx, const uint8_t* kept, int64_t N) {
  local_.plan(idx, kept, N);
  N_ = N;
  const int64_t NK = N * K_, first = ep_.rank() * El_;
  ep_.all_gather(idx_all_.data(), idx, NK);
  ep_.all_gather(kept_all_.data(), kept, NK);
  count(NK, sizeof(int32_t) + sizeof(uint8_t));
  // Rows: local expert, then source, then the source's choices in order (padding after each block).
  std::fill(slot_.begin(), slot_.begin() + S_ * NK, -1);
  // Layout mode: each source's token segments (the sources route N tokens each).
  if (L_) tsegs_.resize(static_cast<size_t>(El_ * S_ * L_ + 1));
  int64_t r = 0;
  for (int64_t e = 0; e < El_; ++e) {
    for (int64_t s = 0; s < S_; ++s) {
      const int64_t b = e * S_ + s;
      segments_[b] = r;
      int64_t l = 0;  // the token segment the rows are in
      for (int64_t i = s * NK; i < (s + 1) * NK; ++i) {
        if (!kept_all_[i] || idx_all_[i] != first + e) continue;
        if (L_)
          for (const int64_t li = token_segment((i - s * NK) / K_, N, L_); l < li; ++l) tsegs_[b * L_ + l + 1] = r;
        slot_[i] = static_cast<int32_t>(r);
        row_choice_[r++] = static_cast<int32_t>(i);
      }
      if (pad_) {
        const int64_t used = r - segments_[b];
        LOCKSTEP_CHECK(used <= capacity_, "expert over capacity after dropping");
        for (; r < segments_[b] + capacity_; ++r) row_choice_[r] = -1;
      }
      if (L_) {  // the segments after the last token's end here (padding counts to the last)
        tsegs_[b * L_] = segments_[b];
        for (; l < L_; ++l) tsegs_[b * L_ + l + 1] = r;
      }
    }
    offsets_[e] = segments_[e * S_];
  }
  choice_row_.assign(row_choice_.begin(), row_choice_.begin() + r);  // as scatter_rows' row index
  LOCKSTEP_CHECK(r <= max_rows_, "all-gather dispatcher: ", r, " rows, planned for ", max_rows_);
  segments_[El_ * S_] = offsets_[El_] = r;
}

void AllGatherDispatcher::set_layout_invariant() {
  exact_ = true;
  choice_rows_.resize(static_cast<int64_t>(idx_all_.size()) * C_);
  mine_rows_.resize(static_cast<int64_t>(idx_all_.size()) / S_ * C_);
  own_slot_.resize(idx_all_.size() / static_cast<size_t>(S_));
}

void AllGatherDispatcher::gather_choice_rows(const float* src) const {
  const int64_t NK = N_ * K_, all = S_ * NK;
  float* dst = choice_rows_.data();
  ops_.fill(dst, all * C_, -0.0f);
  ops_.scatter_rows(dst, src, choice_row_.data(), rows(), C_);
  ep_.reduce_scatter(mine_rows_.data(), dst, NK * C_);
  count(NK * C_, sizeof(float));
  for (int64_t i = 0; i < NK; ++i) own_slot_[i] = local_.slots()[i] >= 0 ? static_cast<int32_t>(i) : -1;
}

void AllGatherDispatcher::dispatch(float* expert_in, const float* x) const {
  ep_.all_gather(gathered_.data(), x, N_ * C_);
  count(N_ * C_, sizeof(float));
  ops_.permute_forward(expert_in, gathered_.data(), row_choice_.data(), rows(), K_, C_);
}

void AllGatherDispatcher::combine(float* out, const float* base, const float* expert_out, const float* probs) const {
  const int64_t all = S_ * N_;
  ep_.all_gather(probs_all_.data(), probs, N_ * K_);  // also for backward's d(expert output)
  count(N_ * K_, sizeof(float));
  if (exact_) {
    gather_choice_rows(expert_out);
    ops_.combine_forward(out, base, mine_rows_.data(), own_slot_.data(), probs, N_, K_, C_);
    return;
  }
  float* partial = partial_.data();
  ops_.fill(partial, all * C_, 0.0f);
  ops_.combine_forward(partial, partial, expert_out, slot_.data(), probs_all_.data(), all, K_, C_);
  ep_.reduce_scatter(mine_.data(), partial, N_ * C_);
  count(N_ * C_, sizeof(float));
  ops_.add(out, base, mine_.data(), N_ * C_);
}

void AllGatherDispatcher::combine_backward(float* dexpert_out, float* dprobs, const float* dout,
                                           const float* expert_out, const float*) const {
  const int64_t all = S_ * N_;
  ep_.all_gather(gathered_.data(), dout, N_ * C_);
  count(N_ * C_, sizeof(float));
  ops_.combine_backward(dexpert_out, dprobs_all_.data(), gathered_.data(), expert_out, slot_.data(), row_choice_.data(),
                        probs_all_.data(), all, rows(), K_, C_);
  // Each choice's gradient comes from the one rank holding its expert; the others add zeros (-0 in
  // layout mode, which adds exactly, also to a -0).
  if (exact_)
    for (int64_t i = 0; i < all * K_; ++i)
      if (kept_all_[i] && slot_[i] < 0) dprobs_all_[i] = -0.0f;
  ep_.reduce_scatter(dprobs, dprobs_all_.data(), N_ * K_);
  count(N_ * K_, sizeof(float));
}

void AllGatherDispatcher::dispatch_backward(float* dx, const float* dexpert_in) const {
  if (exact_) {
    gather_choice_rows(dexpert_in);
    ops_.permute_backward(dx, mine_rows_.data(), own_slot_.data(), N_, K_, C_);
    return;
  }
  const int64_t all = S_ * N_;
  float* partial = partial_.data();
  ops_.fill(partial, all * C_, 0.0f);
  ops_.permute_backward(partial, dexpert_in, slot_.data(), all, K_, C_);
  ep_.reduce_scatter(mine_.data(), partial, N_ * C_);
  count(N_ * C_, sizeof(float));
  ops_.add(dx, dx, mine_.data(), N_ * C_);
}

}  // namespace lockstep
