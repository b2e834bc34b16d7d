#include "lockstep/kernels/cpu/optimizer.h"

#include <bit>
#include <cmath>
#include <string>
#include <vector>

#include "lockstep/core/error.h"
#include "lockstep/core/hash.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/train/optimizer.h"
#include "testing.h"

namespace lockstep {
namespace {

using testing::all_close;
using testing::with_threads;
using testing::bitwise_equal;
using testing::randn;

const AdamW kHp{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};

// The formula of the header, in double, over the same hyperparameter values.
void ref_adamw(std::vector<double>& p, std::vector<double>& m, std::vector<double>& v,
               const std::vector<float>& grad, const AdamW& hp, int64_t step, double grad_scale) {
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

TEST(AdamW, MatchesDoubleReferenceOverSeveralSteps) {
  const int64_t n = 1003;  // not a multiple of the vector width
  const float grad_scale = 0.5f;
  auto p = randn(n, 20, "param");
  std::vector<float> m(n, 0.0f), v(n, 0.0f);
  auto rp = testing::to_double(p);
  std::vector<double> rm(n, 0.0), rv(n, 0.0);
  for (int64_t step = 1; step <= 6; ++step) {
    SCOPED_TRACE(step);
    const auto grad = randn(n, 20 + step, "grad");
    adamw_update(p.data(), m.data(), v.data(), grad.data(), n, kHp, step, grad_scale);
    ref_adamw(rp, rm, rv, grad, kHp, step, grad_scale);
    EXPECT_TRUE(all_close(m, rm, 1e-5, 1e-7, "m"));
    EXPECT_TRUE(all_close(v, rv, 1e-5, 1e-9, "v"));
    // The update is about lr in size; allow a relative 1e-5 of it on top of the rounding of p.
    EXPECT_TRUE(all_close(p, rp, 1e-6, 1e-5 * kHp.lr, "param"));
  }
}

// The header's operations, one fp32 rounding each, scalars computed in double: the vectorised
// kernel must give exactly these bits.
TEST(AdamW, BitwiseEqualToScalarFormula) {
  const int64_t n = 77;
  const int64_t step = 3;
  const float grad_scale = 0.75f;
  const auto grad = randn(n, 21, "grad");
  auto p = randn(n, 21, "param");
  auto m = randn(n, 21, "m", 0.1f);
  auto v = randn(n, 21, "v", 0.1f);
  for (float& x : v) x = x * x;
  auto sp = p, sm = m, sv = v;
  adamw_update(p.data(), m.data(), v.data(), grad.data(), n, kHp, step, grad_scale);
  const double lr = kHp.lr;
  const float decay = static_cast<float>(1.0 - lr * static_cast<double>(kHp.weight_decay));
  const float c1 = static_cast<float>(1.0 - static_cast<double>(kHp.beta1));
  const float c2 = static_cast<float>(1.0 - static_cast<double>(kHp.beta2));
  const float step_size = static_cast<float>(lr / (1.0 - std::pow(double(kHp.beta1), step)));
  const float bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(double(kHp.beta2), step)));
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] * grad_scale;
    sp[i] = sp[i] * decay;
    sm[i] = kHp.beta1 * sm[i] + c1 * g;
    sv[i] = kHp.beta2 * sv[i] + c2 * g * g;
    sp[i] = sp[i] - step_size * sm[i] / (std::sqrt(sv[i]) / bc2_sqrt + kHp.eps);
  }
  EXPECT_TRUE(bitwise_equal(p, sp, "param"));
  EXPECT_TRUE(bitwise_equal(m, sm, "m"));
  EXPECT_TRUE(bitwise_equal(v, sv, "v"));
}

// First step without decay: m / sqrt(v) is g / |g|, so every parameter moves by lr against the
// sign of its gradient.
TEST(AdamW, FirstStepMovesByLearningRate) {
  const int64_t n = 20;
  const AdamW hp{.lr = 1e-3f};
  auto p = randn(n, 22, "param");
  const auto p0 = p;
  const auto grad = randn(n, 22, "grad");
  std::vector<float> m(n, 0.0f), v(n, 0.0f);
  adamw_update(p.data(), m.data(), v.data(), grad.data(), n, hp, 1, 1.0f);
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_NEAR(p[i], p0[i] - std::copysign(1e-3f, grad[i]), 1e-6) << i;
  }
}

TEST(AdamW, RejectsStepZero) {
  float p = 1, m = 0, v = 0, g = 1;
  EXPECT_THROW(adamw_update(&p, &m, &v, &g, 1, kHp, 0, 1.0f), InternalError);
}

TEST(AdamW, BitwiseAcrossThreadCounts) {
  const int64_t n = 100003;
  const auto grad = randn(n, 23, "grad");
  std::vector<float> p[4], m[4], v[4];
  for (int threads = 1; threads <= 3; ++threads) {
    p[threads] = randn(n, 23, "param");
    m[threads].assign(n, 0.0f);
    v[threads].assign(n, 0.0f);
    with_threads(threads, [&] {
      for (int64_t step = 1; step <= 2; ++step)
        adamw_update(p[threads].data(), m[threads].data(), v[threads].data(), grad.data(), n, kHp,
                     step, 0.9f);
    });
  }
  for (int threads = 2; threads <= 3; ++threads) {
    EXPECT_TRUE(bitwise_equal(p[1], p[threads], "param"));
    EXPECT_TRUE(bitwise_equal(m[1], m[threads], "m"));
    EXPECT_TRUE(bitwise_equal(v[1], v[threads], "v"));
  }
}

// The fused form: the same bits as adamw_update, XXH3 of the gradient as read and of the moments
// as written over the state range, and of the parameters as written over all n; over several
// 16384-element pieces and a tail, with state ranges that cut pieces, are empty or are everything.
TEST(AdamW, HashedUpdateGivesTheSameBitsAndHashesTheGradientMomentsAndParameters) {
  const int64_t n = 3 * 16384 + 777;
  const auto grad = randn(n, 29, "grad");
  for (const auto& [sb, se] : {std::pair<int64_t, int64_t>{0, n}, {100, 2 * 16384 + 5}, {16384, 16384}, {n - 1, n}}) {
    SCOPED_TRACE(::testing::Message() << "state [" << sb << ", " << se << ")");
    std::vector<float> p = randn(n, 29, "param"), m(n, 0.0f), v(n, 0.0f);
    std::vector<float> p2 = p, m2 = m, v2 = v;
    for (int64_t step = 1; step <= 2; ++step) {
      uint64_t h[4];
      adamw_update_hashed(p.data(), m.data(), v.data(), grad.data(), n, kHp, step, 0.7f, sb, se, h);
      adamw_update(p2.data(), m2.data(), v2.data(), grad.data(), n, kHp, step, 0.7f);
      EXPECT_TRUE(bitwise_equal(p, p2, "param"));
      EXPECT_TRUE(bitwise_equal(m, m2, "m"));
      EXPECT_TRUE(bitwise_equal(v, v2, "v"));
      EXPECT_EQ(h[0], hash_floats(grad.data() + sb, se - sb));
      EXPECT_EQ(h[1], hash_floats(m.data() + sb, se - sb));
      EXPECT_EQ(h[2], hash_floats(v.data() + sb, se - sb));
      EXPECT_EQ(h[3], hash_floats(p.data(), n));
    }
  }
}

// A parameter table with one parameter of three 1 MiB hash blocks' worth (the last one short) and
// two small ones; grads random.
ParamStore hash_table() {
  ParamStore ps;
  ps.add("big", Shape{2 * 262144 + 1000}, Init::normal, 0.02f, true);
  ps.add("small", Shape{10}, Init::ones);
  ps.add("mid", Shape{5000}, Init::normal, 0.02f, true);
  ps.allocate();
  ps.init(5);
  const auto g = randn(ps.total(), 31, "grads");
  std::copy(g.begin(), g.end(), ps.grads());
  return ps;
}

// The fingerprint's shard hashes taken inside the update equal BlockHasher over the shard's
// gradients and (Optimizer::hash) moments after a plain update, each range on its parameter's own
// grid, which they leave bitwise alone; with 1, 2 and 3 threads; whether one update call covers
// the shard (replicated optimizer, shard ranges inside whole parameters, the parameters' values
// hashed too) or two calls do (the distributed optimizer's buckets).
TEST(ShardHashes, EqualBlockHashesAfterAPlainUpdateForAnyThreadsAndCalls) {
  const std::vector<ParamRange> shard = {{0, 1000, 2 * 262144 + 900}, {2, 100, 4000}, {1, 0, 10}};
  ParamStore plain = hash_table();
  Optimizer reference(plain, OptimizerConfig{});
  reference.update(plain, 1, 1e-2, 0.5f);
  BlockHasher grads, values;
  for (const ParamRange& r : shard) grads.update_elements(plain.grad(r.param) + r.begin, r.begin, r.end);
  for (int p = 0; p < 3; ++p) values.update(plain.value(p), static_cast<size_t>(plain.specs()[p].shape.numel()) * sizeof(float));
  const std::vector<float> params(plain.values(), plain.values() + plain.total());
  for (int threads = 1; threads <= 3; ++threads)
    with_threads(threads, [&] {
      ParamStore ps = hash_table();
      Optimizer opt(ps, OptimizerConfig{});
      ShardHashes h(shard, &ps);
      opt.update(ps, 1, 1e-2, 0.5f, opt.owned(), &h);
      EXPECT_TRUE(bitwise_equal(params, std::vector<float>(ps.values(), ps.values() + ps.total()), "params"));
      EXPECT_EQ(h.grads(), grads.digest()) << threads << " threads";
      EXPECT_EQ(h.moments(), reference.hash(shard)) << threads << " threads";
      EXPECT_EQ(h.params(), values.block_hashes()) << threads << " threads";
      // Owning the shard only, updated in two calls in another order.
      ParamStore ps2 = hash_table();
      Optimizer own(ps2, OptimizerConfig{}, shard);
      ShardHashes h2(shard);
      own.update(ps2, 1, 1e-2, 0.5f, {shard[2], shard[1]}, &h2);
      EXPECT_THROW(h2.grads(), InternalError) << "a range not updated yet";
      own.update(ps2, 1, 1e-2, 0.5f, {shard[0]}, &h2);
      EXPECT_EQ(h2.grads(), grads.digest());
      EXPECT_EQ(h2.moments(), reference.hash(shard));
      EXPECT_THROW(h2.params(), InternalError) << "made without the parameters";
    });
  // The grid is the parameter's: a range starting inside a block hashes that block's rest as one.
  EXPECT_NE(grads.digest(), [&] {
    BlockHasher from_range_start;
    for (const ParamRange& r : shard)
      from_range_start.update(plain.grad(r.param) + r.begin, static_cast<size_t>(r.end - r.begin) * sizeof(float));
    return from_range_start.digest();
  }());
  // A covered part split over two update calls cannot be hashed in one pass; with the parameters
  // covered, a parameter updated in part cannot either.
  ParamStore ps = hash_table();
  Optimizer opt(ps, OptimizerConfig{});
  ShardHashes h(shard);
  EXPECT_THROW(opt.update(ps, 1, 1e-2, 0.5f, {{0, 0, 5000}}, &h), InternalError);
  ShardHashes with_params(shard, &ps);
  EXPECT_THROW(opt.update(ps, 1, 1e-2, 0.5f, {{2, 0, 4500}}, &with_params), InternalError);
}

TEST(SumOfSquares, MatchesReference) {
  for (int64_t n : {0L, 1L, 15L, 17L, kNormBlock, kNormBlock + 1, 3 * kNormBlock + 100}) {
    SCOPED_TRACE(n);
    const auto x = randn(n, 24, "x", 3.0f);
    long double ref = 0.0L;
    for (float xi : x) ref += static_cast<long double>(xi) * xi;
    const double got = sum_of_squares(x.data(), n);
    EXPECT_NEAR(got, static_cast<double>(ref), 1e-13 * static_cast<double>(ref));
  }
}

TEST(SumOfSquares, BitwiseAcrossThreadCounts) {
  const int64_t n = 5 * kNormBlock + 333;
  const auto x = randn(n, 25, "x");
  double got[4];
  for (int threads = 1; threads <= 3; ++threads)
    with_threads(threads, [&] { got[threads] = sum_of_squares(x.data(), n); });
  for (int threads = 2; threads <= 3; ++threads)
    EXPECT_EQ(std::bit_cast<uint64_t>(got[1]), std::bit_cast<uint64_t>(got[threads])) << threads;
}

}  // namespace
}  // namespace lockstep
