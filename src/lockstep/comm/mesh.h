// The rank mesh: which ranks form the tensor, context, data, pipeline and expert groups.
//
// Ranks are laid out in the order tp-cp-ep-dp-pp, tp fastest (Megatron-Core's default order and
// its RankGenerator semantics, so the groups match Megatron's for the same sizes):
//
//   dense mesh  (attention, dense MLP):  world = tp  x cp x dp  x pp   (ep = 1)
//   expert mesh (MoE layers):            world = etp x ep x edp x pp   (cp = 1)
//
// Both meshes cover the same ranks (MoE parallel folding): the expert mesh re-reads the ranks of a
// pipeline stage as (etp, ep, edp), so that, with tp fastest, an expert all-to-all stays among
// neighbouring ranks (the fastest links), and both meshes share the pipeline groups.
//
// A group of kind g is the set of ranks whose coordinates agree on every dimension not in g; its
// ranks are listed by the coordinates in g, fastest first (Megatron's
// generate_masked_orthogonal_rank_groups).
#pragma once

#include <string>
#include <vector>

namespace lockstep {

struct ParallelSizes {
  int tensor = 1, context = 1, pipeline = 1, expert = 1, expert_tensor = 1;
};

enum class MeshGroup {
  tp,                  // dense tensor parallel
  cp,                  // context parallel
  dp,                  // data parallel (dense)
  dp_cp,               // data x context: where dense gradients are reduced
  pp,                  // pipeline (same in both meshes)
  tp_cp,               // tensor x context
  tp_pp,               // model parallel: tensor x pipeline
  tp_dp_cp,            // every dense replica dimension but pipeline
  ep,                  // expert parallel
  etp,                 // expert tensor parallel
  edp,                 // expert data parallel: where expert gradients are reduced
  tp_ep,               // expert tensor x expert (Megatron's expert tensor-and-model group)
  tp_ep_pp,            // expert tensor x expert x pipeline
  etp_edp,             // expert tensor x expert data: every rank holding a piece or replica of an expert
  embedding,           // first and last pipeline stage of a pipeline group (tied embeddings)
  position_embedding,  // first pipeline stage
};

const char* mesh_group_name(MeshGroup g);

// A rank's coordinates in both meshes.
struct MeshCoordinates {
  int tp = 0, cp = 0, dp = 0, pp = 0;  // dense
  int etp = 0, ep = 0, edp = 0;        // expert (pp is shared)
};

class Mesh {
 public:
  // Validates the sizes against the world; UserError naming the sizes that do not fit.
  Mesh(int world_size, const ParallelSizes& sizes);

  int world_size() const { return world_; }
  int tp() const { return tp_; }
  int cp() const { return cp_; }
  int dp() const { return dp_; }
  int pp() const { return pp_; }
  int ep() const { return ep_; }
  int etp() const { return etp_; }
  int edp() const { return edp_; }

  // Every group of kind g (together they hold every rank once, except the embedding groups, which
  // hold one or two ranks per pipeline group).
  std::vector<std::vector<int>> groups(MeshGroup g) const;
  // The group of kind g that holds `rank` (empty for an embedding group the rank is not in).
  std::vector<int> group_of(MeshGroup g, int rank) const;
  MeshCoordinates coordinates(int rank) const;

 private:
  int world_, tp_, cp_, dp_, pp_, ep_, etp_, edp_;
};

// Megatron-Core's generate_masked_orthogonal_rank_groups: `sizes` of the dimensions, fastest first;
// the groups of the dimensions where mask is true.
std::vector<std::vector<int>> orthogonal_rank_groups(int world_size, const std::vector<int>& sizes,
                                                     const std::vector<bool>& mask);

}  // namespace lockstep
