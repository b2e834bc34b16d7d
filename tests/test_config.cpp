// Config loading: precedence (defaults < preset < file < command line), the resolved TOML round
// trip, and the one-line errors for unknown keys, wrong types and impossible values.
#include <gtest/gtest.h>

#include "lockstep/config/config.h"
#include "lockstep/core/error.h"
#include "testing.h"

namespace lockstep {
namespace {

using testing::TempDir;

std::string error_of(const std::string& file, const std::vector<std::string>& overrides) {
  try {
    load_config(file, overrides);
  } catch (const UserError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Config, DefaultsAreValidAndGpt2) {
  const Config c = load_config("", {});
  EXPECT_EQ(c.model.preset, "gpt2");
  EXPECT_EQ(c.model.normalization, "layernorm");
  EXPECT_TRUE(c.model.tie_embeddings);
  EXPECT_EQ(c.data.source, "synthetic");
}

TEST(Config, PresetSetsArchitectureAndKeysOverrideIt) {
  Config c = load_config("", {"model.preset=llama"});
  EXPECT_EQ(c.model.normalization, "rmsnorm");
  EXPECT_EQ(c.model.position_embedding, "rope");
  EXPECT_EQ(c.model.activation, "swiglu");
  EXPECT_FALSE(c.model.bias);
  EXPECT_FALSE(c.model.tie_embeddings);
  // An explicit key wins over the preset even when it comes before the preset.
  c = load_config("", {"model.tie_embeddings=true", "model.preset=llama"});
  EXPECT_TRUE(c.model.tie_embeddings);
}

TEST(Config, FileThenCommandLine) {
  TempDir dir;
  const std::string f = dir.write("job.toml", "[model]\nnum_layers = 3\nhidden_size = 96\n[train]\nlr = 0.01\n");
  const Config c = load_config(f, {"model.num_layers=5", "train.lr=2e-3"});
  EXPECT_EQ(c.model.num_layers, 5);
  EXPECT_EQ(c.model.hidden_size, 96);
  EXPECT_DOUBLE_EQ(c.train.lr, 2e-3);
}

// The keys holding a list as text take a TOML array of integers too.
TEST(Config, ListKeysTakeTomlArrays) {
  TempDir dir;
  const Config c = load_config(dir.write("job.toml",
                                         "[model]\nnum_layers = 4\n[parallel]\npipeline = 2\n"
                                         "pipeline_layers = [1, 3]\n[moe]\nnum_experts = 4\n"
                                         "layer_freq = [0, 1, 1, 1]\n"),
                               {});
  EXPECT_EQ(c.parallel.pipeline_layers, "[1,3]");
  EXPECT_EQ(c.moe.layer_freq, "[0,1,1,1]");
  EXPECT_EQ(error_of(dir.write("bad.toml", "[parallel]\npipeline_layers = [1.5]\n"), {}),
            dir.path("bad.toml") + ":2: parallel.pipeline_layers: expected a single value, got an array");
}

TEST(Config, ResolvedTomlRoundTrips) {
  TempDir dir;
  const Config c = load_config("", {"model.preset=llama", "model.num_query_groups=2", "train.lr=0.00123",
                                    "train.out_dir=some \"quoted\" dir", "data.eval_fraction=0.1"});
  const std::string text = config_to_toml(c);
  const Config back = load_config(dir.write("resolved.toml", text), {});
  EXPECT_EQ(config_to_toml(back), text);
  EXPECT_EQ(back.train.out_dir, "some \"quoted\" dir");
  EXPECT_DOUBLE_EQ(back.train.lr, 0.00123);
}

TEST(Config, ShippedPresetsLoad) {
  for (const char* name : {"debug", "gpt2-peer", "llama-tiny", "moe-debug", "moe-peer", "mixtral-tiny", "deepseek-tiny",
                           "mixtral-8x7b", "deepseek-v3", "qwen3-moe-tiny", "qwen3-30b-a3b"}) {
    SCOPED_TRACE(name);
    EXPECT_NO_THROW(load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/" + name + ".toml", {}));
  }
}

TEST(Config, FullSizeShapesAreTheirPublishedSizes) {
  const Config mixtral = load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/mixtral-8x7b.toml", {});
  EXPECT_EQ(mixtral.model.query_groups(), 8);
  EXPECT_EQ(mixtral.moe.num_experts, 8);
  const Config dsv3 = load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/deepseek-v3.toml", {});
  EXPECT_EQ(dsv3.model.num_layers, 61);
  EXPECT_EQ(dsv3.moe.num_experts, 256);
  EXPECT_EQ(dsv3.moe.router_topk, 8);
}

TEST(Config, UnknownKeySuggestsTheNearestName) {
  EXPECT_EQ(error_of("", {"model.hiden_size=64"}),
            "command line: unknown config key 'model.hiden_size' (did you mean 'model.hidden_size'?)");
  TempDir dir;
  const std::string f = dir.write("bad.toml", "[train]\nsteps = 10\nbogus_key = 1\n");
  EXPECT_EQ(error_of(f, {}), f + ":3: unknown config key 'train.bogus_key' (see `lockstep help config`)");
}

TEST(Config, WrongTypesNameKeyAndValue) {
  EXPECT_EQ(error_of("", {"model.num_layers=four"}), "command line: model.num_layers=four: expected an integer");
  EXPECT_EQ(error_of("", {"model.bias=yes"}), "command line: model.bias=yes: expected true or false");
  EXPECT_EQ(error_of("", {"train.lr=fast"}), "command line: train.lr=fast: expected a number");
  TempDir dir;
  const std::string f = dir.write("t.toml", "[model]\nnum_layers = \"four\"\n");
  EXPECT_EQ(error_of(f, {}), f + ":2: model.num_layers = \"four\": expected an integer");
  const std::string g = dir.write("u.toml", "[model]\nactivation = \"relu\"\n");
  EXPECT_EQ(error_of(g, {}), g + ":2: model.activation = \"relu\": expected one of gelu, swiglu");
}

TEST(Config, ImpossibleValuesNameTheKeys) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"model.hidden_size=100", "model.num_heads=3"},
       "config: model.hidden_size = 100 is not divisible by model.num_heads = 3 (or set model.kv_channels, the head "
       "size)"},
      {{"model.preset=llama", "model.kv_channels=7"},
       "config: model.position_embedding = \"rope\" needs an even head size, got 7"},
      {{"model.kv_channels=-1"}, "config: model.kv_channels = -1: must be >= 0 (0 = hidden_size / num_heads)"},
      {{"train.global_batch=10", "train.micro_batch=4"},
       "config: train.global_batch = 10 is not divisible by train.micro_batch = 4"},
      {{"model.num_layers=0"}, "config: model.num_layers = 0: must be positive"},
      {{"model.num_heads=4", "model.num_query_groups=3"},
       "config: model.num_heads = 4 is not divisible by model.num_query_groups = 3"},
      {{"model.vocab_size=100"}, "config: model.vocab_size = 100 is smaller than the data's byte vocabulary (256)"},
      {{"data.source=parquet:x"},
       "config: data.source = \"parquet:x\": expected \"synthetic\", \"text:PATH\" or \"indexed:PREFIX\""},
      {{"determinism=bitwise"}, "command line: determinism = \"bitwise\": expected one of run, layout"},
      // The parallel sizes: zero or negative, sizes that do not divide, expert sizes without experts.
      {{"parallel.expert_tensor=0"}, "config: parallel.expert_tensor = 0: must be positive"},
      {{"parallel.expert=-2"}, "config: parallel.expert = -2: must be positive"},
      {{"parallel.tensor=3"}, "config: model.num_heads = 4 is not divisible by parallel.tensor = 3"},
      {{"parallel.tensor=2", "model.vocab_size=257"},
       "config: model.vocab_size = 257 is not divisible by parallel.tensor = 2"},
      {{"parallel.tensor=2", "model.ffn_hidden_size=33"},
       "config: model.ffn_hidden_size = 33 is not divisible by parallel.tensor = 2"},
      {{"parallel.expert_tensor=2"}, "config: parallel.expert_tensor = 2 needs an MoE model (moe.num_experts > 0)"},
      {{"parallel.expert=2"}, "config: parallel.expert = 2 needs an MoE model (moe.num_experts > 0)"},
      {{"moe.num_experts=6", "parallel.expert=4"},
       "config: moe.num_experts = 6 is not divisible by parallel.expert = 4 (every expert-parallel rank holds the same "
       "number of experts)"},
      {{"moe.num_experts=4", "moe.ffn_hidden_size=33", "parallel.expert_tensor=2"},
       "config: moe.ffn_hidden_size = 33 is not divisible by parallel.expert_tensor = 2 (every expert-tensor-parallel "
       "rank holds the same number of hidden units)"},
      {{"moe.num_experts=-1"}, "config: moe.num_experts = -1: must be >= 0 (0 = dense)"},
      // determinism = "layout": each combination it refuses.
      {{"determinism=layout", "parallel.tensor=4", "layout_segments=2"},
       "config: determinism = \"layout\" with parallel.tensor = 4 and layout_segments = 2: parallel.tensor must "
       "divide layout_segments (each tensor-parallel rank holds a block of whole canonical segments of every "
       "reduction it splits)"},
      {{"determinism=layout", "moe.num_experts=6", "parallel.tensor=4", "parallel.expert=6"},
       "config: determinism = \"layout\" with parallel.tensor = 4, an MoE model and parallel.expert x "
       "parallel.expert_tensor = 6: an expert's rows would come from parts of a micro-batch's ranks of "
       "parallel.tensor = 4 that do not tile it: the expert x expert-tensor group must be 1, a multiple of 4 or a "
       "divisor of it"},
      {{"determinism=layout", "moe.num_experts=4", "moe.ffn_hidden_size=100"},
       "config: determinism = \"layout\" with moe.ffn_hidden_size = 100 and layout_segments = 8: the expert hidden "
       "size must be divisible by layout_segments (each canonical segment of the expert GEMMs over the hidden units is "
       "F / layout_segments units)"},
      {{"determinism=layout", "moe.num_experts=4", "parallel.expert_tensor=4", "layout_segments=2"},
       "config: determinism = \"layout\" with parallel.expert_tensor = 4 and layout_segments = 2: "
       "parallel.expert_tensor must divide layout_segments (each expert-tensor-parallel rank holds a block of whole "
       "canonical segments of the hidden units)"},
      {{"determinism=layout", "moe.num_experts=4", "moe.router_load_balancing_type=global_aux_loss"},
       "config: determinism = \"layout\" with moe.router_load_balancing_type = \"global_aux_loss\": Megatron's "
       "global aux loss balances a rank's micro-batch i against the counts of every data-parallel rank's "
       "micro-batches 0 .. i of the step, which are other micro-batches under another data-parallel size: the loss "
       "itself depends on the layout"},
      {{"train.out_dir="}, "config: train.out_dir is empty"},
      // The pipeline keys.
      {{"parallel.pipeline=0"}, "config: parallel.pipeline = 0: must be positive"},
      {{"parallel.pipeline=3"},
       "config: model.num_layers = 4 is not divisible by parallel.pipeline x parallel.virtual_pipeline = 3 x 1; set "
       "parallel.pipeline_layers to split them unevenly"},
      {{"parallel.pipeline=2", "parallel.pipeline_layers=[1,3"},
       "config: parallel.pipeline_layers = \"[1,3\": expected positive layer counts such as [1,2,1]"},
      {{"parallel.pipeline=2", "parallel.pipeline_layers=[0,4]"},
       "config: parallel.pipeline_layers = \"[0,4]\": expected positive layer counts such as [1,2,1]"},
      {{"parallel.pipeline=2", "parallel.pipeline_layers=[1,2]"},
       "config: parallel.pipeline_layers = \"[1,2]\" adds up to 3 layers, model.num_layers = 4"},
      {{"parallel.pipeline_layers=[4]"}, "config: parallel.pipeline_layers = \"[4]\" needs parallel.pipeline > 1"},
      {{"parallel.virtual_pipeline=2"}, "config: parallel.virtual_pipeline = 2 needs parallel.pipeline > 1"},
      {{"parallel.pipeline=2", "parallel.virtual_pipeline=2", "parallel.pipeline_schedule=all_forward_all_backward"},
       "config: parallel.virtual_pipeline = 2: the interleaved schedule is 1F1B; parallel.pipeline_schedule = "
       "\"all_forward_all_backward\" has no virtual stages"},
  };
  for (const auto& [overrides, expected] : cases) EXPECT_EQ(error_of("", overrides), expected) << overrides[0];
}

TEST(Config, WrongShapesInTheFileNameKeyAndLine) {
  TempDir dir;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"[parallel]\ntensor = [2]\n", ":2: parallel.tensor: expected a single value, got an array"},
      {"[parallel]\ntensor = 2.0\n", ":2: parallel.tensor = 2.0: expected an integer"},
      {"[parallel]\ntensor = \"2\"\n", ":2: parallel.tensor = \"2\": expected an integer"},
      {"[parallel]\nexpert_tensor = { size = 2 }\n",
       ":2: parallel.expert_tensor: expected a single value, got a table"},
      {"[parallel.tensor]\nsize = 2\n", ":2: parallel.tensor: expected a single value, got a table"},
      {"parallel = 3\n", ":1: unknown config key 'parallel' (see `lockstep help config`)"},
  };
  for (const auto& [text, expected] : cases) {
    const std::string f = dir.write("job.toml", text);
    EXPECT_EQ(error_of(f, {}), f + expected) << text;
  }
}

TEST(Config, MalformedInputs) {
  EXPECT_EQ(error_of("", {"train.steps"}),
            "command line: 'train.steps' is not a key=value override (e.g. train.steps=20)");
  TempDir dir;
  const std::string f = dir.write("broken.toml", "[model\nnum_layers = 2\n");
  const std::string e = error_of(f, {});
  EXPECT_EQ(e.rfind(f + ":1:", 0), 0u) << e;
  EXPECT_NE(error_of(dir.path("missing.toml"), {}).find("missing.toml"), std::string::npos);
}

}  // namespace
}  // namespace lockstep

namespace lockstep {
namespace {

TEST(Config, DocumentedKeyListMatchesTheProgram) {
  const std::string doc = testing::read_file(std::string(LOCKSTEP_SOURCE_DIR) + "/docs/configuration.md");
  EXPECT_NE(doc.find("```\n" + config_help() + "```"), std::string::npos)
      << "docs/configuration.md is out of date: paste the output of `build/lockstep help config`";
}

}  // namespace
}  // namespace lockstep
