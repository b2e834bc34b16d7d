#include "lockstep/kernels/cpu/backend.h"

#include "lockstep/core/exact_sum.h"
#include "lockstep/kernels/cpu/activations.h"
#include "lockstep/kernels/cpu/attention.h"
#include "lockstep/kernels/cpu/copy.h"
#include "lockstep/kernels/cpu/cross_entropy.h"
#include "lockstep/kernels/cpu/elementwise.h"
#include "lockstep/kernels/cpu/embedding.h"
#include "lockstep/kernels/cpu/gate.h"
#include "lockstep/kernels/cpu/gemm.h"
#include "lockstep/kernels/cpu/grouped_gemm.h"
#include "lockstep/kernels/cpu/norms.h"
#include "lockstep/kernels/cpu/optimizer.h"
#include "lockstep/kernels/cpu/permute.h"
#include "lockstep/kernels/cpu/quantize.h"
#include "lockstep/kernels/cpu/reduce.h"
#include "lockstep/kernels/cpu/rope.h"
#include "lockstep/kernels/cpu/router.h"

namespace lockstep {

// Each op binds the CPU kernel of the same name whose signature is the op's (overloads resolve by
// it). The kernels run on the calling thread's pool: no device context.
void bind_cpu_ops(Ops& ops) {
  ops.gate_forward.bind(&gate_forward);
  ops.gate_backward.bind(&gate_backward);
  ops.gate_weight_grad.bind(&gate_weight_grad);
  ops.gate_input_grad.bind(&gate_input_grad);
  ops.route_topk.bind(&route_topk);
  ops.route_topk_backward.bind(&route_topk_backward);
  ops.apply_capacity.bind(&apply_capacity);
  ops.router_statistics.bind(&router_statistics);
  ops.aux_losses_backward.bind(&aux_losses_backward);
  ops.router_jitter.bind(&router_jitter);
  ops.tree_sum.bind(&tree_sum);
  ops.ordered_sum.bind(&ordered_sum);
  ops.piece_tree_sum.bind(&piece_tree_sum);
  ops.tree_push_block.bind(&tree_push_block);
  ops.tree_fold.bind(&tree_fold);
  ops.add_positions.bind(&add_positions);
  ops.fill.bind(&fill);
  ops.copy.bind(&copy);
  ops.copy_rows.bind(&copy_rows);
  ops.gather_rows.bind(&gather_rows);
  ops.scatter_rows.bind(&scatter_rows);
  ops.copy_row_blocks.bind(&copy_row_blocks);
  ops.transpose.bind(&transpose);
  ops.lookup_rows.bind(&lookup_rows);
  ops.add.bind(&add);
  ops.multiply.bind(&multiply);
  ops.add_product.bind(&add_product);
  ops.add_bias_rows.bind(&add_bias_rows);
  ops.add_group_bias.bind(&add_group_bias);
  ops.round_bf16.bind(&round_bf16);
  ops.pack_bf16.bind(&pack_bf16);
  ops.unpack_bf16.bind(&unpack_bf16);
  ops.zero_rows_of_zeros.bind(&zero_rows_of_zeros);
  ops.gemm.bind(&gemm);
  ops.gemm_batch.bind(&gemm_batch);
  ops.grouped_gemm.bind(&grouped_gemm);
  ops.grouped_gemm_wgrad.bind(&grouped_gemm_wgrad);
  ops.grouped_bias_grad.bind(&grouped_bias_grad);
  ops.grouped_gemm_segmented.bind(&grouped_gemm_segmented);
  ops.attention_forward.bind(&attention_forward);
  ops.attention_backward.bind(&attention_backward);
  ops.attention_forward_chunks.bind(&attention_forward_chunks);
  ops.attention_backward_chunks.bind(&attention_backward_chunks);
  ops.attention_forward_partial.bind(&attention_forward_partial);
  ops.attention_backward_partial.bind(&attention_backward_partial);
  ops.attention_merge.bind(&attention_merge);
  ops.layernorm_forward.bind(&layernorm_forward);
  ops.layernorm_backward.bind(&layernorm_backward);
  ops.rmsnorm_forward.bind(&rmsnorm_forward);
  ops.rmsnorm_backward.bind(&rmsnorm_backward);
  ops.gelu_forward.bind(&gelu_forward);
  ops.gelu_backward.bind(&gelu_backward);
  ops.swiglu_forward.bind(&swiglu_forward);
  ops.swiglu_backward.bind(&swiglu_backward);
  ops.embedding_forward.bind(&embedding_forward);
  ops.embedding_backward.bind(&embedding_backward);
  ops.bias_backward.bind(&bias_backward);
  ops.rope_forward.bind(&rope_forward);
  ops.rope_backward.bind(&rope_backward);
  ops.cross_entropy_forward.bind(&cross_entropy_forward);
  ops.cross_entropy_forward_backward.bind(&cross_entropy_forward_backward);
  ops.cross_entropy_shard_lse.bind(&cross_entropy_shard_lse);
  ops.cross_entropy_combine.bind(&cross_entropy_combine);
  ops.cross_entropy_shard_backward.bind(&cross_entropy_shard_backward);
  ops.cross_entropy_segments_max.bind(&cross_entropy_segments_max);
  ops.cross_entropy_segments_sum.bind(&cross_entropy_segments_sum);
  ops.cross_entropy_segments_loss.bind(&cross_entropy_segments_loss);
  ops.cross_entropy_segments_backward.bind(&cross_entropy_segments_backward);
  ops.cross_entropy_segments.bind(&cross_entropy_segments);
  ops.permute_forward.bind(&permute_forward);
  ops.permute_backward.bind(&permute_backward);
  ops.combine_forward.bind(&combine_forward);
  ops.combine_backward.bind(&combine_backward);
  ops.quantize_tensorwise.bind(&quantize_tensorwise);
  ops.quantize_blockwise.bind(&quantize_blockwise);
  ops.quantize_mxfp8.bind(&quantize_mxfp8);
  ops.quantize_nvfp4.bind(&quantize_nvfp4);
  ops.dequantize.bind(&dequantize);
  ops.amax.bind(&amax);
  ops.hadamard16.bind(&hadamard16);
  ops.adamw_update.bind(&adamw_update);
  ops.adamw_update_hashed.bind(&adamw_update_hashed_items);
  ops.adam_state_hashes.bind(&adam_state_hashes);
  ops.sum_of_squares.bind(&sum_of_squares);
  ops.exact_sum_of_squares.bind(&exact_sum_of_squares);
}

}  // namespace lockstep
