// The routed experts of one MoE layer: E MLPs (fc: C -> F, or C -> 2F as [gate | up] for SwiGLU;
// GELU / SwiGLU; proj: F -> C), run as one grouped GEMM per projection over the dispatcher's rows
// (kernels/cpu/grouped_gemm.h). The routing weight is not applied here: the combine multiplies each
// expert output by it (Megatron's unpermute; Megatron's grouped MLP folds it into the activation,
// which for a linear proj is the same function).
//
// Parameters: <prefix>fc.weight (E, Fw, C), fc.bias (E, Fw), proj.weight (E, C, F), proj.bias (E, C);
// biases only with model.bias. Under expert parallelism a rank holds the box of its experts
// [first, first + E) of the layer's E_global (param_table.h's global_shape and boxes), drawn at
// init exactly as the whole tensors would be. Under expert tensor parallelism (P ranks,
// expert_tensor_parallel.h) it holds, of each of its experts, the fc rows of its F / P hidden units
// (one box per expert and section: [gate | up] stay contiguous per expert, as the grouped GEMM
// reads them) and the proj columns of the same units; proj.bias only on etp rank 0.
//
// Weight gradients with several source ranks (sources > 1, expert parallelism): the rows of an
// expert come from the micro-batches of S ranks. Each (expert, source) block accumulates into its
// own buffer over the step's micro-batches, and after each backward the parameter gradient is the
// rank-order sum of the S buffers: ((g_0 + g_1) + g_2) + ... Each g_s is bitwise the gradient rank s
// accumulates for that expert when it computes all experts itself (the same rows in the same order,
// one FMA chain per element), and a data-parallel all-reduce sums those in the same order
// (comm/communicator.h): so expert parallelism over S ranks gives the expert gradients of data
// parallelism over the same S ranks bit for bit.
//
// determinism = "layout" (set_layout(A), A micro-batches per rank and step): each (expert, source)
// block is the gradient of ONE micro-batch of that source, computed from zero, and is pushed as a
// leaf into its own canonical-tree sum over the source's A micro-batches (core/tree_sum.h). After
// the last micro-batch the parameter gradient is the canonical tree over the S sources' sums: the
// expert-parallel group's micro-batches are the S sources' blocks of A in source order, so with A a
// power of two that is the canonical tree over the group's S x A micro-batches, bit for bit the
// single-process sum of their expert gradients. Until the last micro-batch the parameter gradient
// stays zero; data parallelism leaves these parameters to this class in that mode and reduces
// them over the expert data-parallel group along the canonical tree (data_parallel.h).
#pragma once

#include <string>
#include <vector>

#include "lockstep/config/config.h"
#include "lockstep/model/arena.h"
#include "lockstep/core/tree_sum.h"
#include "lockstep/model/param_table.h"

namespace lockstep {

struct ExpertsScratch {
  float* dact;  // (R, F)
  float* dfc;   // (R, Fw)
};

// Which part of a layer's experts a rank holds.
struct ExpertShard {
  int64_t first = 0, E_global = 0;  // experts [first, first + E) of E_global (0: E, all of them)
  int64_t sources = 1;              // ranks whose rows reach these experts (dispatcher / etp sources())
  int64_t etp_rank = 0, etp_size = 1;  // the slice of each expert's hidden units
};

struct GroupedExperts {
  GroupedExperts() = default;
  // E local experts of width F_global (this rank computes F_global / etp_size of it); max_rows: the
  // most rows a micro-batch can give these experts.
  GroupedExperts(ParamStore& ps, Arena& arena, const std::string& prefix, const ModelConfig& m, int64_t E,
                 int64_t F_global, int64_t max_rows, const ExpertShard& shard = ExpertShard{});

  // out (R, C) = expert_e(x) on the rows of each expert e.
  void forward(const ParamStore& ps, const Arena& arena, float* out, const float* x, const int64_t* offsets) const;
  // dx (R, C) assigned; parameter gradients accumulate. segments: (E x sources + 1) rows of
  // (expert e, source s) at [e * sources + s] (= offsets with one source).
  void backward(const ParamStore& ps, const Arena& arena, float* dx, const float* dout, const float* x,
                const int64_t* offsets, const int64_t* segments, const ExpertsScratch& s) const;
  // Start of an optimizer step: clears the per-source gradient buffers (sources > 1).
  void begin_step();
  // determinism = "layout" with `micros` micro-batches per rank and step (sources > 1 only; see above).
  void set_layout(int64_t micros);

  int64_t fc_width() const { return swiglu ? 2 * F : F; }

  int fc_w = -1, fc_b = -1, proj_w = -1, proj_b = -1;
  int64_t E = 0, C = 0, F = 0, sources = 1;  // F: this rank's hidden units per expert
  bool swiglu = false;
  // Per-source weight gradients (E x sources blocks each), sources > 1 only.
  FloatBuffer dfc_w, dfc_b, dproj_w, dproj_b;
  // Layout mode: one tree per (expert, source) block of each of the four buffers above, in that
  // order, and the step's micro-batch backward is at (backward is const for the parameters it
  // reads; these are the sums it builds).
  int64_t layout_micros = 0;
  mutable std::vector<TreeSum> trees;
  mutable int64_t micro = 0;
  ArenaSlice fc_out, act;  // (R, Fw), (R, F), saved for backward
};

}  // namespace lockstep
