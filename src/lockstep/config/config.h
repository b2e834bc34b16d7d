// The job configuration: one struct per concern, filled from built-in defaults, then the model
// preset, then a TOML file, then dotted `key=value` overrides (later wins), then validated.
//
// Every key is declared once, in the key table in config.cpp (name, type, help); that table drives
// parsing, the command line, the resolved `config.toml` a run writes, and `lockstep help config`.
// Errors name the file, key and value at fault (UserError).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lockstep {

struct ModelConfig {
  std::string preset = "gpt2";  // gpt2 | llama: architecture defaults below
  int64_t num_layers = 4;
  int64_t hidden_size = 128;
  int64_t num_heads = 4;
  int64_t num_query_groups = 0;  // key/value heads (GQA); 0 = num_heads
  int64_t kv_channels = 0;       // head size; 0 = hidden_size / num_heads (Qwen3: 128 with hidden 2048, 32 heads)
  int64_t ffn_hidden_size = 0;   // 0 = 4*hidden (gelu) or 8/3*hidden rounded up to 64 (swiglu)
  int64_t seq_length = 128;
  int64_t vocab_size = 256;
  std::string normalization = "layernorm";     // layernorm | rmsnorm
  std::string position_embedding = "learned";  // learned | rope
  std::string activation = "gelu";             // gelu | swiglu
  bool bias = true;                            // biases in linear layers
  bool add_qkv_bias = false;                   // biases in the QKV projection even without `bias` (Qwen2)
  bool qk_layernorm = false;                   // RMSNorm of each query and key head before RoPE (Qwen3)
  bool tie_embeddings = true;                  // output head shares the word embedding
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  // RoPE frequency scaling (kernels/rope.h RopeScaling): none | llama3 (Llama 3.1+ checkpoints).
  std::string rope_scaling = "none";  // none | llama3 | yarn
  double rope_scaling_factor = 8.0;
  double rope_low_freq_factor = 1.0;
  double rope_high_freq_factor = 4.0;
  int64_t rope_original_max_position_embeddings = 8192;
  // yarn (kernels/rope.h): the ramp's rotation bounds and the attention scale's m(factor, k) terms.
  double rope_yarn_beta_fast = 32.0, rope_yarn_beta_slow = 1.0;
  double rope_yarn_mscale = 1.0, rope_yarn_mscale_all_dim = 0.0;
  double init_std = 0.02;
  int64_t mtp_num_layers = 0;            // multi-token prediction depths (model/mtp.h); 0 = off
  double mtp_loss_scaling_factor = 0.1;  // MTP loss = factor / depths * sum of the depths' losses

  // Multi-head latent attention (DeepSeek-V2/V3; model/mla.h), Megatron's names and defaults.
  bool multi_latent_attention = false;
  int64_t q_lora_rank = 0;  // query compression rank; 0 = none (a plain query projection)
  int64_t kv_lora_rank = 32;
  int64_t qk_head_dim = 128;         // the part of a query / key head without RoPE
  int64_t qk_pos_emb_head_dim = 64;  // the RoPE part
  int64_t v_head_dim = 128;

  int64_t query_groups() const {
    return multi_latent_attention ? num_heads : num_query_groups ? num_query_groups : num_heads;
  }
  // The attention core's head size (MLA: of queries and keys; its values are padded to it).
  int64_t head_dim() const {
    if (multi_latent_attention) return qk_head_dim + qk_pos_emb_head_dim;
    return kv_channels ? kv_channels : hidden_size / num_heads;
  }
  // The size of the RoPE part of a head (all of it but under MLA).
  int64_t rope_dim() const { return multi_latent_attention ? qk_pos_emb_head_dim : head_dim(); }
  // The attention output's width per head (the output projection's input is num_heads x this).
  int64_t value_dim() const { return multi_latent_attention ? v_head_dim : head_dim(); }
  int64_t ffn_hidden() const;
};

struct TrainConfig {
  int64_t steps = 300;
  int64_t global_batch = 16;  // sequences per optimizer step
  int64_t micro_batch = 8;    // sequences per forward/backward
  double lr = 1e-3;
  double min_lr = 1e-4;
  std::string lr_schedule = "cosine";  // constant | cosine | wsd
  int64_t warmup_steps = 20;
  int64_t decay_steps = 0;  // wsd: length of the final decay (0 = 20% of steps)
  uint64_t seed = 1234;
  int64_t threads = 0;  // 0 = every core
  std::string out_dir = "runs/default";
  int64_t eval_interval = 100;  // 0 = never
  int64_t eval_batches = 4;     // micro-batches per evaluation
  int64_t log_interval = 10;    // plain-text progress lines (not on a terminal)
  bool tensorboard = false;     // out_dir/tensorboard/ event files (train/tensorboard.h)
  // Warn when a rank's compute time per step exceeds the median of the others' by this fraction
  // over a window of steps (train/stragglers.h); 0 = never.
  double straggler_threshold = 0.2;
  // Checkpoints (train/checkpoint.h, docs/checkpoints.md) in out_dir/checkpoints.
  int64_t save_interval = 0;  // save every N steps and at the last step; 0 = never
  int64_t keep_last = 0;      // keep the newest N complete checkpoints; 0 = all
  bool async_save = false;    // write in a background thread while training goes on
  std::string resume;         // "" = start fresh; "auto" = newest in out_dir/checkpoints if any; or a path
  std::string init_from;      // PATH.safetensors (lockstep ckpt export's format) or hf:DIR (config/hf_config.h)
  int64_t exit_interval = 0;  // stop (after saving when save_interval > 0) once step % N == 0; 0 = never
  // A non-finite loss, grad norm or updated parameter (docs/faults.md): "stop" the job (exit status
  // 4, no checkpoint of that state) or "skip_step" (loss or grad norm: the update is not applied).
  std::string on_nonfinite = "stop";
  // Activation recompute (Megatron's recompute_granularity / method / num_layers; model/gpt.h):
  // "full" keeps only the inputs of groups of layers and runs their forward again in backward.
  std::string recompute_granularity = "none";              // none | full | selective
  std::string recompute_method;                            // uniform | block (full only)
  int64_t recompute_num_layers = 0;                        // layers per group (uniform), recomputed per chunk (block)
  std::string recompute_modules = "core_attn";             // selective: Megatron's module names, comma-separated
  std::vector<std::string> recompute_module_list() const;  // recompute_modules' names

  int64_t accumulation_steps() const { return global_batch / micro_batch; }
};

struct OptimizerConfig {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;  // on weight matrices only (not biases, norms)
  double clip_grad = 1.0;     // global grad-norm clip; 0 = off
  bool distributed = false;   // ZeRO-1: Adam state sharded over data-parallel ranks
  // Megatron's precision-aware optimizer: the Adam moments' storage (fp32 | bf16); the update runs
  // in fp32 and rounds each moment to its storage (train/optimizer.h).
  std::string exp_avg_dtype = "fp32";
  std::string exp_avg_sq_dtype = "fp32";
};

// Sizes of the parallel layout; data parallel is what remains of the world (comm/mesh.h).
struct ParallelConfig {
  int64_t tensor = 1;
  bool sequence_parallel = false;
  int64_t context = 1;
  // How attention crosses the context-parallel group (Megatron's cp_comm_type,
  // parallel/context_attention.h): all_gather | p2p | a2a | a2a+p2p; for a2a+p2p the a2a (inner,
  // consecutive ranks) and p2p (ring) sizes, "A,P" with A x P = context.
  std::string cp_comm_type = "all_gather";
  std::string hierarchical_context_parallel_sizes;
  int64_t pipeline = 1;
  // Pipeline parallelism (parallel/pipeline/): layers per model chunk ("" = even split), the
  // schedule, and the model chunks (virtual stages) per pipeline rank (> 1: interleaved 1F1B).
  std::string pipeline_layers;
  std::string pipeline_schedule = "1f1b";  // 1f1b | all_forward_all_backward
  int64_t virtual_pipeline = 1;
  int64_t expert = 1;
  int64_t expert_tensor = 1;
  int64_t ranks_per_node = 0;  // consecutive job ranks per node, for dist.link; 0 = every rank on one node

  // The transformer layers of each of the pipeline x virtual_pipeline model chunks, in model order
  // (chunk c runs on pipeline rank c % pipeline): parallel.pipeline_layers, or L split evenly.
  // UserError naming the keys when they do not add up to L.
  std::vector<int64_t> chunk_layers(int64_t L) const;
  // The all-to-all (inner) and ring sizes of context parallelism's attention: {context, 1} for a2a,
  // {1, context} for p2p and all_gather, hierarchical_context_parallel_sizes for a2a+p2p; {1, 1} without
  // context parallelism.
  std::pair<int64_t, int64_t> context_a2a_ring() const;
};

// Data-parallel gradient reduction (parallel/data_parallel.h).
struct DdpConfig {
  bool overlap_grad_reduce = true;    // reduce each bucket as soon as backward finishes it
  bool overlap_param_gather = false;  // distributed optimizer: gather parameters while the next forward runs
  int64_t bucket_size = 4000000;      // elements per gradient bucket (at least; buckets hold whole parameters)
};

// The distributed runtime (comm/): backend and the timeout of every collective.
struct DistConfig {
  std::string backend = "auto";  // auto (mpi under mpirun, else threads) | threads | mpi
  double timeout_s = 300;        // a collective not complete by then fails on every rank
  // The wire model (comm/link_model.h): "intra=900GB/s:2us,inter=50GB/s:5us"; "" = none. link_scale
  // multiplies its bandwidths: a number, or "h100" (this CPU's measured GEMM peak / the H100's dense
  // bf16 peak).
  std::string link;
  std::string link_scale = "1";
};

struct DataConfig {
  std::string source = "synthetic";   // synthetic | text:PATH | indexed:PREFIX[:WEIGHT],... (data/dataset.h)
  std::string split = "98,2";         // indexed: train,valid[,test] weights over documents
  double eval_fraction = 0.05;        // text: trailing fraction of the file held out
  int64_t synthetic_bytes = 1 << 21;  // size of the generated training corpus
  // Packed documents (data/documents.h), Megatron's flags; they need eod_token.
  int64_t eod_token = -1;             // end-of-document id of the data's tokenizer; -1 = none
  bool reset_position_ids = false;    // positions restart at 0 after each EOD
  bool reset_attention_mask = false;  // attention stays inside each document
  bool eod_mask_loss = false;         // no loss where the input token is EOD
  // "thd": samples of whole documents packed into model.seq_length tokens, each padded (data/packed_dataset.h);
  // implies reset_position_ids and reset_attention_mask.
  std::string packing = "none";
  int64_t packing_pad_multiple = 0;  // thd: each document padded to a multiple of this; 0 = what the layout needs
  bool thd() const { return packing == "thd"; }
  // Some targets are masked (-1): the loss is the mean over the global batch's tokens with a target.
  bool masked_targets() const { return eod_mask_loss || thd(); }
};

// Mixture of experts (Megatron's --moe-* options without the prefix; docs/moe.md has the formulas).
struct MoeConfig {
  int64_t num_experts = 0;  // 0 = dense model
  int64_t router_topk = 2;
  std::string router_score_function = "softmax";  // softmax | sigmoid
  bool router_pre_softmax = false;                // softmax over all experts before top-k
  int64_t router_num_groups = 0;                  // group-limited routing: expert groups (0 = off)
  int64_t router_group_topk = 0;                  // groups kept per token
  double router_topk_scaling_factor = 1.0;
  std::string router_load_balancing_type =
      "aux_loss";  // comma list of aux_loss, seq_aux_loss, global_aux_loss; or none
  double aux_loss_coeff = 0.0;
  double z_loss_coeff = 0.0;
  double expert_capacity_factor = 0.0;      // 0 = dropless
  std::string token_drop_policy = "probs";  // probs | position
  bool pad_expert_input_to_capacity = false;
  std::string token_dispatcher = "allgather";  // allgather | alltoall (with parallel.expert > 1)
  bool router_enable_expert_bias = false;
  double router_bias_update_rate = 1e-3;
  int64_t ffn_hidden_size = 0;                  // expert width; 0 = model.ffn_hidden_size
  int64_t shared_expert_intermediate_size = 0;  // 0 = no shared expert
  bool shared_expert_gate = false;
  // The shared expert's forward runs while the routed tokens' all-to-all is in flight (Megatron's
  // moe_shared_expert_overlap; model/moe/moe_layer.h).
  bool shared_expert_overlap = false;
  // The experts' fc weight gradients run while the dispatch backward's all-to-all is in flight
  // (Megatron's delay_wgrad_compute; model/moe/experts.h).
  bool delay_wgrad_compute = false;
  std::string layer_freq = "1";  // N (every N-th layer) or a 0/1 pattern "[0,1,1,1]"
  // train.init_from is a dense checkpoint: each MoE layer's experts are cut from its MLP
  // (train/upcycling.h; granularity = model.ffn_hidden_size / moe.ffn_hidden_size).
  bool use_upcycling = false;
  double input_jitter_eps = 0.0;

  // Layer l of L is an MoE layer (num_experts > 0 and layer_freq selects it).
  bool is_moe_layer(int64_t l, int64_t L) const;
};

// Tools for finding where two runs part (docs/determinism.md, core/trace.h).
struct DebugConfig {
  std::string trace = "off";  // off | modules: RUN/trace/rank-NNNNN.jsonl
  std::string inject_ulp;     // "STEP:MODULE": one ulp into MODULE's output at STEP; "" = off
  std::string inject_nan;     // "STEP:MODULE": a NaN into MODULE's output at STEP (the non-finite guard); "" = off
  // Injected faults for restart tests (train/faults.h, docs/faults.md): rank fail_rank fails at
  // step fail_at_step (0 = never), in the step or in that step's checkpoint save, killed or hung.
  int64_t fail_at_step = 0;
  int64_t fail_rank = 0;
  std::string fail_in = "step";    // step | save
  std::string fail_mode = "kill";  // kill | hang
  // An injected straggler: rank slow_rank sleeps slow_ms in every step (0 = off).
  int64_t slow_rank = 0;
  double slow_ms = 0;

  // The injection set (at most one; load_config checks), its key, and its parts: step 0 when off.
  const std::string& injection() const { return inject_nan.empty() ? inject_ulp : inject_nan; }
  const char* injection_key() const { return inject_nan.empty() ? "debug.inject_ulp" : "debug.inject_nan"; }
  int64_t inject_step() const;
  std::string inject_module() const;
};

// Reduced precision (tensor/precision.h, docs/precision.md). FP8 keys take Transformer Engine's
// names and defaults (DelayedScaling: hybrid, history 1024, max, margin 0).
struct PrecisionConfig {
  std::string params = "fp32";                // fp32 | bf16 (fp32 master weights)
  std::string fp8 = "none";                   // none | delayed | tensorwise | blockwise | mxfp8
  std::string fp8_format = "hybrid";          // hybrid (E4M3 forward, E5M2 gradients) | e4m3
  int64_t fp8_amax_history_len = 1024;        // delayed: amax history window
  std::string fp8_amax_compute_algo = "max";  // delayed: max over the history | most_recent
  int64_t fp8_margin = 0;                     // delayed: scale = (fp8 max / amax) / 2^margin
  std::string fp4 = "none";                   // none | nvfp4
  int64_t fp4_high_precision_layers = 0;      // nvfp4: the first and the last N layers stay BF16
};

struct Config {
  std::string determinism = "run";
  // determinism = "layout": how many canonical segments each reduction that tensor parallelism
  // splits is cut into (docs/design/reductions.md#tensor-parallel-k-segments); a power of two that parallel.tensor and
  // parallel.expert_tensor divide. Part of the arithmetic, like train.micro_batch.
  int64_t layout_segments = 8;
  // determinism = "layout": every weight gradient (and attention's dK, dV) is computed in the
  // micro-batch's layout_segments token segments, so that a layout may split a micro-batch's tokens
  // anywhere on a segment boundary (docs/design/reductions.md#token-segments-everywhere). Part of the arithmetic.
  bool layout_token_segments = false;
  ModelConfig model;
  TrainConfig train;
  OptimizerConfig optimizer;
  ParallelConfig parallel;
  DdpConfig ddp;
  DistConfig dist;
  DataConfig data;
  PrecisionConfig precision;
  MoeConfig moe;
  DebugConfig debug;
  // data.packing = "thd": the multiple each document is padded to: data.packing_pad_multiple, or (0) 2 x
  // parallel.context (with context parallelism) times parallel.tensor (with sequence parallelism), else 1.
  int64_t packing_pad_multiple() const;
};

// Builds the configuration: defaults, the preset named by model.preset (from `file` or
// `overrides`), the TOML file (if non-empty), then the overrides ("model.num_layers=4"), then
// validation. Throws UserError.
Config load_config(const std::string& file, const std::vector<std::string>& overrides);
// The same from TOML text (a checkpoint's resolved config); name stands for the file in messages.
Config load_config_text(const std::string& text, const std::string& name);

// The fully resolved configuration as TOML; load_config(path of this text, {}) gives it back.
std::string config_to_toml(const Config& c);

// One line per key: name, type, default, help.
std::string config_help();

}  // namespace lockstep
