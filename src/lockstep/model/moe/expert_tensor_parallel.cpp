#include "lockstep/model/moe/expert_tensor_parallel.h"

#include <cstring>

#include "lockstep/comm/communicator.h"
#include "lockstep/core/error.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/core/tree_sum.h"

namespace lockstep {

ExpertTensorParallel::ExpertTensorParallel(Communicator& etp, int64_t El, int64_t S, int64_t C, int64_t max_rows)
    : etp_(etp), El_(El), S_(S), C_(C), P_(etp.size()), r_(etp.rank()), max_rows_(max_rows),
      peer_segments_(static_cast<size_t>(P_ * (El * S + 1))), peer_rows_(static_cast<size_t>(P_)),
      peer_at_(static_cast<size_t>(P_)), offsets_(static_cast<size_t>(El + 1)),
      segments_(static_cast<size_t>(El * S * P_ + 1)) {
  send_.resize(P_ * max_rows * C);
  recv_.resize(P_ * max_rows * C);
}

void ExpertTensorParallel::plan(const int64_t* segments, const int64_t* token_segments, int64_t L) {
  L_ = token_segments ? L : 0;
  const int64_t n = El_ * S_ + 1;
  etp_.all_gather(peer_segments_.data(), segments, n);
  int64_t at = 0;
  for (int64_t p = 0; p < P_; ++p) {
    peer_at_[p] = at;
    peer_rows_[p] = peer_segments_[p * n + El_ * S_];
    at += peer_rows_[p];
  }
  LOCKSTEP_CHECK(at <= max_rows(), "expert tensor parallelism: ", at, " rows gathered, planned for ", max_rows());
  segments_[0] = 0;
  for (int64_t e = 0; e < El_; ++e) {
    offsets_[e] = segments_[e * S_ * P_];
    for (int64_t s = 0; s < S_; ++s)
      for (int64_t p = 0; p < P_; ++p) {
        const int64_t b = e * S_ * P_ + s * P_ + p;
        const int64_t* ps = peer_segments_.data() + p * n;
        segments_[b + 1] = segments_[b] + ps[e * S_ + s + 1] - ps[e * S_ + s];
      }
  }
  offsets_[El_] = segments_[El_ * S_ * P_];
  if (!L_) return;
  // The same per token segment: (local expert, ep source, etp rank, token segment).
  const int64_t nt = El_ * S_ * L_ + 1;
  peer_tsegs_.resize(static_cast<size_t>(P_ * nt));
  etp_.all_gather(peer_tsegs_.data(), token_segments, nt);
  tsegs_.resize(static_cast<size_t>(El_ * S_ * P_ * L_ + 1));
  tsegs_[0] = 0;
  for (int64_t es = 0; es < El_ * S_; ++es)
    for (int64_t p = 0; p < P_; ++p)
      for (int64_t l = 0; l < L_; ++l) {
        const int64_t k = (es * P_ + p) * L_ + l;
        const int64_t* pt = peer_tsegs_.data() + p * nt + es * L_ + l;
        tsegs_[k + 1] = tsegs_[k] + pt[1] - pt[0];
      }
}

void ExpertTensorParallel::regroup(float* by_expert, const float* by_rank) const {
  const int64_t n = El_ * S_ + 1;
  parallel_for(El_ * S_ * P_, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t p = b % P_, es = b / P_;  // es = e * S + s
      const int64_t from = peer_at_[p] + peer_segments_[p * n + es];
      std::memcpy(by_expert + segments_[b] * C_, by_rank + from * C_,
                  static_cast<size_t>((segments_[b + 1] - segments_[b]) * C_) * sizeof(float));
    }
  });
}

void ExpertTensorParallel::ungroup(float* by_rank, const float* by_expert) const {
  const int64_t n = El_ * S_ + 1;
  parallel_for(El_ * S_ * P_, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t p = b % P_, es = b / P_;
      const int64_t to = peer_at_[p] + peer_segments_[p * n + es];
      std::memcpy(by_rank + to * C_, by_expert + segments_[b] * C_,
                  static_cast<size_t>((segments_[b + 1] - segments_[b]) * C_) * sizeof(float));
    }
  });
}

void ExpertTensorParallel::gather(float* all, const float* mine) const {
  // An all-gather with per-rank sizes: the same block to every peer.
  const int64_t m = peer_rows_[r_] * C_;
  float* send = send_.data();
  for (int64_t p = 0; p < P_; ++p) std::memcpy(send + p * m, mine, static_cast<size_t>(m) * sizeof(float));
  std::vector<int64_t> recv(static_cast<size_t>(P_)), sends(static_cast<size_t>(P_), m);
  for (int64_t p = 0; p < P_; ++p) recv[p] = peer_rows_[p] * C_;
  etp_.all_to_allv(recv_.data(), recv, send, sends);
  regroup(all, recv_.data());
}

void ExpertTensorParallel::reduce_scatter(float* mine, const float* all) const {
  // Rank p's rows to rank p; from every rank, its partial sums of this rank's rows.
  float* by_rank = send_.data();
  ungroup(by_rank, all);
  const int64_t m = peer_rows_[r_] * C_;
  std::vector<int64_t> recv(static_cast<size_t>(P_), m), sends(static_cast<size_t>(P_));
  for (int64_t p = 0; p < P_; ++p) sends[p] = peer_rows_[p] * C_;
  etp_.all_to_allv(recv_.data(), recv, by_rank, sends);
  const float* parts = recv_.data();
  const int64_t P = P_;
  if (tree_) {
    parallel_for(m, [&](int64_t i0, int64_t i1) {
      std::vector<const float*> leaves(static_cast<size_t>(P));
      std::vector<float> stack(static_cast<size_t>(tree_sum_stack(P) * (i1 - i0)));
      for (int64_t p = 0; p < P; ++p) leaves[p] = parts + p * m + i0;
      tree_sum(mine + i0, leaves.data(), P, i1 - i0, stack.data());
    });
    return;
  }
  parallel_for(m, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      float acc = parts[i];
      for (int64_t p = 1; p < P; ++p) acc += parts[p * m + i];
      mine[i] = acc;
    }
  });
}

}  // namespace lockstep
