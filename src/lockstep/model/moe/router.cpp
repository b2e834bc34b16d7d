#include "lockstep/model/moe/router.h"

namespace lockstep {

AuxLosses aux_losses_forward(const Ops& ops, const float* logits, const RouterSpec& s, int64_t B, int64_t T,
                             const int64_t* prev_sum, int64_t prev_micro, float* global_counts,
                             std::vector<int64_t>& counts_seq, int64_t* micro_counts,
                             const std::function<void(int64_t*, int64_t)>& sum_over_replicas) {
  thread_local RouterStatistics st;  // per rank thread, kept across layers and micro-batches
  ops.router_statistics(st, logits, s, B, T);
  counts_seq = st.counts;
  return aux_losses_of(st, s, B, T, prev_sum, prev_micro, global_counts, micro_counts, sum_over_replicas);
}

void aux_losses_backward(const Ops& ops, float* dlogits, const float* logits, const RouterSpec& s, int64_t B, int64_t T,
                         const float* global_counts, const std::vector<int64_t>& counts_seq, float scale, int64_t first,
                         int64_t rows) {
  const bool any_aux = s.aux_coeff > 0 && (s.aux || s.seq_aux || s.global_aux);
  if (!any_aux && s.z_coeff <= 0) return;
  thread_local std::vector<double> g, gseq;
  aux_loss_weights(g, gseq, s, B, T, global_counts, counts_seq);
  ops.aux_losses_backward(dlogits, logits, s, B, T, g.data(), gseq.data(), scale, first, rows < 0 ? B * T : rows);
}

void update_expert_bias(float* bias, const int64_t* counts, int64_t E, float rate) {
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) total += counts[e];
  const double mean = static_cast<double>(total) / static_cast<double>(E);
  for (int64_t e = 0; e < E; ++e) {
    const double off = mean - static_cast<double>(counts[e]);
    bias[e] += off > 0 ? rate : off < 0 ? -rate : 0.0f;
  }
}

}  // namespace lockstep
