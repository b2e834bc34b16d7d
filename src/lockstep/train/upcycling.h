// Upcycling (moe.use_upcycling; Megatron's --moe-use-upcycling): an MoE job initialised from a
// dense checkpoint. With granularity G = model.ffn_hidden_size / moe.ffn_hidden_size and E experts,
// expert e = r G + g (copy r of E / G, slice g of G) is slice g of its layer's dense MLP: rows
// [g F/G, (g+1) F/G) of the fc (of the gate and of the up half under SwiGLU) and the same columns
// of the proj. The router keeps its random initialisation, but its first E / G rows are repeated G
// times (expert r G + g gets row r), so a copy's G slices always score the same and the top k
// (a multiple of G) take whole copies.
//
// Output scale. With the top-k weights renormalised (router_pre_softmax = false) each chosen copy's
// G slices share its weight q_c / G and the q_c sum to one, so the proj is scaled by G: the MoE
// layer then computes the dense MLP exactly (up to the order of the sums; the tests require 1e-6
// relative). With router_pre_softmax = true the chosen weights do not sum to one; the proj is
// scaled by E G / K, which makes them do so on average at a uniform router (Megatron's factor;
// approximate). Megatron spreads the scale over fc and proj as s^(1/3) each under SwiGLU; SiLU is
// not homogeneous, so that is not exact, and lockstep puts the whole scale on the proj, where the
// output is linear in it. Every other parameter (attention, norms, embeddings, the MLPs of dense
// layers) is copied by name.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "lockstep/config/config.h"
#include "lockstep/core/tensor.h"

namespace lockstep {

class ParamStore;

// dense(name, shape): the dense checkpoint's whole tensor `name` (a lockstep parameter name of the
// dense model), checked to have `shape`; it raises the UserError for a missing one. Fills every
// parameter of ps (this rank's boxes).
void upcycle(ParamStore& ps, const ModelConfig& m, const MoeConfig& moe,
             const std::function<std::vector<float>(const std::string& name, const Shape& shape)>& dense);

}  // namespace lockstep
