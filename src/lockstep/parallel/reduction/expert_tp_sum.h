// How the tensor-parallel ranks' parts of each micro-batch's expert gradients reach the expert
// data-parallel reduction in determinism = "layout" (MoE under tensor parallelism without expert,
// expert-tensor or context parallelism: every tp rank holds all experts and routes its own tokens).
// DataParallel::expert_tp_sum chooses; GroupedExperts::set_layout follows.
#pragma once

#include <cstdint>
#include <utility>

#include "lockstep/core/thread_pool.h"

namespace lockstep {

// Each micro-batch's parts are the tree over each rank's token segments, an aligned subtree of the
// micro-batch's; the expert reduction over the tp x dp ranks (tp fastest) adds -0 exactly.
enum class ExpertTpSum {
  on_first,  // each micro-batch's parts summed over tp onto tp rank 0, the others -0
  parts,     // one micro-batch per rank: each rank keeps its part, the reduction's tree over tp x dp adds them
  slices,    // the rank's micro-batches a subtree of the step's: each micro-batch's parts summed over tp as a
             // reduce-scatter, tp rank r keeping chunk r (chunk_begin over the parameter) of every expert
             // parameter and -0 elsewhere; the micro-batches' tree is pushed on the rank's chunks only
};

// ExpertTpSum::slices: the elements [begin, end) of an expert parameter of n elements that tp rank
// `rank` of `size` keeps (and pushes), the chunk Communicator::reduce_scatter_in_place leaves it.
inline std::pair<int64_t, int64_t> tp_chunk(int64_t n, int rank, int size) {
  return {chunk_begin(n, rank, size), chunk_begin(n, rank + 1, size)};
}

}  // namespace lockstep
