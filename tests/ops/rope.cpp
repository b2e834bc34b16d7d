// Rotary position embedding (kernels/rope.h) on every backend: the forward against the double
// rotation, the backward against central differences, every element against the float formula,
// explicit positions, and the thread settings. The table (rope_table, host code) is checked once.
#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "../op_harness.h"
#include "../testing.h"
#include "lockstep/core/error.h"
#include "lockstep/kernels/rope.h"

namespace lockstep::harness {
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
  std::string label() const { return str("B=", B, " T=", T, " heads=", heads, " HS=", HS, " stride=", row_stride); }
};

struct Table {
  std::vector<float> cos, sin;
};
Table make_table(const RopeCase& k) {
  Table t{std::vector<float>(k.T * k.half()), std::vector<float>(k.T * k.half())};
  rope_table(t.cos.data(), t.sin.data(), k.T, k.HS, kTheta);
  return t;
}

// Calls f(lo, hi, j) for every rotated pair: lo and hi index the rows, j the table (row position:
// n % T, or positions[n]).
template <class F>
void for_each_pair(const RopeCase& k, F f, const std::vector<int32_t>& positions = {}) {
  const int64_t half = k.half();
  for (int64_t n = 0; n < k.N(); ++n) {
    const int64_t pos = positions.empty() ? n % k.T : positions[n];
    for (int64_t h = 0; h < k.heads; ++h) {
      for (int64_t i = 0; i < half; ++i) {
        const int64_t lo = n * k.row_stride + h * k.HS + i;
        f(lo, lo + half, pos * half + i);
      }
    }
  }
}

// Double-precision rotation with the table's values (sign -1: the inverse); elements outside the
// heads pass through.
std::vector<double> rope_ref(const RopeCase& k, const Table& t, const std::vector<double>& x,
                             const std::vector<int32_t>& positions = {}, double sign = 1) {
  std::vector<double> y = x;
  for_each_pair(
      k,
      [&](int64_t lo, int64_t hi, int64_t j) {
        const double c = t.cos[j], s = sign * t.sin[j];
        y[lo] = x[lo] * c - x[hi] * s;
        y[hi] = x[hi] * c + x[lo] * s;
      },
      positions);
  return y;
}

// Head sizes whose half is below 8, a multiple of 8, and 8k plus a tail; rows with values after
// the rotated heads (the v part of qkv) that must stay untouched.
const RopeCase kCases[] = {{1, 3, 1, 2, 2}, {2, 5, 3, 10, 47}, {2, 3, 2, 32, 96}, {1, 4, 3, 36, 3 * 36 + 5}};

struct In {
  Table t;
  std::vector<float> x, R;
  std::vector<int32_t> positions;
};

// forward or backward in place on a copy of x; positions given when not empty.
Buf<float> rotate(Run& r, const RopeCase& k, const In& in, const std::vector<float>& x, bool forward) {
  const Buf<float> c = r.in(in.t.cos), s = r.in(in.t.sin);
  const Buf<int32_t> pos = r.in(in.positions);
  Buf<float> y = r.in(x);
  if (forward)
    r.ops.rope_forward(y, c, s, k.N(), k.T, k.heads, k.HS, k.row_stride, pos);
  else
    r.ops.rope_backward(y, c, s, k.N(), k.T, k.heads, k.HS, k.row_stride, pos);
  return y;
}

}  // namespace

// Llama 3's scaling (Llama 3.1 8B's values: theta 500000, factor 8, low 1, high 4, 8192 positions),
// against the formula written out in long double: with HS = 128 the 64 frequencies fall in all three
// bands (kept, blended, divided by the factor), which the test checks it saw.
TEST(Rope, Llama3ScalingMatchesTheFormulaInEveryBand) {
  const int64_t T = 300, HS = 128, half = HS / 2;
  const double theta = 500000.0;
  const RopeScaling sc{8.0, 1.0, 4.0, 8192.0};
  std::vector<float> c(T * half), s(T * half);
  rope_table(c.data(), s.data(), T, HS, theta, sc);
  std::vector<double> want_c(T * half), want_s(T * half);
  int bands[3] = {0, 0, 0};
  for (int64_t i = 0; i < half; ++i) {
    const long double inv = std::pow(static_cast<long double>(theta), -2.0L * i / HS);
    const long double wavelen = 2.0L * 3.14159265358979323846264338327950288L / inv;
    long double scaled;
    if (wavelen < 8192.0L / 4.0L) {
      scaled = inv, ++bands[0];
    } else if (wavelen > 8192.0L / 1.0L) {
      scaled = inv / 8.0L, ++bands[2];
    } else {
      const long double smooth = (8192.0L / wavelen - 1.0L) / (4.0L - 1.0L);
      scaled = (1.0L - smooth) * inv / 8.0L + smooth * inv, ++bands[1];
    }
    EXPECT_NEAR(static_cast<double>(rope_inv_freq(i, HS, theta, sc) / scaled), 1.0, 1e-14) << i;
    for (int64_t t = 0; t < T; ++t) {
      want_c[t * half + i] = static_cast<double>(std::cos(t * scaled));
      want_s[t * half + i] = static_cast<double>(std::sin(t * scaled));
    }
  }
  EXPECT_GT(bands[0], 0);
  EXPECT_GT(bands[1], 0);
  EXPECT_GT(bands[2], 0);
  EXPECT_TRUE(all_close(c, want_c, 6e-8, 1e-12, "cos"));
  EXPECT_TRUE(all_close(s, want_s, 6e-8, 1e-12, "sin"));
  // Factor 1 is no scaling, bit for bit.
  std::vector<float> c1(T * half), s1(T * half), c0(T * half), s0(T * half);
  rope_table(c1.data(), s1.data(), T, HS, theta, RopeScaling{1.0, 1.0, 4.0, 8192.0});
  rope_table(c0.data(), s0.data(), T, HS, theta);
  EXPECT_TRUE(testing::bitwise_equal(c1, c0, "cos"));
  EXPECT_TRUE(testing::bitwise_equal(s1, s0, "sin"));
}

// YaRN with DeepSeek-V3's settings (factor 40, original length 4096, betas 32 and 1, head RoPE part
// 64): the ramp's three regions (kept, blended, interpolated) and the table's attention factor
// m(40, 1) / m(40, 1) = 1; and with mscale 1 alone (Qwen-style) the factor 0.1 ln 40 + 1.
TEST(Rope, YarnScalingMatchesTheFormulaInEveryRegion) {
  const int64_t T = 64, HS = 64, half = HS / 2;
  const double theta = 10000.0, factor = 40.0, L = 4096.0;
  for (const double all_dim : {1.0, 0.0}) {
    RopeScaling sc;
    sc.factor = factor;
    sc.original_max_position = L;
    sc.yarn = true;
    sc.mscale_all_dim = all_dim;
    const long double pi = 3.14159265358979323846264338327950288L;
    auto dim = [&](long double r) { return HS * std::log(L / (r * 2 * pi)) / (2 * std::log((long double)theta)); };
    const long double low = std::max(std::floor(dim(32)), 0.0L),
                      high = std::min(std::ceil(dim(1)), (long double)HS - 1);
    const long double attention = all_dim != 0 ? 1.0L : 0.1L * std::log((long double)factor) + 1.0L;
    EXPECT_NEAR(rope_attention_factor(sc), static_cast<double>(attention), 1e-15);
    std::vector<float> c(T * half), s(T * half);
    rope_table(c.data(), s.data(), T, HS, theta, sc);
    std::vector<double> want_c(T * half), want_s(T * half);
    int regions[3] = {0, 0, 0};
    for (int64_t i = 0; i < half; ++i) {
      const long double inv = std::pow(static_cast<long double>(theta), -2.0L * i / HS);
      const long double ramp = std::clamp((i - low) / (high - low), 0.0L, 1.0L);
      const long double scaled = ramp * inv / factor + (1 - ramp) * inv;
      ++regions[ramp == 0 ? 0 : ramp == 1 ? 2 : 1];
      EXPECT_NEAR(static_cast<double>(rope_inv_freq(i, HS, theta, sc) / scaled), 1.0, 1e-14) << i;
      for (int64_t t = 0; t < T; ++t) {
        want_c[t * half + i] = static_cast<double>(attention * std::cos(t * scaled));
        want_s[t * half + i] = static_cast<double>(attention * std::sin(t * scaled));
      }
    }
    EXPECT_GT(regions[0], 0);
    EXPECT_GT(regions[1], 0);
    EXPECT_GT(regions[2], 0);
    EXPECT_TRUE(all_close(c, want_c, 6e-8, 1e-12, "cos"));
    EXPECT_TRUE(all_close(s, want_s, 6e-8, 1e-12, "sin"));
  }
}

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

void add_rope_cases(Registry& reg) {
  for (const RopeCase& k : kCases) {
    reg.add(
        {"Rope", "ForwardMatchesReference", {"rope_forward"}, k.label()},
        [=] {
          return In{make_table(k), randn(k.N() * k.row_stride, k.HS, "x"), {}, {}};
        },
        [=](Run& r, const In& in) { r.out("x", rotate(r, k, in, in.x, true)); },
        [=](const Result& got, const In& in) {
          const std::vector<float> x = got["x"];
          EXPECT_TRUE(all_close(x, rope_ref(k, in.t, to_double(in.x)), 1e-6, 1e-6, "x"));
          for (int64_t n = 0; n < k.N(); ++n) {
            const int64_t rotated = k.heads * k.HS;
            EXPECT_TRUE(bitwise_equal(x.data() + n * k.row_stride + rotated, in.x.data() + n * k.row_stride + rotated,
                                      k.row_stride - rotated, "untouched"));
          }
        });
  }

  // The backward (in place on the gradient) against central differences of sum(rope(x) * R).
  for (const RopeCase& k : kCases) {
    const int64_t n = k.N() * k.row_stride;
    reg.add(
        {"Rope", "BackwardMatchesFiniteDifferences", {"rope_backward"}, k.label()},
        [=] {
          return In{make_table(k), randn(n, 1, "x"), randn(n, 2, "R"), {}};
        },
        [=](Run& r, const In& in) { r.out("dx", rotate(r, k, in, in.R, false)); },
        [=](const Result& got, const In& in) {
          const auto loss = [&](const std::vector<double>& q) {
            const std::vector<double> y = rope_ref(k, in.t, q);
            double l = 0;
            for (int64_t i = 0; i < n; ++i) l += y[i] * in.R[i];
            return l;
          };
          EXPECT_TRUE(all_close(got["dx"], finite_difference(loss, to_double(in.x)), 1e-5, 1e-6, "dx"));
        });
  }

  // Every element, in a vector lane or in the scalar tail, is the documented float formula.
  {
    const RopeCase k{1, 4, 3, 36, 3 * 36 + 5};
    reg.add(
        {"Rope", "LanesComputeTheScalarFormulaBitwise", {"rope_forward", "rope_backward"}, k.label()},
        [=] {
          return In{make_table(k), randn(k.N() * k.row_stride, 4, "x"), {}, {}};
        },
        [=](Run& r, const In& in) {
          r.out("forward", rotate(r, k, in, in.x, true));
          r.out("backward", rotate(r, k, in, in.x, false));
        },
        [=](const Result& got, const In& in) {
          std::vector<float> want_fwd = in.x, want_bwd = in.x;
          for_each_pair(k, [&](int64_t lo, int64_t hi, int64_t j) {
            const float c = in.t.cos[j], s = in.t.sin[j], a = in.x[lo], b = in.x[hi];
            want_fwd[lo] = std::fma(a, c, -(b * s));
            want_fwd[hi] = std::fma(b, c, a * s);
            want_bwd[lo] = std::fma(a, c, b * s);
            want_bwd[hi] = std::fma(b, c, -(a * s));
          });
          EXPECT_TRUE(bitwise_equal(got["forward"], want_fwd, "forward"));
          EXPECT_TRUE(bitwise_equal(got["backward"], want_bwd, "backward"));
        });
  }

  // Every setting (1, 2, 3 threads on the CPU) gives the same bits; forward against the double
  // rotation, backward against the inverse rotation.
  {
    const RopeCase k{2, 13, 6, 36, 3 * 6 * 36};
    reg.add(
        {"Rope", "BitwiseIndependentOfThreadCount", {"rope_forward", "rope_backward"}, k.label()},
        [=] {
          return In{make_table(k), randn(k.N() * k.row_stride, 5, "x"), {}, {}};
        },
        [=](Run& r, const In& in) {
          r.out("forward", rotate(r, k, in, in.x, true));
          r.out("backward", rotate(r, k, in, in.x, false));
        },
        [=](const Result& got, const In& in) {
          EXPECT_TRUE(all_close(got["forward"], rope_ref(k, in.t, to_double(in.x)), 1e-6, 1e-6, "forward"));
          EXPECT_TRUE(all_close(got["backward"], rope_ref(k, in.t, to_double(in.x), {}, -1), 1e-6, 1e-6, "backward"));
        });
  }

  // Packed documents: positions restart at each document (rope.h); forward and backward against
  // the double rotation at those positions, the backward against central differences.
  {
    const RopeCase k{2, 9, 3, 20, 3 * 20 + 4};
    reg.add(
        {"Rope", "ExplicitPositionsMatchReference", {"rope_forward", "rope_backward"}, k.label()},
        [=] {
          std::vector<int32_t> pos(k.N());
          for (int64_t n = 0; n < k.N(); ++n) pos[n] = static_cast<int32_t>(n % k.T < 4 ? n % k.T : (n % k.T - 4) % 3);
          const int64_t m = k.N() * k.row_stride;
          return In{make_table(k), randn(m, 6, "x"), randn(m, 7, "R"), pos};
        },
        [=](Run& r, const In& in) {
          r.out("forward", rotate(r, k, in, in.x, true));
          r.out("backward", rotate(r, k, in, in.R, false));
        },
        [=](const Result& got, const In& in) {
          EXPECT_TRUE(
              all_close(got["forward"], rope_ref(k, in.t, to_double(in.x), in.positions), 1e-6, 1e-6, "forward"));
          const auto loss = [&](const std::vector<double>& q) {
            const std::vector<double> y = rope_ref(k, in.t, q, in.positions);
            double l = 0;
            for (size_t i = 0; i < y.size(); ++i) l += y[i] * in.R[i];
            return l;
          };
          EXPECT_TRUE(all_close(got["backward"], finite_difference(loss, to_double(in.x)), 1e-5, 1e-6, "backward"));
        });
  }
}

}  // namespace lockstep::harness
