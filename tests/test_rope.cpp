#include "lockstep/kernels/cpu/rope.h"

#include <cmath>
#include <vector>

#include "lockstep/core/thread_pool.h"
#include "testing.h"

namespace lockstep {
namespace {

using testing::all_close;
using testing::bitwise_equal;
using testing::finite_difference;
using testing::randn;
using testing::to_double;

constexpr double kTheta = 10000.0;

struct RopeCase {
  int64_t B, T, heads, HS, row_stride;
  int64_t N() const { return B * T; }
  int64_t half() const { return HS / 2; }
};

struct Table {
  std::vector<float> cos, sin;
};
Table make_table(const RopeCase& k) {
  Table t{std::vector<float>(k.T * k.half()), std::vector<float>(k.T * k.half())};
  rope_table(t.cos.data(), t.sin.data(), k.T, k.HS, kTheta);
  return t;
}

// Calls f(lo, hi, j) for every rotated pair: lo and hi index the rows, j the table.
template <class F>
void for_each_pair(const RopeCase& k, F f) {
  const int64_t half = k.half();
  for (int64_t n = 0; n < k.N(); ++n) {
    for (int64_t h = 0; h < k.heads; ++h) {
      for (int64_t i = 0; i < half; ++i) {
        const int64_t lo = n * k.row_stride + h * k.HS + i;
        f(lo, lo + half, (n % k.T) * half + i);
      }
    }
  }
}

// Double-precision rotation with the table's values; elements outside the heads pass through.
std::vector<double> rope_ref(const RopeCase& k, const Table& t, const std::vector<double>& x) {
  std::vector<double> y = x;
  for_each_pair(k, [&](int64_t lo, int64_t hi, int64_t j) {
    const double c = t.cos[j], s = t.sin[j];
    y[lo] = x[lo] * c - x[hi] * s;
    y[hi] = x[hi] * c + x[lo] * s;
  });
  return y;
}

// Head sizes whose half is below 8, a multiple of 8, and 8k plus a tail; rows with values after
// the rotated heads (the v part of qkv) that must stay untouched.
const RopeCase kCases[] = {
    {1, 3, 1, 2, 2}, {2, 5, 3, 10, 47}, {2, 3, 2, 32, 96}, {1, 4, 3, 36, 3 * 36 + 5}};

TEST(Rope, TableMatchesDoubleAngles) {
  for (auto [T, HS] : {std::pair<int64_t, int64_t>{7, 10}, {2048, 64}}) {
    const int64_t half = HS / 2;
    std::vector<float> c(T * half), s(T * half);
    rope_table(c.data(), s.data(), T, HS, kTheta);
    std::vector<double> want_c(T * half), want_s(T * half);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t i = 0; i < half; ++i) {
        const double angle = t * std::pow(kTheta, -2.0 * i / HS);
        want_c[t * half + i] = std::cos(angle);
        want_s[t * half + i] = std::sin(angle);
      }
    }
    // One rounding to float: half an ulp, plus slack for the double angle's own rounding.
    EXPECT_TRUE(all_close(c, want_c, 6e-8, 1e-12, "cos"));
    EXPECT_TRUE(all_close(s, want_s, 6e-8, 1e-12, "sin"));
  }
}

TEST(Rope, ForwardMatchesReference) {
  for (const RopeCase& k : kCases) {
    SCOPED_TRACE(::testing::Message() << "HS=" << k.HS << " heads=" << k.heads);
    const Table t = make_table(k);
    const std::vector<float> x0 = randn(k.N() * k.row_stride, k.HS, "x");
    std::vector<float> x = x0;
    rope_forward(x.data(), t.cos.data(), t.sin.data(), k.N(), k.T, k.heads, k.HS, k.row_stride);
    EXPECT_TRUE(all_close(x, rope_ref(k, t, to_double(x0)), 1e-6, 1e-6, "x"));
    for (int64_t n = 0; n < k.N(); ++n) {
      const int64_t rotated = k.heads * k.HS;
      EXPECT_TRUE(bitwise_equal(x.data() + n * k.row_stride + rotated,
                                x0.data() + n * k.row_stride + rotated, k.row_stride - rotated,
                                "untouched"));
    }
  }
}

// The backward (in place on the gradient) against central differences of sum(rope(x) * R).
TEST(Rope, BackwardMatchesFiniteDifferences) {
  for (const RopeCase& k : kCases) {
    SCOPED_TRACE(::testing::Message() << "HS=" << k.HS << " heads=" << k.heads);
    const Table t = make_table(k);
    const int64_t n = k.N() * k.row_stride;
    const std::vector<float> x = randn(n, 1, "x"), R = randn(n, 2, "R");
    std::vector<float> dx = R;
    rope_backward(dx.data(), t.cos.data(), t.sin.data(), k.N(), k.T, k.heads, k.HS, k.row_stride);
    const auto loss = [&](const std::vector<double>& q) {
      const std::vector<double> y = rope_ref(k, t, q);
      double l = 0;
      for (int64_t i = 0; i < n; ++i) l += y[i] * R[i];
      return l;
    };
    EXPECT_TRUE(all_close(dx, finite_difference(loss, to_double(x)), 1e-5, 1e-6, "dx"));
  }
}

// Every element, in a vector lane or in the scalar tail, is the documented float formula.
TEST(Rope, LanesComputeTheScalarFormulaBitwise) {
  const RopeCase k{1, 4, 3, 36, 3 * 36 + 5};
  const Table t = make_table(k);
  const std::vector<float> x0 = randn(k.N() * k.row_stride, 4, "x");
  std::vector<float> fwd = x0, bwd = x0, want_fwd = x0, want_bwd = x0;
  rope_forward(fwd.data(), t.cos.data(), t.sin.data(), k.N(), k.T, k.heads, k.HS, k.row_stride);
  rope_backward(bwd.data(), t.cos.data(), t.sin.data(), k.N(), k.T, k.heads, k.HS, k.row_stride);
  for_each_pair(k, [&](int64_t lo, int64_t hi, int64_t j) {
    const float c = t.cos[j], s = t.sin[j], a = x0[lo], b = x0[hi];
    want_fwd[lo] = std::fma(a, c, -(b * s));
    want_fwd[hi] = std::fma(b, c, a * s);
    want_bwd[lo] = std::fma(a, c, b * s);
    want_bwd[hi] = std::fma(b, c, -(a * s));
  });
  EXPECT_TRUE(bitwise_equal(fwd, want_fwd, "forward"));
  EXPECT_TRUE(bitwise_equal(bwd, want_bwd, "backward"));
}

TEST(Rope, BitwiseIndependentOfThreadCount) {
  const RopeCase k{2, 13, 6, 36, 3 * 6 * 36};
  const Table t = make_table(k);
  const std::vector<float> x0 = randn(k.N() * k.row_stride, 5, "x");
  const auto run = [&](int threads) {
    ThreadPool pool(threads);
    ThreadPool::Bind bind(&pool);
    std::vector<float> fwd = x0, bwd = x0;
    rope_forward(fwd.data(), t.cos.data(), t.sin.data(), k.N(), k.T, k.heads, k.HS, k.row_stride);
    rope_backward(bwd.data(), t.cos.data(), t.sin.data(), k.N(), k.T, k.heads, k.HS, k.row_stride);
    return std::pair{fwd, bwd};
  };
  const auto one = run(1);
  for (int threads : {2, 3}) {
    const auto r = run(threads);
    EXPECT_TRUE(bitwise_equal(r.first, one.first, "forward")) << threads << " threads";
    EXPECT_TRUE(bitwise_equal(r.second, one.second, "backward")) << threads << " threads";
  }
}

}  // namespace
}  // namespace lockstep
