// GELU (tanh) and SwiGLU (kernels/activations.h) on every backend: against the double formulas,
// central differences, element by element (vector lanes = one element at a time), and the thread
// settings.
#include <cmath>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "../op_harness.h"
#include "../testing.h"
#include "lockstep/core/error.h"

namespace lockstep::harness {
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
double gelu_grad_ref(double x) {
  const double k = std::sqrt(2.0 / M_PI), u = k * (x + 0.044715 * x * x * x), t = std::tanh(u);
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3 * 0.044715 * x * x);
}
double sigmoid(double g) { return 1.0 / (1.0 + std::exp(-g)); }
double silu_ref(double g) { return g / (1.0 + std::exp(-g)); }

std::vector<double> swiglu_ref(const std::vector<double>& inp, int64_t N, int64_t H) {
  std::vector<double> out(N * H);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t i = 0; i < H; ++i) out[n * H + i] = silu_ref(inp[n * 2 * H + i]) * inp[n * 2 * H + H + i];
  }
  return out;
}
// d(sum out * dout) / d inp, analytically in double.
std::vector<double> swiglu_grad_ref(const std::vector<float>& inp, const std::vector<float>& dout, int64_t N,
                                    int64_t H) {
  std::vector<double> d(N * 2 * H);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < H; ++i) {
      const double g = inp[n * 2 * H + i], u = inp[n * 2 * H + H + i], s = sigmoid(g), go = dout[n * H + i];
      d[n * 2 * H + i] = go * u * s * (1.0 + g * (1.0 - s));
      d[n * 2 * H + H + i] = go * g * s;
    }
  return d;
}

// Random values with a wide spread, plus the saturated and special regions.
std::vector<float> gelu_inputs(int64_t n, uint64_t seed) {
  std::vector<float> x = randn(n, seed, "x", 3.0f);
  const float special[] = {0.0f, -0.0f, 1.0f, -1.0f, 5.5f, -5.5f, 10.0f, -10.0f, 20.0f, -20.0f, 1e-20f};
  for (size_t i = 0; i < std::size(special) && i < x.size(); ++i) x[i * 7 % x.size()] = special[i];
  return x;
}

struct Pair {
  std::vector<float> x, d;
};

}  // namespace

void add_activation_cases(Registry& reg) {
  for (int64_t n : {1, 7, 8, 1003}) {
    reg.add(
        {"Activations", "GeluForwardMatchesReference", {"gelu_forward"}, str("n=", n)},
        [=] { return gelu_inputs(n, n); },
        [=](Run& r, const std::vector<float>& x) {
          const Buf<float> in = r.in(x);
          Buf<float> out = r.zeros(n);
          r.ops.gelu_forward(out, in, n);
          r.out("gelu", out);
        },
        [=](const Result& got, const std::vector<float>& x) {
          std::vector<double> want(n);
          for (int64_t i = 0; i < n; ++i) want[i] = gelu_ref(x[i]);
          EXPECT_TRUE(all_close(got["gelu"], want, 1e-5, 1e-6, "gelu"));
        });
  }

  {
    const int64_t n = 203;
    reg.add(
        {"Activations", "GeluBackwardMatchesFiniteDifferences", {"gelu_backward"}, str("n=", n)},
        [=] {
          return Pair{gelu_inputs(n, 1), randn(n, 2, "R")};
        },
        [=](Run& r, const Pair& in) {
          const Buf<float> x = r.in(in.x), R = r.in(in.d);
          Buf<float> dinp = r.full(n, 123.0f);
          r.ops.gelu_backward(dinp, x, R, n);
          r.out("dinp", dinp);
        },
        [=](const Result& got, const Pair& in) {
          const auto loss = [&](const std::vector<double>& q) {
            double l = 0;
            for (int64_t i = 0; i < n; ++i) l += gelu_ref(q[i]) * in.d[i];
            return l;
          };
          EXPECT_TRUE(all_close(got["dinp"], finite_difference(loss, to_double(in.x)), 1e-4, 1e-5, "dinp"));
        });
  }

  for (auto [N, H] : {std::pair<int64_t, int64_t>{1, 1}, {3, 8}, {4, 37}, {16, 300}}) {
    reg.add(
        {"Activations", "SwigluForwardMatchesReference", {"swiglu_forward"}, str("N=", N, " H=", H)},
        [=] { return randn(N * 2 * H, N * 1000 + H, "inp", 3.0f); },
        [=](Run& r, const std::vector<float>& inp) {
          const Buf<float> in = r.in(inp);
          Buf<float> out = r.zeros(N * H);
          r.ops.swiglu_forward(out, in, N, H);
          r.out("out", out);
        },
        [=](const Result& got, const std::vector<float>& inp) {
          EXPECT_TRUE(all_close(got["out"], swiglu_ref(to_double(inp), N, H), 1e-5, 1e-6, "out"));
        });
  }

  for (auto [N, H] : {std::pair<int64_t, int64_t>{1, 1}, {3, 37}}) {
    reg.add(
        {"Activations", "SwigluBackwardMatchesFiniteDifferences", {"swiglu_backward"}, str("N=", N, " H=", H)},
        [=] {
          return Pair{randn(N * 2 * H, 3, "inp", 3.0f), randn(N * H, 4, "R")};
        },
        [=](Run& r, const Pair& in) {
          const Buf<float> inp = r.in(in.x), R = r.in(in.d);
          Buf<float> dinp = r.full(N * 2 * H, 123.0f);
          r.ops.swiglu_backward(dinp, inp, R, N, H);
          r.out("dinp", dinp);
        },
        [=](const Result& got, const Pair& in) {
          const auto loss = [&](const std::vector<double>& q) {
            const std::vector<double> out = swiglu_ref(q, N, H);
            double l = 0;
            for (int64_t i = 0; i < N * H; ++i) l += out[i] * in.d[i];
            return l;
          };
          EXPECT_TRUE(all_close(got["dinp"], finite_difference(loss, to_double(in.x)), 1e-4, 1e-5, "dinp"));
          EXPECT_TRUE(all_close(got["dinp"], swiglu_grad_ref(in.x, in.d, N, H), 1e-4, 1e-5, "dinp analytic"));
        });
  }

  // Elements computed in vector lanes equal the same elements computed one at a time (n = 1: the
  // scalar path), bit for bit.
  {
    const int64_t n = 1003;
    struct In {
      std::vector<float> x, d, inp;
    };
    reg.add(
        {"Activations",
         "LanesMatchScalarPathBitwise",
         {"gelu_forward", "gelu_backward", "swiglu_forward", "swiglu_backward"},
         str("n=", n)},
        [=] {
          return In{gelu_inputs(n, 5), randn(n, 6, "d"), randn(2 * n, 7, "inp", 3.0f)};
        },
        [=](Run& r, const In& in) {
          const Buf<float> x = r.in(in.x), d = r.in(in.d);
          Buf<float> out = r.zeros(n), dinp = r.zeros(n), out1 = r.zeros(n), dinp1 = r.zeros(n);
          r.ops.gelu_forward(out, x, n);
          r.ops.gelu_backward(dinp, x, d, n);
          for (int64_t i = 0; i < n; ++i) {
            r.ops.gelu_forward(out1.p() + i, x.p() + i, 1);
            r.ops.gelu_backward(dinp1.p() + i, x.p() + i, d.p() + i, 1);
          }
          r.out("gelu forward", out);
          r.out("gelu backward", dinp);
          r.out("gelu forward, one at a time", out1);
          r.out("gelu backward, one at a time", dinp1);
          // swiglu with H = n: the pair (gate[i], up[i]) as a one-element row.
          const Buf<float> inp = r.in(in.inp);
          Buf<float> sout = r.zeros(n), sdinp = r.zeros(2 * n), pair = r.zeros(2), dpair = r.zeros(2);
          r.ops.swiglu_forward(sout, inp, 1, n);
          r.ops.swiglu_backward(sdinp, inp, d, 1, n);
          std::vector<float> sout1(n), sdinp1(2 * n);
          for (int64_t i = 0; i < n; ++i) {
            r.put(pair, {in.inp[i], in.inp[n + i]});
            Buf<float> o = r.zeros(1);
            r.ops.swiglu_forward(o, pair, 1, 1);
            r.ops.swiglu_backward(dpair, pair, d.p() + i, 1, 1);
            sout1[i] = r.get(o)[0];
            const std::vector<float> dp = r.get(dpair);
            sdinp1[i] = dp[0];
            sdinp1[n + i] = dp[1];
          }
          r.out("swiglu forward", sout);
          r.out("swiglu backward", sdinp);
          r.out("swiglu forward, one at a time", sout1);
          r.out("swiglu backward, one at a time", sdinp1);
        },
        [=](const Result& got, const In&) {
          for (const char* what : {"gelu forward", "gelu backward", "swiglu forward", "swiglu backward"}) {
            EXPECT_TRUE(bitwise_equal(got[what], got[std::string(what) + ", one at a time"], what));
          }
        });
  }

  // Every setting (1, 2, 3 threads on the CPU) gives the same bits; against the double formulas.
  {
    const int64_t n = 10007, N = 31, H = 101;
    struct In {
      std::vector<float> x, d, inp, dout;
    };
    reg.add(
        {"Activations",
         "BitwiseIndependentOfThreadCount",
         {"gelu_forward", "gelu_backward", "swiglu_forward", "swiglu_backward"},
         str("n=", n, " N=", N, " H=", H)},
        [=] {
          return In{gelu_inputs(n, 8), randn(n, 9, "d"), randn(N * 2 * H, 10, "inp", 3.0f), randn(N * H, 11, "dout")};
        },
        [=](Run& r, const In& in) {
          const Buf<float> x = r.in(in.x), d = r.in(in.d), inp = r.in(in.inp), dout = r.in(in.dout);
          Buf<float> a = r.zeros(n), b = r.zeros(n), c = r.zeros(N * H), e = r.zeros(N * 2 * H);
          r.ops.gelu_forward(a, x, n);
          r.ops.gelu_backward(b, x, d, n);
          r.ops.swiglu_forward(c, inp, N, H);
          r.ops.swiglu_backward(e, inp, dout, N, H);
          r.out("gelu forward", a);
          r.out("gelu backward", b);
          r.out("swiglu forward", c);
          r.out("swiglu backward", e);
        },
        [=](const Result& got, const In& in) {
          std::vector<double> f(n), g(n);
          for (int64_t i = 0; i < n; ++i) f[i] = gelu_ref(in.x[i]), g[i] = gelu_grad_ref(in.x[i]) * in.d[i];
          EXPECT_TRUE(all_close(got["gelu forward"], f, 1e-5, 1e-6, "gelu forward"));
          EXPECT_TRUE(all_close(got["gelu backward"], g, 1e-4, 1e-5, "gelu backward"));
          EXPECT_TRUE(
              all_close(got["swiglu forward"], swiglu_ref(to_double(in.inp), N, H), 1e-5, 1e-6, "swiglu forward"));
          EXPECT_TRUE(
              all_close(got["swiglu backward"], swiglu_grad_ref(in.inp, in.dout, N, H), 1e-4, 1e-5, "swiglu backward"));
        });
  }
}

}  // namespace lockstep::harness
