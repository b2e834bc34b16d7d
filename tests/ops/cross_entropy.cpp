// Softmax cross-entropy (kernels/cross_entropy.h) on every backend: the fused forward-backward,
// the vocab-parallel pieces (shard log-sum-exp, combine, shard backward) and the canonical
// vocabulary segments of determinism = "layout" (whole and in shards), against the double
// reference, central differences, the whole-vocabulary bits and the thread settings.
#include <algorithm>
#include <cmath>
#include <limits>
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
using testing::randn;
using testing::random_ints;
using testing::to_double;

// Double-precision reference: loss of one row, and its gradient scaled by grad_scale.
double ref_loss(const double* x, int64_t V, int32_t target) {
  if (target < 0) return 0.0;
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t v = 0; v < V; ++v) m = std::max(m, x[v]);
  double s = 0.0;
  for (int64_t v = 0; v < V; ++v) s += std::exp(x[v] - m);
  return m + std::log(s) - x[target];
}

std::vector<double> ref_losses(const std::vector<double>& x, const std::vector<int32_t>& targets, int64_t V,
                               int64_t ld) {
  std::vector<double> out(targets.size());
  for (size_t n = 0; n < targets.size(); ++n) out[n] = ref_loss(&x[n * ld], V, targets[n]);
  return out;
}

std::vector<double> ref_grad(const std::vector<double>& x, const std::vector<int32_t>& targets, int64_t V, int64_t ld,
                             double grad_scale) {
  std::vector<double> g(x.size(), 0.0);
  for (size_t n = 0; n < targets.size(); ++n) {
    if (targets[n] < 0) continue;
    const double* row = &x[n * ld];
    const double lse = ref_loss(row, V, targets[n]) + row[targets[n]];
    for (int64_t v = 0; v < V; ++v) g[n * ld + v] = (std::exp(row[v] - lse) - (v == targets[n])) * grad_scale;
  }
  return g;
}

// Columns [V, ld) of each row: the kernel must leave them alone.
std::vector<float> padding(const std::vector<float>& x, int64_t N, int64_t V, int64_t ld) {
  std::vector<float> p;
  for (int64_t n = 0; n < N; ++n) p.insert(p.end(), x.begin() + n * ld + V, x.begin() + (n + 1) * ld);
  return p;
}

// The first V columns of each row (ld apart).
template <class T>
std::vector<T> columns(const std::vector<T>& x, int64_t N, int64_t V, int64_t ld) {
  std::vector<T> p;
  for (int64_t n = 0; n < N; ++n) p.insert(p.end(), x.begin() + n * ld, x.begin() + n * ld + V);
  return p;
}

struct In {
  std::vector<float> logits;
  std::vector<int32_t> targets;
};

// "losses" (cross_entropy_forward) and, with a grad scale, "fb losses" and "dlogits"
// (cross_entropy_forward_backward on a copy of the logits).
void forward_backward(Run& r, const In& in, int64_t N, int64_t V, int64_t ld, bool forward, bool backward,
                      float grad_scale, float loss_init = 0.0f) {
  const Buf<int32_t> targets = r.in(in.targets);
  if (forward) {
    const Buf<float> logits = r.in(in.logits);
    Buf<float> losses = r.full(N, loss_init);
    r.ops.cross_entropy_forward(losses, logits, targets, N, V, ld);
    r.out("losses", losses);
  }
  if (backward) {
    Buf<float> logits = r.in(in.logits), losses = r.full(N, loss_init);
    r.ops.cross_entropy_forward_backward(losses, logits, targets, N, V, ld, grad_scale);
    r.out("fb losses", losses);
    r.out("dlogits", logits);
  }
}

// The vocab-parallel pieces over shards [vb[p], vb[p + 1]) of the columns: every shard's stats,
// the combine, every shard's backward. Outputs "losses", "lse", "dlogits".
void sharded(Run& r, const In& in, int64_t N, int64_t V, int64_t ld, const std::vector<int64_t>& vb, float grad_scale) {
  const int64_t P = static_cast<int64_t>(vb.size()) - 1;
  const Buf<int32_t> targets = r.in(in.targets);
  Buf<float> logits = r.in(in.logits), stats = r.zeros(P * N * 3), losses = r.zeros(N), lse = r.zeros(N * 2);
  std::vector<Buf<float>> cmax;
  for (int64_t p = 0; p < P; ++p) {
    const int64_t Vl = vb[p + 1] - vb[p];
    cmax.push_back(r.zeros((Vl + kXentChunk - 1) / kXentChunk * N));
    r.ops.cross_entropy_shard_lse(stats.p() + p * N * 3, cmax.back(), logits.p() + vb[p], targets, N, Vl, ld, vb[p], V,
                                  true);
  }
  r.ops.cross_entropy_combine(losses, lse, stats, targets, N, P);
  for (int64_t p = 0; p < P; ++p)
    r.ops.cross_entropy_shard_backward(logits.p() + vb[p], cmax[p], lse, targets, N, vb[p + 1] - vb[p], ld, vb[p],
                                       grad_scale);
  r.out("stats", stats);
  r.out("losses", losses);
  r.out("lse", lse);
  r.out("dlogits", logits);
}

// The layout form in shards of whole subtrees of the S segments (P shards): the max and the
// segment sums per shard, reduced over the shards on the host (ReduceOp::max, ReduceOp::tree_sum),
// then the loss and every shard's backward. Outputs "losses", "dlogits".
void segment_shards(Run& r, const In& in, int64_t N, int64_t V, int64_t ld, int64_t S, int64_t P, float grad_scale) {
  std::vector<int64_t> vb;
  for (int64_t p = 0; p <= P; ++p) vb.push_back(p * (S / P) * V / S);
  const Buf<int32_t> targets = r.in(in.targets);
  Buf<float> logits = r.in(in.logits), losses = r.zeros(N);
  std::vector<float> rowmax(N, -std::numeric_limits<float>::infinity());
  for (int64_t p = 0; p < P; ++p) {
    Buf<float> m = r.zeros(N);
    r.ops.cross_entropy_segments_max(m, logits.p() + vb[p], targets, N, vb[p + 1] - vb[p], ld, V);
    const std::vector<float> mine = r.get(m);
    for (int64_t n = 0; n < N; ++n) rowmax[n] = std::max(rowmax[n], mine[n]);
  }
  const Buf<float> rowmax_d = r.in(rowmax);
  std::vector<std::vector<float>> parts;
  for (int64_t p = 0; p < P; ++p) {
    Buf<float> s = r.zeros(N * 2);
    r.ops.cross_entropy_segments_sum(s, logits.p() + vb[p], rowmax_d, targets, N, vb[p + 1] - vb[p], ld, vb[p], V, S,
                                     true);
    parts.push_back(r.get(s));
  }
  std::vector<const float*> leaves;
  for (const auto& p : parts) leaves.push_back(p.data());
  std::vector<float> stats(N * 2), stack(tree_sum_stack(P) * N * 2);
  tree_sum(stats.data(), leaves.data(), P, N * 2, stack.data());
  const Buf<float> stats_d = r.in(stats);
  r.ops.cross_entropy_segments_loss(losses, rowmax_d, stats_d, targets, N);
  for (int64_t p = 0; p < P; ++p)
    r.ops.cross_entropy_segments_backward(logits.p() + vb[p], stats_d, targets, N, vb[p + 1] - vb[p], ld, vb[p],
                                          grad_scale);
  r.out("losses", losses);
  r.out("dlogits", logits);
}

// cross_entropy_segments on the whole vocabulary: "losses" (backward) or "forward losses" and
// "logits after forward" (not).
void segments_whole(Run& r, const In& in, int64_t N, int64_t V, int64_t ld, int64_t S, bool backward,
                    float grad_scale) {
  const Buf<int32_t> targets = r.in(in.targets);
  Buf<float> logits = r.in(in.logits), losses = r.full(N, 1.0f), scratch = r.zeros(3 * N);
  r.ops.cross_entropy_segments(losses, logits, targets, N, V, ld, S, backward, grad_scale, scratch);
  r.out(backward ? "losses" : "forward losses", losses);
  r.out(backward ? "dlogits" : "logits after forward", logits);
}

}  // namespace

void add_cross_entropy_cases(Registry& reg) {
  // Single chunk with and without a vector body, exactly one chunk, a one-element second chunk,
  // and three chunks with a short tail.
  for (int64_t V : {1, 7, 40, 2048, 2049, 4100}) {
    const int64_t N = 4, ld = V + 3;
    reg.add(
        {"CrossEntropy", "ForwardMatchesReference", {"cross_entropy_forward"}, str("V=", V)},
        [=] {
          In in{randn(N * ld, 10, "logits", 3.0f), random_ints(N, V, 10, "targets")};
          in.targets[2] = -1;
          return in;
        },
        [=](Run& r, const In& in) { forward_backward(r, in, N, V, ld, true, false, 0.0f, -1.0f); },
        [=](const Result& got, const In& in) {
          EXPECT_TRUE(
              all_close(got["losses"], ref_losses(to_double(in.logits), in.targets, V, ld), 1e-5, 1e-5, "losses"));
          EXPECT_EQ(got["losses"][2], 0.0f);
        });
  }

  {
    const int64_t N = 3, V = 37, ld = 37;
    const float grad_scale = 0.25f;
    reg.add(
        {"CrossEntropy", "GradientMatchesFiniteDifferences", {"cross_entropy_forward_backward"}, str("V=", V)},
        [=] {
          return In{randn(N * ld, 11, "logits", 2.0f), {5, -1, 36}};
        },
        [=](Run& r, const In& in) { forward_backward(r, in, N, V, ld, false, true, grad_scale); },
        [=](const Result& got, const In& in) {
          const auto fd = testing::finite_difference(
              [&](const std::vector<double>& x) {
                double f = 0.0;
                for (double l : ref_losses(x, in.targets, V, ld)) f += grad_scale * l;
                return f;
              },
              to_double(in.logits));
          EXPECT_TRUE(all_close(got["dlogits"], fd, 1e-5, 1e-7, "dlogits"));
        });
  }

  {
    const int64_t N = 4, V = 2 * kXentChunk + 4, ld = V + 11;
    const float grad_scale = 1.0f / 3.0f;
    reg.add(
        {"CrossEntropy",
         "GradientMatchesReferenceAcrossChunks",
         {"cross_entropy_forward", "cross_entropy_forward_backward"},
         str("V=", V, " ld=", ld)},
        [=] {
          In in{randn(N * ld, 12, "logits", 4.0f), random_ints(N, V, 12, "targets")};
          in.targets[1] = static_cast<int32_t>(V - 1);  // the target in the last, short chunk
          return in;
        },
        [=](Run& r, const In& in) { forward_backward(r, in, N, V, ld, true, true, grad_scale); },
        [=](const Result& got, const In& in) {
          const auto xd = to_double(in.logits);
          EXPECT_TRUE(all_close(got["fb losses"], ref_losses(xd, in.targets, V, ld), 1e-5, 1e-5, "losses"));
          EXPECT_TRUE(bitwise_equal(got["losses"], got["fb losses"], "forward vs forward_backward losses"));
          const auto ref = ref_grad(xd, in.targets, V, ld, grad_scale);
          const std::vector<float> logits = got["dlogits"];
          for (int64_t n = 0; n < N; ++n) {
            EXPECT_TRUE(all_close(&logits[n * ld], &ref[n * ld], V, 1e-5, 1e-9, "dlogits row"));
          }
          EXPECT_TRUE(bitwise_equal(padding(logits, N, V, ld), padding(in.logits, N, V, ld), "padding"));
        });
  }

  {
    const int64_t N = 3, V = 50;
    reg.add(
        {"CrossEntropy", "IgnoredTargetsGiveZeroLossAndGradient", {"cross_entropy_forward_backward"}, str("V=", V)},
        [=] {
          return In{randn(N * V, 13, "logits"), {-1, 3, -100}};
        },
        [=](Run& r, const In& in) { forward_backward(r, in, N, V, V, false, true, 1.0f, 9.0f); },
        [=](const Result& got, const In&) {
          const std::vector<float> losses = got["fb losses"], logits = got["dlogits"];
          EXPECT_EQ(losses[0], 0.0f);
          EXPECT_EQ(losses[2], 0.0f);
          EXPECT_GT(losses[1], 0.0f);
          for (int64_t v = 0; v < V; ++v) {
            EXPECT_EQ(logits[v], 0.0f);
            EXPECT_EQ(logits[2 * V + v], 0.0f);
          }
        });
  }

  {
    const int64_t N = 3, V = 20;
    reg.add(
        {"CrossEntropy",
         "RejectsTargetOutsideVocabulary",
         {"cross_entropy_forward", "cross_entropy_forward_backward"},
         str("V=", V)},
        [=] {
          return In{randn(N * V, 14, "logits"), {1, 2, 20}};
        },
        [=](Run& r, const In& in) {
          const Buf<int32_t> targets = r.in(in.targets);
          Buf<float> logits = r.in(in.logits), losses = r.zeros(N);
          r.out_text("error", testing::user_error_of([&] {
                       r.ops.cross_entropy_forward_backward(losses, logits, targets, N, V, V, 1.0f);
                     }));
          r.out("logits", logits);
          r.out_text("forward error",
                     testing::user_error_of([&] { r.ops.cross_entropy_forward(losses, logits, targets, N, V, V); }));
        },
        [=](const Result& got, const In& in) {
          const std::string msg = got.text("error");
          EXPECT_NE(msg, "(no error)") << "target 20 accepted";
          EXPECT_NE(msg.find("target 20"), std::string::npos) << msg;
          EXPECT_NE(msg.find("row 2"), std::string::npos) << msg;
          EXPECT_TRUE(bitwise_equal(got["logits"], in.logits, "logits changed before the error"));
          EXPECT_NE(got.text("forward error"), "(no error)") << "forward: target 20 accepted";
        });
  }

  // Masked logits (-inf), including a whole chunk of them, contribute exactly nothing.
  {
    const int64_t N = 2, V = 2 * kXentChunk + 10;
    reg.add(
        {"CrossEntropy", "MaskedLogits", {"cross_entropy_forward_backward"}, str("V=", V)},
        [=] {
          In in{randn(N * V, 15, "logits"), {7, static_cast<int32_t>(V - 2)}};
          const float ninf = -std::numeric_limits<float>::infinity();
          for (int64_t n = 0; n < N; ++n) {
            for (int64_t v = kXentChunk; v < 2 * kXentChunk; ++v) in.logits[n * V + v] = ninf;
            in.logits[n * V + 3] = ninf;
          }
          return in;
        },
        [=](Run& r, const In& in) { forward_backward(r, in, N, V, V, false, true, 1.0f); },
        [=](const Result& got, const In& in) {
          const auto xd = to_double(in.logits);
          EXPECT_TRUE(all_close(got["fb losses"], ref_losses(xd, in.targets, V, V), 1e-5, 1e-5, "losses"));
          const std::vector<float> logits = got["dlogits"];
          EXPECT_TRUE(all_close(logits, ref_grad(xd, in.targets, V, V, 1.0), 1e-5, 1e-9, "dlogits"));
          for (int64_t n = 0; n < N; ++n) EXPECT_EQ(logits[n * V + kXentChunk], 0.0f);
        });
  }

  {
    const int64_t N = 2, V = 3000;
    reg.add(
        {"CrossEntropy", "LargeLogitsAreStable", {"cross_entropy_forward_backward"}, str("V=", V)},
        [=] {
          In in{randn(N * V, 16, "logits"), {0, 2999}};
          for (float& x : in.logits) x += 1e4f;
          return in;
        },
        [=](Run& r, const In& in) { forward_backward(r, in, N, V, V, false, true, 1.0f); },
        [=](const Result& got, const In& in) {
          const auto xd = to_double(in.logits);
          // Near 1e4 an fp32 logit carries about 1e-3 absolute error, which the loss inherits.
          EXPECT_TRUE(all_close(got["fb losses"], ref_losses(xd, in.targets, V, V), 0.0, 2e-3, "losses"));
          EXPECT_TRUE(all_close(got["dlogits"], ref_grad(xd, in.targets, V, V, 1.0), 1e-5, 1e-9, "dlogits"));
        });
  }

  // An element in the vector body and one in the scalar tail with the same logit get the same
  // gradient bits (vecmath's exp is identical in both forms).
  {
    const int64_t V = 40;  // 32-element body, 8-element tail
    reg.add(
        {"CrossEntropy", "VectorBodyAndTailAgree", {"cross_entropy_forward_backward"}, str("V=", V)},
        [=] {
          In in{randn(V, 17, "logits"), {20}};
          for (int64_t i = 0; i < 8; ++i) in.logits[32 + i] = in.logits[i];
          return in;
        },
        [=](Run& r, const In& in) { forward_backward(r, in, 1, V, V, false, true, 0.5f); },
        [=](const Result& got, const In&) {
          const std::vector<float> logits = got["dlogits"];
          for (int64_t i = 0; i < 8; ++i) EXPECT_TRUE(bitwise_equal(&logits[i], &logits[32 + i], 1, "grad"));
        });
  }

  // Every setting (1 to 3 threads) gives the same bits; against the double reference.
  {
    const int64_t N = 37, V = kXentChunk + 52, ld = V;
    reg.add(
        {"CrossEntropy",
         "BitwiseAcrossThreadCounts",
         {"cross_entropy_forward", "cross_entropy_forward_backward"},
         str("N=", N, " V=", V)},
        [=] {
          In in{randn(N * ld, 18, "logits", 2.0f), random_ints(N, V, 18, "targets")};
          in.targets[5] = -1;
          return in;
        },
        [=](Run& r, const In& in) { forward_backward(r, in, N, V, ld, true, true, 1.0f / N); },
        [=](const Result& got, const In& in) {
          const auto xd = to_double(in.logits);
          EXPECT_TRUE(all_close(got["losses"], ref_losses(xd, in.targets, V, ld), 1e-5, 1e-5, "forward losses"));
          EXPECT_TRUE(bitwise_equal(got["losses"], got["fb losses"], "forward vs forward_backward losses"));
          EXPECT_TRUE(all_close(got["dlogits"], ref_grad(xd, in.targets, V, ld, 1.0 / N), 1e-5, 1e-9, "dlogits"));
        });
  }

  // determinism = "layout": the canonical vocabulary segments (cross_entropy.h) against the double
  // reference, with a vocabulary that S does not divide, ignored targets and masked logits, on
  // every setting (1 to 3 threads) bitwise. In shards: below; across tensor-parallel shard counts:
  // test_tensor_parallel.cpp.
  {
    const int64_t N = 9, ld = kXentChunk + 70;
    for (const int64_t V : {int64_t{100}, kXentChunk + 61}) {
      for (const int64_t S : {1, 2, 8}) {
        reg.add(
            {"CrossEntropy",
             "LayoutSegmentsMatchReferenceAndThreads",
             {"cross_entropy_segments"},
             str("V=", V, " S=", S)},
            [=] {
              In in{randn(N * ld, 31, "logits", 3.0f), random_ints(N, V, 31, "targets")};
              for (int64_t v = 0; v < V; v += 7) in.logits[2 * ld + v] = -std::numeric_limits<float>::infinity();
              in.targets[4] = -1;
              in.targets[2] = 1;  // not a masked logit
              return in;
            },
            [=](Run& r, const In& in) {
              segments_whole(r, in, N, V, ld, S, false, 0.0f);
              segments_whole(r, in, N, V, ld, S, true, 0.25f);
            },
            [=](const Result& got, const In& in) {
              const auto xd = to_double(in.logits);
              const std::vector<double> ref_l = ref_losses(xd, in.targets, V, ld),
                                        ref_g = ref_grad(xd, in.targets, V, ld, 0.25);
              EXPECT_TRUE(
                  bitwise_equal(got["logits after forward"], in.logits, "forward only leaves the logits alone"));
              const std::vector<float> losses = got["losses"], grads = got["dlogits"];
              EXPECT_TRUE(all_close(losses.data(), ref_l.data(), N, 1e-5, 1e-5));
              const std::vector<float> g = columns(grads, N, V, ld);
              const std::vector<double> gr = columns(ref_g, N, V, ld);
              EXPECT_TRUE(all_close(g.data(), gr.data(), N * V, 1e-6, 1e-5));
              EXPECT_TRUE(bitwise_equal(padding(grads, N, V, ld), padding(in.logits, N, V, ld), "padding"));
              EXPECT_TRUE(bitwise_equal(got["forward losses"], losses, "forward = forward-backward losses"));
            });
      }
    }
  }

  {
    const int64_t N = 2, V = 16;
    reg.add(
        {"CrossEntropy", "LayoutSegmentsRejectTargetOutsideVocabulary", {"cross_entropy_segments"}, str("V=", V)},
        [=] {
          return In{randn(N * V, 3, "logits"), {3, 16}};
        },
        [=](Run& r, const In& in) {
          const Buf<int32_t> targets = r.in(in.targets);
          Buf<float> logits = r.in(in.logits), losses = r.zeros(N), scratch = r.zeros(3 * N);
          r.out_text("error", testing::user_error_of([&] {
                       r.ops.cross_entropy_segments(losses, logits, targets, N, V, V, 4, true, 1.0f, scratch);
                     }));
        },
        [=](const Result& got, const In&) {
          EXPECT_NE(got.text("error").find("target 16 at row 1"), std::string::npos) << got.text("error");
        });
  }

  // The vocab-parallel pieces: shards of whole kXentChunk chunks give the single-shard loss bits
  // (cross_entropy_forward's); uneven shards the reference's values. Stats hold each shard's
  // (max, sum) pair and its target logit (0 where the shard does not own it); the gradients are
  // the reference's; columns past V stay alone. Ignored targets and masked logits.
  {
    const int64_t N = 5, V = 3 * kXentChunk + 100, ld = V + 5;
    const std::vector<std::vector<int64_t>> splits = {
        {0, V}, {0, 2 * kXentChunk, V}, {0, kXentChunk, 2 * kXentChunk, V}, {0, 1000, 3000, 5000, V}};
    for (const auto& vb : splits) {
      reg.add(
          {"CrossEntropy",
           "VocabShardsCombineToTheWholeRow",
           {"cross_entropy_shard_lse", "cross_entropy_combine", "cross_entropy_shard_backward",
            "cross_entropy_forward"},
           str(vb.size() - 1, " shards, the second at ", vb[1])},
          [=] {
            In in{randn(N * ld, 41, "logits", 3.0f), random_ints(N, V, 41, "targets")};
            in.targets[1] = -1;
            in.targets[3] = static_cast<int32_t>(V - 1);
            for (int64_t v = 0; v < V; v += 5) in.logits[2 * ld + v] = -std::numeric_limits<float>::infinity();
            in.targets[2] = 3;
            return in;
          },
          [=](Run& r, const In& in) {
            sharded(r, in, N, V, ld, vb, 0.5f);
            const Buf<int32_t> targets = r.in(in.targets);
            const Buf<float> logits = r.in(in.logits);
            Buf<float> losses = r.zeros(N);
            r.ops.cross_entropy_forward(losses, logits, targets, N, V, ld);
            r.out("single-shard losses", losses);
          },
          [=](const Result& got, const In& in) {
            const auto xd = to_double(in.logits);
            EXPECT_TRUE(all_close(got["losses"], ref_losses(xd, in.targets, V, ld), 1e-5, 1e-5, "losses"));
            bool whole_chunks = true;
            for (int64_t b : vb) whole_chunks &= b % kXentChunk == 0 || b == V;
            if (whole_chunks) {
              EXPECT_TRUE(bitwise_equal(got["losses"], got["single-shard losses"], "losses vs one shard"));
            }
            const std::vector<float> stats = got["stats"], lse = got["lse"], grads = got["dlogits"];
            for (size_t p = 0; p + 1 < vb.size(); ++p)
              for (int64_t n = 0; n < N; ++n) {
                const int32_t t = in.targets[n];
                const bool owned = t >= vb[p] && t < vb[p + 1];
                EXPECT_EQ(stats[(p * N + n) * 3 + 2], owned ? in.logits[n * ld + t] : 0.0f)
                    << "shard " << p << " row " << n;
              }
            for (int64_t n = 0; n < N; ++n) {
              double m = -std::numeric_limits<double>::infinity(), s = 0;
              for (int64_t v = 0; v < V; ++v) m = std::max(m, xd[n * ld + v]);
              for (int64_t v = 0; v < V; ++v) s += std::exp(xd[n * ld + v] - m);
              EXPECT_NEAR(lse[n * 2] + std::log(static_cast<double>(lse[n * 2 + 1])), m + std::log(s),
                          1e-5 * std::abs(m) + 1e-5)
                  << "row " << n;
            }
            const std::vector<double> ref = ref_grad(xd, in.targets, V, ld, 0.5);
            EXPECT_TRUE(all_close(columns(grads, N, V, ld), columns(ref, N, V, ld), 1e-5, 1e-9, "dlogits"));
            EXPECT_TRUE(bitwise_equal(padding(grads, N, V, ld), padding(in.logits, N, V, ld), "padding"));
          });
    }
  }

  // The layout form in shards, each a whole subtree of the S segments: the per-shard max, segment
  // sums, loss and backward, reduced over the shards as the tensor-parallel group does, give the
  // whole-vocabulary call's bits (cross_entropy_segments), for every shard count; with V a multiple
  // of S and not (a shard then ends at a rounded-down bound s V / S, e.g. [0, 2086) of 4173 in 8
  // segments).
  for (const int64_t V : {2 * kXentChunk + 80, 2 * kXentChunk + 77}) {
    const int64_t N = 6, ld = V + 3, S = 8;
    for (const int64_t P : {1, 2, 4, 8}) {
      reg.add(
          {"CrossEntropy",
           "LayoutSegmentShardsGiveTheWholeVocabularysBits",
           {"cross_entropy_segments_max", "cross_entropy_segments_sum", "cross_entropy_segments_loss",
            "cross_entropy_segments_backward", "cross_entropy_segments"},
           str("V=", V, " S=", S, " P=", P)},
          [=] {
            In in{randn(N * ld, 43, "logits", 3.0f), random_ints(N, V, 43, "targets")};
            in.targets[0] = -1;
            in.targets[4] = static_cast<int32_t>(V - 1);
            for (int64_t v = 1; v < V; v += 3) in.logits[3 * ld + v] = -std::numeric_limits<float>::infinity();
            in.targets[3] = 0;
            return in;
          },
          [=](Run& r, const In& in) {
            segment_shards(r, in, N, V, ld, S, P, 0.125f);
            Run whole(r.backend, r.device);
            segments_whole(whole, in, N, V, ld, S, true, 0.125f);
            r.out("whole losses", whole.result["losses"]);
            r.out("whole dlogits", whole.result["dlogits"]);
          },
          [=](const Result& got, const In& in) {
            EXPECT_TRUE(bitwise_equal(got["losses"], got["whole losses"], "losses"));
            EXPECT_TRUE(bitwise_equal(got["dlogits"], got["whole dlogits"], "dlogits"));
            const auto xd = to_double(in.logits);
            EXPECT_TRUE(all_close(got["losses"], ref_losses(xd, in.targets, V, ld), 1e-5, 1e-5, "losses"));
          });
    }
  }

  // The sharded forms' gradients against central differences of the double loss: the
  // vocab-parallel pieces over uneven shards, the layout form over 2 shards of 4 segments, and the
  // layout form on the whole vocabulary.
  {
    const int64_t N = 3, V = 40, ld = 42;
    const float grad_scale = 0.25f;
    const std::vector<std::string> ops[] = {
        {"cross_entropy_shard_lse", "cross_entropy_combine", "cross_entropy_shard_backward"},
        {"cross_entropy_segments_max", "cross_entropy_segments_sum", "cross_entropy_segments_loss",
         "cross_entropy_segments_backward"},
        {"cross_entropy_segments"}};
    const char* labels[] = {"shards [0, 10) [10, 40)", "layout, 2 shards of 4 segments", "layout, 8 segments, whole"};
    for (int form = 0; form < 3; ++form) {
      reg.add(
          {"CrossEntropy", "ShardedGradientsMatchFiniteDifferences", ops[form], labels[form]},
          [=] {
            return In{randn(N * ld, 45, "logits", 2.0f), {5, -1, 39}};
          },
          [=](Run& r, const In& in) {
            if (form == 0)
              sharded(r, in, N, V, ld, {0, 10, V}, grad_scale);
            else if (form == 1)
              segment_shards(r, in, N, V, ld, 8, 2, grad_scale);
            else
              segments_whole(r, in, N, V, ld, 8, true, grad_scale);
          },
          [=](const Result& got, const In& in) {
            const auto fd = testing::finite_difference(
                [&](const std::vector<double>& x) {
                  double f = 0.0;
                  for (double l : ref_losses(x, in.targets, V, ld)) f += grad_scale * l;
                  return f;
                },
                to_double(in.logits));
            EXPECT_TRUE(all_close(columns(got["dlogits"], N, V, ld), columns(fd, N, V, ld), 1e-5, 1e-7, "dlogits"));
          });
    }
  }
}

}  // namespace lockstep::harness
