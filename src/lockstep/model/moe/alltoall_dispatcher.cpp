#include "lockstep/model/moe/alltoall_dispatcher.h"

#include <algorithm>
#include <cstring>

#include "lockstep/comm/communicator.h"
#include "lockstep/core/error.h"
#include "lockstep/core/thread_pool.h"

namespace lockstep {

AllToAllDispatcher::AllToAllDispatcher(const Ops& ops, Communicator& ep, int64_t E, int64_t K, int64_t C,
                                       int64_t max_tokens, int64_t capacity, bool pad)
    : ExpertParallelDispatcher(ops, ep, E, K, C, max_tokens, capacity, pad),
      send_rows_(static_cast<size_t>(S_)),
      recv_rows_(static_cast<size_t>(S_)),
      recv_counts_(static_cast<size_t>(S_ * El_)),
      recv_at_(static_cast<size_t>(S_ * El_)),
      block_source_row_(static_cast<size_t>(S_ * El_)),
      block_rows_(static_cast<size_t>(S_ * El_)) {
  send_.resize(local_.max_rows() * C);
  back_.resize(local_.max_rows() * C);
  recv_.resize(max_rows_ * C);
}

void AllToAllDispatcher::plan(const int32_t* idx, const uint8_t* kept, int64_t N) {
  local_.plan(idx, kept, N);
  // Rows of this rank's layout per expert, in peer blocks: rank d gets experts [d El, (d+1) El).
  const int64_t* lo = local_.offsets();
  std::vector<int64_t> send_counts(static_cast<size_t>(E_));
  for (int64_t g = 0; g < E_; ++g) send_counts[g] = lo[g + 1] - lo[g];
  for (int64_t d = 0; d < S_; ++d) send_rows_[d] = lo[(d + 1) * El_] - lo[d * El_];
  if (L_) {
    // Layout mode: the counts per (expert, token segment) instead, (S, El, L) received.
    const int64_t* lt = local_.token_segments();
    const int64_t EL = E_ * L_;
    send_counts.resize(static_cast<size_t>(EL));
    for (int64_t k = 0; k < EL; ++k) send_counts[k] = lt[k + 1] - lt[k];
    recv_tcounts_.resize(static_cast<size_t>(S_ * El_ * L_));
    ep_.all_to_all(recv_tcounts_.data(), send_counts.data(), El_ * L_);
    bytes_sent_ += (S_ - 1) * El_ * L_ * static_cast<int64_t>(sizeof(int64_t));
    for (int64_t b = 0; b < S_ * El_; ++b) {
      recv_counts_[b] = 0;
      for (int64_t l = 0; l < L_; ++l) recv_counts_[b] += recv_tcounts_[b * L_ + l];
    }
  } else {
    ep_.all_to_all(recv_counts_.data(), send_counts.data(), El_);
    bytes_sent_ += (S_ - 1) * El_ * static_cast<int64_t>(sizeof(int64_t));
  }
  int64_t at = 0;
  for (int64_t s = 0; s < S_; ++s) {
    recv_rows_[s] = 0;
    for (int64_t e = 0; e < El_; ++e) {
      recv_at_[s * El_ + e] = at;
      at += recv_counts_[s * El_ + e];
      recv_rows_[s] += recv_counts_[s * El_ + e];
    }
  }
  LOCKSTEP_CHECK(at <= max_rows_, "all-to-all dispatcher: ", at, " rows received, planned for ", max_rows_);
  segments_[0] = 0;
  for (int64_t e = 0; e < El_; ++e) {
    offsets_[e] = segments_[e * S_];
    for (int64_t s = 0; s < S_; ++s) segments_[e * S_ + s + 1] = segments_[e * S_ + s] + recv_counts_[s * El_ + e];
  }
  offsets_[El_] = segments_[El_ * S_];
  // The (local expert, source) blocks as row copies between the expert-major and source-major layouts.
  for (int64_t b = 0; b < El_ * S_; ++b) {
    block_source_row_[b] = recv_at_[b % S_ * El_ + b / S_];
    block_rows_[b] = segments_[b + 1] - segments_[b];
  }
  if (!L_) return;
  // (local expert, source, token segment): source s's rows of expert e are in its token order.
  tsegs_.resize(static_cast<size_t>(El_ * S_ * L_ + 1));
  tsegs_[0] = 0;
  for (int64_t e = 0; e < El_; ++e)
    for (int64_t s = 0; s < S_; ++s)
      for (int64_t l = 0; l < L_; ++l) {
        const int64_t k = (e * S_ + s) * L_ + l;
        tsegs_[k + 1] = tsegs_[k] + recv_tcounts_[(s * El_ + e) * L_ + l];
      }
}

void AllToAllDispatcher::regroup(float* by_expert, const float* by_source) const {
  ops_.copy_row_blocks(by_expert, segments_.data(), by_source, block_source_row_.data(), block_rows_.data(), El_ * S_,
                       C_);
}

void AllToAllDispatcher::ungroup(float* by_source, const float* by_expert) const {
  ops_.copy_row_blocks(by_source, block_source_row_.data(), by_expert, segments_.data(), block_rows_.data(), El_ * S_,
                       C_);
}

void AllToAllDispatcher::set_bf16_payload(bool on) {
  bf16_ = on;
  if (!on) return;
  send_words_.resize(std::max(local_.max_rows(), max_rows_) * C_);
  recv_words_.resize(send_words_.size());
}

Work AllToAllDispatcher::exchange_async(float* out, const std::vector<int64_t>& out_rows, const float* in,
                                        const std::vector<int64_t>& in_rows, bool bf16) const {
  std::vector<int64_t> recv(static_cast<size_t>(S_)), send(static_cast<size_t>(S_));
  int64_t sent = 0;
  for (int64_t r = 0; r < S_; ++r) {
    recv[r] = out_rows[r] * C_;
    send[r] = in_rows[r] * C_;
    sent += send[r];
    if (r != ep_.rank()) bytes_sent_ += send[r] * static_cast<int64_t>(bf16 ? sizeof(uint16_t) : sizeof(float));
  }
  if (!bf16) return ep_.all_to_allv_async(out, recv, in, send);
  ops_.pack_bf16(send_words_.data(), in, sent);
  return ep_.all_to_allv_async(recv_words_.data(), recv, send_words_.data(), send);
}

void AllToAllDispatcher::finish_exchange(float* out, const std::vector<int64_t>& out_rows, bool bf16) const {
  if (!bf16) return;
  int64_t n = 0;
  for (int64_t r = 0; r < S_; ++r) n += out_rows[r] * C_;
  ops_.unpack_bf16(out, recv_words_.data(), n);
}

void AllToAllDispatcher::exchange(float* out, const std::vector<int64_t>& out_rows, const float* in,
                                  const std::vector<int64_t>& in_rows, bool bf16) const {
  exchange_async(out, out_rows, in, in_rows, bf16).wait();
  finish_exchange(out, out_rows, bf16);
}

void AllToAllDispatcher::dispatch(float* expert_in, const float* x) const {
  dispatch(expert_in, x, [] {});
}

void AllToAllDispatcher::dispatch(float* expert_in, const float* x, const std::function<void()>& meanwhile) const {
  local_.dispatch(send_.data(), x);
  Work in_flight = exchange_async(recv_.data(), recv_rows_, send_.data(), send_rows_, bf16_);
  meanwhile();
  in_flight.wait();
  finish_exchange(recv_.data(), recv_rows_, bf16_);
  regroup(expert_in, recv_.data());
}

void AllToAllDispatcher::combine(float* out, const float* base, const float* expert_out, const float* probs) const {
  ungroup(recv_.data(), expert_out);
  exchange(back_.data(), send_rows_, recv_.data(), recv_rows_, bf16_);
  local_.combine(out, base, back_.data(), probs);
}

void AllToAllDispatcher::combine_backward(float* dexpert_out, float* dprobs, const float* dout, const float* expert_out,
                                          const float* probs) const {
  combine_backward(dexpert_out, dprobs, dout, expert_out, probs, [] {});
}

void AllToAllDispatcher::combine_backward(float* dexpert_out, float* dprobs, const float* dout, const float*,
                                          const float* probs, const std::function<void()>& meanwhile) const {
  local_.combine_backward(send_.data(), dprobs, dout, back_.data(), probs);
  Work in_flight = exchange_async(recv_.data(), recv_rows_, send_.data(), send_rows_, bf16_);
  meanwhile();
  in_flight.wait();
  finish_exchange(recv_.data(), recv_rows_, bf16_);
  regroup(dexpert_out, recv_.data());
}

void AllToAllDispatcher::dispatch_backward(float* dx, const float* dexpert_in) const {
  dispatch_backward(dx, dexpert_in, [] {});
}

void AllToAllDispatcher::dispatch_backward(float* dx, const float* dexpert_in,
                                           const std::function<void()>& meanwhile) const {
  ungroup(recv_.data(), dexpert_in);
  Work in_flight = exchange_async(send_.data(), send_rows_, recv_.data(), recv_rows_);
  meanwhile();
  in_flight.wait();
  local_.dispatch_backward(dx, send_.data());
}

}  // namespace lockstep
