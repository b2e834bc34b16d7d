// LayerNorm and RMSNorm (kernels/norms.h) on every backend: the forward against the double
// reference, the backward against central differences and the double gradient, and the token
// segments of determinism = "layout" (one process equals P parts combined along the tree).
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "../op_harness.h"
#include "../testing.h"
#include "lockstep/core/error.h"
#include "lockstep/core/tree_sum.h"

namespace lockstep::harness {
namespace {

using testing::all_close;
using testing::bitwise_equal;
using testing::finite_difference;
using testing::randn;
using testing::to_double;

constexpr float kEps = 1e-5f;

// Double-precision LayerNorm (centered) or RMSNorm; bias only when centered.
struct NormRef {
  std::vector<double> out, mean, rstd;
};
NormRef norm_ref(bool centered, const double* x, const double* w, const double* b, int64_t N, int64_t C) {
  NormRef r{std::vector<double>(N * C), std::vector<double>(N), std::vector<double>(N)};
  for (int64_t n = 0; n < N; ++n) {
    const double* xr = x + n * C;
    double m = 0;
    if (centered) {
      for (int64_t i = 0; i < C; ++i) m += xr[i];
      m /= C;
    }
    double sq = 0;
    for (int64_t i = 0; i < C; ++i) sq += (xr[i] - m) * (xr[i] - m);
    const double s = 1.0 / std::sqrt(sq / C + kEps);
    for (int64_t i = 0; i < C; ++i) r.out[n * C + i] = (xr[i] - m) * s * w[i] + (centered ? b[i] : 0.0);
    r.mean[n] = m;
    r.rstd[n] = s;
  }
  return r;
}

// The analytic gradients in double (what the backward adds), from the double statistics.
struct NormGrads {
  std::vector<double> dinp, dw, db;
};
NormGrads norm_grads_ref(bool centered, const std::vector<float>& x, const std::vector<float>& w,
                         const std::vector<float>& dout, int64_t N, int64_t C) {
  const auto xd = to_double(x), wd = to_double(w);
  const NormRef r = norm_ref(centered, xd.data(), wd.data(), wd.data(), N, C);
  NormGrads g{std::vector<double>(N * C), std::vector<double>(C, 0.0), std::vector<double>(C, 0.0)};
  for (int64_t n = 0; n < N; ++n) {
    double mean_g = 0, mean_gx = 0;
    for (int64_t i = 0; i < C; ++i) {
      const double xhat = (xd[n * C + i] - r.mean[n]) * r.rstd[n], gi = wd[i] * dout[n * C + i];
      mean_g += gi / C;
      mean_gx += gi * xhat / C;
      g.dw[i] += dout[n * C + i] * xhat;
      g.db[i] += dout[n * C + i];
    }
    for (int64_t i = 0; i < C; ++i) {
      const double xhat = (xd[n * C + i] - r.mean[n]) * r.rstd[n], gi = wd[i] * dout[n * C + i];
      g.dinp[n * C + i] = r.rstd[n] * (gi - (centered ? mean_g : 0.0) - xhat * mean_gx);
    }
  }
  return g;
}

// Random inputs, with a row offset so that the mean is large against the spread.
struct NormInputs {
  std::vector<float> x, w, b;
};
NormInputs make_inputs(int64_t N, int64_t C, uint64_t seed) {
  NormInputs in{randn(N * C, seed, "x", 2.0f), randn(C, seed, "w", 0.5f), randn(C, seed, "b")};
  for (auto& v : in.x) v += 3.0f;
  for (auto& v : in.w) v += 1.0f;
  return in;
}

const char* norm_name(bool centered) { return centered ? "layernorm" : "rmsnorm"; }

// The forward on the backend's buffers: out (N, C), mean (layernorm), rstd.
void forward(Run& r, bool centered, const NormInputs& in, int64_t N, int64_t C, Buf<float>& out, Buf<float>& mean,
             Buf<float>& rstd) {
  const Buf<float> x = r.in(in.x), w = r.in(in.w), b = r.in(in.b);
  out = r.zeros(N * C), mean = r.zeros(N), rstd = r.zeros(N);
  if (centered)
    r.ops.layernorm_forward(out, mean, rstd, x, w, b, N, C, kEps);
  else
    r.ops.rmsnorm_forward(out, rstd, x, w, N, C, kEps);
}

// The backward of rows [r0, r0 + rows), adding into dinp, dw, db.
void backward(Run& r, bool centered, const Buf<float>& dout, const Buf<float>& x, const Buf<float>& w,
              const Buf<float>& mean, const Buf<float>& rstd, int64_t r0, int64_t rows, int64_t C, int64_t segments,
              Buf<float>& dinp, Buf<float>& dw, Buf<float>& db) {
  if (centered)
    r.ops.layernorm_backward(dinp, dw, db, dout.p() + r0 * C, x.p() + r0 * C, w, mean.p() + r0, rstd.p() + r0, rows, C,
                             segments);
  else
    r.ops.rmsnorm_backward(dinp, dw, dout.p() + r0 * C, x.p() + r0 * C, w, rstd.p() + r0, rows, C, segments);
}

// The kernel's forward against the double reference.
void add_forward(Registry& reg, bool centered, int64_t N, int64_t C) {
  reg.add(
      {"Norms",
       centered ? "LayerNormForwardMatchesReference" : "RMSNormForwardMatchesReference",
       {centered ? "layernorm_forward" : "rmsnorm_forward"},
       str(norm_name(centered), " N=", N, " C=", C)},
      [=] { return make_inputs(N, C, 7 + N * 1000 + C); },
      [=](Run& r, const NormInputs& in) {
        Buf<float> out, mean, rstd;
        forward(r, centered, in, N, C, out, mean, rstd);
        r.out("out", out);
        if (centered) r.out("mean", mean);
        r.out("rstd", rstd);
      },
      [=](const Result& got, const NormInputs& in) {
        const auto xd = to_double(in.x), wd = to_double(in.w), bd = to_double(in.b);
        const NormRef ref = norm_ref(centered, xd.data(), wd.data(), bd.data(), N, C);
        EXPECT_TRUE(all_close(got["out"], ref.out, 1e-5, 1e-5, "out"));
        if (centered) {
          EXPECT_TRUE(all_close(got["mean"], ref.mean, 1e-6, 1e-6, "mean"));
        }
        EXPECT_TRUE(all_close(got["rstd"], ref.rstd, 1e-5, 0, "rstd"));
      });
}

// The kernel's backward (which adds into dinp, dweight, dbias) against central differences of the
// double reference, with loss = sum(out * R).
void add_backward(Registry& reg, bool centered, int64_t N, int64_t C) {
  struct In {
    NormInputs in;
    std::vector<float> R, dinp0, dw0, db0;
  };
  reg.add(
      {"Norms",
       centered ? "LayerNormBackwardMatchesFiniteDifferences" : "RMSNormBackwardMatchesFiniteDifferences",
       {centered ? "layernorm_forward" : "rmsnorm_forward", centered ? "layernorm_backward" : "rmsnorm_backward"},
       str(norm_name(centered), " N=", N, " C=", C)},
      [=] {
        return In{make_inputs(N, C, 11 + N * 1000 + C), randn(N * C, 3, "R"), randn(N * C, 5, "dinp0"),
                  randn(C, 5, "dw0"), randn(C, 5, "db0")};
      },
      [=](Run& r, const In& in) {
        Buf<float> out, mean, rstd;
        forward(r, centered, in.in, N, C, out, mean, rstd);
        const Buf<float> R = r.in(in.R), x = r.in(in.in.x), w = r.in(in.in.w);
        Buf<float> dinp = r.in(in.dinp0), dw = r.in(in.dw0), db = r.in(in.db0);
        backward(r, centered, R, x, w, mean, rstd, 0, N, C, 0, dinp, dw, db);
        r.out("dinp", dinp);
        r.out("dweight", dw);
        if (centered) r.out("dbias", db);
      },
      [=](const Result& got, const In& in) {
        // Parameters packed as [x | w | b].
        std::vector<double> p = to_double(in.in.x);
        p.insert(p.end(), in.in.w.begin(), in.in.w.end());
        p.insert(p.end(), in.in.b.begin(), in.in.b.end());
        const auto loss = [&](const std::vector<double>& q) {
          const NormRef ref = norm_ref(centered, q.data(), q.data() + N * C, q.data() + N * C + C, N, C);
          double l = 0;
          for (int64_t i = 0; i < N * C; ++i) l += ref.out[i] * in.R[i];
          return l;
        };
        const std::vector<double> g = finite_difference(loss, p);
        std::vector<double> want_dinp(N * C), want_dw(C), want_db(C);
        for (int64_t i = 0; i < N * C; ++i) want_dinp[i] = in.dinp0[i] + g[i];
        for (int64_t i = 0; i < C; ++i) {
          want_dw[i] = in.dw0[i] + g[N * C + i];
          want_db[i] = in.db0[i] + g[N * C + C + i];
        }
        EXPECT_TRUE(all_close(got["dinp"], want_dinp, 1e-4, 1e-4, "dinp"));
        EXPECT_TRUE(all_close(got["dweight"], want_dw, 1e-4, 1e-4, "dweight"));
        if (centered) {
          EXPECT_TRUE(all_close(got["dbias"], want_db, 1e-4, 1e-4, "dbias"));
        }
      });
}

// Forward and backward of both norms on shapes that split unevenly over threads: every setting of
// the backend (1, 2, 3 threads on the CPU) gives the same bits; against the double forward and the
// double analytic gradient.
void add_threads(Registry& reg, int64_t N, int64_t C) {
  struct In {
    NormInputs in;
    std::vector<float> dout;
  };
  reg.add(
      {"Norms",
       "BitwiseIndependentOfThreadCount",
       {"layernorm_forward", "layernorm_backward", "rmsnorm_forward", "rmsnorm_backward"},
       str("N=", N, " C=", C)},
      [=] {
        return In{make_inputs(N, C, 17), randn(N * C, 19, "dout")};
      },
      [=](Run& r, const In& in) {
        const Buf<float> dout = r.in(in.dout), x = r.in(in.in.x), w = r.in(in.in.w);
        for (bool centered : {true, false}) {
          const std::string n = norm_name(centered);
          Buf<float> out, mean, rstd;
          forward(r, centered, in.in, N, C, out, mean, rstd);
          Buf<float> dinp = r.in(randn(N * C, centered ? 23 : 29, "dinp")),
                     dw = r.in(randn(C, centered ? 23 : 29, "dw")), db = r.in(randn(C, 23, "db"));
          backward(r, centered, dout, x, w, mean, rstd, 0, N, C, 0, dinp, dw, db);
          r.out(n + " out", out);
          if (centered) r.out("mean", mean);
          r.out(n + " rstd", rstd);
          r.out(n + " dinp", dinp);
          r.out(n + " dweight", dw);
          if (centered) r.out(n + " dbias", db);
        }
      },
      [=](const Result& got, const In& in) {
        const auto xd = to_double(in.in.x), wd = to_double(in.in.w), bd = to_double(in.in.b);
        for (bool centered : {true, false}) {
          const std::string n = norm_name(centered);
          const NormRef ref = norm_ref(centered, xd.data(), wd.data(), bd.data(), N, C);
          EXPECT_TRUE(all_close(got[n + " out"], ref.out, 1e-5, 1e-5, n + " out"));
          EXPECT_TRUE(all_close(got[n + " rstd"], ref.rstd, 1e-5, 0, n + " rstd"));
          if (centered) {
            EXPECT_TRUE(all_close(got["mean"], ref.mean, 1e-6, 1e-6, "mean"));
          }
          const NormGrads g = norm_grads_ref(centered, in.in.x, in.in.w, in.dout, N, C);
          const uint64_t seed = centered ? 23 : 29;
          const auto plus = [](std::vector<double> a, const std::vector<float>& b) {
            for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
            return a;
          };
          EXPECT_TRUE(all_close(got[n + " dinp"], plus(g.dinp, randn(N * C, seed, "dinp")), 1e-4, 1e-4, n + " dinp"));
          EXPECT_TRUE(all_close(got[n + " dweight"], plus(g.dw, randn(C, seed, "dw")), 1e-4, 1e-3, n + " dweight"));
          if (centered) {
            EXPECT_TRUE(all_close(got[n + " dbias"], plus(g.db, randn(C, 23, "db")), 1e-4, 1e-3, n + " dbias"));
          }
        }
      });
}

// determinism = "layout": the parameter gradients in S token segments (norms.h). One process over
// N rows with S segments equals, bit for bit, P parts of N / P rows with S / P segments each,
// every part's gradient from zero, combined along the canonical tree over the parts (what
// ReduceOp::tree_sum does over a sequence-parallel group); the input gradients are per row and
// equal too. Against the double reference; one segment is the unsegmented sum; every setting
// (1 to 3 threads) bitwise.
void add_layout(Registry& reg, bool centered, int64_t N, int64_t C) {
  struct In {
    NormInputs in;
    std::vector<float> dout;
  };
  reg.add(
      {"Norms",
       "LayoutTokenSegmentsAreSplitInvariant",
       {centered ? "layernorm_forward" : "rmsnorm_forward", centered ? "layernorm_backward" : "rmsnorm_backward"},
       str(norm_name(centered), " N=", N, " C=", C)},
      [=] {
        return In{make_inputs(N, C, 43), randn(N * C, 47, "dout")};
      },
      [=](Run& r, const In& in) {
        Buf<float> out, mean, rstd;
        forward(r, centered, in.in, N, C, out, mean, rstd);
        r.out("mean", mean);
        r.out("rstd", rstd);
        const Buf<float> dout = r.in(in.dout), x = r.in(in.in.x), w = r.in(in.in.w);
        // Rows [r0, r0 + rows) in `segments` segments, gradients from zero.
        const auto grads = [&](int64_t r0, int64_t rows, int64_t segments, const std::string& name) {
          Buf<float> dinp = r.zeros(rows * C), dw = r.zeros(C), db = r.zeros(C);
          backward(r, centered, dout, x, w, mean, rstd, r0, rows, C, segments, dinp, dw, db);
          r.out(name + " dinp", dinp);
          r.out(name + " dweight", dw);
          r.out(name + " dbias", db);
        };
        grads(0, N, 0, "unsegmented");
        for (const int64_t S : {1, 2, 8}) {
          grads(0, N, S, str("S=", S));
          for (int64_t P = 2; P <= S; P *= 2)
            for (int64_t p = 0; p < P; ++p) grads(p * N / P, N / P, S / P, str("S=", S, " P=", P, " part ", p));
        }
      },
      [=](const Result& got, const In& in) {
        // The double reference of the parameter gradients (the kernel's statistics).
        const std::vector<float> mean = got["mean"], rstd = got["rstd"];
        std::vector<double> ref_dw(C, 0.0), ref_db(C, 0.0);
        for (int64_t n = 0; n < N; ++n)
          for (int64_t c = 0; c < C; ++c) {
            const double xhat = (static_cast<double>(in.in.x[n * C + c]) - (centered ? mean[n] : 0.0f)) * rstd[n];
            ref_dw[c] += in.dout[n * C + c] * xhat;
            ref_db[c] += in.dout[n * C + c];
          }
        EXPECT_TRUE(bitwise_equal(got["S=1 dweight"], got["unsegmented dweight"], "one segment = unsegmented"));
        for (const int64_t S : {1, 2, 8}) {
          SCOPED_TRACE(::testing::Message() << "S=" << S);
          const std::string s = str("S=", S);
          const std::vector<float> dw1 = got[s + " dweight"], db1 = got[s + " dbias"], dinp1 = got[s + " dinp"];
          EXPECT_TRUE(all_close(dw1, ref_dw, 1e-5, 1e-5, "dweight"));
          if (centered) {
            EXPECT_TRUE(all_close(db1, ref_db, 1e-5, 1e-5, "dbias"));
          }
          for (int64_t P = 2; P <= S; P *= 2) {
            std::vector<std::vector<float>> pw, pb;
            std::vector<float> dinp;
            for (int64_t p = 0; p < P; ++p) {
              const std::string part = str(s, " P=", P, " part ", p);
              pw.push_back(got[part + " dweight"]);
              pb.push_back(got[part + " dbias"]);
              const std::vector<float> d = got[part + " dinp"];
              dinp.insert(dinp.end(), d.begin(), d.end());
            }
            std::vector<float> dw(C), db(C), stack(tree_sum_stack(P) * C);
            std::vector<const float*> lw, lb;
            for (int64_t p = 0; p < P; ++p) lw.push_back(pw[p].data()), lb.push_back(pb[p].data());
            tree_sum(dw.data(), lw.data(), P, C, stack.data());
            tree_sum(db.data(), lb.data(), P, C, stack.data());
            EXPECT_TRUE(bitwise_equal(dw, dw1, "dweight, P = " + std::to_string(P)));
            if (centered) {
              EXPECT_TRUE(bitwise_equal(db, db1, "dbias, P = " + std::to_string(P)));
            }
            EXPECT_TRUE(bitwise_equal(dinp, dinp1, "dinp, P = " + std::to_string(P)));
          }
        }
      });
}

}  // namespace

void add_norm_cases(Registry& reg) {
  // Sizes cover C below 8, whole 8-blocks, whole 32-blocks with 8-blocks and tails after them, and
  // (backward) more columns than one column tile.
  for (const bool centered : {true, false})
    for (auto [N, C] : {std::pair<int64_t, int64_t>{1, 1}, {3, 5}, {4, 8}, {2, 77}, {5, 300}, {64, 1000}})
      add_forward(reg, centered, N, C);
  for (const bool centered : {true, false})
    for (auto [N, C] : {std::pair<int64_t, int64_t>{1, 2}, {3, 5}, {2, 77}, {3, 109}, {1, 2100}})
      add_backward(reg, centered, N, C);
  for (auto [N, C] : {std::pair<int64_t, int64_t>{37, 300}, {7, 1029}, {3, 4133}}) add_threads(reg, N, C);
  for (const bool centered : {true, false})
    for (auto [N, C] : {std::pair<int64_t, int64_t>{64, 300}, {32, 2100}}) add_layout(reg, centered, N, C);
}

}  // namespace lockstep::harness
