// Multi-token prediction (model/mtp.h): whole-model gradients against finite differences of the
// training loss lm + mtp with MTP on (both flavours, two depths, masked targets), bitwise
// determinism over threads and runs, what the run directory records, and config validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>

#include "lockstep/config/config.h"
#include "lockstep/core/error.h"
#include "lockstep/core/hash.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/model/gpt.h"
#include "lockstep/train/fingerprint.h"
#include "lockstep/train/trainer.h"
#include "model_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

ModelConfig tiny_mtp(const std::string& preset, int64_t depths) {
  ModelConfig m = testing::tiny_model(preset);
  m.mtp_num_layers = depths;
  m.mtp_loss_scaling_factor = 0.7;  // large, so the MTP part of each gradient is visible
  return m;
}

// Directional derivatives of lm_loss + mtp_loss along a random unit direction per parameter tensor
// (the embedding and head receive gradient from every depth) against central differences.
void check_mtp_gradients(const std::string& preset) {
  const ModelConfig m = tiny_mtp(preset, 2);
  const int64_t B = 2, N = B * m.seq_length;
  GPT model(m, B);
  ParamStore& ps = model.params();
  ps.init(7);
  const std::vector<int32_t> tokens = testing::random_ints(N, m.vocab_size, 3, "tokens");
  std::vector<int32_t> targets = testing::random_ints(N, m.vocab_size, 3, "targets");
  targets[4] = -1;  // a masked target: shifted into each depth's targets, it must stay masked
  int64_t valid = 0;
  for (int32_t t : targets) valid += t >= 0;
  ps.zero_grads();
  // grad_scale * N = 1: the gradient of lm_loss + mtp_loss, as with one micro-batch per step.
  model.forward_backward(tokens.data(), targets.data(), 1.0f / static_cast<float>(valid));
  ASSERT_GT(model.mtp_loss(), 0.0);
  const std::vector<float> grad(ps.grads(), ps.grads() + ps.total());
  // With eod-style masking grad_scale is 1 / valid, so the MTP gradients are scaled by N / valid.
  const double mtp_weight = static_cast<double>(N) / static_cast<double>(valid);
  int checked_mtp = 0;
  testing::for_each_directional_derivative(
      ps, grad,
      [&] {
        const double lm = model.evaluate(tokens.data(), targets.data());
        return lm + mtp_weight * model.mtp_loss();
      },
      [&](const ParamSpec& p, double analytic, double numeric) {
        EXPECT_NEAR(analytic, numeric, 2e-3 * std::max(1.0, std::abs(numeric)) + 2e-4)
            << preset << " parameter " << p.name << " " << p.shape.to_string();
        if (p.name.rfind("mtp.layers.", 0) == 0) {
          ++checked_mtp;
          EXPECT_GT(std::abs(numeric), 1e-4) << p.name << " gets no gradient";
        }
      });
  EXPECT_GT(checked_mtp, 10);
}

TEST(MtpModel, Gpt2FlavourGradientsMatchFiniteDifferences) { check_mtp_gradients("gpt2"); }
TEST(MtpModel, LlamaFlavourGradientsMatchFiniteDifferences) { check_mtp_gradients("llama"); }

// Each depth adds its own parameters; the embedding and the output head stay shared.
TEST(MtpModel, DepthsDeclareTheirParametersAndShareEmbeddingAndHead) {
  const ModelConfig m = tiny_mtp("llama", 2);
  GPT with(m, 1);
  ModelConfig off = m;
  off.mtp_num_layers = 0;
  GPT without(off, 1);
  int64_t extra = 0;
  for (const ParamSpec& p : with.params().specs()) {
    if (p.name.rfind("mtp.layers.", 0) == 0) extra += p.shape.numel();
    EXPECT_EQ(p.name.find("mtp.layers.2."), std::string::npos) << p.name;
  }
  EXPECT_EQ(with.params().total(), without.params().total() + extra);
  bool proj = false;
  for (const ParamSpec& p : with.params().specs())
    if (p.name == "mtp.layers.1.eh_proj.weight") proj = p.shape.to_string() == "(16, 32)";
  EXPECT_TRUE(proj);
  EXPECT_EQ(without.mtp_loss(), 0.0);
}

TEST(MtpModel, SameBitsOnOneTwoThreeThreads) {
  const ModelConfig m = tiny_mtp("gpt2", 2);
  std::vector<uint64_t> hashes;
  std::vector<double> losses;
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    ThreadPool::Bind bind(&pool);
    GPT model(m, 2);
    model.params().init(5);
    const std::vector<int32_t> tokens = testing::random_ints(2 * m.seq_length, m.vocab_size, 9, "tokens");
    const std::vector<int32_t> targets = testing::random_ints(2 * m.seq_length, m.vocab_size, 9, "targets");
    model.params().zero_grads();
    model.forward_backward(tokens.data(), targets.data(), 0.1f);
    hashes.push_back(hash_floats(model.params().grads(), model.params().total()));
    losses.push_back(model.mtp_loss());
  }
  EXPECT_EQ(hashes[0], hashes[1]);
  EXPECT_EQ(hashes[0], hashes[2]);
  EXPECT_EQ(std::bit_cast<uint64_t>(losses[0]), std::bit_cast<uint64_t>(losses[1]));
  EXPECT_EQ(std::bit_cast<uint64_t>(losses[0]), std::bit_cast<uint64_t>(losses[2]));
}

TEST(MtpConfig, Validation) {
  auto error = [](std::vector<std::string> keys) {
    try {
      load_config("", keys);
    } catch (const UserError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error({"model.mtp_num_layers=-1"}).find("model.mtp_num_layers = -1"), std::string::npos);
  EXPECT_NE(error({"model.seq_length=8", "model.mtp_num_layers=8"}).find("model.seq_length = 8"), std::string::npos);
  EXPECT_NE(error({"model.mtp_loss_scaling_factor=-0.5"}).find("model.mtp_loss_scaling_factor"), std::string::npos);
  EXPECT_EQ(error({"model.mtp_num_layers=2"}), "no error");
}

Config mtp_job(const std::string& out_dir, std::vector<std::string> extra) {
  extra.push_back("train.out_dir=" + out_dir);
  extra.push_back("model.mtp_num_layers=1");
  extra.push_back("train.eval_interval=0");
  return load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/moe-debug.toml", extra);
}

void quiet(const Config& c) {
  std::FILE* sink = std::fopen("/dev/null", "w");
  train(c, sink);
  std::fclose(sink);
}

// MoE model + MTP, two micro-batches per step: fingerprints identical over runs and 1 vs 2
// threads; metrics.jsonl and fingerprints carry a non-zero mtp_loss.
TEST(MtpTraining, DeterministicAndLogged) {
  testing::TempDir dir;
  quiet(mtp_job(dir.path("a"), {"train.steps=3", "train.threads=1"}));
  quiet(mtp_job(dir.path("b"), {"train.steps=3", "train.threads=1"}));
  quiet(mtp_job(dir.path("c"), {"train.steps=3", "train.threads=2"}));
  const std::string fa = testing::read_file(fingerprint_path(dir.path("a"), 0));
  EXPECT_EQ(std::count(fa.begin(), fa.end(), '\n'), 3);
  EXPECT_EQ(fa, testing::read_file(fingerprint_path(dir.path("b"), 0)));
  EXPECT_EQ(fa, testing::read_file(fingerprint_path(dir.path("c"), 0)));
  EXPECT_NE(fa.find("\"mtp_loss\":\""), std::string::npos);
  EXPECT_EQ(fa.find("\"mtp_loss\":\"0000000000000000\""), std::string::npos);
  const std::string metrics = testing::read_file(dir.path("a/metrics.jsonl"));
  const size_t at = metrics.find("\"mtp_loss\":");
  ASSERT_NE(at, std::string::npos);
  // The default factor 0.1 times a loss near ln(256) at the start.
  const double mtp = std::stod(metrics.substr(at + 11));
  EXPECT_GT(mtp, 0.1 * 4.0);
  EXPECT_LT(mtp, 0.1 * 7.0);
}

}  // namespace
}  // namespace lockstep

namespace lockstep {
namespace {

// forward_backward returns the main model's LM loss, not a depth's (the MTP heads reuse the
// per-token loss buffer): it must equal what evaluate() reports on the same batch.
TEST(MtpModel, ForwardBackwardReturnsTheMainLmLoss) {
  const ModelConfig m = tiny_mtp("gpt2", 2);
  const int64_t B = 2, N = B * m.seq_length;
  GPT model(m, B);
  model.params().init(3);
  const std::vector<int32_t> tokens = testing::random_ints(N, m.vocab_size, 4, "tokens");
  const std::vector<int32_t> targets = testing::random_ints(N, m.vocab_size, 4, "targets");
  const double eval = model.evaluate(tokens.data(), targets.data());
  model.params().zero_grads();
  EXPECT_EQ(model.forward_backward(tokens.data(), targets.data(), 1.0f / static_cast<float>(N)), eval);
}

}  // namespace
}  // namespace lockstep
