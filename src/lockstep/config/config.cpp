#include "lockstep/config/config.h"

#include <toml++/toml.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <variant>

#include "lockstep/config/hf_config.h"
#include "lockstep/config/link_spec.h"
#include "lockstep/core/error.h"

namespace lockstep {

std::vector<std::string> TrainConfig::recompute_module_list() const {
  std::vector<std::string> out;
  std::stringstream ss(recompute_modules);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

int64_t ModelConfig::ffn_hidden() const {
  if (ffn_hidden_size) return ffn_hidden_size;
  if (activation == "swiglu") return (8 * hidden_size / 3 + 63) / 64 * 64;
  return 4 * hidden_size;
}

namespace {

// moe.layer_freq: "N", or a 0/1 pattern "[0,1,1]" / "([0]*1+[1]*3)" (Megatron's forms).
std::vector<bool> moe_layer_pattern(const std::string& text, int64_t L) {
  auto bad = [&](const char* why) -> std::vector<bool> { user_error("moe.layer_freq = \"", text, "\": ", why); };
  std::string s;
  for (char ch : text)
    if (ch != ' ' && ch != '\t') s += ch;
  if (s.empty()) return bad("empty");
  if (std::all_of(s.begin(), s.end(), [](char ch) { return ch >= '0' && ch <= '9'; })) {
    if (s.size() > 9) return bad("too large");
    const int64_t every = std::stoll(s);
    if (every <= 0) return bad("must be positive");
    std::vector<bool> p(static_cast<size_t>(L));
    for (int64_t l = 0; l < L; ++l) p[l] = l % every == 0;
    return p;
  }
  if (s.front() == '(' && s.back() == ')') s = s.substr(1, s.size() - 2);
  std::vector<bool> p;
  size_t i = 0;
  while (i < s.size()) {
    if (s[i] != '[') return bad("expected a list like [0,1,1]");
    const size_t close = s.find(']', i);
    if (close == std::string::npos) return bad("missing ']'");
    std::vector<bool> term;
    for (size_t j = i + 1; j < close; ++j) {
      if (s[j] == '0' || s[j] == '1')
        term.push_back(s[j] == '1');
      else if (s[j] != ',')
        return bad("list entries must be 0 or 1");
    }
    i = close + 1;
    int64_t times = 1;
    if (i < s.size() && s[i] == '*') {
      size_t j = ++i;
      while (j < s.size() && s[j] >= '0' && s[j] <= '9') ++j;
      if (j == i || j - i > 6) return bad("expected a count after '*'");
      times = std::stoll(s.substr(i, j - i));
      i = j;
    }
    for (int64_t r = 0; r < times; ++r) p.insert(p.end(), term.begin(), term.end());
    if (i < s.size() && s[i++] != '+') return bad("expected '+' between lists");
  }
  if (static_cast<int64_t>(p.size()) != L)
    user_error("moe.layer_freq = \"", text, "\" has ", p.size(), " entries, model.num_layers = ", L);
  return p;
}

}  // namespace

int64_t DebugConfig::inject_step() const {
  const std::string& spec = injection();
  const size_t colon = spec.find(':');
  if (spec.empty() || colon == 0 || colon == std::string::npos || colon > 18) return 0;
  int64_t step = 0;
  const auto [p, ec] = std::from_chars(spec.data(), spec.data() + colon, step);
  return ec == std::errc() && p == spec.data() + colon ? step : 0;
}

std::string DebugConfig::inject_module() const {
  const std::string& spec = injection();
  const size_t colon = spec.find(':');
  return colon == std::string::npos ? "" : spec.substr(colon + 1);
}

int64_t Config::packing_pad_multiple() const {
  if (data.packing_pad_multiple > 0) return data.packing_pad_multiple;
  return (parallel.context > 1 ? 2 * parallel.context : 1) * (parallel.sequence_parallel ? parallel.tensor : 1);
}

std::pair<int64_t, int64_t> ParallelConfig::context_a2a_ring() const {
  if (context == 1) return {1, 1};
  if (cp_comm_type == "a2a") return {context, 1};
  if (cp_comm_type != "a2a+p2p") return {1, context};
  const std::string& s = hierarchical_context_parallel_sizes;
  const size_t comma = s.find(',');
  const auto number = [&](const std::string& part) -> int64_t {
    if (part.empty() || part.size() > 6 || part.find_first_not_of("0123456789") != std::string::npos) return 0;
    return std::stoll(part);
  };
  const int64_t a = comma == std::string::npos ? 0 : number(s.substr(0, comma));
  const int64_t p = comma == std::string::npos ? 0 : number(s.substr(comma + 1));
  if (a < 1 || p < 1 || a * p != context)
    user_error("parallel.hierarchical_context_parallel_sizes = \"", s,
               "\": cp_comm_type = \"a2a+p2p\" needs \"A,P\", two positive sizes whose product is parallel.context = ",
               context);
  return {a, p};
}

std::vector<int64_t> ParallelConfig::chunk_layers(int64_t L) const {
  const int64_t chunks = pipeline * virtual_pipeline;
  std::vector<int64_t> n;
  if (pipeline_layers.empty()) {
    if (L % chunks)
      user_error("model.num_layers = ", L,
                 " is not divisible by parallel.pipeline x parallel.virtual_pipeline = ", pipeline, " x ",
                 virtual_pipeline, "; set parallel.pipeline_layers to split them unevenly");
    n.assign(static_cast<size_t>(chunks), L / chunks);
    return n;
  }
  // "[1,2,1]" or "1,2,1": one count per model chunk.
  std::string s;
  for (char ch : pipeline_layers)
    if (ch != ' ' && ch != '\t') s += ch;
  if (s.size() >= 2 && s.front() == '[' && s.back() == ']') s = s.substr(1, s.size() - 2);
  size_t i = 0;
  while (i <= s.size()) {
    const size_t comma = std::min(s.find(',', i), s.size());
    int64_t v = 0;
    const auto [p, ec] = std::from_chars(s.data() + i, s.data() + comma, v);
    if (ec != std::errc() || p != s.data() + comma || v < 1)
      user_error("parallel.pipeline_layers = \"", pipeline_layers,
                 "\": expected positive layer counts such as [1,2,1]");
    n.push_back(v);
    i = comma + 1;
  }
  int64_t sum = 0;
  for (int64_t v : n) sum += v;
  if (static_cast<int64_t>(n.size()) != chunks)
    user_error("parallel.pipeline_layers = \"", pipeline_layers, "\" has ", n.size(),
               " entries, but parallel.pipeline x "
               "parallel.virtual_pipeline = ",
               pipeline, " x ", virtual_pipeline, " = ", chunks, " model chunks");
  if (sum != L)
    user_error("parallel.pipeline_layers = \"", pipeline_layers, "\" adds up to ", sum,
               " layers, model.num_layers = ", L);
  return n;
}

bool MoeConfig::is_moe_layer(int64_t l, int64_t L) const {
  return num_experts > 0 && moe_layer_pattern(layer_freq, L)[static_cast<size_t>(l)];
}

namespace {

using IntRef = std::function<int64_t&(Config&)>;
using U64Ref = std::function<uint64_t&(Config&)>;
using FloatRef = std::function<double&(Config&)>;
using BoolRef = std::function<bool&(Config&)>;
using StringRef = std::function<std::string&(Config&)>;
using Ref = std::variant<IntRef, U64Ref, FloatRef, BoolRef, StringRef>;

struct Key {
  Key(std::string name_, Ref ref_, std::string help_, std::vector<std::string> choices_ = {})
      : name(std::move(name_)), ref(std::move(ref_)), help(std::move(help_)), choices(std::move(choices_)) {}
  std::string name;
  Ref ref;
  std::string help;
  std::vector<std::string> choices;  // strings only; empty = free text
};

#define LS_KEY(path, ...)                             \
  Key {                                               \
#path, [](Config & c) -> auto& { return c.path; } \
    , __VA_ARGS__                                     \
  }

// Tensor and sequence parallelism (parallel/tensor_parallel.h) split heads, KV groups, the MLP's
// hidden units, the vocabulary and (sequence parallelism) the tokens of a micro-batch evenly.
void validate_tensor_parallel(const Config& c) {
  const int64_t tp = c.parallel.tensor;
  const ModelConfig& m = c.model;
  if (c.parallel.sequence_parallel && tp < 2)
    user_error("parallel.sequence_parallel = true needs parallel.tensor > 1 (got ", tp, ")");
  if (tp == 1) return;
  const std::pair<const char*, int64_t> split[] = {{"model.num_heads", m.num_heads},
                                                   {"model.num_query_groups", m.query_groups()},
                                                   {"model.vocab_size", m.vocab_size},
                                                   {"model.ffn_hidden_size", m.ffn_hidden()}};
  for (const auto& [key, value] : split)
    if (value % tp) user_error(key, " = ", value, " is not divisible by parallel.tensor = ", tp);
  if (c.parallel.sequence_parallel && (c.train.micro_batch * m.seq_length) % tp)
    user_error("parallel.sequence_parallel: train.micro_batch x model.seq_length = ",
               c.train.micro_batch * m.seq_length, " tokens are not divisible by parallel.tensor = ", tp);
  // An MoE layer routes 1 / tp of each micro-batch's tokens on each tensor-parallel rank.
  if (c.moe.num_experts > 0 && (c.train.micro_batch * m.seq_length) % tp)
    user_error("parallel.tensor = ", tp,
               " with an MoE model: train.micro_batch x model.seq_length = ", c.train.micro_batch * m.seq_length,
               " tokens are not divisible by it (each tensor-parallel rank routes "
               "its share of the tokens)");
}

// Expert parallelism and expert tensor parallelism split the experts of an MoE layer (experts over
// ep, each expert's hidden units over etp).
void validate_expert_parallel(const Config& c) {
  const ParallelConfig& p = c.parallel;
  const MoeConfig& e = c.moe;
  for (const auto& [key, size] :
       {std::pair<const char*, int64_t>{"expert", p.expert}, {"expert_tensor", p.expert_tensor}})
    if (size > 1 && e.num_experts == 0)
      user_error("parallel.", key, " = ", size, " needs an MoE model (moe.num_experts > 0)");
  if (e.num_experts % p.expert)
    user_error("moe.num_experts = ", e.num_experts, " is not divisible by parallel.expert = ", p.expert,
               " (every expert-parallel rank holds the same number of experts)");
  const int64_t F = e.ffn_hidden_size ? e.ffn_hidden_size : c.model.ffn_hidden();
  if (e.num_experts > 0 && F % p.expert_tensor)
    user_error(e.ffn_hidden_size ? "moe.ffn_hidden_size = "
                                 : "moe.ffn_hidden_size = 0: the experts' width "
                                   "model.ffn_hidden_size = ",
               F, " is not divisible by parallel.expert_tensor = ", p.expert_tensor,
               " (every expert-tensor-parallel rank holds the same number of hidden units)");
}

void validate_pipeline_parallel(const Config& c) {
  const ParallelConfig& p = c.parallel;
  if (p.virtual_pipeline < 1) user_error("parallel.virtual_pipeline = ", p.virtual_pipeline, ": must be positive");
  if (p.virtual_pipeline > 1 && p.pipeline < 2)
    user_error("parallel.virtual_pipeline = ", p.virtual_pipeline, " needs parallel.pipeline > 1");
  if (p.virtual_pipeline > 1 && p.pipeline_schedule != "1f1b")
    user_error("parallel.virtual_pipeline = ", p.virtual_pipeline,
               ": the interleaved schedule is 1F1B; "
               "parallel.pipeline_schedule = \"",
               p.pipeline_schedule, "\" has no virtual stages");
  if (p.pipeline == 1 && !p.pipeline_layers.empty())
    user_error("parallel.pipeline_layers = \"", p.pipeline_layers, "\" needs parallel.pipeline > 1");
  if (p.pipeline == 1) return;
  p.chunk_layers(c.model.num_layers);
}

// Injected faults and stragglers (debug.fail_*, debug.slow_*); the ranks are checked against the
// world size in checked_mesh.
void validate_faults(const Config& c) {
  const DebugConfig& dbg = c.debug;
  const TrainConfig& t = c.train;
  if (!(t.straggler_threshold >= 0))
    user_error("train.straggler_threshold = ", t.straggler_threshold, ": must be >= 0 (0 = never warn)");
  if (dbg.slow_rank < 0) user_error("debug.slow_rank = ", dbg.slow_rank, ": must be >= 0");
  if (!(dbg.slow_ms >= 0)) user_error("debug.slow_ms = ", dbg.slow_ms, ": must be >= 0 (0 = off)");
  if (dbg.fail_rank < 0) user_error("debug.fail_rank = ", dbg.fail_rank, ": must be >= 0");
  const int64_t k = dbg.fail_at_step;
  if (k < 0 || k > t.steps)
    user_error("debug.fail_at_step = ", k, ": must be in [0, train.steps = ", t.steps, "] (0 = never)");
  const bool saves = t.save_interval > 0 &&
                     (k % t.save_interval == 0 || k == t.steps || (t.exit_interval > 0 && k % t.exit_interval == 0));
  if (k > 0 && dbg.fail_in == "save" && !saves)
    user_error("debug.fail_in = \"save\": no checkpoint is saved at debug.fail_at_step = ", k,
               " (train.save_interval = ", t.save_interval, ")");
}

const std::vector<Key>& keys() {
  static const std::vector<Key> table = {
      LS_KEY(determinism,
             "determinism level (run: same config + binary => same bits; layout: also the same bits "
             "for any data-, tensor-, expert-, expert-tensor- and pipeline-parallel size, (with "
             "layout_token_segments) context-parallel size, micro-batch spread, process count and "
             "backend)",
             {"run", "layout"}),
      LS_KEY(layout_segments,
             "determinism = layout: canonical segments of every reduction tensor or expert "
             "tensor parallelism splits (a power of two in [1, 64]; parallel.tensor and "
             "parallel.expert_tensor must divide it, and 2 x parallel.context x train.micro_batch "
             "under context parallelism, with sequence parallelism or an MoE model "
             "parallel.context x parallel.tensor too)"),
      LS_KEY(layout_token_segments,
             "determinism = layout: every weight gradient and attention's key and value "
             "gradients in layout_segments token segments of the micro-batch, what "
             "parallel.context > 1 needs (train.micro_batch must divide layout_segments)"),
      LS_KEY(model.preset,
             "architecture defaults: gpt2 (LayerNorm, GELU, learned positions, "
             "biases, tied head) or llama (RMSNorm, SwiGLU, RoPE, no biases, untied)",
             {"gpt2", "llama"}),
      LS_KEY(model.num_layers, "transformer layers"),
      LS_KEY(model.hidden_size, "model width C"),
      LS_KEY(model.num_heads, "attention (query) heads"),
      LS_KEY(model.num_query_groups, "key/value heads for grouped-query attention; 0 = num_heads"),
      LS_KEY(model.kv_channels,
             "head size of queries, keys and values; 0 = hidden_size / num_heads (Megatron's --kv-channels, "
             "Hugging Face's head_dim)"),
      LS_KEY(model.ffn_hidden_size, "MLP width; 0 = 4*hidden (gelu), 8/3*hidden rounded to 64 (swiglu)"),
      LS_KEY(model.seq_length, "tokens per sequence T"),
      LS_KEY(model.vocab_size, "vocabulary size V"),
      LS_KEY(model.normalization, "norm layer", {"layernorm", "rmsnorm"}),
      LS_KEY(model.position_embedding, "position encoding", {"learned", "rope"}),
      LS_KEY(model.activation, "MLP activation", {"gelu", "swiglu"}),
      LS_KEY(model.bias, "biases in linear layers"),
      LS_KEY(model.add_qkv_bias,
             "biases in the attention's QKV projection even when model.bias = false (Qwen2, Megatron's "
             "--add-qkv-bias)"),
      LS_KEY(model.multi_latent_attention,
             "multi-head latent attention (DeepSeek-V2/V3): low-rank query and key/value projections with "
             "normed latents, RoPE on a separate part of each head (Megatron's --multi-latent-attention)"),
      LS_KEY(model.q_lora_rank, "MLA: the queries' latent rank; 0 = a plain query projection"),
      LS_KEY(model.kv_lora_rank, "MLA: the keys' and values' latent rank"),
      LS_KEY(model.qk_head_dim, "MLA: the query / key head size without the RoPE part"),
      LS_KEY(model.qk_pos_emb_head_dim, "MLA: the RoPE part of each query / key head (one shared key part)"),
      LS_KEY(model.v_head_dim, "MLA: the value head size"),
      LS_KEY(model.qk_layernorm,
             "RMSNorm of each query and key head before RoPE, one weight of head size each (Qwen3, Megatron's "
             "--qk-layernorm)"),
      LS_KEY(model.tie_embeddings, "output head shares the word embedding"),
      LS_KEY(model.norm_eps, "epsilon of the norm layers"),
      LS_KEY(model.rope_theta, "RoPE base"),
      LS_KEY(model.rope_scaling,
             "RoPE frequency scaling: none; llama3 (Llama 3.1+: long wavelengths divided by "
             "model.rope_scaling_factor, short ones kept, a smooth blend between); or yarn (DeepSeek-V3, Qwen "
             "long context: a ramp between the bounds below, cos and sin scaled)",
             {"none", "llama3", "yarn"}),
      LS_KEY(model.rope_scaling_factor, "llama3 and yarn: the factor long wavelengths are stretched by"),
      LS_KEY(model.rope_low_freq_factor,
             "llama3 scaling: wavelengths above original_max_position_embeddings / this are scaled"),
      LS_KEY(model.rope_high_freq_factor,
             "llama3 scaling: wavelengths below original_max_position_embeddings / this are kept"),
      LS_KEY(model.rope_original_max_position_embeddings, "llama3 and yarn: the context length before scaling"),
      LS_KEY(model.rope_yarn_beta_fast, "yarn: rotations below which frequencies are interpolated fully"),
      LS_KEY(model.rope_yarn_beta_slow, "yarn: rotations above which frequencies are kept"),
      LS_KEY(model.rope_yarn_mscale, "yarn: cos and sin times m(factor, mscale) / m(factor, mscale_all_dim)"),
      LS_KEY(model.rope_yarn_mscale_all_dim,
             "yarn: with MLA the softmax scale times m(factor, this)^2 (DeepSeek-V3: 1); 0 = off"),
      LS_KEY(model.init_std, "std of the normal init (residual projections: std / sqrt(2 * layers))"),
      LS_KEY(model.mtp_num_layers, "multi-token prediction depths D (DeepSeek-V3 / Megatron MTP); 0 = off"),
      LS_KEY(model.mtp_loss_scaling_factor, "MTP loss = factor / D * sum of the depths' mean losses"),
      LS_KEY(train.steps, "optimizer steps"),
      LS_KEY(train.global_batch, "sequences per optimizer step"),
      LS_KEY(train.micro_batch,
             "sequences per forward/backward (global_batch / micro_batch "
             "micro-batches are accumulated)"),
      LS_KEY(train.lr, "peak learning rate"),
      LS_KEY(train.min_lr, "final learning rate of cosine / wsd decay"),
      LS_KEY(train.lr_schedule, "learning-rate schedule after warmup", {"constant", "cosine", "wsd"}),
      LS_KEY(train.warmup_steps, "linear warmup steps"),
      LS_KEY(train.decay_steps, "wsd: steps of the final decay; 0 = 20% of train.steps"),
      LS_KEY(train.seed, "seed of every random stream (init, data)"),
      LS_KEY(train.threads, "worker threads; 0 = every core"),
      LS_KEY(train.out_dir, "run directory (config.toml, metrics.jsonl, fingerprints/)"),
      LS_KEY(train.eval_interval, "evaluate on held-out data every N steps; 0 = never"),
      LS_KEY(train.eval_batches, "micro-batches per evaluation"),
      LS_KEY(train.log_interval, "steps between progress lines when output is not a terminal"),
      LS_KEY(train.tensorboard,
             "also write metrics.jsonl's numbers as TensorBoard event files in out_dir/tensorboard (rank 0)"),
      LS_KEY(train.straggler_threshold,
             "warn when a rank's compute time per step (step time less time waiting in collectives) exceeds "
             "the median of the other ranks' by this fraction over 10 steps; 0 = never"),
      LS_KEY(train.save_interval,
             "save a checkpoint to out_dir/checkpoints every N steps and at the last step; 0 = never"),
      LS_KEY(train.keep_last, "keep only the newest N complete checkpoints; 0 = keep all"),
      LS_KEY(train.async_save, "write checkpoints in a background thread while training goes on"),
      LS_KEY(train.resume,
             "\"auto\" = resume from the newest complete checkpoint in out_dir/checkpoints (else start "
             "fresh), or a checkpoint directory; \"\" = start fresh"),
      LS_KEY(train.init_from,
             "initial weights: a .safetensors file (lockstep ckpt export), or \"hf:DIR\", a Hugging Face model "
             "directory whose config.json sets the model keys (docs/hf.md); \"\" = random init"),
      LS_KEY(train.exit_interval, "stop once the step is a multiple of N (after saving, when saving); 0 = never"),
      LS_KEY(train.recompute_granularity,
             "activation recompute (Megatron's recompute_granularity): \"none\" keeps every layer's activations "
             "for backward; \"full\" keeps only the inputs of groups of layers (train.recompute_method) and runs "
             "their forward again in backward; \"selective\" does so for the modules train.recompute_modules "
             "names: less activation memory for one more forward of what is recomputed, the same bits",
             {"none", "full", "selective"}),
      LS_KEY(train.recompute_method,
             "full recompute's groups (Megatron's recompute_method): \"uniform\": each run of "
             "train.recompute_num_layers consecutive layers of a model chunk is one group; \"block\": the first "
             "train.recompute_num_layers layers of each model chunk are recomputed, one group each, the others "
             "keep their activations; \"\" without full recompute",
             {"", "uniform", "block"}),
      LS_KEY(train.recompute_num_layers,
             "full recompute: layers per group (uniform) or layers recomputed per model chunk (block); 0 "
             "without full recompute"),
      LS_KEY(train.recompute_modules,
             "selective recompute's modules (Megatron's recompute_modules), comma-separated: \"mlp\" (a dense "
             "layer's MLP sublayer), \"moe\" (an MoE sublayer: router, dispatch, experts, combine); Megatron's "
             "others (core_attn, layernorm, moe_act, shared_experts, mla_up_proj) are refused, not yet "
             "implemented"),
      LS_KEY(train.on_nonfinite,
             "a non-finite loss, grad norm or updated parameter: \"stop\" the job (exit status 4, no checkpoint "
             "of that state), or \"skip_step\" (loss or grad norm: the update is not applied; a non-finite "
             "updated parameter still stops)",
             {"stop", "skip_step"}),
      LS_KEY(parallel.tensor, "tensor-parallel size (data parallel = world / (tensor x context x pipeline))"),
      LS_KEY(parallel.sequence_parallel,
             "shard the norms and residual stream along the tokens over the tensor-parallel "
             "group (needs parallel.tensor > 1)"),
      LS_KEY(parallel.context,
             "context-parallel size: each sequence cut into 2 x context chunks, rank r holding chunks r and 2 x "
             "context - 1 - r (docs/parallelism.md)"),
      LS_KEY(parallel.cp_comm_type,
             "how attention crosses the context-parallel group: all_gather (keys and values gathered, kept whole), "
             "p2p (ring attention: key/value chunks passed around the ring, partial results merged by log-sum-exp), "
             "a2a (all-to-all from sequence to head shards and back; heads and query groups divisible by tensor x "
             "context), a2a+p2p (a2a inside parallel.hierarchical_context_parallel_sizes' first size, ring across) "
             "(docs/parallelism.md#context-parallel-communication-parallelcp_comm_type)",
             {"all_gather", "p2p", "a2a", "a2a+p2p"}),
      LS_KEY(parallel.hierarchical_context_parallel_sizes,
             "cp_comm_type = \"a2a+p2p\": \"A,P\", the all-to-all size (consecutive cp ranks) and the ring size, "
             "A x P = parallel.context"),
      LS_KEY(parallel.pipeline, "pipeline-parallel size: the layers split over this many stages (docs/parallelism.md)"),
      LS_KEY(parallel.pipeline_layers,
             "transformer layers of each model chunk, e.g. \"[1,2,1]\" (pipeline x "
             "virtual_pipeline entries); \"\" = an even split"),
      LS_KEY(parallel.pipeline_schedule,
             "pipeline schedule: 1f1b (one forward, one backward; at most pipeline - stage "
             "micro-batches in flight) or all_forward_all_backward (the reference)",
             {"1f1b", "all_forward_all_backward"}),
      LS_KEY(parallel.virtual_pipeline,
             "model chunks per pipeline rank; > 1 = interleaved 1F1B (micro-batches per "
             "rank must be a multiple of parallel.pipeline)"),
      LS_KEY(parallel.expert,
             "expert-parallel size (expert data parallel = world / (expert_tensor x expert x pipeline))"),
      LS_KEY(parallel.expert_tensor,
             "expert tensor parallelism: each expert's hidden units split over this many ranks "
             "(may differ from parallel.tensor)"),
      LS_KEY(parallel.ranks_per_node,
             "consecutive job ranks per node, for dist.link's intra- and inter-node levels; 0 = every rank on one "
             "node"),
      LS_KEY(ddp.overlap_grad_reduce,
             "reduce each gradient bucket while backward goes on (bitwise the same as after it)"),
      LS_KEY(ddp.overlap_param_gather,
             "optimizer.distributed: all-gather the updated parameters in the background; the "
             "next forward waits for each bucket before its first use (bitwise the same)"),
      LS_KEY(ddp.bucket_size, "gradient elements per bucket reduced at once (buckets hold whole parameters)"),
      LS_KEY(dist.backend, "communication backend: auto = mpi under mpirun, else threads (lockstep train --nproc N)",
             {"auto", "threads", "mpi"}),
      LS_KEY(dist.timeout_s, "seconds a collective may wait for a peer before every rank stops with an error"),
      LS_KEY(dist.link,
             "a model of the wire between ranks (docs/distributed.md#the-link-model): "
             "\"intra=900GB/s:2us,inter=50GB/s:5us\", each message then delivered no earlier than latency + "
             "bytes / bandwidth on its link (intra- or inter-node by parallel.ranks_per_node; one link's "
             "messages in FIFO order), waited for by a timer; the bits never depend on it; \"\" = none"),
      LS_KEY(dist.link_scale,
             "scales dist.link's speed (bandwidths times it, latencies divided by it): a positive number, or "
             "\"h100\" = this CPU's measured GEMM peak / the H100's dense bf16 peak (989.4 TFLOP/s), so that a "
             "step's communication / compute ratio here is a cluster's"),
      LS_KEY(optimizer.beta1, "AdamW beta1"),
      LS_KEY(optimizer.beta2, "AdamW beta2"),
      LS_KEY(optimizer.eps, "AdamW epsilon"),
      LS_KEY(optimizer.weight_decay, "AdamW decoupled weight decay on weight matrices"),
      LS_KEY(optimizer.clip_grad, "clip the global gradient norm to this; 0 = off"),
      LS_KEY(optimizer.distributed,
             "ZeRO-1: each data-parallel rank keeps the Adam moments of its shard of the "
             "parameters only, then all-gathers the updated parameters"),
      LS_KEY(optimizer.exp_avg_dtype,
             "storage of AdamW's first moment (Megatron's --exp-avg-dtype): the update runs in fp32 and rounds "
             "the moment to it (bf16: to nearest, ties to even); half the memory in bf16",
             {"fp32", "bf16"}),
      LS_KEY(optimizer.exp_avg_sq_dtype,
             "storage of AdamW's second moment (Megatron's --exp-avg-sq-dtype), as optimizer.exp_avg_dtype",
             {"fp32", "bf16"}),
      LS_KEY(data.source,
             "synthetic (built-in corpus), text:PATH (bytes of a file, vocabulary 256) or "
             "indexed:PREFIX[:WEIGHT],... (Megatron .bin/.idx datasets, blended by weight)"),
      LS_KEY(data.split, "indexed: train,valid[,test] weights splitting each dataset's documents"),
      LS_KEY(data.eval_fraction, "text: trailing fraction of the file held out for evaluation"),
      LS_KEY(data.synthetic_bytes, "synthetic: bytes of generated training text"),
      LS_KEY(data.eod_token, "indexed: end-of-document token id of the data's tokenizer (byte: 256); -1 = none"),
      LS_KEY(data.reset_position_ids, "positions restart at 0 after each end-of-document token (needs data.eod_token)"),
      LS_KEY(data.reset_attention_mask, "attention stays within each document of a sample (needs data.eod_token)"),
      LS_KEY(data.eod_mask_loss,
             "no loss at positions whose input is the end-of-document token; the loss is "
             "the mean over the other tokens of the step (needs data.eod_token)"),
      LS_KEY(data.packing,
             "\"thd\": each sample is whole documents packed into model.seq_length tokens (longer ones cut), "
             "each padded to 2 x parallel.context (x parallel.tensor under sequence parallelism), no loss across "
             "documents or on padding; implies reset_position_ids and reset_attention_mask; needs indexed data "
             "and data.eod_token (docs/data.md#packed-variable-length-samples-datapacking--thd)",
             {"none", "thd"}),
      LS_KEY(data.packing_pad_multiple,
             "thd: pad each document to a multiple of this (a multiple of what the layout needs; the same value "
             "makes runs of different layouts see the same samples); 0 = 2 x parallel.context x parallel.tensor "
             "(under sequence parallelism)"),
      LS_KEY(precision.params,
             "compute precision: fp32, or bf16 mixed precision (bf16 weights and activations, "
             "fp32 master weights, gradients and accumulation; docs/precision.md)",
             {"fp32", "bf16"}),
      LS_KEY(precision.fp8,
             "FP8 GEMMs in every linear layer and expert (needs params = bf16): delayed (per-tensor "
             "scale from an amax history), tensorwise (current per-tensor amax), blockwise (1x128 "
             "activations / gradients, 128x128 weights, power-of-2 scales), mxfp8 (1x32, E8M0 scales)",
             {"none", "delayed", "tensorwise", "blockwise", "mxfp8"}),
      LS_KEY(precision.fp8_format,
             "FP8 formats: hybrid = E4M3 forward (inputs, weights), E5M2 gradients; e4m3 = E4M3 "
             "everywhere",
             {"hybrid", "e4m3"}),
      LS_KEY(precision.fp8_amax_history_len, "fp8 = delayed: amax values kept per tensor"),
      LS_KEY(precision.fp8_amax_compute_algo, "fp8 = delayed: the amax a scale comes from", {"max", "most_recent"}),
      LS_KEY(precision.fp8_margin, "fp8 = delayed: scale = (format max / amax) / 2^margin"),
      LS_KEY(precision.fp4,
             "NVFP4 GEMMs (needs params = bf16): E2M1 with an E4M3 scale per 16 and an FP32 tensor scale, "
             "16x16 weight blocks, random Hadamard transform on the weight-gradient inputs, stochastic "
             "rounding of gradients",
             {"none", "nvfp4"}),
      LS_KEY(precision.fp4_high_precision_layers,
             "fp4 = nvfp4: the first and the last N transformer layers stay BF16 "
             "(router, embedding and output head always do)"),
      LS_KEY(moe.num_experts, "routed experts per MoE layer; 0 = dense model"),
      LS_KEY(moe.router_topk, "experts per token k"),
      LS_KEY(moe.router_score_function, "router scores", {"softmax", "sigmoid"}),
      LS_KEY(moe.router_pre_softmax, "softmax over all experts before top-k (else softmax over the k logits)"),
      LS_KEY(moe.router_num_groups, "group-limited routing: expert groups; 0 = off"),
      LS_KEY(moe.router_group_topk, "group-limited routing: groups kept per token"),
      LS_KEY(moe.router_topk_scaling_factor, "multiplies the top-k routing weights"),
      LS_KEY(moe.router_load_balancing_type, "comma list of aux_loss, seq_aux_loss, global_aux_loss; or none"),
      LS_KEY(moe.aux_loss_coeff, "coefficient of each load-balancing loss"),
      LS_KEY(moe.z_loss_coeff, "router z-loss coefficient (mean squared logsumexp of the logits)"),
      LS_KEY(moe.expert_capacity_factor, "expert capacity = ceil(tokens * k / experts * factor); 0 = dropless"),
      LS_KEY(moe.token_drop_policy, "which tokens an expert over capacity keeps", {"probs", "position"}),
      LS_KEY(moe.pad_expert_input_to_capacity, "pad every expert's input to its capacity"),
      LS_KEY(moe.token_dispatcher, "how tokens reach the experts of other expert-parallel ranks",
             {"allgather", "alltoall"}),
      LS_KEY(moe.router_enable_expert_bias, "aux-loss-free balancing: a per-expert bias that affects selection only"),
      LS_KEY(moe.router_bias_update_rate, "expert bias += rate * sign(mean load - load) after each step"),
      LS_KEY(moe.ffn_hidden_size, "expert MLP width; 0 = the dense MLP width"),
      LS_KEY(moe.shared_expert_intermediate_size, "width of the shared expert; 0 = none"),
      LS_KEY(moe.shared_expert_gate, "scale the shared expert's output by sigmoid(x . w_gate)"),
      LS_KEY(moe.shared_expert_overlap,
             "compute the shared expert while the routed tokens' all-to-all is in flight (Megatron's "
             "--moe-shared-expert-overlap; needs a shared expert and moe.token_dispatcher = \"alltoall\"); the "
             "same bits"),
      LS_KEY(moe.delay_wgrad_compute,
             "compute the experts' fc weight gradients while the dispatch backward's all-to-all is in flight "
             "(Megatron's --delay-wgrad-compute; needs moe.token_dispatcher = \"alltoall\"); the same bits"),
      LS_KEY(moe.layer_freq,
             "MoE layers: \"N\" = every N-th layer from layer 0, or a 0/1 pattern such as "
             "\"[0,1,1,1]\" or \"([0]*1+[1]*3)\""),
      LS_KEY(moe.use_upcycling,
             "train.init_from is a dense checkpoint: every expert starts as a slice of its layer's MLP, "
             "granularity = model.ffn_hidden_size / moe.ffn_hidden_size (Megatron's --moe-use-upcycling)"),
      LS_KEY(moe.input_jitter_eps, "router input multiplied by uniform(1 - eps, 1 + eps) in training; 0 = off"),
      LS_KEY(debug.trace,
             "modules: hash every module's output and input gradient per micro-batch into "
             "RUN/trace/rank-NNNNN.jsonl (lockstep diff names the first module that differs)",
             {"off", "modules"}),
      LS_KEY(debug.inject_ulp,
             "\"STEP:MODULE\" (e.g. \"3:layers.1.attn.qkv\"): flip one ulp of MODULE's output in "
             "the first micro-batch of STEP, for testing lockstep diff; \"\" = off"),
      LS_KEY(debug.inject_nan,
             "\"STEP:MODULE\": set the first element of MODULE's output in the first micro-batch of STEP to "
             "NaN, for testing the non-finite guard (train.on_nonfinite); \"\" = off"),
      LS_KEY(debug.fail_at_step,
             "rank debug.fail_rank fails at this step, once per run directory (for testing --max-restarts; "
             "docs/faults.md); 0 = never"),
      LS_KEY(debug.fail_rank, "the rank that debug.fail_at_step fails"),
      LS_KEY(debug.fail_in,
             "where the injected failure strikes: step (after the rank's forward and backward) or save "
             "(after the rank wrote its part of that step's checkpoint, before the commit)",
             {"step", "save"}),
      LS_KEY(debug.fail_mode,
             "kill: SIGKILL to the rank's process (with the threads backend every rank's); hang: the rank "
             "stops responding, so the others' collectives time out (dist.timeout_s)",
             {"kill", "hang"}),
      LS_KEY(debug.slow_rank, "the rank that debug.slow_ms slows down"),
      LS_KEY(debug.slow_ms, "rank debug.slow_rank sleeps this long in every step (an injected straggler); 0 = off"),
  };
  return table;
}
#undef LS_KEY

const Key* find_key(std::string_view name) {
  for (const Key& k : keys())
    if (k.name == name) return &k;
  return nullptr;
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1])});
      diag = up;
    }
  }
  return row[b.size()];
}

[[noreturn]] void unknown_key(std::string_view name, const std::string& where) {
  std::string best;
  size_t best_d = 4;
  for (const Key& k : keys()) {
    const size_t d = edit_distance(name, k.name);
    if (d < best_d) best_d = d, best = k.name;
  }
  user_error(where, "unknown config key '", name, "'",
             best.empty() ? std::string(" (see `lockstep help config`)") : str(" (did you mean '", best, "'?)"));
}

const char* type_name(const Ref& r) {
  switch (r.index()) {
    case 0:
      return "an integer";
    case 1:
      return "a non-negative integer";
    case 2:
      return "a number";
    case 3:
      return "true or false";
    default:
      return "a string";
  }
}

// A value before it is stored: from TOML (typed) or from the command line (text).
using Value = std::variant<int64_t, double, bool, std::string>;

std::string show(const Value& v) {
  return std::visit(
      [](const auto& x) -> std::string {
        using X = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<X, std::string>) {
          return "\"" + x + "\"";
        } else if constexpr (std::is_same_v<X, bool>) {
          return x ? "true" : "false";
        } else if constexpr (std::is_same_v<X, double>) {
          // As the file wrote it: 2.0 for an integer key must not read back as "2".
          std::string t = str(x);
          return t.find_first_of(".eEni") == std::string::npos ? t + ".0" : t;
        } else {
          return str(x);
        }
      },
      v);
}

void assign(Config& c, const Key& key, const Value& v, const std::string& where) {
  auto bad = [&]() { user_error(where, key.name, " = ", show(v), ": expected ", type_name(key.ref)); };
  std::visit(
      [&](const auto& ref) {
        using R = std::decay_t<decltype(ref)>;
        if constexpr (std::is_same_v<R, IntRef>) {
          if (!std::holds_alternative<int64_t>(v)) bad();
          ref(c) = std::get<int64_t>(v);
        } else if constexpr (std::is_same_v<R, U64Ref>) {
          if (!std::holds_alternative<int64_t>(v) || std::get<int64_t>(v) < 0) bad();
          ref(c) = static_cast<uint64_t>(std::get<int64_t>(v));
        } else if constexpr (std::is_same_v<R, FloatRef>) {
          if (std::holds_alternative<int64_t>(v))
            ref(c) = static_cast<double>(std::get<int64_t>(v));
          else if (std::holds_alternative<double>(v))
            ref(c) = std::get<double>(v);
          else
            bad();
        } else if constexpr (std::is_same_v<R, BoolRef>) {
          if (!std::holds_alternative<bool>(v)) bad();
          ref(c) = std::get<bool>(v);
        } else {
          if (!std::holds_alternative<std::string>(v)) bad();
          const std::string& s = std::get<std::string>(v);
          if (!key.choices.empty() && std::find(key.choices.begin(), key.choices.end(), s) == key.choices.end()) {
            std::string list;
            for (const auto& ch : key.choices) list += (list.empty() ? "" : ", ") + ch;
            user_error(where, key.name, " = \"", s, "\": expected one of ", list);
          }
          ref(c) = s;
        }
      },
      key.ref);
}

// Command-line text to a value of the key's type.
Value parse_text(const Key& key, const std::string& text, const std::string& where) {
  auto fail = [&]() -> Value { user_error(where, key.name, "=", text, ": expected ", type_name(key.ref)); };
  switch (key.ref.index()) {
    case 0:
    case 1: {
      int64_t x;
      auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), x);
      if (ec != std::errc() || p != text.data() + text.size()) return fail();
      return x;
    }
    case 2: {
      if (text.empty()) return fail();
      char* end = nullptr;
      const double x = std::strtod(text.c_str(), &end);
      if (end != text.c_str() + text.size() || !std::isfinite(x)) return fail();
      return x;
    }
    case 3:
      if (text == "true") return true;
      if (text == "false") return false;
      return fail();
    default: {
      std::string s = text;
      if (s.size() >= 2 && (s.front() == '"' || s.front() == '\'') && s.back() == s.front())
        s = s.substr(1, s.size() - 2);
      return s;
    }
  }
}

Value from_toml(const toml::node& node, const std::string& name, const std::string& where) {
  // A list key (parallel.pipeline_layers, moe.layer_freq) written as a TOML array of integers: its text.
  if (const toml::array* list = node.as_array(); list && list->is_homogeneous(toml::node_type::integer)) {
    const Key* key = find_key(name);
    if (key && key->ref.index() == 4 && key->choices.empty()) {
      std::string text = "[";
      for (const toml::node& x : *list) text += str(text.size() > 1 ? "," : "", x.as_integer()->get());
      return text + "]";
    }
  }
  if (auto v = node.as_integer()) return v->get();
  if (auto v = node.as_floating_point()) return v->get();
  if (auto v = node.as_boolean()) return v->get();
  if (auto v = node.as_string()) return v->get();
  const std::string type = str(node.type());
  user_error(where, name, ": expected a single value, got ", type == "array" ? "an " : "a ", type);
}

// Flattens a TOML table into dotted keys in document order.
void flatten(const toml::table& t, const std::string& prefix,
             std::vector<std::pair<std::string, const toml::node*>>& out) {
  for (auto&& [k, node] : t) {
    const std::string name = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    if (const toml::table* sub = node.as_table())
      flatten(*sub, name, out);
    else
      out.emplace_back(name, &node);
  }
}

// Architecture defaults of each preset; any of them can be overridden after.
const std::map<std::string, std::vector<std::pair<std::string, Value>>>& presets() {
  static const std::map<std::string, std::vector<std::pair<std::string, Value>>> p = {
      {"gpt2",
       {{"model.normalization", std::string("layernorm")},
        {"model.position_embedding", std::string("learned")},
        {"model.activation", std::string("gelu")},
        {"model.bias", true},
        {"model.tie_embeddings", true}}},
      {"llama",
       {{"model.normalization", std::string("rmsnorm")},
        {"model.position_embedding", std::string("rope")},
        {"model.activation", std::string("swiglu")},
        {"model.bias", false},
        {"model.tie_embeddings", false}}},
  };
  return p;
}

void validate_mla(const Config& c) {
  const ModelConfig& m = c.model;
  const auto refuse = [](const std::string& what, const std::string& why) {
    user_error("model.multi_latent_attention = true with ", what, ": ", why);
  };
  for (const auto& [name, v] : {std::pair<const char*, int64_t>{"model.kv_lora_rank", m.kv_lora_rank},
                                {"model.qk_head_dim", m.qk_head_dim},
                                {"model.qk_pos_emb_head_dim", m.qk_pos_emb_head_dim},
                                {"model.v_head_dim", m.v_head_dim}})
    if (v <= 0) refuse(str(name, " = ", v), "must be positive");
  if (m.q_lora_rank < 0) refuse(str("model.q_lora_rank = ", m.q_lora_rank), "must be >= 0 (0 = no query compression)");
  if (m.v_head_dim > m.head_dim())
    refuse(str("model.v_head_dim = ", m.v_head_dim),
           str("the values are padded to the query / key head size ", m.head_dim(), ", so it may not exceed it"));
  if (m.position_embedding != "rope") refuse("model.position_embedding = \"learned\"", "its keys carry RoPE");
  if (m.num_query_groups != 0 && m.num_query_groups != m.num_heads)
    refuse(str("model.num_query_groups = ", m.num_query_groups), "every head has its own keys and values");
  if (m.kv_channels != 0) refuse("model.kv_channels", "the head sizes are model.qk_head_dim and model.v_head_dim");
  if (m.qk_layernorm || m.add_qkv_bias || m.bias)
    refuse(m.qk_layernorm   ? "model.qk_layernorm"
           : m.add_qkv_bias ? "model.add_qkv_bias"
                            : "model.bias = true",
           "not supported together");
}

// Upcycling (train/upcycling.h) makes the MoE model compute the dense one at step 0: expert groups
// of G slices of the MLP, chosen whole by the top k, weighted to sum to one.
void validate_upcycling(const Config& c) {
  const MoeConfig& e = c.moe;
  if (!e.use_upcycling) return;
  const auto refuse = [](const std::string& what, const std::string& why) {
    user_error("moe.use_upcycling = true with ", what, ": ", why);
  };
  if (e.num_experts == 0) refuse("moe.num_experts = 0", "there are no experts to make");
  if (c.train.init_from.empty()) refuse("train.init_from = \"\"", "it needs the dense checkpoint to upcycle");
  const int64_t F = c.model.ffn_hidden(), Fe = e.ffn_hidden_size ? e.ffn_hidden_size : F;
  if (F % Fe) refuse(str("moe.ffn_hidden_size = ", Fe), str("it must divide the dense MLP's width ", F));
  const int64_t G = F / Fe;
  if (e.num_experts % G || e.router_topk % G)
    refuse(str("granularity ", G, " (model.ffn_hidden_size / moe.ffn_hidden_size)"),
           str("moe.num_experts = ", e.num_experts, " and moe.router_topk = ", e.router_topk,
               " must be multiples of it, so that the top k take whole copies of the MLP"));
  if (e.router_score_function != "softmax")
    refuse("moe.router_score_function = \"sigmoid\"", "it needs softmax routing");
  if (e.router_num_groups > 0) refuse("moe.router_num_groups", "group-limited routing is not supported");
  if (e.shared_expert_intermediate_size > 0)
    refuse("moe.shared_expert_intermediate_size", "the dense MLP has no counterpart of the shared expert");
}

void validate_moe(const MoeConfig& e, int64_t L) {
  if (e.num_experts < 0) user_error("moe.num_experts = ", e.num_experts, ": must be >= 0 (0 = dense)");
  if (e.num_experts == 0) return;
  if (e.num_experts > 1024)
    user_error("moe.num_experts = ", e.num_experts, ": must be at most 1024 (the router's per-token top-k limit)");
  const int64_t E = e.num_experts, K = e.router_topk;
  if (K <= 0 || K > E) user_error("moe.router_topk = ", K, ": must be in [1, moe.num_experts = ", E, "]");
  if (e.router_num_groups < 0 || e.router_group_topk < 0)
    user_error("moe.router_num_groups and moe.router_group_topk must be >= 0");
  if (e.router_num_groups > 0) {
    const int64_t G = e.router_num_groups, GK = e.router_group_topk;
    if (E % G) user_error("moe.num_experts = ", E, " is not divisible by moe.router_num_groups = ", G);
    if (GK <= 0 || GK > G)
      user_error("moe.router_group_topk = ", GK, ": must be in [1, moe.router_num_groups = ", G, "]");
    if (K % GK) user_error("moe.router_topk = ", K, " is not divisible by moe.router_group_topk = ", GK);
    if (K / GK > E / G)
      user_error("moe.router_topk / moe.router_group_topk = ", K / GK, " exceeds the experts per group (", E / G, ")");
    if (K > GK * (E / G)) user_error("moe.router_topk = ", K, " exceeds the experts in the kept groups");
  } else if (e.router_group_topk > 0) {
    user_error("moe.router_group_topk = ", e.router_group_topk, " needs moe.router_num_groups > 0");
  }
  if (!(e.router_topk_scaling_factor > 0))
    user_error("moe.router_topk_scaling_factor = ", e.router_topk_scaling_factor, ": must be positive");
  {
    std::stringstream ss(e.router_load_balancing_type);
    std::string item;
    while (std::getline(ss, item, ',')) {
      item.erase(std::remove(item.begin(), item.end(), ' '), item.end());
      if (item != "aux_loss" && item != "seq_aux_loss" && item != "global_aux_loss" && item != "none")
        user_error("moe.router_load_balancing_type = \"", e.router_load_balancing_type, "\": unknown type '", item,
                   "' (expected a comma list of aux_loss, seq_aux_loss, global_aux_loss, or none)");
    }
  }
  if (e.aux_loss_coeff < 0) user_error("moe.aux_loss_coeff = ", e.aux_loss_coeff, ": must be >= 0");
  if (e.z_loss_coeff < 0) user_error("moe.z_loss_coeff = ", e.z_loss_coeff, ": must be >= 0");
  if (e.expert_capacity_factor < 0)
    user_error("moe.expert_capacity_factor = ", e.expert_capacity_factor, ": must be >= 0 (0 = dropless)");
  if (e.pad_expert_input_to_capacity && e.expert_capacity_factor == 0)
    user_error("moe.pad_expert_input_to_capacity = true needs moe.expert_capacity_factor > 0");
  if (e.router_enable_expert_bias && e.router_score_function != "sigmoid")
    user_error("moe.router_enable_expert_bias = true needs moe.router_score_function = \"sigmoid\"");
  if (e.router_bias_update_rate < 0)
    user_error("moe.router_bias_update_rate = ", e.router_bias_update_rate, ": must be >= 0");
  if (e.ffn_hidden_size < 0) user_error("moe.ffn_hidden_size = ", e.ffn_hidden_size, ": must be >= 0");
  if (e.shared_expert_intermediate_size < 0)
    user_error("moe.shared_expert_intermediate_size = ", e.shared_expert_intermediate_size, ": must be >= 0");
  if (e.shared_expert_gate && e.shared_expert_intermediate_size == 0)
    user_error("moe.shared_expert_gate = true needs moe.shared_expert_intermediate_size > 0");
  if (e.shared_expert_overlap && e.shared_expert_intermediate_size == 0)
    user_error("moe.shared_expert_overlap = true needs moe.shared_expert_intermediate_size > 0");
  if (e.shared_expert_overlap && e.token_dispatcher != "alltoall")
    user_error("moe.shared_expert_overlap = true needs moe.token_dispatcher = \"alltoall\" (it is \"",
               e.token_dispatcher, "\"), as Megatron's");
  if (e.delay_wgrad_compute && e.token_dispatcher != "alltoall")
    user_error("moe.delay_wgrad_compute = true needs moe.token_dispatcher = \"alltoall\" (it is \"", e.token_dispatcher,
               "\")");
  if (!(e.input_jitter_eps >= 0 && e.input_jitter_eps < 1))
    user_error("moe.input_jitter_eps = ", e.input_jitter_eps, ": must be in [0, 1)");
  moe_layer_pattern(e.layer_freq, L);
}

void validate_precision(const PrecisionConfig& p, int64_t L) {
  const bool fp8 = p.fp8 != "none", fp4 = p.fp4 != "none";
  if (fp8 && fp4)
    user_error("precision.fp8 = \"", p.fp8, "\" and precision.fp4 = \"", p.fp4, "\": choose one low-precision recipe");
  if ((fp8 || fp4) && p.params != "bf16")
    user_error("precision.", fp8 ? "fp8 = \"" + p.fp8 : "fp4 = \"" + p.fp4, "\" needs precision.params = \"bf16\" ",
               "(the low-precision GEMMs run inside BF16 mixed precision), got \"", p.params, "\"");
  if (p.fp8_amax_history_len < 1)
    user_error("precision.fp8_amax_history_len = ", p.fp8_amax_history_len, ": must be >= 1");
  if (p.fp8_margin < 0 || p.fp8_margin > 64)
    user_error("precision.fp8_margin = ", p.fp8_margin, ": must be in [0, 64]");
  if (p.fp4_high_precision_layers < 0)
    user_error("precision.fp4_high_precision_layers = ", p.fp4_high_precision_layers, ": must be >= 0");
  if (fp4 && 2 * p.fp4_high_precision_layers >= L)
    user_error("precision.fp4_high_precision_layers = ", p.fp4_high_precision_layers,
               " keeps all model.num_layers = ", L, " layers in BF16: nothing would run in NVFP4");
}

// determinism = "layout" with an MoE model whose micro-batch tokens are split over `ranks` ranks (tensor x context
// parallelism; each routes its own tokens): what the experts cannot take. The expert x expert-tensor group holds
// whole groups of those ranks, whose rows of an expert it puts back in token order, or a divisor of them, whose
// partners combine each micro-batch's parts (model/moe/experts.h); any other group would see parts that do not tile
// the micro-batch. FP8 quantises an expert's rows along the tokens segment by segment, so a rank's whole segments
// quantise as one process's, its padding rows (in its last one) zero rows (with model.bias their activations are
// zeroed: GroupedExperts' inert_padding). NVFP4's weight gradients transform an expert's rows of a micro-batch in
// 16-row Hadamard blocks (Precision::ExpertBlocks), which the group holds whole when it holds whole groups of
// those ranks, or, when it divides them under tensor parallelism alone (1: the experts on every rank), gathers from
// the partners holding the rest (GroupedExperts::gathered_wgrad); and without padding between their rows (but for
// a group of 1 there, whose gathered rows put the tp ranks' padding after all of their tokens).
// what_prefix starts the refused combination; ranks_name names `ranks` (a key, or a product of keys).
void refuse_split_experts(const Config& c, int64_t ranks, const std::string& ranks_name, const std::string& what_prefix,
                          const std::function<void(const std::string&, const std::string&)>& refuse) {
  if (c.moe.num_experts == 0 || ranks == 1) return;
  const int64_t expert_group = static_cast<int64_t>(c.parallel.expert) * c.parallel.expert_tensor;
  const std::string who = "ranks of " + ranks_name + " = " + std::to_string(ranks);
  if (expert_group > 1 && expert_group % ranks && ranks % expert_group)
    refuse(str(what_prefix, "an MoE model and parallel.expert x parallel.expert_tensor = ", expert_group),
           str("an expert's rows would come from parts of a micro-batch's ", who,
               " that do not tile it: the expert "
               "x expert-tensor group must be 1, a multiple of ",
               ranks, " or a divisor of it"));
  const bool gathers = ranks % expert_group == 0 && c.parallel.context == 1;  // ranks = tp
  if (c.precision.fp4 != "none" && expert_group % ranks && !gathers)
    refuse(str(what_prefix, "an MoE model, precision.fp4 = \"", c.precision.fp4,
               "\" and parallel.expert x parallel.expert_tensor = ", expert_group),
           str("NVFP4's expert weight gradients transform an expert's rows of a micro-batch in 16-row Hadamard blocks, "
               "which would straddle the rows of its ",
               who,
               "; use an expert x expert-tensor group that is a multiple "
               "of ",
               ranks, ", or an FP8 recipe"));
  // (With the experts on every rank under tensor parallelism alone the gathered rows leave the padding out.)
  if (c.precision.fp4 != "none" && c.moe.pad_expert_input_to_capacity && !(gathers && expert_group == 1))
    refuse(
        str(what_prefix, "an MoE model, precision.fp4 = \"", c.precision.fp4,
            "\" and moe.pad_expert_input_to_capacity = true"),
        str("a micro-batch's NVFP4 expert block would hold the padding of each of its ", who,
            " between its tokens, inside its 16-row Hadamard blocks; use moe.pad_expert_input_to_capacity = false or "
            "an FP8 recipe"));
}

// Context parallelism (parallel/context_parallel.h): each sample cut into 2 x cp chunks (x tp rows under sequence
// parallelism or in an MoE layer under tensor parallelism); what it does not support yet is refused by name.
void validate_context_parallel(const Config& c) {
  const int64_t cp = c.parallel.context;
  if (!c.parallel.hierarchical_context_parallel_sizes.empty() && c.parallel.cp_comm_type != "a2a+p2p")
    user_error("parallel.hierarchical_context_parallel_sizes = \"", c.parallel.hierarchical_context_parallel_sizes,
               "\": only for parallel.cp_comm_type = \"a2a+p2p\" (it is \"", c.parallel.cp_comm_type, "\")");
  if (cp == 1) return;
  const ModelConfig& m = c.model;
  const bool sp = c.parallel.sequence_parallel;
  const int64_t tp = c.parallel.tensor;
  if (m.seq_length % (2 * cp))
    user_error("parallel.context = ", cp, ": model.seq_length = ", m.seq_length,
               " is not divisible by 2 x parallel.context = ", 2 * cp,
               " (each sequence is cut into 2 x context chunks, two per rank)");
  if ((sp || c.moe.num_experts > 0) && (c.train.micro_batch * m.seq_length / cp) % tp)
    user_error("parallel.context = ", cp, sp ? " with parallel.sequence_parallel" : " with an MoE model",
               ": train.micro_batch x model.seq_length / context = ", c.train.micro_batch * m.seq_length / cp,
               " tokens per rank are not divisible by parallel.tensor = ", tp);
  const auto refuse = [cp](const std::string& what, const std::string& why) {
    user_error("parallel.context = ", cp, " with ", what, ": ", why);
  };
  // Attention's communication (parallel/context_attention.h): the all-to-all hands each rank whole heads
  // and query groups of its group's sequence.
  const auto [a2a, ring] = c.parallel.context_a2a_ring();
  const std::string type = str("parallel.cp_comm_type = \"", c.parallel.cp_comm_type, "\"");
  if (a2a > 1 && (m.num_heads % (tp * a2a) || m.query_groups() % (tp * a2a)))
    refuse(type, str("the all-to-all gives each of parallel.tensor x ", a2a, " = ", tp * a2a,
                     " ranks whole heads: model.num_heads = ", m.num_heads, " and query groups = ", m.query_groups(),
                     " must be divisible by it"));
  if (ring > 1 && c.parallel.cp_comm_type != "all_gather" && c.determinism == "layout")
    refuse(str(type, " and determinism = \"layout\""),
           "ring attention merges each rank's partial results in ring order, which depends on the layout; use "
           "cp_comm_type = \"a2a\" (bitwise the single process) or \"all_gather\"");
  // Layout: every sum over a micro-batch's tokens in token segments (layout_token_segments), each rank's
  // chunks whole segments: its 2B token pieces, combined exactly over the group (combine_token_pieces).
  if (c.determinism == "layout") {
    const int64_t B = c.train.micro_batch, S = c.layout_segments;
    // Refused before the key, with or without it.
    const bool moe = c.moe.num_experts > 0;
    refuse_split_experts(c, tp * cp, "parallel.tensor x parallel.context", "determinism = \"layout\", ", refuse);
    // NVFP4: a cp rank's chunks hold whole 16-token blocks (the weight gradients' Hadamard transform and
    // their 1 x 16 blocks along the tokens), as one process cuts the micro-batch's tokens.
    if (c.precision.fp4 != "none" && (m.seq_length / (2 * cp)) % 16)
      refuse(str("determinism = \"layout\", precision.fp4 = \"", c.precision.fp4,
                 "\" and model.seq_length = ", m.seq_length),
             str("each rank's chunks of ", m.seq_length / (2 * cp),
                 " tokens must be whole 16-token blocks of the weight "
                 "gradients' Hadamard transform: model.seq_length / (2 x parallel.context) must be a multiple of 16"));
    // The shared expert under tensor parallelism sees a tp rank's units of the cp rank's rows
    // (ParamStore::token_units: max(2B, tp) per cp rank), each whole 16-token blocks too.
    const int64_t unit = B * m.seq_length / (cp * std::max<int64_t>(2 * B, tp));
    if (c.precision.fp4 != "none" && moe && c.moe.shared_expert_intermediate_size > 0 && tp > 1 && unit % 16)
      refuse(str("determinism = \"layout\", precision.fp4 = \"", c.precision.fp4,
                 "\", moe.shared_expert_intermediate_size = ", c.moe.shared_expert_intermediate_size,
                 " and parallel.tensor = ", tp),
             str("the shared expert's weight gradients transform each tensor-parallel rank's token units of ", unit,
                 " tokens in 16-token Hadamard blocks: train.micro_batch x model.seq_length / (parallel.context x "
                 "max(2 x train.micro_batch, parallel.tensor)) must be a multiple of 16"));
    if (!c.layout_token_segments)
      refuse("determinism = \"layout\"",
             "the key and value gradients and every weight gradient are sums over each "
             "rank's tokens: set layout_token_segments = true to compute them in canonical token segments");
    // (A layout_segments that is no power of two in [1, 64] is named by validate_layout_determinism.)
    if (std::has_single_bit(static_cast<uint64_t>(S)) && S <= 64 && S % (2 * cp * B))
      refuse(str("determinism = \"layout\", train.micro_batch = ", B, " and layout_segments = ", S),
             str("each rank's chunks must be whole token segments: 2 x parallel.context x train.micro_batch = ",
                 2 * cp * B, " must divide layout_segments (at most 64)"));
    // Sequence parallelism (and an MoE layer under tensor parallelism): a tp rank holds 1 / tp of the cp
    // rank's rows, whole token segments of them.
    if ((sp || moe) && std::has_single_bit(static_cast<uint64_t>(S)) && S <= 64 && S % (cp * tp))
      refuse(str("determinism = \"layout\", ", sp ? "parallel.sequence_parallel" : "an MoE model",
                 ", parallel.tensor = ", tp, " and layout_segments = ", S),
             str("each tensor-parallel rank's rows must be whole token segments: parallel.context x parallel.tensor = ",
                 cp * tp, " must divide layout_segments (at most 64)"));
  }
}

// determinism = "layout" (docs/determinism.md) covers data, expert, expert tensor, pipeline and (dense models) tensor
// and sequence parallelism, and context parallelism within validate_context_parallel's limits:
// what it cannot yet make layout-invariant is refused by name. (Any number of micro-batches per rank is taken: blocks
// that are not subtrees of the canonical tree are reduced as their pieces, parallel/data_parallel.h.)
void validate_layout_determinism(const Config& c) {
  if (c.layout_segments < 1 || c.layout_segments > 64 || std::popcount(static_cast<uint64_t>(c.layout_segments)) != 1)
    user_error("layout_segments = ", c.layout_segments, ": must be a power of two in [1, 64]");
  if (c.layout_token_segments && c.determinism != "layout")
    user_error(
        "layout_token_segments = true: needs determinism = \"layout\" (it chooses layout mode's summation "
        "order), not \"",
        c.determinism, "\"");
  if (c.determinism != "layout") return;
  const auto refuse = [](const std::string& what, const std::string& why) {
    user_error("determinism = \"layout\" with ", what, ": ", why);
  };
  if (c.layout_token_segments) {
    const int64_t B = c.train.micro_batch;
    if (c.layout_segments % B || c.layout_segments / B > c.model.seq_length)
      refuse(str("layout_token_segments = true, train.micro_batch = ", B, " and layout_segments = ", c.layout_segments),
             "the micro-batch's token segments must fall on sample boundaries: train.micro_batch must divide "
             "layout_segments, with at most model.seq_length segments per sample");
  }
  const MoeConfig& e = c.moe;
  // MoE under tensor parallelism: each tp rank routes its own N / tp tokens, whole token segments of the
  // micro-batch (model/moe/experts.h); a capacity is the micro-batch's (model/moe/moe_layer.h).
  const int64_t tp = c.parallel.tensor;
  refuse_split_experts(c, tp, "parallel.tensor", str("parallel.tensor = ", tp, ", "), refuse);
  // The shared expert sees a tp rank's N / tp tokens: its weight gradients' operands are quantised along
  // those tokens (the FP8 block recipes' blocks stop at the token segments; NVFP4 keys its stochastic
  // rounding by their micro-batch tokens, its Hadamard blocks of 16 within the rank's).
  const int64_t rank_tokens = c.train.micro_batch * c.model.seq_length / c.parallel.tensor;
  if (e.num_experts > 0 && c.parallel.tensor > 1 && c.precision.fp4 != "none" &&
      e.shared_expert_intermediate_size > 0 && rank_tokens % 16)
    refuse(str("precision.fp4 = \"", c.precision.fp4, "\", moe.shared_expert_intermediate_size = ",
               e.shared_expert_intermediate_size, " and parallel.tensor = ", c.parallel.tensor),
           str("the shared expert's weight gradients transform each tensor-parallel rank's ", rank_tokens,
               " tokens in 16-token Hadamard blocks: train.micro_batch x model.seq_length / parallel.tensor must be a "
               "multiple of 16"));
  // Tensor parallelism's reductions are cut into layout_segments canonical segments (segment s of n items:
  // [s n / S, (s + 1) n / S), so no size needs to be a multiple of S), S / tp per rank.
  if (c.layout_segments % c.parallel.tensor)
    refuse(str("parallel.tensor = ", c.parallel.tensor, " and layout_segments = ", c.layout_segments),
           "parallel.tensor must divide layout_segments (each tensor-parallel rank holds a block of whole "
           "canonical segments of every reduction it splits)");
  // The experts' K segments (model/moe/experts.h): F / S hidden units each, S / etp per etp rank.
  const int64_t F = e.ffn_hidden_size ? e.ffn_hidden_size : c.model.ffn_hidden();
  if (e.num_experts > 0 && F % c.layout_segments)
    refuse(str(e.ffn_hidden_size ? "moe.ffn_hidden_size = "
                                 : "moe.ffn_hidden_size = 0 (the experts' width "
                                   "model.ffn_hidden_size = ",
               F, e.ffn_hidden_size ? "" : ")", " and layout_segments = ", c.layout_segments),
           "the expert hidden size must be divisible by layout_segments (each canonical segment of the expert "
           "GEMMs over the hidden units is F / layout_segments units)");
  if (c.layout_segments % c.parallel.expert_tensor)
    refuse(str("parallel.expert_tensor = ", c.parallel.expert_tensor, " and layout_segments = ", c.layout_segments),
           "parallel.expert_tensor must divide layout_segments (each expert-tensor-parallel rank holds a block of "
           "whole canonical segments of the hidden units)");
  if (c.moe.router_load_balancing_type.find("global_aux_loss") != std::string::npos)
    refuse("moe.router_load_balancing_type = \"" + c.moe.router_load_balancing_type + "\"",
           "Megatron's global aux loss balances a rank's micro-batch i against the counts of every data-parallel "
           "rank's micro-batches 0 .. i of the step, which are other micro-batches under another data-parallel "
           "size: the loss itself depends on the layout");
}

void validate(const Config& c) {
  const ModelConfig& m = c.model;
  const TrainConfig& t = c.train;
  auto positive = [](const char* name, int64_t v) {
    if (v <= 0) user_error(name, " = ", v, ": must be positive");
  };
  positive("model.num_layers", m.num_layers);
  positive("model.hidden_size", m.hidden_size);
  positive("model.num_heads", m.num_heads);
  positive("model.seq_length", m.seq_length);
  positive("model.vocab_size", m.vocab_size);
  positive("train.steps", t.steps);
  positive("train.global_batch", t.global_batch);
  positive("train.micro_batch", t.micro_batch);
  parse_link_spec(c.dist.link, "dist.link");
  parse_link_scale(c.dist.link_scale, "dist.link_scale");
  if (c.parallel.ranks_per_node < 0)
    user_error("parallel.ranks_per_node = ", c.parallel.ranks_per_node, ": must be >= 0 (0 = every rank on one node)");
  // Megatron's rules: full recompute needs its method and layer count; nothing else takes them.
  if (t.recompute_granularity == "full") {
    if (t.recompute_method.empty())
      user_error("train.recompute_granularity = \"full\" needs train.recompute_method (\"uniform\" or \"block\")");
    if (t.recompute_num_layers <= 0)
      user_error("train.recompute_granularity = \"full\" needs train.recompute_num_layers >= 1, got ",
                 t.recompute_num_layers);
  } else if (!t.recompute_method.empty() || t.recompute_num_layers != 0) {
    user_error(!t.recompute_method.empty() ? "train.recompute_method" : "train.recompute_num_layers",
               " is for train.recompute_granularity = \"full\" (it is \"", t.recompute_granularity, "\")");
  }
  if (t.recompute_granularity == "selective") {
    for (const std::string& name : t.recompute_module_list()) {
      if (name == "mlp" || name == "moe") continue;
      const bool megatron = name == "core_attn" || name == "layernorm" || name == "moe_act" ||
                            name == "shared_experts" || name == "mla_up_proj";
      user_error("train.recompute_modules = \"", t.recompute_modules, "\": \"", name, "\" ",
                 megatron ? "is not implemented yet" : "is not a module name",
                 " (lockstep recomputes \"mlp\" and \"moe\")");
    }
  } else if (t.recompute_modules != TrainConfig{}.recompute_modules) {
    user_error("train.recompute_modules is for train.recompute_granularity = \"selective\" (it is \"",
               t.recompute_granularity, "\")");
  }
  if (m.num_query_groups < 0) user_error("model.num_query_groups = ", m.num_query_groups, ": must be >= 0");
  if (m.ffn_hidden_size < 0) user_error("model.ffn_hidden_size = ", m.ffn_hidden_size, ": must be >= 0");
  if (m.kv_channels < 0)
    user_error("model.kv_channels = ", m.kv_channels, ": must be >= 0 (0 = hidden_size / num_heads)");
  if (m.kv_channels == 0 && !m.multi_latent_attention && m.hidden_size % m.num_heads)
    user_error("model.hidden_size = ", m.hidden_size, " is not divisible by model.num_heads = ", m.num_heads,
               " (or set model.kv_channels, the head size)");
  if (m.num_heads % m.query_groups())
    user_error("model.num_heads = ", m.num_heads, " is not divisible by model.num_query_groups = ", m.num_query_groups);
  if (m.multi_latent_attention) validate_mla(c);
  if (m.position_embedding == "rope" && m.rope_dim() % 2)
    user_error("model.position_embedding = \"rope\" needs an even head size, got ", m.rope_dim());
  if (!(m.norm_eps > 0)) user_error("model.norm_eps = ", m.norm_eps, ": must be positive");
  if (!(m.rope_theta > 0)) user_error("model.rope_theta = ", m.rope_theta, ": must be positive");
  if (m.rope_scaling != "none") {
    if (m.position_embedding != "rope")
      user_error("model.rope_scaling = \"", m.rope_scaling, "\" needs model.position_embedding = \"rope\"");
    if (!(m.rope_scaling_factor >= 1))
      user_error("model.rope_scaling_factor = ", m.rope_scaling_factor, ": must be >= 1");
    if (m.rope_original_max_position_embeddings < 1)
      user_error("model.rope_original_max_position_embeddings = ", m.rope_original_max_position_embeddings,
                 ": must be positive");
  }
  if (m.rope_scaling == "yarn" && !(m.rope_yarn_beta_fast > m.rope_yarn_beta_slow && m.rope_yarn_beta_slow > 0))
    user_error("model.rope_yarn_beta_fast = ", m.rope_yarn_beta_fast,
               " and model.rope_yarn_beta_slow = ", m.rope_yarn_beta_slow, ": need 0 < slow < fast");
  if (m.rope_yarn_mscale_all_dim != 0 && !(m.rope_scaling == "yarn" && m.multi_latent_attention))
    user_error("model.rope_yarn_mscale_all_dim = ", m.rope_yarn_mscale_all_dim,
               ": scales the softmax of multi-head latent attention under yarn only (DeepSeek); set it to 0");
  if (m.rope_scaling == "llama3") {
    if (!(m.rope_low_freq_factor > 0 && m.rope_high_freq_factor > m.rope_low_freq_factor))
      user_error("model.rope_low_freq_factor = ", m.rope_low_freq_factor,
                 " and model.rope_high_freq_factor = ", m.rope_high_freq_factor, ": need 0 < low < high");
  }
  if (!(m.init_std > 0)) user_error("model.init_std = ", m.init_std, ": must be positive");
  if (m.mtp_num_layers < 0 || m.mtp_num_layers >= m.seq_length)
    user_error("model.mtp_num_layers = ", m.mtp_num_layers, ": must be in [0, model.seq_length = ", m.seq_length, ")");
  if (!(m.mtp_loss_scaling_factor >= 0))
    user_error("model.mtp_loss_scaling_factor = ", m.mtp_loss_scaling_factor, ": must be >= 0");
  if (t.global_batch % t.micro_batch)
    user_error("train.global_batch = ", t.global_batch, " is not divisible by train.micro_batch = ", t.micro_batch);
  if (!(t.lr > 0)) user_error("train.lr = ", t.lr, ": must be positive");
  if (t.min_lr < 0 || t.min_lr > t.lr)
    user_error("train.min_lr = ", t.min_lr, ": must be in [0, train.lr = ", t.lr, "]");
  if (t.warmup_steps < 0) user_error("train.warmup_steps = ", t.warmup_steps, ": must be >= 0");
  if (t.decay_steps < 0 || t.decay_steps > t.steps)
    user_error("train.decay_steps = ", t.decay_steps, ": must be in [0, train.steps = ", t.steps, "]");
  if (t.threads < 0) user_error("train.threads = ", t.threads, ": must be >= 0 (0 = every core)");
  if (t.eval_interval < 0) user_error("train.eval_interval = ", t.eval_interval, ": must be >= 0");
  if (t.eval_interval > 0 && t.eval_batches <= 0)
    user_error("train.eval_batches = ", t.eval_batches, ": must be positive when evaluating");
  if (t.log_interval <= 0) user_error("train.log_interval = ", t.log_interval, ": must be positive");
  if (t.save_interval < 0) user_error("train.save_interval = ", t.save_interval, ": must be >= 0 (0 = never)");
  if (t.keep_last < 0) user_error("train.keep_last = ", t.keep_last, ": must be >= 0 (0 = keep all)");
  if (t.exit_interval < 0) user_error("train.exit_interval = ", t.exit_interval, ": must be >= 0 (0 = never)");
  const std::pair<const char*, int64_t> layout[] = {{"tensor", c.parallel.tensor},
                                                    {"context", c.parallel.context},
                                                    {"pipeline", c.parallel.pipeline},
                                                    {"expert", c.parallel.expert},
                                                    {"expert_tensor", c.parallel.expert_tensor}};
  for (const auto& [name, size] : layout) {
    if (size < 1) user_error("parallel.", name, " = ", size, ": must be positive");
  }
  validate_tensor_parallel(c);
  validate_context_parallel(c);
  validate_expert_parallel(c);
  validate_pipeline_parallel(c);
  if (c.ddp.bucket_size <= 0) user_error("ddp.bucket_size = ", c.ddp.bucket_size, ": must be positive");
  if (!(c.dist.timeout_s > 0)) user_error("dist.timeout_s = ", c.dist.timeout_s, ": must be positive");
  if (t.out_dir.empty()) user_error("train.out_dir is empty");
  const OptimizerConfig& o = c.optimizer;
  if (!(o.beta1 >= 0 && o.beta1 < 1)) user_error("optimizer.beta1 = ", o.beta1, ": must be in [0, 1)");
  if (!(o.beta2 >= 0 && o.beta2 < 1)) user_error("optimizer.beta2 = ", o.beta2, ": must be in [0, 1)");
  if (!(o.eps > 0)) user_error("optimizer.eps = ", o.eps, ": must be positive");
  if (o.weight_decay < 0) user_error("optimizer.weight_decay = ", o.weight_decay, ": must be >= 0");
  if (o.clip_grad < 0) user_error("optimizer.clip_grad = ", o.clip_grad, ": must be >= 0 (0 = off)");
  const DataConfig& d = c.data;
  const bool indexed = d.source.rfind("indexed:", 0) == 0;
  if (d.source != "synthetic" && d.source.rfind("text:", 0) != 0 && !indexed)
    user_error("data.source = \"", d.source, "\": expected \"synthetic\", \"text:PATH\" or \"indexed:PREFIX\"");
  if (d.source == "text:") user_error("data.source = \"text:\": the path is missing");
  if (!(d.eval_fraction > 0 && d.eval_fraction < 1))
    user_error("data.eval_fraction = ", d.eval_fraction, ": must be in (0, 1)");
  if (d.synthetic_bytes < 4096) user_error("data.synthetic_bytes = ", d.synthetic_bytes, ": must be at least 4096");
  if (!indexed && m.vocab_size < 256)
    user_error("model.vocab_size = ", m.vocab_size, " is smaller than the data's byte vocabulary (256)");
  if (d.eod_token < -1 || d.eod_token >= m.vocab_size)
    user_error("data.eod_token = ", d.eod_token, ": must be -1 (none) or in [0, model.vocab_size = ", m.vocab_size,
               ")");
  for (const auto& [name, on] : {std::pair{"data.reset_position_ids = true", d.reset_position_ids},
                                 {"data.reset_attention_mask = true", d.reset_attention_mask},
                                 {"data.eod_mask_loss = true", d.eod_mask_loss},
                                 {"data.packing = \"thd\"", d.thd()}}) {
    if (!on) continue;
    if (!indexed)
      user_error(name, " needs documents ended by an end-of-document token, but data.source = \"", d.source,
                 "\" is bytes without one: use indexed data and set data.eod_token");
    if (d.eod_token < 0)
      user_error(name,
                 " needs data.eod_token, the end-of-document id of the data's tokenizer "
                 "(256 for the byte tokenizer)");
  }
  // Packed documents: each padded to the multiple context (and sequence) parallelism cut it into.
  const int64_t natural =
      (c.parallel.context > 1 ? 2 * c.parallel.context : 1) * (c.parallel.sequence_parallel ? c.parallel.tensor : 1);
  if (d.packing_pad_multiple < 0 || (d.packing_pad_multiple > 0 && d.packing_pad_multiple % natural))
    user_error("data.packing_pad_multiple = ", d.packing_pad_multiple,
               ": must be 0 (automatic) or a multiple of 2 x parallel.context x parallel.tensor (with sequence "
               "parallelism) = ",
               natural);
  if (d.thd() && c.parallel.context > 1 && c.determinism != "layout" && c.train.micro_batch != 1)
    user_error("data.packing = \"thd\" with parallel.context = ", c.parallel.context,
               ": train.micro_batch = ", c.train.micro_batch,
               " must be 1 (each packed sample's documents are cut into their own context-parallel chunks)");
  if (d.thd() && m.seq_length % c.packing_pad_multiple())
    user_error("data.packing = \"thd\": model.seq_length = ", m.seq_length,
               " is not a multiple of the documents' padding (data.packing_pad_multiple) = ", c.packing_pad_multiple());
  validate_moe(c.moe, m.num_layers);
  validate_upcycling(c);
  validate_precision(c.precision, m.num_layers);
  validate_layout_determinism(c);
  const DebugConfig& dbg = c.debug;
  if (!dbg.inject_ulp.empty() && !dbg.inject_nan.empty())
    user_error("debug.inject_ulp and debug.inject_nan are both set: inject one thing at a time");
  if (!dbg.injection().empty() && (dbg.inject_step() <= 0 || dbg.inject_module().empty()))
    user_error(dbg.injection_key(), " = \"", dbg.injection(),
               "\": expected \"STEP:MODULE\" with STEP >= 1, e.g. "
               "\"3:layers.1.attn.qkv\"");
  if (dbg.inject_step() > t.steps)
    user_error(dbg.injection_key(), " = \"", dbg.injection(), "\": step ", dbg.inject_step(),
               " is past train.steps = ", t.steps);
  validate_faults(c);
}

std::string toml_value(Config& c, const Key& key) {
  return std::visit(
      [&](const auto& ref) -> std::string {
        using R = std::decay_t<decltype(ref)>;
        if constexpr (std::is_same_v<R, FloatRef>) {
          // Whole numbers as "300.0"; others as the shortest text that reads back as the same double.
          char buf[40];
          const double v = ref(c);
          if (v == std::floor(v) && std::abs(v) < 1e15) {
            std::snprintf(buf, sizeof buf, "%.1f", v);
            return std::string(buf);
          }
          for (int digits = 1; digits <= 17; ++digits) {
            std::snprintf(buf, sizeof buf, "%.*g", digits, ref(c));
            if (std::strtod(buf, nullptr) == ref(c)) break;
          }
          std::string s = buf;
          if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
          return s;
        } else if constexpr (std::is_same_v<R, BoolRef>) {
          return ref(c) ? "true" : "false";
        } else if constexpr (std::is_same_v<R, StringRef>) {
          std::string out = "\"";
          for (char ch : ref(c)) {
            if (ch == '"' || ch == '\\') out += '\\';
            out += ch;
          }
          return out + "\"";
        } else {
          return str(ref(c));
        }
      },
      key.ref);
}

}  // namespace

namespace {

// file: the config's name in messages; text: its TOML, or nullopt to read the file.
Config load(const std::string& file, const std::optional<std::string>& text,
            const std::vector<std::string>& overrides) {
  // Gather (key, value, where) in order of precedence: file first, then the command line.
  struct Setting {
    const Key* key;
    Value value;
    std::string where;
  };
  std::vector<Setting> settings;

  if (!file.empty()) {
    if (!text) {
      if (std::FILE* f = std::fopen(file.c_str(), "rb"))
        std::fclose(f);
      else
        user_error("cannot open config file '", file, "': ", std::strerror(errno));
    }
    toml::table doc;
    try {
      doc = text ? toml::parse(*text, file) : toml::parse_file(file);
    } catch (const toml::parse_error& e) {
      const auto& src = e.source();
      user_error(file, ":", src.begin.line, ":", src.begin.column, ": ", e.description());
    }
    std::vector<std::pair<std::string, const toml::node*>> flat;
    flatten(doc, "", flat);
    for (const auto& [name, node] : flat) {
      const std::string where = str(file, ":", node->source().begin.line, ": ");
      const Key* key = find_key(name);
      // A table where a value belongs ([parallel.tensor] or tensor = { ... }) flattens to deeper names.
      for (size_t dot = name.rfind('.'); !key && dot != std::string::npos; dot = name.rfind('.', dot - 1)) {
        if (find_key(name.substr(0, dot)))
          user_error(where, name.substr(0, dot), ": expected a single value, got a table");
        if (dot == 0) break;
      }
      if (!key) unknown_key(name, where);
      settings.push_back({key, from_toml(*node, name, where), where});
    }
  }
  for (const std::string& arg : overrides) {
    const size_t eq = arg.find('=');
    if (eq == std::string::npos || eq == 0)
      user_error("command line: '", arg, "' is not a key=value override (e.g. train.steps=20)");
    const std::string name = arg.substr(0, eq);
    const Key* key = find_key(name);
    if (!key) unknown_key(name, "command line: ");
    settings.push_back({key, parse_text(*key, arg.substr(eq + 1), "command line: "), "command line: "});
  }

  // train.init_from = "hf:DIR": DIR/config.json sets the model (config/hf_config.h).
  std::string init_from;
  for (const Setting& s : settings)
    if (s.key->name == "train.init_from" && std::holds_alternative<std::string>(s.value))
      init_from = std::get<std::string>(s.value);
  std::vector<Setting> hf;
  if (const std::string dir = hf_model_dir(init_from); !dir.empty())
    for (const HfSetting& h : read_hf_config(dir).settings) {
      const std::string where = str("'", dir, "/config.json' (", h.source, "): ");
      hf.push_back({find_key(h.key), parse_text(*find_key(h.key), h.value, where), where});
    }

  Config c;
  // The preset goes first so that every explicit key can override what it sets.
  for (const std::vector<Setting>* layer : {&hf, &settings})
    for (const Setting& s : *layer)
      if (s.key->name == "model.preset") assign(c, *s.key, s.value, s.where);
  for (const auto& [name, value] : presets().at(c.model.preset)) assign(c, *find_key(name), value, "preset: ");
  for (const Setting& s : hf) assign(c, *s.key, s.value, s.where);
  for (const Setting& s : settings) assign(c, *s.key, s.value, s.where);
  // A job may repeat what config.json says, not change it.
  for (const Setting& h : hf) {
    Config theirs = c;
    assign(theirs, *h.key, h.value, h.where);
    if (toml_value(theirs, *h.key) == toml_value(c, *h.key)) continue;
    std::string where;
    for (const Setting& s : settings)
      if (s.key == h.key) where = s.where;
    user_error(where, h.key->name, " = ", toml_value(c, *h.key), ", but ", h.where.substr(0, h.where.size() - 2),
               " sets it to ", toml_value(theirs, *h.key), " (leave the key out: the checkpoint's config decides it)");
  }
  try {
    validate(c);
  } catch (const UserError& e) {
    throw UserError(str("config: ", e.what()));
  }
  return c;
}

}  // namespace

Config load_config(const std::string& file, const std::vector<std::string>& overrides) {
  return load(file, std::nullopt, overrides);
}

Config load_config_text(const std::string& text, const std::string& name) { return load(name, text, {}); }

std::string config_to_toml(const Config& config) {
  Config c = config;
  std::ostringstream os;
  os << "# lockstep job configuration, fully resolved\n";
  std::string section;
  for (const Key& k : keys()) {
    const size_t dot = k.name.find('.');
    const std::string sec = dot == std::string::npos ? "" : k.name.substr(0, dot);
    const std::string leaf = dot == std::string::npos ? k.name : k.name.substr(dot + 1);
    if (sec != section) {
      os << "\n[" << sec << "]\n";
      section = sec;
    }
    os << leaf << " = " << toml_value(c, k) << "\n";
  }
  return os.str();
}

std::string config_help() {
  Config c;
  std::ostringstream os;
  for (const Key& k : keys()) {
    std::string type = type_name(k.ref);
    if (!k.choices.empty()) {
      type = "one of";
      for (const auto& ch : k.choices) type += " " + ch;
    }
    os << k.name << " = " << toml_value(c, k) << "    # " << k.help << " (" << type << ")\n";
  }
  return os.str();
}

}  // namespace lockstep
