// The MoE router ops (kernels/router.h) on every backend: the routing (every score function,
// pre-softmax, group-limited top-k, the expert bias, the scaling factor, ties to the lower index)
// against a double-precision router, its backward against central differences of that double
// router; capacity dropping under both policies against the policy written out; the aux losses'
// statistics against double sums and their backward against central differences of the double
// losses (aux_losses_of over the double statistics); the jitter against RandomStream drawn here.
// The RouterSpecs come from configs (load_config), as the model's do.
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "../op_harness.h"
#include "../testing.h"
#include "lockstep/config/config.h"
#include "lockstep/core/error.h"
#include "lockstep/core/philox.h"

namespace lockstep::harness {
namespace {

using testing::all_close;
using testing::bitwise_equal;
using testing::randn;

using Options = std::vector<std::string>;

// The RouterSpec of a config with these moe.* overrides (8 experts unless they say).
RouterSpec spec_of(Options overrides) {
  bool has_e = false;
  for (const auto& o : overrides) has_e |= o.rfind("moe.num_experts=", 0) == 0;
  if (!has_e) overrides.push_back("moe.num_experts=8");
  return RouterSpec(load_config("", overrides).moe);
}

// ---- The double-precision router

// The K largest of v (n) among `allowed` (empty: all), ties to the lower index; ascending.
std::vector<int32_t> topk_ref(const double* v, int64_t n, int64_t K, const std::vector<char>& allowed = {}) {
  std::vector<int32_t> order;
  for (int64_t e = 0; e < n; ++e)
    if (allowed.empty() || allowed[e]) order.push_back(static_cast<int32_t>(e));
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return v[a] > v[b]; });
  order.resize(static_cast<size_t>(K));
  std::sort(order.begin(), order.end());
  return order;
}

// The top K of the selection scores v (E), group-limited when s.groups > 0: a group scores the sum
// of its best K / group_topk, the best group_topk groups stay.
std::vector<int32_t> select_ref(const std::vector<double>& v, const RouterSpec& s) {
  if (s.groups <= 0) return topk_ref(v.data(), s.E, s.K);
  const int64_t per = s.E / s.groups, take = s.K / s.group_topk;
  std::vector<double> gscore(s.groups);
  for (int64_t g = 0; g < s.groups; ++g)
    for (const int32_t i : topk_ref(v.data() + g * per, per, take)) gscore[g] += v[g * per + i];
  std::vector<char> allowed(s.E, 0);
  for (const int32_t g : topk_ref(gscore.data(), s.groups, s.group_topk))
    std::fill(allowed.begin() + g * per, allowed.begin() + (g + 1) * per, 1);
  return topk_ref(v.data(), s.E, s.K, allowed);
}

std::vector<double> softmax_ref(const double* z, int64_t n) {
  const double m = *std::max_element(z, z + n);
  std::vector<double> p(n);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += p[i] = std::exp(z[i] - m);
  for (double& x : p) x /= sum;
  return p;
}
double sigmoid_ref(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// One token's selection from its logits z (E): top-K of the logits (softmax), of the softmax
// (pre-softmax), of sigmoid + bias (sigmoid; the bias shifts the selection only).
std::vector<int32_t> selection_ref(const double* z, const float* bias, const RouterSpec& s) {
  const int64_t E = s.E;
  if (!s.sigmoid && !s.pre_softmax) return select_ref(std::vector<double>(z, z + E), s);
  if (!s.sigmoid) return select_ref(softmax_ref(z, E), s);
  std::vector<double> sel(E);
  for (int64_t e = 0; e < E; ++e) sel[e] = sigmoid_ref(z[e]) + (bias ? bias[e] : 0.0);
  return select_ref(sel, s);
}

// The routing weights of the chosen experts idx, docs/moe.md's formulas in double: softmax over
// the chosen logits; the full softmax's entries (pre-softmax); the sigmoid scores, normalised over
// the chosen when K > 1 (sigmoid); times the scaling factor.
std::vector<double> weights_ref(const double* z, const std::vector<int32_t>& idx, const RouterSpec& s) {
  const int64_t E = s.E, K = s.K;
  std::vector<double> p;
  if (!s.sigmoid && !s.pre_softmax) {
    std::vector<double> zk;
    for (const int32_t e : idx) zk.push_back(z[e]);
    p = softmax_ref(zk.data(), K);
  } else if (!s.sigmoid) {
    const std::vector<double> sc = softmax_ref(z, E);
    for (const int32_t e : idx) p.push_back(sc[e]);
  } else {
    double sum = 0;
    for (const int32_t e : idx) sum += sigmoid_ref(z[e]);
    for (const int32_t e : idx) p.push_back(K > 1 ? sigmoid_ref(z[e]) / (sum + 1e-20) : sigmoid_ref(z[e]));
  }
  for (double& x : p) x *= s.scaling;
  return p;
}

struct TokenRoute {
  std::vector<int32_t> idx;
  std::vector<double> p;
};
TokenRoute route_ref(const double* z, const float* bias, const RouterSpec& s) {
  TokenRoute r{selection_ref(z, bias, s), {}};
  r.p = weights_ref(z, r.idx, s);
  return r;
}

// The aux losses' statistics in double (RouterStatistics: psum and counts with an aux loss on, zsq
// with the z-loss on).
RouterStatistics statistics_ref(const std::vector<double>& z, const RouterSpec& s, int64_t B, int64_t T) {
  const int64_t E = s.E;
  RouterStatistics st{std::vector<double>(B * E, 0.0), std::vector<double>(B, 0.0), std::vector<int64_t>(B * E, 0)};
  const bool any_aux = s.aux_coeff > 0 && (s.aux || s.seq_aux || s.global_aux);
  for (int64_t t = 0; t < B * T; ++t) {
    const double* zt = z.data() + t * E;
    const int64_t b = t / T;
    if (s.z_coeff > 0) {
      const double m = *std::max_element(zt, zt + E);
      double sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += std::exp(zt[e] - m);
      const double lse = m + std::log(sum);
      st.zsq[b] += lse * lse;
    }
    if (!any_aux) continue;
    std::vector<double> a(E);
    if (!s.sigmoid) {
      a = softmax_ref(zt, E);
    } else {
      double sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += a[e] = sigmoid_ref(zt[e]);
      for (double& x : a) x /= sum + 1e-20;
    }
    for (int64_t e = 0; e < E; ++e) st.psum[b * E + e] += a[e];
    for (const int32_t e : topk_ref(a.data(), E, s.K)) ++st.counts[b * E + e];
  }
  return st;
}

::testing::AssertionResult near(const std::vector<double>& got, const std::vector<double>& ref, double rtol,
                                double atol, const std::string& what) {
  if (got.size() != ref.size())
    return ::testing::AssertionFailure() << what << ": " << got.size() << " values, the reference " << ref.size();
  for (size_t i = 0; i < got.size(); ++i)
    if (!(std::abs(got[i] - ref[i]) <= atol + rtol * std::abs(ref[i])))
      return ::testing::AssertionFailure() << what << "[" << i << "]: " << got[i] << ", reference " << ref[i];
  return ::testing::AssertionSuccess();
}

// ---- Routing: the kernel against the double router, its backward against central differences

struct RouteIn {
  Options options;
  RouterSpec s;
  bool with_bias;
  int64_t N;
  std::vector<float> logits, bias, dprobs;
};

RouteIn route_inputs(const Options& options, bool with_bias, int64_t N, uint64_t seed) {
  RouteIn in{options, spec_of(options), with_bias, N, {}, {}, {}};
  in.logits = randn(N * in.s.E, seed, "logits");
  in.bias = randn(in.s.E, seed + 2, "bias", 0.3f);
  in.dprobs = randn(N * in.s.K, seed + 1, "w");
  return in;
}

// route_topk, then route_topk_backward into a buffer of garbage (the op assigns).
void run_route(Run& r, const RouteIn& in) {
  const int64_t N = in.N, E = in.s.E, K = in.s.K;
  const Buf<float> logits = r.in(in.logits), bias = r.in(in.bias), dprobs = r.in(in.dprobs);
  Buf<int32_t> idx = r.full<int32_t>(N * K, -7);
  Buf<float> probs = r.full(N * K, -7.0f), dlogits = r.in(randn(N * E, 77, "garbage"));
  r.ops.route_topk(idx, probs, logits, in.with_bias ? bias.p() : nullptr, in.s, N);
  r.ops.route_topk_backward(dlogits, dprobs, logits, idx, in.s, N);
  r.out("idx", idx);
  r.out("probs", probs);
  r.out("dlogits", dlogits);
}

// idx and probs against the double router; dlogits against central differences (in double) of
// sum_k dprobs[t, k] p[t, k] for the token's chosen experts, and the entries of unchosen experts
// exactly 0 where the weights do not depend on them. stable: the selection must not change under
// the finite-difference step either (false for a case of exact ties, which any step breaks).
void check_route(const Result& got, const RouteIn& in, bool stable = true) {
  const int64_t N = in.N, E = in.s.E, K = in.s.K;
  const std::vector<int32_t> idx = got.get<int32_t>("idx");
  const std::vector<float> probs = got["probs"], dlogits = got["dlogits"];
  const float* bias = in.with_bias ? in.bias.data() : nullptr;
  std::vector<int32_t> want_idx;
  std::vector<double> want_p, want_dz;
  for (int64_t t = 0; t < N; ++t) {
    const std::vector<double> z(in.logits.begin() + t * E, in.logits.begin() + (t + 1) * E);
    const TokenRoute rt = route_ref(z.data(), bias, in.s);
    want_idx.insert(want_idx.end(), rt.idx.begin(), rt.idx.end());
    want_p.insert(want_p.end(), rt.p.begin(), rt.p.end());
    bool held = true;
    const std::vector<double> g = testing::finite_difference(
        [&](const std::vector<double>& zz) {
          if (stable) held &= selection_ref(zz.data(), bias, in.s) == rt.idx;
          const std::vector<double> q = weights_ref(zz.data(), rt.idx, in.s);
          double f = 0;
          for (int64_t k = 0; k < K; ++k) f += in.dprobs[t * K + k] * q[k];
          return f;
        },
        z);
    ASSERT_TRUE(held) << "token " << t << ": the selection changed under the finite-difference step";
    want_dz.insert(want_dz.end(), g.begin(), g.end());
  }
  ASSERT_EQ(idx, want_idx);
  EXPECT_TRUE(all_close(probs, want_p, 2e-6, 1e-7, "probs"));
  EXPECT_TRUE(all_close(dlogits, want_dz, 1e-5, 1e-6, "dlogits"));
  if (in.s.sigmoid || !in.s.pre_softmax)  // the weights depend on the chosen logits only
    for (int64_t t = 0; t < N; ++t)
      for (int64_t e = 0; e < E; ++e)
        if (!std::count(idx.begin() + t * K, idx.begin() + (t + 1) * K, e)) {
          EXPECT_EQ(std::bit_cast<uint32_t>(dlogits[t * E + e]), 0u) << "token " << t << " expert " << e;
        }
}

// The routings the cases cover: every score function and option, with and without the bias.
struct Routing {
  Options options;
  bool with_bias;
};
std::vector<Routing> routings() {
  return {
      {{"moe.router_topk=2"}, false},
      {{"moe.router_topk=3", "moe.router_pre_softmax=true"}, false},
      {{"moe.router_topk=2", "moe.router_score_function=sigmoid"}, false},
      {{"moe.router_topk=1", "moe.router_score_function=sigmoid"}, false},
      {{"moe.router_topk=2", "moe.router_score_function=sigmoid", "moe.router_enable_expert_bias=true",
        "moe.router_topk_scaling_factor=2"},
       true},
      {{"moe.router_topk=4", "moe.router_score_function=sigmoid", "moe.router_num_groups=4", "moe.router_group_topk=2",
        "moe.router_topk_scaling_factor=2.5", "moe.router_enable_expert_bias=true"},
       true},
      {{"moe.router_topk=2", "moe.router_num_groups=2", "moe.router_group_topk=1",
        "moe.router_topk_scaling_factor=1.5"},
       false},
      {{"moe.router_topk=4", "moe.router_pre_softmax=true", "moe.router_num_groups=4", "moe.router_group_topk=2"},
       false},
      {{"moe.num_experts=64", "moe.router_topk=6", "moe.router_score_function=sigmoid", "moe.router_num_groups=8",
        "moe.router_group_topk=3", "moe.router_enable_expert_bias=true", "moe.router_topk_scaling_factor=2.5"},
       true},
      {{"moe.num_experts=1", "moe.router_topk=1"}, false},
      {{"moe.num_experts=1", "moe.router_topk=1", "moe.router_score_function=sigmoid"}, false},
  };
}

// ---- Capacity

struct CapacityIn {
  RouterSpec s;
  int64_t N;
  std::vector<int32_t> idx;
  std::vector<float> probs;
};

// What the policy keeps, written out: choice i of expert e survives when fewer than `capacity`
// choices of e come before it: by weight, ties to the earlier token (probs), or by token order
// (position). All kept when dropless.
std::vector<uint8_t> capacity_ref(const CapacityIn& in) {
  const int64_t n = in.N * in.s.K, cap = expert_capacity(in.s, in.N);
  std::vector<uint8_t> kept(n, 1);
  if (cap == 0) return kept;
  for (int64_t i = 0; i < n; ++i) {
    int64_t before = 0;
    for (int64_t j = 0; j < n; ++j)
      if (j != i && in.idx[j] == in.idx[i])
        before += in.s.drop_by_position ? j < i : in.probs[j] > in.probs[i] || (in.probs[j] == in.probs[i] && j < i);
    kept[i] = before < cap;
  }
  return kept;
}

// ---- Jitter

struct JitterIn {
  int64_t N, C;
  std::vector<float> x;
  std::vector<int64_t> rows;
};
constexpr uint64_t kJitterSeed = 20240607;
constexpr float kJitterLo = static_cast<float>(1.0 - 0.01), kJitterWidth = static_cast<float>(2.0 * 0.01);
uint64_t jitter_purpose() { return mix_purpose(mix_purpose(purpose_id("moe/router_jitter"), 3), 17); }

}  // namespace

void add_router_cases(Registry& reg) {
  // ---- route_topk and route_topk_backward

  // Every routing against the double router, on empty, single, odd and multi-chunk token counts.
  for (const Routing& ro : routings())
    for (const int64_t N : {0, 1, 37, 300}) {
      reg.add(
          {"MoeRouter",
           "RoutingMatchesTheDoubleRouter",
           {"route_topk", "route_topk_backward"},
           str(::testing::PrintToString(ro.options), ro.with_bias ? " with bias" : "", " N=", N)},
          [=] { return route_inputs(ro.options, ro.with_bias, N, 1 + N); },
          [](Run& r, const RouteIn& in) { run_route(r, in); },
          [](const Result& got, const RouteIn& in) {
            check_route(got, in);
            if (!in.with_bias || in.N < 37) return;
            // The bias changed some token's choice (the case tests the bias).
            int64_t changed = 0;
            for (int64_t t = 0; t < in.N; ++t) {
              const std::vector<double> z(in.logits.begin() + t * in.s.E, in.logits.begin() + (t + 1) * in.s.E);
              changed += route_ref(z.data(), nullptr, in.s).idx != route_ref(z.data(), in.bias.data(), in.s).idx;
            }
            EXPECT_GT(changed, 0) << "the bias changes no token's choice";
          });
    }

  // Ties (equal logits, equal scores, equal group scores) go to the lower index, in every score
  // function, with and without groups; the backward at the chosen experts.
  for (const Options& options : std::vector<Options>{
           {"moe.num_experts=4", "moe.router_topk=1"},
           {"moe.num_experts=4", "moe.router_topk=2"},
           {"moe.num_experts=4", "moe.router_topk=2", "moe.router_pre_softmax=true"},
           {"moe.num_experts=4", "moe.router_topk=1", "moe.router_score_function=sigmoid"},
           {"moe.num_experts=4", "moe.router_topk=2", "moe.router_score_function=sigmoid"},
           {"moe.num_experts=4", "moe.router_topk=2", "moe.router_num_groups=2", "moe.router_group_topk=1"},
           {"moe.num_experts=4", "moe.router_topk=2", "moe.router_num_groups=2", "moe.router_group_topk=1",
            "moe.router_score_function=sigmoid"},
       }) {
    reg.add(
        {"MoeRouter",
         "TiesGoToTheLowerIndex",
         {"route_topk", "route_topk_backward"},
         ::testing::PrintToString(options)},
        [=] {
          RouteIn in = route_inputs(options, false, 6, 5);
          // Six tokens of E = 4 logits with ties, among experts and among the groups {0, 1}, {2, 3}.
          in.logits = {1, 1, 1, 1, 0, 2, 1, 2, 3, 0, 3, 3, -1, -1, -1, -1, 1, 0, 0, 1, 0, 1, 1, 0};
          return in;
        },
        [](Run& r, const RouteIn& in) { run_route(r, in); },
        [=](const Result& got, const RouteIn& in) {
          const std::vector<int32_t> idx = got.get<int32_t>("idx");
          std::vector<std::vector<int32_t>> want;
          if (in.s.groups > 0)  // group scores (sums of both): tokens 1 and 2 pick group 1, the others tie
            want = {{0, 1}, {2, 3}, {2, 3}, {0, 1}, {0, 1}, {0, 1}};
          else if (in.s.K == 1)
            want = {{0}, {1}, {0}, {0}, {0}, {1}};
          else
            want = {{0, 1}, {1, 3}, {0, 2}, {0, 1}, {0, 3}, {1, 2}};
          std::vector<int32_t> flat;
          for (const auto& w : want) flat.insert(flat.end(), w.begin(), w.end());
          EXPECT_EQ(idx, flat);
          check_route(got, in, false);
        });
  }

  // Moved from tests/test_moe.cpp (the same assertions, through the op on every backend). One
  // token, E = 4 logits.
  {
    struct In {
      std::vector<RouterSpec> specs;
    };
    reg.add(
        {"MoeRouter", "SelectionAndWeightsFollowTheFormulas", {"route_topk"}, "one token, E=4"},
        [] {
          return In{{spec_of({"moe.num_experts=4", "moe.router_topk=2"}),
                     spec_of({"moe.num_experts=4", "moe.router_topk=2", "moe.router_pre_softmax=true"}),
                     spec_of({"moe.num_experts=4", "moe.router_topk=2", "moe.router_score_function=sigmoid",
                              "moe.router_topk_scaling_factor=2"}),
                     spec_of({"moe.num_experts=4", "moe.router_topk=2", "moe.router_num_groups=2",
                              "moe.router_group_topk=1"})}};
        },
        [](Run& r, const In& in) {
          const Buf<float> z = r.in(std::vector<float>{0.5f, 2.0f, -1.0f, 1.0f});
          for (size_t i = 0; i < in.specs.size(); ++i) {
            Buf<int32_t> idx = r.zeros<int32_t>(2);
            Buf<float> p = r.zeros(2);
            r.ops.route_topk(idx, p, z, nullptr, in.specs[i], 1);
            r.out(str("idx ", i), idx);
            r.out(str("p ", i), p);
          }
        },
        [](const Result& got, const In&) {
          // softmax, not pre: top-2 logits {1, 3}, weights softmax over (2.0, 1.0), ascending expert order.
          std::vector<int32_t> idx = got.get<int32_t>("idx 0");
          std::vector<float> p = got["p 0"];
          EXPECT_EQ(idx[0], 1);
          EXPECT_EQ(idx[1], 3);
          EXPECT_NEAR(p[0], 1.0 / (1.0 + std::exp(-1.0)), 1e-6);
          EXPECT_NEAR(p[1], 1.0 / (1.0 + std::exp(1.0)), 1e-6);
          // pre-softmax: the weights are the full softmax's entries, not renormalised.
          p = got["p 1"];
          double denom = 0;
          for (float v : {0.5f, 2.0f, -1.0f, 1.0f}) denom += std::exp(static_cast<double>(v));
          EXPECT_NEAR(p[0], std::exp(2.0) / denom, 1e-6);
          EXPECT_NEAR(p[1], std::exp(1.0) / denom, 1e-6);
          // sigmoid with scaling 2: sigmoid scores of the top-2 renormalised, times 2.
          p = got["p 2"];
          auto sg = [](double x) { return 1 / (1 + std::exp(-x)); };
          EXPECT_NEAR(p[0], 2 * sg(2.0) / (sg(2.0) + sg(1.0)), 1e-6);
          // Group-limited: groups {0,1} and {2,3}; group scores = best logit (K/group_topk = 1):
          // 2.0 vs 1.0, so only group 0 stays and the top-2 come from experts 0 and 1.
          idx = got.get<int32_t>("idx 3");
          EXPECT_EQ(idx[0], 0);
          EXPECT_EQ(idx[1], 1);
        });
  }

  // Moved from tests/test_moe.cpp: the expert bias changes the selection, not the weights.
  reg.add(
      {"MoeRouter", "ExpertBiasChangesSelectionButNotWeights", {"route_topk"}, "one token, E=4, sigmoid"},
      [] {
        return spec_of({"moe.num_experts=4", "moe.router_topk=2", "moe.router_score_function=sigmoid",
                        "moe.router_enable_expert_bias=true"});
      },
      [](Run& r, const RouterSpec& s) {
        const Buf<float> z = r.in(std::vector<float>{0.5f, 2.0f, -1.0f, 1.0f});
        const Buf<float> bias = r.in(std::vector<float>{0.0f, 0.0f, 5.0f, 0.0f});  // pushes expert 2 into the top-2
        Buf<int32_t> idx = r.zeros<int32_t>(2);
        Buf<float> p = r.zeros(2);
        r.ops.route_topk(idx, p, z, bias, s, 1);
        r.out("idx", idx);
        r.out("p", p);
      },
      [](const Result& got, const RouterSpec&) {
        const std::vector<int32_t> idx = got.get<int32_t>("idx");
        const std::vector<float> p = got["p"];
        EXPECT_EQ(idx[0], 1);
        EXPECT_EQ(idx[1], 2);
        auto sg = [](double x) { return 1 / (1 + std::exp(-x)); };
        // The weights come from the unbiased scores of the chosen experts.
        EXPECT_NEAR(p[0], sg(2.0) / (sg(2.0) + sg(-1.0)), 1e-6);
        EXPECT_NEAR(p[1], sg(-1.0) / (sg(2.0) + sg(-1.0)), 1e-6);
      });

  // Moved from tests/test_moe.cpp: the backward against central differences of the op's own
  // forward (fp32 logits stepped by h = 1e-3 through route_topk, the selection held), as well as
  // against the double router's.
  const std::vector<Routing> moved = {
      {{"moe.router_topk=2"}, false},
      {{"moe.router_topk=3", "moe.router_pre_softmax=true"}, false},
      {{"moe.router_topk=2", "moe.router_score_function=sigmoid"}, false},
      {{"moe.router_topk=1", "moe.router_score_function=sigmoid"}, false},
      {{"moe.router_topk=4", "moe.router_score_function=sigmoid", "moe.router_num_groups=4", "moe.router_group_topk=2",
        "moe.router_topk_scaling_factor=2.5", "moe.router_enable_expert_bias=true"},
       true},
      {{"moe.router_topk=2", "moe.router_num_groups=2", "moe.router_group_topk=1",
        "moe.router_topk_scaling_factor=1.5"},
       false},
  };
  for (const Routing& ro : moved) {
    reg.add(
        {"MoeRouter",
         "GradientsMatchFiniteDifferences",
         {"route_topk", "route_topk_backward"},
         str(::testing::PrintToString(ro.options), ro.with_bias ? " with bias" : "")},
        [=] {
          RouteIn in = route_inputs(ro.options, ro.with_bias, 6, 1);
          in.bias = randn(in.s.E, 3, "bias", 0.3f);
          return in;
        },
        [](Run& r, const RouteIn& in) {
          run_route(r, in);
          const int64_t N = in.N, K = in.s.K, n = static_cast<int64_t>(in.logits.size());
          const std::vector<int32_t> idx = r.result.get<int32_t>("idx");
          const Buf<float> bias = r.in(in.bias);
          const double h = 1e-3;
          // sum over (t, k) of w[t, k] probs[t, k] at the given logits, and whether the selection held.
          const auto weighted = [&](const std::vector<float>& logits, bool& held) {
            Buf<int32_t> ip = r.zeros<int32_t>(N * K);
            Buf<float> probs = r.zeros(N * K);
            r.ops.route_topk(ip, probs, r.in(logits), in.with_bias ? bias.p() : nullptr, in.s, N);
            held &= r.get(ip) == idx;
            const std::vector<float> p = r.get(probs);
            double f = 0;
            for (size_t i = 0; i < p.size(); ++i) f += static_cast<double>(in.dprobs[i]) * p[i];
            return f;
          };
          std::vector<double> fd(n);
          std::vector<uint8_t> held(n, 1);
          for (int64_t i = 0; i < n; ++i) {
            std::vector<float> logits = in.logits;
            bool same = true;
            logits[i] = static_cast<float>(in.logits[i] + h);
            const double fp = weighted(logits, same);
            logits[i] = static_cast<float>(in.logits[i] - h);
            const double fm = weighted(logits, same);
            fd[i] = (fp - fm) / (2 * h);
            held[i] = same;
          }
          r.out("finite differences", fd);
          r.out("selection held", held);
        },
        [](const Result& got, const RouteIn& in) {
          const std::vector<float> dlogits = got["dlogits"];
          const std::vector<double> fd = got.get<double>("finite differences");
          const std::vector<uint8_t> held = got.get<uint8_t>("selection held");
          for (size_t i = 0; i < fd.size(); ++i) {
            ASSERT_EQ(held[i], 1) << "selection changed under the finite-difference step, logit " << i;
            EXPECT_NEAR(dlogits[i], fd[i], 2e-3) << "logit " << i;
          }
          check_route(got, in);
        });
  }

  // ---- apply_capacity

  // Moved from tests/test_moe.cpp. A hand-built routing: E = 3, K = 2, N = 4.
  {
    struct In {
      RouterSpec probs, position, dropless;
    };
    reg.add(
        {"MoeCapacity", "DroppingKeepsExactlyWhatThePolicySays", {"apply_capacity"}, "E=3 K=2 N=4"},
        [] {
          const auto spec = [](const char* policy) {
            return spec_of({"moe.num_experts=3", "moe.router_topk=2", "moe.expert_capacity_factor=0.5",
                            std::string("moe.token_drop_policy=") + policy});
          };
          return In{spec("probs"), spec("position"), spec_of({"moe.num_experts=3"})};
        },
        [](Run& r, const In& in) {
          const Buf<int32_t> idx = r.in(std::vector<int32_t>{0, 1, 0, 2, 1, 2, 0, 1});
          const Buf<float> probs = r.in(std::vector<float>{0.6f, 0.4f, 0.3f, 0.7f, 0.5f, 0.5f, 0.9f, 0.1f});
          for (const auto& [name, s] : {std::pair<const char*, const RouterSpec*>{"probs", &in.probs},
                                        {"position", &in.position},
                                        {"dropless", &in.dropless}}) {
            Buf<uint8_t> kept = r.full<uint8_t>(8, 7);
            r.ops.apply_capacity(kept, idx, probs, *s, 4);
            r.out(name, kept);
          }
        },
        [](const Result& got, const In& in) {
          // capacity = ceil(4 * 2 / 3 * 0.5) = 2. Expert 0 has tokens 0 (0.6), 1 (0.3), 3 (0.9).
          // Expert 1 has tokens 0 (0.4), 2 (0.5), 3 (0.1); expert 2 has tokens 1, 2 (fits).
          EXPECT_EQ(expert_capacity(in.probs, 4), 2);
          EXPECT_EQ(expert_capacity(in.position, 4), 2);
          // probs: expert 0 drops token 1 (lowest 0.3), expert 1 drops token 3 (0.1)
          EXPECT_EQ(got.get<uint8_t>("probs"), (std::vector<uint8_t>{1, 1, 0, 1, 1, 1, 1, 0}));
          // position: the first two in token order: expert 0 drops token 3, expert 1 drops token 3
          EXPECT_EQ(got.get<uint8_t>("position"), (std::vector<uint8_t>{1, 1, 1, 1, 1, 1, 0, 0}));
          // Dropless keeps everything.
          EXPECT_EQ(got.get<uint8_t>("dropless"), std::vector<uint8_t>(8, 1));
        });
  }

  // Random routings (two distinct experts per token, ascending) with weights on a coarse grid (many
  // ties): both policies and dropless against the policy written out, on empty, single, odd and
  // multi-chunk token counts.
  for (const int64_t N : {0, 1, 37, 300})
    for (const char* factor : {"0", "0.5", "1.25"})
      for (const char* policy : {"probs", "position"}) {
        if (std::string(factor) == "0" && std::string(policy) == "position") continue;
        reg.add(
            {"MoeCapacity",
             "KeepsWhatThePolicySays",
             {"apply_capacity"},
             str("E=8 K=2 N=", N, " capacity factor ", factor, " policy ", policy)},
            [=] {
              CapacityIn in{spec_of({"moe.router_topk=2", std::string("moe.expert_capacity_factor=") + factor,
                                     std::string("moe.token_drop_policy=") + policy}),
                            N,
                            {},
                            {}};
              const std::vector<int32_t> pick = testing::random_ints(N * 2, 8, 9, "idx");
              const std::vector<int32_t> grid = testing::random_ints(N * 2, 6, 9, "probs");
              for (int64_t t = 0; t < N; ++t) {
                // Skewed towards the low experts, so that they overflow.
                const int32_t a = pick[2 * t] % 4, b = (a + 1 + pick[2 * t + 1] % 7) % 8;
                in.idx.push_back(std::min(a, b));
                in.idx.push_back(std::max(a, b));
                in.probs.push_back(0.125f * static_cast<float>(grid[2 * t] + 1));
                in.probs.push_back(0.125f * static_cast<float>(grid[2 * t + 1] + 1));
              }
              return in;
            },
            [](Run& r, const CapacityIn& in) {
              const Buf<int32_t> idx = r.in(in.idx);
              const Buf<float> probs = r.in(in.probs);
              Buf<uint8_t> kept = r.full<uint8_t>(in.N * in.s.K, 7);
              r.ops.apply_capacity(kept, idx, probs, in.s, in.N);
              r.out("kept", kept);
            },
            [](const Result& got, const CapacityIn& in) {
              const std::vector<uint8_t> kept = got.get<uint8_t>("kept"), want = capacity_ref(in);
              EXPECT_EQ(kept, want);
              const int64_t cap = expert_capacity(in.s, in.N);
              for (int64_t e = 0; e < in.s.E; ++e) {
                int64_t routed = 0, k = 0;
                for (size_t i = 0; i < in.idx.size(); ++i)
                  if (in.idx[i] == e) ++routed, k += kept[i];
                EXPECT_EQ(k, cap == 0 ? routed : std::min(routed, cap)) << "expert " << e;
              }
              if (in.N == 300 && cap > 0) {
                EXPECT_TRUE(std::count(kept.begin(), kept.end(), 0) > 0) << "the case drops nothing";
              }
            });
      }

  // ---- router_statistics

  // The aux losses' statistics against double sums: psum and counts with an aux loss on (else
  // zero), zsq with the z-loss on (else zero); resized whatever they held.
  {
    struct StatIn {
      RouterSpec s;
      int64_t B, T;
      std::vector<float> logits;
    };
    for (const char* type : {"aux_loss", "seq_aux_loss,global_aux_loss", "none"})
      for (const char* score : {"softmax", "sigmoid"})
        for (const bool z : {false, true})
          for (const auto& bt : std::vector<std::pair<int64_t, int64_t>>{{0, 4}, {1, 1}, {3, 5}, {4, 64}}) {
            const int64_t B = bt.first, T = bt.second;
            reg.add(
                {"MoeAuxLoss",
                 "RouterStatisticsMatchDoubleSums",
                 {"router_statistics"},
                 str(type, " ", score, z ? " z-loss" : "", " B=", B, " T=", T)},
                [=] {
                  Options o = {"moe.router_topk=2", std::string("moe.router_load_balancing_type=") + type,
                               std::string("moe.router_score_function=") + score};
                  if (std::string(type) != "none") o.push_back("moe.aux_loss_coeff=0.5");
                  if (z) o.push_back("moe.z_loss_coeff=0.3");
                  const RouterSpec s = spec_of(o);
                  return StatIn{s, B, T, randn(B * T * s.E, 4 + B + T, "logits", 2.0f)};
                },
                [](Run& r, const StatIn& in) {
                  const Buf<float> logits = r.in(in.logits);
                  RouterStatistics st{std::vector<double>(3, 7.0), std::vector<double>(9, 7.0),
                                      std::vector<int64_t>(1, 7)};
                  r.ops.router_statistics(st, logits, in.s, in.B, in.T);
                  r.out("psum", st.psum);
                  r.out("zsq", st.zsq);
                  r.out("counts", st.counts);
                },
                [](const Result& got, const StatIn& in) {
                  const RouterStatistics want = statistics_ref(testing::to_double(in.logits), in.s, in.B, in.T);
                  EXPECT_TRUE(near(got.get<double>("psum"), want.psum, 1e-6, 1e-7, "psum"));
                  EXPECT_TRUE(near(got.get<double>("zsq"), want.zsq, 1e-6, 1e-7, "zsq"));
                  EXPECT_EQ(got.get<int64_t>("counts"), want.counts);
                  if (in.s.aux_coeff > 0)
                    for (int64_t b = 0; b < in.B; ++b) {
                      const auto c = got.get<int64_t>("counts");
                      EXPECT_EQ(std::accumulate(c.begin() + b * in.s.E, c.begin() + (b + 1) * in.s.E, int64_t{0}),
                                in.T * in.s.K);
                    }
                });
          }
  }

  // ---- aux_losses_backward

  // dlogits (rows [first, first + rows) of the micro-batch) += scale * d(aux losses)/d(logits) with
  // aux_loss_weights' g and gseq: against central differences (in double) of the losses that
  // aux_losses_of gives from the double statistics, the routing map held. Every loss type, both
  // score functions, the z-loss, the global loss over two replicas; all rows, and a
  // tensor-parallel rank's slice.
  {
    struct AuxIn {
      RouterSpec s;
      int64_t B, T, first, rows;
      std::vector<float> logits, dlogits0, global;
      std::vector<int64_t> counts;
      std::vector<double> g, gseq;
    };
    const int64_t prev[8] = {3, 1, 0, 2, 5, 1, 1, 0};
    std::vector<std::pair<Options, int64_t>> configs;  // options, replicas
    for (const char* type : {"aux_loss", "seq_aux_loss", "global_aux_loss", "aux_loss,seq_aux_loss,global_aux_loss"})
      for (const char* score : {"softmax", "sigmoid"})
        configs.push_back(
            {{"moe.router_topk=2", "moe.aux_loss_coeff=0.5", std::string("moe.router_load_balancing_type=") + type,
              std::string("moe.router_score_function=") + score},
             1});
    configs.push_back({{"moe.router_topk=2", "moe.z_loss_coeff=0.3", "moe.router_load_balancing_type=none"}, 1});
    configs.push_back(
        {{"moe.router_topk=2", "moe.aux_loss_coeff=0.5", "moe.z_loss_coeff=0.3",
          "moe.router_load_balancing_type=aux_loss,seq_aux_loss,global_aux_loss", "moe.router_score_function=sigmoid"},
         2});
    for (const auto& [options, replicas] : configs)
      for (const auto& shape :
           std::vector<std::array<int64_t, 4>>{{1, 1, 0, 1}, {2, 3, 0, 6}, {3, 5, 4, 7}, {2, 3, 6, 0}}) {
        const int64_t B = shape[0], T = shape[1], first = shape[2], rows = shape[3];
        const Options opts = options;
        const int64_t R = replicas;
        reg.add(
            {"MoeAuxLoss",
             "AuxLossesBackwardMatchesFiniteDifferences",
             {"aux_losses_backward"},
             str(::testing::PrintToString(opts), " replicas=", R, " B=", B, " T=", T, " rows [", first, ", ",
                 first + rows, ")")},
            [=] {
              AuxIn in;
              in.s = spec_of(opts), in.B = B, in.T = T, in.first = first, in.rows = rows;
              in.s.global_replicas = R;
              const int64_t E = in.s.E;
              in.logits = randn(B * T * E, 4, "logits");
              in.dlogits0 = randn(rows * E, 5, "dlogits", 0.01f);
              const RouterStatistics st = statistics_ref(testing::to_double(in.logits), in.s, B, T);
              in.counts = st.counts;
              in.global.assign(E, 0.0f);
              aux_losses_of(st, in.s, B, T, prev, 2, in.global.data(), nullptr, {});
              aux_loss_weights(in.g, in.gseq, in.s, B, T, in.global.data(), in.counts);
              return in;
            },
            [](Run& r, const AuxIn& in) {
              const Buf<float> logits = r.in(in.logits);
              Buf<float> dlogits = r.in(in.dlogits0);
              r.ops.aux_losses_backward(dlogits, logits, in.s, in.B, in.T, in.g.data(), in.gseq.data(), 0.5f, in.first,
                                        in.rows);
              r.out("dlogits", dlogits);
            },
            [=](const Result& got, const AuxIn& in) {
              const int64_t E = in.s.E;
              std::vector<double> z = testing::to_double(in.logits), want(in.rows * E);
              const auto loss = [&](const std::vector<double>& zz) {
                const RouterStatistics st = statistics_ref(zz, in.s, in.B, in.T);
                EXPECT_EQ(st.counts, in.counts) << "the routing map changed under the finite-difference step";
                std::vector<float> global(E);
                return aux_losses_of(st, in.s, in.B, in.T, prev, 2, global.data(), nullptr, {}).total();
              };
              const double h = 1e-5;
              for (int64_t i = 0; i < in.rows * E; ++i) {
                const int64_t j = in.first * E + i;
                const double x = z[j];
                z[j] = x + h;
                const double fp = loss(z);
                z[j] = x - h;
                const double fm = loss(z);
                z[j] = x;
                want[i] = in.dlogits0[i] + 0.5 * (fp - fm) / (2 * h);
              }
              EXPECT_TRUE(all_close(got["dlogits"], want, 1e-4, 1e-7, "dlogits"));
            });
      }
  }

  // ---- router_jitter

  // u[i] = lo + width * RandomStream(seed, purpose).uniform(rows[i / C] * C + i % C), y = x u, bit for
  // bit against the stream drawn here; the tokens in two parts with their own rows give the whole's
  // bits (the same draw in every layout).
  for (const auto& shape : std::vector<std::pair<int64_t, int64_t>>{{0, 3}, {1, 1}, {7, 5}, {300, 64}}) {
    const int64_t N = shape.first, C = shape.second;
    reg.add(
        {"MoeRouter", "JitterIsThePhiloxDrawAtTheTokensRow", {"router_jitter"}, str("N=", N, " C=", C)},
        [=] {
          JitterIn in{N, C, randn(N * C, 6, "x"), {}};
          for (int64_t i = 0; i < N; ++i) in.rows.push_back(1000 + (i * 37) % (2 * N + 1));  // not in order
          return in;
        },
        [](Run& r, const JitterIn& in) {
          const int64_t N = in.N, C = in.C, h = N / 2;
          const Buf<float> x = r.in(in.x);
          const Buf<int64_t> rows = r.in(in.rows);
          Buf<float> u = r.in(randn(N * C, 7, "u")), y = r.in(randn(N * C, 7, "y"));
          r.ops.router_jitter(u, y, x, rows, N, C, kJitterSeed, jitter_purpose(), kJitterLo, kJitterWidth);
          r.out("u", u);
          r.out("y", y);
          // Tokens [0, h) and [h, N) apart.
          Buf<float> pu = r.zeros(N * C), py = r.zeros(N * C);
          r.ops.router_jitter(pu, py, x, rows, h, C, kJitterSeed, jitter_purpose(), kJitterLo, kJitterWidth);
          r.ops.router_jitter(pu.p() + h * C, py.p() + h * C, x.p() + h * C, rows.p() + h, N - h, C, kJitterSeed,
                              jitter_purpose(), kJitterLo, kJitterWidth);
          r.out("u in parts", pu);
          r.out("y in parts", py);
        },
        [](const Result& got, const JitterIn& in) {
          const RandomStream rng(kJitterSeed, jitter_purpose());
          std::vector<float> u(in.N * in.C), y(in.N * in.C);
          for (int64_t i = 0; i < in.N * in.C; ++i) {
            const float w = kJitterWidth * rng.uniform(static_cast<uint64_t>(in.rows[i / in.C] * in.C + i % in.C));
            u[i] = kJitterLo + w;
            y[i] = in.x[i] * u[i];
            EXPECT_TRUE(u[i] >= kJitterLo && u[i] <= kJitterLo + kJitterWidth) << i;
          }
          EXPECT_TRUE(bitwise_equal(got["u"], u, "u"));
          EXPECT_TRUE(bitwise_equal(got["y"], y, "y"));
          EXPECT_TRUE(bitwise_equal(got["u in parts"], u, "u in parts"));
          EXPECT_TRUE(bitwise_equal(got["y in parts"], y, "y in parts"));
        });
  }
}

}  // namespace lockstep::harness
