// The CPU GEMM (kernels/gemm.h states the contract): packed panels and register-blocked AVX-512,
// AVX2 and portable micro-kernels that continue each element's FMA chain over K (gemm.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "lockstep/kernels/gemm.h"

namespace lockstep {

void gemm(float* C, int64_t ldc, const float* A, int64_t lda, Trans ta, const float* B, int64_t ldb, Trans tb,
          int64_t M, int64_t N, int64_t K, const GemmOptions& opt = {});

// Contiguous operands: lda/ldb/ldc are the natural row lengths.
inline void gemm(float* C, const float* A, Trans ta, const float* B, Trans tb, int64_t M, int64_t N, int64_t K,
                 const GemmOptions& opt = {}) {
  gemm(C, N, A, ta == Trans::N ? K : M, ta, B, tb == Trans::N ? N : K, tb, M, N, K, opt);
}

// C(M, N) = init + op(A)(M, K) * op(B)(K, N) with A and B in any storage; options as gemm()'s.
void gemm(float* C, int64_t ldc, const GemmOperand& A, const GemmOperand& B, int64_t M, int64_t N, int64_t K,
          const GemmOptions& opt = {});

void gemm_batch(const GemmBatchItem* items, int64_t count);

// Which micro-kernel gemm() runs on this machine ("avx512-4x64", "avx2-6x16", "portable").
const char* gemm_kernel_name();

namespace detail {
// The portable micro-kernel path, exposed so tests can check it against the vector one bitwise.
void gemm_portable(float* C, int64_t ldc, const float* A, int64_t lda, Trans ta, const float* B, int64_t ldb, Trans tb,
                   int64_t M, int64_t N, int64_t K, const GemmOptions& opt);
// Every micro-kernel this build has and this CPU can run (gemm_kernel_name() among them), and
// gemm() forced onto one of them: tests check each against the others bitwise, also the AVX2 kernel
// on a machine where gemm() would pick AVX-512.
std::vector<std::string> gemm_kernels();
void gemm_with_kernel(const std::string& kernel, float* C, int64_t ldc, const float* A, int64_t lda, Trans ta,
                      const float* B, int64_t ldb, Trans tb, int64_t M, int64_t N, int64_t K, const GemmOptions& opt);
void gemm_with_kernel(const std::string& kernel, float* C, int64_t ldc, const GemmOperand& A, const GemmOperand& B,
                      int64_t M, int64_t N, int64_t K, const GemmOptions& opt);
}  // namespace detail

}  // namespace lockstep
