// Hugging Face checkpoints (config/hf_config.h, train/hf_checkpoint.h) against Hugging Face
// transformers itself: tests/hf/make_fixtures.py builds a tiny random model of each family in
// transformers, saves it with save_pretrained, and records one batch's loss and the gradient of
// every checkpoint tensor that transformers computes in float64. Here lockstep loads the directory
// (config.json decides the model), runs the batch, and its loss and gradients (mapped back to the
// checkpoint's names) must match; writing the model back gives the same tensors and config.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "lockstep/config/config.h"
#include "lockstep/config/hf_config.h"
#include "lockstep/model/gpt.h"
#include "lockstep/train/checkpoint.h"
#include "lockstep/train/fingerprint.h"
#include "lockstep/train/hf_checkpoint.h"
#include "lockstep/train/safetensors.h"
#include "model_testing.h"
#include "testing.h"
#include "tokenizer_fixtures.h"

namespace lockstep {
namespace {

namespace fs = std::filesystem;
using testing::read_file;
using testing::TempDir;
using testing::user_error_of;

std::string fixture(const std::string& name) { return std::string(LOCKSTEP_SOURCE_DIR) + "/tests/hf/fixtures/" + name; }

// The job of a fixture: config.json's model, the reference batch's shape. indexed data, so that
// the 64-token vocabulary passes validation (the tests feed their own tokens).
Config fixture_job(const std::string& dir, std::vector<std::string> extra = {}) {
  extra.insert(extra.end(), {"train.init_from=hf:" + dir, "model.seq_length=16", "train.micro_batch=2",
                             "train.global_batch=2", "data.source=indexed:unused"});
  return load_config("", extra);
}

using testing::relative_error;

void check_against_transformers(const std::string& name) {
  const std::string dir = fixture(name);
  const std::string family = read_hf_config(dir).model_type;
  const Config c = fixture_job(dir);
  SafetensorsFile ref(dir + "/reference.safetensors");
  const std::vector<char> tok = ref.bytes("tokens"), tgt = ref.bytes("targets"), loss_bytes = ref.bytes("loss");
  const int64_t N = c.train.micro_batch * c.model.seq_length;
  ASSERT_EQ(static_cast<int64_t>(tok.size()), 4 * N);
  double hf_loss;
  std::memcpy(&hf_loss, loss_bytes.data(), 8);

  GPT model(c.model, c.train.micro_batch, c.moe);
  ParamStore& ps = model.params();
  std::vector<StateShard> state;  // DeepSeek's expert biases are module state
  model.state_shards(state, true, true);
  load_hf_checkpoint(dir, ps, c.model, c.moe, state);
  ps.zero_grads();
  model.begin_step(c.train.seed, 1);
  const double loss =
      model.forward_backward(reinterpret_cast<const int32_t*>(tok.data()), reinterpret_cast<const int32_t*>(tgt.data()),
                             1.0f / static_cast<float>(N));
  EXPECT_NEAR(loss, hf_loss, 2e-6 * hf_loss) << family;
  EXPECT_NEAR(
      model.evaluate(reinterpret_cast<const int32_t*>(tok.data()), reinterpret_cast<const int32_t*>(tgt.data())),
      hf_loss, 2e-6 * hf_loss)
      << family;

  // DeepSeek's multi-token prediction layer: the depth's loss (make_mtp_case).
  const bool mtp = ref.has("mtp_loss");
  EXPECT_EQ(mtp, c.model.mtp_num_layers > 0) << family;
  if (mtp) {
    double hf_mtp;
    std::memcpy(&hf_mtp, ref.bytes("mtp_loss").data(), 8);
    EXPECT_NEAR(model.mtp_loss(), hf_mtp, 2e-6 * hf_mtp) << family;
    if (std::getenv("LOCKSTEP_REFERENCE_REPORT"))
      std::printf("%s: mtp loss rel err %.3e\n", name.c_str(), std::abs(model.mtp_loss() - hf_mtp) / hf_mtp);
  }

  // Every gradient transformers has, under its name; none left over.
  const bool report = std::getenv("LOCKSTEP_REFERENCE_REPORT") != nullptr;
  if (report) std::printf("%s: loss rel err %.3e\n", family.c_str(), std::abs(loss - hf_loss) / hf_loss);
  double worst = 0;
  int64_t compared = 0;
  for (const HfParam& p : hf_tensor_map(c.model, c.moe, family, read_hf_config(dir).rope_interleave)) {
    if (p.param.rfind("buffer/", 0) == 0) continue;  // not trained
    if (p.copy) continue;                            // the MTP layer's embedding and head: shared
    const int i = ps.find(p.param);
    ASSERT_GE(i, 0) << p.param;
    for (const HfPiece& piece : p.pieces) {
      ASSERT_TRUE(ref.has("grad/" + piece.name)) << family << ": transformers has no gradient of " << piece.name;
      const double err = relative_error(hf_checkpoint_tensor(p, piece, ps.grad(i)), ref.floats("grad/" + piece.name));
      EXPECT_LE(err, 2e-5) << family << ": gradient of " << piece.name << " (lockstep's " << p.param << ")";
      worst = std::max(worst, err);
      ++compared;
    }
  }
  // Every gradient the reference holds was compared (the expert biases are module state, not
  // trained: save_pretrained writes them with the gradients).
  int64_t buffers = 0;
  for (const std::string& name : ref.names()) buffers += name.ends_with("e_score_correction_bias");
  EXPECT_EQ(compared, static_cast<int64_t>(ref.names().size()) - 3 - mtp - buffers)
      << family << ": gradients not compared";
  if (report)
    std::printf("%s: largest gradient rel err %.3e over %lld tensors\n", family.c_str(), worst, (long long)compared);
}

TEST(HfCheckpoint, LlamaMatchesTransformers) { check_against_transformers("llama"); }
TEST(HfCheckpoint, MixtralMatchesTransformers) { check_against_transformers("mixtral"); }
TEST(HfCheckpoint, Qwen2MoeMatchesTransformers) { check_against_transformers("qwen2_moe"); }
TEST(HfCheckpoint, Qwen3MoeMatchesTransformers) { check_against_transformers("qwen3_moe"); }
TEST(HfCheckpoint, DeepseekV3MatchesTransformers) { check_against_transformers("deepseek_v3"); }
// DeepSeek-V3's YaRN: the frequency ramp and the softmax scale's m(factor, mscale_all_dim)^2.
TEST(HfCheckpoint, DeepseekV3WithYarnMatchesTransformers) { check_against_transformers("deepseek_v3_yarn"); }
// DeepSeek-V3's multi-token prediction layer as its release stores it (model.layers.<L>.*), its
// transformer layer MoE like the last decoder layer, against transformers' own decoder layer.
TEST(HfCheckpoint, DeepseekV3WithMtpMatchesTransformers) { check_against_transformers("deepseek_v3_mtp"); }

// The real-size presets have their published parameter counts (Mixtral-8x7B-v0.1 and
// Qwen3-30B-A3B on the Hugging Face hub), counted from the tensor map without building them.
TEST(HfCheckpoint, RealSizePresetsHaveTheirPublishedParameterCounts) {
  for (const auto& [preset, family, published] : std::vector<std::tuple<std::string, std::string, int64_t>>{
           {"mixtral-8x7b", "mixtral", 46702792704}, {"qwen3-30b-a3b", "qwen3_moe", 30532122624}}) {
    const Config c = load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/" + preset + ".toml", {});
    EXPECT_EQ(hf_family(c.model, c.moe), family);
    int64_t total = 0;
    for (const HfParam& p : hf_tensor_map(c.model, c.moe, family)) total += p.shape.numel();
    EXPECT_EQ(total, published) << preset;
  }
  // DeepSeek-V3: "671B of the Main Model weights and 14B of the Multi-Token Prediction (MTP) Module
  // weights" (685B on the hub), counted by the deepseek_v3 tensor map (the expert biases are module
  // state, not parameters); the MTP layer as the release stores it, with its copies of the embedding
  // and the output head: 13.46B, which DeepSeek rounds to 14B.
  const Config dsv3 = load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/deepseek-v3.toml", {});
  int64_t main = 0, mtp = 0;
  for (const HfParam& p : hf_tensor_map(dsv3.model, dsv3.moe, "deepseek_v3")) {
    if (p.param.rfind("buffer/", 0) == 0) continue;
    (p.copy || p.param.rfind("mtp.", 0) == 0 ? mtp : main) += p.shape.numel();
  }
  EXPECT_NEAR(static_cast<double>(main), 671e9, 671e9 * 1e-4);  // 671,026,404,352
  EXPECT_NEAR(static_cast<double>(mtp), 13.5e9, 0.5e9);         // 13,463,426,048
  EXPECT_NEAR(static_cast<double>(main + mtp), 685e9, 1e9);
}

// config.json becomes lockstep's keys: the fixtures' families, layer patterns and routing.
TEST(HfCheckpoint, ConfigJsonSetsTheModel) {
  const Config llama = fixture_job(fixture("llama"));
  EXPECT_EQ(llama.model.num_layers, 2);
  EXPECT_EQ(llama.model.hidden_size, 32);
  EXPECT_EQ(llama.model.query_groups(), 2);
  EXPECT_EQ(llama.model.ffn_hidden(), 48);
  EXPECT_TRUE(llama.model.tie_embeddings);
  EXPECT_EQ(llama.model.rope_scaling, "llama3");
  EXPECT_EQ(llama.model.rope_original_max_position_embeddings, 64);
  EXPECT_EQ(llama.model.norm_eps, 1e-6);
  EXPECT_EQ(llama.moe.num_experts, 0);
  const Config qwen2 = fixture_job(fixture("qwen2_moe"));
  EXPECT_EQ(qwen2.moe.num_experts, 4);
  EXPECT_TRUE(qwen2.moe.router_pre_softmax);  // norm_topk_prob false
  EXPECT_TRUE(qwen2.moe.is_moe_layer(0, 2));
  EXPECT_FALSE(qwen2.moe.is_moe_layer(1, 2));  // mlp_only_layers [1]
  EXPECT_EQ(qwen2.moe.shared_expert_intermediate_size, 40);
  EXPECT_TRUE(qwen2.moe.shared_expert_gate);
  EXPECT_TRUE(qwen2.model.add_qkv_bias);
  const Config mixtral = fixture_job(fixture("mixtral"));
  EXPECT_FALSE(mixtral.moe.router_pre_softmax);
  EXPECT_EQ(mixtral.moe.ffn_hidden_size, 48);
  EXPECT_EQ(mixtral.model.rope_theta, 1e6);
  EXPECT_TRUE(fixture_job(fixture("qwen3_moe")).model.qk_layernorm);
  // A job may repeat config.json's values, not change them.
  EXPECT_EQ(fixture_job(fixture("llama"), {"model.hidden_size=32", "model.preset=llama"}).model.hidden_size, 32);
  EXPECT_EQ(user_error_of([&] { fixture_job(fixture("llama"), {"model.hidden_size=64"}); }),
            "command line: model.hidden_size = 64, but '" + fixture("llama") +
                "/config.json' (hidden_size) sets it to 32 (leave the key out: the checkpoint's config decides it)");
}

// Writing the loaded model back gives the checkpoint's tensors bit for bit (per-expert, unsharded)
// and a config.json that reads back as the same model.
TEST(HfCheckpoint, ExportWritesTheImportedCheckpointBack) {
  // LOCKSTEP_HF_EXPORT_DIR=DIR keeps the exports as DIR/<family> (tests/hf/check_export.py loads
  // them in transformers), named by fixture.
  const char* keep = std::getenv("LOCKSTEP_HF_EXPORT_DIR");
  for (const std::string name :
       {"llama", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v3_yarn", "deepseek_v3_mtp"}) {
    TempDir tmp;
    const std::string family = read_hf_config(fixture(name)).model_type;
    const Config c = fixture_job(fixture(name));
    GPT model(c.model, c.train.micro_batch, c.moe);
    ParamStore& ps = model.params();
    std::vector<StateShard> state;
    model.state_shards(state, true, true);
    load_hf_checkpoint(fixture(name), ps, c.model, c.moe, state);
    EXPECT_EQ(hf_family(c.model, c.moe), family);
    const int64_t n = write_hf_checkpoint(tmp.path("out"), c.model, c.moe, [&](const std::string& name) {
      if (name.rfind("buffer/", 0) != 0) return static_cast<const float*>(ps.value(ps.find(name)));
      const auto it = std::find_if(state.begin(), state.end(), [&](const StateShard& s) { return s.name == name; });
      EXPECT_NE(it, state.end()) << name;
      return static_cast<const float*>(it->data);
    });
    SafetensorsFile written(tmp.path("out/model.safetensors"));
    EXPECT_EQ(static_cast<int64_t>(written.names().size()), n);
    // The fixture's tensors, from however many shards.
    std::map<std::string, std::vector<float>> theirs;
    for (const auto& entry : fs::directory_iterator(fixture(name))) {
      const std::string leaf = entry.path().filename().string();
      if (leaf.rfind("model", 0) != 0 || entry.path().extension() != ".safetensors") continue;
      SafetensorsFile f(entry.path().string());
      for (const std::string& name : f.names()) theirs[name] = f.floats(name);
    }
    if (c.model.tie_embeddings) theirs.erase("lm_head.weight");  // transformers writes none when tied
    EXPECT_EQ(theirs.size(), written.names().size()) << family;
    for (const std::string& name : written.names()) {
      ASSERT_TRUE(theirs.count(name)) << family << ": lockstep wrote " << name << ", transformers did not";
      EXPECT_TRUE(testing::bitwise_equal(written.floats(name), theirs[name])) << family << ": " << name;
    }
    // The [model] and [moe] tables of the resolved configs.
    auto model_keys = [](const Config& job) {
      const std::string t = config_to_toml(job);
      auto table = [&](const std::string& from, const std::string& to) {
        return t.substr(t.find(from), t.find(to) - t.find(from));
      };
      return table("[model]", "[train]") + table("[moe]", "[debug]");
    };
    EXPECT_EQ(model_keys(fixture_job(tmp.path("out"))), model_keys(c)) << family;
    if (keep) {
      fs::remove_all(std::string(keep) + "/" + name);
      fs::create_directories(keep);
      fs::rename(tmp.path("out"), std::string(keep) + "/" + name);
    }
  }
}

// DeepSeek-V3-style FP8 weights: codes times 128x128 block scales, partial blocks at the edges.
TEST(HfCheckpoint, Fp8BlockScaledWeightsAreDequantised) {
  const std::string dir = fixture("llama_fp8");
  const Config c = fixture_job(dir);
  GPT model(c.model, c.train.micro_batch, c.moe);
  ParamStore& ps = model.params();
  load_hf_checkpoint(dir, ps, c.model, c.moe);
  SafetensorsFile ref(dir + "/reference.safetensors");
  int64_t compared = 0;
  for (const HfParam& p : hf_tensor_map(c.model, c.moe, "llama"))
    for (const HfPiece& piece : p.pieces)
      if (ref.has("dequant/" + piece.name)) {
        EXPECT_TRUE(testing::bitwise_equal(hf_checkpoint_tensor(p, piece, ps.value(ps.find(p.param))),
                                           ref.floats("dequant/" + piece.name)))
            << piece.name;
        ++compared;
      }
  EXPECT_EQ(compared, 7);  // q, k, v, o, gate, up, down
}

// One error line naming the file and the tensor or field, for each kind of bad directory.
TEST(HfCheckpoint, BadDirectoriesAreRefusedByName) {
  TempDir tmp;
  auto copy_with = [&](const std::string& leaf, const std::function<void(std::vector<SafetensorsTensor>&)>& edit,
                       const std::string& config_edit = "", const std::string& src = fixture("mixtral")) {
    const std::string dir = tmp.path(leaf);
    fs::create_directories(dir);
    std::string config = read_file(src + "/config.json");
    if (!config_edit.empty()) {
      nlohmann::json j = nlohmann::json::parse(config);
      j.merge_patch(nlohmann::json::parse(config_edit));
      config = j.dump();
    }
    tmp.write(leaf + "/config.json", config);
    SafetensorsFile f(src + "/model.safetensors");
    std::vector<std::vector<float>> data;
    std::vector<SafetensorsTensor> tensors;
    for (const std::string& name : f.names()) {
      data.push_back(f.floats(name));
      tensors.push_back({name, DType::f32, f.entry(name).shape, nullptr});
    }
    for (size_t k = 0; k < tensors.size(); ++k) tensors[k].data = data[k].data();
    edit(tensors);
    write_safetensors(dir + "/model.safetensors", tensors, {});
    return dir;
  };
  auto load = [&](const std::string& dir) {
    return user_error_of([&] {
      const Config c = fixture_job(dir);
      GPT model(c.model, c.train.micro_batch, c.moe);
      load_hf_checkpoint(dir, model.params(), c.model, c.moe);
    });
  };
  const std::string router = "model.layers.1.block_sparse_moe.gate.weight";
  std::string dir = copy_with("missing", [&](auto& t) {
    t.erase(std::find_if(t.begin(), t.end(), [&](const SafetensorsTensor& x) { return x.name == router; }));
  });
  EXPECT_EQ(load(dir), "'" + dir + "' has no tensor '" + router +
                           "' (lockstep's layers.1.moe.router.weight (4, 32) needs it; compare config.json with the "
                           "checkpoint)");
  std::vector<float> extra(4, 1.0f);
  dir = copy_with("extra", [&](auto& t) { t.push_back({"model.layers.9.foo", DType::f32, Shape{4}, extra.data()}); });
  EXPECT_EQ(load(dir), "'" + dir +
                           "/model.safetensors' has tensor 'model.layers.9.foo', which is not part of the "
                           "model its config.json describes");
  dir = copy_with(
      "shape", [&](auto&) {}, R"({"num_local_experts": 5})");
  EXPECT_EQ(load(dir),
            "'" + dir +
                "/model.safetensors': tensor 'model.layers.0.block_sparse_moe.gate.weight' has shape (4, 32); "
                "config.json makes it (5, 32)");
  dir = copy_with(
      "family", [&](auto&) {}, R"({"model_type": "gpt2"})");
  EXPECT_EQ(load(dir), "'" + dir +
                           "/config.json': model_type = \"gpt2\": lockstep reads the families llama, mixtral, "
                           "qwen2_moe, qwen3_moe, deepseek_v3");
  dir = copy_with(
      "act", [&](auto&) {}, R"({"hidden_act": "gelu"})");
  EXPECT_EQ(load(dir), "'" + dir + "/config.json': hidden_act = \"gelu\": lockstep's SwiGLU uses silu");
  dir = copy_with(
      "rope", [&](auto&) {}, R"({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6}})");
  EXPECT_EQ(load(dir), "'" + dir +
                           "/config.json': rope_parameters = {\"rope_theta\":1000000.0,\"rope_type\":\"dynamic\"}: "
                           "RoPE scaling \"dynamic\" is not supported (lockstep has llama3 and yarn)");
  // DeepSeek's MTP layer: its copy of the output head must be the head lockstep's depth shares;
  // config.json's num_nextn_predict_layers asks for the layer's tensors.
  const std::string mtp_head = "model.layers.2.shared_head.head.weight";
  std::vector<float> changed;
  dir = copy_with(
      "mtp_head",
      [&](auto& t) {
        auto it = std::find_if(t.begin(), t.end(), [&](const SafetensorsTensor& x) { return x.name == mtp_head; });
        const float* head = static_cast<const float*>(it->data);
        changed.assign(head, head + it->shape.numel());
        changed[5] += 1.0f;
        it->data = changed.data();
      },
      "", fixture("deepseek_v3_mtp"));
  EXPECT_EQ(load(dir), "'" + dir + "/model.safetensors': tensor '" + mtp_head +
                           "' differs from 'lm_head.weight'; lockstep's multi-token prediction depths share the "
                           "model's");
  dir = copy_with(
      "mtp_missing", [&](auto&) {}, R"({"num_nextn_predict_layers": 1})", fixture("deepseek_v3"));
  EXPECT_EQ(load(dir), "'" + dir +
                           "' has no tensor 'model.layers.2.enorm.weight' (lockstep's mtp.layers.0.enorm.weight (32) "
                           "needs it; compare config.json with the checkpoint)");
  EXPECT_EQ(load(tmp.path("nowhere")), "train.init_from = \"hf:" + tmp.path("nowhere") + "\": cannot open '" +
                                           tmp.path("nowhere") + "/config.json'");
  // A model no family holds is refused by the key that rules it out.
  ModelConfig gpt2;
  EXPECT_EQ(user_error_of([&] { hf_family(gpt2, MoeConfig{}); }),
            "--format hf: model.normalization = \"layernorm\": they use rmsnorm (the Hugging Face families lockstep "
            "writes: llama, mixtral, qwen2_moe, qwen3_moe, deepseek_v3)");
}

// From the command line: a run's checkpoint exported as a Hugging Face directory initialises a run
// with exactly the bits of one initialised from the same weights in lockstep's own format.
TEST(HfCheckpoint, ExportedDirectoryTrainsLikeTheSafetensorsExport) {
  TempDir dir;
  const std::string config = std::string(LOCKSTEP_SOURCE_DIR) + "/configs/mixtral-tiny.toml";
  const std::string small =
      " model.num_layers=2 model.vocab_size=512 train.global_batch=4 train.micro_batch=2 train.eval_interval=0";
  testing::CliResult r =
      testing::run_cli(dir, "train -c " + config + small + " train.steps=1 train.save_interval=1 train.out_dir=run");
  ASSERT_EQ(r.status, 0) << r.err;
  r = testing::run_cli(dir, "ckpt export run w.safetensors");
  ASSERT_EQ(r.status, 0) << r.err;
  r = testing::run_cli(dir, "ckpt export run hf --format hf");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("config.json (mixtral)"), std::string::npos) << r.out;
  r = testing::run_cli(dir, "ckpt export run hf --format hf");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("'hf' exists; --format hf writes a new directory"), std::string::npos) << r.err;
  for (const std::string& init : std::vector<std::string>{"w.safetensors", "hf:" + dir.path("hf")}) {
    const std::string out = init == "w.safetensors" ? "a" : "b";
    r = testing::run_cli(
        dir, "train -c " + config + small + " train.steps=2 train.init_from=" + init + " train.out_dir=" + out);
    ASSERT_EQ(r.status, 0) << r.err;
  }
  EXPECT_EQ(read_file(fingerprint_path(dir.path("a"), 0)), read_file(fingerprint_path(dir.path("b"), 0)));

  // DeepSeek-V3's shape (MLA, expert bias, an MoE MTP depth: configs/deepseek-tiny.toml) goes out as
  // deepseek_v3 with its trained expert biases and comes back in.
  const std::string ds = " -c " + std::string(LOCKSTEP_SOURCE_DIR) +
                         "/configs/deepseek-tiny.toml train.global_batch=4 train.micro_batch=2 train.eval_interval=0";
  r = testing::run_cli(dir, "train" + ds + " train.steps=2 train.save_interval=2 train.out_dir=ds");
  ASSERT_EQ(r.status, 0) << r.err;
  r = testing::run_cli(dir, "ckpt export ds ds-hf --format hf");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("config.json (deepseek_v3)"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(dir.path("ds-hf/tokenizer.json")));  // the run had none
  r = testing::run_cli(dir, "train" + ds +
                                " train.steps=1 train.save_interval=1 train.init_from=hf:ds-hf "
                                "train.out_dir=ds2");
  EXPECT_EQ(r.status, 0) << r.err;

  // The tokenizer's files: --tokenizer's, checked against the vocabulary, or those of the directory
  // the run was initialised from.
  fs::create_directories(dir.path("tok"));
  const std::string tokenizer = dir.write("tok/tokenizer.json", testing::byte_fallback_json().dump());
  r = testing::run_cli(dir, "ckpt export ds ds-tok --format hf --tokenizer tok/tokenizer.json");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("'tok/tokenizer.json' has 271 tokens; the model's vocabulary (model.vocab_size) is 256"),
            std::string::npos)
      << r.err;
  EXPECT_FALSE(fs::exists(dir.path("ds-tok")));
  r = testing::run_cli(dir, "ckpt export ds ds-tok --format hf --tokenizer nowhere");
  EXPECT_NE(r.err.find("--tokenizer 'nowhere': no such file or directory"), std::string::npos) << r.err;
  r = testing::run_cli(dir, "ckpt export run hf-tok --format hf --tokenizer tok");  // 512 tokens
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("model.safetensors, tokenizer.json;"), std::string::npos) << r.out;
  EXPECT_EQ(read_file(dir.path("hf-tok/tokenizer.json")), read_file(tokenizer));
  r = testing::run_cli(dir, "train -c " + config + small +
                                " train.steps=1 train.save_interval=1 train.init_from=hf:hf-tok train.out_dir=c");
  ASSERT_EQ(r.status, 0) << r.err;
  r = testing::run_cli(dir, "ckpt export c c-hf --format hf");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(read_file(dir.path("c-hf/tokenizer.json")), read_file(tokenizer));
}

}  // namespace
}  // namespace lockstep
