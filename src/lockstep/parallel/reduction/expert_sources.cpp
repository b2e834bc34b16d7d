#include "lockstep/parallel/reduction/expert_sources.h"

#include "lockstep/core/error.h"
#include "lockstep/kernels/device.h"

namespace lockstep {

namespace {

// grad (E, n) = over each expert's G blocks of blocks (E x G, n): the rank-order sum, or the
// canonical tree.
void sum_blocks(const Ops& ops, float* grad, const float* blocks, int64_t E, int64_t G, int64_t n, bool tree) {
  std::vector<const float*> at(static_cast<size_t>(G));
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t g = 0; g < G; ++g) at[static_cast<size_t>(g)] = blocks + (e * G + g) * n;
    if (tree)
      ops.tree_sum(grad + e * n, at.data(), G, n);
    else
      ops.ordered_sum(grad + e * n, at.data(), G, n);
  }
}

class RankOrder final : public ExpertSourceSum {
 public:
  RankOrder(int64_t E, int64_t G, int64_t n) : E_(E), G_(G), n_(n) {}
  void add(const Ops& ops, const ParamStore& ps, int param, float* blocks, int64_t) override {
    sum_blocks(ops, ps.grad(param), blocks, E_, G_, n_, false);
  }

 private:
  int64_t E_, G_, n_;
};

class Tree final : public ExpertSourceSum {
 public:
  Tree(Device& device, int64_t E, int64_t G, int64_t n, int64_t micros, const std::vector<std::vector<int64_t>>& pieces,
       std::vector<GroupPiece> group)
      : E_(E), G_(G), n_(n), micros_(micros), group_(std::move(group)) {
    LOCKSTEP_CHECK(static_cast<int64_t>(pieces.size()) == G, "expert source trees: ", pieces.size(),
                   " blocks' pieces for ", G, " blocks");
    trees_.resize(static_cast<size_t>(E * G));
    for (int64_t k = 0; k < E * G; ++k)  // block k = (expert k / G, block k % G)
      trees_[static_cast<size_t>(k)].reset(device, n, pieces[static_cast<size_t>(k % G)]);
  }

  void add(const Ops& ops, const ParamStore& ps, int param, float* blocks, int64_t micro) override {
    for (int64_t k = 0; k < E_ * G_; ++k) trees_[static_cast<size_t>(k)].push(micro, blocks + k * n_, 0, n_);
    if (micro != micros_ - 1) return;
    if (group_.empty()) return sum_blocks(ops, ps.grad(param), blocks, E_, G_, n_, true);
    thread_local std::vector<const float*> pieces;  // all blocks' pieces, in order (kept across calls)
    for (int64_t e = 0; e < E_; ++e) {
      pieces.clear();
      for (int64_t g = 0; g < G_; ++g) {
        MicroBatchTree& t = trees_[static_cast<size_t>(e * G_ + g)];
        for (int64_t k = 0; k + 1 < t.pieces(); ++k) pieces.push_back(t.piece(k));
        pieces.push_back(blocks + (e * G_ + g) * n_);
      }
      for (const GroupPiece& p : group_) {
        float* dst = (p.table ? p.table + ps.specs()[static_cast<size_t>(param)].offset : ps.grad(param)) + e * n_;
        ops.piece_tree_sum(dst, pieces.data() + p.first, p.tree, n_);
      }
    }
  }

 private:
  int64_t E_, G_, n_, micros_;
  std::vector<MicroBatchTree> trees_;
  std::vector<GroupPiece> group_;
};

}  // namespace

std::unique_ptr<ExpertSourceSum> ExpertSourceSum::rank_order(int64_t E, int64_t G, int64_t n) {
  return std::make_unique<RankOrder>(E, G, n);
}

std::unique_ptr<ExpertSourceSum> ExpertSourceSum::tree(Device& device, int64_t E, int64_t G, int64_t n, int64_t micros,
                                                       const std::vector<std::vector<int64_t>>& pieces,
                                                       std::vector<GroupPiece> group) {
  return std::make_unique<Tree>(device, E, G, n, micros, pieces, std::move(group));
}

}  // namespace lockstep
