// lockstep's MoE router against Megatron Core's own functions: tests/megatron/make_fixtures.py runs
// megatron.core.transformer.moe.moe_utils on the CPU (top-k routing with every score option, the
// aux, sequence aux and z losses with their gradients, capacity dropping) and records inputs and
// outputs in tests/megatron/fixtures/moe.safetensors. Here the same inputs go through lockstep's
// router ops (kernels/router.h, model/moe/router.h) configured from the same options, and the
// outputs must match: the routing map exactly, values to 2e-6 of each tensor's largest element
// (the losses' gradients, small sums of float32 terms: 1e-5), float32 on both sides, summed in
// different orders.
//
// Where lockstep differs from Megatron on purpose: the aux losses' gradients are the same
// function's, but lockstep adds them into the logits' gradient itself (Megatron attaches them to
// the routing probabilities with MoEAuxLossAutoScaler); a token's K choices are kept in ascending
// expert order, Megatron's in a dense (N, E) map (compared as that map); the position drop policy
// keeps each expert's first tokens, where Megatron's keeps torch.topk's choice among them
// (CapacityDroppingMatchesMegatron); with pad_to_capacity Megatron fills an expert's rows with other
// tokens at weight 0, lockstep with rows of zeros it never combines (PermuteAndCombineMatchMegatron).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "lockstep/config/config.h"
#include "lockstep/kernels/device.h"
#include "lockstep/model/moe/dispatcher.h"
#include "lockstep/model/moe/router.h"
#include "lockstep/train/safetensors.h"
#include "testing.h"

namespace lockstep {
namespace {

SafetensorsFile& fixture() {
  static SafetensorsFile f(std::string(LOCKSTEP_SOURCE_DIR) + "/tests/megatron/fixtures/moe.safetensors");
  return f;
}

// The case's options (its metadata) as lockstep's moe.* keys.
MoeConfig moe_of(const std::string& key) {
  const nlohmann::json c = nlohmann::json::parse(fixture().metadata().at(key));
  std::vector<std::string> keys = {
      "moe.num_experts=" + std::to_string(c["E"].get<int>()), "moe.router_topk=" + std::to_string(c["K"].get<int>()),
      "moe.router_score_function=" + c.value("score", std::string("softmax")), "moe.router_load_balancing_type=none"};
  if (c.value("pre_softmax", false)) keys.push_back("moe.router_pre_softmax=true");
  if (c.contains("scaling"))
    keys.push_back("moe.router_topk_scaling_factor=" + std::to_string(c["scaling"].get<double>()));
  if (c.contains("groups"))
    keys.insert(keys.end(), {"moe.router_num_groups=" + std::to_string(c["groups"].get<int>()),
                             "moe.router_group_topk=" + std::to_string(c["group_topk"].get<int>())});
  if (c.value("bias", false)) keys.push_back("moe.router_enable_expert_bias=true");
  std::string types;
  for (const std::string t : {"aux", "seq_aux", "global_aux"})
    if (c.contains(t)) {
      types += (types.empty() ? "" : ",") + t + "_loss";
      keys.push_back("moe.aux_loss_coeff=" + std::to_string(c[t].get<double>()));
    }
  if (!types.empty()) keys.push_back("moe.router_load_balancing_type=" + types);
  if (c.contains("z")) keys.push_back("moe.z_loss_coeff=" + std::to_string(c["z"].get<double>()));
  if (c.contains("factor"))
    keys.insert(keys.end(), {"moe.expert_capacity_factor=" + std::to_string(c["factor"].get<double>()),
                             "moe.token_drop_policy=" + c["policy"].get<std::string>()});
  return load_config("", keys).moe;
}

std::vector<std::string> cases(const std::string& kind) {
  std::vector<std::string> out;
  for (const auto& [key, value] : fixture().metadata())
    if (key.rfind(kind + "/", 0) == 0) out.push_back(key.substr(kind.size() + 1));
  return out;
}

using testing::relative_error;

// (N, K) choices as Megatron's dense (N, E) map and probabilities.
void densify(std::vector<float>& map, std::vector<float>& probs, const std::vector<int32_t>& idx,
             const std::vector<float>& p, int64_t N, int64_t E, int64_t K) {
  map.assign(static_cast<size_t>(N * E), 0.0f);
  probs.assign(static_cast<size_t>(N * E), 0.0f);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      map[static_cast<size_t>(n * E + idx[n * K + k])] = 1.0f;
      probs[static_cast<size_t>(n * E + idx[n * K + k])] = p[static_cast<size_t>(n * K + k)];
    }
}

TEST(MegatronOracle, TopKRoutingMatchesMegatron) {
  const auto device = Device::cpu();
  const Ops& ops = device->ops;
  const std::vector<std::string> names = cases("route");
  EXPECT_EQ(names.size(), 6u);
  for (const std::string& name : names) {
    const std::string at = "route/" + name + "/";
    const RouterSpec s(moe_of("route/" + name));
    const std::vector<float> logits = fixture().floats(at + "logits"), upstream = fixture().floats(at + "upstream");
    const int64_t E = s.E, K = s.K, N = static_cast<int64_t>(logits.size()) / E;
    const std::vector<float> bias =
        fixture().has(at + "expert_bias") ? fixture().floats(at + "expert_bias") : std::vector<float>{};
    std::vector<int32_t> idx(static_cast<size_t>(N * K));
    std::vector<float> p(static_cast<size_t>(N * K)), map, probs;
    ops.route_topk(idx.data(), p.data(), logits.data(), bias.empty() ? nullptr : bias.data(), s, N);
    densify(map, probs, idx, p, N, E, K);
    EXPECT_EQ(map, fixture().floats(at + "map")) << name << ": another expert chosen";
    EXPECT_LE(relative_error(probs, fixture().floats(at + "probs")), 2e-6) << name << ": routing weights";
    // d(sum probs * upstream)/d(logits): the upstream gradient at each choice.
    std::vector<float> dprobs(static_cast<size_t>(N * K)), dlogits(static_cast<size_t>(N * E));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) dprobs[n * K + k] = upstream[n * E + idx[n * K + k]];
    ops.route_topk_backward(dlogits.data(), dprobs.data(), logits.data(), idx.data(), s, N);
    EXPECT_LE(relative_error(dlogits, fixture().floats(at + "dlogits")), 2e-6) << name << ": logits' gradient";
  }
}

TEST(MegatronOracle, LoadBalancingLossesMatchMegatron) {
  const auto device = Device::cpu();
  const std::vector<std::string> names = cases("aux");
  EXPECT_EQ(names.size(), 4u);
  for (const std::string& name : names) {
    const std::string at = "aux/" + name + "/";
    const nlohmann::json c = nlohmann::json::parse(fixture().metadata().at("aux/" + name));
    const RouterSpec s(moe_of("aux/" + name));
    const int64_t B = c["B"], T = c["T"], E = s.E;
    const std::vector<float> logits = fixture().floats(at + "logits");
    std::vector<float> global_counts(static_cast<size_t>(E));
    std::vector<int64_t> counts_seq;
    const AuxLosses l =
        aux_losses_forward(device->ops, logits.data(), s, B, T, nullptr, 0, global_counts.data(), counts_seq);
    const double want = fixture().floats(at + "loss")[0];
    EXPECT_NEAR(l.total(), want, 2e-6 * std::abs(want)) << name << ": loss";
    std::vector<float> dlogits(static_cast<size_t>(B * T * E), 0.0f);
    aux_losses_backward(device->ops, dlogits.data(), logits.data(), s, B, T, global_counts.data(), counts_seq, 1.0f);
    EXPECT_LE(relative_error(dlogits, fixture().floats(at + "dlogits")), 1e-5) << name << ": logits' gradient";
  }
}

TEST(MegatronOracle, CapacityDroppingMatchesMegatron) {
  const auto device = Device::cpu();
  const std::vector<std::string> names = cases("capacity");
  EXPECT_EQ(names.size(), 2u);
  for (const std::string& name : names) {
    const std::string at = "capacity/" + name + "/";
    const RouterSpec s(moe_of("capacity/" + name));
    const std::vector<float> logits = fixture().floats(at + "logits");
    const int64_t E = s.E, K = s.K, N = static_cast<int64_t>(logits.size()) / E;
    std::vector<int32_t> idx(static_cast<size_t>(N * K));
    std::vector<float> p(static_cast<size_t>(N * K)), map, probs;
    device->ops.route_topk(idx.data(), p.data(), logits.data(), nullptr, s, N);
    densify(map, probs, idx, p, N, E, K);
    EXPECT_EQ(map, fixture().floats(at + "map")) << name;
    std::vector<uint8_t> kept(static_cast<size_t>(N * K));
    device->ops.apply_capacity(kept.data(), idx.data(), p.data(), s, N);
    for (int64_t i = 0; i < N * K; ++i)
      if (!kept[i]) p[i] = 0.0f;
    std::vector<float> kept_map, kept_probs;
    densify(kept_map, kept_probs, idx, p, N, E, K);
    for (int64_t i = 0; i < N * K; ++i)
      if (!kept[i]) kept_map[static_cast<size_t>((i / K) * E + idx[i])] = 0.0f;
    const std::vector<float> theirs = fixture().floats(at + "kept_map");
    if (name == "capacity_probs") {
      EXPECT_EQ(kept_map, theirs) << name << ": another token dropped";
      EXPECT_LE(relative_error(kept_probs, fixture().floats(at + "kept_probs")), 2e-6) << name;
      continue;
    }
    // The position policy. Megatron takes torch.topk of the 0/1 routing map over the tokens, so
    // which of an over-full expert's tokens survive is torch's tie order, not their position;
    // lockstep keeps each expert's first `capacity` tokens, as the policy's name says. The same
    // number survive per expert; lockstep's are the earliest.
    const int64_t capacity = expert_capacity(s, N);
    for (int64_t e = 0; e < E; ++e) {
      int64_t ours = 0, megatron = 0, routed = 0;
      for (int64_t n = 0; n < N; ++n) {
        ours += kept_map[n * E + e] != 0.0f, megatron += theirs[n * E + e] != 0.0f, routed += map[n * E + e] != 0.0f;
        if (kept_map[n * E + e] == 0.0f && map[n * E + e] != 0.0f) {
          EXPECT_EQ(ours, capacity) << name << ": expert " << e << " dropped token " << n << " before it was full";
        }
      }
      EXPECT_EQ(ours, megatron) << name << ": expert " << e;
      EXPECT_EQ(ours, std::min(routed, capacity)) << name << ": expert " << e;
    }
  }
}

// The global aux loss over a step's micro-batches on one rank: each micro-batch's loss uses the
// running mean of the tokens per expert so far (Megatron's global_tokens_per_expert / ga_steps).
TEST(MegatronOracle, GlobalAuxLossMatchesMegatron) {
  const auto device = Device::cpu();
  const std::vector<std::string> names = cases("global_aux");
  EXPECT_EQ(names.size(), 2u);
  for (const std::string& name : names) {
    const nlohmann::json c = nlohmann::json::parse(fixture().metadata().at("global_aux/" + name));
    const RouterSpec s(moe_of("global_aux/" + name));
    const int64_t B = c["B"], T = c["T"], E = s.E;
    std::vector<int64_t> sum(static_cast<size_t>(E), 0), micro_counts(static_cast<size_t>(E)), counts_seq;
    std::vector<float> global_counts(static_cast<size_t>(E));
    for (int64_t m = 0; m < c["micros"].get<int64_t>(); ++m) {
      const std::string at = "global_aux/" + name + "/" + std::to_string(m) + "/";
      const std::vector<float> logits = fixture().floats(at + "logits");
      const AuxLosses l = aux_losses_forward(device->ops, logits.data(), s, B, T, sum.data(), m, global_counts.data(),
                                             counts_seq, micro_counts.data());
      const double want = fixture().floats(at + "loss")[0];
      EXPECT_NEAR(l.total(), want, 2e-6 * std::abs(want)) << name << " micro-batch " << m << ": loss";
      std::vector<float> dlogits(static_cast<size_t>(B * T * E), 0.0f);
      aux_losses_backward(device->ops, dlogits.data(), logits.data(), s, B, T, global_counts.data(), counts_seq, 1.0f);
      EXPECT_LE(relative_error(dlogits, fixture().floats(at + "dlogits")), 1e-5)
          << name << " micro-batch " << m << ": logits' gradient";
      for (int64_t e = 0; e < E; ++e) sum[e] += micro_counts[e];
    }
  }
}

TEST(MegatronOracle, ExpertBiasUpdateMatchesMegatron) {
  const std::string at = "bias/expert_bias_update/";
  const nlohmann::json c = nlohmann::json::parse(fixture().metadata().at("bias/expert_bias_update"));
  const std::vector<float> counts_f = fixture().floats(at + "counts");
  std::vector<int64_t> counts(counts_f.begin(), counts_f.end());
  std::vector<float> bias = fixture().floats(at + "bias");
  update_expert_bias(bias.data(), counts.data(), static_cast<int64_t>(bias.size()), c["rate"].get<float>());
  EXPECT_TRUE(testing::bitwise_equal(bias, fixture().floats(at + "updated")));
  EXPECT_EQ(bias[0], fixture().floats(at + "bias")[0]);  // exactly at the mean load: unchanged
}

// Dispatch (Megatron's permute: rows grouped by expert, tokens in order inside) and combine
// (unpermute with the routing weights), with and without capacity padding.
TEST(MegatronOracle, PermuteAndCombineMatchMegatron) {
  const auto device = Device::cpu();
  const std::vector<std::string> names = cases("permute");
  EXPECT_EQ(names.size(), 2u);
  for (const std::string& name : names) {
    const std::string at = "permute/" + name + "/";
    const nlohmann::json c = nlohmann::json::parse(fixture().metadata().at("permute/" + name));
    const bool pad = c.value("pad", false);
    MoeConfig moe = moe_of("permute/" + name);
    moe.pad_expert_input_to_capacity = pad;
    const RouterSpec s(moe);
    const std::vector<float> logits = fixture().floats(at + "logits"), tokens = fixture().floats(at + "tokens");
    const int64_t E = s.E, K = s.K, N = static_cast<int64_t>(logits.size()) / E, C = c["C"];
    std::vector<int32_t> idx(static_cast<size_t>(N * K));
    std::vector<float> p(static_cast<size_t>(N * K));
    std::vector<uint8_t> kept(static_cast<size_t>(N * K), 1);
    device->ops.route_topk(idx.data(), p.data(), logits.data(), nullptr, s, N);
    if (pad) device->ops.apply_capacity(kept.data(), idx.data(), p.data(), s, N);
    const int64_t capacity = pad ? expert_capacity(s, N) : 0;
    LocalDispatcher d(device->ops, E, K, C, N, capacity, pad);
    d.plan(idx.data(), kept.data(), N);
    const std::vector<float> permuted = fixture().floats(at + "permuted"),
                             expert_out = fixture().floats(at + "expert_out");
    ASSERT_EQ(d.rows() * C, static_cast<int64_t>(permuted.size())) << name << ": rows";
    std::vector<float> rows(static_cast<size_t>(d.rows() * C));
    d.dispatch(rows.data(), tokens.data());
    // Each expert's rows: its tokens in token order, bit for bit; then (padding) lockstep's zero rows
    // where Megatron repeats other tokens, which its routing weights (0) leave out of the combine.
    const std::vector<float> megatron_probs = fixture().floats(at + "probs");
    const std::vector<float> order = fixture().floats(at + "sorted_indices");
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = d.offsets()[e]; r < d.offsets()[e + 1]; ++r) {
        const bool real = r - d.offsets()[e] < d.tokens_per_expert()[e];
        const float* ours = rows.data() + r * C;
        const float* theirs = permuted.data() + r * C;
        for (int64_t j = 0; j < C; ++j) {
          if (real)
            ASSERT_EQ(std::bit_cast<uint32_t>(ours[j]), std::bit_cast<uint32_t>(theirs[j])) << name << " row " << r;
          else
            ASSERT_EQ(ours[j], 0.0f) << name << ": padding row " << r;
        }
        if (!real) {
          const int64_t token = static_cast<int64_t>(order[static_cast<size_t>(r)]);
          EXPECT_EQ(megatron_probs[static_cast<size_t>(token * E + e)], 0.0f)
              << name << ": Megatron's padding row " << r;
        }
      }
    for (int64_t i = 0; i < N * K; ++i)
      if (!kept[i]) p[i] = 0.0f;
    std::vector<float> zeros(static_cast<size_t>(N * C), 0.0f), out(static_cast<size_t>(N * C));
    d.combine(out.data(), zeros.data(), expert_out.data(), p.data());
    EXPECT_LE(relative_error(out, fixture().floats(at + "combined")), 2e-6) << name << ": combine";
  }
}

}  // namespace
}  // namespace lockstep
