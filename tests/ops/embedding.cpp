// Token and position embeddings and the bias gradient (kernels/embedding.h) on every backend:
// against double sums and the serial loops whose order the contract states, central differences,
// the token segments of determinism = "layout", and the thread settings; add_positions bit for bit.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
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
using testing::random_ints;
using testing::to_double;

struct In {
  std::vector<int32_t> tokens, positions;
  std::vector<float> wte, wpe, dout, dwte0, dwpe0;
};

// embedding_backward into copies of dwte0 (and dwpe0 unless empty).
void backward(Run& r, const In& in, int64_t B, int64_t T, int64_t C, int64_t P = 0, int64_t segments = 0,
              int64_t pos_segments = 0) {
  const Buf<float> dout = r.in(in.dout);
  const Buf<int32_t> tokens = r.in(in.tokens), positions = r.in(in.positions);
  Buf<float> dwte = r.in(in.dwte0), dwpe = r.in(in.dwpe0);
  Buf<int32_t> order = r.zeros<int32_t>(B * T);
  r.ops.embedding_backward(dwte, dwpe, order, dout, tokens, B, T, C, positions, P, segments, pos_segments);
  r.out("dwte", dwte);
  if (!in.dwpe0.empty()) r.out("dwpe", dwpe);
}

// The forward of in.tokens (with wpe unless empty, at in.positions when given).
void forward(Run& r, const In& in, int64_t B, int64_t T, int64_t C, int64_t V, int64_t P = 0) {
  const Buf<int32_t> tokens = r.in(in.tokens), positions = r.in(in.positions);
  const Buf<float> wte = r.in(in.wte), wpe = r.in(in.wpe);
  Buf<float> out = r.zeros(B * T * C);
  r.ops.embedding_forward(out, tokens, wte, wpe, B, T, C, V, positions, P);
  r.out("out", out);
}

// out[b, t] = wte[token] (+ wpe[pos]) in double.
std::vector<double> forward_ref(const In& in, int64_t N, int64_t T, int64_t C) {
  std::vector<double> ref(N * C);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c) {
      double v = in.wte[in.tokens[n] * C + c];
      const int64_t pos = in.positions.empty() ? n % T : in.positions[n];
      if (!in.wpe.empty()) v += in.wpe[pos * C + c];
      ref[n * C + c] = v;
    }
  return ref;
}

}  // namespace

void add_embedding_cases(Registry& reg) {
  {
    const int64_t B = 2, T = 5, C = 13, V = 11;
    for (bool positions : {true, false}) {
      reg.add(
          {"Embedding", "ForwardMatchesReference", {"embedding_forward"}, str("with wpe: ", positions)},
          [=] {
            In in;
            in.tokens = random_ints(B * T, V, 1, "tokens");
            in.wte = randn(V * C, 1, "wte");
            if (positions) in.wpe = randn(T * C, 1, "wpe");
            return in;
          },
          [=](Run& r, const In& in) { forward(r, in, B, T, C, V); },
          [=](const Result& got, const In& in) {
            // One float addition is correctly rounded: the result is exact up to that rounding.
            EXPECT_TRUE(all_close(got["out"], forward_ref(in, B * T, T, C), 6e-8, 0.0, "out"));
          });
    }
  }

  {
    const int64_t B = 2, T = 3, C = 4, V = 10;
    for (int32_t bad : {10, -1, 12345}) {
      reg.add(
          {"Embedding", "ForwardRejectsTokenOutsideVocabulary", {"embedding_forward"}, str("token ", bad)},
          [=](Run& r) {
            const Buf<int32_t> tokens = r.in(std::vector<int32_t>{1, 2, 3, 4, bad, 5});
            const Buf<float> wte = r.in(randn(V * C, 2, "wte"));
            Buf<float> out = r.full(B * T * C, 7.0f);
            r.out_text("error", testing::user_error_of([&] {
                         r.ops.embedding_forward(out, tokens, wte, nullptr, B, T, C, V, nullptr, 0);
                       }));
            r.out("out", out);
          },
          [=](const Result& got) {
            const std::string msg = got.text("error");
            EXPECT_NE(msg, "(no error)") << "token " << bad << " accepted";
            EXPECT_NE(msg.find("token " + std::to_string(bad)), std::string::npos) << msg;
            EXPECT_NE(msg.find("position 4"), std::string::npos) << msg;
            for (float x : got["out"]) EXPECT_EQ(x, 7.0f) << "output written before the error";
          });
    }
  }

  // The backward is linear in dout: compare with the direct sum, computed in double.
  {
    const int64_t B = 3, T = 7, C = 19, V = 6;  // 21 positions over 6 tokens: many repeats
    reg.add(
        {"Embedding",
         "BackwardMatchesReferenceSum",
         {"embedding_backward"},
         str("B=", B, " T=", T, " C=", C, " V=", V)},
        [=] {
          In in;
          in.tokens = random_ints(B * T, V, 3, "tokens");
          in.dout = randn(B * T * C, 3, "dout");
          in.dwte0 = randn(V * C, 3, "dwte0");
          in.dwpe0 = randn(T * C, 3, "dwpe0");
          return in;
        },
        [=](Run& r, const In& in) { backward(r, in, B, T, C); },
        [=](const Result& got, const In& in) {
          std::vector<double> ref_wte = to_double(in.dwte0), ref_wpe = to_double(in.dwpe0);
          for (int64_t b = 0; b < B; ++b)
            for (int64_t t = 0; t < T; ++t)
              for (int64_t c = 0; c < C; ++c) {
                ref_wte[in.tokens[b * T + t] * C + c] += in.dout[(b * T + t) * C + c];
                ref_wpe[t * C + c] += in.dout[(b * T + t) * C + c];
              }
          EXPECT_TRUE(all_close(got["dwte"], ref_wte, 1e-6, 1e-6, "dwte"));
          EXPECT_TRUE(all_close(got["dwpe"], ref_wpe, 1e-6, 1e-6, "dwpe"));
        });
  }

  // The documented order - each row accumulated in position order, dwpe in b order - is the order
  // of the plain serial loop, so the result must equal that loop bit for bit (on every setting:
  // 1 to 3 threads).
  {
    const int64_t B = 4, T = 9, C = 21, V = 5;
    reg.add(
        {"Embedding",
         "BackwardSumsInPositionOrder",
         {"embedding_backward"},
         str("B=", B, " T=", T, " C=", C, " V=", V)},
        [=] {
          In in;
          in.tokens = random_ints(B * T, V, 4, "tokens");
          in.dout = randn(B * T * C, 4, "dout", 3.0f);
          in.dwte0 = randn(V * C, 4, "dwte0");
          in.dwpe0 = randn(T * C, 4, "dwpe0");
          return in;
        },
        [=](Run& r, const In& in) { backward(r, in, B, T, C); },
        [=](const Result& got, const In& in) {
          auto serial_wte = in.dwte0, serial_wpe = in.dwpe0;
          for (int64_t n = 0; n < B * T; ++n)
            for (int64_t c = 0; c < C; ++c) {
              serial_wte[in.tokens[n] * C + c] += in.dout[n * C + c];
              serial_wpe[(n % T) * C + c] += in.dout[n * C + c];
            }
          EXPECT_TRUE(bitwise_equal(got["dwte"], serial_wte, "dwte"));
          EXPECT_TRUE(bitwise_equal(got["dwpe"], serial_wpe, "dwpe"));
        });
  }

  // Forward and backward on every setting (1 to 3 threads) bitwise, for uniform and skewed token
  // counts; against the double forward and sums.
  {
    const int64_t B = 4, T = 50, C = 37, V = 300;
    for (int kind = 0; kind < 3; ++kind) {
      const char* names[] = {"uniform", "all one token", "four tokens and one frequent one"};
      reg.add(
          {"Embedding", "BitwiseAcrossThreadCounts", {"embedding_forward", "embedding_backward"}, names[kind]},
          [=] {
            In in;
            if (kind == 0) in.tokens = random_ints(B * T, V, 5, "tokens");
            if (kind == 1) in.tokens.assign(B * T, 17);
            if (kind == 2) {
              in.tokens = random_ints(B * T, V, 6, "tokens");
              for (auto& t : in.tokens) t = t % 3 == 0 ? 42 : t % 4;
            }
            in.wte = randn(V * C, 5, "wte");
            in.wpe = randn(T * C, 5, "wpe");
            in.dout = randn(B * T * C, 5, "dout");
            in.dwte0 = randn(V * C, 7, "dwte0");
            in.dwpe0 = randn(T * C, 7, "dwpe0");
            return in;
          },
          [=](Run& r, const In& in) {
            forward(r, in, B, T, C, V);
            backward(r, in, B, T, C);
          },
          [=](const Result& got, const In& in) {
            EXPECT_TRUE(all_close(got["out"], forward_ref(in, B * T, T, C), 6e-8, 0.0, "out"));
            std::vector<double> ref_wte = to_double(in.dwte0), ref_wpe = to_double(in.dwpe0);
            for (int64_t n = 0; n < B * T; ++n)
              for (int64_t c = 0; c < C; ++c) {
                ref_wte[in.tokens[n] * C + c] += in.dout[n * C + c];
                ref_wpe[(n % T) * C + c] += in.dout[n * C + c];
              }
            EXPECT_TRUE(all_close(got["dwte"], ref_wte, 1e-5, 1e-5, "dwte"));
            EXPECT_TRUE(all_close(got["dwpe"], ref_wpe, 1e-5, 1e-5, "dwpe"));
          });
    }
  }

  {
    const int64_t B = 2, T = 3, C = 5;
    reg.add(
        {"Embedding", "BackwardWithoutPositions", {"embedding_backward"}, str("B=", B, " T=", T, " C=", C)},
        [=] {
          In in;
          in.tokens = {2, 0, 2, 2, 1, 0};
          in.dout = randn(B * T * C, 8, "dout");
          in.dwte0.assign(3 * C, 0.0f);
          return in;
        },
        [=](Run& r, const In& in) { backward(r, in, B, T, C); },
        [=](const Result& got, const In& in) {
          const std::vector<float> dwte = got["dwte"];
          const std::vector<float>& dout = in.dout;
          for (int64_t c = 0; c < C; ++c) {
            EXPECT_EQ(dwte[0 * C + c], (0.0f + dout[1 * C + c]) + dout[5 * C + c]);
            EXPECT_EQ(dwte[1 * C + c], 0.0f + dout[4 * C + c]);
            EXPECT_EQ(dwte[2 * C + c], ((0.0f + dout[0 * C + c]) + dout[2 * C + c]) + dout[3 * C + c]);
          }
        });
  }

  // Gradients of sum(embedding(wte, wpe) * R) against central differences: positions restarting
  // at each document (P rows of wpe), and the plain positions.
  for (bool with_pos : {false, true}) {
    const int64_t B = 2, T = 6, C = 3, V = 4, P = with_pos ? 4 : 0;
    reg.add(
        {"Embedding",
         "GradientsMatchFiniteDifferences",
         {"embedding_forward", "embedding_backward"},
         str("positions: ", with_pos)},
        [=] {
          In in;
          in.tokens = random_ints(B * T, V, 9, "tokens");
          if (with_pos) in.positions = {0, 1, 2, 0, 1, 2, 3, 0, 1, 0, 1, 2};
          in.wte = randn(V * C, 9, "wte");
          in.wpe = randn((with_pos ? P : T) * C, 9, "wpe");
          in.dout = randn(B * T * C, 9, "R");
          in.dwte0.assign(V * C, 0.0f);
          in.dwpe0.assign(in.wpe.size(), 0.0f);
          return in;
        },
        [=](Run& r, const In& in) {
          forward(r, in, B, T, C, V, P);
          backward(r, in, B, T, C, P);
        },
        [=](const Result& got, const In& in) {
          EXPECT_TRUE(all_close(got["out"], forward_ref(in, B * T, T, C), 6e-8, 0.0, "out"));
          std::vector<double> p = to_double(in.wte);
          p.insert(p.end(), in.wpe.begin(), in.wpe.end());
          const auto loss = [&](const std::vector<double>& q) {
            double l = 0;
            for (int64_t n = 0; n < B * T; ++n) {
              const int64_t pos = in.positions.empty() ? n % T : in.positions[n];
              for (int64_t c = 0; c < C; ++c)
                l += (q[in.tokens[n] * C + c] + q[V * C + pos * C + c]) * in.dout[n * C + c];
            }
            return l;
          };
          const std::vector<double> g = finite_difference(loss, p);
          EXPECT_TRUE(all_close(got["dwte"], std::vector<double>(g.begin(), g.begin() + V * C), 1e-6, 1e-6, "dwte"));
          EXPECT_TRUE(all_close(got["dwpe"], std::vector<double>(g.begin() + V * C, g.end()), 1e-6, 1e-6, "dwpe"));
        });
  }

  // layout_token_segments: the word and position embeddings' gradients in S token segments: each
  // row's segment sums from zero in row order, the tree over the S segments (empty ones are zero
  // leaves), added to the row; bitwise against that definition on every setting (1 to 3 threads),
  // with and without explicit positions, and close to the double sum.
  {
    const int64_t B = 2, T = 24, C = 20, V = 7, N = B * T;
    for (const int64_t S : {2, 8}) {
      for (const bool with_pos : {false, true}) {
        reg.add(
            {"Embedding", "BackwardInTokenSegments", {"embedding_backward"}, str("S=", S, " positions=", with_pos)},
            [=] {
              In in;
              in.tokens = random_ints(N, V, 5, "tokens");
              if (with_pos) in.positions = random_ints(N, T, 6, "positions");
              in.dout = randn(N * C, 7, "dout");
              in.dwte0.assign(V * C, 0.0f);
              in.dwpe0.assign(T * C, 0.0f);
              return in;
            },
            [=](Run& r, const In& in) { backward(r, in, B, T, C, T, S, S); },
            [=](const Result& got, const In& in) {
              // key of row n: the token (dwte) or the position (dwpe).
              auto want = [&](auto key, int64_t rows) {
                const std::vector<int64_t> b = canonical_segments(N, S);
                std::vector<float> out(rows * C, 0.0f);
                std::vector<double> ref(rows * C, 0.0);
                for (int64_t v = 0; v < rows; ++v) {
                  std::vector<std::vector<float>> seg(S, std::vector<float>(C, 0.0f));
                  for (int64_t k = 0; k < S; ++k)
                    for (int64_t n = b[k]; n < b[k + 1]; ++n)
                      if (key(n) == v)
                        for (int64_t c = 0; c < C; ++c) {
                          seg[k][c] += in.dout[n * C + c];
                          ref[v * C + c] += in.dout[n * C + c];
                        }
                  std::vector<const float*> leaves;
                  for (const auto& l : seg) leaves.push_back(l.data());
                  std::vector<float> tree(C), stack(tree_sum_stack(S) * C);
                  tree_sum(tree.data(), leaves.data(), S, C, stack.data());
                  bool touched = false;
                  for (int64_t n = 0; n < N; ++n) touched |= key(n) == v;
                  for (int64_t c = 0; c < C; ++c) out[v * C + c] = touched ? 0.0f + tree[c] : 0.0f;
                }
                EXPECT_TRUE(all_close(out, ref, 1e-5, 1e-6, "vs double"));
                return out;
              };
              const auto wte = want([&](int64_t n) { return in.tokens[n]; }, V);
              const auto wpe = want([&](int64_t n) { return with_pos ? in.positions[n] : n % T; }, T);
              EXPECT_TRUE(bitwise_equal(got["dwte"], wte, "dwte"));
              EXPECT_TRUE(bitwise_equal(got["dwpe"], wpe, "dwpe"));
            });
      }
    }
  }

  // bias_backward: dbias += the column sums in row order: the serial loop's bits, on every setting
  // (1 to 3 threads), and the double sum.
  for (int64_t C : {1, 15, 16, 37, 100}) {
    const int64_t N = 29;
    reg.add(
        {"BiasBackward", "MatchesReferenceAndRowOrder", {"bias_backward"}, str("N=", N, " C=", C)},
        [=] {
          In in;
          in.dout = randn(N * C, 9, "dout");
          in.dwte0 = randn(C, 9, "dbias0");
          return in;
        },
        [=](Run& r, const In& in) {
          const Buf<float> dout = r.in(in.dout);
          Buf<float> dbias = r.in(in.dwte0);
          r.ops.bias_backward(dbias, dout, N, C, 0);
          r.out("dbias", dbias);
        },
        [=](const Result& got, const In& in) {
          std::vector<double> ref = to_double(in.dwte0);
          auto serial = in.dwte0;
          for (int64_t n = 0; n < N; ++n)
            for (int64_t c = 0; c < C; ++c) {
              ref[c] += in.dout[n * C + c];
              serial[c] += in.dout[n * C + c];
            }
          EXPECT_TRUE(all_close(got["dbias"], ref, 1e-5, 1e-5, "dbias"));
          EXPECT_TRUE(bitwise_equal(got["dbias"], serial, "dbias vs serial row order"));
        });
  }

  // The bias gradient of sum((x + bias) * dout) against central differences (from a zero dbias).
  {
    const int64_t N = 5, C = 3;
    reg.add(
        {"BiasBackward", "GradientMatchesFiniteDifferences", {"bias_backward"}, str("N=", N, " C=", C)},
        [=] {
          In in;
          in.wte = randn(N * C, 14, "x");
          in.dout = randn(N * C, 14, "dout");
          return in;
        },
        [=](Run& r, const In& in) {
          const Buf<float> dout = r.in(in.dout);
          Buf<float> dbias = r.zeros(C);
          r.ops.bias_backward(dbias, dout, N, C, 0);
          r.out("dbias", dbias);
        },
        [=](const Result& got, const In& in) {
          const auto loss = [&](const std::vector<double>& b) {
            double l = 0;
            for (int64_t n = 0; n < N; ++n)
              for (int64_t c = 0; c < C; ++c) l += (in.wte[n * C + c] + b[c]) * in.dout[n * C + c];
            return l;
          };
          EXPECT_TRUE(
              all_close(got["dbias"], finite_difference(loss, std::vector<double>(C, 0.5)), 1e-6, 1e-6, "dbias"));
        });
  }

  // determinism = "layout": S token segments, each summed from zero in row order, then the
  // canonical tree over them, then added to dbias: against that definition written out serially,
  // on every setting (1 to 3 threads); and P parts of the rows with S / P segments each, combined
  // along the canonical tree over the parts, give the same bits (the sequence-parallel split).
  {
    const int64_t N = 64;
    for (int64_t C : {1, 37, 100}) {
      for (const int64_t S : {1, 2, 8}) {
        reg.add(
            {"BiasBackward", "LayoutTokenSegments", {"bias_backward"}, str("C=", C, " S=", S)},
            [=] { return randn(N * C, 13, "dout"); },
            [=](Run& r, const std::vector<float>& d) {
              const Buf<float> dout = r.in(d);
              Buf<float> dbias = r.zeros(C);
              r.ops.bias_backward(dbias, dout, N, C, S);
              r.out("dbias", dbias);
              for (int64_t P = 2; P <= S; P *= 2)
                for (int64_t p = 0; p < P; ++p) {
                  Buf<float> part = r.zeros(C);
                  r.ops.bias_backward(part, dout.p() + p * (N / P) * C, N / P, C, S / P);
                  r.out(str("P=", P, " part ", p), part);
                }
            },
            [=](const Result& got, const std::vector<float>& dout) {
              std::vector<float> want(C, 0.0f);
              std::vector<std::vector<float>> seg(S, std::vector<float>(C, 0.0f));
              const std::vector<int64_t> b = canonical_segments(N, S);
              for (int64_t k = 0; k < S; ++k)
                for (int64_t n = b[k]; n < b[k + 1]; ++n)
                  for (int64_t c = 0; c < C; ++c) seg[k][c] += dout[n * C + c];
              std::vector<const float*> leaves;
              for (const auto& v : seg) leaves.push_back(v.data());
              std::vector<float> tree(C), stack(tree_sum_stack(S) * C);
              tree_sum(tree.data(), leaves.data(), S, C, stack.data());
              for (int64_t c = 0; c < C; ++c) want[c] = 0.0f + tree[c];
              EXPECT_TRUE(bitwise_equal(got["dbias"], want, "dbias"));
              for (int64_t P = 2; P <= S; P *= 2) {
                std::vector<std::vector<float>> parts;
                std::vector<const float*> pl;
                for (int64_t p = 0; p < P; ++p) parts.push_back(got[str("P=", P, " part ", p)]);
                for (const auto& p : parts) pl.push_back(p.data());
                std::vector<float> sum(C), pstack(tree_sum_stack(P) * C);
                tree_sum(sum.data(), pl.data(), P, C, pstack.data());
                EXPECT_TRUE(bitwise_equal(sum, want, "dbias over " + std::to_string(P) + " parts"));
              }
            });
      }
    }
  }

  // add_positions: x row r = sum row r + wpe row p, p = positions[row0 + r] (positions null:
  // (row0 + r) % T), one fp32 addition; wpe null: sum row r's bits (-0 and a NaN payload kept).
  // Rows from row0 (a rank's rows of the batch), with positions that restart (packed documents).
  {
    struct Shape {
      int64_t row0, rows, T, C;
    };
    struct In {
      std::vector<float> sum, wpe;
      std::vector<int32_t> positions;
    };
    for (const Shape s : {Shape{0, 0, 4, 3}, Shape{0, 1, 1, 1}, Shape{3, 7, 5, 6}, Shape{11, 301, 16, 9}})
      for (const bool with_positions : {false, true})
        for (const bool with_wpe : {true, false}) {
          reg.add(
              {"Embedding",
               "AddPositionsAddsThePositionsRow",
               {"add_positions"},
               str("row0=", s.row0, " rows=", s.rows, " T=", s.T, " C=", s.C, with_positions ? " positions" : "",
                   with_wpe ? " wpe" : " wpe null")},
              [=] {
                In in{randn(s.rows * s.C, 14, "sum"), randn(s.T * s.C, 14, "wpe"), {}};
                for (int64_t i = 0; i < s.rows * s.C; i += 4) in.sum[i] = -0.0f;
                if (s.rows * s.C > 2) {
                  const uint32_t nan = 0x7fc01234u;
                  std::memcpy(&in.sum[2], &nan, 4);
                }
                // Documents of 3 tokens: positions 0, 1, 2, 0, 1, 2, ... (all below T)
                for (int64_t n = 0; n < s.row0 + s.rows; ++n)
                  in.positions.push_back(static_cast<int32_t>(n % std::min<int64_t>(3, s.T)));
                return in;
              },
              [=](Run& r, const In& in) {
                const Buf<float> sum = r.in(in.sum), wpe = r.in(in.wpe);
                const Buf<int32_t> positions = r.in(in.positions);
                Buf<float> x = r.in(randn(s.rows * s.C, 15, "x"));
                r.ops.add_positions(x, sum, with_wpe ? wpe.p() : nullptr, with_positions ? positions.p() : nullptr,
                                    s.row0, s.rows, s.T, s.C);
                r.out("x", x);
              },
              [=](const Result& got, const In& in) {
                std::vector<float> want(s.rows * s.C);
                std::vector<double> ref(s.rows * s.C);
                for (int64_t r = 0; r < s.rows; ++r) {
                  const int64_t n = s.row0 + r, p = with_positions ? in.positions[n] : n % s.T;
                  for (int64_t c = 0; c < s.C; ++c) {
                    const float a = in.sum[r * s.C + c];
                    want[r * s.C + c] = with_wpe ? a + in.wpe[p * s.C + c] : a;
                    ref[r * s.C + c] = with_wpe ? static_cast<double>(a) + in.wpe[p * s.C + c] : a;
                  }
                }
                const std::vector<float> x = got["x"];
                EXPECT_TRUE(bitwise_equal(x, want, "x"));
                // One correctly rounded addition: within half an ulp of the double sum (but the NaN).
                for (size_t i = 0; i < x.size(); ++i)
                  if (!std::isnan(ref[i])) {
                    EXPECT_NEAR(x[i], ref[i], 6e-8 * std::abs(ref[i])) << i;
                  }
              });
        }
  }
}

}  // namespace lockstep::harness
