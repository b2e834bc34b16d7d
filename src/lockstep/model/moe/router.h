// The MoE router's load-balancing losses for a layer: the statistics and gradients run as device
// ops (kernels/router.h, which also holds the routing ops and their contract: docs/moe.md states
// every formula and default); these combine them with the host-side rules.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "lockstep/kernels/ops.h"

namespace lockstep {

// The load-balancing losses of one micro-batch of B sequences of T tokens from its logits (B T, E)
// (each already multiplied by its coefficient). counts_seq (B, E): tokens per expert per sequence
// in the aux losses' routing map; the global aux loss's running counts as aux_losses_of says.
AuxLosses aux_losses_forward(const Ops& ops, const float* logits, const RouterSpec& s, int64_t B, int64_t T,
                             const int64_t* prev_sum, int64_t prev_micro, float* global_counts,
                             std::vector<int64_t>& counts_seq, int64_t* micro_counts = nullptr,
                             const std::function<void(int64_t*, int64_t)>& sum_over_replicas = {});
// dlogits += scale * d(aux losses)/d(logits) for the tokens [first, first + rows) of the micro-batch
// (rows < 0: all B T; dlogits holds those rows, logits all (B T, E)): a tensor-parallel rank's rows.
void aux_losses_backward(const Ops& ops, float* dlogits, const float* logits, const RouterSpec& s, int64_t B, int64_t T,
                         const float* global_counts, const std::vector<int64_t>& counts_seq, float scale,
                         int64_t first = 0, int64_t rows = -1);

// The aux-loss-free expert bias update (Megatron's get_updated_expert_bias) from a step's tokens per
// expert (E, summed over the replicas): bias += rate * sign(mean load - load); underloaded experts
// gain, an expert exactly at the mean keeps its bias.
void update_expert_bias(float* bias, const int64_t* counts, int64_t E, float rate);

}  // namespace lockstep
