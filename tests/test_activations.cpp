#include "lockstep/kernels/cpu/activations.h"

#include <cmath>
#include <iterator>
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

double gelu_ref(double x) {
  const double u = std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x);
  return 0.5 * x * (1.0 + std::tanh(u));
}
double silu_ref(double g) { return g / (1.0 + std::exp(-g)); }

std::vector<double> swiglu_ref(const std::vector<double>& inp, int64_t N, int64_t H) {
  std::vector<double> out(N * H);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t i = 0; i < H; ++i)
      out[n * H + i] = silu_ref(inp[n * 2 * H + i]) * inp[n * 2 * H + H + i];
  }
  return out;
}

// Random values with a wide spread, plus the saturated and special regions.
std::vector<float> gelu_inputs(int64_t n, uint64_t seed) {
  std::vector<float> x = randn(n, seed, "x", 3.0f);
  const float special[] = {0.0f,  -0.0f,  1.0f,  -1.0f,  5.5f,  -5.5f,
                           10.0f, -10.0f, 20.0f, -20.0f, 1e-20f};
  for (size_t i = 0; i < std::size(special) && i < x.size(); ++i) x[i * 7 % x.size()] = special[i];
  return x;
}

TEST(Activations, GeluForwardMatchesReference) {
  for (int64_t n : {1, 7, 8, 1003}) {
    const std::vector<float> x = gelu_inputs(n, n);
    std::vector<float> out(n);
    gelu_forward(out.data(), x.data(), n);
    std::vector<double> want(n);
    for (int64_t i = 0; i < n; ++i) want[i] = gelu_ref(x[i]);
    EXPECT_TRUE(all_close(out, want, 1e-5, 1e-6, "gelu")) << "n = " << n;
  }
}

TEST(Activations, GeluBackwardMatchesFiniteDifferences) {
  const int64_t n = 203;
  const std::vector<float> x = gelu_inputs(n, 1), R = randn(n, 2, "R");
  std::vector<float> dinp(n, 123.0f);
  gelu_backward(dinp.data(), x.data(), R.data(), n);
  const auto loss = [&](const std::vector<double>& q) {
    double l = 0;
    for (int64_t i = 0; i < n; ++i) l += gelu_ref(q[i]) * R[i];
    return l;
  };
  EXPECT_TRUE(all_close(dinp, finite_difference(loss, to_double(x)), 1e-4, 1e-5, "dinp"));
}

TEST(Activations, SwigluForwardMatchesReference) {
  for (auto [N, H] : {std::pair<int64_t, int64_t>{1, 1}, {3, 8}, {4, 37}, {16, 300}}) {
    const std::vector<float> inp = randn(N * 2 * H, N * 1000 + H, "inp", 3.0f);
    std::vector<float> out(N * H);
    swiglu_forward(out.data(), inp.data(), N, H);
    EXPECT_TRUE(all_close(out, swiglu_ref(to_double(inp), N, H), 1e-5, 1e-6, "out"))
        << "N = " << N << " H = " << H;
  }
}

TEST(Activations, SwigluBackwardMatchesFiniteDifferences) {
  for (auto [N, H] : {std::pair<int64_t, int64_t>{1, 1}, {3, 37}}) {
    const std::vector<float> inp = randn(N * 2 * H, 3, "inp", 3.0f), R = randn(N * H, 4, "R");
    std::vector<float> dinp(N * 2 * H, 123.0f);
    swiglu_backward(dinp.data(), inp.data(), R.data(), N, H);
    const auto loss = [&](const std::vector<double>& q) {
      const std::vector<double> out = swiglu_ref(q, N, H);
      double l = 0;
      for (int64_t i = 0; i < N * H; ++i) l += out[i] * R[i];
      return l;
    };
    EXPECT_TRUE(all_close(dinp, finite_difference(loss, to_double(inp)), 1e-4, 1e-5, "dinp"))
        << "N = " << N << " H = " << H;
  }
}

// Elements computed in vector lanes equal the same elements computed one at a time (the scalar
// path), bit for bit.
TEST(Activations, LanesMatchScalarPathBitwise) {
  const int64_t n = 1003;
  const std::vector<float> x = gelu_inputs(n, 5), d = randn(n, 6, "d");
  std::vector<float> out(n), dinp(n), out1(n), dinp1(n);
  gelu_forward(out.data(), x.data(), n);
  gelu_backward(dinp.data(), x.data(), d.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    gelu_forward(&out1[i], &x[i], 1);
    gelu_backward(&dinp1[i], &x[i], &d[i], 1);
  }
  EXPECT_TRUE(bitwise_equal(out, out1, "gelu forward"));
  EXPECT_TRUE(bitwise_equal(dinp, dinp1, "gelu backward"));

  // swiglu with H = n: the pair (gate[i], up[i]) as a one-element row.
  std::vector<float> sout(n), sdinp(2 * n), sout1(n), sdinp1(2 * n);
  const std::vector<float> inp = randn(2 * n, 7, "inp", 3.0f);
  swiglu_forward(sout.data(), inp.data(), 1, n);
  swiglu_backward(sdinp.data(), inp.data(), d.data(), 1, n);
  for (int64_t i = 0; i < n; ++i) {
    const float pair[2] = {inp[i], inp[n + i]};
    float dpair[2];
    swiglu_forward(&sout1[i], pair, 1, 1);
    swiglu_backward(dpair, pair, &d[i], 1, 1);
    sdinp1[i] = dpair[0];
    sdinp1[n + i] = dpair[1];
  }
  EXPECT_TRUE(bitwise_equal(sout, sout1, "swiglu forward"));
  EXPECT_TRUE(bitwise_equal(sdinp, sdinp1, "swiglu backward"));
}

TEST(Activations, BitwiseIndependentOfThreadCount) {
  const int64_t n = 10007, N = 31, H = 101;
  const std::vector<float> x = gelu_inputs(n, 8), d = randn(n, 9, "d");
  const std::vector<float> inp = randn(N * 2 * H, 10, "inp", 3.0f), dout = randn(N * H, 11, "dout");
  const auto run = [&](int threads) {
    ThreadPool pool(threads);
    ThreadPool::Bind bind(&pool);
    std::vector<std::vector<float>> r = {std::vector<float>(n), std::vector<float>(n),
                                         std::vector<float>(N * H), std::vector<float>(N * 2 * H)};
    gelu_forward(r[0].data(), x.data(), n);
    gelu_backward(r[1].data(), x.data(), d.data(), n);
    swiglu_forward(r[2].data(), inp.data(), N, H);
    swiglu_backward(r[3].data(), inp.data(), dout.data(), N, H);
    return r;
  };
  const auto one = run(1);
  const char* names[] = {"gelu forward", "gelu backward", "swiglu forward", "swiglu backward"};
  for (int threads : {2, 3}) {
    const auto r = run(threads);
    for (int k = 0; k < 4; ++k) {
      EXPECT_TRUE(bitwise_equal(r[k], one[k], names[k])) << threads << " threads";
    }
  }
}

}  // namespace
}  // namespace lockstep
