// The quantisers (tensorwise / blockwise FP8, MXFP8, NVFP4), stochastic rounding, amax, dequantize
// and the random Hadamard transform (kernels/quantize.h) on every backend, against
// double-precision references and the scalar encoders of core/float_formats.h. (The encoders
// themselves: test_float_formats.cpp; fp8_scale_from_amax, host code: below.)
#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "../op_harness.h"
#include "../testing.h"
#include "lockstep/core/error.h"
#include "lockstep/core/float_formats.h"
#include "lockstep/core/philox.h"

namespace lockstep::harness {
namespace {

using testing::bitwise_equal;

struct FormatBits {
  int M, emin;
};
FormatBits bits_of(ElemFormat f) {
  return f == ElemFormat::e4m3 ? FormatBits{3, -6} : f == ElemFormat::e5m2 ? FormatBits{2, -14} : FormatBits{1, 0};
}

// Gap between the representable magnitudes around |y| (double), for |y| <= max_finite.
double gap_at(ElemFormat f, double y) {
  const FormatBits b = bits_of(f);
  const int e = y == 0 ? b.emin : std::max(b.emin, static_cast<int>(std::floor(std::log2(std::abs(y)))));
  return std::ldexp(1.0, e - b.M);
}

// Outliers on a normal background, with some exact zeros, rows x cols.
std::vector<float> test_matrix(int64_t rows, int64_t cols, uint64_t seed, float scale = 1.0f) {
  std::vector<float> x = testing::randn(rows * cols, seed, "quantize", scale);
  for (int64_t i = 0; i < rows * cols; i += 97) x[i] *= 40.0f;
  for (int64_t i = 5; i < rows * cols; i += 131) x[i] = 0.0f;
  return x;
}

// ---- A QuantizedTensor as outputs, and back

// Records q (codes, scales, tensor scale, its layout) as outputs `name ...`, and (with deq) the
// values the backend's dequantize gives it as `name values`.
void out_q(Run& r, const std::string& name, const QuantizedTensor& q, bool deq = true) {
  r.out(name + " layout", std::vector<int32_t>{static_cast<int32_t>(q.elem), static_cast<int32_t>(q.scale_format),
                                               static_cast<int32_t>(q.rows), static_cast<int32_t>(q.cols),
                                               static_cast<int32_t>(q.block_rows), static_cast<int32_t>(q.block_cols)});
  r.out(name + " codes", q.codes);
  r.out(name + " scale codes", q.scale_codes);
  r.out(name + " scales", q.scales);
  r.out(name + " tensor scale", q.tensor_scale);
  if (deq) {
    Buf<float> values = r.zeros(q.rows * q.cols);
    r.ops.dequantize(values, q.cols, q);
    r.out(name + " values", values);
  }
}
QuantizedTensor q_of(const Result& got, const std::string& name) {
  const std::vector<int32_t> l = got.get<int32_t>(name + " layout");
  QuantizedTensor q;
  if (l.size() != 6) return q;
  q.elem = static_cast<ElemFormat>(l[0]);
  q.scale_format = static_cast<ScaleFormat>(l[1]);
  q.rows = l[2], q.cols = l[3], q.block_rows = l[4], q.block_cols = l[5];
  q.codes = got.get<uint8_t>(name + " codes");
  q.scale_codes = got.get<uint8_t>(name + " scale codes");
  q.scales = got.get<float>(name + " scales");
  q.tensor_scale = got[name + " tensor scale"].at(0);
  return q;
}

// The recipe-independent contract: value() is dequantize()'s output bit for bit, and each code is
// the nearest (ties aside) to x / m, m = the element's multiplier (block scale * tensor scale), or
// +-max when x / m is beyond it. Checked in double.
void check_nearest(const Result& got, const std::string& name, const std::vector<float>& x) {
  const QuantizedTensor q = q_of(got, name);
  const std::vector<float> deq = got[name + " values"];
  const double fmax = max_finite(q.elem);
  for (int64_t r = 0; r < q.rows; ++r) {
    for (int64_t c = 0; c < q.cols; ++c) {
      const size_t i = static_cast<size_t>(r * q.cols + c);
      ASSERT_TRUE(bitwise_equal(&deq[i], std::vector<float>{q.value(r, c)}.data(), 1));
      const double m = static_cast<double>(q.block_scale(r / q.block_rows, c / q.block_cols)) * q.tensor_scale;
      const double y = x[i] / m, v = decode(q.elem, q.code(r, c));
      if (std::abs(y) >= fmax) {
        ASSERT_EQ(std::abs(v), fmax) << r << "," << c << " y=" << y;
      } else {
        ASSERT_LE(std::abs(v - y), 0.5 * gap_at(q.elem, y) + 1e-6 * std::abs(y))
            << r << "," << c << " y=" << y << " code value " << v;
      }
      ASSERT_EQ(std::signbit(v), std::signbit(x[i])) << r << "," << c;
    }
  }
}

// max over blocks of (max |value - x| in the block) / amax_b, in double.
double worst_block_error(const QuantizedTensor& q, const std::vector<float>& x) {
  double worst = 0;
  for (int64_t br = 0; br < q.grid_rows(); ++br) {
    for (int64_t bc = 0; bc < q.grid_cols(); ++bc) {
      double amax_b = 0, err = 0;
      for (int64_t r = br * q.block_rows; r < std::min(q.rows, (br + 1) * q.block_rows); ++r) {
        for (int64_t c = bc * q.block_cols; c < std::min(q.cols, (bc + 1) * q.block_cols); ++c) {
          const double xv = x[static_cast<size_t>(r * q.cols + c)];
          amax_b = std::max(amax_b, std::abs(xv));
          err = std::max(err, std::abs(static_cast<double>(q.value(r, c)) - xv));
        }
      }
      if (amax_b > 0) worst = std::max(worst, err / amax_b);
    }
  }
  return worst;
}

const StochasticRounding kNearest{};

// E2M1 code (r, c) of packed NVFP4 codes.
uint8_t nibble(const QuantizedTensor& q, int64_t r, int64_t c) {
  return (q.codes[static_cast<size_t>(r * q.row_bytes() + c / 2)] >> (c % 2 ? 4 : 0)) & 0xF;
}

double hadamard_entry(int i, int k) { return ((__builtin_popcount(i & k) & 1) ? -0.25 : 0.25) * hadamard16_signs()[k]; }

}  // namespace

// TransformerEngine's scale from an amax (host code, the same for every backend).
TEST(Quantize, ScaleFromAmaxFollowsTransformerEngine) {
  EXPECT_EQ(fp8_scale_from_amax(2.0f, ElemFormat::e4m3), 224.0f);
  EXPECT_EQ(fp8_scale_from_amax(2.0f, ElemFormat::e4m3, 1), 112.0f);
  EXPECT_EQ(fp8_scale_from_amax(4.0f, ElemFormat::e5m2), 14336.0f);
  EXPECT_EQ(fp8_scale_from_amax(0.0f, ElemFormat::e4m3, 0, 3.5f), 3.5f);  // keep the last scale
  EXPECT_EQ(fp8_scale_from_amax(std::numeric_limits<float>::infinity(), ElemFormat::e4m3, 0, 2.0f), 2.0f);
  EXPECT_EQ(fp8_scale_from_amax(std::nanf(""), ElemFormat::e4m3), 1.0f);
}

void add_quantize_cases(Registry& reg) {
  reg.add(
      {"Quantize", "ScaleFromAmaxFollowsTransformerEngine", {"amax"}, "amax of 3 and of 4 values (a NaN)"},
      [](Run& r) {
        const Buf<float> x = r.in(std::vector<float>{0.5f, -3.0f, 2.0f, std::nanf("")});
        r.out("amax of 3", r.ops.amax(x, 3));
        r.out("amax of 4", r.ops.amax(x, 4));
      },
      [](const Result& got) {
        EXPECT_EQ(got["amax of 3"].at(0), 3.0f);
        EXPECT_TRUE(std::isnan(got["amax of 4"].at(0)));
      });

  for (ElemFormat f : {ElemFormat::e4m3, ElemFormat::e5m2}) {
    reg.add(
        {"Quantize",
         "TensorwiseIsNearestWithinTheFormatsBound",
         {"amax", "quantize_tensorwise", "dequantize"},
         std::string(elem_format_name(f))},
        [] { return test_matrix(37, 53, 1); },
        [=](Run& r, const std::vector<float>& x) {
          const Buf<float> xd = r.in(x);
          const float scale = fp8_scale_from_amax(r.ops.amax(xd, 37 * 53), f);
          QuantizedTensor q;
          r.ops.quantize_tensorwise(q, xd, 37, 53, f, scale, kNearest);
          r.out("scale", scale);
          out_q(r, "q", q);
        },
        [=](const Result& got, const std::vector<float>& x) {
          const QuantizedTensor q = q_of(got, "q");
          const float scale = got["scale"].at(0);
          EXPECT_EQ(q.scales.size(), 1u);
          EXPECT_EQ(q.scales.at(0), 1.0f / scale);
          check_nearest(got, "q", x);
          // Relative error 2^-(M+1) in the normal range, absolute half a subnormal quantum below it.
          const FormatBits b = bits_of(f);
          for (int64_t i = 0; i < 37 * 53; ++i) {
            const double err = std::abs(static_cast<double>(q.value(i / 53, i % 53)) - x[i]);
            const double bound =
                std::max(std::ldexp(std::abs(x[i]), -(b.M + 1)), std::ldexp(q.scales[0], b.emin - b.M - 1));
            ASSERT_LE(err, bound * (1 + 1e-6)) << elem_format_name(f) << " " << x[i];
          }
        });
  }

  // The encoder's vector lanes and its scalar tail against encode(f, x * scale) (the scalar
  // encoder): every fp32 exponent with both signs, each mantissa's rounding boundaries for the
  // format (half a quantum, one ulp either side, an odd and an even truncated code), the largest
  // mantissas (carry into the exponent, saturation), infinities and NaNs with payloads; rows of 61
  // values, so that the tail of each row is encoded by the scalar loop. Round to nearest and
  // stochastic.
  for (ElemFormat f : {ElemFormat::e4m3, ElemFormat::e5m2}) {
    for (float scale : {1.0f, 0.3f, 1.0f / 3.0f * 0x1p-20f, 0x1p30f}) {
      reg.add(
          {"Quantize",
           "EncodingOfEveryExponentMatchesTheScalarEncoders",
           {"quantize_tensorwise"},
           str(elem_format_name(f), " scale ", scale)},
          [=] {
            const int sh = 23 - bits_of(f).M;
            const uint32_t half = 1u << (sh - 1);
            const uint32_t mantissas[] = {0,
                                          1,
                                          half - 1,
                                          half,
                                          half + 1,
                                          (1u << sh) | half,
                                          ((1u << sh) | half) - 1,
                                          ((1u << sh) | half) + 1,
                                          (3u << sh) | half,
                                          0x7fffffu,
                                          0x7fffffu - half,
                                          0x400000u};
            std::vector<float> x;
            for (uint32_t sign : {0u, 1u})
              for (uint32_t e = 0; e < 256; ++e)
                for (uint32_t m : mantissas) x.push_back(std::bit_cast<float>(sign << 31 | e << 23 | m));
            x.resize(static_cast<size_t>((static_cast<int64_t>(x.size()) + 60) / 61 * 61), 0.0f);
            return x;
          },
          [=](Run& r, const std::vector<float>& x) {
            const int64_t cols = 61, rows = static_cast<int64_t>(x.size()) / cols;
            const Buf<float> xd = r.in(x);
            QuantizedTensor q;
            r.ops.quantize_tensorwise(q, xd, rows, cols, f, scale, kNearest);
            r.out("nearest", q.codes);
            // Stochastic: encode_stochastic with the element's draw, the runs starting anywhere in a block.
            for (int64_t base : {0, 1, 2, 3}) {
              StochasticRounding sr;
              sr.enabled = true;
              sr.seed = 5;
              sr.index_base = base;
              r.ops.quantize_tensorwise(q, xd, rows, cols, f, scale, sr);
              r.out(str("stochastic base ", base), q.codes);
            }
          },
          [=](const Result& got, const std::vector<float>& x) {
            const std::vector<uint8_t> nearest = got.get<uint8_t>("nearest");
            for (size_t i = 0; i < x.size(); ++i)
              ASSERT_EQ(nearest.at(i), encode(f, x[i] * scale)) << elem_format_name(f) << " x bits " << std::hex
                                                                << std::bit_cast<uint32_t>(x[i]) << " scale " << scale;
            for (int64_t base : {0, 1, 2, 3}) {
              const std::vector<uint8_t> codes = got.get<uint8_t>(str("stochastic base ", base));
              const RandomStream rng(5, sr_purpose(0, 0));
              for (size_t i = 0; i < x.size(); ++i)
                ASSERT_EQ(codes.at(i), encode_stochastic(f, x[i] * scale, rng.bits(static_cast<uint64_t>(base) + i)))
                    << elem_format_name(f) << " x bits " << std::hex << std::bit_cast<uint32_t>(x[i]) << " scale "
                    << scale;
            }
          });
    }
  }

  // The same for E2M1 (NVFP4's elements, two per byte): codes against encode(e2m1, x * m), m = S / d
  // the block's multiplier from quantize.h's two-level scales (S = 6 * 448 / amax, d the decoded
  // E4M3 block scale), on values spread over 2^-11 .. 2^3 in every block with the rounding
  // boundaries of one mantissa bit; 84 columns, so that each row ends in a 4-column block the
  // scalar loop encodes.
  reg.add(
      {"Quantize", "NearestE2m1EncodingMatchesTheScalarEncoder", {"quantize_nvfp4"}, "84 columns"},
      [] {
        const uint32_t mantissas[] = {0,         1,         0x200000u - 1, 0x200000u, 0x200001u,
                                      0x600000u, 0x5fffffu, 0x600001u,     0x7fffffu};
        std::vector<float> x;
        for (uint32_t sign : {0u, 1u})  // exponent-minor: each block of 16 spans the range (subnormal codes too)
          for (uint32_t m : mantissas)
            for (uint32_t e = 127 - 11; e <= 127 + 3; ++e) x.push_back(std::bit_cast<float>(sign << 31 | e << 23 | m));
        x.resize(static_cast<size_t>((static_cast<int64_t>(x.size()) + 83) / 84 * 84), 0.25f);
        return x;
      },
      [](Run& r, const std::vector<float>& x) {
        QuantizedTensor q;
        r.ops.quantize_nvfp4(q, r.in(x), static_cast<int64_t>(x.size()) / 84, 84, 1, kNearest, nullptr);
        out_q(r, "q", q, false);
      },
      [](const Result& got, const std::vector<float>& x) {
        const int64_t cols = 84, rows = static_cast<int64_t>(x.size()) / cols;
        float t = 0.0f;
        for (float v : x) t = std::max(t, std::abs(v));
        const float S = 6.0f * 448.0f / t;
        const QuantizedTensor q = q_of(got, "q");
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c0 = 0; c0 < cols; c0 += 16) {
            float amax_b = 0.0f;
            for (int64_t c = c0; c < std::min(cols, c0 + 16); ++c) amax_b = std::max(amax_b, std::abs(x[r * cols + c]));
            const float d = decode_e4m3(encode_e4m3((amax_b / 6.0f) * S));
            const float m = d == 0.0f ? 0.0f : S / d;
            for (int64_t c = c0; c < std::min(cols, c0 + 16); ++c)
              ASSERT_EQ(nibble(q, r, c), encode(ElemFormat::e2m1, x[r * cols + c] * m))
                  << "x bits " << std::hex << std::bit_cast<uint32_t>(x[r * cols + c]) << " row " << std::dec << r
                  << " col " << c;
          }
      });

  // Every block recipe, round to nearest and stochastic, against the scalar encoders element by
  // element: code(r, c) == encode(f, x * m) or encode_stochastic(f, x * m, bits(index)), m the
  // element's multiplier (1 / the block's power-of-two scale; NVFP4: S / d as above), the index
  // index_base + r * row stride + c with the bases 0..3 (so that a run's first draw sits anywhere
  // in its Philox block) and a wider global row. Column blocks of 1 (128 x 1), 128 (1 x 128), 32
  // (MXFP8), 16 (NVFP4, a row's 64-block chunks) and 12 (2 x 12), 75 columns, so that rows end in
  // scalar tails. (blockwise_odd: 2 x 12 blocks, whose 8-column groups straddle blocks: a
  // multiplier per lane.)
  {
    enum Kind { blockwise_cols, blockwise_rows, mxfp8, nvfp4, blockwise_odd };
    const char* kind_names[] = {"blockwise 128x1", "blockwise 1x128", "mxfp8", "nvfp4", "blockwise 2x12"};
    const int64_t rows = 256, cols = 75;
    for (Kind kind : {blockwise_cols, blockwise_rows, mxfp8, nvfp4, blockwise_odd})
      for (bool stochastic : {false, true}) {
        const auto sr_of = [=](int64_t base, int64_t global_cols) {
          StochasticRounding sr;
          sr.enabled = stochastic;
          sr.seed = 7;
          sr.step = 3;
          sr.tensor_id = 11;
          sr.index_base = base;
          sr.global_cols = global_cols;
          return sr;
        };
        reg.add(
            {"Quantize",
             "EveryRecipesCodesMatchTheScalarEncoders",
             {"quantize_blockwise", "quantize_mxfp8", "quantize_nvfp4"},
             str(kind_names[kind], stochastic ? " stochastic" : " nearest")},
            [] {
              std::vector<float> x = test_matrix(rows, cols, 9);
              for (int64_t i = 0; i < rows * cols; i += 7)
                x[i] = std::bit_cast<float>((std::bit_cast<uint32_t>(x[i]) & 0xfff00000u) | 0x80000u);
              return x;
            },
            [=](Run& r, const std::vector<float>& x) {
              const Buf<float> xd = r.in(x);
              const ElemFormat f = kind == nvfp4 ? ElemFormat::e2m1 : ElemFormat::e4m3;
              for (int64_t base : {0, 1, 2, 3})
                for (int64_t global_cols : {int64_t{0}, int64_t{83}}) {
                  const StochasticRounding sr = sr_of(base, global_cols);
                  QuantizedTensor q;
                  switch (kind) {
                    case blockwise_cols:
                      r.ops.quantize_blockwise(q, xd, rows, cols, f, 128, 1, sr);
                      break;
                    case blockwise_rows:
                      r.ops.quantize_blockwise(q, xd, rows, cols, f, 1, 128, sr);
                      break;
                    case mxfp8:
                      r.ops.quantize_mxfp8(q, xd, rows, cols, f, ScaleRounding::up, 32, sr);
                      break;
                    case nvfp4:
                      r.ops.quantize_nvfp4(q, xd, rows, cols, 1, sr, nullptr);
                      break;
                    case blockwise_odd:
                      r.ops.quantize_blockwise(q, xd, rows, cols, f, 2, 12, sr);
                      break;
                  }
                  out_q(r, str("base ", base, " global_cols ", global_cols), q, false);
                }
            },
            [=](const Result& got, const std::vector<float>& x) {
              const ElemFormat f = kind == nvfp4 ? ElemFormat::e2m1 : ElemFormat::e4m3;
              float t = 0.0f;
              for (float v : x) t = std::max(t, std::abs(v));
              const float S = 6.0f * 448.0f / t;
              for (int64_t base : {0, 1, 2, 3})
                for (int64_t global_cols : {int64_t{0}, int64_t{83}}) {
                  const StochasticRounding sr = sr_of(base, global_cols);
                  const QuantizedTensor q = q_of(got, str("base ", base, " global_cols ", global_cols));
                  const RandomStream rng(sr.seed, sr_purpose(sr.tensor_id, sr.step));
                  for (int64_t r = 0; r < rows; ++r)
                    for (int64_t c = 0; c < cols; ++c) {
                      const float d = q.block_scale(r / q.block_rows, c / q.block_cols);
                      const float m = kind != nvfp4 ? 1.0f / d : d == 0.0f ? 0.0f : S / d;
                      const float y = x[r * cols + c] * m;
                      const auto index = static_cast<uint64_t>(base + r * (global_cols ? global_cols : cols) + c);
                      const uint8_t want = stochastic ? encode_stochastic(f, y, rng.bits(index)) : encode(f, y);
                      const uint8_t code = kind == nvfp4 ? nibble(q, r, c) : q.codes[static_cast<size_t>(r * cols + c)];
                      ASSERT_EQ(code, want)
                          << "base " << base << " global_cols " << global_cols << " at " << r << "," << c;
                    }
                }
            });
      }
  }

  // amax against the scalar fold m = (|v| > m or isnan(|v|)) ? |v| : m from 0, bitwise: without a
  // NaN the max; with NaNs (each with its own payload) at the start, in the middle of a vector
  // stretch and in the tail, the last one. Lengths around the vector widths.
  for (int64_t n : {1, 7, 8, 9, 31, 32, 33, 100, 5000, 300001}) {
    reg.add(
        {"Quantize", "AmaxIsTheScalarFoldBitwiseWhereverTheNaNs", {"amax"}, str("n=", n)},
        [=] {
          std::vector<float> x = test_matrix(1, n, 3);
          x[static_cast<size_t>(n / 2)] = -7500.0f;  // the max, negative
          return x;
        },
        [=](Run& r, const std::vector<float>& x0) {
          std::vector<float> x = x0;
          r.out("amax", r.ops.amax(r.in(x), n));
          uint32_t payload = 0x7fc00001u;
          for (int64_t at : {int64_t{0}, n / 3, n - 1}) {
            x[static_cast<size_t>(at)] = std::bit_cast<float>(payload | 0x80000000u);
            r.out(str("amax with NaN ", payload++ & 0xf, " at ", at), r.ops.amax(r.in(x), n));
          }
        },
        [=](const Result& got, const std::vector<float>& x0) {
          const auto fold = [](const std::vector<float>& v, int64_t n) {
            float m = 0.0f;
            for (int64_t i = 0; i < n; ++i) {
              const float a = std::abs(v[static_cast<size_t>(i)]);
              m = (a > m || std::isnan(a)) ? a : m;
            }
            return m;
          };
          std::vector<float> x = x0;
          const float a = got["amax"].at(0);
          EXPECT_EQ(std::bit_cast<uint32_t>(a), std::bit_cast<uint32_t>(7500.0f)) << n;
          EXPECT_EQ(std::bit_cast<uint32_t>(a), std::bit_cast<uint32_t>(fold(x, n))) << n;
          uint32_t payload = 0x7fc00001u;
          for (int64_t at : {int64_t{0}, n / 3, n - 1}) {
            x[static_cast<size_t>(at)] = std::bit_cast<float>(payload | 0x80000000u);
            ASSERT_EQ(std::bit_cast<uint32_t>(got[str("amax with NaN ", payload++ & 0xf, " at ", at)].at(0)),
                      std::bit_cast<uint32_t>(fold(x, n)))
                << n << " " << at;
          }
        });
  }

  for (auto [br, bc] : {std::pair<int64_t, int64_t>{1, 128}, {128, 1}, {128, 128}}) {
    const int64_t rows = 130, cols = 300;  // partial edge blocks both ways
    reg.add(
        {"Quantize", "BlockwiseUsesPowerOfTwoScalesPerBlock", {"quantize_blockwise", "dequantize"}, str(br, "x", bc)},
        [] { return test_matrix(rows, cols, 2); },
        [=](Run& r, const std::vector<float>& x) {
          QuantizedTensor q;
          r.ops.quantize_blockwise(q, r.in(x), rows, cols, ElemFormat::e4m3, br, bc, kNearest);
          out_q(r, "q", q);
        },
        [=](const Result& got, const std::vector<float>& x) {
          const QuantizedTensor q = q_of(got, "q");
          ASSERT_EQ(q.grid_rows(), (rows + br - 1) / br);
          ASSERT_EQ(q.grid_cols(), (cols + bc - 1) / bc);
          check_nearest(got, "q", x);
          for (int64_t gr = 0; gr < q.grid_rows(); ++gr) {
            for (int64_t gc = 0; gc < q.grid_cols(); ++gc) {
              double amax_b = 0;
              for (int64_t r = gr * br; r < std::min(rows, (gr + 1) * br); ++r) {
                for (int64_t c = gc * bc; c < std::min(cols, (gc + 1) * bc); ++c)
                  amax_b = std::max(amax_b, std::abs(double(x[r * cols + c])));
              }
              const double want =
                  amax_b == 0 ? 1 : std::ldexp(1.0, -static_cast<int>(std::floor(std::log2(448.0 / amax_b))));
              ASSERT_EQ(q.block_scale(gr, gc), want) << br << "x" << bc << " block " << gr << "," << gc;
            }
          }
          EXPECT_LE(worst_block_error(q, x), 0x1p-4) << br << "x" << bc;
        });
  }

  for (ElemFormat f : {ElemFormat::e4m3, ElemFormat::e5m2}) {
    for (ScaleRounding rule : {ScaleRounding::down, ScaleRounding::up}) {
      const int64_t rows = 9, cols = 100;
      reg.add(
          {"Quantize",
           "Mxfp8ScalesFollowOcpOrTransformerEngine",
           {"quantize_mxfp8", "dequantize"},
           str(elem_format_name(f), rule == ScaleRounding::down ? " OCP (down)" : " TE (up)")},
          [] { return test_matrix(rows, cols, 3, 0.01f); },
          [=](Run& r, const std::vector<float>& x) {
            QuantizedTensor q;
            r.ops.quantize_mxfp8(q, r.in(x), rows, cols, f, rule, 32, kNearest);
            out_q(r, "q", q);
          },
          [=](const Result& got, const std::vector<float>& x) {
            const QuantizedTensor q = q_of(got, "q");
            ASSERT_EQ(q.scale_format, ScaleFormat::e8m0);
            ASSERT_EQ(q.grid_cols(), 4);
            check_nearest(got, "q", x);
            int saturated = 0;
            for (int64_t r = 0; r < rows; ++r) {
              for (int64_t gc = 0; gc < 4; ++gc) {
                double amax_b = 0;
                for (int64_t c = gc * 32; c < std::min(cols, gc * 32 + 32); ++c)
                  amax_b = std::max(amax_b, std::abs(double(x[r * cols + c])));
                const int e = rule == ScaleRounding::down
                                  ? static_cast<int>(std::floor(std::log2(amax_b))) - max_exponent(f)
                                  : static_cast<int>(std::ceil(std::log2(amax_b / max_finite(f))));
                ASSERT_EQ(q.block_scale(r, gc), std::ldexp(1.0, e)) << r << "," << gc;
                for (int64_t c = gc * 32; c < std::min(cols, gc * 32 + 32); ++c) {
                  saturated += std::abs(x[r * cols + c]) / q.block_scale(r, gc) > max_finite(f);
                }
              }
            }
            // TE's rule never saturates; OCP's does for blocks whose amax sits in [fmax, 2^(emax+1)) X.
            if (rule == ScaleRounding::up) {
              EXPECT_EQ(saturated, 0) << elem_format_name(f);
            } else {
              EXPECT_GT(saturated, 0) << elem_format_name(f);  // this data has such blocks
            }
            EXPECT_LE(worst_block_error(q, x), f == ElemFormat::e4m3 ? 0.125 : 0.25);
          });
    }
  }

  for (int64_t br : {1, 16}) {
    const int64_t rows = 32, cols = 88;  // 88 = 5.5 blocks of 16: a partial block, full bytes
    reg.add(
        {"Quantize", "Nvfp4TwoLevelScales", {"quantize_nvfp4", "amax", "dequantize"}, str("block rows ", br)},
        [] { return test_matrix(rows, cols, 4); },
        [=](Run& r, const std::vector<float>& x) {
          const Buf<float> xd = r.in(x);
          r.out("amax", r.ops.amax(xd, rows * cols));
          QuantizedTensor q;
          r.ops.quantize_nvfp4(q, xd, rows, cols, br, kNearest, nullptr);
          out_q(r, "q", q);
        },
        [=](const Result& got, const std::vector<float>& x) {
          const double t = got["amax"].at(0);
          const QuantizedTensor q = q_of(got, "q");
          ASSERT_EQ(q.elem, ElemFormat::e2m1);
          ASSERT_EQ(q.scale_format, ScaleFormat::e4m3);
          ASSERT_EQ(q.row_bytes(), 44);
          EXPECT_EQ(q.tensor_scale, static_cast<float>(t / 2688.0));
          check_nearest(got, "q", x);
          for (int64_t gr = 0; gr < q.grid_rows(); ++gr) {
            for (int64_t gc = 0; gc < q.grid_cols(); ++gc) {
              double amax_b = 0;
              for (int64_t r = gr * br; r < (gr + 1) * br; ++r) {
                for (int64_t c = gc * 16; c < std::min(cols, gc * 16 + 16); ++c)
                  amax_b = std::max(amax_b, std::abs(double(x[r * cols + c])));
              }
              // The E4M3 scale is the nearest to amax_b / 6 in units of the tensor scale.
              const double s = amax_b / 6 / (t / 2688.0), scale = q.block_scale(gr, gc);
              ASSERT_LE(std::abs(scale - s), 0.5 * gap_at(ElemFormat::e4m3, s) + 1e-5 * s) << gr << "," << gc;
            }
          }
          // Half the widest E2M1 gap (4 to 6) over the block's top value 6, plus the scale's rounding.
          EXPECT_LE(worst_block_error(q, x), (1.0 / 6) * (1 + 0x1p-4)) << br;
        });
  }

  // A tensor of zeros: codes 0, values 0.
  reg.add(
      {"Quantize", "Nvfp4TwoLevelScales", {"quantize_nvfp4"}, "zeros"},
      [](Run& r) {
        QuantizedTensor z;
        r.ops.quantize_nvfp4(z, r.zeros(64), 2, 32, 1, kNearest, nullptr);
        out_q(r, "z", z);
      },
      [](const Result& got) {
        const QuantizedTensor z = q_of(got, "z");
        for (int64_t i = 0; i < 64; ++i) EXPECT_EQ(z.value(i / 32, i % 32), 0.0f);
        for (float v : got["z values"]) EXPECT_EQ(v, 0.0f);
      });

  // quantize.h: given the whole tensor's amax, a piece (cut on block boundaries: a tensor-parallel
  // shard, a canonical piece under determinism = "layout") gets the whole tensor's tensor scale,
  // and so the codes and block scales the whole tensor's quantisation gives it, bit for bit.
  for (int64_t br : {1, 16}) {
    const int64_t rows = 48, cols = 96;
    using Piece = std::tuple<int64_t, int64_t, int64_t>;
    const std::vector<Piece> pieces = {{0, 0, 32}, {16, 32, 64}, {32, 80, 16}};
    reg.add(
        {"Quantize",
         "Nvfp4PieceWithTheTensorsAmaxIsTheWholesSlice",
         {"quantize_nvfp4", "amax"},
         str("block rows ", br)},
        [] { return test_matrix(rows, cols, 11); },
        [=](Run& r, const std::vector<float>& x) {
          const Buf<float> xd = r.in(x);
          const float t = r.ops.amax(xd, rows * cols);
          r.out("amax", t);
          QuantizedTensor whole, given;
          r.ops.quantize_nvfp4(whole, xd, rows, cols, br, kNearest, nullptr);
          r.ops.quantize_nvfp4(given, xd, rows, cols, br, kNearest,
                               &t);  // the amax passed for the whole: the same bits
          out_q(r, "whole", whole, false);
          out_q(r, "given", given, false);
          // Pieces [r0, r0 + 16) x [c0, c0 + pc): their own amax is smaller than t (the outliers fall elsewhere).
          for (const auto& [r0, c0, pc] : pieces) {
            const int64_t pr = 16;
            std::vector<float> piece(static_cast<size_t>(pr * pc));
            for (int64_t i = 0; i < pr; ++i)
              for (int64_t c = 0; c < pc; ++c) piece[i * pc + c] = x[(r0 + i) * cols + c0 + c];
            const Buf<float> pd = r.in(piece);
            QuantizedTensor q, own;
            r.ops.quantize_nvfp4(q, pd, pr, pc, br, kNearest, &t);
            r.ops.quantize_nvfp4(own, pd, pr, pc, br, kNearest, nullptr);
            out_q(r, str("piece ", r0, ",", c0), q, false);
            out_q(r, str("own ", r0, ",", c0), own, false);
            r.out(str("piece amax ", r0, ",", c0), r.ops.amax(pd, pr * pc));
          }
        },
        [=](const Result& got, const std::vector<float>&) {
          const QuantizedTensor whole = q_of(got, "whole"), given = q_of(got, "given");
          const float t = got["amax"].at(0);
          EXPECT_EQ(given.codes, whole.codes);
          EXPECT_EQ(given.scale_codes, whole.scale_codes);
          EXPECT_EQ(std::bit_cast<uint32_t>(given.tensor_scale), std::bit_cast<uint32_t>(whole.tensor_scale));
          for (const auto& [r0, c0, pc] : pieces) {
            const int64_t pr = 16;
            const QuantizedTensor q = q_of(got, str("piece ", r0, ",", c0)), own = q_of(got, str("own ", r0, ",", c0));
            EXPECT_EQ(std::bit_cast<uint32_t>(q.tensor_scale), std::bit_cast<uint32_t>(whole.tensor_scale)) << br;
            for (int64_t i = 0; i < pr; ++i)
              for (int64_t c = 0; c < pc; ++c)
                ASSERT_EQ(q.code(i, c), whole.code(r0 + i, c0 + c)) << br << " " << r0 + i << "," << c0 + c;
            for (int64_t gr = 0; gr < q.grid_rows(); ++gr)
              for (int64_t gc = 0; gc < q.grid_cols(); ++gc)
                ASSERT_EQ(std::bit_cast<uint32_t>(q.block_scale(gr, gc)),
                          std::bit_cast<uint32_t>(whole.block_scale(r0 / br + gr, c0 / 16 + gc)))
                    << br << " block " << gr << "," << gc;
            // Without it the piece's own amax sets the scales: other bits (the test can fail).
            if (got[str("piece amax ", r0, ",", c0)].at(0) != t) {
              EXPECT_NE(own.tensor_scale, whole.tensor_scale);
            }
          }
        });
  }

  reg.add(
      {"Quantize",
       "NaNPoisonsItsBlock",
       {"quantize_blockwise", "quantize_mxfp8", "quantize_nvfp4", "dequantize"},
       "a NaN at row 0, column 40"},
      [] {
        std::vector<float> x = test_matrix(2, 64, 5);
        x[40] = std::nanf("");  // row 0, column 40
        return x;
      },
      [](Run& r, const std::vector<float>& x0) {
        const Buf<float> x = r.in(x0);
        QuantizedTensor q;
        r.ops.quantize_blockwise(q, x, 2, 64, ElemFormat::e4m3, 1, 32, kNearest);
        out_q(r, "blockwise 1x32", q);
        r.ops.quantize_mxfp8(q, x, 2, 64, ElemFormat::e4m3, ScaleRounding::up, 32, kNearest);
        out_q(r, "mxfp8", q);
        r.ops.quantize_blockwise(q, x, 2, 64, ElemFormat::e4m3, 128, 1, kNearest);  // a block per column
        out_q(r, "blockwise 128x1", q);
        // A NaN block's codes are its multiplier's (NaN) code, in the vector lanes and the scalar
        // tail alike, whatever NaNs (negative: x86's default NaN) the block holds.
        std::vector<float> y(45, 1.0f);  // 40 columns in lanes, 5 in the tail
        for (int64_t c : {1, 4, 7, 10, 33, 38, 41, 43}) y[static_cast<size_t>(c)] = std::bit_cast<float>(0xffc00000u);
        r.ops.quantize_blockwise(q, r.in(y), 1, 45, ElemFormat::e4m3, 1, 128, kNearest);
        out_q(r, "NaN block", q);
        r.ops.quantize_nvfp4(q, x, 2, 64, 1, kNearest, nullptr);
        out_q(r, "nvfp4", q);
      },
      [](const Result& got, const std::vector<float>&) {
        const QuantizedTensor mx = q_of(got, "mxfp8");
        for (int64_t c = 0; c < 64; ++c) {
          EXPECT_EQ(std::isnan(mx.value(0, c)), c >= 32) << c;
          EXPECT_FALSE(std::isnan(mx.value(1, c)));
        }
        const QuantizedTensor b = q_of(got, "blockwise 1x32");
        EXPECT_TRUE(std::isnan(b.value(0, 33)) && !std::isnan(b.value(0, 3)));
        const QuantizedTensor col = q_of(got, "blockwise 128x1");
        for (int64_t c = 0; c < 64; ++c) EXPECT_EQ(std::isnan(col.value(1, c)), c == 40) << c;
        const QuantizedTensor q = q_of(got, "NaN block");
        for (int64_t c = 0; c < 45; ++c)
          EXPECT_EQ(q.codes[static_cast<size_t>(c)], encode(ElemFormat::e4m3, std::numeric_limits<float>::quiet_NaN()))
              << c;
        // And a NaN block scale decodes to itself (value() and dequantize()), whatever the code.
        const std::vector<float> values = got["NaN block values"];
        for (int64_t c = 0; c < 45; ++c) {
          EXPECT_EQ(std::bit_cast<uint32_t>(values[static_cast<size_t>(c)]),
                    std::bit_cast<uint32_t>(q.block_scale(0, 0)))
              << c;
          EXPECT_EQ(std::bit_cast<uint32_t>(q.value(0, c)), std::bit_cast<uint32_t>(q.block_scale(0, 0))) << c;
        }
        EXPECT_TRUE(std::isnan(q_of(got, "nvfp4").value(1, 0)));  // the tensor scale
      });

  // Mean of the dequantised values over `draws` SR keys (steps) must be x within 6 sigma per
  // element; nearest rounding of the same x is visibly biased.
  for (int recipe = 0; recipe < 2; ++recipe) {
    const int64_t rows = 4, cols = 64, n = rows * cols;
    const int draws = 400;
    reg.add(
        {"Quantize",
         "StochasticRoundingIsUnbiased",
         {"quantize_nvfp4", "quantize_blockwise", "dequantize"},
         recipe == 0 ? "nvfp4" : "blockwise 1x32 e4m3"},
        [=] {
          // 1.3 falls 0.6 of a gap above 1 in NVFP4's units and 0.4 of a gap above 80 in FP8's (1.3 * 64):
          // nearest rounding is biased by 0.4 gap. Every 16th element, 6, pins each block's scale.
          std::vector<float> x(n);
          for (int64_t i = 0; i < n; ++i) x[i] = i % 16 == 0 ? 6.0f : 1.3f;
          return x;
        },
        [=](Run& r, const std::vector<float>& x) {
          const Buf<float> xd = r.in(x);
          Buf<float> values = r.zeros(n);
          std::vector<double> mean(n, 0.0);
          QuantizedTensor q;
          for (int s = 0; s < draws; ++s) {
            const StochasticRounding sr{true, 123, static_cast<uint64_t>(s), 7};
            if (recipe == 0)
              r.ops.quantize_nvfp4(q, xd, rows, cols, 1, sr, nullptr);
            else
              r.ops.quantize_blockwise(q, xd, rows, cols, ElemFormat::e4m3, 1, 32, sr);
            r.ops.dequantize(values, cols, q);
            const std::vector<float> v = r.get(values);
            for (int64_t i = 0; i < n; ++i) mean[i] += v[i] / double(draws);
          }
          r.out("mean", mean);
          out_q(r, "last draw", q, false);
          // The same x rounded to nearest.
          if (recipe == 0)
            r.ops.quantize_nvfp4(q, xd, rows, cols, 1, kNearest, nullptr);
          else
            r.ops.quantize_blockwise(q, xd, rows, cols, ElemFormat::e4m3, 1, 32, kNearest);
          out_q(r, "nearest", q);
        },
        [=](const Result& got, const std::vector<float>& x) {
          const std::vector<double> mean = got.get<double>("mean");
          const QuantizedTensor q = q_of(got, "last draw");
          std::vector<double> gap(n, 0.0);
          for (int64_t i = 0; i < n; ++i) {
            const double m =
                static_cast<double>(q.block_scale(i / cols / q.block_rows, i % cols / q.block_cols)) * q.tensor_scale;
            gap[i] = gap_at(q.elem, x[i] / m) * m;
            ASSERT_NEAR(mean[i], x[i], 6 * 0.5 * gap[i] / std::sqrt(draws) + 1e-6) << "element " << i;
          }
          // The same x rounded to nearest: the average error is a sizeable fraction of a gap.
          const std::vector<float> nearest = got["nearest values"];
          double bias_nearest = 0, bias_sr = 0;
          for (int64_t i = 0; i < n; ++i) {
            bias_nearest += (nearest[i] - x[i]) / gap[i];
            bias_sr += (mean[i] - x[i]) / gap[i];
          }
          EXPECT_GT(std::abs(bias_nearest) / n, 0.05);
          EXPECT_LT(std::abs(bias_sr) / n, 0.01);
        });
  }

  {
    const int64_t rows = 24, cols = 96;
    reg.add(
        {"Quantize", "StochasticRoundingIsKeyedByGlobalIndex", {"quantize_mxfp8"}, "e5m2, 1x32"},
        [] { return test_matrix(rows, cols, 6); },
        [=](Run& r, const std::vector<float>& x) {
          const Buf<float> xd = r.in(x);
          const auto q = [&](const float* p, int64_t rs, int64_t cs, const StochasticRounding& sr) {
            QuantizedTensor t;
            r.ops.quantize_mxfp8(t, p, rs, cs, ElemFormat::e5m2, ScaleRounding::up, 32, sr);
            return t;
          };
          const StochasticRounding sr{true, 9, 3, 77};
          out_q(r, "full", q(xd, rows, cols, sr), false);
          out_q(r, "again", q(xd, rows, cols, sr), false);
          // Another step, another tensor: other draws.
          out_q(r, "step 4", q(xd, rows, cols, {true, 9, 4, 77}), false);
          out_q(r, "tensor 78", q(xd, rows, cols, {true, 9, 3, 78}), false);
          // A shard of rows [8, 24) and a shard of columns [32, 96) draw what the full tensor drew.
          out_q(r, "rows 8..24", q(xd.p() + 8 * cols, 16, cols, {true, 9, 3, 77, 8 * cols}), false);
          std::vector<float> right(rows * 64);
          for (int64_t i = 0; i < rows; ++i) std::copy_n(x.data() + i * cols + 32, 64, right.data() + i * 64);
          out_q(r, "columns 32..96", q(r.in(right), rows, 64, {true, 9, 3, 77, 32, cols}), false);
        },
        [=](const Result& got, const std::vector<float>&) {
          const QuantizedTensor full = q_of(got, "full");
          EXPECT_EQ(full.codes, q_of(got, "again").codes);
          EXPECT_NE(full.codes, q_of(got, "step 4").codes);
          EXPECT_NE(full.codes, q_of(got, "tensor 78").codes);
          const QuantizedTensor a = q_of(got, "rows 8..24"), b = q_of(got, "columns 32..96");
          EXPECT_TRUE(std::equal(a.codes.begin(), a.codes.end(), full.codes.begin() + 8 * cols));
          for (int64_t i = 0; i < rows; ++i) {
            for (int64_t c = 0; c < 64; ++c) ASSERT_EQ(b.code(i, c), full.code(i, c + 32)) << i << "," << c;
          }
        });
  }

  // Every recipe, rounding and amax on every setting (1 to 3 threads): the same codes, scales and
  // tensor scale (the harness compares every output's bits); the nearest ones within the formats.
  {
    const int64_t rows = 64, cols = 160;
    reg.add(
        {"Quantize",
         "BitwiseIndependentOfThreads",
         {"quantize_tensorwise", "quantize_blockwise", "quantize_mxfp8", "quantize_nvfp4", "amax", "dequantize"},
         str(rows, "x", cols)},
        [] { return test_matrix(rows, cols, 7); },
        [=](Run& r, const std::vector<float>& x0) {
          const Buf<float> x = r.in(x0);
          const StochasticRounding sr{true, 5, 2, 1};
          std::vector<QuantizedTensor> out(7);
          r.ops.quantize_tensorwise(out[0], x, rows, cols, ElemFormat::e4m3, 10.0f, sr);
          r.ops.quantize_blockwise(out[1], x, rows, cols, ElemFormat::e4m3, 1, 128, sr);
          r.ops.quantize_blockwise(out[2], x, rows, cols, ElemFormat::e5m2, 32, 32, kNearest);
          r.ops.quantize_mxfp8(out[3], x, rows, cols, ElemFormat::e4m3, ScaleRounding::down, 32, sr);
          r.ops.quantize_nvfp4(out[4], x, rows, cols, 1, sr, nullptr);
          r.ops.quantize_nvfp4(out[5], x, rows, cols, 16, kNearest, nullptr);
          r.ops.quantize_blockwise(out[6], x, rows, cols, ElemFormat::e4m3, 16, 1, sr);  // a scale per column
          out[6].tensor_scale = r.ops.amax(x, rows * cols);  // amax's parts, over the threads
          for (size_t i = 0; i < out.size(); ++i) out_q(r, str("q", i), out[i]);
        },
        [](const Result& got, const std::vector<float>& x) {
          check_nearest(got, "q2", x);
          check_nearest(got, "q5", x);
        });
  }

  {
    reg.add(
        {"Quantize",
         "StorageIsWhatTheFormatsCost",
         {"quantize_mxfp8", "quantize_nvfp4", "quantize_blockwise"},
         "32x256"},
        [] { return test_matrix(32, 256, 8); },
        [](Run& r, const std::vector<float>& x0) {
          const Buf<float> x = r.in(x0);
          QuantizedTensor q;
          r.ops.quantize_mxfp8(q, x, 32, 256, ElemFormat::e4m3, ScaleRounding::up, 32, kNearest);
          out_q(r, "mxfp8", q, false);
          r.ops.quantize_nvfp4(q, x, 32, 256, 1, kNearest, nullptr);
          out_q(r, "nvfp4", q, false);
          r.ops.quantize_blockwise(q, x, 32, 256, ElemFormat::e4m3, 1, 128, kNearest);
          out_q(r, "blockwise", q, false);
        },
        [](const Result& got, const std::vector<float>&) {
          EXPECT_EQ(q_of(got, "mxfp8").storage_bytes(), 32 * 256 + 32 * 8);       // 8.25 bits per element
          EXPECT_EQ(q_of(got, "nvfp4").storage_bytes(), 32 * 128 + 32 * 16 + 4);  // 4.5 bits per element + tensor scale
          EXPECT_EQ(q_of(got, "blockwise").storage_bytes(), 32 * 256 + 32 * 2 * 4);
        });
  }

  // Q is the transform of the identity (rows axis: column k of the output is Q e_k).
  reg.add(
      {"Hadamard", "IsOrthogonalWithEntriesOfAQuarter", {"hadamard16"}, "16x16"},
      [](Run& r) {
        std::vector<float> I(256, 0.0f);
        for (int i = 0; i < 16; ++i) I[i * 16 + i] = 1.0f;
        Buf<float> Q = r.zeros(256);
        r.ops.hadamard16(Q, r.in(I), 16, 16, HadamardAxis::rows);
        r.out("Q", Q);
      },
      [](const Result& got) {
        const std::vector<float> Q = got["Q"];
        int negatives = 0;
        for (int i = 0; i < 16; ++i) {
          for (int j = 0; j < 16; ++j) {
            ASSERT_EQ(std::abs(Q[i * 16 + j]), 0.25f);
            double dot = 0;
            for (int k = 0; k < 16; ++k) dot += double(Q[i * 16 + k]) * Q[j * 16 + k];
            ASSERT_EQ(dot, i == j ? 1.0 : 0.0) << i << "," << j;
          }
        }
        for (float s : hadamard16_signs()) negatives += s < 0;
        EXPECT_GT(negatives, 0);  // a random sign vector, not all +1
        EXPECT_LT(negatives, 16);
        // Q = H16 diag(s) / 4 by the definition.
        for (int i = 0; i < 16; ++i) {
          for (int k = 0; k < 16; ++k) {
            const float h = (__builtin_popcount(i & k) & 1) ? -1.0f : 1.0f;
            ASSERT_EQ(Q[i * 16 + k], h * hadamard16_signs()[k] * 0.25f);
          }
        }
      });

  // Against the matrix product in double; the cols axis on the transpose gives the same bits; in
  // place the same bits (and on every setting); a length not a multiple of 16 is refused.
  {
    const int64_t rows = 48, cols = 20;
    reg.add(
        {"Hadamard", "MatchesTheMatrixProductAndBothAxesAgree", {"hadamard16"}, str(rows, "x", cols)},
        [] { return testing::randn(rows * cols, 9, "hadamard"); },
        [=](Run& r, const std::vector<float>& x) {
          std::vector<float> xt(cols * rows);
          for (int64_t i = 0; i < rows; ++i)
            for (int64_t c = 0; c < cols; ++c) xt[c * rows + i] = x[i * cols + c];
          const Buf<float> xd = r.in(x);
          Buf<float> y = r.zeros(rows * cols), yt = r.zeros(cols * rows), z = r.in(x);
          r.ops.hadamard16(y, xd, rows, cols, HadamardAxis::rows);
          r.ops.hadamard16(yt, r.in(xt), cols, rows, HadamardAxis::cols);
          r.ops.hadamard16(z, z, rows, cols, HadamardAxis::rows);
          r.out("rows", y);
          r.out("cols of the transpose", yt);
          r.out("in place", z);
          bool threw = false;
          try {
            r.ops.hadamard16(z, xd, 40, cols, HadamardAxis::rows);
          } catch (const InternalError&) {
            threw = true;
          }
          r.out("40 rows threw InternalError", std::vector<uint8_t>{threw});
        },
        [=](const Result& got, const std::vector<float>& x) {
          const std::vector<float> y = got["rows"], yt = got["cols of the transpose"];
          std::vector<double> ref(rows * cols, 0.0);
          for (int64_t g = 0; g < rows / 16; ++g)
            for (int i = 0; i < 16; ++i)
              for (int k = 0; k < 16; ++k)
                for (int64_t j = 0; j < cols; ++j)
                  ref[(g * 16 + i) * cols + j] += hadamard_entry(i, k) * x[(g * 16 + k) * cols + j];
          EXPECT_TRUE(testing::all_close(y, ref, 1e-6, 1e-6, "hadamard rows"));
          for (int64_t i = 0; i < rows; ++i)
            for (int64_t c = 0; c < cols; ++c) ASSERT_EQ(yt[c * rows + i], y[i * cols + c]);
          EXPECT_TRUE(bitwise_equal(got["in place"], y));
          EXPECT_EQ(got.get<uint8_t>("40 rows threw InternalError"), std::vector<uint8_t>{1});
        });
  }

  // dW = dY^T X over T tokens; with Q applied to both along tokens: (Q dY)^T (Q X) = dY^T X.
  {
    const int64_t T = 64, N = 24, K = 40;
    struct In {
      std::vector<float> dy, x;
    };
    reg.add(
        {"Hadamard", "CancelsInTheWeightGradient", {"hadamard16"}, str("T=", T, " N=", N, " K=", K)},
        [] {
          return In{testing::randn(T * N, 10, "dy"), testing::randn(T * K, 10, "x")};
        },
        [=](Run& r, const In& in) {
          Buf<float> qdy = r.zeros(T * N), qx = r.zeros(T * K);
          r.ops.hadamard16(qdy, r.in(in.dy), T, N, HadamardAxis::rows);
          r.ops.hadamard16(qx, r.in(in.x), T, K, HadamardAxis::rows);
          r.out("Q dy", qdy);
          r.out("Q x", qx);
        },
        [=](const Result& got, const In& in) {
          const std::vector<float> qdy = got["Q dy"], qx = got["Q x"];
          std::vector<float> dw(N * K, 0.0f);
          std::vector<double> ref(N * K, 0.0);
          for (int64_t n = 0; n < N; ++n) {
            for (int64_t k = 0; k < K; ++k) {
              double a = 0, b = 0;
              for (int64_t t = 0; t < T; ++t) {
                a += double(qdy[t * N + n]) * qx[t * K + k];
                b += double(in.dy[t * N + n]) * in.x[t * K + k];
              }
              dw[n * K + k] = static_cast<float>(a);
              ref[n * K + k] = b;
            }
          }
          EXPECT_TRUE(testing::all_close(dw, ref, 1e-5, 1e-5, "transformed dW"));
        });
  }
}

}  // namespace lockstep::harness
