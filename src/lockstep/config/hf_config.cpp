#include "lockstep/config/hf_config.h"

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "lockstep/core/error.h"

namespace lockstep {

using json = nlohmann::ordered_json;

namespace {

const char* const kFamilies = "llama, mixtral, qwen2_moe, qwen3_moe, deepseek_v3";

std::string text_of(const json& v) {
  if (v.is_boolean()) return v.get<bool>() ? "true" : "false";
  if (v.is_number_integer()) return std::to_string(v.get<int64_t>());
  if (v.is_number_float()) {
    std::ostringstream os;
    os.precision(17);
    os << v.get<double>();
    return os.str();
  }
  if (v.is_string()) return v.get<std::string>();
  return v.dump();
}

// Reads one config.json: typed field access with errors that name the file and the field.
class Fields {
 public:
  Fields(std::string path, json doc) : path_(std::move(path)), doc_(std::move(doc)) {}

  bool has(const std::string& f) const { return doc_.contains(f) && !doc_[f].is_null(); }
  const json& at(const std::string& f) const {
    if (!has(f)) user_error("'", path_, "' has no field '", f, "'");
    return doc_[f];
  }
  int64_t integer(const std::string& f) const {
    if (!at(f).is_number_integer()) user_error("'", path_, "': field '", f, "' is ", at(f).dump(), ", not an integer");
    return at(f).get<int64_t>();
  }
  int64_t integer(const std::string& f, int64_t fallback) const { return has(f) ? integer(f) : fallback; }
  double number(const json& v, const std::string& f) const {
    if (!v.is_number()) user_error("'", path_, "': field '", f, "' is ", v.dump(), ", not a number");
    return v.get<double>();
  }
  double number(const std::string& f, double fallback) const { return has(f) ? number(at(f), f) : fallback; }
  bool boolean(const std::string& f, bool fallback) const {
    if (!has(f)) return fallback;
    if (!at(f).is_boolean()) user_error("'", path_, "': field '", f, "' is ", at(f).dump(), ", not true or false");
    return at(f).get<bool>();
  }
  [[noreturn]] void refuse(const std::string& f, const std::string& why) const {
    user_error("'", path_, "': ", f, " = ", has(f) ? at(f).dump() : std::string("(absent)"), ": ", why);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  json doc_;
};

void add(HfModelConfig& out, const std::string& key, const std::string& value, const std::string& source) {
  out.settings.push_back({key, value, source});
}

// RoPE: transformers 5 writes rope_parameters {rope_type, rope_theta, ...}; earlier versions
// rope_theta and rope_scaling {rope_type or type, ...}.
void read_rope(const Fields& f, HfModelConfig& out, double default_theta) {
  const bool v5 = f.has("rope_parameters");
  const std::string field = v5 ? "rope_parameters" : "rope_scaling";
  const json params = f.has(field) ? f.at(field) : json::object();
  if (!params.is_object()) f.refuse(field, "expected an object");
  double theta = f.number("rope_theta", default_theta);
  if (params.contains("rope_theta")) theta = f.number(params["rope_theta"], field + ".rope_theta");
  add(out, "model.rope_theta", text_of(json(theta)), v5 ? "rope_parameters.rope_theta" : "rope_theta");
  std::string type = "default";
  for (const char* k : {"rope_type", "type"})
    if (params.contains(k) && params[k].is_string()) type = params[k].get<std::string>();
  if (type == "default") {
    add(out, "model.rope_scaling", "none", field);
    return;
  }
  if (type == "yarn") {
    add(out, "model.rope_scaling", "yarn", field + ".rope_type");
    if (params.contains("attention_factor") || params.value("truncate", true) != true)
      f.refuse(field, "yarn with attention_factor or truncate = false is not supported");
    const std::pair<const char*, const char*> keys[] = {
        {"factor", "model.rope_scaling_factor"},
        {"original_max_position_embeddings", "model.rope_original_max_position_embeddings"},
        {"beta_fast", "model.rope_yarn_beta_fast"},
        {"beta_slow", "model.rope_yarn_beta_slow"},
        {"mscale", "model.rope_yarn_mscale"},
        {"mscale_all_dim", "model.rope_yarn_mscale_all_dim"}};
    for (const auto& [k, key] : keys)
      if (params.contains(k) && !params[k].is_null()) add(out, key, text_of(params[k]), field + "." + k);
    if (!params.contains("factor")) f.refuse(field, "yarn RoPE scaling needs 'factor'");
    // transformers uses mscale only together with mscale_all_dim.
    if (params.contains("mscale_all_dim") && (!params.contains("mscale") || params["mscale"].is_null()))
      add(out, "model.rope_yarn_mscale", "0", field + ".mscale");
    if (!params.contains("original_max_position_embeddings"))
      add(out, "model.rope_original_max_position_embeddings", std::to_string(f.integer("max_position_embeddings")),
          "max_position_embeddings");
    return;
  }
  if (type != "llama3")
    f.refuse(field, "RoPE scaling \"" + type + "\" is not supported (lockstep has llama3 and yarn)");
  add(out, "model.rope_scaling", "llama3", field + ".rope_type");
  const std::pair<const char*, const char*> keys[] = {
      {"factor", "model.rope_scaling_factor"},
      {"low_freq_factor", "model.rope_low_freq_factor"},
      {"high_freq_factor", "model.rope_high_freq_factor"},
      {"original_max_position_embeddings", "model.rope_original_max_position_embeddings"}};
  for (const auto& [k, key] : keys) {
    if (!params.contains(k)) f.refuse(field, std::string("llama3 RoPE scaling needs '") + k + "'");
    add(out, key, text_of(params[k]), field + "." + k);
  }
}

// The 0/1 pattern of MoE layers (moe.layer_freq) from Qwen's decoder_sparse_step and mlp_only_layers.
std::string qwen_layer_pattern(const Fields& f, int64_t L) {
  const int64_t step = f.integer("decoder_sparse_step", 1);
  if (step < 1) f.refuse("decoder_sparse_step", "must be >= 1");
  std::vector<bool> dense(static_cast<size_t>(L), false);
  if (f.has("mlp_only_layers")) {
    if (!f.at("mlp_only_layers").is_array()) f.refuse("mlp_only_layers", "expected a list of layer indices");
    for (const json& l : f.at("mlp_only_layers")) {
      if (!l.is_number_integer() || l.get<int64_t>() < 0 || l.get<int64_t>() >= L)
        f.refuse("mlp_only_layers", "expected layer indices in [0, num_hidden_layers)");
      dense[static_cast<size_t>(l.get<int64_t>())] = true;
    }
  }
  std::string pattern = "[";
  for (int64_t l = 0; l < L; ++l)
    pattern += std::string(l ? "," : "") + ((!dense[static_cast<size_t>(l)] && (l + 1) % step == 0) ? "1" : "0");
  return pattern + "]";
}

}  // namespace

std::string hf_model_dir(const std::string& init_from) {
  return init_from.rfind("hf:", 0) == 0 ? init_from.substr(3) : std::string();
}

HfModelConfig read_hf_config(const std::string& dir) {
  const std::string path = dir + "/config.json";
  std::ifstream in(path);
  if (!in) user_error("train.init_from = \"hf:", dir, "\": cannot open '", path, "'");
  json doc;
  try {
    doc = json::parse(in);
  } catch (const std::exception&) {
    user_error("'", path, "' is not JSON");
  }
  if (!doc.is_object()) user_error("'", path, "' is not a JSON object");
  const Fields f(path, doc);
  HfModelConfig out;
  out.dir = dir;
  if (!f.has("model_type") || !f.at("model_type").is_string())
    user_error("'", path, "' has no model_type (a Hugging Face model's config.json names its family)");
  out.model_type = f.at("model_type").get<std::string>();
  const std::string& type = out.model_type;
  if (type != "llama" && type != "mixtral" && type != "qwen2_moe" && type != "qwen3_moe" && type != "deepseek_v3")
    f.refuse("model_type", std::string("lockstep reads the families ") + kFamilies);
  const bool deepseek = type == "deepseek_v3";

  // The architecture every family shares: RMSNorm, RoPE, SwiGLU, no biases but the ones below.
  add(out, "model.preset", "llama", "model_type");
  const int64_t L = f.integer("num_hidden_layers"), C = f.integer("hidden_size"), NH = f.integer("num_attention_heads");
  add(out, "model.num_layers", std::to_string(L), "num_hidden_layers");
  add(out, "model.hidden_size", std::to_string(C), "hidden_size");
  add(out, "model.num_heads", std::to_string(NH), "num_attention_heads");
  if (deepseek) {
    // Multi-head latent attention; its config's num_key_value_heads and head_dim describe nothing
    // lockstep has (every head has its own keys; head_dim is the RoPE part).
    add(out, "model.multi_latent_attention", "true", "model_type");
    add(out, "model.q_lora_rank", std::to_string(f.integer("q_lora_rank", 0)), "q_lora_rank");
    add(out, "model.kv_lora_rank", std::to_string(f.integer("kv_lora_rank")), "kv_lora_rank");
    add(out, "model.qk_head_dim", std::to_string(f.integer("qk_nope_head_dim")), "qk_nope_head_dim");
    add(out, "model.qk_pos_emb_head_dim", std::to_string(f.integer("qk_rope_head_dim")), "qk_rope_head_dim");
    add(out, "model.v_head_dim", std::to_string(f.integer("v_head_dim")), "v_head_dim");
    add(out, "model.num_query_groups", "0", "model_type");
    out.rope_interleave = f.boolean("rope_interleave", true);
    // Multi-token prediction: the layers after the decoder's (model/mtp.h; hf_checkpoint.h).
    add(out, "model.mtp_num_layers", std::to_string(f.integer("num_nextn_predict_layers", 0)),
        "num_nextn_predict_layers");
  } else {
    add(out, "model.num_query_groups", std::to_string(f.integer("num_key_value_heads", NH)), "num_key_value_heads");
    // transformers' default head size is hidden_size / num_attention_heads; Qwen3 sets its own.
    const int64_t HS = f.integer("head_dim", NH > 0 ? C / NH : 0);
    add(out, "model.kv_channels", HS * NH == C ? "0" : std::to_string(HS), "head_dim");
  }
  add(out, "model.ffn_hidden_size", std::to_string(f.integer("intermediate_size")), "intermediate_size");
  add(out, "model.vocab_size", std::to_string(f.integer("vocab_size")), "vocab_size");
  add(out, "model.norm_eps", text_of(json(f.number("rms_norm_eps", 1e-6))), "rms_norm_eps");
  add(out, "model.tie_embeddings", f.boolean("tie_word_embeddings", false) ? "true" : "false", "tie_word_embeddings");
  read_rope(f, out, type == "mixtral" ? 1e6 : 10000.0);
  if (f.has("hidden_act") && f.at("hidden_act") != "silu") f.refuse("hidden_act", "lockstep's SwiGLU uses silu");
  if (f.boolean("attention_bias", false))
    f.refuse("attention_bias", "biases on the output projection are not supported (q/k/v biases are: qwen2_moe)");
  if (f.boolean("mlp_bias", false)) f.refuse("mlp_bias", "MLP biases are not supported in this family");
  if (f.boolean("use_sliding_window", false) || (type == "mixtral" && f.has("sliding_window")))
    f.refuse(type == "mixtral" ? "sliding_window" : "use_sliding_window", "sliding-window attention is not supported");
  if (f.has("quantization_config")) {
    const json& q = f.at("quantization_config");
    const bool fp8_blocks = q.is_object() && q.value("quant_method", "") == "fp8" &&
                            q.value("weight_block_size", json::array()) == json::array({128, 128});
    if (!fp8_blocks)
      f.refuse("quantization_config", "lockstep reads FP8 weights with 128x128 block scales (weight_scale_inv) only");
  }
  add(out, "model.add_qkv_bias", type == "qwen2_moe" && f.boolean("qkv_bias", true) ? "true" : "false",
      type == "qwen2_moe" ? "qkv_bias" : "model_type");
  add(out, "model.qk_layernorm", type == "qwen3_moe" ? "true" : "false", "model_type");

  // A dense checkpoint leaves the moe.* keys to the job: moe.use_upcycling makes an MoE model of it.
  if (type == "llama") return out;
  if (deepseek) {
    // Sigmoid scores, group-limited top k with the aux-loss-free expert bias
    // (e_score_correction_bias), renormalised and scaled; a shared expert without a gate; the first
    // first_k_dense_replace layers dense.
    if (!f.boolean("norm_topk_prob", true))
      f.refuse("norm_topk_prob", "lockstep's sigmoid routing always renormalises the chosen weights");
    const int64_t E = f.integer("n_routed_experts"), Fe = f.integer("moe_intermediate_size");
    // DeepSeek scores a group by its two best experts; Megatron and lockstep by its best
    // num_experts_per_tok / topk_group (the same for DeepSeek-V3: 8 / 4).
    if (f.has("n_group") && f.integer("n_group") > 1 &&
        f.integer("num_experts_per_tok") != 2 * f.integer("topk_group", 1))
      f.refuse("num_experts_per_tok",
               "with group-limited routing it must be 2 x topk_group: DeepSeek scores a group by its two best "
               "experts, lockstep by its best num_experts_per_tok / topk_group");
    add(out, "moe.num_experts", std::to_string(E), "n_routed_experts");
    add(out, "moe.router_topk", std::to_string(f.integer("num_experts_per_tok")), "num_experts_per_tok");
    add(out, "moe.router_score_function", "sigmoid", "model_type");
    add(out, "moe.router_pre_softmax", "false", "model_type");
    add(out, "moe.router_num_groups", std::to_string(f.integer("n_group", 1)), "n_group");
    add(out, "moe.router_group_topk", std::to_string(f.integer("topk_group", 1)), "topk_group");
    add(out, "moe.router_topk_scaling_factor", text_of(json(f.number("routed_scaling_factor", 1.0))),
        "routed_scaling_factor");
    add(out, "moe.router_enable_expert_bias", "true", "model_type");
    add(out, "moe.ffn_hidden_size", std::to_string(Fe), "moe_intermediate_size");
    add(out, "moe.shared_expert_intermediate_size", std::to_string(f.integer("n_shared_experts", 0) * Fe),
        "n_shared_experts");
    add(out, "moe.shared_expert_gate", "false", "model_type");
    const int64_t dense = f.integer("first_k_dense_replace", 0), every = f.integer("moe_layer_freq", 1);
    std::string pattern = "[";
    for (int64_t l = 0; l < L; ++l) pattern += std::string(l ? "," : "") + (l >= dense && l % every == 0 ? "1" : "0");
    add(out, "moe.layer_freq", pattern + "]", "first_k_dense_replace, moe_layer_freq");
    return out;
  }
  // Mixture of experts: softmax routing; Mixtral renormalises the top k (lockstep's softmax over
  // the chosen logits), Qwen does when norm_topk_prob is true.
  const bool qwen = type != "mixtral";
  const std::string experts_field = f.has("num_local_experts") ? "num_local_experts" : "num_experts";
  add(out, "moe.num_experts", std::to_string(f.integer(experts_field)), experts_field);
  add(out, "moe.router_topk", std::to_string(f.integer("num_experts_per_tok")), "num_experts_per_tok");
  add(out, "moe.router_score_function", "softmax", "model_type");
  add(out, "moe.router_pre_softmax", qwen && !f.boolean("norm_topk_prob", false) ? "true" : "false",
      qwen ? "norm_topk_prob" : "model_type");
  add(out, "moe.router_num_groups", "0", "model_type");
  add(out, "moe.router_topk_scaling_factor", "1.0", "model_type");
  add(out, "moe.router_enable_expert_bias", "false", "model_type");
  add(out, "moe.ffn_hidden_size", std::to_string(f.integer(qwen ? "moe_intermediate_size" : "intermediate_size")),
      qwen ? "moe_intermediate_size" : "intermediate_size");
  add(out, "moe.layer_freq", qwen ? qwen_layer_pattern(f, L) : "1",
      qwen ? "decoder_sparse_step, mlp_only_layers" : "model_type");
  const int64_t shared = type == "qwen2_moe" ? f.integer("shared_expert_intermediate_size", 0) : 0;
  add(out, "moe.shared_expert_intermediate_size", std::to_string(shared),
      type == "qwen2_moe" ? "shared_expert_intermediate_size" : "model_type");
  add(out, "moe.shared_expert_gate", shared > 0 ? "true" : "false", "model_type");
  return out;
}

std::string hf_family(const ModelConfig& m, const MoeConfig& moe) {
  auto refuse = [](const std::string& key, const std::string& why) -> std::string {
    user_error("--format hf: ", key, ": ", why, " (the Hugging Face families lockstep writes: ", kFamilies, ")");
  };
  if (m.normalization != "rmsnorm") refuse("model.normalization = \"" + m.normalization + "\"", "they use rmsnorm");
  if (m.position_embedding != "rope")
    refuse("model.position_embedding = \"" + m.position_embedding + "\"", "they use rope");
  if (m.activation != "swiglu") refuse("model.activation = \"" + m.activation + "\"", "they use swiglu");
  if (m.bias) refuse("model.bias = true", "they have no biases but q/k/v ones (model.add_qkv_bias)");
  if (m.mtp_num_layers > 0 && !m.multi_latent_attention)
    refuse("model.mtp_num_layers", "only deepseek_v3 (model.multi_latent_attention) has multi-token prediction layers");
  if (m.multi_latent_attention) {
    // deepseek_v3: dense first layers, then MoE layers with sigmoid scores, the expert bias, an
    // ungated shared expert that is a whole number of experts wide.
    const auto is_moe = [&](int64_t l) { return moe.num_experts > 0 && moe.is_moe_layer(l, m.num_layers); };
    for (int64_t l = 1; l < m.num_layers; ++l)
      if (is_moe(l - 1) && !is_moe(l)) refuse("moe.layer_freq", "deepseek_v3's dense layers come first, then MoE");
    if (moe.num_experts > 0) {
      const int64_t Fe = moe.ffn_hidden_size ? moe.ffn_hidden_size : m.ffn_hidden();
      if (moe.router_score_function != "sigmoid")
        refuse("moe.router_score_function", "deepseek_v3 routes with sigmoid");
      if (!moe.router_enable_expert_bias)
        refuse("moe.router_enable_expert_bias = false", "deepseek_v3 routes with its e_score_correction_bias");
      if (moe.router_num_groups > 1 && moe.router_topk != 2 * moe.router_group_topk)
        refuse("moe.router_topk",
               "deepseek_v3 scores a group by its two best experts: it must be 2 x router_group_topk");
      if (moe.shared_expert_gate) refuse("moe.shared_expert_gate", "deepseek_v3's shared experts have no gate");
      if (moe.shared_expert_intermediate_size % Fe)
        refuse("moe.shared_expert_intermediate_size", "deepseek_v3's shared expert is n_shared_experts experts wide");
    }
    if (m.qk_layernorm || m.add_qkv_bias) refuse("model.qk_layernorm", "deepseek_v3 has neither it nor q/k/v biases");
    return "deepseek_v3";
  }
  if (moe.num_experts == 0) {
    if (m.add_qkv_bias || m.qk_layernorm)
      refuse(m.add_qkv_bias ? "model.add_qkv_bias" : "model.qk_layernorm",
             "a dense model is written as llama, which has neither");
    return "llama";
  }
  if (moe.router_score_function != "softmax") refuse("moe.router_score_function", "they route with softmax");
  if (moe.router_num_groups > 0) refuse("moe.router_num_groups", "they have no group-limited routing");
  if (moe.router_enable_expert_bias) refuse("moe.router_enable_expert_bias", "they have no expert bias");
  if (moe.router_topk_scaling_factor != 1.0) refuse("moe.router_topk_scaling_factor", "they do not scale the weights");
  if (m.bias) refuse("model.bias", "their experts have no biases");
  const bool shared = moe.shared_expert_intermediate_size > 0;
  bool every_layer = true;
  for (int64_t l = 0; l < m.num_layers; ++l) every_layer = every_layer && moe.is_moe_layer(l, m.num_layers);
  if (m.qk_layernorm) {
    if (shared)
      refuse("moe.shared_expert_intermediate_size", "qwen3_moe (for model.qk_layernorm) has no shared expert");
    if (m.add_qkv_bias) refuse("model.add_qkv_bias", "qwen3_moe (for model.qk_layernorm) has no q/k/v biases");
    return "qwen3_moe";
  }
  if (shared || m.add_qkv_bias) {
    if (!shared || !moe.shared_expert_gate || !m.add_qkv_bias)
      refuse(!shared                   ? "moe.shared_expert_intermediate_size"
             : !moe.shared_expert_gate ? "moe.shared_expert_gate"
                                       : "model.add_qkv_bias",
             "qwen2_moe has a gated shared expert and q/k/v biases, all three");
    return "qwen2_moe";
  }
  if (!every_layer || moe.router_pre_softmax)
    refuse(moe.router_pre_softmax ? "moe.router_pre_softmax" : "moe.layer_freq",
           "mixtral renormalises the top k in every layer; qwen2_moe and qwen3_moe, which need not, also have a shared "
           "expert and q/k/v biases, or QK layernorm");
  return "mixtral";
}

namespace {

json rope_json(const ModelConfig& m) {
  json rope = {{"rope_theta", m.rope_theta}, {"rope_type", m.rope_scaling == "none" ? "default" : m.rope_scaling}};
  if (m.rope_scaling == "yarn") {
    rope["factor"] = m.rope_scaling_factor;
    rope["original_max_position_embeddings"] = m.rope_original_max_position_embeddings;
    rope["beta_fast"] = m.rope_yarn_beta_fast;
    rope["beta_slow"] = m.rope_yarn_beta_slow;
    rope["mscale"] = m.rope_yarn_mscale;
    rope["mscale_all_dim"] = m.rope_yarn_mscale_all_dim;
  }
  if (m.rope_scaling == "llama3") {
    rope["factor"] = m.rope_scaling_factor;
    rope["low_freq_factor"] = m.rope_low_freq_factor;
    rope["high_freq_factor"] = m.rope_high_freq_factor;
    rope["original_max_position_embeddings"] = m.rope_original_max_position_embeddings;
  }
  return rope;
}

// The fields every family's config.json has.
json common_json(const ModelConfig& m, const std::string& family) {
  static const std::map<std::string, std::string> architectures = {{"llama", "LlamaForCausalLM"},
                                                                   {"mixtral", "MixtralForCausalLM"},
                                                                   {"qwen2_moe", "Qwen2MoeForCausalLM"},
                                                                   {"qwen3_moe", "Qwen3MoeForCausalLM"},
                                                                   {"deepseek_v3", "DeepseekV3ForCausalLM"}};
  json c;
  c["architectures"] = {architectures.at(family)};
  c["model_type"] = family;
  c["dtype"] = "float32";
  c["vocab_size"] = m.vocab_size;
  c["hidden_size"] = m.hidden_size;
  c["num_hidden_layers"] = m.num_layers;
  c["num_attention_heads"] = m.num_heads;
  c["num_key_value_heads"] = m.query_groups();
  c["intermediate_size"] = m.ffn_hidden();
  c["hidden_act"] = "silu";
  c["rms_norm_eps"] = m.norm_eps;
  c["max_position_embeddings"] = m.seq_length;
  c["initializer_range"] = m.init_std;
  c["tie_word_embeddings"] = m.tie_embeddings;
  const json rope = rope_json(m);
  c["rope_parameters"] = rope;
  // Earlier transformers versions read these two.
  c["rope_theta"] = m.rope_theta;
  if (m.rope_scaling != "none") c["rope_scaling"] = rope;
  return c;
}

// DeepSeek's RoPE layout (rope_interleave: train/hf_checkpoint.h permutes the rows back).
std::string deepseek_config_json(const ModelConfig& m, const MoeConfig& moe) {
  int64_t dense = 0;
  while (dense < m.num_layers && !(moe.num_experts > 0 && moe.is_moe_layer(dense, m.num_layers))) ++dense;
  const int64_t Fe = moe.ffn_hidden_size ? moe.ffn_hidden_size : m.ffn_hidden();
  json c = common_json(m, "deepseek_v3");
  c["q_lora_rank"] = m.q_lora_rank > 0 ? json(m.q_lora_rank) : json(nullptr);
  c["kv_lora_rank"] = m.kv_lora_rank;
  c["qk_nope_head_dim"] = m.qk_head_dim;
  c["qk_rope_head_dim"] = m.qk_pos_emb_head_dim;
  c["qk_head_dim"] = m.qk_head_dim + m.qk_pos_emb_head_dim;
  c["head_dim"] = m.qk_pos_emb_head_dim;
  c["v_head_dim"] = m.v_head_dim;
  c["rope_interleave"] = true;
  c["attention_bias"] = false;
  c["first_k_dense_replace"] = dense;
  c["moe_layer_freq"] = 1;
  c["n_routed_experts"] = std::max<int64_t>(moe.num_experts, 1);
  c["num_experts_per_tok"] = moe.num_experts > 0 ? moe.router_topk : 1;
  c["moe_intermediate_size"] = Fe;
  c["n_shared_experts"] = Fe > 0 ? moe.shared_expert_intermediate_size / Fe : 0;
  c["n_group"] = std::max<int64_t>(moe.router_num_groups, 1);
  c["topk_group"] = std::max<int64_t>(moe.router_group_topk, 1);
  c["routed_scaling_factor"] = moe.router_topk_scaling_factor;
  // lockstep renormalises the sigmoid weights of more than one choice (docs/moe.md).
  c["norm_topk_prob"] = moe.router_topk > 1;
  c["topk_method"] = "noaux_tc";
  c["scoring_func"] = "sigmoid";
  c["num_nextn_predict_layers"] = m.mtp_num_layers;
  return c.dump(2) + "\n";
}

}  // namespace

std::string hf_config_json(const ModelConfig& m, const MoeConfig& moe, const std::string& family) {
  if (family == "deepseek_v3") return deepseek_config_json(m, moe);
  json c = common_json(m, family);
  c["head_dim"] = m.head_dim();
  if (family == "mixtral") c["intermediate_size"] = moe.ffn_hidden_size ? moe.ffn_hidden_size : m.ffn_hidden();
  if (family == "llama") {
    c["attention_bias"] = false;
    c["mlp_bias"] = false;
  } else {
    c[family == "mixtral" ? "num_local_experts" : "num_experts"] = moe.num_experts;
    c["num_experts_per_tok"] = moe.router_topk;
    c["output_router_logits"] = false;
    c["router_aux_loss_coef"] = moe.aux_loss_coeff;
  }
  if (family == "mixtral") c["sliding_window"] = nullptr;
  if (family == "qwen2_moe" || family == "qwen3_moe") {
    c["moe_intermediate_size"] = moe.ffn_hidden_size ? moe.ffn_hidden_size : m.ffn_hidden();
    c["norm_topk_prob"] = !moe.router_pre_softmax;
    c["decoder_sparse_step"] = 1;
    json dense = json::array();
    for (int64_t l = 0; l < m.num_layers; ++l)
      if (!moe.is_moe_layer(l, m.num_layers)) dense.push_back(l);
    c["mlp_only_layers"] = dense;
    c["use_sliding_window"] = false;
  }
  if (family == "qwen2_moe") {
    c["shared_expert_intermediate_size"] = moe.shared_expert_intermediate_size;
    c["qkv_bias"] = true;
  }
  if (family == "qwen3_moe") c["attention_bias"] = false;
  return c.dump(2) + "\n";
}

}  // namespace lockstep
