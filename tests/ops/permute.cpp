// MoE token permutation and combine (kernels/permute.h) on every backend, over dispatch layouts
// that the CPU's LocalDispatcher plans (host code): against double references, central
// differences, the sums in k order that the contract states, and the thread settings.
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "../op_harness.h"
#include "../testing.h"
#include "lockstep/core/error.h"
#include "lockstep/model/moe/dispatcher.h"

namespace lockstep::harness {
namespace {

using testing::all_close;
using testing::bitwise_equal;
using testing::randn;

// A dispatch layout and the tensors the four ops read.
struct In {
  int64_t N, K, E, C, R;
  std::vector<int32_t> slot, row_choice;
  std::vector<float> probs, x, y, base, dout, drows;
};

// The layout of routing idx (N, K) over E experts with the kept choices, as LocalDispatcher plans
// it (capacity rows per expert with padding when pad).
In make_layout(int64_t N, int64_t K, int64_t E, int64_t C, const std::vector<int32_t>& idx,
               const std::vector<uint8_t>& kept, std::vector<float> probs, int64_t capacity, bool pad) {
  const std::unique_ptr<Device> cpu = Device::cpu();
  LocalDispatcher d(cpu->ops, E, K, C, N, capacity, pad);
  d.plan(idx.data(), kept.data(), N);
  In in{N, K, E, C, d.rows(), d.slots(), d.row_choices(), std::move(probs), {}, {}, {}, {}, {}};
  in.x = randn(N * C, 5, "x");
  in.y = randn(in.R * C, 6, "y");
  in.base = randn(N * C, 7, "base");
  in.dout = randn(N * C, 8, "dout");
  in.drows = randn(in.R * C, 9, "drows");
  return in;
}

// A hand-built routing: E = 3, K = 2, N = 4 (test_moe.cpp's), two choices dropped.
In hand_routing(int64_t C, int64_t capacity, bool pad) {
  return make_layout(4, 2, 3, C, {0, 1, 0, 2, 1, 2, 0, 1}, {1, 1, 0, 1, 1, 1, 1, 0},
                     {0.6f, 0.4f, 0.3f, 0.7f, 0.5f, 0.5f, 0.9f, 0.1f}, capacity, pad);
}

// Every op once: "rows" = permute(x), "dx" = dx0 + permute^T(drows), "out" = combine, "out in
// place" (out aliasing base), "dexpert_out", "dprobs".
void run_all(Run& r, const In& in, const std::vector<float>& dx0) {
  const Buf<int32_t> slot = r.in(in.slot), row_choice = r.in(in.row_choice);
  const Buf<float> x = r.in(in.x), y = r.in(in.y), base = r.in(in.base), dout = r.in(in.dout), drows = r.in(in.drows),
                   probs = r.in(in.probs);
  Buf<float> rows = r.full(in.R * in.C, -1.0f), dx = r.in(dx0), out = r.zeros(in.N * in.C), inplace = r.in(in.base);
  r.ops.permute_forward(rows, x, row_choice, in.R, in.K, in.C);
  r.ops.permute_backward(dx, drows, slot, in.N, in.K, in.C);
  r.ops.combine_forward(out, base, y, slot, probs, in.N, in.K, in.C);
  r.ops.combine_forward(inplace, inplace, y, slot, probs, in.N, in.K, in.C);
  Buf<float> dy = r.full(in.R * in.C, -1.0f), dprobs = r.full(in.N * in.K, -1.0f);
  r.ops.combine_backward(dy, dprobs, dout, y, slot, row_choice, probs, in.N, in.R, in.K, in.C);
  r.out("rows", rows);
  r.out("dx", dx);
  r.out("out", out);
  r.out("out in place", inplace);
  r.out("dexpert_out", dy);
  r.out("dprobs", dprobs);
}

std::vector<double> combine_ref(const In& in, const std::vector<double>& yy, const std::vector<double>& pp) {
  std::vector<double> o(in.base.begin(), in.base.end());
  for (int64_t t = 0; t < in.N; ++t)
    for (int64_t k = 0; k < in.K; ++k)
      if (in.slot[t * in.K + k] >= 0)
        for (int64_t c = 0; c < in.C; ++c) o[t * in.C + c] += pp[t * in.K + k] * yy[in.slot[t * in.K + k] * in.C + c];
  return o;
}

// The contract's arithmetic, serially: rows copied (zeros for padding), dx summed from its base in
// k order, combine as one FMA chain per element in k order, dexpert_out = probs * dout, dprobs one
// FMA chain over c (0 when dropped).
void check_formulas(const Result& got, const In& in, const std::vector<float>& dx0) {
  const int64_t C = in.C, K = in.K;
  std::vector<float> rows(in.R * C, 0.0f), dx = dx0, out = in.base, dy(in.R * C, 0.0f), dprobs(in.N * K, 0.0f);
  for (int64_t r = 0; r < in.R; ++r)
    if (in.row_choice[r] >= 0)
      for (int64_t c = 0; c < C; ++c) {
        rows[r * C + c] = in.x[in.row_choice[r] / K * C + c];
        dy[r * C + c] = in.probs[in.row_choice[r]] * in.dout[in.row_choice[r] / K * C + c];
      }
  for (int64_t t = 0; t < in.N; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int32_t s = in.slot[t * K + k];
      if (s < 0) continue;
      float acc = 0.0f;
      for (int64_t c = 0; c < C; ++c) {
        dx[t * C + c] += in.drows[s * C + c];
        out[t * C + c] = std::fma(in.probs[t * K + k], in.y[s * C + c], out[t * C + c]);
        acc = std::fma(in.dout[t * C + c], in.y[s * C + c], acc);
      }
      dprobs[t * K + k] = acc;
    }
  EXPECT_TRUE(bitwise_equal(got["rows"], rows, "rows"));
  EXPECT_TRUE(bitwise_equal(got["dx"], dx, "dx"));
  EXPECT_TRUE(bitwise_equal(got["out"], out, "out"));
  EXPECT_TRUE(bitwise_equal(got["out in place"], out, "out in place"));
  EXPECT_TRUE(bitwise_equal(got["dexpert_out"], dy, "dexpert_out"));
  EXPECT_TRUE(bitwise_equal(got["dprobs"], dprobs, "dprobs"));
}

}  // namespace

void add_permute_cases(Registry& reg) {
  const std::vector<std::string> all = {"permute_forward", "permute_backward", "combine_forward", "combine_backward"};

  // Permute is linear: its backward is its adjoint, <P x, g> = <x, P^T g>; combine against a double
  // reference; the combine's gradients against central differences of <dout, combine(y, probs)>.
  reg.add(
      {"MoeDispatch", "PermuteAndCombineMatchReferencesAndFiniteDifferences", all, "E=3 K=2 N=4 C=5, 2 dropped"},
      [] { return hand_routing(5, 0, false); },
      [](Run& r, const In& in) { run_all(r, in, std::vector<float>(in.N * in.C, 0.0f)); },
      [](const Result& got, const In& in) {
        ASSERT_EQ(in.R, 6);
        const std::vector<float> px = got["rows"], ptg = got["dx"];
        double lhs = 0, rhs = 0;
        for (int64_t i = 0; i < in.R * in.C; ++i) lhs += static_cast<double>(px[i]) * in.drows[i];
        for (int64_t i = 0; i < in.N * in.C; ++i) rhs += static_cast<double>(in.x[i]) * ptg[i];
        EXPECT_NEAR(lhs, rhs, 1e-5);
        const std::vector<double> yd(in.y.begin(), in.y.end()), pd(in.probs.begin(), in.probs.end());
        EXPECT_TRUE(all_close(got["out"], combine_ref(in, yd, pd), 1e-6, 1e-6, "combine"));
        auto f = [&](const std::vector<double>& yy, const std::vector<double>& pp) {
          const std::vector<double> o = combine_ref(in, yy, pp);
          double s = 0;
          for (int64_t i = 0; i < in.N * in.C; ++i) s += o[i] * in.dout[i];
          return s;
        };
        const std::vector<double> gy =
            testing::finite_difference([&](const std::vector<double>& v) { return f(v, pd); }, yd);
        const std::vector<double> gp =
            testing::finite_difference([&](const std::vector<double>& v) { return f(yd, v); }, pd);
        EXPECT_TRUE(all_close(got["dexpert_out"], gy, 1e-5, 1e-5, "dexpert_out"));
        const std::vector<float> dprobs = got["dprobs"];
        EXPECT_TRUE(all_close(dprobs, gp, 1e-5, 1e-5, "dprobs"));
        EXPECT_EQ(dprobs[2], 0.0f);  // dropped choice
        // permute_backward against central differences of <P x, drows>.
        const std::vector<double> gx = testing::finite_difference(
            [&](const std::vector<double>& xx) {
              double s = 0;
              for (int64_t r = 0; r < in.R; ++r)
                if (in.row_choice[r] >= 0)
                  for (int64_t c = 0; c < in.C; ++c)
                    s += xx[in.row_choice[r] / in.K * in.C + c] * in.drows[r * in.C + c];
              return s;
            },
            testing::to_double(in.x));
        EXPECT_TRUE(all_close(ptg, gx, 1e-5, 1e-5, "dx"));
      });

  // Every op's arithmetic as the contract writes it, bit for bit: without padding, with padding
  // rows (capacity 3: zeros in the rows and their gradient), dx added to its base.
  for (const bool pad : {false, true}) {
    reg.add(
        {"MoeDispatch", "PermuteAndCombineFollowTheirFormulasBitwise", all,
         pad ? "padded to 3 rows per expert" : "dropless"},
        [=] { return hand_routing(37, 3, pad); },
        [](Run& r, const In& in) { run_all(r, in, randn(in.N * in.C, 10, "dx0")); },
        [](const Result& got, const In& in) { check_formulas(got, in, randn(in.N * in.C, 10, "dx0")); });
  }

  // A larger routing (E = 8, K = 2, 300 tokens, some choices dropped): the formulas bitwise on
  // every setting (1 to 3 threads).
  reg.add(
      {"MoeDispatch", "PermuteAndCombineBitwiseAcrossThreadCounts", all, "E=8 K=2 N=300 C=67"},
      [] {
        const int64_t N = 300, K = 2, E = 8;
        const std::vector<int32_t> pick = testing::random_ints(N * K, E - 1, 11, "idx");
        std::vector<int32_t> idx(N * K);
        std::vector<uint8_t> kept(N * K);
        for (int64_t i = 0; i < N * K; ++i) {
          idx[i] = i % 2 == 0 ? pick[i] : (pick[i - 1] + 1 + pick[i] % (E - 1)) % E;  // two distinct experts
          kept[i] = i % 13 != 5;
        }
        std::vector<float> probs = randn(N * K, 12, "probs");
        return make_layout(N, K, E, 67, idx, kept, probs, 0, false);
      },
      [](Run& r, const In& in) { run_all(r, in, randn(in.N * in.C, 10, "dx0")); },
      [](const Result& got, const In& in) { check_formulas(got, in, randn(in.N * in.C, 10, "dx0")); });
}

}  // namespace lockstep::harness
