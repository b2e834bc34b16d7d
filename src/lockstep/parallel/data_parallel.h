// Data parallelism: gradient buckets reduced over the data-parallel ranks, the distributed
// optimizer's shards (ZeRO-1, as Megatron's DistributedOptimizer) and the global gradient norm.
//
// The parameters of the table form two gradient buffers: dense parameters, reduced over the
// dp x cp group, and MoE expert parameters (ParamSpec::expert), reduced over the expert
// data-parallel group edp, so that folding works once expert parallelism splits the experts (the
// two groups are the same ranks while parallel.expert = 1). Each buffer is cut into buckets of at
// least ddp.bucket_size elements, whole parameters, starting from the end of the table (backward
// finishes the last parameters first). A bucket's gradients are packed into one contiguous
// buffer (the replicated optimizer reduces a bucket of consecutive parameters in place instead),
// padded to a multiple of the group size P; rank r of the group owns the chunk
// [r, r + 1) x padded / P of every bucket of its buffer: the elements whose optimizer state it
// keeps under optimizer.distributed, and whose gradients and state its fingerprint hashes in
// either mode.
//
// On the last micro-batch of a step (earlier ones accumulate locally, with no communication) a
// bucket is posted as soon as backward reports all its parameters final (GPT's grads-ready hook,
// ddp.overlap_grad_reduce), or after backward otherwise:
//   replicated optimizer:  all-reduce of the bucket, every rank gets every summed gradient;
//   distributed optimizer: reduce-scatter, each rank gets the sums of its chunk; after the
//                          update the chunks of updated parameters are all-gathered.
//
// Determinism: each summed gradient element is the rank-order sum of the P contributions
// (comm/communicator.h), whether it comes from an all-reduce or a reduce-scatter, whenever the
// bucket is posted; the update is elementwise; the gradient norm is the same fold of per-chunk
// sums of squares in both modes. So a step gives the same bits with the replicated and the
// distributed optimizer and with overlap on or off. ddp.bucket_size changes the grad norm's last
// bits (it groups and orders the partial sums), hence the clipped update's.
//
// determinism = "layout" (set_layout; docs/design/reductions.md#micro-batch-tree): the same bits for any number of
// data-parallel ranks and any spread of the step's micro-batches over them. Each micro-batch's
// gradient is computed from zero: as backward reports parameters final (the grads-ready hook, every
// micro-batch), their gradients are pushed as one leaf into a canonical-tree sum over the rank's
// micro-batches (core/tree_sum.h) and zeroed; the last micro-batch's push leaves the rank's tree sum
// in ps.grads(). The buckets are then reduced with ReduceOp::tree_sum, the canonical tree over
// ranks: with a power-of-two number of micro-batches per rank that is exactly the canonical tree
// over all the step's micro-batches, the single-process sum. With A micro-batches per rank that
// make some rank's block no subtree (A not a power of two, e.g. 3 ranks x 3), each rank's block is
// cut into its canonical pieces (canonical_pieces): the rank's tree keeps each piece's sum (the
// last one in ps.grads(), the others in K - 1 more gradient-sized buffers), and the buckets are
// reduced with the *_pieces collectives, which combine every rank's pieces along the canonical tree
// over the step's micro-batches (K times the reduce-scatter bytes of the power-of-two case; a
// packed bucket keeps one packed copy per piece). The gradient norm is the exact sum of
// squares (core/exact_sum.h) over each element once, so neither the chunking nor bucket_size
// changes it.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "lockstep/comm/communicator.h"
#include "lockstep/config/config.h"
#include "lockstep/core/tensor.h"
#include "lockstep/core/tree_sum.h"
#include "lockstep/parallel/reduction/expert_tp_sum.h"
#include "lockstep/parallel/reduction/micro_batch_tree.h"
#include "lockstep/tensor/param_table.h"

namespace lockstep {

class DataParallel {
 public:
  // dense: the dp x cp group; expert: the edp group. distributed: optimizer.distributed.
  DataParallel(ParamStore& ps, Communicator& dense, Communicator& expert, const DdpConfig& ddp, bool distributed);
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // This rank's elements: one range per parameter that meets one of its chunks, in bucket order.
  const std::vector<ParamRange>& shard() const { return shard_; }
  // The elements an optimizer of this rank updates: the shard (distributed) or every parameter.
  std::vector<ParamRange> optimizer_ranges() const;
  int64_t num_buckets() const { return static_cast<int64_t>(buckets_.size()); }

  // determinism = "layout": `micros` micro-batches per rank and step, rank r of the dense group
  // holding the step's micro-batches [r micros, (r + 1) micros); world: every rank of the job (the
  // gradient norm's exact sum runs over it). experts_summed: the model sums the expert parameters'
  // gradients over the micro-batches itself (expert parallelism, model/moe/experts.h): they are left
  // out of this class's tree and reduced over the expert group, whose rank g holds the step's
  // micro-batches [g G, (g + 1) G) (G = all / the group's size): with ReduceOp::tree_sum when every
  // such block is a subtree, else as the pieces the model writes into expert_pieces() and ps.grads().
  // Otherwise, when the expert group also holds each dense rank's tensor-parallel replicas (MoE under
  // tensor parallelism, ep = etp = 1: tp rank 0 holds the expert gradients, the others -0) and the
  // dense blocks go as pieces, the expert buckets go as tp rank 0's pieces, the replicas' blocks empty.
  // expert_partners (experts_summed): consecutive ranks of the expert group that hold parts of the
  // same micro-batches (an expert x expert-tensor group smaller than tp x cp: GroupedExperts::set_layout's
  // partners), the first giving their sum and the others -0 (as pieces: the first's block, the
  // others' empty).
  // Call set_tensor_parallel first.
  void set_layout(int64_t micros, Communicator* world, bool experts_summed = false, int expert_partners = 1);
  // Layout mode, experts_summed: where this rank's expert group's block starts among the step's
  // micro-batches, and the table-shaped buffers of its canonical pieces but the last (none when the
  // block is a subtree), for the model's experts to fill (GroupedExperts::set_layout).
  // The tables share the dense tree's buffers of its pieces where it has them (the experts' are
  // other elements of the same table shape).
  int64_t expert_block_first() const { return expert_first_; }
  // Layout mode, MoE under tensor parallelism without expert (tensor) or context parallelism: how the
  // model gives this rank's expert gradients (GroupedExperts::set_layout). The expert buckets go whole,
  // along the canonical tree over the expert group's tp x dp ranks in rank order, tp fastest; with one
  // micro-batch per rank (parts) the tp ranks' parts come in as they are and the reduction adds them as
  // one process would, with a subtree of micro-batches per rank (slices) each micro-batch's tp sum is
  // spread over the tp ranks, which push only their chunks, and otherwise tp rank 0 holds it (on_first).
  ExpertTpSum expert_tp_sum() const { return expert_tp_sum_; }
  std::vector<float*> expert_pieces();
  // Layout mode: the gradient-sized buffers held for pieces (the dense tree's and the experts'
  // tables beyond them): max(K - 1, K_expert - 1) for a rank with K dense and K_expert expert pieces.
  int64_t piece_buffers() const { return tree_.pieces() - 1 + static_cast<int64_t>(expert_pieces_.size()); }
  // Parameters whose summed gradient is needed at every element after finish_grad_sync, not only
  // at this rank's shard (layout mode: a shared word embedding's two parts are added after the
  // reduction, and the parts' shards differ): under the distributed optimizer their buckets are
  // all-reduced instead of reduce-scattered (the same bits at the shard: both sum each element
  // along the same tree over ranks).
  void set_full_grads(const std::vector<int>& params);
  // Before micro-batch `micro` (0-based, of this rank's step) under set_layout: the leaf its
  // gradients are pushed as.
  void begin_micro(int64_t micro);
  // Before the last micro-batch's backward: from here grads_ready() posts the buckets it completes
  // (when ddp.overlap_grad_reduce; otherwise it ignores the calls).
  void begin_last_micro();
  // Backward's hook (GPT::set_grads_ready_hook): parameters [first, end) are final. It is
  // push_grads (layout mode, as the begin_micro leaf) then post_ready.
  void grads_ready(int first, int end);
  // Layout mode: micro-batch `micro`'s gradients of parameters [first, end) are complete; pushes them
  // as that leaf of the canonical tree (and zeroes them, except for the last leaf). Pipelined, a
  // stage's model chunks interleave micro-batches, so the leaf comes with each call; the schedules
  // run each chunk's backwards in micro-batch order, the order the tree needs per element.
  void push_grads(int first, int end, int64_t micro);
  // Parameters [first, end) are final for the step: posts the buckets they complete (when armed).
  void post_ready(int first, int end);
  // After the last backward: posts the buckets not yet posted and waits for all. Then ps.grads()
  // holds the group's sum at every element of shard() (and at every element when not distributed).
  void finish_grad_sync();

  // Tensor parallelism: the gradient norm also sums over the tensor-parallel group (tp), counting
  // the parameters every tp rank holds (GradRole::tp_replicated) once, on tp rank 0.
  void set_tensor_parallel(Communicator* tp) { tp_ = tp; }
  // Context parallelism (layout mode; call before set_layout): the dense group is dp x cp and the
  // ranks of a cp group share their micro-batches, cp rank 0 holding each micro-batch's gradient and
  // the others -0 (combine_token_pieces). When the blocks are subtrees (a power of two of micro-batches
  // per rank) the tree over dp x cp adds the -0 exactly; otherwise the blocks go as pieces of the tree
  // over the step's micro-batches, cp rank 0 giving its dp rank's block and the others an empty one.
  // Unsplit MoE experts likewise over their expert group (dp x cp x tp): tp rank 0 of cp rank 0.
  void set_context_parallel(int dp_rank, int cp_rank, int cp_size) {
    cp_dp_rank_ = dp_rank, cp_rank_ = cp_rank, cp_size_ = cp_size;
  }
  // Expert (tensor) parallelism: the ranks of the expert-tensor x expert group (MeshGroup::tp_ep)
  // hold different experts or different slices of them, so the gradient norm adds their expert parts.
  void set_expert_parallel(Communicator* tp_ep) { ep_ = tp_ep; }
  // Pipeline parallelism: the stages hold different layers, so the gradient norm adds their totals
  // in stage order (a parameter's stage copy, GradRole::stage_copy, counted on its owner only).
  void set_pipeline_parallel(Communicator* pp) { pp_ = pp; }
  // The global gradient norm after finish_grad_sync: the square root of the dense plus the expert
  // buffer's sum of squares, each the rank-order fold of its P chunks' sums (the same bits whether
  // the chunks' sums are computed here or gathered from their owners); under tensor parallelism
  // the dense part is the tp ranks' parts folded in rank order, under expert (tensor) parallelism
  // the expert part is summed over the tp-ep group in rank order.
  double grad_norm();

  // The optimizer's update of `ranges` (a list of at most one range per parameter, every one
  // owned by this rank): step() calls it on the owned elements and the trainer supplies it.
  using Update = std::function<void(const std::vector<ParamRange>& ranges)>;
  // The optimizer step on the owned elements, bucket by bucket in forward order; distributed: each
  // bucket's updated chunks are all-gathered. Afterwards every rank holds every updated parameter,
  // except with ddp.overlap_param_gather: then the gathers run in the background and
  // params_needed() (GPT's forward hook) or wait_params() completes them.
  void step(const Update& update);
  // Whether step() updates every parameter whole in one call (not distributed): the fingerprint's
  // parameter hashes can then be taken in the update (the distributed optimizer's parameters are
  // complete only after its all-gather).
  bool updates_whole() const { return !distributed_; }
  // Parameters [first, end) are about to be read: completes their buckets' gathers.
  void params_needed(int first, int end);
  // Completes every gather still running (before anything but forward reads the parameters).
  void wait_params();
  // Buckets whose reduction the last backward posted itself (ddp.overlap_grad_reduce), and buckets
  // whose gather the last forward waited for (ddp.overlap_param_gather): what overlapped.
  int64_t buckets_posted_in_backward() const { return posted_in_backward_; }
  int64_t gathers_completed_in_forward() const { return gathered_in_forward_; }

 private:
  struct Bucket {
    Communicator* comm = nullptr;
    std::vector<int> params;       // table indices, ascending
    std::vector<int64_t> at;       // each parameter's offset in the packed bucket
    int64_t size = 0, chunk = 0;   // packed elements; elements per rank (padded size = chunk x P)
    std::vector<ParamRange> mine;  // this rank's chunk as parameter ranges
    int pending = 0;               // parameters not yet final this step
    bool posted = false;
    bool gathering = false;                    // an all-gather of its parameters is in flight
    bool full = false;                         // all-reduced even under the distributed optimizer (set_full_grads)
    int64_t in_place = -1, in_place_size = 0;  // replicated, consecutive parameters: the span of
                                               // ps.grads() reduced where it lies; -1 = packed
    FloatBuffer packed;                        // (chunk x P)
    bool pieced = false;                       // layout mode, reduced as pieces (set_layout)
    std::vector<FloatBuffer> packed_pieces;    // pieced and packed: pieces 0 .. K-2 (chunk x P each)
    FloatBuffer chunk_buf;                     // (chunk) reduce-scatter output / all-gather input
    Work work;
  };
  // Rank r's chunk of bucket b as parameter ranges.
  std::vector<ParamRange> chunk_ranges(const Bucket& b, int r) const;
  // Copies between a table-shaped buffer (ps.values() or ps.grads()) and a bucket's packed buffer
  // (every parameter) or its chunk buffer (this rank's chunk), in the direction `into`.
  enum class Into { packed, table };
  void copy_bucket(Bucket& b, float* table, Into into) const { copy_bucket(b, table, b.packed.data(), into); }
  void copy_bucket(const Bucket& b, float* table, float* packed, Into into) const;
  void copy_chunk(Bucket& b, float* table, Into into) const;
  void post(Bucket& b);
  void post_pieces(Bucket& b);
  void finish_gather(Bucket& b);
  // Rank r's chunk's sum of squares over every bucket of one buffer.
  double chunk_sum_of_squares(bool expert, int r) const;

  // Checks that the last micro-batch's backward reported every parameter once (layout mode).
  void check_pushed() const;
  bool pipelined() const { return pp_ && pp_->size() > 1; }
  ReduceOp reduce_op() const { return world_ ? ReduceOp::tree_sum : ReduceOp::sum; }

  ParamStore& ps_;
  Communicator* world_ = nullptr;  // set in layout mode
  MicroBatchTree tree_;
  std::vector<int64_t> blocks_;  // pieced: the dense group's blocks of micro-batches (P + 1 bounds)
  // experts_summed and pieced: the expert group's blocks, and this rank's pieces but the last
  std::vector<int64_t> expert_blocks_;
  std::vector<FloatBuffer> expert_pieces_;      // the tables beyond the dense tree's held pieces
  int64_t expert_first_ = 0, expert_held_ = 0;  // expert_held_: this rank's expert pieces but the last
  // Pieced, and the expert group holds tensor-parallel replicas of the dense ranks (not experts_summed)
  // or partners (experts_summed, expert_partners > 1): whether this rank's expert gradients count (tp
  // rank 0, the first partner; the others' blocks are empty).
  bool expert_keeps_ = true;
  // Context parallelism (set_context_parallel), pieced: whether this rank's dense pieces count (cp rank 0).
  bool dense_keeps_ = true;
  int cp_dp_rank_ = 0, cp_rank_ = 0, cp_size_ = 1;
  bool experts_summed_ = false;
  ExpertTpSum expert_tp_sum_ = ExpertTpSum::on_first;  // expert_tp_sum()
  int64_t micro_ = 0, pushed_ = 0;                     // the current leaf; parameters pushed as it
  Communicator& dense_;
  Communicator& expert_;
  Communicator* tp_ = nullptr;
  Communicator* ep_ = nullptr;
  Communicator* pp_ = nullptr;
  DdpConfig ddp_;
  bool distributed_;
  bool armed_ = false;
  int64_t posted_in_backward_ = 0, gathered_in_forward_ = 0;
  std::vector<Bucket> buckets_;  // in the order backward completes them
  std::vector<int> bucket_of_;   // per parameter
  std::vector<ParamRange> shard_;
};

}  // namespace lockstep
