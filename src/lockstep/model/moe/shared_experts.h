// The shared expert of an MoE layer (DeepSeek / Qwen style): a dense MLP every token goes through,
// of its own width (moe.shared_expert_intermediate_size), its output added to the routed experts'.
// With moe.shared_expert_gate its output is scaled per token by sigmoid(x . w_gate), w_gate (1, C)
// (Megatron's SharedExpertMLP gate).
//
// Parameters: <prefix>fc.*, <prefix>proj.*, <prefix>gate.weight (1, C).
#pragma once

#include <string>

#include "lockstep/config/config.h"
#include "lockstep/model/arena.h"
#include "lockstep/model/linear.h"

namespace lockstep {

struct SharedExpertScratch {
  float* dout;  // (N, C)
  float* dact;  // (N, F)
  float* dfc;   // (N, Fw)
  float* dx;    // (N, C)
};

struct SharedExpert {
  SharedExpert() = default;
  SharedExpert(ParamStore& ps, Arena& arena, const std::string& prefix, const ModelConfig& m, int64_t F, bool gate,
               int64_t N);

  // out (N, C) = base + gate * proj(act(fc(x))). out may alias base.
  void forward(const ParamStore& ps, const Arena& arena, float* out, const float* base, const float* x) const;
  // dx (N, C) += gradient through the shared expert of dout (N, C): branch_backward (every gradient
  // but that add, its input gradient in s.dx) then add_input_grad.
  void backward(const ParamStore& ps, const Arena& arena, float* dx, const float* dout, const float* x,
                const SharedExpertScratch& s) const {
    branch_backward(ps, arena, dout, x, s);
    add_input_grad(ps, arena, dx, s);
  }
  void branch_backward(const ParamStore& ps, const Arena& arena, const float* dout, const float* x,
                       const SharedExpertScratch& s) const;
  void add_input_grad(const ParamStore& ps, const Arena& arena, float* dx, const SharedExpertScratch& s) const;

  int64_t fc_width() const { return swiglu ? 2 * F : F; }

  Linear fc, proj;
  int gate_w = -1;
  int64_t N = 0, C = 0, F = 0;
  bool swiglu = false;
  ArenaSlice fc_out, act, y, gate;  // saved: (N, Fw), (N, F), (N, C) ungated output, (N) gate
  ArenaSlice dgate;                 // backward scratch: (N) the gate logits' gradient
};

}  // namespace lockstep
