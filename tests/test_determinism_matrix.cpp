// The determinism regression matrix: one row per feature (or combination) that the `run` guarantee
// covers (docs/determinism.md). Each row trains a tiny model for a few steps three ways: with 2
// threads; with 1 thread; and with 2 threads stopped after step 2 (train.exit_interval, saving a
// checkpoint) and resumed from that checkpoint with 1 thread. All three must give byte-identical
// fingerprint files on every rank: the same job twice, 1 vs 2 threads, and resumed vs uninterrupted.
// The first run's fingerprints must also match the row's golden file (tests/golden.h).
// Adding a row is one line: name, config file, overrides, ranks ({docs} in an override is a small
// indexed dataset of byte documents ended by EOD 256).
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "golden.h"
#include "lockstep/comm/threads/thread_transport.h"
#include "lockstep/config/config.h"
#include "lockstep/data/indexed_dataset.h"
#include "lockstep/train/fingerprint.h"
#include "lockstep/train/trainer.h"
#include "testing.h"

namespace lockstep {
namespace {

struct Row {
  const char* name;
  const char* config;  // in configs/
  std::vector<std::string> overrides;
  int ranks = 1;  // threads-backend ranks (data parallel today)
};

// gtest prints a failing row by its name.
void PrintTo(const Row& row, std::ostream* os) { *os << row.name; }

const char* const kMoeBalance = "moe.router_load_balancing_type=aux_loss,seq_aux_loss,global_aux_loss";

const Row kRows[] = {
    {"gpt2", "debug.toml", {}},
    {"llama_gqa", "debug.toml", {"model.preset=llama", "model.num_query_groups=2"}},
    {"gpt2_untied_wsd", "debug.toml", {"model.tie_embeddings=false", "train.lr_schedule=wsd", "train.warmup_steps=1"}},
    {"moe_softmax_every_aux_loss", "moe-debug.toml", {kMoeBalance}},
    {"moe_softmax_pre_softmax_scaled",
     "moe-debug.toml",
     {"moe.router_pre_softmax=true", "moe.router_topk_scaling_factor=2"}},
    {"moe_sigmoid_groups",
     "moe-debug.toml",
     {"moe.router_score_function=sigmoid", "moe.router_num_groups=2", "moe.router_group_topk=1",
      "moe.router_topk_scaling_factor=2.5"}},
    {"moe_aux_loss_free_bias",
     "moe-debug.toml",
     {"moe.router_score_function=sigmoid", "moe.router_enable_expert_bias=true", "moe.router_bias_update_rate=0.01",
      "moe.router_load_balancing_type=none"}},
    {"moe_capacity_drop_probs", "moe-debug.toml", {"moe.expert_capacity_factor=0.75"}},
    {"moe_deepseek_mla",
     "moe-debug.toml",
     {"model.preset=llama", "model.multi_latent_attention=true", "model.q_lora_rank=24", "model.kv_lora_rank=16",
      "model.qk_head_dim=12", "model.qk_pos_emb_head_dim=4", "model.v_head_dim=10", "moe.router_score_function=sigmoid",
      "moe.router_enable_expert_bias=true", "moe.shared_expert_intermediate_size=32"}},
    {"moe_qwen3_qk_norm_head24",
     "moe-debug.toml",
     {"model.preset=llama", "model.qk_layernorm=true", "model.kv_channels=24", "model.num_query_groups=2"}},

    {"moe_capacity_drop_position_padded",
     "moe-debug.toml",
     {"moe.expert_capacity_factor=0.75", "moe.token_drop_policy=position", "moe.pad_expert_input_to_capacity=true"}},
    {"moe_shared_gated_jitter_dense_first",
     "moe-debug.toml",
     {"moe.shared_expert_intermediate_size=64", "moe.shared_expert_gate=true", "moe.input_jitter_eps=0.01",
      "moe.layer_freq=[0,1]"}},
    {"llama_moe_swiglu", "moe-debug.toml", {"model.preset=llama", "moe.router_topk=1"}},
    {"mtp_two_depths", "debug.toml", {"model.mtp_num_layers=2", "model.mtp_loss_scaling_factor=0.3"}},
    {"deepseek_style_moe_mtp",
     "moe-debug.toml",
     {"model.preset=llama", "model.mtp_num_layers=1", "moe.router_score_function=sigmoid",
      "moe.router_enable_expert_bias=true", "moe.shared_expert_intermediate_size=32"}},
    {"documents_masks",
     "debug.toml",
     {"data.source=indexed:{docs}", "data.eod_token=256", "model.vocab_size=259", "data.reset_position_ids=true",
      "data.reset_attention_mask=true", "data.eod_mask_loss=true"}},
    {"bf16_gpt2", "debug.toml", {"precision.params=bf16"}},
    {"bf16_llama_moe_mtp",
     "moe-debug.toml",
     {"precision.params=bf16", "model.preset=llama", "model.mtp_num_layers=1",
      "moe.shared_expert_intermediate_size=32"}},
    {"fp8_delayed_moe",
     "moe-debug.toml",
     {"precision.params=bf16", "precision.fp8=delayed", "precision.fp8_amax_history_len=4"}},
    {"fp8_tensorwise_gpt2", "debug.toml", {"precision.params=bf16", "precision.fp8=tensorwise"}},
    {"fp8_blockwise_e4m3_moe",
     "moe-debug.toml",
     {"precision.params=bf16", "precision.fp8=blockwise", "precision.fp8_format=e4m3"}},
    {"mxfp8_llama_moe", "moe-debug.toml", {"precision.params=bf16", "precision.fp8=mxfp8", "model.preset=llama"}},
    {"nvfp4_moe_shared",
     "moe-debug.toml",
     {"precision.params=bf16", "precision.fp4=nvfp4", "moe.shared_expert_intermediate_size=32"}},
    {"dp2", "debug.toml", {}, 2},
    {"dp2_moe",
     "moe-debug.toml",
     {kMoeBalance, "moe.router_score_function=sigmoid", "moe.router_enable_expert_bias=true"},
     2},
    {"dp2_distributed_optimizer_overlap",
     "debug.toml",
     {"optimizer.distributed=true", "ddp.overlap_grad_reduce=true", "ddp.overlap_param_gather=true",
      "ddp.bucket_size=4096"},
     2},
    {"dp2_bf16_distributed_optimizer", "moe-debug.toml", {"precision.params=bf16", "optimizer.distributed=true"}, 2},
    {"dp2_nvfp4_moe", "moe-debug.toml", {"precision.params=bf16", "precision.fp4=nvfp4"}, 2},
    {"dp2_documents_llama",
     "debug.toml",
     {"model.preset=llama", "data.source=indexed:{docs}", "data.eod_token=256", "model.vocab_size=259",
      "data.eod_mask_loss=true"},
     2},
    {"tp2_gpt2", "debug.toml", {"parallel.tensor=2"}, 2},
    {"tp2_sp_dp2_llama_gqa_distributed",
     "debug.toml",
     {"model.preset=llama", "model.num_query_groups=2", "parallel.tensor=2", "parallel.sequence_parallel=true",
      "optimizer.distributed=true"},
     4},
    {"tp4_sp_documents",
     "debug.toml",
     {"parallel.tensor=4", "parallel.sequence_parallel=true", "data.source=indexed:{docs}", "data.eod_token=256",
      "model.vocab_size=260", "data.reset_position_ids=true", "data.reset_attention_mask=true",
      "data.eod_mask_loss=true"},
     4},
    {"tp2_dp2_bf16_untied",
     "debug.toml",
     {"parallel.tensor=2", "precision.params=bf16", "model.tie_embeddings=false"},
     4},
    {"tp2_sp_llama_mtp",
     "debug.toml",
     {"model.preset=llama", "parallel.tensor=2", "parallel.sequence_parallel=true", "model.mtp_num_layers=1"},
     2},
    {"ep2_alltoall", "moe-debug.toml", {"parallel.expert=2", "moe.token_dispatcher=alltoall", kMoeBalance}, 2},
    {"ep2_allgather", "moe-debug.toml", {"parallel.expert=2", "moe.token_dispatcher=allgather"}, 2},
    {"ep4_alltoall_capacity_padded",
     "moe-debug.toml",
     {"parallel.expert=4", "moe.token_dispatcher=alltoall", "train.micro_batch=2", "moe.expert_capacity_factor=0.75",
      "moe.pad_expert_input_to_capacity=true"},
     4},
    {"ep2_edp2_alltoall_distributed_optimizer",
     "moe-debug.toml",
     {"parallel.expert=2", "moe.token_dispatcher=alltoall", "train.micro_batch=2", "optimizer.distributed=true"},
     4},
    {"ep2_edp2_allgather_llama_bias",
     "moe-debug.toml",
     {"parallel.expert=2", "moe.token_dispatcher=allgather", "train.micro_batch=2", "model.preset=llama",
      "moe.router_score_function=sigmoid", "moe.router_enable_expert_bias=true"},
     4},
    {"ep2_alltoall_bf16",
     "moe-debug.toml",
     {"parallel.expert=2", "moe.token_dispatcher=alltoall", "precision.params=bf16"},
     2},
    {"tp2_sp_moe_jitter_every_aux_loss",
     "moe-debug.toml",
     {"parallel.tensor=2", "parallel.sequence_parallel=true", kMoeBalance, "moe.input_jitter_eps=0.01"},
     2},
    {"tp2_llama_moe_shared_bias",
     "moe-debug.toml",
     {"parallel.tensor=2", "model.preset=llama", "moe.router_score_function=sigmoid",
      "moe.router_enable_expert_bias=true", "moe.shared_expert_intermediate_size=32"},
     2},
    {"etp2_llama_moe_swiglu", "moe-debug.toml", {"parallel.expert_tensor=2", "model.preset=llama"}, 2},
    {"tp2_sp_etp2_ep2_alltoall_distributed",
     "moe-debug.toml",
     {"parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert_tensor=2", "parallel.expert=2",
      "moe.token_dispatcher=alltoall", "train.micro_batch=2", "optimizer.distributed=true"},
     4},
    {"tp2_etp2_ep2_allgather_bf16",
     "moe-debug.toml",
     {"parallel.tensor=2", "parallel.expert_tensor=2", "parallel.expert=2", "moe.token_dispatcher=allgather",
      "train.micro_batch=2", "precision.params=bf16"},
     4},
    {"layout_token_segments_tp2_sp_llama_gqa",
     "debug.toml",
     {"determinism=layout", "layout_token_segments=true", "model.preset=llama", "model.num_query_groups=2",
      "parallel.tensor=2", "parallel.sequence_parallel=true"},
     2},
    // The head's weight gradient in chunks of 64 rows (vocabulary 65,536): blocks of 2 segments pushed
    // across the pool (GPT::plan_head, tree_sum_push_block), on 1 and 2 threads.
    {"layout_token_segments_head_blocks_vocab64k",
     "debug.toml",
     {"determinism=layout", "layout_token_segments=true", "model.vocab_size=65536", "model.hidden_size=16"},
     1},
    {"layout_token_segments_cp2_dp2_llama_gqa",
     "debug.toml",
     {"determinism=layout", "layout_token_segments=true", "train.micro_batch=2", "model.preset=llama",
      "model.num_query_groups=2", "parallel.context=2"},
     4},
    {"layout_token_segments_cp2_tp2_sp_bf16",
     "debug.toml",
     {"determinism=layout", "layout_token_segments=true", "train.micro_batch=2", "precision.params=bf16",
      "parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true"},
     4},
    {"layout_token_segments_cp2_tp2_sp_nvfp4",
     "debug.toml",
     {"determinism=layout", "layout_token_segments=true", "train.micro_batch=2", "precision.params=bf16",
      "precision.fp4=nvfp4", "parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true"},
     4},
    {"layout_token_segments_cp2_mtp2",
     "debug.toml",
     {"determinism=layout", "layout_token_segments=true", "train.micro_batch=2", "model.mtp_num_layers=2",
      "parallel.context=2"},
     2},
    {"layout_token_segments_cp2_pp2_interleaved",
     "debug.toml",
     {"determinism=layout", "layout_token_segments=true", "train.micro_batch=2", "model.num_layers=4",
      "parallel.context=2", "parallel.pipeline=2", "parallel.virtual_pipeline=2"},
     4},
    {"layout_token_segments_cp2_tp2_moe_shared_gate_bf16",
     "moe-debug.toml",
     {"determinism=layout", "layout_token_segments=true", "train.micro_batch=2", "precision.params=bf16",
      "moe.shared_expert_intermediate_size=64", "moe.shared_expert_gate=true", "parallel.context=2",
      "parallel.tensor=2"},
     4},
    {"layout_token_segments_cp2_ep2_edp2_alltoall",
     "moe-debug.toml",
     {"determinism=layout", "layout_token_segments=true", "train.micro_batch=2", "parallel.context=2",
      "parallel.expert=2", "moe.token_dispatcher=alltoall"},
     4},
    {"layout_token_segments_cp2_ep2_nvfp4_shared",
     "moe-debug.toml",
     {"determinism=layout", "layout_token_segments=true", "train.micro_batch=2", "parallel.context=2",
      "parallel.expert=2", "precision.params=bf16", "precision.fp4=nvfp4", "moe.shared_expert_intermediate_size=64"},
     2},
    {"layout_dp2_distributed_overlap",
     "debug.toml",
     {"determinism=layout", "train.micro_batch=2", "optimizer.distributed=true", "ddp.overlap_grad_reduce=true"},
     2},
    {"layout_ep2_edp2_allgather_moe",
     "moe-debug.toml",
     {"determinism=layout", "parallel.expert=2", "train.micro_batch=2", "moe.token_dispatcher=allgather"},
     4},
    {"layout_etp2_ep2_alltoall_moe_bf16",
     "moe-debug.toml",
     {"determinism=layout", "parallel.expert_tensor=2", "parallel.expert=2", "moe.token_dispatcher=alltoall",
      "train.micro_batch=2", "precision.params=bf16"},
     4},
    {"layout_dp2_fp8_delayed",
     "moe-debug.toml",
     {"determinism=layout", "train.micro_batch=2", "precision.params=bf16", "precision.fp8=delayed",
      "precision.fp8_amax_history_len=2"},
     2},
    {"layout_tp2_sp_fp8_blockwise_moe_experts_on_every_rank",
     "moe-debug.toml",
     {"determinism=layout", "parallel.tensor=2", "parallel.sequence_parallel=true", "train.micro_batch=2",
      "precision.params=bf16", "precision.fp8=blockwise"},
     2},
    // NVFP4 with the experts on every rank, 4 micro-batches per rank: each expert's gradient computed
    // whole on its owner, every rank receiving its chunk of them (ExpertTpSum::slices).
    {"layout_tp2_sp_nvfp4_moe_experts_on_every_rank",
     "moe-debug.toml",
     {"determinism=layout", "parallel.tensor=2", "parallel.sequence_parallel=true", "train.micro_batch=2",
      "precision.params=bf16", "precision.fp4=nvfp4"},
     2},
    {"layout_tp2_fp8_blockwise_moe_padded_with_biases",
     "moe-debug.toml",
     {"determinism=layout", "parallel.tensor=2", "train.micro_batch=2", "precision.params=bf16",
      "precision.fp8=blockwise", "moe.expert_capacity_factor=1.5", "moe.pad_expert_input_to_capacity=true"},
     2},
    {"layout_token_segments_cp2_tp2_ep2_expert_group_partners",
     "moe-debug.toml",
     {"determinism=layout", "layout_token_segments=true", "parallel.context=2", "parallel.tensor=2",
      "parallel.expert=2", "train.micro_batch=2"},
     4},
    {"layout_tp4_ep2_alltoall_expert_group_partners",
     "moe-debug.toml",
     {"determinism=layout", "parallel.tensor=4", "parallel.expert=2", "moe.token_dispatcher=alltoall",
      "train.micro_batch=2"},
     4},
    {"layout_ep2_nvfp4_alltoall",
     "moe-debug.toml",
     {"determinism=layout", "parallel.expert=2", "train.micro_batch=2", "moe.token_dispatcher=alltoall",
      "precision.params=bf16", "precision.fp4=nvfp4"},
     2},
    {"layout_moe_tp4_ep2_nvfp4_gathered_wgrad",
     "moe-debug.toml",
     {"determinism=layout", "parallel.tensor=4", "parallel.expert=2", "train.micro_batch=2", "precision.params=bf16",
      "precision.fp4=nvfp4"},
     4},
    {"layout_tp2_sp_nvfp4",
     "debug.toml",
     {"determinism=layout", "parallel.tensor=2", "parallel.sequence_parallel=true", "train.micro_batch=2",
      "precision.params=bf16", "precision.fp4=nvfp4"},
     2},
    // Multi-head latent attention and QK layernorm under tensor parallelism in layout mode (their
    // sums over heads in one process's order), with an MoE MTP depth.
    {"layout_tp2_sp_mla_bf16_moe_mtp",
     "moe-debug.toml",
     {"determinism=layout", "parallel.tensor=2", "parallel.sequence_parallel=true", "train.micro_batch=2",
      "model.preset=llama", "model.multi_latent_attention=true", "model.q_lora_rank=24", "model.kv_lora_rank=16",
      "model.qk_head_dim=12", "model.qk_pos_emb_head_dim=4", "model.v_head_dim=10", "precision.params=bf16",
      "model.mtp_num_layers=1"},
     2},
    {"layout_tp2_qk_norm_fp8_blockwise",
     "moe-debug.toml",
     {"determinism=layout", "parallel.tensor=2", "train.micro_batch=2", "model.preset=llama", "model.qk_layernorm=true",
      "model.kv_channels=24", "model.num_query_groups=2", "precision.params=bf16", "precision.fp8=blockwise",
      "precision.fp8_format=e4m3"},
     2},
    {"layout_tp2_sp_dp2_llama_bf16_mtp",
     "debug.toml",
     {"determinism=layout", "parallel.tensor=2", "parallel.sequence_parallel=true", "model.preset=llama",
      "model.num_query_groups=2", "precision.params=bf16", "model.mtp_num_layers=1", "train.micro_batch=2"},
     4},
    {"layout_tp2_sp_ep2_alltoall_moe_shared",
     "moe-debug.toml",
     {"determinism=layout", "parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.expert=2",
      "moe.token_dispatcher=alltoall", "train.micro_batch=2", "moe.shared_expert_intermediate_size=32"},
     4},
    {"layout_pp2_dp2_moe_untied",
     "moe-debug.toml",
     {"determinism=layout", "parallel.pipeline=2", "train.micro_batch=2", "model.tie_embeddings=false",
      "optimizer.distributed=true"},
     4},
    {"layout_pp2_tied_mtp",
     "debug.toml",
     {"determinism=layout", "parallel.pipeline=2", "train.micro_batch=2", "model.mtp_num_layers=1",
      "optimizer.distributed=true"},
     4},
    {"pp2_gpt2_tied_mtp", "debug.toml", {"parallel.pipeline=2", "model.mtp_num_layers=1"}, 2},
    {"pp2_afab_documents_llama",
     "debug.toml",
     {"parallel.pipeline=2", "parallel.pipeline_schedule=all_forward_all_backward", "model.preset=llama",
      "data.source=indexed:{docs}", "data.eod_token=256", "model.vocab_size=259", "data.reset_attention_mask=true",
      "data.eod_mask_loss=true"},
     2},
    {"pp2_interleaved_moe_ep2_alltoall",
     "moe-debug.toml",
     {"parallel.pipeline=2", "parallel.virtual_pipeline=2", "model.num_layers=4", "train.micro_batch=2",
      "parallel.expert=2", "moe.token_dispatcher=alltoall", kMoeBalance},
     4},
    {"pp2_tp2_sp_bf16_llama",
     "debug.toml",
     {"parallel.pipeline=2", "parallel.tensor=2", "parallel.sequence_parallel=true", "model.preset=llama",
      "precision.params=bf16"},
     4},
    {"pp2_interleaved_tp2_etp2_moe",
     "moe-debug.toml",
     {"parallel.pipeline=2", "parallel.virtual_pipeline=2", "model.num_layers=4", "parallel.tensor=2",
      "parallel.expert_tensor=2", "train.micro_batch=2"},
     4},
    {"pp4_dp_distributed_moe",
     "moe-debug.toml",
     {"parallel.pipeline=4", "model.num_layers=4", "train.micro_batch=1", "optimizer.distributed=true"},
     8},
    // Context parallelism: load-balanced chunks, all-gathered keys and values (dense and MoE).
    {"cp2_gpt2", "debug.toml", {"parallel.context=2"}, 2},
    {"cp2_dp2_documents_llama_gqa",
     "debug.toml",
     {"parallel.context=2", "model.preset=llama", "model.num_query_groups=2", "data.source=indexed:{docs}",
      "data.eod_token=256", "model.vocab_size=259", "data.reset_position_ids=true", "data.reset_attention_mask=true",
      "data.eod_mask_loss=true"},
     4},
    {"cp2_tp2_sp_bf16_distributed",
     "debug.toml",
     {"parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true", "precision.params=bf16",
      "optimizer.distributed=true"},
     4},
    {"cp2_ep2_alltoall_moe_bias_every_aux_loss",
     "moe-debug.toml",
     {"parallel.context=2", "parallel.expert=2", "moe.token_dispatcher=alltoall", kMoeBalance,
      "moe.router_score_function=sigmoid", "moe.router_enable_expert_bias=true"},
     4},
    // With pipeline parallelism (each stage's ranks a cp group) and multi-token prediction.
    {"cp2_pp2_mtp_documents_llama",
     "debug.toml",
     {"parallel.context=2", "parallel.pipeline=2", "model.mtp_num_layers=1", "model.preset=llama",
      "data.source=indexed:{docs}", "data.eod_token=256", "model.vocab_size=259", "data.reset_position_ids=true",
      "data.reset_attention_mask=true", "data.eod_mask_loss=true"},
     4},
    {"cp2_pp2_interleaved_moe_every_aux_loss",
     "moe-debug.toml",
     {"parallel.context=2", "parallel.pipeline=2", "parallel.virtual_pipeline=2", "model.num_layers=4",
      "train.micro_batch=2", kMoeBalance},
     4},
    // Attention across the cp group by parallel.cp_comm_type (model/context_attention.h): ring attention
    // (its partial results merged in ring order), the all-to-all to head shards, and both.
    {"cp2_p2p_documents_llama_gqa",
     "debug.toml",
     {"parallel.context=2", "parallel.cp_comm_type=p2p", "model.preset=llama", "model.num_query_groups=2",
      "data.source=indexed:{docs}", "data.eod_token=256", "model.vocab_size=259", "data.reset_position_ids=true",
      "data.reset_attention_mask=true", "data.eod_mask_loss=true"},
     2},
    {"cp4_p2p_bf16", "debug.toml", {"parallel.context=4", "parallel.cp_comm_type=p2p", "precision.params=bf16"}, 4},
    {"cp2_tp2_sp_a2a_bf16_distributed",
     "debug.toml",
     {"parallel.context=2", "parallel.cp_comm_type=a2a", "parallel.tensor=2", "parallel.sequence_parallel=true",
      "precision.params=bf16", "optimizer.distributed=true"},
     4},
    {"cp4_a2a_p2p_llama_gqa",
     "debug.toml",
     {"parallel.context=4", "parallel.cp_comm_type=a2a+p2p", "parallel.hierarchical_context_parallel_sizes=2,2",
      "model.preset=llama", "model.num_query_groups=2"},
     4},
    {"cp2_p2p_ep2_alltoall_moe",
     "moe-debug.toml",
     {"parallel.context=2", "parallel.cp_comm_type=p2p", "parallel.expert=2", "moe.token_dispatcher=alltoall"},
     4},
    {"cp2_a2a_pp2_mtp",
     "debug.toml",
     {"parallel.context=2", "parallel.cp_comm_type=a2a", "parallel.pipeline=2", "model.mtp_num_layers=1"},
     4},
    {"fp8_blockwise_cp2_p2p",
     "debug.toml",
     {"parallel.context=2", "parallel.cp_comm_type=p2p", "precision.params=bf16", "precision.fp8=blockwise"},
     2},
    {"layout_token_segments_cp2_a2a_tp2_sp_bf16",
     "debug.toml",
     {"determinism=layout", "layout_token_segments=true", "train.micro_batch=2", "precision.params=bf16",
      "parallel.context=2", "parallel.cp_comm_type=a2a", "parallel.tensor=2", "parallel.sequence_parallel=true"},
     4},
    // Packed variable-length samples (data.packing = "thd", data/packed_dataset.h).
    {"thd_llama_gqa",
     "debug.toml",
     {"data.packing=thd", "model.preset=llama", "model.num_query_groups=2", "data.source=indexed:{docs}",
      "data.eod_token=256", "model.vocab_size=259"}},
    {"thd_cp2_p2p_tp2_sp_bf16",
     "debug.toml",
     {"data.packing=thd", "parallel.context=2", "parallel.cp_comm_type=p2p", "parallel.tensor=2",
      "parallel.sequence_parallel=true", "precision.params=bf16", "train.micro_batch=1", "data.source=indexed:{docs}",
      "data.eod_token=256", "model.vocab_size=260"},
     4},
    {"thd_pp2_ep2_alltoall_moe",
     "moe-debug.toml",
     {"data.packing=thd", "parallel.pipeline=2", "parallel.expert=2", "moe.token_dispatcher=alltoall",
      "data.source=indexed:{docs}", "data.eod_token=256", "model.vocab_size=259"},
     4},
    // Low precision split over ranks: amax reduced over the tensor's group (tensor/precision.h).
    {"fp8_delayed_tp2_sp_dp2_llama",
     "debug.toml",
     {"precision.params=bf16", "precision.fp8=delayed", "model.preset=llama", "parallel.tensor=2",
      "parallel.sequence_parallel=true"},
     4},
    {"fp8_tensorwise_ep2_alltoall",
     "moe-debug.toml",
     {"precision.params=bf16", "precision.fp8=tensorwise", "parallel.expert=2", "moe.token_dispatcher=alltoall"},
     2},
    {"mxfp8_tp2_sp_moe",
     "moe-debug.toml",
     {"precision.params=bf16", "precision.fp8=mxfp8", "parallel.tensor=2", "parallel.sequence_parallel=true"},
     2},
    {"nvfp4_etp2_ep2_allgather",
     "moe-debug.toml",
     {"precision.params=bf16", "precision.fp4=nvfp4", "parallel.expert_tensor=2", "parallel.expert=2",
      "moe.token_dispatcher=allgather", "train.micro_batch=2"},
     4},
    // Low precision under pipeline parallelism: each micro-batch in flight keeps its own quantised
    // inputs; delayed scaling updates once per step (its per-rank histories in the checkpoint).
    {"fp8_delayed_pp2_dp2_moe",
     "moe-debug.toml",
     {"precision.params=bf16", "precision.fp8=delayed", "precision.fp8_amax_history_len=4", "parallel.pipeline=2",
      "train.micro_batch=2"},
     4},
    {"fp8_tensorwise_pp2_interleaved_tp2_sp",
     "debug.toml",
     {"precision.params=bf16", "precision.fp8=tensorwise", "parallel.pipeline=2", "parallel.virtual_pipeline=2",
      "model.num_layers=4", "parallel.tensor=2", "parallel.sequence_parallel=true"},
     4},
    {"fp8_blockwise_pp2_afab_ep2_alltoall",
     "moe-debug.toml",
     {"precision.params=bf16", "precision.fp8=blockwise", "parallel.pipeline=2", "parallel.expert=2",
      "parallel.pipeline_schedule=all_forward_all_backward", "moe.token_dispatcher=alltoall", "train.micro_batch=2"},
     4},
    {"mxfp8_pp2_llama_moe",
     "moe-debug.toml",
     {"precision.params=bf16", "precision.fp8=mxfp8", "model.preset=llama", "parallel.pipeline=2"},
     2},
    {"nvfp4_pp2_interleaved_moe_shared",
     "moe-debug.toml",
     {"precision.params=bf16", "precision.fp4=nvfp4", "parallel.pipeline=2", "parallel.virtual_pipeline=2",
      "model.num_layers=4", "train.micro_batch=2", "moe.shared_expert_intermediate_size=32"},
     2},
    {"fp8_tensorwise_cp2_pp2_interleaved_moe",
     "moe-debug.toml",
     {"precision.params=bf16", "precision.fp8=tensorwise", "parallel.context=2", "parallel.pipeline=2",
      "parallel.virtual_pipeline=2", "model.num_layers=4", "train.micro_batch=2"},
     4},
};

constexpr int kSteps = 3;
constexpr int kStopAfter = 2;  // the resumed run's cut: it resumes for the steps after it
// Byte documents of random lengths, each ended by EOD 256.
std::string write_documents(const testing::TempDir& dir) {
  const std::string prefix = dir.path("docs");
  IndexedDatasetWriter w(prefix, TokenDtype::uint16);
  const std::vector<int32_t> lengths = testing::random_ints(200, 60, 3, "lengths");
  const std::vector<int32_t> bytes = testing::random_ints(200 * 61, 256, 3, "bytes");
  for (size_t i = 0; i < lengths.size(); ++i) {
    std::vector<int32_t> doc(bytes.begin() + static_cast<int64_t>(i) * 61,
                             bytes.begin() + static_cast<int64_t>(i) * 61 + lengths[i] + 1);
    doc.push_back(256);
    w.add_document(doc.data(), static_cast<int64_t>(doc.size()));
  }
  w.finish();
  return prefix;
}

// Trains the row with `threads` threads per rank into dir/run (`extra` keys last); returns every
// rank's fingerprints.
std::string train_row(const Row& row, const testing::TempDir& dir, const std::string& run, int threads,
                      const std::vector<std::string>& extra = {}) {
  std::vector<std::string> keys;
  for (std::string k : row.overrides) {
    const size_t at = k.find("{docs}");
    if (at != std::string::npos) k.replace(at, 6, dir.path("docs"));
    keys.push_back(k);
  }
  for (const std::string& k : {str("train.steps=", kSteps), std::string("train.eval_interval=0"),
                               str("train.threads=", threads), "train.out_dir=" + dir.path(run)})
    keys.push_back(k);
  keys.insert(keys.end(), extra.begin(), extra.end());
  const Config c = load_config(str(LOCKSTEP_SOURCE_DIR, "/configs/", row.config), keys);
  std::FILE* sink = std::fopen("/dev/null", "w");
  run_threads(row.ranks, c.dist.timeout_s, [&](Communicator& comm) { train(c, sink, comm); });
  std::fclose(sink);
  return testing::read_fingerprints(dir.path(run), row.ranks);
}

class DeterminismMatrix : public ::testing::TestWithParam<Row> {};

TEST_P(DeterminismMatrix, TwoThreadsOneThreadAndResumedGiveIdenticalFingerprints) {
  const Row& row = GetParam();
  testing::TempDir dir;
  write_documents(dir);
  const std::string first = train_row(row, dir, "first", 2);
  EXPECT_EQ(std::count(first.begin(), first.end(), '\n'), kSteps * row.ranks);
  EXPECT_TRUE(testing::matches_golden("matrix", row.name, first));
  EXPECT_EQ(first, train_row(row, dir, "one_thread", 1)) << "1 thread vs 2";
  const std::string save = str("train.save_interval=", kStopAfter);
  const std::string stopped = train_row(row, dir, "resumed", 2, {save, str("train.exit_interval=", kStopAfter)});
  EXPECT_EQ(std::count(stopped.begin(), stopped.end(), '\n'), kStopAfter * row.ranks)
      << "stopped after step " << kStopAfter;
  EXPECT_EQ(first, train_row(row, dir, "resumed", 1, {save, "train.resume=auto"}))
      << "stopped after step " << kStopAfter << " and resumed vs uninterrupted";
}

INSTANTIATE_TEST_SUITE_P(Rows, DeterminismMatrix, ::testing::ValuesIn(kRows),
                         [](const ::testing::TestParamInfo<Row>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace lockstep
