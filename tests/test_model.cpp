// Whole-model checks on tiny models of each flavour: the backward pass against finite differences
// of the forward pass (one random direction per parameter tensor), the parameter table, and that
// init is a pure function of (seed, parameter name).
#include <gtest/gtest.h>

#include <cmath>

#include "lockstep/config/config.h"
#include "lockstep/core/hash.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/model/gpt.h"
#include "model_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

ModelConfig tiny(const std::string& preset) { return testing::tiny_model(preset); }

struct Batch {
  std::vector<int32_t> tokens, targets;
};

Batch make_batch(int64_t n, int64_t V, uint64_t seed) {
  return {testing::random_ints(n, V, seed, "tokens"), testing::random_ints(n, V, seed, "targets")};
}

// For each parameter tensor p and a random unit direction d inside it, compares the analytic
// directional derivative <grad p, d> with the central difference (L(p + h d) - L(p - h d)) / 2h.
void check_gradients(const std::string& preset) {
  const ModelConfig m = tiny(preset);
  const int64_t B = 2;
  GPT model(m, B);
  ParamStore& ps = model.params();
  ps.init(7);
  const Batch batch = make_batch(B * m.seq_length, m.vocab_size, 3);
  ps.zero_grads();
  model.forward_backward(batch.tokens.data(), batch.targets.data(), 1.0f / static_cast<float>(B * m.seq_length));
  const std::vector<float> grad(ps.grads(), ps.grads() + ps.total());

  testing::for_each_directional_derivative(
      ps, grad, [&] { return model.evaluate(batch.tokens.data(), batch.targets.data()); },
      [&](const ParamSpec& p, double analytic, double numeric) {
        EXPECT_NEAR(analytic, numeric, 2e-3 * std::max(1.0, std::abs(numeric)) + 2e-4)
            << preset << " parameter " << p.name << " " << p.shape.to_string();
      });
}

TEST(ModelGradients, Gpt2FlavourMatchesFiniteDifferences) { check_gradients("gpt2"); }
TEST(ModelGradients, LlamaFlavourMatchesFiniteDifferences) { check_gradients("llama"); }

TEST(ModelGradients, SameWithTwoThreads) {
  const ModelConfig m = tiny("llama");
  std::vector<uint64_t> hashes;
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    ThreadPool::Bind bind(&pool);
    GPT model(m, 2);
    model.params().init(5);
    const Batch batch = make_batch(2 * m.seq_length, m.vocab_size, 9);
    model.params().zero_grads();
    model.forward_backward(batch.tokens.data(), batch.targets.data(), 0.1f);
    hashes.push_back(hash_floats(model.params().grads(), model.params().total()));
  }
  EXPECT_EQ(hashes[0], hashes[1]);
  EXPECT_EQ(hashes[0], hashes[2]);
}

TEST(ParamTable, FlavoursDeclareTheDocumentedParameters) {
  GPT gpt2(tiny("gpt2"), 1);
  EXPECT_GE(gpt2.params().find("embedding.position.weight"), 0);
  EXPECT_GE(gpt2.params().find("layers.1.attn.qkv.bias"), 0);
  EXPECT_GE(gpt2.params().find("final_norm.bias"), 0);
  EXPECT_LT(gpt2.params().find("output.weight"), 0);  // tied
  GPT llama(tiny("llama"), 1);
  const ParamStore& ps = llama.params();
  EXPECT_LT(ps.find("embedding.position.weight"), 0);
  EXPECT_LT(ps.find("layers.0.attn.qkv.bias"), 0);
  EXPECT_GE(ps.find("output.weight"), 0);
  const ParamSpec& qkv = ps.specs()[ps.find("layers.0.attn.qkv.weight")];
  EXPECT_EQ(qkv.shape, (Shape{(4 + 2 * 2) * 4, 16}));  // (NH + 2 NKV) * HS rows
  const ParamSpec& fc = ps.specs()[ps.find("layers.0.mlp.fc.weight")];
  EXPECT_EQ(fc.shape, (Shape{2 * 64, 16}));  // [gate | up], F = 8/3 * 16 rounded up to 64
}

TEST(ParamTable, InitIsAPureFunctionOfSeedAndName) {
  ModelConfig a = tiny("gpt2");
  ModelConfig b = a;
  b.num_layers = 3;  // more parameters declared after layer 0's
  GPT ma(a, 1), mb(b, 1);
  ma.params().init(42);
  mb.params().init(42);
  const int ia = ma.params().find("layers.0.mlp.fc.weight"), ib = mb.params().find("layers.0.mlp.fc.weight");
  const int64_t n = ma.params().specs()[ia].shape.numel();
  EXPECT_TRUE(testing::bitwise_equal(ma.params().value(ia), mb.params().value(ib), n, "fc.weight"));
  GPT mc(a, 1);
  mc.params().init(43);
  EXPECT_NE(hash_floats(mc.params().value(ia), n), hash_floats(ma.params().value(ia), n));
}

}  // namespace
}  // namespace lockstep
