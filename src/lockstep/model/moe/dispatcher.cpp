#include "lockstep/model/moe/dispatcher.h"

#include <algorithm>

#include "lockstep/comm/communicator.h"
#include "lockstep/core/error.h"
#include "lockstep/core/tree_sum.h"

namespace lockstep {

LocalDispatcher::LocalDispatcher(const Ops& ops, int64_t E, int64_t K, int64_t C, int64_t max_tokens, int64_t capacity,
                                 bool pad)
    : Dispatcher(ops),
      E_(E),
      K_(K),
      C_(C),
      capacity_(capacity),
      pad_(pad),
      counts_(static_cast<size_t>(E)),
      offsets_(static_cast<size_t>(E + 1)) {
  LOCKSTEP_CHECK(!pad || capacity > 0, "padding needs a capacity");
  slot_.resize(static_cast<size_t>(max_tokens * K));
  row_choice_.resize(static_cast<size_t>(max_rows_for(max_tokens)));
}

int64_t LocalDispatcher::max_rows_for(int64_t tokens) const { return pad_ ? E_ * capacity_ : tokens * K_; }

int64_t LocalDispatcher::max_rows() const { return static_cast<int64_t>(row_choice_.size()); }

void LocalDispatcher::plan(const int32_t* idx, const uint8_t* kept, int64_t N) {
  LOCKSTEP_CHECK(N * K_ <= static_cast<int64_t>(slot_.size()), "dispatcher planned for fewer tokens");
  N_ = N;
  std::fill(counts_.begin(), counts_.end(), 0);
  for (int64_t i = 0; i < N * K_; ++i)
    if (kept[i]) ++counts_[idx[i]];
  offsets_[0] = 0;
  for (int64_t e = 0; e < E_; ++e) {
    LOCKSTEP_CHECK(!pad_ || counts_[e] <= capacity_, "expert over capacity after dropping");
    offsets_[e + 1] = offsets_[e] + (pad_ ? capacity_ : counts_[e]);
  }
  std::vector<int64_t> fill(offsets_.begin(), offsets_.end() - 1);
  std::fill(row_choice_.begin(), row_choice_.begin() + offsets_[E_], -1);
  // Choices in token order, so each expert's rows are in token order.
  for (int64_t i = 0; i < N * K_; ++i) {
    if (!kept[i]) {
      slot_[i] = -1;
      continue;
    }
    const int64_t r = fill[idx[i]]++;
    slot_[i] = static_cast<int32_t>(r);
    row_choice_[r] = static_cast<int32_t>(i);
  }
  if (!L_) return;
  // Rows per (expert, token segment); an expert's padding rows (after its tokens) to its last one.
  tsegs_.assign(static_cast<size_t>(E_ * L_ + 1), 0);
  for (int64_t e = 0; e < E_; ++e)
    for (int64_t r = offsets_[e]; r < offsets_[e + 1]; ++r)
      ++tsegs_[e * L_ + (row_choice_[r] >= 0 ? token_segment(row_choice_[r] / K_, N, L_) : L_ - 1) + 1];
  for (int64_t k = 0; k < E_ * L_; ++k) tsegs_[k + 1] += tsegs_[k];
}

void LocalDispatcher::dispatch(float* expert_in, const float* x) const {
  ops_.permute_forward(expert_in, x, row_choice_.data(), rows(), K_, C_);
}

void LocalDispatcher::dispatch_backward(float* dx, const float* dexpert_in) const {
  ops_.permute_backward(dx, dexpert_in, slot_.data(), N_, K_, C_);
}

void LocalDispatcher::combine(float* out, const float* base, const float* expert_out, const float* probs) const {
  ops_.combine_forward(out, base, expert_out, slot_.data(), probs, N_, K_, C_);
}

void LocalDispatcher::combine_backward(float* dexpert_out, float* dprobs, const float* dout, const float* expert_out,
                                       const float* probs) const {
  ops_.combine_backward(dexpert_out, dprobs, dout, expert_out, slot_.data(), row_choice_.data(), probs, N_, rows(), K_,
                        C_);
}

ExpertParallelDispatcher::ExpertParallelDispatcher(const Ops& ops, Communicator& ep, int64_t E, int64_t K, int64_t C,
                                                   int64_t max_tokens, int64_t capacity, bool pad)
    : Dispatcher(ops),
      ep_(ep),
      E_(E),
      El_(E / ep.size()),
      S_(ep.size()),
      C_(C),
      local_(ops, E, K, C, max_tokens, capacity, pad),
      offsets_(static_cast<size_t>(El_ + 1)),
      segments_(static_cast<size_t>(El_ * S_ + 1)) {
  LOCKSTEP_CHECK(E % S_ == 0, "experts ", E, " not divisible by the expert-parallel size ", S_);
  max_rows_ = pad ? El_ * S_ * capacity : S_ * max_tokens * K;
  if (capacity > 0) max_rows_ = std::min(max_rows_, El_ * S_ * capacity);
}

}  // namespace lockstep
