// The parallel plan of one rank: the communicators of its mesh groups (comm/mesh.h), and
// parallelize(), which applies the plan to a model: data-parallel gradient reduction and its hooks,
// the pipeline schedule and its hooks, and the precision's amax groups.
#pragma once

#include <memory>
#include <optional>

#include "lockstep/comm/communicator.h"
#include "lockstep/comm/mesh.h"
#include "lockstep/config/config.h"
#include "lockstep/model/gpt.h"
#include "lockstep/parallel/context_parallel.h"
#include "lockstep/parallel/data_parallel.h"
#include "lockstep/parallel/pipeline/pipeline.h"
#include "lockstep/parallel/tensor_parallel.h"

namespace lockstep {

// Every group this rank trains with, split from `world` once, in one fixed order (each split is
// collective over world). Not movable: the model and DataParallel keep pointers into it.
struct ParallelGroups {
  ParallelGroups(Communicator& world, const Config& config);
  ParallelGroups(const ParallelGroups&) = delete;
  ParallelGroups& operator=(const ParallelGroups&) = delete;

  Communicator& world;
  const Mesh mesh;  // checked_mesh(config, world.size())
  const MeshCoordinates coords;
  // Dense gradients and the loss sums are reduced over dp x cp: the cp ranks of a micro-batch each
  // hold two chunks of every sample (parallel/context_parallel.h) and add up their shares.
  Communicator dense_dp;
  Communicator expert_dp;  // edp: expert gradients
  Communicator tp_group;   // shares each micro-batch (same dp coordinate)
  Communicator cp_group;   // shares each micro-batch, split along the sequence
  // Layout mode under sequence parallelism (or an MoE model under tensor parallelism): combines the
  // token pieces of the parameters whose rows are a tp rank's share (combine_token_pieces).
  Communicator tp_cp_group;
  // The micro-batches' token counts are summed over dp only: every cp rank counts its whole
  // micro-batch. Megatron's global aux loss uses it for the same reason.
  Communicator dp_group;
  // Expert parallelism: the MoE layers' experts are split over ep, whose ranks exchange tokens in
  // every MoE layer (model/moe/alltoall_dispatcher.h, allgather_dispatcher.h).
  Communicator ep_group;
  // Expert tensor parallelism: each expert's hidden units are split over etp, which gathers its
  // tokens (model/moe/expert_tensor_parallel.h). The experts' parts differ over etp x ep.
  Communicator etp_group;
  // etp x ep: the ranks holding different experts or different slices of them, whose expert parts
  // the gradient norm adds (DataParallel::set_expert_parallel).
  Communicator tp_ep_group;
  // Pipeline parallelism: the ranks of a group (same tp, cp, dp coordinates) hold successive parts of
  // the model (parallel/pipeline/pipeline.h).
  Communicator pp_group;
  // The amax groups of FP8 per-tensor scales (amax_groups() in parallelize.cpp).
  Communicator tp_dp_cp_group;
  Communicator etp_edp_group;
  // With an expert x expert-tensor group smaller than tp x cp: the tp x cp ranks holding the same
  // experts (the expert amax group); in layout mode, those with the same expert-tensor coordinate
  // too, which sum each micro-batch's parts of the experts (model/moe/experts.h).
  std::optional<Communicator> same_experts;
  std::optional<Communicator> partners;
  // Context parallelism's attention under parallel.cp_comm_type = "a2a+p2p" (model/context_attention.h):
  // the all-to-all groups (consecutive cp ranks) and the rings, split from each cp group (the other
  // types run on cp_group).
  std::optional<Communicator> cp_a2a;
  std::optional<Communicator> cp_ring;
  // Bytes this rank has sent in its cp group and its subgroups.
  int64_t cp_bytes_sent() const {
    return cp_group.bytes_sent() + (cp_a2a ? cp_a2a->bytes_sent() : 0) + (cp_ring ? cp_ring->bytes_sent() : 0);
  }

  TensorParallel tp;
  ContextParallel cp;

  Communicator* ep() { return mesh.ep() > 1 ? &ep_group : nullptr; }
  Communicator* etp() { return mesh.etp() > 1 ? &etp_group : nullptr; }
  bool experts_split() const { return mesh.ep() > 1 || mesh.etp() > 1; }
  bool pipelined() const { return mesh.pp() > 1; }
};

// The stage of the model this rank holds (the whole model without pipeline parallelism).
StagePart stage_part(const Config& config, const ParallelGroups& groups);

// Applies the plan to `model`, whose gradients `dp` reduces: the precision's amax groups, data
// parallelism's set-up (tensor, context, expert and pipeline parallelism; layout mode's micro-batch
// tree) and the backward hooks that hand it finished gradients, and the forward hook of an
// overlapped parameter gather. Returns the pipeline schedule under pipeline parallelism, else null.
// The model keeps hooks into `dp` and the pipeline: both must outlive its training.
std::unique_ptr<Pipeline> parallelize(GPT& model, DataParallel& dp, ParallelGroups& groups, const Config& config);

}  // namespace lockstep
