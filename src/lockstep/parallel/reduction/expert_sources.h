// An MoE layer's expert weight gradients when several sources' rows reach its experts (expert or
// expert-tensor parallelism): each (expert, block) accumulates its own buffer, and the parameter
// gradient is made of the blocks (docs/design/reductions.md#expert-parallelism-per-source-trees).
// One ExpertSourceSum per buffer (fc weight and bias, proj weight and bias), its scheme chosen once
// when the layer is set up (GroupedExperts' constructor and set_layout); after each micro-batch the
// layer hands it the blocks, and never tests the mode itself.
//   rank_order   (run mode) after every micro-batch, gradient = ((b_0 + b_1) + b_2) + ... over the
//                blocks in source order: data parallelism's sum over the same ranks, bit for bit;
//   tree         (layout) each block is one micro-batch's leaf, pushed into its source's canonical
//                tree over the step's micro-batches; after the last, gradient = the canonical tree
//                over the blocks;
//   pieces       (layout, blocks that are not subtrees of the step's tree) the same pushes keep each
//                block's canonical pieces; each piece of the expert group's block is the tree over
//                the pieces it holds, written to its table (DataParallel's piece tables; the last
//                piece to the gradient).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "lockstep/core/tree_sum.h"
#include "lockstep/parallel/reduction/micro_batch_tree.h"
#include "lockstep/tensor/param_table.h"

namespace lockstep {

struct Ops;
class Device;

class ExpertSourceSum {
 public:
  virtual ~ExpertSourceSum() = default;
  // blocks (E x G, n): micro-batch `micro`'s gradient of each (expert e, block g) at e G + g; the
  // scheme may zero or overwrite them. Writes parameter `param`'s gradient (E, n) of ps once it is
  // complete.
  virtual void add(const Ops& ops, const ParamStore& ps, int param, float* blocks, int64_t micro) = 0;

  // A piece of the expert group's block of micro-batches (pieces scheme): the tree over the
  // sources' pieces [first, end) (every source's pieces in source order) into `table` at the
  // parameter's offset (null: the gradient itself, the last piece).
  struct GroupPiece {
    PieceTree tree;
    int64_t first, end;
    float* table;
  };
  // E experts, G blocks each, n elements a block.
  static std::unique_ptr<ExpertSourceSum> rank_order(int64_t E, int64_t G, int64_t n);
  // micros: micro-batches per step; pieces[g]: block g's canonical pieces of the step's tree,
  // relative to its first micro-batch (core/tree_sum.h canonical_pieces); group: the expert group's
  // pieces (empty: one tree over the blocks).
  static std::unique_ptr<ExpertSourceSum> tree(Device& device, int64_t E, int64_t G, int64_t n, int64_t micros,
                                               const std::vector<std::vector<int64_t>>& pieces,
                                               std::vector<GroupPiece> group);
};

}  // namespace lockstep
