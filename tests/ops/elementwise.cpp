// The elementwise ops (kernels/elementwise.h) on every backend: each output element is the stated
// fp32 expression, every operation rounded on its own, so each is checked bit for bit against that
// expression evaluated here (the tests, like the kernels, build with -ffp-contract=off), with the
// signed zeros, infinities and denormals the expressions must treat as IEEE says, in place where
// the contract allows it, and on empty, single, odd and multi-chunk sizes.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "../op_harness.h"
#include "../testing.h"
#include "lockstep/core/dtype.h"
#include "lockstep/core/error.h"

namespace lockstep::harness {
namespace {

using testing::bitwise_equal;
using testing::randn;

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// n random values with signed zeros, an infinity and denormals sprinkled in (no NaN: which NaN an
// operation on two NaNs returns is not the contract's).
std::vector<float> values(int64_t n, uint64_t seed, const std::string& name) {
  std::vector<float> v = randn(n, seed, name);
  const float special[] = {-0.0f, 0.0f, std::numeric_limits<float>::infinity(), from_bits(0x00000005u),
                           -from_bits(0x00400000u)};
  for (int64_t i = 0; i < n; i += 7) v[i] = special[(i / 7 + seed) % 5];
  return v;
}

constexpr int64_t kSizes[] = {0, 1, 7, 10007};

}  // namespace

void add_elementwise_cases(Registry& reg) {
  // add, multiply, add_product: out of place and in place (y = a, y = b where allowed).
  for (const int64_t n : kSizes) {
    struct In {
      std::vector<float> a, b, y0;
    };
    reg.add(
        {"Elementwise", "AddMultiplyAddProductAreTheirExpressions", {"add", "multiply", "add_product"}, str("n=", n)},
        [=] {
          return In{values(n, 1, "a"), values(n, 2, "b"), values(n, 3, "y")};
        },
        [=](Run& r, const In& in) {
          const Buf<float> a = r.in(in.a), b = r.in(in.b);
          Buf<float> sum = r.in(in.y0), prod = r.in(in.y0), acc = r.in(in.y0);
          r.ops.add(sum, a, b, n);
          r.ops.multiply(prod, a, b, n);
          r.ops.add_product(acc, a, b, n);
          r.out("add", sum);
          r.out("multiply", prod);
          r.out("add_product", acc);
          Buf<float> ya = r.in(in.a), yb = r.in(in.b);
          r.ops.add(ya, ya, b, n);       // y = a
          r.ops.multiply(yb, a, yb, n);  // y = b
          r.out("add in place", ya);
          r.out("multiply in place", yb);
        },
        [=](const Result& got, const In& in) {
          std::vector<float> sum(n), prod(n), acc(n);
          for (int64_t i = 0; i < n; ++i) {
            sum[i] = in.a[i] + in.b[i];
            prod[i] = in.a[i] * in.b[i];
            const float p = in.a[i] * in.b[i];  // the product rounded first
            acc[i] = in.y0[i] + p;
          }
          EXPECT_TRUE(bitwise_equal(got["add"], sum, "add"));
          EXPECT_TRUE(bitwise_equal(got["multiply"], prod, "multiply"));
          EXPECT_TRUE(bitwise_equal(got["add_product"], acc, "add_product"));
          EXPECT_TRUE(bitwise_equal(got["add in place"], sum, "add in place"));
          EXPECT_TRUE(bitwise_equal(got["multiply in place"], prod, "multiply in place"));
        });
  }

  // add_product rounds the product before the add: a product that needs more than 24 bits gives
  // the two-rounding result, not the FMA's.
  reg.add(
      {"Elementwise", "AddProductRoundsTheProductFirst", {"add_product"}, "1 + 2^-13, 1 - 2^-13, y = -1"},
      [](Run& r) {
        const float a = 1.0f + 0x1p-13f, b = 1.0f - 0x1p-13f;  // a b = 1 - 2^-26: rounds to 1 in fp32
        Buf<float> y = r.in(std::vector<float>{-1.0f});
        r.ops.add_product(y, r.in(std::vector<float>{a}), r.in(std::vector<float>{b}), 1);
        r.out("y", y);
      },
      [](const Result& got) {
        EXPECT_EQ(bits_of(got["y"].at(0)), bits_of(0.0f)) << "the product was fused with the add (an FMA gives -2^-26)";
      });

  // add_bias_rows: y = (x + b) + s per element, b = bias[j] or `zero` (bias null), s = sum[r, j]
  // (sum null: no second add); in place (y = x) too. bias null with zero = -0 leaves x's bits,
  // -0 inputs included; zero = +0 turns a -0 input into +0.
  for (const auto& shape : {std::pair<int64_t, int64_t>{0, 3}, {1, 1}, {5, 3}, {67, 33}, {301, 8}}) {
    const int64_t rows = shape.first, cols = shape.second;
    struct In {
      std::vector<float> x, bias, sum;
    };
    reg.add(
        {"Elementwise", "AddBiasRowsIsItsExpression", {"add_bias_rows"}, str("rows=", rows, " cols=", cols)},
        [=] {
          return In{values(rows * cols, 4, "x"), values(cols, 5, "bias"), values(rows * cols, 6, "sum")};
        },
        [=](Run& r, const In& in) {
          const Buf<float> x = r.in(in.x), bias = r.in(in.bias), sum = r.in(in.sum);
          for (const int with_bias : {0, 1, 2})  // bias, null with zero = -0, null with zero = +0
            for (const bool with_sum : {false, true})
              for (const bool in_place : {false, true}) {
                Buf<float> y = in_place ? r.in(in.x) : r.in(randn(rows * cols, 7, "y"));
                r.ops.add_bias_rows(y, in_place ? y.p() : x.p(), with_bias == 0 ? bias.p() : nullptr,
                                    with_bias == 1 ? -0.0f : 0.0f, with_sum ? sum.p() : nullptr, rows, cols);
                r.out(str("bias ", with_bias, " sum ", with_sum, " in place ", in_place), y);
              }
        },
        [=](const Result& got, const In& in) {
          for (const int with_bias : {0, 1, 2})
            for (const bool with_sum : {false, true}) {
              std::vector<float> want(rows * cols);
              for (int64_t r = 0; r < rows; ++r)
                for (int64_t j = 0; j < cols; ++j) {
                  const float b = with_bias == 0 ? in.bias[j] : with_bias == 1 ? -0.0f : 0.0f;
                  const float xb = in.x[r * cols + j] + b;
                  want[r * cols + j] = with_sum ? xb + in.sum[r * cols + j] : xb;
                }
              if (with_bias == 1 && !with_sum) {
                EXPECT_TRUE(bitwise_equal(want, in.x, "x + -0 is x"));  // the reference itself
              }
              for (const bool in_place : {false, true}) {
                const std::string name = str("bias ", with_bias, " sum ", with_sum, " in place ", in_place);
                EXPECT_TRUE(bitwise_equal(got[name], want, name));
              }
            }
        });
  }

  // add_bias_rows on signed zeros: bias null, zero = -0 keeps a -0 input's sign bit; zero = +0 and
  // a +0 bias turn it into +0.
  reg.add(
      {"Elementwise", "AddBiasRowsKeepsNegativeZeroWithNegativeZero", {"add_bias_rows"}, "rows=2 cols=2"},
      [](Run& r) {
        const Buf<float> x = r.in(std::vector<float>{-0.0f, 0.0f, -0.0f, 1.0f}), bias = r.zeros(2);
        Buf<float> a = r.zeros(4), b = r.zeros(4), c = r.zeros(4);
        r.ops.add_bias_rows(a, x, nullptr, -0.0f, nullptr, 2, 2);
        r.ops.add_bias_rows(b, x, nullptr, 0.0f, nullptr, 2, 2);
        r.ops.add_bias_rows(c, x, bias, -0.0f, nullptr, 2, 2);
        r.out("zero -0", a);
        r.out("zero +0", b);
        r.out("bias +0", c);
      },
      [](const Result& got) {
        EXPECT_TRUE(bitwise_equal(got["zero -0"], {-0.0f, 0.0f, -0.0f, 1.0f}, "zero -0"));
        EXPECT_TRUE(bitwise_equal(got["zero +0"], {0.0f, 0.0f, 0.0f, 1.0f}, "zero +0"));
        EXPECT_TRUE(bitwise_equal(got["bias +0"], {0.0f, 0.0f, 0.0f, 1.0f}, "bias +0"));
      });

  // add_group_bias: rows [offsets[g], offsets[g + 1]) of y += bias row g, as bias + y; empty groups
  // (and no groups at all) allowed. offsets live on the host, as grouped_gemm's do.
  {
    struct Layout {
      std::vector<int64_t> offsets;
      int64_t cols;
    };
    for (const Layout& l : {Layout{{0}, 3}, Layout{{0, 1}, 1}, Layout{{0, 0, 3, 3, 7}, 5},
                            Layout{{0, 150, 151, 301}, 9}, Layout{{0, 0, 0}, 4}}) {
      const int64_t G = static_cast<int64_t>(l.offsets.size()) - 1, R = l.offsets.back(), C = l.cols;
      struct In {
        std::vector<float> y, bias;
      };
      reg.add(
          {"Elementwise", "AddGroupBiasAddsEachGroupsRow", {"add_group_bias"}, str("G=", G, " R=", R, " cols=", C)},
          [=] {
            return In{values(R * C, 8, "y"), values(G * C, 9, "bias")};
          },
          [=](Run& r, const In& in) {
            Buf<float> y = r.in(in.y);
            const Buf<float> bias = r.in(in.bias);
            r.ops.add_group_bias(y, bias, l.offsets.data(), G, C);
            r.out("y", y);
          },
          [=](const Result& got, const In& in) {
            std::vector<float> want = in.y;
            for (int64_t g = 0; g < G; ++g)
              for (int64_t i = l.offsets[g]; i < l.offsets[g + 1]; ++i)
                for (int64_t j = 0; j < C; ++j) want[i * C + j] = in.bias[g * C + j] + in.y[i * C + j];
            EXPECT_TRUE(bitwise_equal(got["y"], want, "y"));
          });
    }
  }

  // pack_bf16 / unpack_bf16 (the MoE dispatch payload): unpack(pack(x)) is round_bf16(x) bit for bit,
  // the packed words are to_bf16's, specials included.
  for (const int64_t n : kSizes) {
    reg.add(
        {"Elementwise", "PackedBf16IsRoundBf16", {"pack_bf16", "unpack_bf16", "round_bf16"}, str("n=", n)},
        [=] {
          std::vector<float> x = values(n, 12, "x");
          const float special[] = {
              from_bits(0x3f808000u), from_bits(0x3f818000u), from_bits(0x7f7fffffu), from_bits(0x7fa00001u), -0.0f,
              from_bits(0x80008000u)};
          for (int64_t i = 2; i < n; i += 7) x[i] = special[(i / 7) % 6];
          return x;
        },
        [=](Run& r, const std::vector<float>& x0) {
          const Buf<float> x = r.in(x0);
          Buf<uint16_t> packed = r.zeros<uint16_t>(n);
          Buf<float> y = r.zeros(n), rounded = r.zeros(n);
          r.ops.pack_bf16(packed, x, n);
          r.ops.unpack_bf16(y, packed, n);
          r.ops.round_bf16(rounded, x, n);
          r.out("unpacked", y);
          r.out("rounded", rounded);
          std::vector<float> words;
          for (uint16_t w : r.get(packed)) words.push_back(from_bits(static_cast<uint32_t>(w)));
          r.out("words", words);
        },
        [=](const Result& got, const std::vector<float>& x) {
          EXPECT_TRUE(bitwise_equal(got["unpacked"], got["rounded"], "unpack(pack(x)) vs round_bf16(x)"));
          std::vector<float> want(n);
          for (int64_t i = 0; i < n; ++i) want[i] = from_bits(to_bf16(x[i]).bits);
          EXPECT_TRUE(bitwise_equal(got["words"], want, "the packed words"));
        });
  }

  // round_bf16: core/dtype.h's to_f32(to_bf16(x)) (nearest, ties to even; NaN stays NaN, quiet;
  // infinities stay), out of place and in place; plus hand-picked ties and overflow.
  for (const int64_t n : kSizes) {
    reg.add(
        {"Elementwise", "RoundBf16IsDtypesRounding", {"round_bf16"}, str("n=", n)},
        [=] {
          std::vector<float> x = values(n, 10, "x");
          const float special[] = {from_bits(0x3f808000u),  // tie, even below: 0x3f80
                                   from_bits(0x3f818000u),  // tie, odd below: up to 0x3f82
                                   from_bits(0x3f808001u),  // just above a tie: up
                                   from_bits(0x7f7fffffu),  // the largest float: rounds to infinity
                                   from_bits(0x7fa00001u),  // a signalling NaN: quiet NaN
                                   from_bits(0xffc00000u), -0.0f, from_bits(0x80008000u)};
          for (int64_t i = 3; i < n; i += 11) x[i] = special[(i / 11) % 8];
          return x;
        },
        [=](Run& r, const std::vector<float>& x0) {
          const Buf<float> x = r.in(x0);
          Buf<float> y = r.in(randn(n, 11, "y")), z = r.in(x0);
          r.ops.round_bf16(y, x, n);
          r.ops.round_bf16(z, z, n);
          r.out("y", y);
          r.out("in place", z);
        },
        [=](const Result& got, const std::vector<float>& x) {
          std::vector<float> want(n);
          for (int64_t i = 0; i < n; ++i) want[i] = to_f32(to_bf16(x[i]));
          EXPECT_TRUE(bitwise_equal(got["y"], want, "y"));
          EXPECT_TRUE(bitwise_equal(got["in place"], want, "in place"));
          const std::vector<float> y = got["y"];
          for (int64_t i = 0; i < n; ++i) {
            EXPECT_EQ(bits_of(y[i]) & 0xffffu, 0u) << i;
            EXPECT_EQ(std::isnan(y[i]), std::isnan(x[i])) << i;
          }
          // The hand-picked values: ties to even, just above a tie, overflow, a signalling NaN, a
          // negative denormal tie (to -0).
          const std::pair<uint32_t, uint32_t> picked[] = {{0x3f808000u, 0x3f800000u}, {0x3f818000u, 0x3f820000u},
                                                          {0x3f808001u, 0x3f810000u}, {0x7f7fffffu, 0x7f800000u},
                                                          {0x7fa00001u, 0x7fe00000u}, {0x80008000u, 0x80000000u}};
          for (int64_t i = 3; i < n; i += 11)
            for (const auto& [in, out] : picked) {
              if (bits_of(x[i]) == in) {
                EXPECT_EQ(bits_of(y[i]), out) << i;
              }
            }
        });
  }

  // zero_rows_of_zeros: row r of act (R, F) becomes +0 exactly when row r of x (R, C) is all +0 /
  // -0; rows with one nonzero (a denormal, a NaN, at the first or last column) keep act's bits.
  for (const auto& shape : {std::pair<int64_t, int64_t>{0, 3}, {1, 1}, {9, 4}, {301, 7}}) {
    const int64_t R = shape.first, C = shape.second, F = 2 * C + 1;
    struct In {
      std::vector<float> x, act;
    };
    reg.add(
        {"Elementwise",
         "ZeroRowsOfZerosZeroesExactlyTheZeroRows",
         {"zero_rows_of_zeros"},
         str("R=", R, " F=", F, " C=", C)},
        [=] {
          In in{randn(R * C, 12, "x"), values(R * F, 13, "act")};
          for (int64_t r = 0; r < R; ++r) {
            float* row = in.x.data() + r * C;
            switch (r % 9) {
              case 0:
                std::fill(row, row + C, 0.0f);
                break;
              case 1:
                std::fill(row, row + C, -0.0f);
                break;
              case 2:
                for (int64_t j = 0; j < C; ++j) row[j] = j % 2 ? -0.0f : 0.0f;
                break;
              case 3:  // zeros but the last column: a denormal
                std::fill(row, row + C, -0.0f);
                row[C - 1] = from_bits(0x00000001u);
                break;
              case 4:  // zeros but the first column
                std::fill(row, row + C, 0.0f);
                row[0] = -1.0f;
                break;
              case 5:  // zeros but a NaN
                std::fill(row, row + C, 0.0f);
                row[C / 2] = std::numeric_limits<float>::quiet_NaN();
                break;
              default:
                break;  // random
            }
          }
          return in;
        },
        [=](Run& r, const In& in) {
          const Buf<float> x = r.in(in.x);
          Buf<float> act = r.in(in.act);
          r.ops.zero_rows_of_zeros(act, x, R, F, C);
          r.out("act", act);
        },
        [=](const Result& got, const In& in) {
          std::vector<float> want = in.act;
          for (int64_t r = 0; r < R; ++r) {
            bool zero = true;
            for (int64_t j = 0; j < C; ++j) zero &= in.x[r * C + j] == 0.0f;
            EXPECT_EQ(zero, r % 9 < 3) << "the case's row " << r;
            if (zero) std::fill(want.begin() + r * F, want.begin() + (r + 1) * F, 0.0f);
          }
          EXPECT_TRUE(bitwise_equal(got["act"], want, "act"));
        });
  }
}

}  // namespace lockstep::harness
