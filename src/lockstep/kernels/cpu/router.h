// The CPU router kernels (kernels/router.h states the contract).
#pragma once

#include <cstdint>

#include "lockstep/kernels/router.h"

namespace lockstep {

void route_topk(int32_t* idx, float* probs, const float* logits, const float* expert_bias, const RouterSpec& s,
                int64_t N);
void route_topk_backward(float* dlogits, const float* dprobs, const float* logits, const int32_t* idx,
                         const RouterSpec& s, int64_t N);
void apply_capacity(uint8_t* kept, const int32_t* idx, const float* probs, const RouterSpec& s, int64_t N);
void router_statistics(RouterStatistics& st, const float* logits, const RouterSpec& s, int64_t B, int64_t T);
void aux_losses_backward(float* dlogits, const float* logits, const RouterSpec& s, int64_t B, int64_t T,
                         const double* g, const double* gseq, float scale, int64_t first, int64_t rows);
void router_jitter(float* u, float* y, const float* x, const int64_t* rows, int64_t N, int64_t C, uint64_t seed,
                   uint64_t purpose, float lo, float width);

}  // namespace lockstep
