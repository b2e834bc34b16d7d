// Hugging Face checkpoints: a model directory (config.json, then model.safetensors or shards listed
// by model.safetensors.index.json) of the families llama, mixtral, qwen2_moe and qwen3_moe, read
// into lockstep's parameters (train.init_from = "hf:DIR") and written from them (`lockstep ckpt
// export CKPT OUT --format hf`). config/hf_config.h maps config.json; this maps the tensors.
//
// Each lockstep parameter is one or more checkpoint tensors placed at boxes of it: the fused
// attention.qkv is q_proj, k_proj and v_proj stacked by rows; the SwiGLU fc is gate_proj over
// up_proj; the experts' (E, 2F, C) fc is every expert's gate and up (per-expert tensors, as the
// published checkpoints and save_pretrained write them, or stacked gate_up_proj (E, 2F, C), as
// transformers 5 holds them in memory; both are read, per-expert is written). Both checkpoint
// formats rotate half of each head as lockstep does (no permutation). Widening is exact: BF16,
// F16 and F8_E4M3 become the fp32 they stand for; an F8_E4M3 weight with a 128x128 block scale
// `<name>_scale_inv` (DeepSeek-V3's layout) is code x scale, rounded once to fp32.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "lockstep/config/config.h"
#include "lockstep/core/state_shard.h"
#include "lockstep/core/tensor.h"

namespace lockstep {

class ParamStore;

// A checkpoint tensor as a box of a lockstep parameter.
struct HfPiece {
  std::string name;         // e.g. "model.layers.0.self_attn.k_proj.weight"
  Shape file_shape;         // its shape in the checkpoint
  std::vector<int64_t> at;  // the box's offset in the parameter
  Shape box;                // the box's shape (file_shape's elements)
};

struct HfParam {
  std::string param;  // lockstep's name, e.g. "layers.0.attn.qkv.weight", or "buffer/..." for module state
  Shape shape;        // the whole parameter
  std::vector<HfPiece> pieces;
  std::vector<HfPiece> stacked;  // experts: the alternative stacked form; empty otherwise
  // Row r of the parameter is row row_perm[r] of the pieces assembled (DeepSeek's interleaved RoPE
  // dimensions); empty: the identity.
  std::vector<int64_t> row_perm;
  // A second copy of `param` the checkpoint carries (DeepSeek's MTP layer holds the embedding and
  // the output head again): export writes it; import reads the original and, when the copy is there,
  // refuses a copy that differs (lockstep's depths share them).
  bool copy = false;
};

// Every parameter of the whole model (all layers, whatever the parallel layout) in the family's
// checkpoint (config/hf_config.h's hf_family names the family for a model), and the module state
// it carries (DeepSeek's e_score_correction_bias: "buffer/layers.<l>.moe.router.expert_bias"); with
// model.mtp_num_layers (deepseek_v3 only), DeepSeek's MTP layers after the decoder's.
std::vector<HfParam> hf_tensor_map(const ModelConfig& m, const MoeConfig& moe, const std::string& family,
                                   bool rope_interleave = false);

// Between lockstep's row order and the checkpoint's (HfParam::row_perm): to_ours, lockstep row r
// is checkpoint row row_perm[r]; else the reverse. A copy when there is no permutation.
std::vector<float> permute_rows(const HfParam& p, const float* src, bool to_ours);
// The checkpoint tensor `piece` of parameter p, cut from the whole parameter (lockstep's rows).
std::vector<float> hf_checkpoint_tensor(const HfParam& p, const HfPiece& piece, const float* whole);

// Sets every parameter of ps (this rank's boxes) and every buffer listed in buffers (the model's
// "buffer/" state shards) from the model directory dir, whose config.json the job's model keys were
// taken from. UserError naming the file and tensor when one is missing, has another shape or dtype,
// or is left over (a tensor the model does not have).
void load_hf_checkpoint(const std::string& dir, ParamStore& ps, const ModelConfig& m, const MoeConfig& moe,
                        const std::vector<StateShard>& buffers = {});

// The dense checkpoint's whole tensors under lockstep's parameter names, for upcycling
// (train/upcycling.h): dir must hold a llama (dense) model.
std::function<std::vector<float>(const std::string& name, const Shape& shape)> hf_dense_tensors(const std::string& dir,
                                                                                                const ModelConfig& m);

// Writes the model directory dir (config.json, model.safetensors in fp32) from whole parameters
// (tensor(name): the parameter's or, for "buffer/" names, the module state's global row-major
// values) and the tokenizer files listed (copied under their own names; hf_tokenizer_files). dir must
// not exist: the directory is written under a temporary name and renamed when complete. Returns
// the number of tensors.
int64_t write_hf_checkpoint(const std::string& dir, const ModelConfig& m, const MoeConfig& moe,
                            const std::function<const float*(const std::string& param)>& tensor,
                            const std::vector<std::string>& tokenizer_files = {});
// The tokenizer files to write beside a model of vocabulary V: `from` is a tokenizer.json or a
// directory whose tokenizer.json, tokenizer_config.json, special_tokens_map.json, tokenizer.model,
// vocab.json, merges.txt and generation_config.json are taken (those present; a directory without
// a tokenizer gives none unless `required`). UserError when a tokenizer.json does not load or has
// more tokens than V.
std::vector<std::string> hf_tokenizer_files(const std::string& from, int64_t V, bool required);

}  // namespace lockstep
