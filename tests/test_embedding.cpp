#include "lockstep/kernels/cpu/embedding.h"

#include <string>
#include <vector>

#include "lockstep/core/error.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/core/tree_sum.h"
#include "testing.h"

namespace lockstep {
namespace {

using testing::bitwise_equal;
using testing::random_ints;
using testing::with_threads;
using testing::randn;

TEST(Embedding, ForwardMatchesReference) {
  const int64_t B = 2, T = 5, C = 13, V = 11;
  const auto tokens = random_ints(B * T, V, 1, "tokens");
  const auto wte = randn(V * C, 1, "wte"), wpe = randn(T * C, 1, "wpe");
  for (bool positions : {true, false}) {
    std::vector<float> out(B * T * C);
    embedding_forward(out.data(), tokens.data(), wte.data(), positions ? wpe.data() : nullptr, B,
                      T, C, V);
    std::vector<double> ref(out.size());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t c = 0; c < C; ++c) {
          double r = wte[tokens[b * T + t] * C + c];
          if (positions) r += wpe[t * C + c];
          ref[(b * T + t) * C + c] = r;
        }
    // One float addition is correctly rounded: the result is exact up to that rounding.
    EXPECT_TRUE(testing::all_close(out, ref, 6e-8, 0.0, "out"));
  }
}

TEST(Embedding, ForwardRejectsTokenOutsideVocabulary) {
  const int64_t B = 2, T = 3, C = 4, V = 10;
  const auto wte = randn(V * C, 2, "wte");
  for (int32_t bad : {10, -1, 12345}) {
    std::vector<int32_t> tokens = {1, 2, 3, 4, bad, 5};
    std::vector<float> out(B * T * C, 7.0f);
    try {
      embedding_forward(out.data(), tokens.data(), wte.data(), nullptr, B, T, C, V);
      ADD_FAILURE() << "token " << bad << " accepted";
    } catch (const UserError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("token " + std::to_string(bad)), std::string::npos) << msg;
      EXPECT_NE(msg.find("position 4"), std::string::npos) << msg;
    }
    for (float x : out) EXPECT_EQ(x, 7.0f) << "output written before the error";
  }
}

// The backward is linear in dout: compare with the direct sum, computed in double.
TEST(Embedding, BackwardMatchesReferenceSum) {
  const int64_t B = 3, T = 7, C = 19, V = 6;  // 21 positions over 6 tokens: many repeats
  const auto tokens = random_ints(B * T, V, 3, "tokens");
  const auto dout = randn(B * T * C, 3, "dout");
  auto dwte = randn(V * C, 3, "dwte0"), dwpe = randn(T * C, 3, "dwpe0");
  std::vector<double> ref_wte = testing::to_double(dwte), ref_wpe = testing::to_double(dwpe);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < C; ++c) {
        ref_wte[tokens[b * T + t] * C + c] += dout[(b * T + t) * C + c];
        ref_wpe[t * C + c] += dout[(b * T + t) * C + c];
      }
  std::vector<int32_t> order(B * T);
  embedding_backward(dwte.data(), dwpe.data(), order.data(), dout.data(), tokens.data(), B, T, C);
  EXPECT_TRUE(testing::all_close(dwte, ref_wte, 1e-6, 1e-6, "dwte"));
  EXPECT_TRUE(testing::all_close(dwpe, ref_wpe, 1e-6, 1e-6, "dwpe"));
}

// The documented order - each row accumulated in position order, dwpe in b order - is the order of
// the plain serial loop, so the result must equal that loop bit for bit.
TEST(Embedding, BackwardSumsInPositionOrder) {
  const int64_t B = 4, T = 9, C = 21, V = 5;
  const auto tokens = random_ints(B * T, V, 4, "tokens");
  const auto dout = randn(B * T * C, 4, "dout", 3.0f);
  auto dwte = randn(V * C, 4, "dwte0"), dwpe = randn(T * C, 4, "dwpe0");
  auto serial_wte = dwte, serial_wpe = dwpe;
  for (int64_t n = 0; n < B * T; ++n)
    for (int64_t c = 0; c < C; ++c) {
      serial_wte[tokens[n] * C + c] += dout[n * C + c];
      serial_wpe[(n % T) * C + c] += dout[n * C + c];
    }
  std::vector<int32_t> order(B * T);
  with_threads(2, [&] {
    embedding_backward(dwte.data(), dwpe.data(), order.data(), dout.data(), tokens.data(), B, T,
                       C);
  });
  EXPECT_TRUE(bitwise_equal(dwte, serial_wte, "dwte"));
  EXPECT_TRUE(bitwise_equal(dwpe, serial_wpe, "dwpe"));
}

struct TokenCase {
  const char* name;
  std::vector<int32_t> tokens;
};

TEST(Embedding, BitwiseAcrossThreadCounts) {
  const int64_t B = 4, T = 50, C = 37, V = 300;
  std::vector<TokenCase> cases;
  cases.push_back({"uniform", random_ints(B * T, V, 5, "tokens")});
  cases.push_back({"all one token", std::vector<int32_t>(B * T, 17)});
  std::vector<int32_t> skewed = random_ints(B * T, V, 6, "tokens");
  for (size_t i = 0; i < skewed.size(); ++i) skewed[i] = skewed[i] % 3 == 0 ? 42 : skewed[i] % 4;
  cases.push_back({"four tokens and one frequent one", skewed});

  const auto wte = randn(V * C, 5, "wte"), wpe = randn(T * C, 5, "wpe");
  const auto dout = randn(B * T * C, 5, "dout");
  for (const auto& tc : cases) {
    SCOPED_TRACE(tc.name);
    std::vector<float> out[4], dwte[4], dwpe[4];
    for (int threads = 1; threads <= 3; ++threads) {
      out[threads].assign(B * T * C, 0.0f);
      dwte[threads] = randn(V * C, 7, "dwte0");
      dwpe[threads] = randn(T * C, 7, "dwpe0");
      std::vector<int32_t> order(B * T);
      with_threads(threads, [&] {
        embedding_forward(out[threads].data(), tc.tokens.data(), wte.data(), wpe.data(), B, T, C,
                          V);
        embedding_backward(dwte[threads].data(), dwpe[threads].data(), order.data(), dout.data(),
                           tc.tokens.data(), B, T, C);
      });
    }
    for (int threads = 2; threads <= 3; ++threads) {
      EXPECT_TRUE(bitwise_equal(out[1], out[threads], "out"));
      EXPECT_TRUE(bitwise_equal(dwte[1], dwte[threads], "dwte"));
      EXPECT_TRUE(bitwise_equal(dwpe[1], dwpe[threads], "dwpe"));
    }
  }
}

TEST(Embedding, BackwardWithoutPositions) {
  const int64_t B = 2, T = 3, C = 5;
  const std::vector<int32_t> tokens = {2, 0, 2, 2, 1, 0};
  const auto dout = randn(B * T * C, 8, "dout");
  std::vector<float> dwte(3 * C, 0.0f);
  std::vector<int32_t> order(B * T);
  embedding_backward(dwte.data(), nullptr, order.data(), dout.data(), tokens.data(), B, T, C);
  for (int64_t c = 0; c < C; ++c) {
    EXPECT_EQ(dwte[0 * C + c], (0.0f + dout[1 * C + c]) + dout[5 * C + c]);
    EXPECT_EQ(dwte[1 * C + c], 0.0f + dout[4 * C + c]);
    EXPECT_EQ(dwte[2 * C + c], ((0.0f + dout[0 * C + c]) + dout[2 * C + c]) + dout[3 * C + c]);
  }
}

TEST(BiasBackward, MatchesReferenceAndRowOrder) {
  for (int64_t C : {1, 15, 16, 37, 100}) {
    SCOPED_TRACE(C);
    const int64_t N = 29;
    const auto dout = randn(N * C, 9, "dout");
    const auto dbias0 = randn(C, 9, "dbias0");
    std::vector<double> ref = testing::to_double(dbias0);
    auto serial = dbias0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < C; ++c) {
        ref[c] += dout[n * C + c];
        serial[c] += dout[n * C + c];
      }
    for (int threads = 1; threads <= 3; ++threads) {
      auto dbias = dbias0;
      with_threads(threads, [&] { bias_backward(dbias.data(), dout.data(), N, C); });
      EXPECT_TRUE(testing::all_close(dbias, ref, 1e-5, 1e-5, "dbias"));
      EXPECT_TRUE(bitwise_equal(dbias, serial, "dbias vs serial row order"));
    }
  }
}

// determinism = "layout": S token segments, each summed from zero in row order, then the canonical
// tree over them, then added to dbias: against that definition written out serially, on 1 to 3
// threads; and P parts of the rows with S / P segments each, combined along the canonical tree over
// the parts, give the same bits (the sequence-parallel split).
TEST(BiasBackward, LayoutTokenSegments) {
  const int64_t N = 64;
  for (int64_t C : {1, 37, 100}) {
    const auto dout = randn(N * C, 13, "dout");
    for (const int64_t S : {1, 2, 8}) {
      SCOPED_TRACE(::testing::Message() << "C=" << C << " S=" << S);
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
      for (int threads = 1; threads <= 3; ++threads) {
        std::vector<float> dbias(C, 0.0f);
        with_threads(threads, [&] { bias_backward(dbias.data(), dout.data(), N, C, S); });
        EXPECT_TRUE(bitwise_equal(dbias, want, "dbias"));
      }
      for (int64_t P = 2; P <= S; P *= 2) {
        std::vector<std::vector<float>> parts(P, std::vector<float>(C, 0.0f));
        std::vector<const float*> pl;
        for (int64_t p = 0; p < P; ++p) {
          bias_backward(parts[p].data(), dout.data() + p * (N / P) * C, N / P, C, S / P);
          pl.push_back(parts[p].data());
        }
        std::vector<float> sum(C), pstack(tree_sum_stack(P) * C);
        tree_sum(sum.data(), pl.data(), P, C, pstack.data());
        EXPECT_TRUE(bitwise_equal(sum, want, "dbias over " + std::to_string(P) + " parts"));
      }
    }
  }
}

// layout_token_segments: the word and position embeddings' gradients in S token segments: each
// row's segment sums from zero in row order, the tree over the S segments (empty ones are zero
// leaves), added to the row; bitwise against that definition on 1 to 3 threads, with and without
// explicit positions, and close to the double sum.
TEST(Embedding, BackwardInTokenSegments) {
  const int64_t B = 2, T = 24, C = 20, V = 7, N = B * T;
  const auto tokens = random_ints(N, V, 5, "tokens");
  const auto positions = random_ints(N, T, 6, "positions");
  const auto dout = randn(N * C, 7, "dout");
  for (const int64_t S : {2, 8}) {
    for (const bool with_pos : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "S=" << S << " positions=" << with_pos);
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
                  seg[k][c] += dout[n * C + c];
                  ref[v * C + c] += dout[n * C + c];
                }
          std::vector<const float*> leaves;
          for (const auto& l : seg) leaves.push_back(l.data());
          std::vector<float> tree(C), stack(tree_sum_stack(S) * C);
          tree_sum(tree.data(), leaves.data(), S, C, stack.data());
          bool touched = false;
          for (int64_t n = 0; n < N; ++n) touched |= key(n) == v;
          for (int64_t c = 0; c < C; ++c) out[v * C + c] = touched ? 0.0f + tree[c] : 0.0f;
        }
        EXPECT_TRUE(testing::all_close(out, ref, 1e-5, 1e-6, "vs double"));
        return out;
      };
      const auto wte = want([&](int64_t n) { return tokens[n]; }, V);
      const auto wpe = want([&](int64_t n) { return with_pos ? positions[n] : n % T; }, T);
      for (int threads = 1; threads <= 3; ++threads) {
        std::vector<float> dwte(V * C, 0.0f), dwpe(T * C, 0.0f);
        std::vector<int32_t> order(N);
        with_threads(threads, [&] {
          embedding_backward(dwte.data(), dwpe.data(), order.data(), dout.data(), tokens.data(), B, T, C,
                             with_pos ? positions.data() : nullptr, T, S, S);
        });
        EXPECT_TRUE(bitwise_equal(dwte, wte, "dwte"));
        EXPECT_TRUE(bitwise_equal(dwpe, wpe, "dwpe"));
      }
    }
  }
}

}  // namespace
}  // namespace lockstep
