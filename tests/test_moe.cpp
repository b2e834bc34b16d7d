// Mixture of experts: every load-balancing loss against finite differences and hand-computed values;
// permute / combine / grouped GEMM against references and finite differences; the expert bias; one
// expert = the dense MLP; the whole MoE model's gradient; bitwise determinism of MoE training. The
// router's ops themselves (routing, capacity dropping) are tested in the op harness
// (tests/ops/router.cpp).
#include <gtest/gtest.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <sstream>

#include "lockstep/comm/communicator.h"
#include "lockstep/comm/threads/thread_transport.h"
#include "lockstep/config/config.h"
#include "lockstep/core/error.h"
#include "lockstep/core/hash.h"
#include "lockstep/core/tree_sum.h"
#include "lockstep/kernels/device.h"
#include "lockstep/model/gpt.h"
#include "lockstep/model/moe/dispatcher.h"
#include "lockstep/model/moe/experts.h"
#include "lockstep/model/moe/router.h"
#include "lockstep/train/fingerprint.h"
#include "lockstep/train/optimizer.h"
#include "lockstep/train/trainer.h"
#include "model_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

// The CPU backend's ops (the router's loss functions run through them).
const Ops& cpu_ops() {
  static const std::unique_ptr<Device> cpu = Device::cpu();
  return cpu->ops;
}

using testing::quiet_train;
using testing::randn;

RouterSpec spec_of(std::vector<std::string> overrides) {
  bool has_e = false;
  for (const auto& o : overrides) has_e |= o.rfind("moe.num_experts=", 0) == 0;
  if (!has_e) overrides.push_back("moe.num_experts=8");
  return RouterSpec(load_config("", overrides).moe);
}

// The dispatchers' closed form of a token's canonical segment is canonical_segments' cut.
TEST(MoeDispatch, TokenSegmentIsTheCanonicalSegment) {
  for (int64_t N : {1, 2, 7, 8, 64, 1000, 1024})
    for (int64_t L : {1, 2, 4, 8, 16, 64}) {
      const std::vector<int64_t> b = canonical_segments(N, L);
      for (int64_t l = 0; l < L; ++l)
        for (int64_t t = b[l]; t < b[l + 1]; ++t) ASSERT_EQ(token_segment(t, N, L), l) << N << " " << L << " " << t;
    }
}

TEST(MoeAuxLoss, HandComputedValues) {
  // Two sequences of one token, E = 2, K = 1: softmax rows (0.75, 0.25) and (0.25, 0.75).
  const float l3 = static_cast<float>(std::log(3.0));
  const std::vector<float> logits = {l3, 0.0f, 0.0f, l3};
  std::vector<int64_t> counts;
  float global[2];
  auto losses = [&](const std::string& type, const int64_t* prev, int64_t prev_micro, const char* score = "softmax") {
    const RouterSpec s =
        spec_of({"moe.num_experts=2", "moe.router_topk=1", "moe.aux_loss_coeff=0.1", "moe.z_loss_coeff=0.01",
                 "moe.router_load_balancing_type=" + type, std::string("moe.router_score_function=") + score});
    return aux_losses_forward(cpu_ops(), logits.data(), s, 2, 1, prev, prev_micro, global, counts);
  };
  // switch: 0.1 * E / (K N^2) * sum_e T_e P_e = 0.1 * 2/4 * (1 * 1.0 + 1 * 1.0) = 0.1.
  AuxLosses a = losses("aux_loss", nullptr, 0);
  EXPECT_NEAR(a.aux, 0.1, 1e-7);
  // z-loss: 0.01 * mean(lse^2), lse = ln 4 for both tokens.
  EXPECT_NEAR(a.z, 0.01 * std::log(4.0) * std::log(4.0), 1e-7);
  EXPECT_EQ(counts, (std::vector<int64_t>{1, 0, 0, 1}));
  // seq: per sequence E/(K T^2) * 1 * 0.75 = 1.5; mean over 2 sequences; * 0.1.
  a = losses("seq_aux_loss", nullptr, 0);
  EXPECT_NEAR(a.seq_aux, 0.15, 1e-7);
  EXPECT_EQ(a.aux, 0.0);
  // global: earlier micro-batch counts (3, 1) -> running mean ((3+1)/2, (1+1)/2) = (2, 1);
  // 0.1 * 2/4 * (2 * 1.0 + 1 * 1.0) = 0.15.
  const int64_t prev[2] = {3, 1};
  a = losses("global_aux_loss", prev, 1);
  EXPECT_NEAR(a.global_aux, 0.15, 1e-7);
  EXPECT_FLOAT_EQ(global[0], 2.0f);
  // Combined types add up.
  a = losses("aux_loss,seq_aux_loss", nullptr, 0);
  EXPECT_NEAR(a.total(), 0.1 + 0.15 + 0.01 * std::log(4.0) * std::log(4.0), 1e-7);
  // sigmoid: aux scores are sigmoid(z) normalised. Token 0 (ln 3, 0): a = (0.75, 0.5) / 1.25;
  // token 1 (0, 0): a = (0.5, 0.5), its top-1 tie goes to expert 0. T = (2, 0),
  // P_0 = 0.6 + 0.5: aux = 0.1 * 2/4 * 2 * 1.1 = 0.11.
  {
    const std::vector<float> z = {l3, 0.0f, 0.0f, 0.0f};
    const RouterSpec s = spec_of(
        {"moe.num_experts=2", "moe.router_topk=1", "moe.aux_loss_coeff=0.1", "moe.router_score_function=sigmoid"});
    EXPECT_NEAR(aux_losses_forward(cpu_ops(), z.data(), s, 2, 1, nullptr, 0, global, counts).aux, 0.11, 1e-7);
    EXPECT_EQ(counts, (std::vector<int64_t>{1, 0, 1, 0}));
  }
}

void check_aux_gradient(const std::vector<std::string>& options) {
  SCOPED_TRACE(::testing::PrintToString(options));
  const RouterSpec s = spec_of(options);
  const int64_t B = 2, T = 3, N = B * T;
  std::vector<float> logits = randn(N * s.E, 4, "logits");
  const int64_t prev[8] = {3, 1, 0, 2, 5, 1, 1, 0};
  std::vector<int64_t> counts;
  std::vector<float> global(static_cast<size_t>(s.E));
  aux_losses_forward(cpu_ops(), logits.data(), s, B, T, prev, 2, global.data(), counts);
  std::vector<float> dlogits(logits.size(), 0.0f);
  aux_losses_backward(cpu_ops(), dlogits.data(), logits.data(), s, B, T, global.data(), counts, 1.0f);
  const double h = 1e-3;
  for (size_t i = 0; i < logits.size(); ++i) {
    const float x = logits[i];
    std::vector<int64_t> c;
    std::vector<float> g(global.size());
    logits[i] = static_cast<float>(x + h);
    const double fp = aux_losses_forward(cpu_ops(), logits.data(), s, B, T, prev, 2, g.data(), c).total();
    ASSERT_EQ(c, counts) << "routing map changed under the finite-difference step";
    logits[i] = static_cast<float>(x - h);
    const double fm = aux_losses_forward(cpu_ops(), logits.data(), s, B, T, prev, 2, g.data(), c).total();
    logits[i] = x;
    EXPECT_NEAR(dlogits[i], (fp - fm) / (2 * h), 2e-4 * std::max(1.0, std::abs(static_cast<double>(dlogits[i]))))
        << "logit " << i;
  }
}

TEST(MoeAuxLoss, GradientsMatchFiniteDifferences) {
  for (const char* type : {"aux_loss", "seq_aux_loss", "global_aux_loss", "aux_loss,seq_aux_loss,global_aux_loss"})
    for (const char* score : {"softmax", "sigmoid"})
      check_aux_gradient({"moe.router_topk=2", "moe.aux_loss_coeff=0.5",
                          std::string("moe.router_load_balancing_type=") + type,
                          std::string("moe.router_score_function=") + score});
  check_aux_gradient({"moe.router_topk=2", "moe.z_loss_coeff=0.3", "moe.router_load_balancing_type=none"});
}

// The global aux loss under data parallelism (Megatron's): each micro-batch's counts are summed
// over the replicas, the token count is replicas x N, and each replica's term has its own
// probability sums. So the replicas' terms add up to the single-process loss of their joint batch
// (and its gradient rows are the joint batch's), which is what these tests check; the per-step
// running mean, however, mixes different micro-batches under different data-parallel sizes (DP 2
// with one micro-batch each is one joint micro-batch, not one process's two): docs/moe.md.
TEST(MoeAuxLoss, GlobalOverReplicasHandComputed) {
  // The HandComputedValues batch (E = 2, K = 1, 2 tokens, P = (1, 1), counts (1, 1)) on one of two
  // replicas; the other routes both its tokens to expert 0, and the step's earlier micro-batch
  // counted (4, 0) over both. Joint counts (3, 1), running mean ((4 + 3) / 2, (0 + 1) / 2) =
  // (3.5, 0.5), 4 tokens: 0.1 * E / (K 4^2) * (1.0 * 3.5 + 1.0 * 0.5) = 0.05.
  const float l3 = static_cast<float>(std::log(3.0));
  const std::vector<float> logits = {l3, 0.0f, 0.0f, l3};
  RouterSpec s = spec_of({"moe.num_experts=2", "moe.router_topk=1", "moe.aux_loss_coeff=0.1",
                          "moe.router_load_balancing_type=global_aux_loss"});
  s.global_replicas = 2;
  const int64_t prev[2] = {4, 0};
  std::vector<int64_t> counts;
  float global[2];
  int64_t micro[2];
  auto other_replica = [](int64_t* c, int64_t n) {
    ASSERT_EQ(n, 2);
    c[0] += 2;
  };
  const AuxLosses a =
      aux_losses_forward(cpu_ops(), logits.data(), s, 2, 1, prev, 1, global, counts, micro, other_replica);
  EXPECT_NEAR(a.global_aux, 0.05, 1e-7);
  EXPECT_EQ(global[0], 3.5f);
  EXPECT_EQ(global[1], 0.5f);
  EXPECT_EQ(micro[0], 3);
  EXPECT_EQ(micro[1], 1);
  EXPECT_EQ(counts, (std::vector<int64_t>{1, 0, 0, 1}));  // the sequences' own counts stay local
}

TEST(MoeAuxLoss, GlobalReplicasAddUpToTheJointBatch) {
  for (const char* score : {"softmax", "sigmoid"}) {
    SCOPED_TRACE(score);
    RouterSpec joint =
        spec_of({"moe.num_experts=4", "moe.router_topk=2", "moe.aux_loss_coeff=0.5",
                 "moe.router_load_balancing_type=global_aux_loss", std::string("moe.router_score_function=") + score});
    const int64_t B = 2, T = 3, N = B * T, E = joint.E, R = 2;
    const std::vector<float> all = randn(R * N * E, 11, "logits");  // replica r: rows [r N, (r + 1) N)
    const int64_t prev[4] = {7, 3, 9, 5};                           // an earlier micro-batch, both replicas
    std::vector<int64_t> joint_counts;
    std::vector<float> joint_global(static_cast<size_t>(E));
    const double joint_loss =
        aux_losses_forward(cpu_ops(), all.data(), joint, R * B, T, prev, 1, joint_global.data(), joint_counts)
            .global_aux;
    std::vector<float> joint_grad(all.size(), 0.0f);
    aux_losses_backward(cpu_ops(), joint_grad.data(), all.data(), joint, R * B, T, joint_global.data(), joint_counts,
                        0.5f);
    RouterSpec s = joint;
    s.global_replicas = R;
    std::vector<double> loss(R);
    std::vector<std::vector<float>> global(R), grad(R);
    run_threads(static_cast<int>(R), 30, [&](Communicator& comm) {
      const int r = comm.rank();
      const float* mine = all.data() + r * N * E;
      std::vector<int64_t> counts;
      std::vector<float> g(static_cast<size_t>(E));
      loss[r] =
          aux_losses_forward(cpu_ops(), mine, s, B, T, prev, 1, g.data(), counts, nullptr, [&](int64_t* c, int64_t n) {
            comm.all_reduce(c, n);
          }).global_aux;
      std::vector<float> d(static_cast<size_t>(N * E), 0.0f);
      aux_losses_backward(cpu_ops(), d.data(), mine, s, B, T, g.data(), counts, 0.5f);
      global[r] = g;
      grad[r] = d;
    });
    for (int64_t r = 0; r < R; ++r) {
      EXPECT_EQ(global[r], joint_global) << "replica " << r << " balances against the joint counts";
      EXPECT_TRUE(testing::bitwise_equal(grad[r].data(), joint_grad.data() + r * N * E, N * E)) << "replica " << r;
    }
    EXPECT_NEAR(loss[0] + loss[1], joint_loss, 1e-12 * joint_loss);
  }
}

// A hand-built routing: E = 3, K = 2, N = 4.
struct Routing {
  int64_t N = 4, K = 2, E = 3;
  std::vector<int32_t> idx = {0, 1, 0, 2, 1, 2, 0, 1};
  std::vector<float> probs = {0.6f, 0.4f, 0.3f, 0.7f, 0.5f, 0.5f, 0.9f, 0.1f};
};

TEST(MoeDispatch, RowsAreGroupedByExpertInTokenOrderWithPadding) {
  const Routing r;
  const std::vector<uint8_t> kept = {1, 1, 0, 1, 1, 1, 1, 0};
  const std::unique_ptr<Device> cpu = Device::cpu();
  LocalDispatcher d(cpu->ops, r.E, r.K, /*C=*/2, r.N, /*capacity=*/3, /*pad=*/true);
  d.plan(r.idx.data(), kept.data(), r.N);
  EXPECT_EQ(d.rows(), 9);
  EXPECT_EQ(d.tokens_per_expert(), (std::vector<int64_t>{2, 2, 2}));
  // Expert 0: tokens 0, 3 then padding; expert 1: tokens 0, 2; expert 2: tokens 1, 2.
  EXPECT_EQ(d.slots(), (std::vector<int32_t>{0, 3, -1, 6, 4, 7, 1, -1}));
  const std::vector<float> x = {1, 2, 3, 4, 5, 6, 7, 8};  // (4, 2)
  std::vector<float> rows(18, -1.0f);
  d.dispatch(rows.data(), x.data());
  EXPECT_EQ(rows, (std::vector<float>{1, 2, 7, 8, 0, 0, 1, 2, 5, 6, 0, 0, 3, 4, 5, 6, 0, 0}));
}

// The permute and combine ops of a dispatch layout, and the grouped GEMMs of the experts, on every
// backend: the op harness (tests/ops/permute.cpp, tests/ops/gemm.cpp).

// Tiny models for whole-model checks: vocabulary and sizes below what load_config allows.
struct TinyMoe {
  ModelConfig m;
  MoeConfig moe;
};

TinyMoe tiny_moe(const std::string& preset, std::vector<std::string> moe_keys) {
  moe_keys.push_back("model.preset=" + preset);
  moe_keys.push_back("model.num_layers=2");
  const Config c = load_config("", moe_keys);
  TinyMoe t{c.model, c.moe};
  t.m.hidden_size = 16;
  t.m.num_heads = 4;
  t.m.num_query_groups = preset == "llama" ? 2 : 0;
  t.m.seq_length = 7;
  t.m.vocab_size = 23;
  t.m.init_std = 0.2;
  return t;
}

std::vector<std::vector<int32_t>> routing_of(const GPT& g) {
  std::vector<std::vector<int32_t>> out;
  for (const auto& l : g.moe_layers())
    if (l) out.emplace_back(l->topk_idx(), l->topk_idx() + l->dispatcher().slots().size());
  return out;
}

void check_model_gradients(const TinyMoe& t) {
  const int64_t B = 2, N = B * t.m.seq_length;
  GPT model(t.m, B, t.moe);
  ParamStore& ps = model.params();
  ps.init(7);
  const std::vector<int32_t> tokens = testing::random_ints(N, t.m.vocab_size, 3, "tokens");
  const std::vector<int32_t> targets = testing::random_ints(N, t.m.vocab_size, 3, "targets");
  ps.zero_grads();
  model.begin_step(1, 1);
  model.forward_backward(tokens.data(), targets.data(), 1.0f / static_cast<float>(N));
  EXPECT_GT(model.aux_loss(), 0.0);
  const std::vector<float> grad(ps.grads(), ps.grads() + ps.total());
  model.begin_step(1, 1);
  model.evaluate(tokens.data(), targets.data());
  const auto routing = routing_of(model);
  for (const ParamSpec& p : ps.specs()) {
    const int64_t n = p.shape.numel();
    std::vector<float> d = randn(n, 11, "direction/" + p.name);
    double norm = 0;
    for (float x : d) norm += static_cast<double>(x) * x;
    double analytic = 0;
    for (int64_t i = 0; i < n; ++i) analytic += static_cast<double>(grad[p.offset + i]) * d[i] / std::sqrt(norm);
    float* v = ps.values() + p.offset;
    const std::vector<float> saved(v, v + n);
    // Small enough that no token's expert choice flips (checked below), large enough for fp32.
    const double h = 1e-3;
    auto loss_at = [&](double s) {
      for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(saved[i] + s * d[i] / std::sqrt(norm));
      model.begin_step(1, 1);
      const double lm = model.evaluate(tokens.data(), targets.data());
      EXPECT_EQ(routing_of(model), routing) << p.name << ": routing changed under the finite-difference step";
      return lm + model.aux_loss() + model.mtp_loss();
    };
    const double numeric = (loss_at(h) - loss_at(-h)) / (2 * h);
    std::copy(saved.begin(), saved.end(), v);
    EXPECT_NEAR(analytic, numeric, 2e-3 * std::max(1.0, std::abs(numeric)) + 2e-4)
        << p.name << " " << p.shape.to_string();
  }
}

TEST(MoeModel, GradientsMatchFiniteDifferences) {
  // gpt2 flavour, softmax top-2, every aux loss and the z-loss, position capacity with padding.
  check_model_gradients(tiny_moe(
      "gpt2",
      {"moe.num_experts=4", "moe.router_topk=2", "moe.aux_loss_coeff=0.1", "moe.z_loss_coeff=0.01",
       "moe.ffn_hidden_size=24", "moe.router_load_balancing_type=aux_loss,seq_aux_loss,global_aux_loss",
       "moe.expert_capacity_factor=1.0", "moe.token_drop_policy=position", "moe.pad_expert_input_to_capacity=true"}));
  // llama flavour, DeepSeek style: sigmoid, groups, scaling, bias, seq aux, gated shared expert,
  // dense first layer.
  check_model_gradients(tiny_moe(
      "llama",
      {"moe.num_experts=8", "moe.router_topk=4", "moe.router_score_function=sigmoid", "moe.router_num_groups=4",
       "moe.router_group_topk=2", "moe.router_topk_scaling_factor=2.5", "moe.router_enable_expert_bias=true",
       "moe.router_load_balancing_type=seq_aux_loss", "moe.aux_loss_coeff=0.1", "moe.ffn_hidden_size=16",
       "moe.shared_expert_intermediate_size=24", "moe.shared_expert_gate=true", "moe.layer_freq=[0,1]"}));
}

// A multi-token prediction depth after an MoE last layer is MoE too (model/mtp.h), as DeepSeek-V3's:
// its router, experts and shared expert get their gradients (and its aux loss its share) through
// the depth's loss; after a dense last layer the depth keeps the MLP.
TEST(MoeModel, MtpDepthAfterAnMoeLayerIsMoe) {
  const std::vector<std::string> keys = {"moe.num_experts=4",
                                         "moe.router_topk=2",
                                         "moe.router_score_function=sigmoid",
                                         "moe.router_topk_scaling_factor=2.5",
                                         "moe.router_enable_expert_bias=true",
                                         "moe.router_load_balancing_type=seq_aux_loss",
                                         "moe.aux_loss_coeff=0.1",
                                         "moe.ffn_hidden_size=16",
                                         "moe.shared_expert_intermediate_size=24",
                                         "moe.layer_freq=[0,1]",
                                         "model.mtp_num_layers=1"};
  TinyMoe t = tiny_moe("llama", keys);
  t.m.mtp_loss_scaling_factor = 0.7;
  {
    GPT model(t.m, 1, t.moe);
    ASSERT_EQ(model.moe_layers().size(), 3u);  // layers 0 (dense), 1, then the depth's
    EXPECT_EQ(model.moe_layers()[0], nullptr);
    EXPECT_NE(model.moe_layers()[2], nullptr);
    int depth_moe = 0;
    for (const ParamSpec& p : model.params().specs()) {
      depth_moe += p.name.rfind("mtp.layers.0.moe.", 0) == 0;
      EXPECT_EQ(p.name.rfind("mtp.layers.0.mlp.", 0), std::string::npos) << p.name;
    }
    EXPECT_GE(depth_moe, 4);  // router, experts' fc and proj, shared expert
    std::vector<StateShard> shards;
    model.state_shards(shards, true, true);
    bool bias = false;
    for (const StateShard& sh : shards) bias = bias || sh.name == "buffer/mtp.layers.0.moe.router.expert_bias";
    EXPECT_TRUE(bias);
  }
  check_model_gradients(t);
  TinyMoe dense_last =
      tiny_moe("llama", {"moe.num_experts=4", "moe.router_topk=2", "moe.layer_freq=[1,0]", "model.mtp_num_layers=1"});
  GPT model(dense_last.m, 1, dense_last.moe);
  EXPECT_EQ(model.moe_layers().size(), 2u);
  bool mlp = false;
  for (const ParamSpec& p : model.params().specs()) mlp = mlp || p.name == "mtp.layers.0.mlp.fc.weight";
  EXPECT_TRUE(mlp);
}

TEST(MoeModel, OneExpertTopOneEqualsTheDenseMlp) {
  for (const char* preset : {"gpt2", "llama"}) {
    SCOPED_TRACE(preset);
    const TinyMoe t = tiny_moe(preset, {"moe.num_experts=1", "moe.router_topk=1"});
    const int64_t B = 2, N = B * t.m.seq_length;
    GPT dense(t.m, B), moe(t.m, B, t.moe);
    dense.params().init(5);
    moe.params().init(5);
    // Copy the dense MLP weights into the single expert (same shapes with a leading 1).
    for (const ParamSpec& p : dense.params().specs()) {
      std::string name = p.name;
      const size_t at = name.find(".mlp.");
      if (at != std::string::npos && name.find("mlp_norm") == std::string::npos)
        name = name.substr(0, at) + ".moe.experts." + name.substr(at + 5);
      const int j = moe.params().find(name);
      ASSERT_GE(j, 0) << name;
      std::copy(dense.params().value(static_cast<int>(&p - dense.params().specs().data())),
                dense.params().value(static_cast<int>(&p - dense.params().specs().data())) + p.shape.numel(),
                moe.params().value(j));
    }
    const std::vector<int32_t> tokens = testing::random_ints(N, t.m.vocab_size, 3, "tokens");
    const std::vector<int32_t> targets = testing::random_ints(N, t.m.vocab_size, 3, "targets");
    dense.params().zero_grads();
    moe.params().zero_grads();
    const double ld = dense.forward_backward(tokens.data(), targets.data(), 1.0f / N);
    const double lm = moe.forward_backward(tokens.data(), targets.data(), 1.0f / N);
    EXPECT_NEAR(ld, lm, 1e-6);
    for (const ParamSpec& p : dense.params().specs()) {
      std::string name = p.name;
      const size_t at = name.find(".mlp.");
      if (at != std::string::npos && name.find("mlp_norm") == std::string::npos)
        name = name.substr(0, at) + ".moe.experts." + name.substr(at + 5);
      const int j = moe.params().find(name);
      const float* gd = dense.params().grad(static_cast<int>(&p - dense.params().specs().data()));
      std::vector<double> ref(gd, gd + p.shape.numel());
      EXPECT_TRUE(testing::all_close(moe.params().grad(j), ref.data(), p.shape.numel(), 1e-4, 1e-6, name));
    }
    // The router of a single expert gets no gradient: its weight is softmax over one logit = 1.
    const int r = moe.params().find("layers.0.moe.router.weight");
    for (int64_t i = 0; i < moe.params().specs()[r].shape.numel(); ++i) EXPECT_EQ(moe.params().grad(r)[i], 0.0f);
  }
}

TEST(MoeModel, ExpertBiasMovesTowardsTheMeanLoad) {
  const TinyMoe t = tiny_moe("llama", {"moe.num_experts=4", "moe.router_topk=1", "moe.router_score_function=sigmoid",
                                       "moe.router_enable_expert_bias=true", "moe.router_bias_update_rate=0.25"});
  const int64_t B = 2, N = B * t.m.seq_length;
  GPT model(t.m, B, t.moe);
  model.params().init(5);
  const std::vector<int32_t> tokens = testing::random_ints(N, t.m.vocab_size, 3, "tokens");
  model.begin_step(1, 1);
  model.forward_backward(tokens.data(), tokens.data(), 1.0f / N);
  const std::vector<int64_t> counts = model.moe_layers()[0]->dispatcher().tokens_per_expert();
  const uint64_t params = hash_floats(model.params().values(), model.params().total());
  const uint64_t state = model.state_hash();
  const std::vector<MoeTokenStats> stats = model.finish_step(0.25);
  ASSERT_EQ(stats.size(), 2u);
  const double mean = static_cast<double>(N) / 4;
  EXPECT_EQ(stats[0].max, *std::max_element(counts.begin(), counts.end()));
  EXPECT_DOUBLE_EQ(stats[0].imbalance, static_cast<double>(stats[0].max) / mean);
  for (int e = 0; e < 4; ++e) {
    const float expect = counts[e] < mean ? 0.25f : counts[e] > mean ? -0.25f : 0.0f;
    EXPECT_EQ(model.moe_layers()[0]->expert_bias()[e], expect) << e;
  }
  EXPECT_EQ(hash_floats(model.params().values(), model.params().total()), params);  // weights untouched
  EXPECT_NE(model.state_hash(), state);  // the bias is part of the fingerprinted state
}

// The fingerprint's state hashes by their definition (model/gpt.h): BlockHasher over each
// parameter in table order then the expert biases; the dense part (dense parameters, then the
// biases) and the expert part (expert parameters) that the replica checks compare; the same from
// the block hashes AdamW takes in the update (ShardHashes with the table) as from a pass of their own.
TEST(MoeModel, StateHashesFollowTheirDefinition) {
  const TinyMoe t = tiny_moe("llama", {"moe.num_experts=4", "moe.router_topk=2", "moe.router_score_function=sigmoid",
                                       "moe.router_enable_expert_bias=true", "moe.router_bias_update_rate=0.25"});
  const int64_t B = 2, N = B * t.m.seq_length;
  GPT model(t.m, B, t.moe);
  ParamStore& ps = model.params();
  ps.init(5);
  const std::vector<int32_t> tokens = testing::random_ints(N, t.m.vocab_size, 3, "tokens");
  model.begin_step(1, 1);
  model.forward_backward(tokens.data(), tokens.data(), 1.0f / N);
  Optimizer opt(ps, OptimizerConfig{});
  std::vector<ParamRange> all;
  for (int i = 0; i < static_cast<int>(ps.specs().size()); ++i) all.push_back({i, 0, ps.specs()[i].shape.numel()});
  ShardHashes in_update(all, &ps);
  opt.update(ps, 1, 1e-2, 1.0f, opt.owned(), &in_update);
  model.finish_step(0.25);             // expert biases off zero
  auto reference = [&](int experts) {  // -1: everything; 0 / 1: the dense / expert part
    BlockHasher h;
    for (size_t i = 0; i < ps.specs().size(); ++i)
      if (experts < 0 || ps.specs()[i].expert == (experts == 1))
        h.update(ps.value(static_cast<int>(i)), static_cast<size_t>(ps.specs()[i].shape.numel()) * sizeof(float));
    if (experts != 1)
      for (const auto& layer : model.moe_layers())
        if (layer) h.update(layer->expert_bias().data(), layer->expert_bias().size() * sizeof(float));
    return h.digest();
  };
  ASSERT_NE(reference(0), reference(1));
  const std::vector<uint64_t> pass = model.param_block_hashes();
  EXPECT_EQ(in_update.params(), pass);
  EXPECT_EQ(model.state_hash(), reference(-1));
  EXPECT_EQ(model.state_hash(in_update.params()), reference(-1));
  EXPECT_EQ(model.state_hash(pass, /*experts=*/false), reference(0));
  EXPECT_EQ(model.state_hash(pass, /*experts=*/true), reference(1));
  EXPECT_THROW(model.state_hash(std::vector<uint64_t>(pass.begin(), pass.end() - 2)), InternalError);
}

TEST(MoeConfig, LayerFreqAndValidation) {
  auto moe = [](std::vector<std::string> k) { return load_config("", k).moe; };
  const MoeConfig a = moe({"moe.num_experts=4", "model.num_layers=4", "moe.layer_freq=2"});
  EXPECT_TRUE(a.is_moe_layer(0, 4));
  EXPECT_FALSE(a.is_moe_layer(1, 4));
  EXPECT_TRUE(a.is_moe_layer(2, 4));
  const MoeConfig b = moe({"moe.num_experts=4", "model.num_layers=4", "moe.layer_freq=([0]*1+[1]*3)"});
  EXPECT_FALSE(b.is_moe_layer(0, 4));
  EXPECT_TRUE(b.is_moe_layer(3, 4));
  auto error = [](std::vector<std::string> k) {
    try {
      load_config("", k);
    } catch (const UserError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error({"moe.num_experts=4", "model.num_layers=4", "moe.layer_freq=[0,1]"}).find("has 2 entries"),
            std::string::npos);
  EXPECT_NE(error({"moe.num_experts=4", "moe.router_topk=5"}).find("moe.router_topk = 5"), std::string::npos);
  EXPECT_EQ(error({"moe.num_experts=1025"}),
            "config: moe.num_experts = 1025: must be at most 1024 (the router's per-token top-k limit)");
  EXPECT_NE(error({"moe.num_experts=6", "moe.router_num_groups=4", "moe.router_group_topk=1"}).find("not divisible"),
            std::string::npos);
  EXPECT_NE(error({"moe.num_experts=4", "moe.router_enable_expert_bias=true"}).find("sigmoid"), std::string::npos);
  EXPECT_NE(error({"moe.num_experts=4", "moe.router_load_balancing_type=sinkhorn"}).find("sinkhorn"),
            std::string::npos);
  EXPECT_NE(error({"moe.num_experts=4", "moe.pad_expert_input_to_capacity=true"}).find("expert_capacity_factor"),
            std::string::npos);
}

// MoE training: bitwise determinism on fingerprints, and what the run directory records.
Config moe_job(const std::string& out_dir, std::vector<std::string> extra = {}) {
  extra.push_back("train.out_dir=" + out_dir);
  return load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/moe-debug.toml", extra);
}

TEST(MoeTraining, DeterministicAcrossRunsAndThreads) {
  // Every routing feature at once, with jitter and two accumulated micro-batches.
  const std::vector<std::string> keys = {"train.steps=3",
                                         "model.preset=llama",
                                         "model.num_query_groups=2",
                                         "moe.num_experts=8",
                                         "moe.router_topk=4",
                                         "moe.router_score_function=sigmoid",
                                         "moe.router_num_groups=4",
                                         "moe.router_group_topk=2",
                                         "moe.router_enable_expert_bias=true",
                                         "moe.router_load_balancing_type=seq_aux_loss,global_aux_loss",
                                         "moe.shared_expert_intermediate_size=32",
                                         "moe.shared_expert_gate=true",
                                         "moe.input_jitter_eps=0.01",
                                         "moe.expert_capacity_factor=1.5",
                                         "moe.layer_freq=[0,1]",
                                         "train.eval_interval=0"};
  testing::TempDir dir;
  auto with = [&](const char* threads) {
    std::vector<std::string> k = keys;
    k.push_back(std::string("train.threads=") + threads);
    return k;
  };
  quiet_train(moe_job(dir.path("a"), with("1")));
  quiet_train(moe_job(dir.path("b"), with("1")));
  quiet_train(moe_job(dir.path("c"), with("2")));
  const std::string a = testing::read_file(fingerprint_path(dir.path("a"), 0));
  EXPECT_EQ(std::count(a.begin(), a.end(), '\n'), 3);
  EXPECT_EQ(a, testing::read_file(fingerprint_path(dir.path("b"), 0)));
  EXPECT_EQ(a, testing::read_file(fingerprint_path(dir.path("c"), 0)));
}

TEST(MoeTraining, GlobalAuxLossCountsAreTheSameOnEveryDataParallelRank) {
  // Two data-parallel ranks, two micro-batches each: after every forward both ranks balance against
  // the same running mean of the joint counts, which sums to replicas x N x K (each token counts K
  // times in the aux routing map); a rank's own counts would sum to N x K.
  const Config c = moe_job("unused", {"moe.router_load_balancing_type=global_aux_loss"});
  const int64_t B = 2, N = B * c.model.seq_length, K = c.moe.router_topk;
  run_threads(2, 60, [&](Communicator& comm) {
    GPT model(c.model, B, c.moe);
    model.params().init(7);
    for (const auto& layer : model.moe_layers())
      if (layer) layer->set_data_parallel(&comm);
    model.begin_step(1, 1, 2 * comm.rank());
    for (int micro = 0; micro < 2; ++micro) {
      const uint64_t seed = static_cast<uint64_t>(2 * comm.rank() + micro);
      const std::vector<int32_t> tokens = testing::random_ints(N, c.model.vocab_size, seed, "tokens");
      const std::vector<int32_t> targets = testing::random_ints(N, c.model.vocab_size, seed, "targets");
      model.forward_backward(tokens.data(), targets.data(), 1.0f / static_cast<float>(2 * 2 * N));
      for (const auto& layer : model.moe_layers()) {
        if (!layer) continue;
        const std::vector<float>& g = layer->global_counts();
        const uint64_t h = hash_floats(g.data(), static_cast<int64_t>(g.size()));
        uint64_t agree[2] = {h, ~h};
        comm.all_reduce(agree, 2, ReduceOp::max);
        EXPECT_TRUE(agree[0] == h && agree[1] == ~h) << "rank " << comm.rank() << " micro " << micro;
        EXPECT_EQ(std::accumulate(g.begin(), g.end(), 0.0), static_cast<double>(2 * N * K));
      }
    }
  });
}

// (aux_loss, loss, grad_norm) of every step, exact, from rank 0's fingerprints.
std::vector<std::array<double, 3>> aux_trajectory(const std::string& run_dir) {
  std::vector<std::array<double, 3>> out;
  std::istringstream in(testing::read_file(fingerprint_path(run_dir, 0)));
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    std::array<double, 3> v{};
    int i = 0;
    for (const char* k : {"aux_loss", "loss", "grad_norm"})
      v[i++] = std::bit_cast<double>(std::stoull(j[k].get<std::string>(), nullptr, 16));
    out.push_back(v);
  }
  return out;
}

TEST(MoeTraining, GlobalAuxLossUnderDataParallelismIsTheJointBatchs) {
  // One micro-batch per rank: Megatron's global aux loss over R data-parallel ranks is the switch
  // loss of their joint batch / R, with the gradient of that (docs/moe.md). So R = 2 ranks of
  // micro-batch 2 with aux_loss_coeff 2c train what one process of micro-batch 4 (the same
  // samples) trains with c, within the rounding of the gradient sums (1e-8 relative with no
  // balancing loss at all); at step 1 (same parameters, batch-invariant GEMMs) the aux loss
  // differs only by its double sums' association, and under tensor parallelism by the rounding of
  // the row-parallel sums before the router. Under expert parallelism the ep ranks are those
  // data-parallel ranks; under tensor parallelism every tp rank counts the whole micro-batch.
  testing::TempDir dir;
  const std::vector<std::string> base = {
      "train.steps=3",        "train.eval_interval=0",      "train.threads=1",
      "train.global_batch=4", "data.synthetic_bytes=65536", "moe.router_load_balancing_type=global_aux_loss"};
  auto job = [&](const std::string& name, std::vector<std::string> extra) {
    extra.insert(extra.end(), base.begin(), base.end());
    return moe_job(dir.path(name), extra);
  };
  quiet_train(job("one", {"train.micro_batch=4", "moe.aux_loss_coeff=0.01"}));
  const auto one = aux_trajectory(dir.path("one"));
  ASSERT_EQ(one.size(), 3u);
  const struct {
    const char* name;
    int ranks;
    std::vector<std::string> keys;
    double step1_aux;  // tolerance
  } layouts[] = {{"dp2", 2, {}, 1e-12},
                 {"ep2", 2, {"parallel.expert=2", "moe.token_dispatcher=alltoall"}, 1e-12},
                 {"tp2sp_dp2", 4, {"parallel.tensor=2", "parallel.sequence_parallel=true"}, 1e-7}};
  for (const auto& l : layouts) {
    std::vector<std::string> keys = l.keys;
    keys.insert(keys.end(), {"train.micro_batch=2", "moe.aux_loss_coeff=0.02"});
    testing::train_ranks(l.ranks, job(l.name, keys));
    const auto dp = aux_trajectory(dir.path(l.name));
    ASSERT_EQ(dp.size(), one.size()) << l.name;
    const double aux1 = std::fabs(dp[0][0] - one[0][0]) / one[0][0];
    double worst = 0;
    for (size_t s = 0; s < one.size(); ++s)
      for (int k : {1, 2}) worst = std::max(worst, std::fabs(dp[s][k] - one[s][k]) / std::fabs(one[s][k]));
    std::printf("[ global aux ] %s vs one process: step-1 aux loss %.2e, loss / grad norm %.2e (relative)\n", l.name,
                aux1, worst);
    EXPECT_LT(aux1, l.step1_aux) << l.name;
    EXPECT_LT(worst, 1e-6) << l.name;
  }
}

TEST(MoeTraining, MetricsAndFingerprintsCarryTheAuxLoss) {
  testing::TempDir dir;
  const TrainSummary s = quiet_train(moe_job(dir.path("run"), {"train.steps=2", "train.eval_interval=0"}));
  EXPECT_EQ(s.steps, 2);
  const std::string metrics = testing::read_file(dir.path("run/metrics.jsonl"));
  for (const char* key :
       {"\"aux_loss\":", "\"lm_loss\":", "\"moe.0.tokens_min\":", "\"moe.1.tokens_max\":", "\"moe.1.imbalance\":"})
    EXPECT_NE(metrics.find(key), std::string::npos) << key;
  const std::string fp = testing::read_file(fingerprint_path(dir.path("run"), 0));
  EXPECT_NE(fp.find("\"aux_loss\":\""), std::string::npos);
  EXPECT_EQ(fp.find("\"aux_loss\":\"0000000000000000\""), std::string::npos) << "aux loss is on in moe-debug";
}

TEST(MoeTraining, DebugModelLearns) {
  testing::TempDir dir;
  const TrainSummary s = quiet_train(moe_job(dir.path("run")));
  EXPECT_LT(s.last_loss, s.first_loss - 1.5);
  EXPECT_LT(s.last_eval_loss, s.first_loss - 1.5);
}

}  // namespace
TEST(GatheredWgrad, BalancedRangesCutTheRowsEvenlyAndCoverTheExperts) {
  using R = std::vector<int64_t>;
  EXPECT_EQ(balanced_ranges(R(8, 10), 2), (R{0, 4, 8}));
  EXPECT_EQ(balanced_ranges(R(8, 10), 4), (R{0, 2, 4, 6, 8}));
  EXPECT_EQ(balanced_ranges(R(8, 10), 1), (R{0, 8}));
  // One heavy expert gets a rank of its own; the rest share the other.
  EXPECT_EQ(balanced_ranges(R{1000, 0, 0, 0, 0, 0, 0, 0}, 2), (R{0, 1, 8}));
  EXPECT_EQ(balanced_ranges(R{0, 0, 0, 0, 0, 0, 0, 1000}, 2), (R{0, 7, 8}));
  // Skewed counts as moe-peer's early steps have (two heavy experts), both in the first half: E / 2
  // each would give 1,936 rows against 152; the cut gives 1,024 against 1,064.
  EXPECT_EQ(balanced_ranges(R{1024, 800, 64, 48, 128, 0, 8, 16}, 2), (R{0, 1, 8}));
  // More ranks than experts: some ranges are empty, all in order.
  const R few = balanced_ranges(R{5, 7}, 4);
  ASSERT_EQ(few.size(), 5u);
  EXPECT_EQ(few.front(), 0);
  EXPECT_EQ(few.back(), 2);
  // Any counts: P + 1 boundaries from 0 to E, in order, and no rank's cost more than the even share
  // plus the largest expert's.
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t E = 1 + static_cast<int64_t>(rng() % 16), P = 1 + static_cast<int64_t>(rng() % 8);
    R rows(static_cast<size_t>(E));
    for (int64_t& r : rows) r = static_cast<int64_t>(rng() % (rng() % 2 ? 2000 : 20));
    const R b = balanced_ranges(rows, P);
    ASSERT_EQ(b.size(), static_cast<size_t>(P + 1));
    EXPECT_EQ(b.front(), 0);
    EXPECT_EQ(b.back(), E);
    int64_t total = 0, largest = 0;
    for (const int64_t r : rows) total += r + 16, largest = std::max(largest, r + 16);
    for (int64_t q = 0; q < P; ++q) {
      ASSERT_LE(b[static_cast<size_t>(q)], b[static_cast<size_t>(q + 1)]);
      int64_t cost = 0;
      for (int64_t e = b[static_cast<size_t>(q)]; e < b[static_cast<size_t>(q + 1)]; ++e)
        cost += rows[static_cast<size_t>(e)] + 16;
      EXPECT_LE(cost, total / P + 2 * largest) << "trial " << trial << " rank " << q;
    }
  }
}

}  // namespace lockstep
