#include "lockstep/train/parallelize.h"

#include <algorithm>
#include <vector>

#include "lockstep/core/error.h"
#include "lockstep/parallel/pipeline/schedule.h"
#include "lockstep/train/trainer.h"

namespace lockstep {

namespace {

// The groups of kind g, each split into the ranks with the same experts: the same expert-parallel
// coordinate, and with `etp` the same expert-tensor one too (the expert amax group and the partners
// of an expert group smaller than tp x cp, model/moe/experts.h).
std::vector<std::vector<int>> same_expert_groups(const Mesh& mesh, MeshGroup g, bool etp) {
  std::vector<std::vector<int>> out;
  for (const std::vector<int>& group : mesh.groups(g)) {
    std::vector<std::vector<int>> by(static_cast<size_t>(mesh.ep() * (etp ? mesh.etp() : 1)));
    for (int r : group) {
      const MeshCoordinates c = mesh.coordinates(r);
      by[static_cast<size_t>(etp ? c.ep * mesh.etp() + c.etp : c.ep)].push_back(r);
    }
    for (std::vector<int>& ranks : by)
      if (!ranks.empty()) out.push_back(std::move(ranks));
  }
  return out;
}

std::optional<Communicator> split_if(bool wanted, Communicator& world, const std::vector<std::vector<int>>& groups) {
  if (!wanted) return std::nullopt;
  return world.split_groups(groups);
}

TensorParallel tensor_parallel(Communicator& tp_group, const Config& config) {
  TensorParallel tp(&tp_group, config.parallel.sequence_parallel);
  if (config.determinism == "layout") {
    tp.segments = config.layout_segments;
    tp.token_segments = config.layout_token_segments;
  }
  return tp;
}

ContextParallel context_parallel(ParallelGroups& g, const Config& config) {
  const bool sequence_pieces = config.determinism == "layout" &&
                               (config.parallel.sequence_parallel || config.moe.num_experts > 0) && g.mesh.tp() > 1;
  ContextParallel cp(g.mesh.cp() > 1 ? &g.cp_group : nullptr,
                     g.mesh.cp() > 1 && sequence_pieces ? &g.tp_cp_group : nullptr);
  // Packed documents in run mode: each document cut into its own chunks (layout mode keeps the
  // sample's, on which its token segments lie).
  if (cp.on() && config.data.thd() && config.determinism != "layout") cp.cut_documents();
  if (cp.on()) {
    // One kind alone runs on the cp group itself; a2a+p2p on its subgroups.
    const auto [A, P] = config.parallel.context_a2a_ring();
    const bool ring = config.parallel.cp_comm_type != "all_gather" && P > 1;
    cp.set_comm_type(config.parallel.cp_comm_type,
                     A == 1   ? nullptr
                     : P == 1 ? &g.cp_group
                              : &*g.cp_a2a,
                     !ring    ? nullptr
                     : A == 1 ? &g.cp_group
                              : &*g.cp_ring);
  }
  return cp;
}

// parallel.cp_comm_type = "a2a+p2p" with both sizes above 1: the cp group split in two ways.
bool hierarchical_context(const Config& config) {
  const auto [A, P] = config.parallel.context_a2a_ring();
  return config.parallel.cp_comm_type == "a2a+p2p" && A > 1 && P > 1;
}

// Each cp group (in cp rank order) cut into its all-to-all groups of A consecutive ranks (ring = false)
// or its rings of the ranks A apart (ring = true).
std::vector<std::vector<int>> context_subgroups(const Mesh& mesh, int64_t A, bool ring) {
  std::vector<std::vector<int>> out;
  for (const std::vector<int>& group : mesh.groups(MeshGroup::cp)) {
    const auto P = static_cast<int64_t>(group.size()) / A;
    for (int64_t k = 0; k < (ring ? A : P); ++k) {
      std::vector<int>& sub = out.emplace_back();
      for (int64_t j = 0; j < (ring ? P : A); ++j)
        sub.push_back(group[static_cast<size_t>(ring ? j * A + k : k * A + j)]);
    }
  }
  return out;
}

// FP8 per-tensor scales come from amax values reduced over every rank holding a piece or replica
// of the tensor (tensor/precision.h). determinism = "layout" scales each micro-batch by its own
// tensors (docs/design/reductions.md#quantised-gemms-canonical-pieces), so there the data-parallel
// replicas are left out, except from delayed scaling's once-per-step update (the step's amax is the
// max over all its micro-batches). Evaluation scales each forward by its own tensors (tp x cp, etp)
// in either mode. An expert x expert-tensor group smaller than tp x cp sees part of a micro-batch's
// rows: its experts' group there is the tp x cp ranks holding the same experts (the same ep
// coordinate: all of tp x cp for a group of 1, the etp ranks and their partners for a divisor of
// tp x cp).
Precision::AmaxGroups amax_groups(ParallelGroups& g, const Config& config) {
  const bool own_micro_batch = config.determinism == "layout";
  Communicator* expert_batch = g.same_experts ? &*g.same_experts : &g.etp_group;
  Precision::AmaxGroups amax{own_micro_batch ? &g.tp_cp_group : &g.tp_dp_cp_group,
                             own_micro_batch ? expert_batch : &g.etp_edp_group, &g.tp_cp_group, expert_batch};
  amax.layout = own_micro_batch;
  // Pipeline schedules run other micro-batches' forwards between a micro-batch's forward and its
  // backward: delayed scaling updates once per step there too (in either mode).
  if (own_micro_batch || g.pipelined()) {
    amax.per_step = true;
    amax.dense_step = &g.tp_dp_cp_group;
    amax.expert_step = &g.etp_edp_group;
  }
  return amax;
}

// Data parallelism's view of the other dimensions, and in layout mode the micro-batch tree: the
// step's micro-batch gradients and scalar sums are combined exactly or along the canonical tree
// (parallel/data_parallel.h, docs/design/reductions.md#micro-batch-tree).
void set_up_data_parallel(GPT& model, DataParallel& dp, ParallelGroups& g, const Config& config) {
  const bool layout = config.determinism == "layout";
  const int64_t dp_size = g.mesh.dp();
  const int64_t accum = config.train.global_batch / (config.train.micro_batch * dp_size);
  // Megatron's global aux loss counts each micro-batch over the ranks holding the step's other ones:
  // the dp group only, since every tp and cp rank already counts its whole micro-batch (the router
  // logits are gathered over tp x cp).
  for (const auto& layer : model.moe_layers())
    if (layer) layer->set_data_parallel(&g.dp_group);
  if (g.tp.on()) dp.set_tensor_parallel(&g.tp_group);  // before set_layout, which reads the tp rank
  // Layout mode with an expert x expert-tensor group of G ranks smaller than the tp x cp group: the
  // tp cp / G groups of a tp x cp group hold the same experts for its other ranks, and sum each
  // micro-batch's parts over these partners (model/moe/experts.h): ranks j, j + G, ... of each tp x cp
  // group, the ranks of the tp x cp group with the same expert and expert-tensor coordinates.
  Communicator* partners = g.partners ? &*g.partners : nullptr;
  if (layout) {
    if (g.mesh.cp() > 1) dp.set_context_parallel(g.dp_group.rank(), g.cp_group.rank(), g.mesh.cp());
    dp.set_layout(accum, &g.world, g.experts_split(), partners ? partners->size() : 1);
    for (const auto& layer : model.moe_layers())
      if (layer)
        layer->set_layout(accum, accum * dp_size, dp.expert_block_first(), dp.expert_pieces(), partners,
                          dp.expert_tp_sum());
  }
  if (g.experts_split()) dp.set_expert_parallel(&g.tp_ep_group);
}

// The backward hooks that hand data parallelism each parameter's gradients once they are final.
std::unique_ptr<Pipeline> set_up_pipeline(GPT& model, DataParallel& dp, ParallelGroups& g, const Config& config) {
  const bool layout = config.determinism == "layout";
  if (!g.pipelined()) {
    model.set_grads_ready_hook([&dp, &model, layout](int first, int end) {
      // Layout: a micro-batch's sequence-parallel gradients and its context-parallel token pieces
      // (layout_token_segments) are complete before they become its leaf.
      if (layout) model.complete_micro_batch_grads(first, end);
      dp.grads_ready(first, end);
    });
    for (const auto& [owner, copy] : model.split_params()) dp.set_full_grads({owner, copy});
    return nullptr;
  }
  const TrainConfig& tc = config.train;
  const int64_t accum = tc.global_batch / (tc.micro_batch * g.mesh.dp());
  dp.set_pipeline_parallel(&g.pp_group);
  auto pipeline =
      std::make_unique<Pipeline>(g.pp_group, config.parallel, accum, tc.micro_batch * config.model.seq_length);
  // A chunk's parameters are final after its backward of the last micro-batch; the embedding
  // shared with another stage only once the stages' gradients are summed (after the schedule).
  // Layout mode pushes every micro-batch's gradients as its leaf, the shared embedding's stage
  // part too: each stage reduces its part over the data-parallel ranks, and the stages add the
  // reduced parts after finish_grad_sync.
  const std::vector<int> shared = layout ? std::vector<int>{} : model.shared_params();
  Pipeline* schedule = pipeline.get();
  model.set_grads_ready_hook([&dp, schedule, &model, shared, layout](int first, int end) {
    if (layout) {
      model.complete_micro_batch_grads(first, end);
      dp.push_grads(first, end, schedule->backward_micro());
    }
    if (!schedule->in_final_backward()) return;
    for (int i = first; i < end; ++i)
      if (std::find(shared.begin(), shared.end(), i) == shared.end()) dp.post_ready(i, i + 1);
  });
  if (layout) dp.set_full_grads(model.shared_params());
  return pipeline;
}

}  // namespace

Mesh checked_mesh(const Config& config, int world_size) {
  const TrainConfig& tc = config.train;
  const ParallelConfig& pc = config.parallel;
  const Mesh mesh(world_size, {static_cast<int>(pc.tensor), static_cast<int>(pc.context), static_cast<int>(pc.pipeline),
                               static_cast<int>(pc.expert), static_cast<int>(pc.expert_tensor)});
  // Each data-parallel rank takes its own micro-batches of the global batch (the ranks of a
  // context-parallel group share them: context parallelism splits sequences, not samples).
  const int64_t dp_size = mesh.dp();
  if (tc.global_batch % (tc.micro_batch * dp_size))
    user_error("train.global_batch = ", tc.global_batch, " is not divisible by train.micro_batch (", tc.micro_batch,
               ") x data-parallel size (", dp_size, " = ", world_size,
               " ranks / (parallel.tensor x parallel.context x "
               "parallel.pipeline = ",
               mesh.tp() * mesh.cp() * mesh.pp(), "))");
  const int64_t accum = tc.global_batch / (tc.micro_batch * dp_size);
  // The schedule refuses micro-batch counts it cannot run (interleaved 1F1B).
  if (mesh.pp() > 1)
    pipeline_schedule(pc.pipeline_schedule, mesh.pp(), static_cast<int>(pc.virtual_pipeline), accum, 0);
  const DebugConfig& dbg = config.debug;
  if (dbg.fail_at_step > 0 && dbg.fail_rank >= world_size)
    user_error("debug.fail_rank = ", dbg.fail_rank, ": the job has ", world_size, " rank(s)");
  if (dbg.fail_at_step > 0 && dbg.fail_mode == "hang" && world_size == 1)
    user_error(
        "debug.fail_mode = \"hang\" needs more than one rank: a hung rank is noticed by the others' "
        "collectives timing out");
  if (dbg.slow_ms > 0 && dbg.slow_rank >= world_size)
    user_error("debug.slow_rank = ", dbg.slow_rank, ": the job has ", world_size, " rank(s)");
  // determinism = "layout" takes any micro-batch count and layout: blocks of micro-batches that are
  // not subtrees of the canonical tree go as their pieces (parallel/data_parallel.h, model/moe/experts.h;
  // under context parallelism cp rank 0's, the other cp ranks' blocks empty: set_context_parallel;
  // with an expert group smaller than tp x cp the first partner's, the others' empty: expert_partners).
  return mesh;
}

// The member order is the order of the splits, which every rank must share.
ParallelGroups::ParallelGroups(Communicator& w, const Config& config)
    : world(w),
      mesh(checked_mesh(config, w.size())),
      coords(mesh.coordinates(w.rank())),
      dense_dp(w.split_groups(mesh.groups(MeshGroup::dp_cp))),
      expert_dp(w.split_groups(mesh.groups(MeshGroup::edp))),
      tp_group(w.split_groups(mesh.groups(MeshGroup::tp))),
      cp_group(w.split_groups(mesh.groups(MeshGroup::cp))),
      tp_cp_group(w.split_groups(mesh.groups(MeshGroup::tp_cp))),
      dp_group(w.split_groups(mesh.groups(MeshGroup::dp))),
      ep_group(w.split_groups(mesh.groups(MeshGroup::ep))),
      etp_group(w.split_groups(mesh.groups(MeshGroup::etp))),
      tp_ep_group(w.split_groups(mesh.groups(MeshGroup::tp_ep))),
      pp_group(w.split_groups(mesh.groups(MeshGroup::pp))),
      tp_dp_cp_group(w.split_groups(mesh.groups(MeshGroup::tp_dp_cp))),
      etp_edp_group(w.split_groups(mesh.groups(MeshGroup::etp_edp))),
      same_experts(split_if(mesh.ep() * mesh.etp() < mesh.tp() * mesh.cp(), w,
                            same_expert_groups(mesh, MeshGroup::tp_cp, false))),
      partners(
          split_if(config.determinism == "layout" && experts_split() && mesh.ep() * mesh.etp() < mesh.tp() * mesh.cp(),
                   w, same_expert_groups(mesh, MeshGroup::tp_cp, true))),
      cp_a2a(split_if(hierarchical_context(config), w,
                      context_subgroups(mesh, config.parallel.context_a2a_ring().first, false))),
      cp_ring(split_if(hierarchical_context(config), w,
                       context_subgroups(mesh, config.parallel.context_a2a_ring().first, true))),
      tp(tensor_parallel(tp_group, config)),
      cp(context_parallel(*this, config)) {}

StagePart stage_part(const Config& config, const ParallelGroups& groups) {
  // determinism = "layout": a tied head's or the MTP depths' word embedding keeps its last-stage
  // copy on one stage too (StagePart::split_embedding).
  StagePart part =
      groups.pipelined() ? pipeline_part(config.parallel, config.model.num_layers, groups.coords.pp) : StagePart{};
  part.split_embedding = config.determinism == "layout";
  return part;
}

std::unique_ptr<Pipeline> parallelize(GPT& model, DataParallel& dp, ParallelGroups& groups, const Config& config) {
  model.params().precision().set_amax_groups(amax_groups(groups, config));
  set_up_data_parallel(model, dp, groups, config);
  std::unique_ptr<Pipeline> pipeline = set_up_pipeline(model, dp, groups, config);
  // An overlapped parameter gather (the distributed optimizer) completes a layer's parameters just
  // before its forward needs them.
  if (config.optimizer.distributed && config.ddp.overlap_param_gather)
    model.set_params_needed_hook([&dp](int first, int end) { dp.params_needed(first, end); });
  return pipeline;
}

}  // namespace lockstep
