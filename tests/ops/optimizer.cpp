// AdamW and the gradient norm's sums of squares (kernels/optimizer.h) on every backend: against
// the double formula, the float formula bit for bit, the fused hashing form, exact sums, and the
// thread settings.
#include <bit>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "../op_harness.h"
#include "../testing.h"
#include "lockstep/core/dtype.h"
#include "lockstep/core/error.h"
#include "lockstep/core/exact_sum.h"
#include "lockstep/core/hash.h"

namespace lockstep::harness {
namespace {

using testing::all_close;
using testing::bitwise_equal;
using testing::randn;

const AdamW kHp{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};

// The formula of the header, in double, over the same hyperparameter values.
void ref_adamw(std::vector<double>& p, std::vector<double>& m, std::vector<double>& v, const std::vector<float>& grad,
               const AdamW& hp, int64_t step, double grad_scale) {
  const double lr = hp.lr, b1 = hp.beta1, b2 = hp.beta2, eps = hp.eps, wd = hp.weight_decay;
  const double bc1 = 1.0 - std::pow(b1, step), bc2 = 1.0 - std::pow(b2, step);
  for (size_t i = 0; i < p.size(); ++i) {
    const double g = grad[i] * grad_scale;
    p[i] *= 1.0 - lr * wd;
    m[i] = b1 * m[i] + (1.0 - b1) * g;
    v[i] = b2 * v[i] + (1.0 - b2) * g * g;
    p[i] -= lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + eps);
  }
}

// The header's float formula for one element, operation for operation (the kernels give these bits).
void scalar_adamw(float& p, float& m, float& v, float grad, const AdamW& hp, int64_t step, float grad_scale) {
  const double lr = hp.lr;
  const float decay = static_cast<float>(1.0 - lr * static_cast<double>(hp.weight_decay));
  const float c1 = static_cast<float>(1.0 - static_cast<double>(hp.beta1));
  const float c2 = static_cast<float>(1.0 - static_cast<double>(hp.beta2));
  const float step_size = static_cast<float>(lr / (1.0 - std::pow(double(hp.beta1), step)));
  const float bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(double(hp.beta2), step)));
  const float g = grad * grad_scale;
  p = p * decay;
  m = hp.beta1 * m + c1 * g;
  v = hp.beta2 * v + c2 * g * g;
  p = p - step_size * m / (std::sqrt(v) / bc2_sqrt + hp.eps);
}

struct State {
  std::vector<float> p, m, v;
};

// Updates (p, m, v) in backend memory with grads[s] at steps 1, 2, ..., recording each step's
// state as "step k param", "step k m", "step k v".
void steps(Run& r, const State& s0, const std::vector<std::vector<float>>& grads, int64_t n, const AdamW& hp,
           float grad_scale) {
  Buf<float> p = r.in(s0.p), m = r.in(s0.m), v = r.in(s0.v);
  for (size_t s = 0; s < grads.size(); ++s) {
    const Buf<float> g = r.in(grads[s]);
    const int64_t step = static_cast<int64_t>(s) + 1;
    r.ops.adamw_update(p, m, v, g, n, hp, step, grad_scale);
    r.out(str("step ", step, " param"), p);
    r.out(str("step ", step, " m"), m);
    r.out(str("step ", step, " v"), v);
  }
}

struct Steps {
  State s0;
  std::vector<std::vector<float>> grads;
};

// Checks every recorded step against the double formula.
void check_steps(const Result& got, const Steps& in, const AdamW& hp, float grad_scale) {
  auto rp = testing::to_double(in.s0.p), rm = testing::to_double(in.s0.m), rv = testing::to_double(in.s0.v);
  for (size_t s = 0; s < in.grads.size(); ++s) {
    const int64_t step = static_cast<int64_t>(s) + 1;
    SCOPED_TRACE(step);
    ref_adamw(rp, rm, rv, in.grads[s], hp, step, grad_scale);
    EXPECT_TRUE(all_close(got[str("step ", step, " m")], rm, 1e-5, 1e-7, "m"));
    EXPECT_TRUE(all_close(got[str("step ", step, " v")], rv, 1e-5, 1e-9, "v"));
    // The update is about lr in size; allow a relative 1e-5 of it on top of the rounding of p.
    EXPECT_TRUE(all_close(got[str("step ", step, " param")], rp, 1e-6, 1e-5 * hp.lr, "param"));
  }
}

}  // namespace

void add_optimizer_cases(Registry& reg) {
  {
    const int64_t n = 1003;  // not a multiple of the vector width
    const float grad_scale = 0.5f;
    reg.add(
        {"AdamW", "MatchesDoubleReferenceOverSeveralSteps", {"adamw_update"}, str("n=", n, " 6 steps")},
        [=] {
          Steps in{{randn(n, 20, "param"), std::vector<float>(n, 0.0f), std::vector<float>(n, 0.0f)}, {}};
          for (int64_t step = 1; step <= 6; ++step) in.grads.push_back(randn(n, 20 + step, "grad"));
          return in;
        },
        [=](Run& r, const Steps& in) { steps(r, in.s0, in.grads, n, kHp, grad_scale); },
        [=](const Result& got, const Steps& in) { check_steps(got, in, kHp, grad_scale); });
  }

  // The header's operations, one fp32 rounding each, scalars computed in double: the kernel must
  // give exactly these bits.
  {
    const int64_t n = 77, step = 3;
    const float grad_scale = 0.75f;
    struct In {
      State s;
      std::vector<float> grad;
    };
    reg.add(
        {"AdamW", "BitwiseEqualToScalarFormula", {"adamw_update"}, str("n=", n, " step ", step)},
        [=] {
          In in{{randn(n, 21, "param"), randn(n, 21, "m", 0.1f), randn(n, 21, "v", 0.1f)}, randn(n, 21, "grad")};
          for (float& x : in.s.v) x = x * x;
          return in;
        },
        [=](Run& r, const In& in) {
          Buf<float> p = r.in(in.s.p), m = r.in(in.s.m), v = r.in(in.s.v);
          const Buf<float> g = r.in(in.grad);
          r.ops.adamw_update(p, m, v, g, n, kHp, step, grad_scale);
          r.out("param", p);
          r.out("m", m);
          r.out("v", v);
        },
        [=](const Result& got, const In& in) {
          auto sp = in.s.p, sm = in.s.m, sv = in.s.v;
          for (int64_t i = 0; i < n; ++i) scalar_adamw(sp[i], sm[i], sv[i], in.grad[i], kHp, step, grad_scale);
          EXPECT_TRUE(bitwise_equal(got["param"], sp, "param"));
          EXPECT_TRUE(bitwise_equal(got["m"], sm, "m"));
          EXPECT_TRUE(bitwise_equal(got["v"], sv, "v"));
        });
  }

  // First step without decay: m / sqrt(v) is g / |g|, so every parameter moves by lr against the
  // sign of its gradient.
  {
    const int64_t n = 20;
    const AdamW hp{.lr = 1e-3f};
    reg.add(
        {"AdamW", "FirstStepMovesByLearningRate", {"adamw_update"}, str("n=", n)},
        [=] {
          return Steps{{randn(n, 22, "param"), std::vector<float>(n, 0.0f), std::vector<float>(n, 0.0f)},
                       {randn(n, 22, "grad")}};
        },
        [=](Run& r, const Steps& in) { steps(r, in.s0, in.grads, n, hp, 1.0f); },
        [=](const Result& got, const Steps& in) {
          const std::vector<float> p = got["step 1 param"];
          for (int64_t i = 0; i < n; ++i) {
            EXPECT_NEAR(p[i], in.s0.p[i] - std::copysign(1e-3f, in.grads[0][i]), 1e-6) << i;
          }
        });
  }

  reg.add(
      {"AdamW", "RejectsStepZero", {"adamw_update"}, "step 0"},
      [](Run& r) {
        Buf<float> p = r.full(1, 1.0f), m = r.zeros(1), v = r.zeros(1);
        const Buf<float> g = r.full(1, 1.0f);
        bool threw = false;
        try {
          r.ops.adamw_update(p, m, v, g, 1, kHp, 0, 1.0f);
        } catch (const InternalError&) {
          threw = true;
        }
        r.out("threw InternalError", std::vector<uint8_t>{threw});
      },
      [](const Result& got) { EXPECT_EQ(got.get<uint8_t>("threw InternalError"), std::vector<uint8_t>{1}); });

  // Every setting (1 to 3 threads) gives the same bits; against the double formula.
  {
    const int64_t n = 100003;
    reg.add(
        {"AdamW", "BitwiseAcrossThreadCounts", {"adamw_update"}, str("n=", n, " 2 steps")},
        [=] {
          const auto grad = randn(n, 23, "grad");
          return Steps{{randn(n, 23, "param"), std::vector<float>(n, 0.0f), std::vector<float>(n, 0.0f)}, {grad, grad}};
        },
        [=](Run& r, const Steps& in) { steps(r, in.s0, in.grads, n, kHp, 0.9f); },
        [=](const Result& got, const Steps& in) { check_steps(got, in, kHp, 0.9f); });
  }

  // The fused form: the same bits as adamw_update, XXH3 of the gradient as read and of the moments
  // as written over the state range, and of the parameters as written over all n; over several
  // 16384-element pieces and a tail, with state ranges that cut pieces, are empty or are everything.
  {
    const int64_t n = 3 * 16384 + 777;
    for (const auto& [sb, se] : {std::pair<int64_t, int64_t>{0, n}, {100, 2 * 16384 + 5}, {16384, 16384}, {n - 1, n}}) {
      reg.add(
          {"AdamW",
           "HashedUpdateGivesTheSameBitsAndHashesTheGradientMomentsAndParameters",
           {"adamw_update_hashed", "adamw_update"},
           str("state [", sb, ", ", se, ")")},
          [=] {
            return Steps{{randn(n, 29, "param"), std::vector<float>(n, 0.0f), std::vector<float>(n, 0.0f)},
                         {randn(n, 29, "grad")}};
          },
          [=](Run& r, const Steps& in) {
            Buf<float> p = r.in(in.s0.p), m = r.in(in.s0.m), v = r.in(in.s0.v);
            Buf<float> p2 = r.in(in.s0.p), m2 = r.in(in.s0.m), v2 = r.in(in.s0.v);
            const Buf<float> g = r.in(in.grads[0]);
            for (int64_t step = 1; step <= 2; ++step) {
              Buf<uint64_t> h = r.zeros<uint64_t>(4);
              const AdamwHashedItem item{p, m, v, g, n, kHp, sb, se, h};
              r.ops.adamw_update_hashed(&item, 1, step, 0.7f);
              r.ops.adamw_update(p2, m2, v2, g, n, kHp, step, 0.7f);
              for (const auto& [name, b] : {std::pair<const char*, const Buf<float>*>{"param", &p},
                                            {"m", &m},
                                            {"v", &v},
                                            {"param (adamw_update)", &p2},
                                            {"m (adamw_update)", &m2},
                                            {"v (adamw_update)", &v2}})
                r.out(str("step ", step, " ", name), *b);
              r.out(str("step ", step, " hashes"), h);
            }
          },
          [=](const Result& got, const Steps& in) {
            for (int64_t step = 1; step <= 2; ++step) {
              SCOPED_TRACE(step);
              const std::string s = str("step ", step, " ");
              const std::vector<float> p = got[s + "param"], m = got[s + "m"], v = got[s + "v"];
              EXPECT_TRUE(bitwise_equal(p, got[s + "param (adamw_update)"], "param"));
              EXPECT_TRUE(bitwise_equal(m, got[s + "m (adamw_update)"], "m"));
              EXPECT_TRUE(bitwise_equal(v, got[s + "v (adamw_update)"], "v"));
              const std::vector<uint64_t> h = got.get<uint64_t>(s + "hashes");
              ASSERT_EQ(h.size(), 4u);
              EXPECT_EQ(h[0], hash_floats(in.grads[0].data() + sb, se - sb));
              EXPECT_EQ(h[1], hash_floats(m.data() + sb, se - sb));
              EXPECT_EQ(h[2], hash_floats(v.data() + sb, se - sb));
              EXPECT_EQ(h[3], hash_floats(p.data(), n));
            }
          });
    }
  }

  // bf16 moments (the precision-aware optimizer): each step is the fp32 update of the moments
  // widened exactly, then each moment rounded to nearest, ties to even; the hashes are of the bf16
  // bytes. Over pieces and a tail, one moment in bf16 or both.
  {
    const int64_t n = 2 * 16384 + 333;
    for (const auto& [m_low, v_low] : {std::pair<bool, bool>{true, true}, {true, false}, {false, true}}) {
      reg.add(
          {"AdamW",
           "Bf16MomentsAreTheFp32UpdateRounded",
           {"adamw_update_hashed", "adamw_update"},
           str("m ", m_low ? "bf16" : "fp32", ", v ", v_low ? "bf16" : "fp32")},
          [=] {
            return Steps{{randn(n, 31, "param"), std::vector<float>(n, 0.0f), std::vector<float>(n, 0.0f)},
                         {randn(n, 31, "grad"), randn(n, 32, "grad")}};
          },
          [=](Run& r, const Steps& in) {
            Buf<float> p = r.in(in.s0.p), m = r.in(in.s0.m), v = r.in(in.s0.v);
            Buf<uint16_t> m16 = r.zeros<uint16_t>(n), v16 = r.zeros<uint16_t>(n);
            for (int64_t step = 1; step <= 2; ++step) {
              Buf<uint64_t> h = r.zeros<uint64_t>(4);
              const Buf<float> g = r.in(in.grads[static_cast<size_t>(step - 1)]);
              AdamwHashedItem item{p, m, v, g, n, kHp, 0, n, h};
              if (m_low) item.m_bf16 = reinterpret_cast<bf16*>(static_cast<uint16_t*>(m16));
              if (v_low) item.v_bf16 = reinterpret_cast<bf16*>(static_cast<uint16_t*>(v16));
              r.ops.adamw_update_hashed(&item, 1, step, 0.7f);
              r.out(str("step ", step, " param"), p);
              if (m_low)
                r.out(str("step ", step, " m"), m16);
              else
                r.out(str("step ", step, " m"), m);
              if (v_low)
                r.out(str("step ", step, " v"), v16);
              else
                r.out(str("step ", step, " v"), v);
              r.out(str("step ", step, " hashes"), h);
            }
          },
          [=](const Result& got, const Steps& in) {
            // The reference: the fp32 formula on host copies, the bf16 moments rounded after each step.
            std::vector<float> p = in.s0.p, m = in.s0.m, v = in.s0.v;
            for (int64_t step = 1; step <= 2; ++step) {
              SCOPED_TRACE(step);
              const std::vector<float>& g = in.grads[static_cast<size_t>(step - 1)];
              for (int64_t i = 0; i < n; ++i) {
                scalar_adamw(p[i], m[i], v[i], g[i], kHp, step, 0.7f);
                if (m_low) m[i] = to_f32(to_bf16(m[i]));
                if (v_low) v[i] = to_f32(to_bf16(v[i]));
              }
              const std::string s = str("step ", step, " ");
              EXPECT_TRUE(bitwise_equal(got[s + "param"], p, "param"));
              const std::vector<uint64_t> h = got.get<uint64_t>(s + "hashes");
              for (const auto& [low, name, ref, k] :
                   {std::tuple<bool, const char*, const std::vector<float>*, int>{m_low, "m", &m, 1},
                    {v_low, "v", &v, 2}}) {
                if (!low) {
                  EXPECT_TRUE(bitwise_equal(got[s + name], *ref, name));
                  EXPECT_EQ(h[k], hash_floats(ref->data(), n)) << name;
                  continue;
                }
                const std::vector<uint16_t> bits = got.get<uint16_t>(s + name);
                ASSERT_EQ(static_cast<int64_t>(bits.size()), n);
                for (int64_t i = 0; i < n; ++i) ASSERT_EQ(bits[i], to_bf16((*ref)[i]).bits) << name << " element " << i;
                EXPECT_EQ(h[k], hash_bytes(bits.data(), bits.size() * sizeof(uint16_t))) << name;
              }
            }
          });
    }
  }

  // The non-finite flag (the trainer's guard): false for an ordinary update; true when one written
  // parameter overflows to inf (a huge learning rate) or turns NaN (a NaN gradient), wherever it
  // lies (first element, a vector body, the tail), from both forms of the update.
  {
    const int64_t n = 2 * 16384 + 37;
    for (const auto& [what, at] : {std::pair<const char*, int64_t>{"finite", -1},
                                   {"inf (a huge learning rate)", 0},
                                   {"nan in the body", 16384 + 5},
                                   {"nan in the tail", n - 1}}) {
      reg.add(
          {"AdamW", "ReportsANonFiniteParameter", {"adamw_update", "adamw_update_hashed"}, what},
          [=] {
            std::vector<float> g = randn(n, 31, "grad");
            if (at > 0) g[static_cast<size_t>(at)] = std::nanf("");
            return Steps{{randn(n, 31, "param"), std::vector<float>(n, 0.0f), std::vector<float>(n, 0.0f)}, {g}};
          },
          [=](Run& r, const Steps& in) {
            AdamW hp = kHp;
            Buf<float> p = r.in(in.s0.p), m = r.in(in.s0.m), v = r.in(in.s0.v);
            if (at == 0) {  // the step size lr / (1 - beta1) overflows: every parameter turns inf or NaN
              hp.lr = 3e38f;
              hp.weight_decay = 0.0f;
            }
            const Buf<float> g = r.in(in.grads[0]);
            const bool plain = r.ops.adamw_update(p, m, v, g, n, hp, 1, 1.0f);
            Buf<float> p2 = r.in(in.s0.p), m2 = r.in(in.s0.m), v2 = r.in(in.s0.v);
            Buf<uint64_t> h = r.zeros<uint64_t>(4);
            const AdamwHashedItem item{p2, m2, v2, g, n, hp, 0, n, h};
            const bool hashed = r.ops.adamw_update_hashed(&item, 1, 1, 1.0f);
            r.out("flags", std::vector<double>{plain ? 1.0 : 0.0, hashed ? 1.0 : 0.0});
            r.out("param", p);
          },
          [=](const Result& got, const Steps&) {
            const std::vector<double> flags = got.get<double>("flags");
            const std::vector<float> p = got["param"];
            bool any = false;
            for (float x : p) any = any || !std::isfinite(x);
            EXPECT_EQ(any, at >= 0);
            EXPECT_EQ(flags[0], at >= 0 ? 1.0 : 0.0);
            EXPECT_EQ(flags[1], at >= 0 ? 1.0 : 0.0);
          });
    }
  }

  // adam_state_hashes: adamw_update_hashed's hashes of the state as it is, which it leaves alone.
  {
    const int64_t n = 16384 + 99;
    reg.add(
        {"AdamW", "StateHashesWithoutAnUpdate", {"adam_state_hashes"}, str("n=", n)},
        [=] {
          return Steps{{randn(n, 33, "param"), randn(n, 33, "m"), randn(n, 33, "v")}, {randn(n, 33, "grad")}};
        },
        [=](Run& r, const Steps& in) {
          Buf<float> p = r.in(in.s0.p), m = r.in(in.s0.m), v = r.in(in.s0.v);
          const Buf<float> g = r.in(in.grads[0]);
          Buf<uint64_t> h = r.zeros<uint64_t>(4);
          const AdamwHashedItem item{p, m, v, g, n, kHp, 7, n - 3, h};
          r.ops.adam_state_hashes(&item, 1);
          r.out("hashes", h);
          r.out("param", p);
          r.out("m", m);
          r.out("v", v);
        },
        [=](const Result& got, const Steps& in) {
          EXPECT_TRUE(bitwise_equal(got["param"], in.s0.p, "param"));
          EXPECT_TRUE(bitwise_equal(got["m"], in.s0.m, "m"));
          EXPECT_TRUE(bitwise_equal(got["v"], in.s0.v, "v"));
          const std::vector<uint64_t> h = got.get<uint64_t>("hashes");
          ASSERT_EQ(h.size(), 4u);
          EXPECT_EQ(h[0], hash_floats(in.grads[0].data() + 7, n - 10));
          EXPECT_EQ(h[1], hash_floats(in.s0.m.data() + 7, n - 10));
          EXPECT_EQ(h[2], hash_floats(in.s0.v.data() + 7, n - 10));
          EXPECT_EQ(h[3], hash_floats(in.s0.p.data(), n));
        });
  }

  for (int64_t n : {0L, 1L, 15L, 17L, kNormBlock, kNormBlock + 1, 3 * kNormBlock + 100}) {
    reg.add(
        {"SumOfSquares", "MatchesReference", {"sum_of_squares"}, str("n=", n)}, [=] { return randn(n, 24, "x", 3.0f); },
        [=](Run& r, const std::vector<float>& x) { r.out("sum", r.ops.sum_of_squares(r.in(x), n)); },
        [=](const Result& got, const std::vector<float>& x) {
          long double ref = 0.0L;
          for (float xi : x) ref += static_cast<long double>(xi) * xi;
          EXPECT_NEAR(got.f64("sum"), static_cast<double>(ref), 1e-13 * static_cast<double>(ref));
        });
  }

  // Every setting (1 to 3 threads) gives the same bits (the harness compares them); the value
  // against the long double sum.
  {
    const int64_t n = 5 * kNormBlock + 333;
    reg.add(
        {"SumOfSquares", "BitwiseAcrossThreadCounts", {"sum_of_squares"}, str("n=", n)},
        [=] { return randn(n, 25, "x"); },
        [=](Run& r, const std::vector<float>& x) { r.out("sum", r.ops.sum_of_squares(r.in(x), n)); },
        [=](const Result& got, const std::vector<float>& x) {
          long double ref = 0.0L;
          for (float xi : x) ref += static_cast<long double>(xi) * xi;
          EXPECT_NEAR(got.f64("sum"), static_cast<double>(ref), 1e-13 * static_cast<double>(ref));
        });
  }

  // determinism = "layout": the exact sum of squares is the accumulator of the squares added one by
  // one (the same integer), for any split of x and any setting; its value is the sum rounded once.
  for (int64_t n : {0L, 1L, 33L, 3 * kNormBlock + 100}) {
    reg.add(
        {"SumOfSquares", "ExactSumIsTheSumOfEverySquare", {"exact_sum_of_squares"}, str("n=", n)},
        [=] {
          std::vector<float> x = randn(n, 26, "x", 3.0f);
          for (int64_t i = 0; i < n; i += 101) x[i] *= 1e15f;
          for (int64_t i = 50; i < n; i += 103) x[i] *= 1e-20f;
          return x;
        },
        [=](Run& r, const std::vector<float>& x) {
          const Buf<float> d = r.in(x);
          std::vector<uint64_t> words(ExactSum::kWords);
          r.ops.exact_sum_of_squares(d, n).to_words(words.data());
          r.out("sum", words);
          ExactSum split = r.ops.exact_sum_of_squares(d, n / 3);
          split.merge(r.ops.exact_sum_of_squares(d.p() + n / 3, n - n / 3));
          split.to_words(words.data());
          r.out("split sum", words);
        },
        [=](const Result& got, const std::vector<float>& x) {
          ExactSum by_term;
          for (float t : x) by_term.add(static_cast<double>(t) * static_cast<double>(t));
          const ExactSum sum = ExactSum::from_words(got.get<uint64_t>("sum").data());
          EXPECT_TRUE(sum == by_term);
          EXPECT_TRUE(ExactSum::from_words(got.get<uint64_t>("split sum").data()) == by_term);
          long double ref = 0.0L;
          for (float xi : x) ref += static_cast<long double>(xi) * xi;
          EXPECT_NEAR(sum.value(), static_cast<double>(ref), 1e-15 * static_cast<double>(ref));
        });
  }
}

}  // namespace lockstep::harness
