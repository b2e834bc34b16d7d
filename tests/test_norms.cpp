#include "lockstep/kernels/cpu/norms.h"

#include <cmath>
#include <string>
#include <vector>

#include "lockstep/core/thread_pool.h"
#include "lockstep/core/tree_sum.h"
#include "testing.h"

namespace lockstep {
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
NormRef norm_ref(bool centered, const double* x, const double* w, const double* b, int64_t N,
                 int64_t C) {
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
    for (int64_t i = 0; i < C; ++i) {
      r.out[n * C + i] = (xr[i] - m) * s * w[i] + (centered ? b[i] : 0.0);
    }
    r.mean[n] = m;
    r.rstd[n] = s;
  }
  return r;
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

// The kernel's forward against the double reference.
void check_forward(bool centered, int64_t N, int64_t C) {
  SCOPED_TRACE(::testing::Message()
               << (centered ? "layernorm" : "rmsnorm") << " N=" << N << " C=" << C);
  const NormInputs in = make_inputs(N, C, 7 + N * 1000 + C);
  std::vector<float> out(N * C), mean(N), rstd(N);
  if (centered) {
    layernorm_forward(out.data(), mean.data(), rstd.data(), in.x.data(), in.w.data(), in.b.data(),
                      N, C, kEps);
  } else {
    rmsnorm_forward(out.data(), rstd.data(), in.x.data(), in.w.data(), N, C, kEps);
  }
  const auto xd = to_double(in.x), wd = to_double(in.w), bd = to_double(in.b);
  const NormRef ref = norm_ref(centered, xd.data(), wd.data(), bd.data(), N, C);
  EXPECT_TRUE(all_close(out, ref.out, 1e-5, 1e-5, "out"));
  if (centered) {
    EXPECT_TRUE(all_close(mean, ref.mean, 1e-6, 1e-6, "mean"));
  }
  EXPECT_TRUE(all_close(rstd, ref.rstd, 1e-5, 0, "rstd"));
}

// The kernel's backward (which adds into dinp, dweight, dbias) against central differences of the
// double reference, with loss = sum(out * R).
void check_backward(bool centered, int64_t N, int64_t C) {
  SCOPED_TRACE(::testing::Message()
               << (centered ? "layernorm" : "rmsnorm") << " N=" << N << " C=" << C);
  const NormInputs in = make_inputs(N, C, 11 + N * 1000 + C);
  const std::vector<float> R = randn(N * C, 3, "R");
  const std::vector<float> dinp0 = randn(N * C, 5, "dinp0"), dw0 = randn(C, 5, "dw0"),
                           db0 = randn(C, 5, "db0");
  std::vector<float> out(N * C), mean(N), rstd(N);
  std::vector<float> dinp = dinp0, dw = dw0, db = db0;
  if (centered) {
    layernorm_forward(out.data(), mean.data(), rstd.data(), in.x.data(), in.w.data(), in.b.data(),
                      N, C, kEps);
    layernorm_backward(dinp.data(), dw.data(), db.data(), R.data(), in.x.data(), in.w.data(),
                       mean.data(), rstd.data(), N, C);
  } else {
    rmsnorm_forward(out.data(), rstd.data(), in.x.data(), in.w.data(), N, C, kEps);
    rmsnorm_backward(dinp.data(), dw.data(), R.data(), in.x.data(), in.w.data(), rstd.data(), N, C);
  }

  // Parameters packed as [x | w | b].
  std::vector<double> p = to_double(in.x);
  p.insert(p.end(), in.w.begin(), in.w.end());
  p.insert(p.end(), in.b.begin(), in.b.end());
  const auto loss = [&](const std::vector<double>& q) {
    const NormRef r = norm_ref(centered, q.data(), q.data() + N * C, q.data() + N * C + C, N, C);
    double l = 0;
    for (int64_t i = 0; i < N * C; ++i) l += r.out[i] * R[i];
    return l;
  };
  const std::vector<double> g = finite_difference(loss, p);
  std::vector<double> want_dinp(N * C), want_dw(C), want_db(C);
  for (int64_t i = 0; i < N * C; ++i) want_dinp[i] = dinp0[i] + g[i];
  for (int64_t i = 0; i < C; ++i) {
    want_dw[i] = dw0[i] + g[N * C + i];
    want_db[i] = db0[i] + g[N * C + C + i];
  }
  EXPECT_TRUE(all_close(dinp, want_dinp, 1e-4, 1e-4, "dinp"));
  EXPECT_TRUE(all_close(dw, want_dw, 1e-4, 1e-4, "dweight"));
  if (centered) {
    EXPECT_TRUE(all_close(db, want_db, 1e-4, 1e-4, "dbias"));
  }
}

// Sizes cover C below 8, whole 8-blocks, whole 32-blocks with 8-blocks and tails after them, and
// (backward) more columns than one column tile.
TEST(Norms, LayerNormForwardMatchesReference) {
  for (auto [N, C] :
       {std::pair<int64_t, int64_t>{1, 1}, {3, 5}, {4, 8}, {2, 77}, {5, 300}, {64, 1000}}) {
    check_forward(true, N, C);
  }
}

TEST(Norms, RMSNormForwardMatchesReference) {
  for (auto [N, C] :
       {std::pair<int64_t, int64_t>{1, 1}, {3, 5}, {4, 8}, {2, 77}, {5, 300}, {64, 1000}}) {
    check_forward(false, N, C);
  }
}

TEST(Norms, LayerNormBackwardMatchesFiniteDifferences) {
  for (auto [N, C] : {std::pair<int64_t, int64_t>{1, 2}, {3, 5}, {2, 77}, {3, 109}, {1, 2100}}) {
    check_backward(true, N, C);
  }
}

TEST(Norms, RMSNormBackwardMatchesFiniteDifferences) {
  for (auto [N, C] : {std::pair<int64_t, int64_t>{1, 2}, {3, 5}, {2, 77}, {3, 109}, {1, 2100}}) {
    check_backward(false, N, C);
  }
}

// Forward and backward outputs with 1, 2 and 3 threads must be the same bits.
TEST(Norms, BitwiseIndependentOfThreadCount) {
  for (auto [N, C] : {std::pair<int64_t, int64_t>{37, 300}, {7, 1029}, {3, 4133}}) {
    const NormInputs in = make_inputs(N, C, 17);
    const std::vector<float> dout = randn(N * C, 19, "dout");
    struct Result {
      std::vector<float> out, mean, rstd, dinp, dw, db, rms_out, rms_rstd, rms_dinp, rms_dw;
    };
    const auto run = [&](int threads) {
      ThreadPool pool(threads);
      ThreadPool::Bind bind(&pool);
      Result r{std::vector<float>(N * C), std::vector<float>(N), std::vector<float>(N),
               randn(N * C, 23, "dinp"),  randn(C, 23, "dw"),    randn(C, 23, "db"),
               std::vector<float>(N * C), std::vector<float>(N), randn(N * C, 29, "dinp"),
               randn(C, 29, "dw")};
      layernorm_forward(r.out.data(), r.mean.data(), r.rstd.data(), in.x.data(), in.w.data(),
                        in.b.data(), N, C, kEps);
      layernorm_backward(r.dinp.data(), r.dw.data(), r.db.data(), dout.data(), in.x.data(),
                         in.w.data(), r.mean.data(), r.rstd.data(), N, C);
      rmsnorm_forward(r.rms_out.data(), r.rms_rstd.data(), in.x.data(), in.w.data(), N, C, kEps);
      rmsnorm_backward(r.rms_dinp.data(), r.rms_dw.data(), dout.data(), in.x.data(), in.w.data(),
                       r.rms_rstd.data(), N, C);
      return r;
    };
    const Result one = run(1);
    for (int threads : {2, 3}) {
      SCOPED_TRACE(::testing::Message() << "N=" << N << " C=" << C << " threads=" << threads);
      const Result r = run(threads);
      EXPECT_TRUE(bitwise_equal(r.out, one.out, "layernorm out"));
      EXPECT_TRUE(bitwise_equal(r.mean, one.mean, "mean"));
      EXPECT_TRUE(bitwise_equal(r.rstd, one.rstd, "rstd"));
      EXPECT_TRUE(bitwise_equal(r.dinp, one.dinp, "layernorm dinp"));
      EXPECT_TRUE(bitwise_equal(r.dw, one.dw, "layernorm dweight"));
      EXPECT_TRUE(bitwise_equal(r.db, one.db, "layernorm dbias"));
      EXPECT_TRUE(bitwise_equal(r.rms_out, one.rms_out, "rmsnorm out"));
      EXPECT_TRUE(bitwise_equal(r.rms_rstd, one.rms_rstd, "rmsnorm rstd"));
      EXPECT_TRUE(bitwise_equal(r.rms_dinp, one.rms_dinp, "rmsnorm dinp"));
      EXPECT_TRUE(bitwise_equal(r.rms_dw, one.rms_dw, "rmsnorm dweight"));
    }
  }
}

// determinism = "layout": the parameter gradients in S token segments (norms.h). One process over
// N rows with S segments equals, bit for bit, P parts of N / P rows with S / P segments each,
// every part's gradient from zero, combined along the canonical tree over the parts (what
// ReduceOp::tree_sum does over a sequence-parallel group); the input gradients are per row and
// equal too. Against the double reference, on 1 to 3 threads bitwise; one segment is the
// unsegmented sum.
TEST(Norms, LayoutTokenSegmentsAreSplitInvariant) {
  for (const bool centered : {true, false}) {
    for (auto [N, C] : {std::pair<int64_t, int64_t>{64, 300}, {32, 2100}}) {
      const NormInputs in = make_inputs(N, C, 43);
      const std::vector<float> dout = randn(N * C, 47, "dout");
      std::vector<float> out(N * C), mean(N), rstd(N);
      if (centered)
        layernorm_forward(out.data(), mean.data(), rstd.data(), in.x.data(), in.w.data(), in.b.data(), N, C, kEps);
      else
        rmsnorm_forward(out.data(), rstd.data(), in.x.data(), in.w.data(), N, C, kEps);
      struct Grads {
        std::vector<float> dinp, dw, db;
      };
      // Rows [r0, r0 + rows) in `segments` segments, gradients from zero.
      const auto backward = [&](int64_t r0, int64_t rows, int64_t segments) {
        Grads g{std::vector<float>(rows * C), std::vector<float>(C), std::vector<float>(C)};
        if (centered)
          layernorm_backward(g.dinp.data(), g.dw.data(), g.db.data(), dout.data() + r0 * C, in.x.data() + r0 * C,
                             in.w.data(), mean.data() + r0, rstd.data() + r0, rows, C, segments);
        else
          rmsnorm_backward(g.dinp.data(), g.dw.data(), dout.data() + r0 * C, in.x.data() + r0 * C, in.w.data(),
                           rstd.data() + r0, rows, C, segments);
        return g;
      };
      // The double reference of the parameter gradients.
      std::vector<double> ref_dw(C, 0.0), ref_db(C, 0.0);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t c = 0; c < C; ++c) {
          const double xhat = (static_cast<double>(in.x[n * C + c]) - (centered ? mean[n] : 0.0f)) * rstd[n];
          ref_dw[c] += dout[n * C + c] * xhat;
          ref_db[c] += dout[n * C + c];
        }
      EXPECT_TRUE(bitwise_equal(backward(0, N, 1).dw, backward(0, N, 0).dw, "one segment = unsegmented"));
      for (const int64_t S : {1, 2, 8}) {
        SCOPED_TRACE(::testing::Message() << (centered ? "layernorm" : "rmsnorm") << " N=" << N << " C=" << C
                                          << " S=" << S);
        const Grads one = backward(0, N, S);
        EXPECT_TRUE(all_close(one.dw, ref_dw, 1e-5, 1e-5, "dweight"));
        if (centered) {
          EXPECT_TRUE(all_close(one.db, ref_db, 1e-5, 1e-5, "dbias"));
        }
        for (int threads : {2, 3}) {
          Grads t;
          testing::with_threads(threads, [&] { t = backward(0, N, S); });
          EXPECT_TRUE(bitwise_equal(t.dw, one.dw, "dweight across threads"));
          EXPECT_TRUE(bitwise_equal(t.db, one.db, "dbias across threads"));
        }
        for (int64_t P = 2; P <= S; P *= 2) {
          std::vector<Grads> parts;
          for (int64_t p = 0; p < P; ++p) parts.push_back(backward(p * N / P, N / P, S / P));
          std::vector<float> dw(C), db(C), stack(tree_sum_stack(P) * C);
          std::vector<const float*> lw, lb;
          std::vector<float> dinp;
          for (const Grads& g : parts) {
            lw.push_back(g.dw.data());
            lb.push_back(g.db.data());
            dinp.insert(dinp.end(), g.dinp.begin(), g.dinp.end());
          }
          tree_sum(dw.data(), lw.data(), P, C, stack.data());
          tree_sum(db.data(), lb.data(), P, C, stack.data());
          EXPECT_TRUE(bitwise_equal(dw, one.dw, "dweight, P = " + std::to_string(P)));
          if (centered) {
            EXPECT_TRUE(bitwise_equal(db, one.db, "dbias, P = " + std::to_string(P)));
          }
          EXPECT_TRUE(bitwise_equal(dinp, one.dinp, "dinp, P = " + std::to_string(P)));
        }
      }
    }
  }
}

}  // namespace
}  // namespace lockstep
