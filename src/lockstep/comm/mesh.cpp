#include "lockstep/comm/mesh.h"

#include <algorithm>

#include "lockstep/core/error.h"

namespace lockstep {

const char* mesh_group_name(MeshGroup g) {
  switch (g) {
    case MeshGroup::tp:
      return "tp";
    case MeshGroup::cp:
      return "cp";
    case MeshGroup::dp:
      return "dp";
    case MeshGroup::dp_cp:
      return "dp-cp";
    case MeshGroup::pp:
      return "pp";
    case MeshGroup::tp_cp:
      return "tp-cp";
    case MeshGroup::tp_pp:
      return "tp-pp";
    case MeshGroup::tp_dp_cp:
      return "tp-dp-cp";
    case MeshGroup::ep:
      return "ep";
    case MeshGroup::etp:
      return "etp";
    case MeshGroup::edp:
      return "edp";
    case MeshGroup::tp_ep:
      return "tp-ep";
    case MeshGroup::tp_ep_pp:
      return "tp-ep-pp";
    case MeshGroup::etp_edp:
      return "etp-edp";
    case MeshGroup::embedding:
      return "embedding";
    case MeshGroup::position_embedding:
      return "position_embedding";
  }
  return "?";
}

std::vector<std::vector<int>> orthogonal_rank_groups(int world_size, const std::vector<int>& sizes,
                                                     const std::vector<bool>& mask) {
  // stride[d] = product of the sizes of the faster dimensions.
  std::vector<int> stride(sizes.size());
  int s = 1;
  for (size_t d = 0; d < sizes.size(); ++d) stride[d] = s, s *= sizes[d];
  LOCKSTEP_CHECK(s == world_size, "orthogonal_rank_groups: sizes multiply to ", s, ", world is ", world_size);
  std::vector<int> in_dims, out_dims;  // dimensions inside a group / indexing the groups
  int group_size = 1;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (mask[d])
      in_dims.push_back(static_cast<int>(d)), group_size *= sizes[d];
    else
      out_dims.push_back(static_cast<int>(d));
  }
  // Rank of the point whose coordinates along `dims` are the mixed-radix digits of index.
  auto offset = [&](int index, const std::vector<int>& dims) {
    int rank = 0;
    for (int d : dims) rank += (index % sizes[d]) * stride[d], index /= sizes[d];
    return rank;
  };
  std::vector<std::vector<int>> groups(world_size / group_size);
  for (int g = 0; g < static_cast<int>(groups.size()); ++g)
    for (int i = 0; i < group_size; ++i) groups[g].push_back(offset(g, out_dims) + offset(i, in_dims));
  return groups;
}

Mesh::Mesh(int world_size, const ParallelSizes& p)
    : world_(world_size), tp_(p.tensor), cp_(p.context), pp_(p.pipeline), ep_(p.expert), etp_(p.expert_tensor) {
  auto positive = [](const char* key, int v) {
    if (v < 1) user_error("parallel.", key, " = ", v, ": must be positive");
  };
  positive("tensor", tp_), positive("context", cp_), positive("pipeline", pp_), positive("expert", ep_),
      positive("expert_tensor", etp_);
  LOCKSTEP_CHECK(world_ >= 1, "world size ", world_);
  if (world_ % (tp_ * cp_ * pp_))
    user_error("parallel: world size ", world_, " is not divisible by tensor (", tp_, ") x context (", cp_,
               ") x pipeline (", pp_, ")");
  if (world_ % (etp_ * ep_ * pp_))
    user_error("parallel: world size ", world_, " is not divisible by expert_tensor (", etp_, ") x expert (", ep_,
               ") x pipeline (", pp_, ")");
  dp_ = world_ / (tp_ * cp_ * pp_);
  edp_ = world_ / (etp_ * ep_ * pp_);
}

std::vector<std::vector<int>> Mesh::groups(MeshGroup g) const {
  // Dimensions in the order tp-cp-ep-dp-pp; the dense mesh has ep = 1, the expert mesh cp = 1.
  const std::vector<int> dense = {tp_, cp_, 1, dp_, pp_}, expert = {etp_, 1, ep_, edp_, pp_};
  enum { TP = 1, CP = 2, EP = 4, DP = 8, PP = 16 };
  auto make = [&](const std::vector<int>& sizes, int dims) {
    std::vector<bool> mask(5);
    for (int d = 0; d < 5; ++d) mask[d] = (dims >> d) & 1;
    return orthogonal_rank_groups(world_, sizes, mask);
  };
  switch (g) {
    case MeshGroup::tp:
      return make(dense, TP);
    case MeshGroup::cp:
      return make(dense, CP);
    case MeshGroup::dp:
      return make(dense, DP);
    case MeshGroup::dp_cp:
      return make(dense, CP | DP);
    case MeshGroup::pp:
      return make(dense, PP);
    case MeshGroup::tp_cp:
      return make(dense, TP | CP);
    case MeshGroup::tp_pp:
      return make(dense, TP | PP);
    case MeshGroup::tp_dp_cp:
      return make(dense, TP | CP | DP);
    case MeshGroup::ep:
      return make(expert, EP);
    case MeshGroup::etp:
      return make(expert, TP);
    case MeshGroup::edp:
      return make(expert, DP);
    case MeshGroup::tp_ep:
      return make(expert, TP | EP);
    case MeshGroup::tp_ep_pp:
      return make(expert, TP | EP | PP);
    case MeshGroup::etp_edp:
      return make(expert, TP | DP);
    case MeshGroup::embedding:
    case MeshGroup::position_embedding: {
      std::vector<std::vector<int>> out;
      for (const auto& stages : make(dense, PP)) {
        if (g == MeshGroup::embedding && stages.size() > 1)
          out.push_back({stages.front(), stages.back()});
        else
          out.push_back({stages.front()});
      }
      return out;
    }
  }
  return {};
}

std::vector<int> Mesh::group_of(MeshGroup g, int rank) const {
  LOCKSTEP_CHECK(rank >= 0 && rank < world_, "rank ", rank, " outside a world of ", world_);
  for (auto& group : groups(g))
    if (std::find(group.begin(), group.end(), rank) != group.end()) return group;
  return {};
}

MeshCoordinates Mesh::coordinates(int rank) const {
  LOCKSTEP_CHECK(rank >= 0 && rank < world_, "rank ", rank, " outside a world of ", world_);
  MeshCoordinates c;
  c.tp = rank % tp_;
  c.cp = rank / tp_ % cp_;
  c.dp = rank / (tp_ * cp_) % dp_;
  c.pp = rank / (tp_ * cp_ * dp_);
  c.etp = rank % etp_;
  c.ep = rank / etp_ % ep_;
  c.edp = rank / (etp_ * ep_) % edp_;
  return c;
}

}  // namespace lockstep
