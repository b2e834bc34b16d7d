// The rank mesh against hand-written layouts (Megatron-Core's documented examples and a folded
// dense/expert layout), its invariants over many sizes, and the validation messages.
#include <gtest/gtest.h>

#include <algorithm>

#include "lockstep/comm/mesh.h"
#include "lockstep/core/error.h"

namespace lockstep {
namespace {

using Groups = std::vector<std::vector<int>>;

TEST(Mesh, OrthogonalGroupsMatchMegatronsWorkedExample) {
  // generate_masked_orthogonal_rank_groups' docstring: sizes [tp 2, dp 3, pp 4], the dp groups.
  const Groups g = orthogonal_rank_groups(24, {2, 3, 4}, {false, true, false});
  ASSERT_EQ(g.size(), 8u);
  EXPECT_EQ(g[0], (std::vector<int>{0, 2, 4}));
  EXPECT_EQ(g[1], (std::vector<int>{1, 3, 5}));
  EXPECT_EQ(g[7], (std::vector<int>{19, 21, 23}));
}

TEST(Mesh, SixteenRanksTensorTwoPipelineFour) {
  // initialize_model_parallel's docstring: 16 GPUs, tp 2, pp 4 (dp 2).
  const Mesh m(16, {2, 1, 4, 1, 1});
  EXPECT_EQ(m.dp(), 2);
  EXPECT_EQ(m.groups(MeshGroup::tp), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}));
  EXPECT_EQ(m.groups(MeshGroup::dp), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(m.groups(MeshGroup::pp), (Groups{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}}));
  EXPECT_EQ(m.groups(MeshGroup::embedding), (Groups{{0, 12}, {1, 13}, {2, 14}, {3, 15}}));
  EXPECT_EQ(m.groups(MeshGroup::position_embedding), (Groups{{0}, {1}, {2}, {3}}));
}

TEST(Mesh, ContextGroupsSpanTensorGroups) {
  // The context_parallel_size docstring: 8 GPUs, tp 4, cp 2.
  const Mesh m(8, {4, 2, 1, 1, 1});
  EXPECT_EQ(m.groups(MeshGroup::cp), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(m.groups(MeshGroup::tp), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(m.groups(MeshGroup::dp_cp), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(m.groups(MeshGroup::tp_cp), (Groups{{0, 1, 2, 3, 4, 5, 6, 7}}));
}

TEST(Mesh, FoldedExpertMeshSixteenRanks) {
  // Dense: tp 2, cp 1, dp 4, pp 2 (rank = tp + 2 dp + 8 pp).
  // Expert over the same ranks: etp 1, ep 4, edp 2, pp 2 (rank = ep + 4 edp + 8 pp).
  const Mesh m(16, {2, 1, 2, 4, 1});
  EXPECT_EQ(m.dp(), 4);
  EXPECT_EQ(m.edp(), 2);
  EXPECT_EQ(m.groups(MeshGroup::tp), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}));
  EXPECT_EQ(m.groups(MeshGroup::dp), (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}));
  EXPECT_EQ(m.groups(MeshGroup::dp_cp), m.groups(MeshGroup::dp));
  EXPECT_EQ(m.groups(MeshGroup::pp), (Groups{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}}));
  EXPECT_EQ(m.groups(MeshGroup::tp_pp), (Groups{{0, 1, 8, 9}, {2, 3, 10, 11}, {4, 5, 12, 13}, {6, 7, 14, 15}}));
  EXPECT_EQ(m.groups(MeshGroup::embedding), m.groups(MeshGroup::pp));
  EXPECT_EQ(m.groups(MeshGroup::ep), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}));
  EXPECT_EQ(m.groups(MeshGroup::tp_ep), m.groups(MeshGroup::ep));
  EXPECT_EQ(m.groups(MeshGroup::edp), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}));
  EXPECT_EQ(m.groups(MeshGroup::etp).size(), 16u);
  EXPECT_EQ(m.groups(MeshGroup::tp_ep_pp), (Groups{{0, 1, 2, 3, 8, 9, 10, 11}, {4, 5, 6, 7, 12, 13, 14, 15}}));
  const MeshCoordinates c = m.coordinates(13);
  EXPECT_EQ((std::vector<int>{c.tp, c.cp, c.dp, c.pp, c.etp, c.ep, c.edp}), (std::vector<int>{1, 0, 2, 1, 0, 1, 1}));
  EXPECT_EQ(m.group_of(MeshGroup::edp, 13), (std::vector<int>{9, 13}));
}

TEST(Mesh, ExpertTensorGroupsAreFastest) {
  const Mesh m(8, {2, 1, 1, 2, 2});  // etp 2, ep 2, edp 2
  EXPECT_EQ(m.groups(MeshGroup::etp), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(m.groups(MeshGroup::ep), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(m.groups(MeshGroup::tp_ep), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(m.groups(MeshGroup::edp), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(m.groups(MeshGroup::etp_edp), (Groups{{0, 1, 4, 5}, {2, 3, 6, 7}}));  // the ranks holding one expert
}

TEST(Mesh, EveryGroupKindPartitionsTheWorldAndAgreesWithCoordinates) {
  for (int world : {1, 2, 4, 6, 8, 12, 16, 24}) {
    for (int tp : {1, 2, 3})
      for (int cp : {1, 2})
        for (int pp : {1, 2})
          for (int ep : {1, 2, 4})
            for (int etp : {1, 2}) {
              if (world % (tp * cp * pp) || world % (etp * ep * pp)) continue;
              const Mesh m(world, {tp, cp, pp, ep, etp});
              for (MeshGroup g :
                   {MeshGroup::tp, MeshGroup::cp, MeshGroup::dp, MeshGroup::dp_cp, MeshGroup::pp, MeshGroup::tp_cp,
                    MeshGroup::tp_pp, MeshGroup::tp_dp_cp, MeshGroup::ep, MeshGroup::etp, MeshGroup::edp,
                    MeshGroup::tp_ep, MeshGroup::tp_ep_pp, MeshGroup::etp_edp}) {
                std::vector<int> all;
                for (const auto& grp : m.groups(g)) all.insert(all.end(), grp.begin(), grp.end());
                std::sort(all.begin(), all.end());
                for (int r = 0; r < world; ++r) ASSERT_EQ(all[r], r) << mesh_group_name(g) << " world " << world;
              }
              for (int r = 0; r < world; ++r) {
                const MeshCoordinates c = m.coordinates(r);
                EXPECT_EQ(m.group_of(MeshGroup::tp, r)[c.tp], r);
                EXPECT_EQ(m.group_of(MeshGroup::cp, r)[c.cp], r);
                EXPECT_EQ(m.group_of(MeshGroup::dp, r)[c.dp], r);
                EXPECT_EQ(m.group_of(MeshGroup::pp, r)[c.pp], r);
                EXPECT_EQ(m.group_of(MeshGroup::ep, r)[c.ep], r);
                EXPECT_EQ(m.group_of(MeshGroup::etp, r)[c.etp], r);
                EXPECT_EQ(m.group_of(MeshGroup::edp, r)[c.edp], r);
                // Folding: both meshes share the pipeline groups.
                EXPECT_EQ(r / (world / pp), c.pp);
              }
            }
  }
}

TEST(Mesh, ValidationNamesTheSizesThatDoNotFit) {
  auto message = [](int world, ParallelSizes s) {
    try {
      Mesh(world, s);
    } catch (const UserError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message(6, {4, 1, 1, 1, 1}),
            "parallel: world size 6 is not divisible by tensor (4) x context (1) x pipeline (1)");
  EXPECT_EQ(message(8, {1, 1, 2, 3, 1}),
            "parallel: world size 8 is not divisible by expert_tensor (1) x expert (3) x pipeline (2)");
  EXPECT_EQ(message(8, {0, 1, 1, 1, 1}), "parallel.tensor = 0: must be positive");
}

}  // namespace
}  // namespace lockstep
