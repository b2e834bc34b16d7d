// The data movement ops (kernels/copy.h) on every backend: they compute nothing, so every output
// is checked bit for bit against the move the contract states (signed zeros, NaN payloads and
// denormals travel unchanged), and the elements the op must not write keep their bits.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "../op_harness.h"
#include "../testing.h"
#include "lockstep/core/error.h"

namespace lockstep::harness {
namespace {

using testing::bitwise_equal;
using testing::randn;
using testing::random_ints;

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::string bits_text(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", u);
  return buf;
}

// n random values with the values a move must keep bit for bit sprinkled in: -0, +0, infinities,
// a NaN with a payload, a denormal, the largest float.
std::vector<float> values(int64_t n, uint64_t seed, const std::string& name) {
  std::vector<float> v = randn(n, seed, name);
  const float special[] = {-0.0f,
                           0.0f,
                           std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(),
                           from_bits(0x7fa12345u),
                           from_bits(0x00000003u),
                           std::numeric_limits<float>::max()};
  for (int64_t i = 0; i < n; i += 5) v[i] = special[(i / 5) % 7];
  return v;
}

// The sizes of the 1-D ops: empty, one, odd, and larger than a thread's chunk.
constexpr int64_t kSizes[] = {0, 1, 7, 10007};

}  // namespace

void add_copy_cases(Registry& reg) {
  // fill: [0, n) is the value's bits (a -0 fill keeps its sign bit, a NaN its payload); the
  // element past n keeps its own.
  for (const int64_t n : kSizes)
    for (const float value : {-0.0f, 0.0f, 1.5f, from_bits(0x7fc00abcu)}) {
      reg.add(
          {"Copy", "FillWritesTheValuesBits", {"fill"}, str("n=", n, " value bits ", bits_text(value))},
          [=] { return values(n + 1, 1, "x"); },
          [=](Run& r, const std::vector<float>& x0) {
            Buf<float> x = r.in(x0);
            r.ops.fill(x, n, value);
            r.out("x", x);
          },
          [=](const Result& got, const std::vector<float>& x0) {
            std::vector<float> want(n + 1, value);
            want[n] = x0[n];
            EXPECT_TRUE(bitwise_equal(got["x"], want, "x"));
          });
    }

  // copy: dst[0, n) = src's bits; dst's element past n untouched.
  for (const int64_t n : kSizes) {
    struct In {
      std::vector<float> src, dst0;
    };
    reg.add(
        {"Copy", "CopyMovesTheBits", {"copy"}, str("n=", n)},
        [=] {
          return In{values(n, 2, "src"), randn(n + 1, 2, "dst")};
        },
        [=](Run& r, const In& in) {
          const Buf<float> src = r.in(in.src);
          Buf<float> dst = r.in(in.dst0);
          r.ops.copy(dst, src, n);
          r.out("dst", dst);
        },
        [=](const Result& got, const In& in) {
          std::vector<float> want = in.src;
          want.push_back(in.dst0[n]);
          EXPECT_TRUE(bitwise_equal(got["dst"], want, "dst"));
        });
  }

  // copy_rows: `width` columns of each row between strided buffers; the columns past width of dst
  // keep their bits.
  {
    struct Shape {
      int64_t rows, width, ld_dst, ld_src;
    };
    struct In {
      std::vector<float> src, dst0;
    };
    for (const Shape s : {Shape{0, 3, 4, 5}, Shape{1, 1, 1, 1}, Shape{5, 4, 4, 4}, Shape{7, 5, 9, 6},
                          Shape{301, 13, 16, 21}, Shape{4, 0, 3, 2}}) {
      reg.add(
          {"Copy",
           "CopyRowsMovesEachRowsColumns",
           {"copy_rows"},
           str("rows=", s.rows, " width=", s.width, " ld_dst=", s.ld_dst, " ld_src=", s.ld_src)},
          [=] {
            return In{values(s.rows * s.ld_src, 3, "src"), randn(s.rows * s.ld_dst, 3, "dst")};
          },
          [=](Run& r, const In& in) {
            const Buf<float> src = r.in(in.src);
            Buf<float> dst = r.in(in.dst0);
            r.ops.copy_rows(dst, s.ld_dst, src, s.ld_src, s.rows, s.width);
            r.out("dst", dst);
          },
          [=](const Result& got, const In& in) {
            std::vector<float> want = in.dst0;
            for (int64_t i = 0; i < s.rows; ++i)
              for (int64_t c = 0; c < s.width; ++c) want[i * s.ld_dst + c] = in.src[i * s.ld_src + c];
            EXPECT_TRUE(bitwise_equal(got["dst"], want, "dst"));
          });
    }
  }

  // gather_rows: dst row r = src row index[r] (repeats allowed), or alt row -1 - index[r] for a
  // negative index; without negative indices alt may be null.
  {
    struct In {
      std::vector<float> src, alt, dst0;
      std::vector<int64_t> index;
    };
    const int64_t S = 11, A = 4;  // rows of src and of alt
    for (const bool with_alt : {false, true})
      for (const auto& shape : {std::pair<int64_t, int64_t>{0, 3}, {1, 1}, {9, 5}, {257, 17}}) {
        const int64_t rows = shape.first, width = shape.second;
        reg.add(
            {"Copy",
             "GatherRowsTakesSrcOrAltRows",
             {"gather_rows"},
             str("rows=", rows, " width=", width, with_alt ? " with alt rows" : " alt null")},
            [=] {
              In in{values(S * width, 4, "src"), values(A * width, 4, "alt"), randn(rows * width, 4, "dst"), {}};
              const std::vector<int32_t> pick = random_ints(rows, with_alt ? S + A : S, 4, "index");
              for (int64_t r = 0; r < rows; ++r) in.index.push_back(pick[r] < S ? pick[r] : S - 1 - pick[r]);
              if (with_alt && rows > 0) in.index[0] = -A;  // the last alt row
              return in;
            },
            [=](Run& r, const In& in) {
              const Buf<float> src = r.in(in.src), alt = r.in(in.alt);
              const Buf<int64_t> index = r.in(in.index);
              Buf<float> dst = r.in(in.dst0);
              r.ops.gather_rows(dst, src, with_alt ? alt.p() : nullptr, index, rows, width);
              r.out("dst", dst);
            },
            [=](const Result& got, const In& in) {
              std::vector<float> want(rows * width);
              for (int64_t r = 0; r < rows; ++r) {
                const int64_t i = in.index[r];
                ASSERT_TRUE(with_alt || i >= 0);
                for (int64_t c = 0; c < width; ++c)
                  want[r * width + c] = i >= 0 ? in.src[i * width + c] : in.alt[(-1 - i) * width + c];
              }
              EXPECT_TRUE(bitwise_equal(got["dst"], want, "dst"));
            });
      }
  }

  // scatter_rows: dst row index[r] = src row r for index[r] >= 0 (distinct rows); a negative index
  // skips its row, and the dst rows no index names keep their bits.
  {
    struct In {
      std::vector<float> src, dst0;
      std::vector<int64_t> index;
    };
    for (const auto& shape : {std::pair<int64_t, int64_t>{0, 2}, {1, 3}, {1, 1}, {13, 7}, {301, 9}}) {
      const int64_t rows = shape.first, width = shape.second;
      const int64_t D = rows + 3;  // dst rows
      reg.add(
          {"Copy", "ScatterRowsSkipsNegativeIndices", {"scatter_rows"}, str("rows=", rows, " width=", width)},
          [=] {
            In in{values(rows * width, 5, "src"), randn(D * width, 5, "dst"), {}};
            // A permutation of the dst rows (a rotation by 2), every third source row skipped.
            for (int64_t r = 0; r < rows; ++r) in.index.push_back(r % 3 == 1 ? -1 - r : (r * 7 + 2) % D);
            return in;
          },
          [=](Run& r, const In& in) {
            const Buf<float> src = r.in(in.src);
            const Buf<int64_t> index = r.in(in.index);
            Buf<float> dst = r.in(in.dst0);
            r.ops.scatter_rows(dst, src, index, rows, width);
            r.out("dst", dst);
          },
          [=](const Result& got, const In& in) {
            std::vector<float> want = in.dst0;
            std::vector<int> hits(D, 0);
            for (int64_t r = 0; r < rows; ++r) {
              if (in.index[r] < 0) continue;
              ASSERT_LT(in.index[r], D);
              ASSERT_EQ(hits[in.index[r]]++, 0) << "the case scatters two rows to one";
              for (int64_t c = 0; c < width; ++c) want[in.index[r] * width + c] = in.src[r * width + c];
            }
            EXPECT_TRUE(bitwise_equal(got["dst"], want, "dst"));
          });
    }
  }

  // copy_row_blocks: block b moves rows[b] rows (0 allowed) from src row src_row[b] to dst row
  // dst_row[b]; the dst rows no block covers keep their bits.
  {
    struct In {
      std::vector<float> src, dst0;
      std::vector<int64_t> dst_row, src_row, rows;
    };
    struct Shape {
      int64_t blocks, width;
    };
    for (const Shape s : {Shape{0, 4}, Shape{1, 1}, Shape{6, 5}, Shape{97, 3}}) {
      reg.add(
          {"Copy", "CopyRowBlocksMovesEachBlock", {"copy_row_blocks"}, str("blocks=", s.blocks, " width=", s.width)},
          [=] {
            In in;
            // Block b has b % 4 rows; the blocks land in dst in reverse order, one spare row after each.
            int64_t src_rows = 0;
            for (int64_t b = 0; b < s.blocks; ++b) {
              in.src_row.push_back(src_rows);
              in.rows.push_back(b % 4);
              src_rows += b % 4 + (b % 3 == 0);  // some src rows are not moved
            }
            int64_t dst_rows = 0;
            in.dst_row.assign(s.blocks, 0);
            for (int64_t b = s.blocks - 1; b >= 0; --b) {
              in.dst_row[b] = dst_rows;
              dst_rows += in.rows[b] + 1;
            }
            in.src = values(src_rows * s.width, 6, "src");
            in.dst0 = randn((dst_rows + 1) * s.width, 6, "dst");
            return in;
          },
          [=](Run& r, const In& in) {
            const Buf<float> src = r.in(in.src);
            const Buf<int64_t> dst_row = r.in(in.dst_row), src_row = r.in(in.src_row), rows = r.in(in.rows);
            Buf<float> dst = r.in(in.dst0);
            r.ops.copy_row_blocks(dst, dst_row, src, src_row, rows, s.blocks, s.width);
            r.out("dst", dst);
          },
          [=](const Result& got, const In& in) {
            std::vector<float> want = in.dst0;
            for (int64_t b = 0; b < s.blocks; ++b)
              for (int64_t i = 0; i < in.rows[b] * s.width; ++i)
                want[in.dst_row[b] * s.width + i] = in.src[in.src_row[b] * s.width + i];
            EXPECT_TRUE(bitwise_equal(got["dst"], want, "dst"));
          });
    }
  }

  // transpose: out[c, r] = x[r, c].
  for (const auto& shape : {std::pair<int64_t, int64_t>{0, 3}, {3, 0}, {1, 1}, {1, 6}, {6, 1}, {37, 29}, {5, 301}}) {
    const int64_t rows = shape.first, cols = shape.second;
    reg.add(
        {"Copy", "TransposeMovesEveryElement", {"transpose"}, str("rows=", rows, " cols=", cols)},
        [=] { return values(rows * cols, 7, "x"); },
        [=](Run& r, const std::vector<float>& x0) {
          const Buf<float> x = r.in(x0);
          Buf<float> out = r.in(randn(rows * cols, 7, "out"));
          r.ops.transpose(out, x, rows, cols);
          r.out("out", out);
        },
        [=](const Result& got, const std::vector<float>& x) {
          std::vector<float> want(rows * cols);
          for (int64_t i = 0; i < rows; ++i)
            for (int64_t c = 0; c < cols; ++c) want[c * rows + i] = x[i * cols + c];
          EXPECT_TRUE(bitwise_equal(got["out"], want, "out"));
        });
  }

  // lookup_rows: row n = table row ids[n], or `missing` (its bits: -0 keeps the sign) where
  // ids[n] < 0 (another vocabulary shard's token).
  for (const float missing : {-0.0f, 0.0f})
    for (const auto& shape : {std::pair<int64_t, int64_t>{0, 4}, {1, 1}, {1, 5}, {11, 6}, {301, 7}}) {
      const int64_t N = shape.first, C = shape.second;
      const int64_t V = 9;
      struct In {
        std::vector<float> table;
        std::vector<int32_t> ids;
      };
      reg.add(
          {"Copy",
           "LookupRowsTakesTableRowsOrMissing",
           {"lookup_rows"},
           str("N=", N, " C=", C, " missing=", std::signbit(missing) ? "-0" : "+0")},
          [=] {
            In in{values(V * C, 8, "table"), random_ints(N, V + 3, 8, "ids")};
            for (int32_t& id : in.ids)
              if (id >= V) id = V - 1 - id;  // -1 .. -3: not this shard's
            if (N > 1) in.ids[N - 1] = -1;
            return in;
          },
          [=](Run& r, const In& in) {
            const Buf<float> table = r.in(in.table);
            const Buf<int32_t> ids = r.in(in.ids);
            Buf<float> out = r.in(randn(N * C, 8, "out"));
            r.ops.lookup_rows(out, table, ids, N, C, missing);
            r.out("out", out);
          },
          [=](const Result& got, const In& in) {
            std::vector<float> want(N * C);
            for (int64_t n = 0; n < N; ++n)
              for (int64_t c = 0; c < C; ++c) want[n * C + c] = in.ids[n] < 0 ? missing : in.table[in.ids[n] * C + c];
            EXPECT_TRUE(bitwise_equal(got["out"], want, "out"));
          });
    }
}

}  // namespace lockstep::harness
