// The GEMM ops (kernels/gemm.h) on every backend: each output element one FMA chain over K (bit
// for bit the chain written out), k_segments and k_sections (the canonical tree), batches,
// operands in low precision (the fp32 GEMM on the dequantised matrices), and the grouped GEMMs of
// the MoE experts (against references, central differences and the split over ranks). The
// micro-kernel checks of the CPU GEMM are in test_gemm.cpp.
#include <bit>
#include <cmath>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "../op_harness.h"
#include "../testing.h"
#include "gemm_testing.h"
#include "lockstep/core/error.h"
#include "lockstep/core/tree_sum.h"

namespace lockstep::harness {
namespace {

using namespace lockstep::gemm_testing;
using testing::all_close;
using testing::bitwise_equal;

// C0 then gemm() on the backend; opt.bias, when set, is c.bias (replaced by the backend's copy).
std::vector<float> run_gemm(Run& r, const GemmCase& c, GemmOptions opt) {
  const Buf<float> A = r.in(c.A), B = r.in(c.B), bias = r.in(opt.bias ? c.bias : std::vector<float>{});
  if (opt.bias) opt.bias = bias;
  Buf<float> C = r.in(c.C0);
  r.ops.gemm(C, c.ldc, gemm_operand(A.p(), c.lda, c.ta), gemm_operand(B.p(), c.ldb, c.tb), c.M, c.N, c.K, opt);
  return r.get(C);
}

GemmOptions accumulate() {
  GemmOptions o;
  o.accumulate = true;
  return o;
}

// One gemm_batch of the cases (options: init and k_segments, bias = the case's): each item's
// output, "item i".
void run_batch(Run& r, const std::vector<GemmCase>& cases, const std::vector<GemmOptions>& opts) {
  std::vector<Buf<float>> bufs;
  std::vector<GemmBatchItem> items;
  std::vector<Buf<float>> C;
  for (size_t i = 0; i < cases.size(); ++i) {
    const GemmCase& c = cases[i];
    bufs.push_back(r.in(c.A));
    const float* A = bufs.back();
    bufs.push_back(r.in(c.B));
    const float* B = bufs.back();
    bufs.push_back(r.in(c.bias));
    const float* bias = bufs.back();
    C.push_back(r.in(c.C0));
    GemmBatchItem it{C.back(), c.ldc, A, c.lda, c.ta, B, c.ldb, c.tb, c.M, c.N, c.K};
    it.accumulate = opts[i].accumulate;
    it.bias = opts[i].bias ? bias : nullptr;
    it.k_segments = opts[i].k_segments;
    it.k_sections = opts[i].k_sections;
    items.push_back(it);
  }
  r.ops.gemm_batch(items.data(), static_cast<int64_t>(items.size()));
  for (size_t i = 0; i < cases.size(); ++i) r.out(str("item ", i), C[i]);
}
void check_batch(const Result& got, const std::vector<GemmCase>& cases, const std::vector<GemmOptions>& opts) {
  for (size_t i = 0; i < cases.size(); ++i)
    ASSERT_TRUE(bitwise_equal(got[str("item ", i)], cases[i].reference(opts[i]), cases[i].name() + str(" item ", i)));
}

// A stored operand in the backend's memory (a QuantizedTensor is passed as it is).
struct DevOperand {
  Buf<float> f;
  Buf<bf16> h;
  GemmOperand op;
};
DevOperand upload(Run& r, const StoredOperand& s, Trans t) {
  DevOperand d;
  if (s.storage == Storage::f32) {
    d.f = r.in(s.dense);
    d.op = gemm_operand(d.f.p(), s.cols, t);
  } else if (s.storage == Storage::bf16) {
    d.h = r.in(s.half);
    d.op = gemm_operand(d.h.p(), s.cols, t);
  } else {
    d.op = gemm_operand(s.q, t);
  }
  return d;
}
DevOperand upload_dense(Run& r, const StoredOperand& s, Trans t) {
  DevOperand d;
  d.f = r.in(s.dense);
  d.op = gemm_operand(d.f.p(), s.cols, t);
  return d;
}

// The tolerance of a low-precision operand path against the CPU's bits (a fast path: tensor cores).
Match low_precision(bool fp32) { return fp32 ? bitwise() : close(1e-4, 1e-4); }

}  // namespace

void add_gemm_cases(Registry& reg) {
  const auto gemm_case = [&](const std::string& test, int64_t M, int64_t N, int64_t K, Trans ta, Trans tb,
                             uint64_t seed, std::function<void(Run&, const GemmCase&)> run,
                             std::function<void(const Result&, const GemmCase&)> check, int64_t pad = 3) {
    reg.add(
        {"Gemm", test, {"gemm"}, str(M, "x", N, "x", K, ta == Trans::N ? " N" : " T", tb == Trans::N ? "N" : "T")},
        [=] { return GemmCase(M, N, K, ta, tb, seed, pad); }, run, check);
  };

  for (Trans ta : kTrans)
    for (Trans tb : kTrans)
      for (int64_t M : {1, 5, 17, 67, 130})
        for (int64_t N : {1, 5, 17, 67, 130})
          for (int64_t K : {1, 5, 17, 67, 130})
            gemm_case(
                "MatchesFmaChainAndDoubleReference", M, N, K, ta, tb, 1,
                [](Run& r, const GemmCase& c) { r.out("C", run_gemm(r, c, {})); },
                [](const Result& got, const GemmCase& c) {
                  const std::vector<float> C = got["C"];
                  ASSERT_TRUE(bitwise_equal(C, c.reference({}), c.name()));
                  ASSERT_TRUE(all_close(C, c.reference_double({}), 1e-5, 2e-6 * c.K, c.name()));
                });

  // Shapes that cross every cache block (K blocks, several M blocks, several N blocks) and edges.
  for (const auto& s : {std::vector<int64_t>{300, 37, 700}, {7, 4500, 3}, {45, 70, 1100}})
    for (Trans ta : kTrans)
      for (Trans tb : kTrans)
        gemm_case(
            "CrossesCacheBlocks", s[0], s[1], s[2], ta, tb, 2,
            [](Run& r, const GemmCase& c) { r.out("C", run_gemm(r, c, accumulate())); },
            [](const Result& got, const GemmCase& c) {
              ASSERT_TRUE(bitwise_equal(got["C"], c.reference(accumulate()), c.name()));
            });

  for (Trans ta : kTrans)
    for (Trans tb : kTrans)
      gemm_case(
          "AccumulateAndBias", 67, 130, 17, ta, tb, 3,
          [](Run& r, const GemmCase& c) {
            GemmOptions bias, both = accumulate();
            bias.bias = c.bias.data();
            both.bias = c.bias.data();
            r.out("accumulate", run_gemm(r, c, accumulate()));
            r.out("bias", run_gemm(r, c, bias));
            r.out("both", run_gemm(r, c, both));
          },
          [](const Result& got, const GemmCase& c) {
            ASSERT_TRUE(bitwise_equal(got["accumulate"], c.reference(accumulate()), c.name() + " accumulate"));
            ASSERT_TRUE(all_close(got["accumulate"], c.reference_double(accumulate()), 1e-5, 1e-4));
            GemmOptions bias;
            bias.bias = c.bias.data();
            ASSERT_TRUE(bitwise_equal(got["bias"], c.reference(bias), c.name() + " bias"));
            // accumulate wins over bias: init is C.
            ASSERT_TRUE(bitwise_equal(got["both"], c.reference(accumulate()), c.name() + " both"));
          });

  gemm_case(
      "EmptyKWritesInit", 5, 17, 0, Trans::N, Trans::T, 4,
      [](Run& r, const GemmCase& c) {
        for (const bool acc : {false, true})
          for (const bool bias : {false, true}) {
            GemmOptions opt;
            opt.accumulate = acc;
            opt.bias = bias ? c.bias.data() : nullptr;
            r.out(str("accumulate ", acc, " bias ", bias), run_gemm(r, c, opt));
          }
      },
      [](const Result& got, const GemmCase& c) {
        for (const bool acc : {false, true})
          for (const bool bias : {false, true}) {
            GemmOptions opt;
            opt.accumulate = acc;
            opt.bias = bias ? c.bias.data() : nullptr;
            ASSERT_TRUE(bitwise_equal(got[str("accumulate ", acc, " bias ", bias)], c.reference(opt)));
          }
      });

  // Without an init the segmented product is the tree itself: a -0 (an underflowing negative
  // product) stays -0, as the sum over ranks of -0 parts keeps it; edge tiles (4 x 3) and whole
  // ones (12 x 128). (Every CPU micro-kernel: test_gemm.cpp.)
  for (const auto& [M, N] : {std::pair<int64_t, int64_t>{4, 3}, {12, 128}}) {
    reg.add(
        {"Gemm", "KSegmentsKeepNegativeZero", {"gemm"}, str(M, "x", N, "x8")},
        [=](Run& r) {
          const std::vector<int64_t> segments = {0, 2, 4, 6, 8};
          GemmOptions opt;
          opt.k_segments = segments;
          const Buf<float> A = r.full(M * 8, 1e-30f), B = r.full(8 * N, -1e-30f);
          Buf<float> C = r.full(M * N, 1.0f);
          r.ops.gemm(C, N, gemm_operand(A.p(), 8, Trans::N), gemm_operand(B.p(), N, Trans::N), M, N, 8, opt);
          r.out("C", C);
        },
        [](const Result& got) {
          for (float v : got["C"]) ASSERT_EQ(std::bit_cast<uint32_t>(v), std::bit_cast<uint32_t>(-0.0f));
        });
  }

  // k_segments (and k_sections): the canonical tree over the segments' chains plus the init, as
  // the reference writes it out. The product runs in one pass (every segment's chain and the tree
  // per tile) up to 128 segments and K up to 4 kernel K blocks, segment by segment past that: both
  // give the reference's bits on every setting (1 to 3 threads), with several rectangles per
  // thread, sections, empty segments, 12 (not a power of two) segments and K = 0. (Every CPU
  // micro-kernel: test_gemm.cpp.)
  {
    uint64_t seed = 40;
    for (const KSegmentLayout& l : k_segment_layouts())
      for (Trans ta : kTrans)
        for (Trans tb : kTrans) {
          const auto options = [](const GemmCase& c, int mode) {
            GemmOptions opt;
            opt.accumulate = mode == 1;
            opt.bias = mode == 2 ? c.bias.data() : nullptr;
            return opt;
          };
          const auto with_segments = [](GemmOptions opt, const std::vector<int64_t>& seg,
                                        const std::vector<int64_t>& sec) {
            opt.k_segments = seg;
            opt.k_sections = sec;
            return opt;
          };
          gemm_case(
              "KSegments", l.M, l.N, l.K, ta, tb, seed++,
              [=](Run& r, const GemmCase& c) {
                for (int mode = 0; mode < 3; ++mode)
                  r.out(str("mode ", mode), run_gemm(r, c, with_segments(options(c, mode), l.segments, l.sections)));
              },
              [=](const Result& got, const GemmCase& c) {
                for (int mode = 0; mode < 3; ++mode)
                  ASSERT_TRUE(bitwise_equal(got[str("mode ", mode)],
                                            c.reference(with_segments(options(c, mode), l.segments, l.sections)),
                                            c.name() + str(" mode ", mode, " segments ", l.segments.size())));
              });
        }
  }

  // Segmented items of a batch (the grouped GEMMs of determinism = "layout") give their own gemm()
  // reference's bits, next to plain items, in one pass or past its limits, on every setting.
  {
    struct Batch {
      std::vector<GemmCase> cases;
      std::vector<GemmOptions> opts;
      std::vector<std::vector<int64_t>> segments;
    };
    reg.add(
        {"Gemm", "BatchOfSegmentedItems", {"gemm_batch"}, "32 items, k_segments"},
        [] {
          auto b = std::make_unique<Batch>();
          b->segments = {{0, 4, 9, 9, 15, 20, 26, 30, 37}, {0, 1, 2, 3}, {0, 37}, {0, 1000, 4000}, {0, 0, 0, 0, 0}};
          const std::vector<int64_t>*seg8 = &b->segments[0], *seg3 = &b->segments[1], *one = &b->segments[2],
                *seg_long = &b->segments[3], *seg_empty = &b->segments[4];
          struct Item {
            int64_t M, N, K;
            const std::vector<int64_t>* segments;
          };
          const std::vector<Item> shapes = {{211, 150, 37, seg8},  {64, 64, 37, seg8}, {3, 5, 3, seg3},
                                            {17, 19, 37, nullptr}, {6, 9, 37, one},    {7, 20, 4000, seg_long},
                                            {6, 9, 0, seg_empty},  {0, 9, 37, seg8}};
          b->cases.reserve(4 * shapes.size());  // opts point into the cases
          uint64_t seed = 60;
          for (Trans ta : kTrans)
            for (Trans tb : kTrans)
              for (const Item& s : shapes) {
                b->cases.emplace_back(s.M, s.N, s.K, ta, tb, seed++);
                GemmOptions o;
                o.accumulate = seed % 3 == 0;
                if (seed % 3 == 1) o.bias = b->cases.back().bias.data();
                if (s.segments) o.k_segments = *s.segments;
                b->opts.push_back(o);
              }
          return std::shared_ptr<Batch>(std::move(b));
        },
        [](Run& r, const std::shared_ptr<Batch>& b) { run_batch(r, b->cases, b->opts); },
        [](const Result& got, const std::shared_ptr<Batch>& b) { check_batch(got, b->cases, b->opts); });
  }

  // Large enough to be split across threads, odd enough to give uneven splits: every setting gives
  // the chain's bits.
  for (Trans ta : kTrans)
    for (Trans tb : kTrans)
      gemm_case(
          "SameBitsForAnyThreadCount", 131, 173, 67, ta, tb, 7,
          [](Run& r, const GemmCase& c) { r.out("C", run_gemm(r, c, accumulate())); },
          [](const Result& got, const GemmCase& c) {
            ASSERT_TRUE(bitwise_equal(got["C"], c.reference(accumulate()), c.name()));
          });

  // Accumulating over [0, K1) then [K1, K) equals one call over [0, K): gradients summed over
  // micro-batches equal the gradient of the concatenated batch.
  for (Trans ta : kTrans)
    for (Trans tb : kTrans)
      gemm_case(
          "AccumulateSplitAlongK", 17, 130, 67, ta, tb, 8,
          [](Run& r, const GemmCase& c) {
            r.out("whole", run_gemm(r, c, accumulate()));
            const int64_t K1 = 29;
            const Buf<float> A = r.in(c.A), B = r.in(c.B);
            Buf<float> C = r.in(c.C0);
            r.ops.gemm(C, c.ldc, gemm_operand(A.p(), c.lda, c.ta), gemm_operand(B.p(), c.ldb, c.tb), c.M, c.N, K1,
                       accumulate());
            r.ops.gemm(C, c.ldc, gemm_operand(A.p() + (c.ta == Trans::N ? K1 : K1 * c.lda), c.lda, c.ta),
                       gemm_operand(B.p() + (c.tb == Trans::N ? K1 * c.ldb : K1), c.ldb, c.tb), c.M, c.N, c.K - K1,
                       accumulate());
            r.out("split", C);
          },
          [](const Result& got, const GemmCase& c) {
            ASSERT_TRUE(bitwise_equal(got["split"], got["whole"], c.name()));
            ASSERT_TRUE(bitwise_equal(got["whole"], c.reference(accumulate()), c.name()));
          });

  // A batch gives each item the bits of its own gemm() call (the FMA-chain reference), on every
  // setting, with items of every transpose and init, empty items, and items large enough to be cut
  // into several rectangles.
  {
    struct Batch {
      std::vector<GemmCase> cases;
      std::vector<GemmOptions> opts;
    };
    reg.add(
        {"Gemm", "BatchEqualsOneGemmPerItem", {"gemm_batch"}, "16 items"},
        [] {
          auto b = std::make_shared<Batch>();
          uint64_t seed = 20;
          for (Trans ta : kTrans)
            for (Trans tb : kTrans) {
              b->cases.emplace_back(211, 307, 67, ta, tb, seed++);  // ~4M FMAs: several rectangles
              b->cases.emplace_back(5, 17, 33, ta, tb, seed++);
              b->cases.emplace_back(0, 9, 4, ta, tb, seed++);  // no rows (an expert without tokens)
              b->cases.emplace_back(6, 9, 0, ta, tb, seed++);  // K = 0: C = init
            }
          for (size_t i = 0; i < b->cases.size(); ++i) {
            GemmOptions o;
            o.accumulate = i % 3 == 0;
            if (i % 3 == 1) o.bias = b->cases[i].bias.data();
            b->opts.push_back(o);
          }
          return b;
        },
        [](Run& r, const std::shared_ptr<Batch>& b) { run_batch(r, b->cases, b->opts); },
        [](const Result& got, const std::shared_ptr<Batch>& b) { check_batch(got, b->cases, b->opts); });
  }

  // The fp32 helpers of ops.h: contiguous operands (natural row lengths) and strided ones.
  gemm_case(
      "ContiguousOverload", 5, 17, 67, Trans::T, Trans::N, 9,
      [](Run& r, const GemmCase& c) {
        const Buf<float> A = r.in(c.A), B = r.in(c.B);
        Buf<float> C = r.zeros(c.M * c.N), Cs = r.in(c.C0);
        gemm_f32(r.ops, C, A, c.ta, B, c.tb, c.M, c.N, c.K, GemmOptions{});
        gemm_f32(r.ops, Cs, c.ldc, A, c.lda, c.ta, B, c.ldb, c.tb, c.M, c.N, c.K, accumulate());
        r.out("C", C);
        r.out("strided C", Cs);
      },
      [](const Result& got, const GemmCase& c) {
        ASSERT_TRUE(bitwise_equal(got["C"], c.reference({})));
        ASSERT_TRUE(bitwise_equal(got["strided C"], c.reference(accumulate())));
      },
      0);

  // ---- Operands in low precision: gemm() on stored operands equals gemm() on the fp32 matrices
  // they stand for, bit for bit (on the CPU; another backend's low-precision path is compared with
  // the CPU's bits within a tolerance).
  {
    const int64_t M = 37, N = 45, K = 600;  // edge tiles, and K crosses a cache block
    for (size_t ia = 0; ia < std::size(kStorages); ++ia)
      for (size_t ib = 0; ib < std::size(kStorages); ++ib) {
        // Every storage on each side against f32 and against itself, and a few mixed pairs.
        if (!(ia == 0 || ib == 0 || ia == ib || (ia + ib) % 3 == 0)) continue;
        for (Trans ta : kTrans)
          for (Trans tb : kTrans) {
            struct In {
              StoredOperand A, B;
              std::vector<float> C0, bias;
            };
            reg.add(
                {"GemmOperands",
                 "EqualTheFp32GemmOnTheDequantisedOperands",
                 {"gemm"},
                 str("A storage ", ia, " B storage ", ib, ta == Trans::N ? " N" : " T", tb == Trans::N ? "N" : "T")},
                [=] {
                  return std::make_shared<In>(
                      In{StoredOperand(kStorages[ia], ta == Trans::N ? M : K, ta == Trans::N ? K : M, 100 + ia),
                         StoredOperand(kStorages[ib], tb == Trans::N ? K : N, tb == Trans::N ? N : K, 200 + ib),
                         testing::randn(M * N, 3, "C0"), testing::randn(N, 3, "bias")});
                },
                [=](Run& r, const std::shared_ptr<In>& in) {
                  const std::vector<int64_t> segments = {0, 100, 333, 600};
                  const Buf<float> bias = r.in(in->bias);
                  GemmOptions plain, acc, with_bias, segmented;
                  acc.accumulate = true;
                  with_bias.bias = bias;
                  segmented.k_segments = segments;
                  const DevOperand A = upload(r, in->A, ta), B = upload(r, in->B, tb);
                  const DevOperand Ad = upload_dense(r, in->A, ta), Bd = upload_dense(r, in->B, tb);
                  int o = 0;
                  for (const GemmOptions* opt : {&plain, &acc, &with_bias, &segmented}) {
                    Buf<float> want = r.in(in->C0), got = r.in(in->C0);
                    r.ops.gemm(want, N, Ad.op, Bd.op, M, N, K, *opt);
                    r.ops.gemm(got, N, A.op, B.op, M, N, K, *opt);
                    r.out(str("fp32 ", o), want);
                    r.out(str("stored ", o++), got, low_precision(ia == 0 && ib == 0));
                  }
                },
                [=](const Result& got, const std::shared_ptr<In>&) {
                  for (int o = 0; o < 4; ++o)
                    ASSERT_TRUE(bitwise_equal(got[str("stored ", o)], got[str("fp32 ", o)], str("options ", o)));
                });
          }
      }
  }

  // op(A) = the transpose of one stored row holding every code (so the vector decoding runs), times
  // B = 1 on top of C = -0: each C[i] is then exactly A's decoded value, sign of zero and NaN bits
  // included: dequantize()'s value (and, unscaled, decode()'s).
  for (ElemFormat f : {ElemFormat::e4m3, ElemFormat::e5m2, ElemFormat::e2m1})
    for (float s : {1.0f, 0.75f}) {
      reg.add(
          {"GemmOperands",
           "EveryCodeDecodesAsDequantizeDoes",
           {"gemm", "dequantize"},
           str(elem_format_name(f), " scale ", s)},
          [=] {
            QuantizedTensor q;
            q.elem = f;
            q.rows = 1;
            q.cols = 256;
            q.block_cols = 256;
            q.scales = {s};
            q.tensor_scale = f == ElemFormat::e2m1 ? 0.3f : 1.0f;
            q.codes.resize(static_cast<size_t>(q.row_bytes()));
            for (size_t c = 0; c < q.codes.size(); ++c)
              q.codes[c] = static_cast<uint8_t>(f == ElemFormat::e2m1 ? (c % 16) | (((c + 5) % 16) << 4) : c);
            return q;
          },
          [](Run& r, const QuantizedTensor& q) {
            const Buf<float> one = r.full(1, 1.0f);
            Buf<float> C = r.full(256, -0.0f), want = r.zeros(256);
            GemmOptions acc;
            acc.accumulate = true;
            r.ops.gemm(C, 1, gemm_operand(q, Trans::T), gemm_operand(one.p(), 1, Trans::N), 256, 1, 1, acc);
            r.ops.dequantize(want, q.cols, q);
            r.out("C", C, low_precision(false));
            r.out("dequantized", want);
          },
          [=](const Result& got, const QuantizedTensor&) {
            const std::vector<float> C = got["C"];
            std::vector<float> want = got["dequantized"];
            for (int i = 0; i < 256; ++i) want[i] = std::fma(want[i], 1.0f, -0.0f);
            ASSERT_TRUE(bitwise_equal(C, want, std::string(elem_format_name(f))));
            if (s == 1.0f && f != ElemFormat::e2m1) {
              for (int i = 0; i < 256; ++i)
                ASSERT_TRUE(bitwise_equal(&C[i], std::vector<float>{decode(f, i)}.data(), 1)) << i;
            }
          });
    }

  // A NaN block scale (a block that held a NaN) decodes to the scale's NaN in every column, in the
  // vector lanes and the scalar tails alike, whatever the codes (a NaN code times a NaN scale would
  // be either NaN as the operands fall): bitwise dequantize()'s, for one scale per row block and
  // per column.
  for (int64_t block_rows : {1, 128}) {
    const int64_t block_cols = block_rows == 1 ? 128 : 1, cols = 45;  // 40 columns in lanes, 5 in the tail
    reg.add(
        {"GemmOperands",
         "NaNBlocksDecodeAsDequantizeDoes",
         {"gemm", "quantize_blockwise", "dequantize"},
         str("block ", block_rows, "x", block_cols)},
        [=](Run& r) {
          std::vector<float> x(cols, 1.0f);
          for (int64_t c : {1, 4, 7, 10, 33, 38, 41, 43}) x[static_cast<size_t>(c)] = std::bit_cast<float>(0xffc00000u);
          QuantizedTensor q;
          r.ops.quantize_blockwise(q, r.in(x), 1, cols, ElemFormat::e4m3, block_rows, block_cols, StochasticRounding{});
          // Give every code a NaN (0x7f / 0xff) or not, so the decoded values and the scales mix.
          for (int64_t c = 0; c < cols; ++c)
            q.codes[static_cast<size_t>(c)] = c % 3 == 0 ? 0xff : c % 3 == 1 ? 0x7f : 0x38;
          const Buf<float> one = r.full(1, 1.0f);
          Buf<float> C = r.full(cols, -0.0f), want = r.zeros(cols);
          GemmOptions acc;
          acc.accumulate = true;
          r.ops.gemm(C, 1, gemm_operand(q, Trans::T), gemm_operand(one.p(), 1, Trans::N), cols, 1, 1, acc);
          r.ops.dequantize(want, q.cols, q);
          r.out("C", C, low_precision(false));
          r.out("dequantized", want);
        },
        [=](const Result& got) {
          std::vector<float> want = got["dequantized"];
          for (int64_t c = 0; c < cols; ++c)
            want[static_cast<size_t>(c)] = std::fma(want[static_cast<size_t>(c)], 1.0f, -0.0f);
          ASSERT_TRUE(bitwise_equal(got["C"], want, "block rows " + std::to_string(block_rows)));
        });
  }

  // 4 experts (one without rows), stacked weights in one quantised tensor, expert e reading its
  // rows: the grouped GEMMs on stored operands equal them on the fp32 matrices, on every setting.
  {
    const int64_t E = 4, Nout = 32, K = 48, R = 40;
    struct In {
      StoredOperand A, Wt, Wn, dY, X;
      std::vector<float> bias, C0, dW0;
    };
    reg.add(
        {"GemmOperands",
         "GroupedExpertsEqualTheFp32GroupedGemm",
         {"grouped_gemm", "grouped_gemm_wgrad"},
         str("E=", E, " Nout=", Nout, " K=", K, " R=", R)},
        [=] {
          return std::make_shared<In>(
              In{StoredOperand(Storage::mxfp8, R, K, 11),
                 StoredOperand(Storage::nvfp4_2d, E * Nout, K, 12),     // (E, Nout, K): W.trans = T
                 StoredOperand(Storage::e4m3_tensor, E * K, Nout, 13),  // (E, K, Nout): W.trans = N
                 StoredOperand(Storage::e5m2_block, R, Nout, 14), StoredOperand(Storage::bf16, R, K, 15),
                 testing::randn(E * Nout, 16, "bias"), testing::randn(R * Nout, 16, "C0"),
                 testing::randn(E * Nout * K, 16, "dW0")});
        },
        [=](Run& r, const std::shared_ptr<In>& in) {
          const int64_t offsets[] = {0, 5, 5, 19, 40};
          const Buf<float> bias = r.in(in->bias);
          const DevOperand A = upload(r, in->A, Trans::N), Ad = upload_dense(r, in->A, Trans::N);
          for (const StoredOperand* W : {&in->Wt, &in->Wn}) {
            const Trans tw = W == &in->Wt ? Trans::T : Trans::N;
            const DevOperand Wq = upload(r, *W, tw), Wd = upload_dense(r, *W, tw);
            for (bool accumulate : {false, true}) {
              Buf<float> got = r.in(in->C0), want = r.in(in->C0);
              r.ops.grouped_gemm(got, A.op, Wq.op, bias, offsets, E, Nout, K, accumulate);
              r.ops.grouped_gemm(want, Ad.op, Wd.op, bias, offsets, E, Nout, K, accumulate);
              const std::string at = str(tw == Trans::T ? "W^T" : "W", accumulate ? " accumulate" : "");
              r.out("grouped_gemm " + at, got, low_precision(false));
              r.out("fp32 grouped_gemm " + at, want);
            }
          }
          const DevOperand dY = upload(r, in->dY, Trans::T), X = upload(r, in->X, Trans::N);
          const DevOperand dYd = upload_dense(r, in->dY, Trans::T), Xd = upload_dense(r, in->X, Trans::N);
          Buf<float> got = r.in(in->dW0), want = r.in(in->dW0);
          r.ops.grouped_gemm_wgrad(got, dY.op, X.op, offsets, E, Nout, K);
          r.ops.grouped_gemm_wgrad(want, dYd.op, Xd.op, offsets, E, Nout, K);
          r.out("grouped_gemm_wgrad", got, low_precision(false));
          r.out("fp32 grouped_gemm_wgrad", want);
        },
        [](const Result& got, const std::shared_ptr<In>&) {
          for (const char* tw : {"W^T", "W"})
            for (const char* acc : {"", " accumulate"}) {
              const std::string at = str(tw, acc);
              ASSERT_TRUE(
                  bitwise_equal(got["grouped_gemm " + at], got["fp32 grouped_gemm " + at], "grouped_gemm " + at));
            }
          ASSERT_TRUE(bitwise_equal(got["grouped_gemm_wgrad"], got["fp32 grouped_gemm_wgrad"], "grouped_gemm_wgrad"));
        });
  }

  // determinism = "layout"'s expert GEMMs over the hidden units (gemm.h): per expert, the tree over
  // segments of chains over slice s of every section, then the bias; and the property expert tensor
  // parallelism relies on: P ranks each computing their block of S / P segments on their slices of
  // the operands (no bias), combined along the canonical tree over ranks, then the bias, give the
  // same bits. Also every setting, a double reference and one gemm() per expert with
  // k_segment_bounds.
  for (int64_t X : {1, 2})
    for (Trans tw : kTrans)
      for (bool with_bias : {false, true}) {
        const int64_t E = 3, Nout = 19, S = 4, f = 3, R = 12, K = S * X * f, section = S * f;
        struct In {
          std::vector<float> A, bias, W;
        };
        reg.add(
            {"GroupedGemm",
             "SegmentedIsTheTreeOverSegmentsAndSplitsOverRanks",
             {"grouped_gemm_segmented", "gemm"},
             str("sections ", X, tw == Trans::T ? " W^T" : " W", with_bias ? " bias" : "")},
            [=] {
              // W: (E, Nout, K) for T, (E, K, Nout) for N.
              return In{testing::randn(R * K, 21, "A"), testing::randn(E * Nout, 21, "bias"),
                        testing::randn(E * Nout * K, 22, "W")};
            },
            [=](Run& r, const In& in) {
              const int64_t offsets[] = {0, 5, 5, 12};  // expert 1 has no rows
              const Buf<float> A = r.in(in.A), W = r.in(in.W), bias = r.in(in.bias);
              const float* b = with_bias ? bias.p() : nullptr;
              const GemmOperand Aop = gemm_operand(A.p(), K, Trans::N),
                                Wop = gemm_operand(W.p(), tw == Trans::T ? K : Nout, tw);
              Buf<float> got = r.zeros(R * Nout);
              r.ops.grouped_gemm_segmented(got, Aop, Wop, b, offsets, E, Nout, K, KSegments{S, X});
              r.out("grouped", got);
              {  // one gemm per expert with the same cut as gemm options
                Buf<float> per = r.zeros(R * Nout);
                GemmOptions opt;
                const KSegmentBounds bounds = k_segment_bounds(KSegments{S, X}, K);
                bounds.apply(opt);
                for (int64_t e = 0; e < E; ++e) {
                  opt.bias = b ? b + e * Nout : nullptr;
                  const int64_t r0 = offsets[e], rows = offsets[e + 1] - r0;
                  if (rows > 0)
                    r.ops.gemm(per.p() + r0 * Nout, Nout, gemm_operand(A.p() + r0 * K, K, Trans::N),
                               gemm_operand(W.p() + e * Nout * K, tw == Trans::T ? K : Nout, tw), rows, Nout, K, opt);
                }
                r.out("gemm per expert", per);
              }
              auto w = [&](int64_t e, int64_t k, int64_t j) {
                return tw == Trans::T ? in.W[(e * Nout + j) * K + k] : in.W[(e * K + k) * Nout + j];
              };
              for (int64_t P : {2, 4}) {
                // Rank p: slices [p S/P f, (p + 1) S/P f) of every section, of A's columns and W's K.
                const int64_t Kr = K / P, sr = section / P;
                for (int64_t p = 0; p < P; ++p) {
                  std::vector<float> Ar(static_cast<size_t>(R * Kr)), Wr(static_cast<size_t>(E * Nout * Kr));
                  for (int64_t x = 0; x < X; ++x)
                    for (int64_t k = 0; k < sr; ++k) {
                      const int64_t kl = x * sr + k, kg = x * section + p * sr + k;
                      for (int64_t i = 0; i < R; ++i) Ar[i * Kr + kl] = in.A[i * K + kg];
                      for (int64_t e = 0; e < E; ++e)
                        for (int64_t j = 0; j < Nout; ++j)
                          (tw == Trans::T ? Wr[(e * Nout + j) * Kr + kl] : Wr[(e * Kr + kl) * Nout + j]) = w(e, kg, j);
                    }
                  const Buf<float> Ard = r.in(Ar), Wrd = r.in(Wr);
                  Buf<float> part = r.zeros(R * Nout);
                  r.ops.grouped_gemm_segmented(part, gemm_operand(Ard.p(), Kr, Trans::N),
                                               gemm_operand(Wrd.p(), tw == Trans::T ? Kr : Nout, tw), nullptr, offsets,
                                               E, Nout, Kr, KSegments{S / P, X});
                  r.out(str(P, " ranks, part ", p), part);
                }
              }
            },
            [=](const Result& got, const In& in) {
              const int64_t offsets[] = {0, 5, 5, 12};
              const float* b = with_bias ? in.bias.data() : nullptr;
              auto w = [&](int64_t e, int64_t k, int64_t j) {
                return tw == Trans::T ? in.W[(e * Nout + j) * K + k] : in.W[(e * K + k) * Nout + j];
              };
              std::vector<float> want(static_cast<size_t>(R * Nout));
              std::vector<double> ref(want.size());
              for (int64_t e = 0; e < E; ++e)
                for (int64_t i = offsets[e]; i < offsets[e + 1]; ++i)
                  for (int64_t j = 0; j < Nout; ++j) {
                    const std::function<float(int64_t, int64_t)> tree = [&](int64_t s0, int64_t s1) -> float {
                      if (s1 - s0 > 1)
                        return tree(s0, s0 + canonical_split(s1 - s0)) + tree(s0 + canonical_split(s1 - s0), s1);
                      float acc = 0.0f;
                      for (int64_t x = 0; x < X; ++x)
                        for (int64_t k = x * section + s0 * f; k < x * section + (s0 + 1) * f; ++k)
                          acc = std::fma(in.A[i * K + k], w(e, k, j), acc);
                      return acc;
                    };
                    const float t = tree(0, S);
                    want[i * Nout + j] = b ? b[e * Nout + j] + t : t;
                    double d = b ? b[e * Nout + j] : 0.0;
                    for (int64_t k = 0; k < K; ++k) d += double(in.A[i * K + k]) * double(w(e, k, j));
                    ref[i * Nout + j] = d;
                  }
              ASSERT_TRUE(bitwise_equal(got["grouped"], want, "grouped_gemm_segmented"));
              ASSERT_TRUE(all_close(want, ref, 1e-5, 1e-5, "vs double"));
              ASSERT_TRUE(bitwise_equal(got["gemm per expert"], want, "gemm per expert"));
              for (int64_t P : {2, 4}) {
                std::vector<std::vector<float>> parts;
                for (int64_t p = 0; p < P; ++p) parts.push_back(got[str(P, " ranks, part ", p)]);
                std::vector<const float*> leaves;
                for (const auto& part : parts) leaves.push_back(part.data());
                std::vector<float> sum(want.size()), stack(static_cast<size_t>(tree_sum_stack(P)) * want.size());
                tree_sum(sum.data(), leaves.data(), P, R * Nout, stack.data());
                if (b)
                  for (int64_t e = 0; e < E; ++e)
                    for (int64_t i = offsets[e]; i < offsets[e + 1]; ++i)
                      for (int64_t j = 0; j < Nout; ++j) sum[i * Nout + j] = b[e * Nout + j] + sum[i * Nout + j];
                ASSERT_TRUE(bitwise_equal(sum, want, str(P, " ranks")));
              }
            });
      }

  // A view at (row0, col0) of a quantised matrix reads the same values as that block of the
  // dequantised matrix (its scales are the stored blocks', not re-derived); a view past the
  // matrix is refused.
  {
    struct In {
      StoredOperand W, X, X4;
    };
    reg.add(
        {"GemmOperands", "QuantisedViews", {"gemm"}, "y(20 x 24) = x[:, 16:56] W[32:56, 16:56]^T"},
        [] {
          return std::make_shared<In>(In{StoredOperand(Storage::nvfp4_2d, 64, 96, 5),
                                         StoredOperand(Storage::mxfp8, 20, 64, 6),
                                         StoredOperand(Storage::nvfp4, 20, 64, 7)});
        },
        [](Run& r, const std::shared_ptr<In>& in) {
          const int64_t M = 20, N = 24, K = 40;
          const GemmOptions none;
          const Buf<float> Wd = r.in(in->W.dense), Xd = r.in(in->X.dense), X4d = r.in(in->X4.dense);
          Buf<float> got = r.zeros(M * N), want = r.zeros(M * N);
          r.ops.gemm(got, N, gemm_operand(in->X.q, Trans::N, 0, 16), gemm_operand(in->W.q, Trans::T, 32, 16), M, N, K,
                     none);
          r.ops.gemm(want, N, gemm_operand(Xd.p() + 16, 64, Trans::N),
                     gemm_operand(Wd.p() + 32 * 96 + 16, 96, Trans::T), M, N, K, none);
          r.out("views", got, low_precision(false));
          r.out("dense", want);
          // An odd column origin in packed E2M1 (a view starting in the high nibble of a byte).
          r.ops.gemm(got, N, gemm_operand(in->X4.q, Trans::N, 0, 3), gemm_operand(in->W.q, Trans::T, 32, 16), M, N, K,
                     none);
          r.ops.gemm(want, N, gemm_operand(X4d.p() + 3, 64, Trans::N),
                     gemm_operand(Wd.p() + 32 * 96 + 16, 96, Trans::T), M, N, K, none);
          r.out("odd origin views", got, low_precision(false));
          r.out("odd origin dense", want);
          bool threw = false;
          try {
            r.ops.gemm(got, N, gemm_operand(in->X.q, Trans::N, 0, 30), gemm_operand(in->W.q, Trans::T, 0, 0), M, N, K,
                       none);
          } catch (const InternalError&) {
            threw = true;
          }
          r.out("view past the matrix threw InternalError", std::vector<uint8_t>{threw});
        },
        [](const Result& got, const std::shared_ptr<In>&) {
          EXPECT_TRUE(bitwise_equal(got["views"], got["dense"]));
          EXPECT_TRUE(bitwise_equal(got["odd origin views"], got["odd origin dense"], "odd origin"));
          EXPECT_EQ(got.get<uint8_t>("view past the matrix threw InternalError"), std::vector<uint8_t>{1});
        });
  }

  // The grouped GEMMs of an MoE layer's experts (fp32): y = grouped_gemm(x, W^T) + b against the
  // double reference; dx = grouped_gemm(dy, W), dW (grouped_gemm_wgrad) and db (grouped_bias_grad)
  // against central differences of <dy, y(x, W, b)>; every setting bitwise.
  {
    const int64_t E = 3, N = 7, K = 5;
    struct In {
      std::vector<float> x, w, b, dy;
    };
    reg.add(
        {"MoeGroupedGemm",
         "MatchesReferenceFiniteDifferencesAndThreads",
         {"grouped_gemm", "grouped_gemm_wgrad", "grouped_bias_grad"},
         str("E=", E, " N=", N, " K=", K)},
        [=] {
          const int64_t R = 9;
          return In{testing::randn(R * K, 1, "x"), testing::randn(E * N * K, 2, "w"), testing::randn(E * N, 3, "b"),
                    testing::randn(R * N, 4, "dy")};
        },
        [=](Run& r, const In& in) {
          const std::vector<int64_t> off = {0, 4, 4, 9};  // expert 1 has no rows
          const int64_t R = off[E];
          const Buf<float> x = r.in(in.x), w = r.in(in.w), b = r.in(in.b), dy = r.in(in.dy);
          Buf<float> y = r.zeros(R * N), dx = r.zeros(R * K), dw = r.zeros(E * N * K), db = r.zeros(E * N);
          r.ops.grouped_gemm(y, gemm_operand(x.p(), K, Trans::N), gemm_operand(w.p(), K, Trans::T), b, off.data(), E, N,
                             K, false);
          r.ops.grouped_gemm(dx, gemm_operand(dy.p(), N, Trans::N), gemm_operand(w.p(), K, Trans::N), nullptr,
                             off.data(), E, K, N, false);
          r.ops.grouped_gemm_wgrad(dw, gemm_operand(dy.p(), N, Trans::T), gemm_operand(x.p(), K, Trans::N), off.data(),
                                   E, N, K);
          r.ops.grouped_bias_grad(db, dy, off.data(), E, N);
          r.out("y", y);
          r.out("dx", dx);
          r.out("dw", dw);
          r.out("db", db);
        },
        [=](const Result& got, const In& in) {
          const std::vector<int64_t> off = {0, 4, 4, 9};
          const int64_t R = off[E];
          std::vector<double> ref(R * N);
          for (int64_t e = 0; e < E; ++e)
            for (int64_t r = off[e]; r < off[e + 1]; ++r)
              for (int64_t n = 0; n < N; ++n) {
                double s = in.b[e * N + n];
                for (int64_t k = 0; k < K; ++k) s += static_cast<double>(in.x[r * K + k]) * in.w[(e * N + n) * K + k];
                ref[r * N + n] = s;
              }
          EXPECT_TRUE(all_close(got["y"], ref, 1e-5, 1e-5, "grouped_gemm"));
          auto f = [&](const std::vector<double>& xx, const std::vector<double>& ww, const std::vector<double>& bb) {
            double s = 0;
            for (int64_t e = 0; e < E; ++e)
              for (int64_t r = off[e]; r < off[e + 1]; ++r)
                for (int64_t n = 0; n < N; ++n) {
                  double v = bb[e * N + n];
                  for (int64_t k = 0; k < K; ++k) v += xx[r * K + k] * ww[(e * N + n) * K + k];
                  s += v * in.dy[r * N + n];
                }
            return s;
          };
          const std::vector<double> xd(in.x.begin(), in.x.end()), wd(in.w.begin(), in.w.end()),
              bd(in.b.begin(), in.b.end());
          EXPECT_TRUE(all_close(got["dx"], testing::finite_difference([&](const auto& v) { return f(v, wd, bd); }, xd),
                                1e-4, 1e-4, "dx"));
          EXPECT_TRUE(all_close(got["dw"], testing::finite_difference([&](const auto& v) { return f(xd, v, bd); }, wd),
                                1e-4, 1e-4, "dw"));
          EXPECT_TRUE(all_close(got["db"], testing::finite_difference([&](const auto& v) { return f(xd, wd, v); }, bd),
                                1e-4, 1e-4, "db"));
        });
  }
}

}  // namespace lockstep::harness
