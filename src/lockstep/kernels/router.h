// The MoE router ops of the compute seam (kernels/ops.h): from the logits (x W_r^T, computed by the
// caller) the scores, top-k selection, routing weights, capacity dropping, the load-balancing
// losses' statistics and gradients, and the router-input jitter, all in FP32 (docs/moe.md states every
// formula and default; the names are Megatron's --moe-* options without the prefix).
//
// Sizes: N tokens (B sequences of T), E experts, K choices per token.
// A token's K choices are stored in ascending expert order (not score order): the combine sums a
// token's expert outputs in that order, so the order is fixed by which experts were chosen alone.
// Ties in any top-k (experts or groups) go to the lower index.
//
// Determinism: every token is routed by one thread from its own logits; per-expert sums (token
// counts, probability sums for the aux losses) run in token order in one thread.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "lockstep/config/config.h"
#include "lockstep/kernels/op.h"

namespace lockstep {

// The routing options of one layer, resolved from MoeConfig.
struct RouterSpec {
  explicit RouterSpec(const MoeConfig& c);
  RouterSpec() = default;
  int64_t E = 0, K = 0;
  bool sigmoid = false, pre_softmax = false;
  int64_t groups = 0, group_topk = 0;
  float scaling = 1.0f;
  bool aux = false, seq_aux = false, global_aux = false;
  double aux_coeff = 0, z_coeff = 0;
  double capacity_factor = 0;
  bool drop_by_position = false;
  // The global aux loss's replicas: the ranks whose micro-batches of the same index are counted
  // together (the data-parallel group only, MoeLayer::set_data_parallel: every tp and cp rank
  // already counts its whole micro-batch from the gathered router logits). Its token count is
  // replicas x N.
  int64_t global_replicas = 1;
};

// Expert capacity for N tokens: ceil(N * K / E * capacity_factor); 0 when dropless.
int64_t expert_capacity(const RouterSpec& s, int64_t N);
// The load-balancing losses of one micro-batch (each already multiplied by its coefficient).
struct AuxLosses {
  double aux = 0, seq_aux = 0, global_aux = 0, z = 0;
  double total() const { return aux + seq_aux + global_aux + z; }
};

// The aux losses' per-sequence statistics (RouterOps::router_statistics): each sequence's
// probability sums (B, E) and token counts per expert (B, E) in the aux losses' routing map (the
// plain top-K of their scores: softmax over all E, or sigmoid normalised to sum 1; no groups, no
// expert bias), and its sum over tokens of lse(logits)^2 for the z-loss (B).
struct RouterStatistics {
  std::vector<double> psum, zsq;
  std::vector<int64_t> counts;
};

// The losses from the statistics (host: B x E scalars). The global aux loss (Megatron's
// TopKRouter._apply_global_aux_loss): this micro-batch's counts are summed over the replicas
// (sum_over_replicas: an all-reduce over s.global_replicas ranks; null when there is one) into
// micro_counts (E, when given), and global_counts (E) = (prev_sum + micro_counts) / (prev_micro + 1)
// is their running mean over the step's micro-batches so far (Megatron's tracker; written for
// backward). The loss is the switch loss of this rank's probability sums against global_counts with
// the token count of all the replicas, coeff * E / (K (replicas N)^2) * sum_e P_e global_e: the
// replicas' terms add up to the switch loss of their joint batch.
AuxLosses aux_losses_of(const RouterStatistics& st, const RouterSpec& s, int64_t B, int64_t T, const int64_t* prev_sum,
                        int64_t prev_micro, float* global_counts, int64_t* micro_counts,
                        const std::function<void(int64_t*, int64_t)>& sum_over_replicas);
// d(aux losses)/d(score) of each expert, batch-wide (g, E) and per sequence (gseq, (B, E)), from the
// counts (B, E) and global_counts (host: B x E scalars).
void aux_loss_weights(std::vector<double>& g, std::vector<double>& gseq, const RouterSpec& s, int64_t B, int64_t T,
                      const float* global_counts, const std::vector<int64_t>& counts);

// The ops, as a backend binds them (kernels/ops.h).
struct RouterOps {
  // Per token: chooses K experts (idx, ascending) and their routing weights (probs) from logits
  // (N, E). expert_bias (E) or null shifts the selection scores only (sigmoid).
  Op<void(int32_t* idx, float* probs, const float* logits, const float* expert_bias, const RouterSpec& s, int64_t N)>
      route_topk{"route_topk"};
  // dlogits (N, E) = d(probs)/d(logits)^T dprobs (assigned).
  Op<void(float* dlogits, const float* dprobs, const float* logits, const int32_t* idx, const RouterSpec& s, int64_t N)>
      route_topk_backward{"route_topk_backward"};
  // kept (N, K): 1 where a choice survives the capacity (probs policy: an expert keeps its
  // `capacity` highest-weight choices, ties to the earlier token; position policy: its first
  // `capacity` choices in token order). All 1 when dropless.
  Op<void(uint8_t* kept, const int32_t* idx, const float* probs, const RouterSpec& s, int64_t N)> apply_capacity{
      "apply_capacity"};
  // The statistics of the B sequences of T tokens of logits (N = B T, E) that RouterStatistics holds
  // (resized here to B x E, B x E and B, and zeroed): psum and counts are filled only with an aux
  // loss on, zsq only with the z-loss on; the others stay 0. One thread per sequence, tokens in
  // order.
  Op<void(RouterStatistics& st, const float* logits, const RouterSpec& s, int64_t B, int64_t T)> router_statistics{
      "router_statistics"};
  // dlogits += scale * d(aux losses)/d(logits) for the tokens [first, first + rows) of the micro-batch
  // of B sequences of T tokens (dlogits holds those rows, logits all (B T, E)), with
  // aux_loss_weights' g and gseq.
  Op<void(float* dlogits, const float* logits, const RouterSpec& s, int64_t B, int64_t T, const double* g,
          const double* gseq, float scale, int64_t first, int64_t rows)>
      aux_losses_backward{"aux_losses_backward"};
  // Router-input jitter (moe.input_jitter_eps): u[i] = lo + width * uniform of Philox (seed, purpose)
  // at element rows[i / C] * C + i % C (the token's row in the step's batch: the same draw in every
  // layout), y[i] = x[i] * u[i], for the N x C elements.
  Op<void(float* u, float* y, const float* x, const int64_t* rows, int64_t N, int64_t C, uint64_t seed,
          uint64_t purpose, float lo, float width)>
      router_jitter{"router_jitter"};

  template <class F>
  void each(F&& f) {
    f(route_topk), f(route_topk_backward), f(apply_capacity), f(router_statistics), f(aux_losses_backward),
        f(router_jitter);
  }
};

}  // namespace lockstep
