// The CPU cross entropy kernels (kernels/cross_entropy.h states the contract).
#pragma once

#include <cstdint>
#include "lockstep/kernels/cross_entropy.h"

namespace lockstep {

void cross_entropy_forward(float* losses, const float* logits, const int32_t* targets, int64_t N, int64_t V,
                           int64_t ld);
void cross_entropy_forward_backward(float* losses, float* logits, const int32_t* targets, int64_t N, int64_t V,
                                    int64_t ld, float grad_scale);
void cross_entropy_shard_lse(float* stats, float* cmax, float* logits, const int32_t* targets, int64_t N, int64_t V,
                             int64_t ld, int64_t vocab_begin, int64_t vocab_size, bool store);
void cross_entropy_combine(float* losses, float* lse, const float* stats, const int32_t* targets, int64_t N, int64_t P);
void cross_entropy_shard_backward(float* logits, const float* cmax, const float* lse, const int32_t* targets, int64_t N,
                                  int64_t V, int64_t ld, int64_t vocab_begin, float grad_scale);
void cross_entropy_segments_max(float* rowmax, const float* logits, const int32_t* targets, int64_t N, int64_t V,
                                int64_t ld, int64_t vocab_size);
void cross_entropy_segments_sum(float* stats, float* logits, const float* rowmax, const int32_t* targets, int64_t N,
                                int64_t V, int64_t ld, int64_t vocab_begin, int64_t vocab_size, int64_t segments,
                                bool store);
void cross_entropy_segments_loss(float* losses, const float* rowmax, const float* stats, const int32_t* targets,
                                 int64_t N);
void cross_entropy_segments_backward(float* logits, const float* stats, const int32_t* targets, int64_t N, int64_t V,
                                     int64_t ld, int64_t vocab_begin, float grad_scale);
void cross_entropy_segments(float* losses, float* logits, const int32_t* targets, int64_t N, int64_t V, int64_t ld,
                            int64_t segments, bool backward, float grad_scale, float* scratch);

}  // namespace lockstep
