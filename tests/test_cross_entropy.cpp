#include "lockstep/kernels/cpu/cross_entropy.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "lockstep/core/error.h"
#include "lockstep/core/thread_pool.h"
#include "testing.h"

namespace lockstep {
namespace {

using testing::all_close;
using testing::with_threads;
using testing::bitwise_equal;
using testing::random_ints;
using testing::randn;

// Double-precision reference: loss of one row, and its gradient scaled by grad_scale.
double ref_loss(const double* x, int64_t V, int32_t target) {
  if (target < 0) return 0.0;
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t v = 0; v < V; ++v) m = std::max(m, x[v]);
  double s = 0.0;
  for (int64_t v = 0; v < V; ++v) s += std::exp(x[v] - m);
  return m + std::log(s) - x[target];
}

std::vector<double> ref_losses(const std::vector<double>& x, const std::vector<int32_t>& targets,
                               int64_t V, int64_t ld) {
  std::vector<double> out(targets.size());
  for (size_t n = 0; n < targets.size(); ++n) out[n] = ref_loss(&x[n * ld], V, targets[n]);
  return out;
}

std::vector<double> ref_grad(const std::vector<double>& x, const std::vector<int32_t>& targets,
                             int64_t V, int64_t ld, double grad_scale) {
  std::vector<double> g(x.size(), 0.0);
  for (size_t n = 0; n < targets.size(); ++n) {
    if (targets[n] < 0) continue;
    const double* row = &x[n * ld];
    const double lse = ref_loss(row, V, targets[n]) + row[targets[n]];
    for (int64_t v = 0; v < V; ++v)
      g[n * ld + v] = (std::exp(row[v] - lse) - (v == targets[n])) * grad_scale;
  }
  return g;
}

// Columns [V, ld) of each row: the kernel must leave them alone.
std::vector<float> padding(const std::vector<float>& x, int64_t N, int64_t V, int64_t ld) {
  std::vector<float> p;
  for (int64_t n = 0; n < N; ++n) p.insert(p.end(), x.begin() + n * ld + V, x.begin() + (n + 1) * ld);
  return p;
}

TEST(CrossEntropy, ForwardMatchesReference) {
  // Single chunk with and without a vector body, exactly one chunk, a one-element second chunk,
  // and three chunks with a short tail.
  for (int64_t V : {1, 7, 40, 2048, 2049, 4100}) {
    SCOPED_TRACE(V);
    const int64_t N = 4, ld = V + 3;
    const auto logits = randn(N * ld, 10, "logits", 3.0f);
    auto targets = random_ints(N, V, 10, "targets");
    targets[2] = -1;
    std::vector<float> losses(N, -1.0f);
    cross_entropy_forward(losses.data(), logits.data(), targets.data(), N, V, ld);
    EXPECT_TRUE(all_close(losses, ref_losses(testing::to_double(logits), targets, V, ld), 1e-5,
                          1e-5, "losses"));
    EXPECT_EQ(losses[2], 0.0f);
  }
}

TEST(CrossEntropy, GradientMatchesFiniteDifferences) {
  const int64_t N = 3, V = 37, ld = 37;
  const float grad_scale = 0.25f;
  const auto x0 = randn(N * ld, 11, "logits", 2.0f);
  const std::vector<int32_t> targets = {5, -1, 36};
  auto logits = x0;
  std::vector<float> losses(N);
  cross_entropy_forward_backward(losses.data(), logits.data(), targets.data(), N, V, ld,
                                 grad_scale);
  const auto fd = testing::finite_difference(
      [&](const std::vector<double>& x) {
        double f = 0.0;
        for (double l : ref_losses(x, targets, V, ld)) f += grad_scale * l;
        return f;
      },
      testing::to_double(x0));
  EXPECT_TRUE(all_close(logits, fd, 1e-5, 1e-7, "dlogits"));
}

TEST(CrossEntropy, GradientMatchesReferenceAcrossChunks) {
  const int64_t N = 4, V = 2 * kXentChunk + 4, ld = V + 11;
  const float grad_scale = 1.0f / 3.0f;
  const auto x0 = randn(N * ld, 12, "logits", 4.0f);
  auto targets = random_ints(N, V, 12, "targets");
  targets[1] = static_cast<int32_t>(V - 1);  // the target in the last, short chunk
  std::vector<float> fwd_losses(N), losses(N);
  cross_entropy_forward(fwd_losses.data(), x0.data(), targets.data(), N, V, ld);
  auto logits = x0;
  cross_entropy_forward_backward(losses.data(), logits.data(), targets.data(), N, V, ld,
                                 grad_scale);
  const auto xd = testing::to_double(x0);
  EXPECT_TRUE(all_close(losses, ref_losses(xd, targets, V, ld), 1e-5, 1e-5, "losses"));
  EXPECT_TRUE(bitwise_equal(fwd_losses, losses, "forward vs forward_backward losses"));
  const auto ref = ref_grad(xd, targets, V, ld, grad_scale);
  for (int64_t n = 0; n < N; ++n) {
    EXPECT_TRUE(all_close(&logits[n * ld], &ref[n * ld], V, 1e-5, 1e-9, "dlogits row"));
  }
  EXPECT_TRUE(bitwise_equal(padding(logits, N, V, ld), padding(x0, N, V, ld), "padding"));
}

TEST(CrossEntropy, IgnoredTargetsGiveZeroLossAndGradient) {
  const int64_t N = 3, V = 50;
  auto logits = randn(N * V, 13, "logits");
  const std::vector<int32_t> targets = {-1, 3, -100};
  std::vector<float> losses(N, 9.0f);
  cross_entropy_forward_backward(losses.data(), logits.data(), targets.data(), N, V, V, 1.0f);
  EXPECT_EQ(losses[0], 0.0f);
  EXPECT_EQ(losses[2], 0.0f);
  EXPECT_GT(losses[1], 0.0f);
  for (int64_t v = 0; v < V; ++v) {
    EXPECT_EQ(logits[v], 0.0f);
    EXPECT_EQ(logits[2 * V + v], 0.0f);
  }
}

TEST(CrossEntropy, RejectsTargetOutsideVocabulary) {
  const int64_t N = 3, V = 20;
  const auto x0 = randn(N * V, 14, "logits");
  auto logits = x0;
  const std::vector<int32_t> targets = {1, 2, 20};
  std::vector<float> losses(N);
  try {
    cross_entropy_forward_backward(losses.data(), logits.data(), targets.data(), N, V, V, 1.0f);
    ADD_FAILURE() << "target 20 accepted";
  } catch (const UserError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("target 20"), std::string::npos) << msg;
    EXPECT_NE(msg.find("row 2"), std::string::npos) << msg;
  }
  EXPECT_TRUE(bitwise_equal(logits, x0, "logits changed before the error"));
  EXPECT_THROW(cross_entropy_forward(losses.data(), x0.data(), targets.data(), N, V, V), UserError);
}

// Masked logits (-inf), including a whole chunk of them, contribute exactly nothing.
TEST(CrossEntropy, MaskedLogits) {
  const int64_t N = 2, V = 2 * kXentChunk + 10;
  auto x0 = randn(N * V, 15, "logits");
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t v = kXentChunk; v < 2 * kXentChunk; ++v) x0[n * V + v] = ninf;
    x0[n * V + 3] = ninf;
  }
  const std::vector<int32_t> targets = {7, static_cast<int32_t>(V - 2)};
  auto logits = x0;
  std::vector<float> losses(N);
  cross_entropy_forward_backward(losses.data(), logits.data(), targets.data(), N, V, V, 1.0f);
  const auto xd = testing::to_double(x0);
  EXPECT_TRUE(all_close(losses, ref_losses(xd, targets, V, V), 1e-5, 1e-5, "losses"));
  const auto ref = ref_grad(xd, targets, V, V, 1.0);
  EXPECT_TRUE(all_close(logits, ref, 1e-5, 1e-9, "dlogits"));
  for (int64_t n = 0; n < N; ++n) EXPECT_EQ(logits[n * V + kXentChunk], 0.0f);
}

TEST(CrossEntropy, LargeLogitsAreStable) {
  const int64_t N = 2, V = 3000;
  auto x0 = randn(N * V, 16, "logits");
  for (float& x : x0) x += 1e4f;
  const std::vector<int32_t> targets = {0, 2999};
  auto logits = x0;
  std::vector<float> losses(N);
  cross_entropy_forward_backward(losses.data(), logits.data(), targets.data(), N, V, V, 1.0f);
  const auto xd = testing::to_double(x0);
  // Near 1e4 an fp32 logit carries about 1e-3 absolute error, which the loss inherits.
  EXPECT_TRUE(all_close(losses, ref_losses(xd, targets, V, V), 0.0, 2e-3, "losses"));
  EXPECT_TRUE(all_close(logits, ref_grad(xd, targets, V, V, 1.0), 1e-5, 1e-9, "dlogits"));
}

// An element in the vector body and one in the scalar tail with the same logit get the same
// gradient bits (vecmath's exp is identical in both forms).
TEST(CrossEntropy, VectorBodyAndTailAgree) {
  const int64_t V = 40;  // 32-element body, 8-element tail
  auto logits = randn(V, 17, "logits");
  for (int64_t i = 0; i < 8; ++i) logits[32 + i] = logits[i];
  const int32_t target = 20;
  float loss;
  cross_entropy_forward_backward(&loss, logits.data(), &target, 1, V, V, 0.5f);
  for (int64_t i = 0; i < 8; ++i) EXPECT_TRUE(bitwise_equal(&logits[i], &logits[32 + i], 1, "grad"));
}

TEST(CrossEntropy, BitwiseAcrossThreadCounts) {
  const int64_t N = 37, V = kXentChunk + 52, ld = V;
  const auto x0 = randn(N * ld, 18, "logits", 2.0f);
  auto targets = random_ints(N, V, 18, "targets");
  targets[5] = -1;
  std::vector<float> fwd[4], losses[4], grads[4];
  for (int threads = 1; threads <= 3; ++threads) {
    fwd[threads].assign(N, 0.0f);
    losses[threads].assign(N, 0.0f);
    grads[threads] = x0;
    with_threads(threads, [&] {
      cross_entropy_forward(fwd[threads].data(), x0.data(), targets.data(), N, V, ld);
      cross_entropy_forward_backward(losses[threads].data(), grads[threads].data(),
                                     targets.data(), N, V, ld, 1.0f / N);
    });
  }
  for (int threads = 2; threads <= 3; ++threads) {
    EXPECT_TRUE(bitwise_equal(fwd[1], fwd[threads], "forward losses"));
    EXPECT_TRUE(bitwise_equal(losses[1], losses[threads], "losses"));
    EXPECT_TRUE(bitwise_equal(grads[1], grads[threads], "dlogits"));
  }
}

// determinism = "layout": the canonical vocabulary segments (cross_entropy.h) against the double
// reference, with a vocabulary that S does not divide, ignored targets and masked logits, on 1 to 3
// threads bitwise. Across tensor-parallel shard counts: test_tensor_parallel.cpp.
TEST(CrossEntropy, LayoutSegmentsMatchReferenceAndThreads) {
  const int64_t N = 9, ld = kXentChunk + 70;
  for (const int64_t V : {int64_t{100}, kXentChunk + 61}) {
    for (const int64_t S : {1, 2, 8}) {
      auto x0 = randn(N * ld, 31, "logits", 3.0f);
      for (int64_t v = 0; v < V; v += 7) x0[2 * ld + v] = -std::numeric_limits<float>::infinity();
      auto targets = random_ints(N, V, 31, "targets");
      targets[4] = -1;
      targets[2] = 1;  // not a masked logit
      const auto xd = testing::to_double(x0);
      std::vector<double> ref_l = ref_losses(xd, targets, V, ld), ref_g = ref_grad(xd, targets, V, ld, 0.25);
      std::vector<float> losses[4], fwd[4], grads[4];
      for (int threads = 1; threads <= 3; ++threads) {
        losses[threads].assign(N, 1.0f);
        fwd[threads].assign(N, 1.0f);
        grads[threads] = x0;
        std::vector<float> scratch(3 * N), copy = x0;
        with_threads(threads, [&] {
          cross_entropy_segments(fwd[threads].data(), copy.data(), targets.data(), N, V, ld, S, false, 0.0f,
                                 scratch.data());
          cross_entropy_segments(losses[threads].data(), grads[threads].data(), targets.data(), N, V, ld, S, true,
                                 0.25f, scratch.data());
        });
        EXPECT_TRUE(bitwise_equal(copy, x0, "forward only leaves the logits alone"));
      }
      EXPECT_TRUE(all_close(losses[1].data(), ref_l.data(), N, 1e-5, 1e-5));
      std::vector<float> g(N * V);
      std::vector<double> gr(N * V);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t v = 0; v < V; ++v) {
          g[n * V + v] = grads[1][n * ld + v];
          gr[n * V + v] = ref_g[n * ld + v];
        }
      EXPECT_TRUE(all_close(g.data(), gr.data(), N * V, 1e-6, 1e-5));
      EXPECT_TRUE(bitwise_equal(padding(grads[1], N, V, ld), padding(x0, N, V, ld), "padding"));
      for (int threads = 1; threads <= 3; ++threads) {
        EXPECT_TRUE(bitwise_equal(fwd[threads], losses[1], "forward = forward-backward losses"));
        EXPECT_TRUE(bitwise_equal(losses[1], losses[threads], "losses"));
        EXPECT_TRUE(bitwise_equal(grads[1], grads[threads], "dlogits"));
      }
    }
  }
}

TEST(CrossEntropy, LayoutSegmentsRejectTargetOutsideVocabulary) {
  const int64_t N = 2, V = 16;
  auto x = randn(N * V, 3, "logits");
  const std::vector<int32_t> targets = {3, 16};
  std::vector<float> losses(N), scratch(3 * N);
  EXPECT_NE(testing::user_error_of([&] {
              cross_entropy_segments(losses.data(), x.data(), targets.data(), N, V, V, 4, true, 1.0f, scratch.data());
            }).find("target 16 at row 1"),
            std::string::npos);
}

}  // namespace
}  // namespace lockstep
