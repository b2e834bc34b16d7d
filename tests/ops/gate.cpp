// The shared expert's sigmoid gate (kernels/gate.h) on every backend: the forward and the three
// backward ops bit for bit against the expressions the contract fixes (the FMA chain over C,
// glibc's expf through core/libm.h, the token order or the canonical tree over token segments),
// against a double forward, and the backward ops against central differences of that double
// forward; the token segments split over parts as determinism = "layout" needs.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "../op_harness.h"
#include "../testing.h"
#include "lockstep/core/error.h"
#include "lockstep/core/libm.h"
#include "lockstep/core/tree_sum.h"

namespace lockstep::harness {
namespace {

using testing::all_close;
using testing::bitwise_equal;
using testing::finite_difference;
using testing::randn;

struct In {
  int64_t N, C;
  std::vector<float> x, w, y, base, dout, dx_expert, dw0, dx0, dlogit0;
};

In make(int64_t N, int64_t C, uint64_t seed) {
  In in;
  in.N = N, in.C = C;
  in.x = randn(N * C, seed, "x");
  in.w = randn(C, seed, "w", 1.0f / std::sqrt(static_cast<float>(C)));  // <x_t, w> ~ N(0, 1)
  in.y = randn(N * C, seed, "y");
  in.base = randn(N * C, seed, "base");
  in.dout = randn(N * C, seed, "dout");
  in.dx_expert = randn(N * C, seed, "dx_expert");
  in.dw0 = randn(C, seed, "dw0");
  in.dx0 = randn(N * C, seed, "dx0");
  in.dlogit0 = randn(N, seed, "dlogit0");
  return in;
}

// The contract's fp32 expressions, serially.
struct Exact {
  std::vector<float> out, g, dy, dlogit, dw, dx;
};
Exact exact(const In& in, bool gated) {
  const int64_t N = in.N, C = in.C;
  Exact e{std::vector<float>(N * C),
          std::vector<float>(N),
          std::vector<float>(N * C),
          std::vector<float>(N),
          in.dw0,
          in.dx0};
  for (int64_t t = 0; t < N; ++t) {
    float g = 1.0f;
    if (gated) {
      float dot = 0.0f;
      for (int64_t c = 0; c < C; ++c) dot = std::fma(in.x[t * C + c], in.w[c], dot);
      g = 1.0f / (1.0f + libm::expf(-dot));
    }
    e.g[t] = g;
    float d = 0.0f;
    for (int64_t c = 0; c < C; ++c) {
      const float gy = g * in.y[t * C + c];
      e.out[t * C + c] = in.base[t * C + c] + (gated ? gy : in.y[t * C + c]);
      e.dy[t * C + c] = gated ? g * in.dout[t * C + c] : in.dout[t * C + c];
      d = std::fma(in.dout[t * C + c], in.y[t * C + c], d);
    }
    const float dg = d * g;
    e.dlogit[t] = dg * (1.0f - g);
  }
  // dw += dlogit_t x_t in token order; dx += dx_expert + dlogit_t w (w null: + 0).
  for (int64_t t = 0; t < N; ++t)
    for (int64_t c = 0; c < C; ++c) {
      const float p = e.dlogit[t] * in.x[t * C + c];
      e.dw[c] = e.dw[c] + p;
      const float q = gated ? e.dlogit[t] * in.w[c] : 0.0f;
      e.dx[t * C + c] = e.dx[t * C + c] + (in.dx_expert[t * C + c] + q);
    }
  return e;
}

// The double forward of token t: out_t = base_t + sigmoid(<x_t, w>) y_t (w null: base_t + y_t).
double sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }
double dot(const double* a, const double* b, int64_t C) {
  double s = 0;
  for (int64_t c = 0; c < C; ++c) s += a[c] * b[c];
  return s;
}

// Forward, then the three backward ops with dout: gate_backward into fresh dy and dlogit (dlogit
// starts as dlogit0: assigned when gated), gate_weight_grad into dw0 (segments), gate_input_grad
// into dx0.
void run_gate(Run& r, const In& in, bool gated, int64_t segments) {
  const int64_t N = in.N, C = in.C;
  const Buf<float> x = r.in(in.x), w = r.in(in.w), y = r.in(in.y), base = r.in(in.base), dout = r.in(in.dout),
                   dx_expert = r.in(in.dx_expert);
  Buf<float> out = r.in(randn(N * C, 99, "out")), g = r.in(randn(N, 99, "g"));
  r.ops.gate_forward(out, g, base, x, gated ? w.p() : nullptr, y, N, C);
  Buf<float> dy = r.in(randn(N * C, 99, "dy")), dlogit = r.in(in.dlogit0), dw = r.in(in.dw0), dx = r.in(in.dx0);
  r.ops.gate_backward(dy, dlogit, dout, y, g, gated, N, C);
  if (gated) r.ops.gate_weight_grad(dw, dlogit, x, N, C, segments);
  r.ops.gate_input_grad(dx, dx_expert, dlogit, gated ? w.p() : nullptr, N, C);
  r.out("out", out);
  r.out("g", g);
  r.out("dy", dy);
  if (gated) r.out("dlogit", dlogit);
  if (gated) r.out("dw", dw);
  r.out("dx", dx);
}

}  // namespace

void add_gate_cases(Registry& reg) {
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{0, 4}, {1, 1}, {7, 5}, {37, 130}, {301, 33}};

  // Every op's fp32 expression bit for bit (the weight gradient in token order), gated and not
  // (w null: g = 1, out = base + y, dy = dout, dx += dx_expert + 0); the forward within a tolerance
  // of the double forward.
  for (const auto& shape : shapes)
    for (const bool gated : {true, false}) {
      const int64_t N = shape.first, C = shape.second;
      reg.add(
          {"Gate",
           "ForwardAndBackwardAreTheirExpressions",
           {"gate_forward", "gate_backward", "gate_weight_grad", "gate_input_grad"},
           str("N=", N, " C=", C, gated ? " gated" : " w null")},
          [=] { return make(N, C, 1 + N + C); }, [=](Run& r, const In& in) { run_gate(r, in, gated, 0); },
          [=](const Result& got, const In& in) {
            const Exact e = exact(in, gated);
            EXPECT_TRUE(bitwise_equal(got["out"], e.out, "out"));
            EXPECT_TRUE(bitwise_equal(got["g"], e.g, "g"));
            EXPECT_TRUE(bitwise_equal(got["dy"], e.dy, "dy"));
            if (gated) {
              EXPECT_TRUE(bitwise_equal(got["dlogit"], e.dlogit, "dlogit"));
              EXPECT_TRUE(bitwise_equal(got["dw"], e.dw, "dw"));
            } else {
              EXPECT_TRUE(bitwise_equal(got["dy"], in.dout, "dy = dout"));
              for (float g : got["g"]) EXPECT_EQ(g, 1.0f);
            }
            EXPECT_TRUE(bitwise_equal(got["dx"], e.dx, "dx"));
            std::vector<double> out(N * C), g(N);
            const std::vector<double> x = testing::to_double(in.x), w = testing::to_double(in.w);
            for (int64_t t = 0; t < N; ++t) {
              g[t] = gated ? sigmoid(dot(&x[t * C], w.data(), C)) : 1.0;
              for (int64_t c = 0; c < C; ++c) out[t * C + c] = in.base[t * C + c] + g[t] * in.y[t * C + c];
            }
            EXPECT_TRUE(all_close(got["g"], g, 1e-5, 1e-6, "g"));
            EXPECT_TRUE(all_close(got["out"], out, 1e-5, 1e-5, "out"));
          });
    }

  // The backward ops against central differences of the double forward with loss
  // sum(out * dout): dy = dL/dy, dlogit = dL/d<x_t, w>, dw = dw0 + dL/dw, dx = dx0 + dx_expert +
  // dL/dx (plain token order and 3 token segments).
  for (const auto& shape : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {3, 5}, {7, 33}, {17, 130}})
    for (const int64_t segments : {0, 3}) {
      const int64_t N = shape.first, C = shape.second;
      reg.add(
          {"Gate",
           "BackwardMatchesFiniteDifferences",
           {"gate_forward", "gate_backward", "gate_weight_grad", "gate_input_grad"},
           str("N=", N, " C=", C, " segments=", segments)},
          [=] { return make(N, C, 2 + N + C); }, [=](Run& r, const In& in) { run_gate(r, in, true, segments); },
          [=](const Result& got, const In& in) {
            const std::vector<double> x = testing::to_double(in.x), w = testing::to_double(in.w),
                                      yd = testing::to_double(in.y);
            // Token t's loss as a function of its logit, of its y row, of its x row; the whole
            // loss as a function of w.
            const auto loss_t = [&](int64_t t, double z, const double* y) {
              double l = 0;
              for (int64_t c = 0; c < C; ++c) l += in.dout[t * C + c] * (in.base[t * C + c] + sigmoid(z) * y[c]);
              return l;
            };
            std::vector<double> dy(N * C), dlogit(N), dx(N * C), dw(C);
            for (int64_t t = 0; t < N; ++t) {
              const std::vector<double> yt(yd.begin() + t * C, yd.begin() + (t + 1) * C);
              const double z = dot(&x[t * C], w.data(), C);
              dlogit[t] =
                  finite_difference([&](const std::vector<double>& v) { return loss_t(t, v[0], yt.data()); }, {z})[0];
              const std::vector<double> gy =
                  finite_difference([&](const std::vector<double>& v) { return loss_t(t, z, v.data()); }, yt);
              const std::vector<double> gx = finite_difference(
                  [&](const std::vector<double>& v) { return loss_t(t, dot(v.data(), w.data(), C), yt.data()); },
                  std::vector<double>(x.begin() + t * C, x.begin() + (t + 1) * C));
              for (int64_t c = 0; c < C; ++c) {
                dy[t * C + c] = gy[c];
                dx[t * C + c] = in.dx0[t * C + c] + in.dx_expert[t * C + c] + gx[c];
              }
            }
            const std::vector<double> gw = finite_difference(
                [&](const std::vector<double>& v) {
                  double l = 0;
                  for (int64_t t = 0; t < N; ++t) l += loss_t(t, dot(&x[t * C], v.data(), C), yd.data() + t * C);
                  return l;
                },
                w);
            for (int64_t c = 0; c < C; ++c) dw[c] = in.dw0[c] + gw[c];
            EXPECT_TRUE(all_close(got["dy"], dy, 1e-5, 1e-6, "dy"));
            EXPECT_TRUE(all_close(got["dlogit"], dlogit, 1e-4, 1e-5, "dlogit"));
            EXPECT_TRUE(all_close(got["dw"], dw, 1e-4, 1e-4, "dw"));
            EXPECT_TRUE(all_close(got["dx"], dx, 1e-4, 1e-4, "dx"));
          });
    }

  // gate_weight_grad with S token segments (determinism = "layout"): each segment's tokens summed
  // from zero in token order, the segments along the canonical tree, the root added to dw: that
  // definition written out, bit for bit (empty segments when N < S); and P parts of N / P tokens
  // with S / P segments each, from zero, combined along the canonical tree over the parts and added
  // to dw, give the same bits.
  for (const int64_t N : {5, 64})
    for (const int64_t C : {1, 37})
      for (const int64_t S : {1, 2, 8}) {
        struct WIn {
          std::vector<float> dlogit, x, dw0;
        };
        reg.add(
            {"Gate", "WeightGradTokenSegments", {"gate_weight_grad"}, str("N=", N, " C=", C, " S=", S)},
            [=] {
              return WIn{randn(N, 3, "dlogit"), randn(N * C, 3, "x"), randn(C, 3, "dw0")};
            },
            [=](Run& r, const WIn& in) {
              const Buf<float> dlogit = r.in(in.dlogit), x = r.in(in.x);
              Buf<float> dw = r.in(in.dw0);
              r.ops.gate_weight_grad(dw, dlogit, x, N, C, S);
              r.out("dw", dw);
              if (N % S) return;
              for (int64_t P = 2; P <= S; P *= 2)
                for (int64_t p = 0; p < P; ++p) {
                  Buf<float> part = r.zeros(C);
                  r.ops.gate_weight_grad(part, dlogit.p() + p * (N / P), x.p() + p * (N / P) * C, N / P, C, S / P);
                  r.out(str("P=", P, " part ", p), part);
                }
            },
            [=](const Result& got, const WIn& in) {
              const std::vector<int64_t> b = canonical_segments(N, S);
              std::vector<std::vector<float>> seg(S, std::vector<float>(C, 0.0f));
              for (int64_t k = 0; k < S; ++k)
                for (int64_t t = b[k]; t < b[k + 1]; ++t)
                  for (int64_t c = 0; c < C; ++c) {
                    const float p = in.dlogit[t] * in.x[t * C + c];
                    seg[k][c] = seg[k][c] + p;
                  }
              std::vector<const float*> leaves;
              for (const auto& v : seg) leaves.push_back(v.data());
              std::vector<float> root(C), stack(std::max<int64_t>(1, tree_sum_stack(S) * C)), want(C);
              tree_sum(root.data(), leaves.data(), S, C, stack.data());
              for (int64_t c = 0; c < C; ++c) want[c] = in.dw0[c] + root[c];
              EXPECT_TRUE(bitwise_equal(got["dw"], want, "dw"));
              std::vector<double> ref(C);
              for (int64_t c = 0; c < C; ++c) {
                ref[c] = in.dw0[c];
                for (int64_t t = 0; t < N; ++t) ref[c] += static_cast<double>(in.dlogit[t]) * in.x[t * C + c];
              }
              EXPECT_TRUE(all_close(got["dw"], ref, 1e-5, 1e-5, "dw"));
              if (N % S) return;
              for (int64_t P = 2; P <= S; P *= 2) {
                std::vector<std::vector<float>> parts;
                std::vector<const float*> pl;
                for (int64_t p = 0; p < P; ++p) parts.push_back(got[str("P=", P, " part ", p)]);
                for (const auto& p : parts) pl.push_back(p.data());
                std::vector<float> sum(C), pstack(tree_sum_stack(P) * C), whole(C);
                tree_sum(sum.data(), pl.data(), P, C, pstack.data());
                for (int64_t c = 0; c < C; ++c) whole[c] = in.dw0[c] + sum[c];
                EXPECT_TRUE(bitwise_equal(whole, got["dw"], str("dw over ", P, " parts")));
              }
            });
      }
}

}  // namespace lockstep::harness
