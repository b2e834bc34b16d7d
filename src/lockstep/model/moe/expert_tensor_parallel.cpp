#include "lockstep/model/moe/expert_tensor_parallel.h"

#include "lockstep/comm/communicator.h"
#include "lockstep/core/error.h"

namespace lockstep {

ExpertTensorParallel::ExpertTensorParallel(const Ops& ops, Communicator& etp, int64_t El, int64_t S, int64_t C,
                                           int64_t max_rows)
    : etp_(etp),
      El_(El),
      S_(S),
      C_(C),
      P_(etp.size()),
      r_(etp.rank()),
      max_rows_(max_rows),
      peer_segments_(static_cast<size_t>(P_ * (El * S + 1))),
      peer_rows_(static_cast<size_t>(P_)),
      peer_at_(static_cast<size_t>(P_)),
      offsets_(static_cast<size_t>(El + 1)),
      segments_(static_cast<size_t>(El * S * P_ + 1)),
      ops_(ops),
      block_rank_row_(static_cast<size_t>(El * S * P_)),
      block_rows_(static_cast<size_t>(El * S * P_)) {
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
  for (int64_t b = 0; b < El_ * S_ * P_; ++b) {
    const int64_t p = b % P_, es = b / P_;  // es = e * S + s
    block_rank_row_[b] = peer_at_[p] + peer_segments_[p * n + es];
    block_rows_[b] = segments_[b + 1] - segments_[b];
  }
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
  ops_.copy_row_blocks(by_expert, segments_.data(), by_rank, block_rank_row_.data(), block_rows_.data(), El_ * S_ * P_,
                       C_);
}

void ExpertTensorParallel::ungroup(float* by_rank, const float* by_expert) const {
  ops_.copy_row_blocks(by_rank, block_rank_row_.data(), by_expert, segments_.data(), block_rows_.data(), El_ * S_ * P_,
                       C_);
}

void ExpertTensorParallel::gather(float* all, const float* mine) const {
  // An all-gather with per-rank sizes: the same block to every peer.
  const int64_t m = peer_rows_[r_] * C_;
  float* send = send_.data();
  for (int64_t p = 0; p < P_; ++p) ops_.copy(send + p * m, mine, m);
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
  // Every rank's part of this rank's rows, in rank order or along the canonical tree (layout).
  std::vector<const float*> parts(static_cast<size_t>(P_));
  for (int64_t p = 0; p < P_; ++p) parts[static_cast<size_t>(p)] = recv_.data() + p * m;
  if (tree_)
    ops_.tree_sum(mine, parts.data(), P_, m);
  else
    ops_.ordered_sum(mine, parts.data(), P_, m);
}

}  // namespace lockstep
