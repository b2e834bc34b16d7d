// Upcycling (train/upcycling.h): an MoE model initialised from a dense one computes the dense
// model at step 0 when the routing renormalises the top k, for whole copies of the MLP (granularity
// 1) and finer slices (granularity 2 and 4), SwiGLU and GELU with biases; from the command line,
// from lockstep's export and from a Hugging Face directory.
#include <gtest/gtest.h>

#include <filesystem>

#include "lockstep/config/config.h"
#include "lockstep/model/gpt.h"
#include "lockstep/train/fingerprint.h"
#include "lockstep/train/upcycling.h"
#include "model_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

using testing::TempDir;
using testing::user_error_of;

struct Case {
  const char* preset;
  int64_t experts, topk, granularity;
};

// The dense and the upcycled model's evaluation losses on one batch of random tokens.
std::pair<double, double> dense_and_upcycled(const Case& k, bool pre_softmax = false) {
  ModelConfig m = testing::tiny_model(k.preset, 8);
  m.ffn_hidden_size = 32;
  m.init_std = 0.1;
  const int64_t B = 2, N = B * m.seq_length;
  GPT dense(m, B);
  dense.params().init(7);
  MoeConfig moe;
  moe.num_experts = k.experts;
  moe.router_topk = k.topk;
  moe.ffn_hidden_size = m.ffn_hidden_size / k.granularity;
  moe.router_pre_softmax = pre_softmax;
  moe.use_upcycling = true;
  GPT upcycled(m, B, moe);
  upcycled.params().init(11);
  const ParamStore& d = dense.params();
  upcycle(upcycled.params(), m, moe, [&](const std::string& name, const Shape& shape) {
    const int i = d.find(name);
    EXPECT_GE(i, 0) << name;
    EXPECT_EQ(d.specs()[i].global_shape, shape) << name;
    return std::vector<float>(d.value(i), d.value(i) + shape.numel());
  });
  const std::vector<int32_t> tokens = testing::random_ints(N, m.vocab_size, 3, "tokens");
  const std::vector<int32_t> targets = testing::random_ints(N, m.vocab_size, 4, "targets");
  return {dense.evaluate(tokens.data(), targets.data()), upcycled.evaluate(tokens.data(), targets.data())};
}

TEST(Upcycling, MoeModelComputesTheDenseModelAtStepZero) {
  for (const Case& k : {Case{"llama", 4, 2, 1}, Case{"llama", 8, 4, 2}, Case{"llama", 8, 4, 4}, Case{"gpt2", 4, 1, 1},
                        Case{"gpt2", 8, 2, 2}}) {
    const auto [dense, upcycled] = dense_and_upcycled(k);
    EXPECT_NEAR(upcycled, dense, 1e-6 * dense)
        << k.preset << " E " << k.experts << " K " << k.topk << " granularity " << k.granularity;
  }
  // Softmax over all experts without renormalising: scaled to be right on average, not exactly.
  const auto [dense, upcycled] = dense_and_upcycled({"llama", 8, 4, 2}, true);
  EXPECT_GT(std::abs(upcycled - dense), 1e-6 * dense);
  EXPECT_NEAR(upcycled, dense, 0.05 * dense);
}

TEST(Upcycling, ImpossibleSettingsNameTheKeys) {
  auto error = [](const std::vector<std::string>& extra) {
    std::vector<std::string> keys = {"model.preset=llama", "model.ffn_hidden_size=256", "moe.num_experts=8",
                                     "moe.use_upcycling=true", "train.init_from=w.safetensors"};
    keys.insert(keys.end(), extra.begin(), extra.end());
    return user_error_of([&] { load_config("", keys); });
  };
  EXPECT_EQ(error({"moe.ffn_hidden_size=96"}),
            "config: moe.use_upcycling = true with moe.ffn_hidden_size = 96: it must divide the dense MLP's width 256");
  EXPECT_EQ(error({"moe.ffn_hidden_size=64", "moe.router_topk=2"}),
            "config: moe.use_upcycling = true with granularity 4 (model.ffn_hidden_size / moe.ffn_hidden_size): "
            "moe.num_experts = 8 and moe.router_topk = 2 must be multiples of it, so that the top k take whole copies "
            "of the MLP");
  EXPECT_EQ(error({"moe.router_score_function=sigmoid"}),
            "config: moe.use_upcycling = true with moe.router_score_function = \"sigmoid\": it needs softmax routing");
  EXPECT_EQ(error({"train.init_from="}),
            "config: moe.use_upcycling = true with train.init_from = \"\": it needs the dense checkpoint to upcycle");
}

// From the command line: a dense Llama run's weights, exported as safetensors or as a Hugging Face
// directory, start an 8-expert run whose first loss is the dense model's on the same batch.
TEST(Upcycling, FromTheCommandLineTheFirstLossIsTheDenseModels) {
  TempDir dir;
  const std::string config = std::string(LOCKSTEP_SOURCE_DIR) + "/configs/llama-tiny.toml";
  const std::string common = " -c " + config +
                             " model.num_layers=2 train.global_batch=4 train.micro_batch=2 "
                             "train.eval_interval=0 train.warmup_steps=1";
  testing::CliResult r =
      testing::run_cli(dir, "train" + common + " train.steps=1 train.save_interval=1 train.out_dir=d");
  ASSERT_EQ(r.status, 0) << r.err;
  ASSERT_EQ(testing::run_cli(dir, "ckpt export d w.safetensors").status, 0);
  ASSERT_EQ(testing::run_cli(dir, "ckpt export d hf --format hf").status, 0);
  r = testing::run_cli(dir, "train" + common + " train.steps=1 train.init_from=w.safetensors train.out_dir=dense");
  ASSERT_EQ(r.status, 0) << r.err;
  const double dense = testing::trajectory(dir.path("dense"))[0].first;
  const std::string moe = " moe.num_experts=8 moe.router_topk=4 moe.ffn_hidden_size=192 moe.use_upcycling=true";
  for (const std::string from : {"w.safetensors", "hf:hf"}) {
    const std::string out = from == "w.safetensors" ? "moe1" : "moe2";
    r = testing::run_cli(dir,
                         "train" + common + moe + " train.steps=1 train.init_from=" + from + " train.out_dir=" + out);
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NEAR(testing::trajectory(dir.path(out))[0].first, dense, 1e-6 * dense) << from;
  }
  r = testing::run_cli(dir,
                       "train" + common + " moe.num_experts=8 train.steps=1 train.init_from=hf:hf train.out_dir=x");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("is a dense checkpoint and moe.num_experts = 8: set moe.use_upcycling = true"),
            std::string::npos)
      << r.err;
}

}  // namespace
}  // namespace lockstep
