// The CPU attention kernels (kernels/attention.h states the contract).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>
#include "lockstep/kernels/attention.h"

namespace lockstep {

void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                       int64_t HS, const int32_t* doc_start = nullptr);
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int64_t B,
                        int64_t T, int64_t NH, int64_t NKV, int64_t HS, const int32_t* doc_start = nullptr,
                        int64_t query_segments = 0);
void attention_forward_chunks(float* out, float* lse, const float* qkv, const float* kv, int64_t B, int64_t T,
                              const QueryChunks& chunks, int64_t NH, int64_t NKV, int64_t HS,
                              const int32_t* doc_start = nullptr);
void attention_backward_chunks(float* dqkv, float* dkv, const float* dout, const float* qkv, const float* kv,
                               const float* out, const float* lse, int64_t B, int64_t T, const QueryChunks& chunks,
                               int64_t NH, int64_t NKV, int64_t HS, const int32_t* doc_start = nullptr,
                               int64_t query_segments = 0);
void attention_forward_partial(float* out, float* lse, const float* qkv, const float* kv, int64_t B, int64_t T,
                               const QueryChunks& q_chunks, const QueryChunks& k_chunks, int64_t NH, int64_t NKV,
                               int64_t HS, const int32_t* doc_start = nullptr);
void attention_backward_partial(float* dqkv, float* dkv, const float* dout, const float* qkv, const float* kv,
                                const float* out, const float* lse, int64_t B, int64_t T, const QueryChunks& q_chunks,
                                const QueryChunks& k_chunks, int64_t NH, int64_t NKV, int64_t HS,
                                const int32_t* doc_start = nullptr);
void attention_merge(float* out, float* lse, const float* part_out, const float* part_lse, int64_t B, int64_t Tq,
                     int64_t NH, int64_t HS);
namespace detail {
// The portable forms, exposed so tests can check them against the AVX2 forms bitwise.
void attention_forward_portable(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                                int64_t HS, const int32_t* doc_start = nullptr);
void attention_backward_portable(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                                 int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS,
                                 const int32_t* doc_start = nullptr, int64_t query_segments = 0);
}  // namespace detail

}  // namespace lockstep
