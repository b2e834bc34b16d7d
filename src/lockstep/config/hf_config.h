// Hugging Face model configurations (a model directory's config.json) in lockstep's terms, both
// ways. The families: llama (dense), mixtral, qwen2_moe, qwen3_moe, deepseek_v3. The weights that go
// with them are train/hf_checkpoint.h; docs/hf.md is the user's page.
//
// Reading: train.init_from = "hf:DIR" makes DIR/config.json a layer of the job's configuration
// (config.h's load_config: after the preset, before the job's file and overrides), and every key it
// sets must keep its value: a job that sets one differently is refused, naming both. A field that
// lockstep cannot honour (an activation other than silu, a sliding window, RoPE scaling other than
// llama3, a head size other than hidden / heads) is refused by name rather than ignored.
//
// Writing: hf_family chooses the family that holds a lockstep model exactly, or says why none does;
// hf_config_json writes its config.json.
#pragma once

#include <string>
#include <vector>

#include "lockstep/config/config.h"

namespace lockstep {

struct HfSetting {
  std::string key;     // lockstep's key, e.g. "model.num_query_groups"
  std::string value;   // as on the command line, e.g. "2"
  std::string source;  // the config.json field it comes from, e.g. "num_key_value_heads"
};

struct HfModelConfig {
  std::string dir;         // the model directory
  std::string model_type;  // llama | mixtral | qwen2_moe | qwen3_moe | deepseek_v3
  std::vector<HfSetting> settings;
  // deepseek_v3: the checkpoint's RoPE dimensions are interleaved pairs (x0, x1), (x2, x3), ...
  // (its rope_interleave, true by default); lockstep rotates halves, so they are permuted on import.
  bool rope_interleave = false;
};

// "hf:DIR" -> DIR; "" for any other train.init_from.
std::string hf_model_dir(const std::string& init_from);

// Reads DIR/config.json. UserError naming the file and the field for a missing or unsupported one.
HfModelConfig read_hf_config(const std::string& dir);

// The family that holds this model exactly; UserError naming the key that no family supports.
std::string hf_family(const ModelConfig& m, const MoeConfig& moe);

// config.json (pretty JSON text) of the model as a checkpoint of `family` (hf_family's choice).
std::string hf_config_json(const ModelConfig& m, const MoeConfig& moe, const std::string& family);

}  // namespace lockstep
