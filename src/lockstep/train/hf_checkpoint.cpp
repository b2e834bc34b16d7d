#include "lockstep/train/hf_checkpoint.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "lockstep/config/hf_config.h"
#include "lockstep/core/error.h"
#include "lockstep/data/tokenizer.h"
#include "lockstep/tensor/param_table.h"
#include "lockstep/train/checkpoint.h"
#include "lockstep/train/run_dir.h"
#include "lockstep/train/safetensors.h"

namespace lockstep {

namespace fs = std::filesystem;

namespace {

// Builds the map: one parameter at a time, its pieces stacked along dimension 0 (or 1 for experts).
class MapBuilder {
 public:
  std::vector<HfParam> params;

  // A parameter that is one checkpoint tensor of the same shape.
  void same(const std::string& param, const std::string& name, const Shape& shape) {
    rows(param, shape, {{name, shape}});
  }
  // A parameter that is checkpoint tensors stacked by rows (dimension 0).
  void rows(const std::string& param, const Shape& shape, const std::vector<std::pair<std::string, Shape>>& parts) {
    HfParam p{param, shape, {}, {}, {}};
    int64_t row = 0;
    for (const auto& [name, file_shape] : parts) {
      std::vector<int64_t> at(static_cast<size_t>(shape.rank()), 0);
      at[0] = row;
      p.pieces.push_back({name, file_shape, at, file_shape});
      row += file_shape[0];
    }
    params.push_back(std::move(p));
  }
  // Experts: the (E, R, K) parameter, expert e's parts stacked by rows at [e, row, 0] (each a (r, K)
  // tensor), or one stacked (E, R, K) tensor.
  void experts(const std::string& param, int64_t E, int64_t K,
               const std::vector<std::pair<std::string, int64_t>>& parts, const std::string& stacked) {
    int64_t R = 0;
    for (const auto& part : parts) R += part.second;
    HfParam p{param, Shape{E, R, K}, {}, {}, {}};
    for (int64_t e = 0; e < E; ++e) {
      int64_t row = 0;
      for (const auto& [pattern, r] : parts) {
        std::string name = pattern;
        name.replace(name.find("{e}"), 3, std::to_string(e));
        p.pieces.push_back({name, Shape{r, K}, {e, row, 0}, Shape{1, r, K}});
        row += r;
      }
    }
    p.stacked.push_back({stacked, Shape{E, R, K}, {0, 0, 0}, Shape{E, R, K}});
    params.push_back(std::move(p));
  }
};

// The checkpoint tensors of a model directory: one file, or the shards an index names.
class CheckpointFiles {
 public:
  explicit CheckpointFiles(const std::string& dir) : dir_(dir) {
    const std::string index = dir + "/model.safetensors.index.json";
    if (fs::exists(index)) {
      nlohmann::json doc;
      try {
        doc = nlohmann::json::parse(std::ifstream(index));
        for (const auto& [name, file] : doc.at("weight_map").items()) where_[name] = file.get<std::string>();
      } catch (const std::exception&) {
        user_error("'", index, "' is not a safetensors index (a JSON object with a weight_map of tensor -> file)");
      }
      for (const auto& [name, file] : where_)
        if (file.find('/') != std::string::npos || !fs::exists(dir + "/" + file))
          user_error("'", index, "' puts tensor '", name, "' in '", file, "', which is not a file in ", dir);
    } else if (fs::exists(dir + "/model.safetensors")) {
      for (const std::string& name : file("model.safetensors").names()) where_[name] = "model.safetensors";
    } else {
      user_error("train.init_from = \"hf:", dir,
                 "\": the directory has neither model.safetensors nor model.safetensors.index.json");
    }
    // Every tensor a shard holds, listed in the index or not.
    std::set<std::string> files;
    for (const auto& kv : where_) files.insert(kv.second);
    for (const std::string& f : files)
      for (const std::string& name : file(f).names())
        if (!where_.count(name)) where_[name] = f;
  }

  const std::string& dir() const { return dir_; }
  bool has(const std::string& name) const { return where_.count(name) > 0; }
  const std::map<std::string, std::string>& tensors() const { return where_; }
  const SafetensorsFile::Entry& entry(const std::string& name) { return of(name).entry(name); }
  std::string path_of(const std::string& name) const { return dir_ + "/" + where_.at(name); }

  // The tensor in fp32: widened exactly, or an FP8 weight times its block scales.
  std::vector<float> floats(const std::string& name) {
    SafetensorsFile& f = of(name);
    std::vector<float> v = f.floats(name);
    if (f.entry(name).dtype != "F8_E4M3") return v;
    const std::string scale_name = name + "_scale_inv";
    const Shape& shape = f.entry(name).shape;
    if (!has(scale_name) || shape.rank() != 2)
      user_error("'", path_of(name), "': tensor '", name, "' is F8_E4M3 without a 2-D block scale '", scale_name, "'");
    const int64_t rows = shape[0], cols = shape[1], br = (rows + 127) / 128, bc = (cols + 127) / 128;
    const SafetensorsFile::Entry& se = entry(scale_name);
    if (se.shape != Shape{br, bc})
      user_error("'", path_of(scale_name), "': tensor '", scale_name, "' has shape ", se.shape.to_string(), ", the ",
                 "128x128 blocks of '", name, "' ", shape.to_string(), " need ", Shape{br, bc}.to_string());
    const std::vector<float> scale = of(scale_name).floats(scale_name);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j)
        v[static_cast<size_t>(i * cols + j)] *= scale[static_cast<size_t>((i / 128) * bc + j / 128)];
    return v;
  }

 private:
  SafetensorsFile& file(const std::string& f) {
    auto& slot = open_[f];
    if (!slot) slot = std::make_unique<SafetensorsFile>(dir_ + "/" + f);
    return *slot;
  }
  SafetensorsFile& of(const std::string& name) {
    const auto it = where_.find(name);
    if (it == where_.end()) user_error("'", dir_, "' has no tensor '", name, "'");
    return file(it->second);
  }

  std::string dir_;
  std::map<std::string, std::string> where_;  // tensor -> file
  std::map<std::string, std::unique_ptr<SafetensorsFile>> open_;
};

StateShard piece_shard(const HfParam& p, const HfPiece& piece, float* data) {
  StateShard s = whole_tensor(p.param, p.shape, data, true);
  s.box_offset = piece.at;
  s.box_shape = piece.box;
  s.flat_end = piece.box.numel();
  return s;
}

}  // namespace

std::vector<float> permute_rows(const HfParam& p, const float* src, bool to_ours) {
  std::vector<float> out(src, src + p.shape.numel());
  const int64_t width = p.shape.numel() / p.shape[0];
  for (size_t r = 0; r < p.row_perm.size(); ++r) {
    const int64_t ours = static_cast<int64_t>(r), theirs = p.row_perm[r];
    std::copy_n(src + (to_ours ? theirs : ours) * width, width, out.data() + (to_ours ? ours : theirs) * width);
  }
  return out;
}

std::vector<float> hf_checkpoint_tensor(const HfParam& p, const HfPiece& piece, const float* whole) {
  const std::vector<float> rows = permute_rows(p, whole, false);
  std::vector<float> out(static_cast<size_t>(piece.box.numel()));
  copy_overlap(piece_shard(p, piece, out.data()),
               whole_tensor(p.param, p.shape, const_cast<float*>(rows.data()), false));
  return out;
}

namespace {

// The whole parameter from the given pieces (its split or stacked form), checked to be there with
// the shapes config.json implies, in lockstep's row order.
std::vector<float> assemble(CheckpointFiles& files, const HfParam& p, const std::vector<HfPiece>& pieces) {
  std::vector<float> whole(static_cast<size_t>(p.shape.numel()));
  const StateShard dst = whole_tensor(p.param, p.shape, whole.data(), true);
  for (const HfPiece& x : pieces) {
    if (!files.has(x.name))
      user_error("'", files.dir(), "' has no tensor '", x.name, "' (lockstep's ", p.param, " ", p.shape.to_string(),
                 " needs it; compare config.json with the checkpoint)");
    if (files.entry(x.name).shape != x.file_shape)
      user_error("'", files.path_of(x.name), "': tensor '", x.name, "' has shape ",
                 files.entry(x.name).shape.to_string(), "; config.json makes it ", x.file_shape.to_string());
    std::vector<float> values = files.floats(x.name);
    copy_overlap(dst, piece_shard(p, x, values.data()));
  }
  return p.row_perm.empty() ? whole : permute_rows(p, whole.data(), true);
}

}  // namespace

std::vector<HfParam> hf_tensor_map(const ModelConfig& m, const MoeConfig& moe, const std::string& family,
                                   bool rope_interleave) {
  const int64_t C = m.hidden_size, HS = m.head_dim(), NH = m.num_heads, NKV = m.query_groups(), V = m.vocab_size;
  const int64_t F = m.ffn_hidden(), E = moe.num_experts, FE = moe.ffn_hidden_size ? moe.ffn_hidden_size : F;
  const int64_t FS = moe.shared_expert_intermediate_size;
  MapBuilder b;
  b.same("embedding.word.weight", "model.embed_tokens.weight", Shape{V, C});
  // One decoder layer: lockstep's names under `ours`, the checkpoint's under `theirs`.
  auto layer = [&](const std::string& ours, const std::string& theirs, bool moe_layer) {
    const std::string attn = theirs + "self_attn.";
    b.same(ours + "attn_norm.weight", theirs + "input_layernorm.weight", Shape{C});
    if (m.multi_latent_attention) {
      // DeepSeek's names; the RoPE rows of each query head and of the shared key part de-interleaved
      // (lockstep row j of a RoPE part of size DR is the checkpoint's row 2j, then 2(j - DR/2) + 1).
      const int64_t DN = m.qk_head_dim, DR = m.qk_pos_emb_head_dim, DV = m.v_head_dim, D = DN + DR;
      const int64_t QL = m.q_lora_rank, KL = m.kv_lora_rank;
      auto perm = [&](int64_t rows, int64_t every, int64_t first) {
        std::vector<int64_t> p(static_cast<size_t>(rows));
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t j = (r % every) - first;
          p[static_cast<size_t>(r)] =
              !rope_interleave || j < 0 ? r : r - j + (j < DR / 2 ? 2 * j : 2 * (j - DR / 2) + 1);
        }
        return p;
      };
      if (QL > 0) {
        b.same(ours + "attn.q_down.weight", attn + "q_a_proj.weight", Shape{QL, C});
        b.same(ours + "attn.q_down_norm.weight", attn + "q_a_layernorm.weight", Shape{QL});
        b.same(ours + "attn.q_up.weight", attn + "q_b_proj.weight", Shape{NH * D, QL});
      } else {
        b.same(ours + "attn.q.weight", attn + "q_proj.weight", Shape{NH * D, C});
      }
      b.params.back().row_perm = perm(NH * D, D, DN);
      b.same(ours + "attn.kv_down.weight", attn + "kv_a_proj_with_mqa.weight", Shape{KL + DR, C});
      b.params.back().row_perm = perm(KL + DR, KL + DR, KL);
      b.same(ours + "attn.kv_down_norm.weight", attn + "kv_a_layernorm.weight", Shape{KL});
      b.same(ours + "attn.kv_up.weight", attn + "kv_b_proj.weight", Shape{NH * (DN + DV), KL});
      b.same(ours + "attn.proj.weight", attn + "o_proj.weight", Shape{C, NH * DV});
    }
    for (const std::string kind : {"weight", "bias"}) {
      if (m.multi_latent_attention) break;
      if (kind == "bias" && !m.add_qkv_bias) continue;
      const bool w = kind == "weight";
      b.rows(ours + "attn.qkv." + kind, w ? Shape{(NH + 2 * NKV) * HS, C} : Shape{(NH + 2 * NKV) * HS},
             {{attn + "q_proj." + kind, w ? Shape{NH * HS, C} : Shape{NH * HS}},
              {attn + "k_proj." + kind, w ? Shape{NKV * HS, C} : Shape{NKV * HS}},
              {attn + "v_proj." + kind, w ? Shape{NKV * HS, C} : Shape{NKV * HS}}});
    }
    if (m.qk_layernorm) {
      b.same(ours + "attn.q_norm.weight", attn + "q_norm.weight", Shape{HS});
      b.same(ours + "attn.k_norm.weight", attn + "k_norm.weight", Shape{HS});
    }
    if (!m.multi_latent_attention) b.same(ours + "attn.proj.weight", attn + "o_proj.weight", Shape{C, NH * HS});
    b.same(ours + "mlp_norm.weight", theirs + "post_attention_layernorm.weight", Shape{C});
    if (!moe_layer) {
      b.rows(ours + "mlp.fc.weight", Shape{2 * F, C},
             {{theirs + "mlp.gate_proj.weight", Shape{F, C}}, {theirs + "mlp.up_proj.weight", Shape{F, C}}});
      b.same(ours + "mlp.proj.weight", theirs + "mlp.down_proj.weight", Shape{C, F});
      return;
    }
    const bool mixtral = family == "mixtral";
    const std::string block = theirs + (mixtral ? "block_sparse_moe." : "mlp.");
    const std::string expert = block + "experts.{e}.";
    b.same(ours + "moe.router.weight", block + "gate.weight", Shape{E, C});
    if (moe.router_enable_expert_bias)
      b.same("buffer/" + ours + "moe.router.expert_bias", block + "gate.e_score_correction_bias", Shape{E});
    // Stacked names as transformers 5 holds them (the module is "mlp" in every family).
    b.experts(ours + "moe.experts.fc.weight", E, C,
              {{expert + (mixtral ? "w1.weight" : "gate_proj.weight"), FE},
               {expert + (mixtral ? "w3.weight" : "up_proj.weight"), FE}},
              theirs + "mlp.experts.gate_up_proj");
    b.experts(ours + "moe.experts.proj.weight", E, FE, {{expert + (mixtral ? "w2.weight" : "down_proj.weight"), C}},
              theirs + "mlp.experts.down_proj");
    if (FS > 0) {
      const std::string shared = block + (family == "deepseek_v3" ? "shared_experts." : "shared_expert.");
      b.rows(ours + "moe.shared.fc.weight", Shape{2 * FS, C},
             {{shared + "gate_proj.weight", Shape{FS, C}}, {shared + "up_proj.weight", Shape{FS, C}}});
      b.same(ours + "moe.shared.proj.weight", shared + "down_proj.weight", Shape{C, FS});
      if (moe.shared_expert_gate)
        b.same(ours + "moe.shared.gate.weight", block + "shared_expert_gate.weight", Shape{1, C});
    }
  };
  for (int64_t l = 0; l < m.num_layers; ++l)
    layer("layers." + std::to_string(l) + ".", "model.layers." + std::to_string(l) + ".",
          moe.is_moe_layer(l, m.num_layers));
  b.same("final_norm.weight", "model.norm.weight", Shape{C});
  if (!m.tie_embeddings) b.same("output.weight", "lm_head.weight", Shape{V, C});
  // DeepSeek's multi-token prediction layers follow the decoder's as model.layers.<L + k> (the
  // release's layer 61): the depth's norms and eh_proj, its transformer layer built like the last
  // decoder layer (model/mtp.h), its final norm as shared_head.norm, and copies of the embedding and
  // the output head (lockstep's depths share the main model's).
  for (int64_t k = 0; family == "deepseek_v3" && k < m.mtp_num_layers; ++k) {
    const std::string ours = "mtp.layers." + std::to_string(k) + ".",
                      theirs = "model.layers." + std::to_string(m.num_layers + k) + ".";
    b.same(ours + "enorm.weight", theirs + "enorm.weight", Shape{C});
    b.same(ours + "hnorm.weight", theirs + "hnorm.weight", Shape{C});
    b.same(ours + "eh_proj.weight", theirs + "eh_proj.weight", Shape{C, 2 * C});
    layer(ours, theirs, moe.num_experts > 0 && moe.is_moe_layer(m.num_layers - 1, m.num_layers));
    b.same(ours + "final_norm.weight", theirs + "shared_head.norm.weight", Shape{C});
    b.same("embedding.word.weight", theirs + "embed_tokens.weight", Shape{V, C});
    b.params.back().copy = true;
    b.same(m.tie_embeddings ? "embedding.word.weight" : "output.weight", theirs + "shared_head.head.weight",
           Shape{V, C});
    b.params.back().copy = true;
  }
  return b.params;
}

std::function<std::vector<float>(const std::string&, const Shape&)> hf_dense_tensors(const std::string& dir,
                                                                                     const ModelConfig& m) {
  const std::string family = read_hf_config(dir).model_type;
  if (family != "llama")
    user_error("moe.use_upcycling: train.init_from = \"hf:", dir, "\" is a ", family,
               " checkpoint; upcycling starts from a dense (llama) one");
  auto files = std::make_shared<CheckpointFiles>(dir);
  auto map = std::make_shared<std::vector<HfParam>>(hf_tensor_map(m, MoeConfig{}, family));
  return [=](const std::string& name, const Shape& shape) {
    const auto it = std::find_if(map->begin(), map->end(), [&](const HfParam& p) { return p.param == name; });
    LOCKSTEP_CHECK(it != map->end() && it->shape == shape, "upcycling: no dense ", name, " ", shape.to_string());
    return assemble(*files, *it, it->pieces);
  };
}

void load_hf_checkpoint(const std::string& dir, ParamStore& ps, const ModelConfig& m, const MoeConfig& moe,
                        const std::vector<StateShard>& buffers) {
  const HfModelConfig hf = read_hf_config(dir);
  const std::string& family = hf.model_type;
  if (family == "llama" && moe.num_experts > 0)
    user_error("train.init_from = \"hf:", dir, "\" is a dense checkpoint and moe.num_experts = ", moe.num_experts,
               ": set moe.use_upcycling = true to make the experts from its MLPs");
  const std::vector<HfParam> map = hf_tensor_map(m, moe, family, hf.rope_interleave);
  CheckpointFiles files(dir);

  // Which form each parameter takes, and every checkpoint tensor accounted for.
  std::map<std::string, const std::vector<HfPiece>*> form;
  std::set<std::string> used;
  for (const HfParam& p : map) {
    const bool split =
        std::all_of(p.pieces.begin(), p.pieces.end(), [&](const HfPiece& x) { return files.has(x.name); });
    const bool stacked = !p.stacked.empty() && files.has(p.stacked[0].name);
    // Neither form complete: the split one names what is missing (assemble, below, reads it).
    const std::vector<HfPiece>& pieces = split || !stacked ? p.pieces : p.stacked;
    if (!p.copy) form[p.param] = &pieces;
    for (const HfPiece& x : pieces) {
      used.insert(x.name);
      used.insert(x.name + "_scale_inv");
    }
  }
  for (const auto& [name, file] : files.tensors()) {
    const bool rotary_cache = name.ends_with("rotary_emb.inv_freq");  // older checkpoints keep RoPE's table
    const bool tied_head = m.tie_embeddings && name == "lm_head.weight";
    if (!used.count(name) && !rotary_cache && !tied_head)
      user_error("'", dir + "/" + file, "' has tensor '", name,
                 "', which is not part of the model its config.json describes");
  }

  auto whole = [&](const HfParam& p) { return assemble(files, p, *form.at(p.param)); };
  auto entry = [&](const std::string& name) {
    const auto it = std::find_if(map.begin(), map.end(), [&](const HfParam& p) { return p.param == name && !p.copy; });
    if (it == map.end())
      user_error("train.init_from = \"hf:", dir, "\": the ", family, " checkpoint has no counterpart of lockstep's '",
                 name, "'");
    return it;
  };
  for (int i = 0; i < static_cast<int>(ps.specs().size()); ++i) {
    const ParamSpec& spec = ps.specs()[i];
    const auto it = entry(spec.name);
    LOCKSTEP_CHECK(it->shape == spec.global_shape, "hf map: ", spec.name, " is ", it->shape.to_string(),
                   ", the model's ", spec.global_shape.to_string());
    set_param_from_whole(ps, i, whole(*it).data());
  }
  for (const HfParam& p : map) {
    if (!p.copy || !files.has(p.pieces[0].name)) continue;
    if (assemble(files, p, p.pieces) != whole(*entry(p.param)))
      user_error("'", files.path_of(p.pieces[0].name), "': tensor '", p.pieces[0].name, "' differs from '",
                 entry(p.param)->pieces[0].name, "'; lockstep's multi-token prediction depths share the model's");
  }
  for (const HfParam& p : map) {
    if (p.param.rfind("buffer/", 0) != 0) continue;
    std::vector<float> values = whole(p);
    const StateShard src = whole_tensor(p.param, p.shape, values.data(), false);
    for (const StateShard& s : buffers)
      if (s.name == p.param) copy_overlap(s, src);
  }
}

std::vector<std::string> hf_tokenizer_files(const std::string& from, int64_t V, bool required) {
  std::vector<std::string> files;
  if (fs::is_directory(from)) {
    for (const char* leaf : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                             "vocab.json", "merges.txt", "generation_config.json"})
      if (fs::is_regular_file(fs::path(from) / leaf)) files.push_back((fs::path(from) / leaf).string());
    const bool tokenizer = std::any_of(files.begin(), files.end(), [](const std::string& f) {
      const std::string leaf = fs::path(f).filename().string();
      return leaf == "tokenizer.json" || leaf == "tokenizer.model" || leaf == "vocab.json";
    });
    if (!tokenizer) {
      if (required) user_error("--tokenizer '", from, "': no tokenizer.json, tokenizer.model or vocab.json in it");
      return {};
    }
  } else if (fs::is_regular_file(from)) {
    files.push_back(from);
  } else {
    user_error("--tokenizer '", from, "': no such file or directory");
  }
  for (const std::string& f : files) {
    if (fs::path(f).filename() != "tokenizer.json") continue;
    const int64_t n = make_tokenizer("hf:" + f)->vocab_size();
    if (n > V) user_error("'", f, "' has ", n, " tokens; the model's vocabulary (model.vocab_size) is ", V);
  }
  return files;
}

int64_t write_hf_checkpoint(const std::string& dir, const ModelConfig& m, const MoeConfig& moe,
                            const std::function<const float*(const std::string& param)>& tensor,
                            const std::vector<std::string>& tokenizer_files) {
  const std::string family = hf_family(m, moe);
  if (fs::exists(dir)) user_error("'", dir, "' exists; --format hf writes a new directory");
  const std::string tmp = dir + ".tmp";
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  std::vector<std::vector<float>> data;
  std::vector<SafetensorsTensor> tensors;
  for (const HfParam& p : hf_tensor_map(m, moe, family, family == "deepseek_v3")) {
    for (const HfPiece& x : p.pieces) {
      data.push_back(hf_checkpoint_tensor(p, x, tensor(p.param)));
      tensors.push_back({x.name, DType::f32, x.file_shape, nullptr});
    }
  }
  for (size_t k = 0; k < tensors.size(); ++k) tensors[k].data = data[k].data();
  write_safetensors(tmp + "/model.safetensors", tensors, {{"format", "pt"}});
  write_file_atomic(tmp + "/config.json", hf_config_json(m, moe, family));
  for (const std::string& f : tokenizer_files) {
    const fs::path to = fs::path(tmp) / fs::path(f).filename();
    if (fs::exists(to)) user_error("two tokenizer files named '", to.filename().string(), "'");  // config.json too
    fs::copy_file(f, to);
  }
  fs::rename(tmp, dir);
  return static_cast<int64_t>(tensors.size());
}

}  // namespace lockstep
