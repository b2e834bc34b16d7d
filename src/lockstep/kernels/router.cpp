// The router's host-side rules (kernels/router.h): the options resolved from the config, the
// capacity, and the load-balancing losses from their statistics, the same for every backend.
#include "lockstep/kernels/router.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace lockstep {

RouterSpec::RouterSpec(const MoeConfig& c)
    : E(c.num_experts),
      K(c.router_topk),
      sigmoid(c.router_score_function == "sigmoid"),
      pre_softmax(c.router_pre_softmax),
      groups(c.router_num_groups),
      group_topk(c.router_group_topk),
      scaling(static_cast<float>(c.router_topk_scaling_factor)),
      aux_coeff(c.aux_loss_coeff),
      z_coeff(c.z_loss_coeff),
      capacity_factor(c.expert_capacity_factor),
      drop_by_position(c.token_drop_policy == "position") {
  std::stringstream ss(c.router_load_balancing_type);
  std::string item;
  while (std::getline(ss, item, ',')) {
    item.erase(std::remove(item.begin(), item.end(), ' '), item.end());
    aux |= item == "aux_loss";
    seq_aux |= item == "seq_aux_loss";
    global_aux |= item == "global_aux_loss";
  }
}

int64_t expert_capacity(const RouterSpec& s, int64_t N) {
  if (s.capacity_factor <= 0) return 0;
  return static_cast<int64_t>(std::ceil(static_cast<double>(N * s.K) / static_cast<double>(s.E) * s.capacity_factor));
}

namespace {

// Coefficient-free switch loss weight of expert e's probability sum: E / (K * n^2) * count_e.
double switch_weight(const RouterSpec& s, double count, double n) {
  return static_cast<double>(s.E) / (static_cast<double>(s.K) * n * n) * count;
}

}  // namespace

AuxLosses aux_losses_of(const RouterStatistics& st, const RouterSpec& s, int64_t B, int64_t T, const int64_t* prev_sum,
                        int64_t prev_micro, float* global_counts, int64_t* micro_counts,
                        const std::function<void(int64_t*, int64_t)>& sum_over_replicas) {
  const int64_t E = s.E, N = B * T;
  AuxLosses out;
  if (micro_counts) std::fill(micro_counts, micro_counts + E, int64_t{0});
  const bool any_aux = s.aux_coeff > 0 && (s.aux || s.seq_aux || s.global_aux);
  if (!any_aux && s.z_coeff <= 0) return out;
  const std::vector<double>& psum = st.psum;
  const std::vector<int64_t>& counts_seq = st.counts;
  const double n = static_cast<double>(N);
  for (int64_t b = 0; b < B; ++b) out.z += st.zsq[b];
  out.z *= s.z_coeff / n;
  if (!any_aux) return out;
  // The global aux loss's counts: this micro-batch's over the replicas (integers: exact in any order).
  std::vector<int64_t> batch(static_cast<size_t>(E), 0);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t b = 0; b < B; ++b) batch[e] += counts_seq[b * E + e];
  if (s.global_aux && sum_over_replicas) sum_over_replicas(batch.data(), E);
  if (micro_counts) std::copy(batch.begin(), batch.end(), micro_counts);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t count = (prev_sum ? prev_sum[e] : 0) + batch[e];
    global_counts[e] = static_cast<float>(static_cast<double>(count) / static_cast<double>(prev_micro + 1));
  }
  const double n_global = n * static_cast<double>(s.global_replicas);
  for (int64_t e = 0; e < E; ++e) {
    double count = 0, p = 0;
    for (int64_t b = 0; b < B; ++b) {
      count += static_cast<double>(counts_seq[b * E + e]);
      p += psum[b * E + e];
      if (s.seq_aux)
        out.seq_aux +=
            switch_weight(s, static_cast<double>(counts_seq[b * E + e]), static_cast<double>(T)) * psum[b * E + e];
    }
    if (s.aux) out.aux += switch_weight(s, count, n) * p;
    if (s.global_aux) out.global_aux += switch_weight(s, global_counts[e], n_global) * p;
  }
  out.aux *= s.aux_coeff;
  out.seq_aux *= s.aux_coeff / static_cast<double>(B);
  out.global_aux *= s.aux_coeff;
  return out;
}

void aux_loss_weights(std::vector<double>& g, std::vector<double>& gseq, const RouterSpec& s, int64_t B, int64_t T,
                      const float* global_counts, const std::vector<int64_t>& counts_seq) {
  const int64_t E = s.E, N = B * T;
  g.assign(static_cast<size_t>(E), 0.0);
  gseq.assign(static_cast<size_t>(B * E), 0.0);
  const double n = static_cast<double>(N);
  for (int64_t e = 0; e < E; ++e) {
    double count = 0;
    for (int64_t b = 0; b < B; ++b) {
      count += static_cast<double>(counts_seq[b * E + e]);
      if (s.seq_aux)
        gseq[b * E + e] = s.aux_coeff / static_cast<double>(B) *
                          switch_weight(s, static_cast<double>(counts_seq[b * E + e]), static_cast<double>(T));
    }
    if (s.aux) g[e] += s.aux_coeff * switch_weight(s, count, n);
    if (s.global_aux)
      g[e] += s.aux_coeff * switch_weight(s, global_counts[e], n * static_cast<double>(s.global_replicas));
  }
}

}  // namespace lockstep
