// The compute seam: every op the model, parallel and train layers run, as one table that a backend
// binds (kernels/cpu/backend.h; a CUDA backend later, with the same op names). Callers reach it
// through their device (kernels/device.h): `device.ops.layernorm_forward(...)`. The layers above
// kernels/ never include a backend's headers (the build enforces it, docs/architecture.md).
//
// Each family's header states the ops' contract, which every backend meets: what each output
// element is, in which order each reduction runs, what is bitwise (across threads, layouts and, on
// the fp32 path, backends).
#pragma once

#include <cstdint>

#include "lockstep/kernels/activations.h"
#include "lockstep/kernels/attention.h"
#include "lockstep/kernels/copy.h"
#include "lockstep/kernels/cross_entropy.h"
#include "lockstep/kernels/elementwise.h"
#include "lockstep/kernels/embedding.h"
#include "lockstep/kernels/gate.h"
#include "lockstep/kernels/gemm.h"
#include "lockstep/kernels/norms.h"
#include "lockstep/kernels/optimizer.h"
#include "lockstep/kernels/permute.h"
#include "lockstep/kernels/quantize.h"
#include "lockstep/kernels/reduce.h"
#include "lockstep/kernels/rope.h"
#include "lockstep/kernels/router.h"

namespace lockstep {

struct Ops : CopyOps,
             ElementwiseOps,
             ReduceOps,
             GemmOps,
             AttentionOps,
             NormOps,
             ActivationOps,
             EmbeddingOps,
             RopeOps,
             CrossEntropyOps,
             PermuteOps,
             RouterOps,
             GateOps,
             QuantizeOps,
             OptimizerOps {
  Ops() = default;
  Ops(const Ops&) = delete;
  Ops& operator=(const Ops&) = delete;

  // Calls f on every op, family by family.
  template <class F>
  void each(F&& f) {
    CopyOps::each(f), ElementwiseOps::each(f), ReduceOps::each(f), GemmOps::each(f), AttentionOps::each(f),
        NormOps::each(f), ActivationOps::each(f), EmbeddingOps::each(f), RopeOps::each(f), CrossEntropyOps::each(f),
        PermuteOps::each(f), RouterOps::each(f), GateOps::each(f), QuantizeOps::each(f), OptimizerOps::each(f);
  }
};

// gemm on strided fp32 operands.
inline void gemm_f32(const Ops& ops, float* C, int64_t ldc, const float* A, int64_t lda, Trans ta, const float* B,
                     int64_t ldb, Trans tb, int64_t M, int64_t N, int64_t K, const GemmOptions& opt = {}) {
  ops.gemm(C, ldc, gemm_operand(A, lda, ta), gemm_operand(B, ldb, tb), M, N, K, opt);
}
// gemm on contiguous fp32 operands: lda, ldb, ldc are the natural row lengths.
inline void gemm_f32(const Ops& ops, float* C, const float* A, Trans ta, const float* B, Trans tb, int64_t M, int64_t N,
                     int64_t K, const GemmOptions& opt = {}) {
  ops.gemm(C, N, gemm_operand(A, ta == Trans::N ? K : M, ta), gemm_operand(B, tb == Trans::N ? N : K, tb), M, N, K,
           opt);
}

}  // namespace lockstep
