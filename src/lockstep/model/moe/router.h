// The MoE router: logits = x W_r^T (W_r: (E, C), no bias), then scores, top-k selection, routing
// weights, capacity dropping, and the load-balancing losses, all in FP32 (docs/moe.md states every
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
#include <string>
#include <vector>

#include "lockstep/config/config.h"
#include "lockstep/model/arena.h"
#include "lockstep/tensor/param_table.h"

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

// Per token: chooses K experts (idx, ascending) and their routing weights (probs) from logits
// (N, E). expert_bias (E) or null shifts the selection scores only (sigmoid).
void route_topk(int32_t* idx, float* probs, const float* logits, const float* expert_bias,
                const RouterSpec& s, int64_t N);
// dlogits (N, E) = d(probs)/d(logits)^T dprobs (assigned).
void route_topk_backward(float* dlogits, const float* dprobs, const float* logits, const int32_t* idx,
                         const RouterSpec& s, int64_t N);

// Expert capacity for N tokens: ceil(N * K / E * capacity_factor); 0 when dropless.
int64_t expert_capacity(const RouterSpec& s, int64_t N);
// kept (N, K): 1 where a choice survives the capacity (probs policy: an expert keeps its
// `capacity` highest-weight choices, ties to the earlier token; position policy: its first
// `capacity` choices in token order). All 1 when dropless.
void apply_capacity(uint8_t* kept, const int32_t* idx, const float* probs, const RouterSpec& s, int64_t N);

// The load-balancing losses of one micro-batch (each already multiplied by its coefficient).
struct AuxLosses {
  double aux = 0, seq_aux = 0, global_aux = 0, z = 0;
  double total() const { return aux + seq_aux + global_aux + z; }
};

// Scores the aux losses use: softmax(logits) over all E, or sigmoid(logits) normalised to sum 1.
// Their routing map is the plain top-K of these scores (no groups, no expert bias).
// Returns counts_seq (B, E): tokens per expert per sequence in that map.
// The global aux loss (Megatron's TopKRouter._apply_global_aux_loss): this micro-batch's counts are
// summed over the replicas (sum_over_replicas: an all-reduce over s.global_replicas ranks; null
// when there is one) into micro_counts (E, when given), and global_counts (E) = (prev_sum +
// micro_counts) / (prev_micro + 1) is their running mean over the step's micro-batches so far
// (Megatron's tracker; written for backward). The loss is the switch loss of this rank's
// probability sums against global_counts with the token count of all the replicas,
// coeff * E / (K (replicas N)^2) * sum_e P_e global_e: the replicas' terms add up to the switch
// loss of their joint batch (so the data-parallel mean, which the gradient follows, is that loss /
// replicas, as in Megatron).
AuxLosses aux_losses_forward(const float* logits, const RouterSpec& s, int64_t B, int64_t T,
                             const int64_t* prev_sum, int64_t prev_micro, float* global_counts,
                             std::vector<int64_t>& counts_seq, int64_t* micro_counts = nullptr,
                             const std::function<void(int64_t*, int64_t)>& sum_over_replicas = {});
// dlogits += scale * d(aux losses)/d(logits) for the tokens [first, first + rows) of the micro-batch
// (rows < 0: all N; dlogits holds those rows, logits all (N, E)): a tensor-parallel rank's rows.
void aux_losses_backward(float* dlogits, const float* logits, const RouterSpec& s, int64_t B, int64_t T,
                         const float* global_counts, const std::vector<int64_t>& counts_seq, float scale,
                         int64_t first = 0, int64_t rows = -1);

}  // namespace lockstep
