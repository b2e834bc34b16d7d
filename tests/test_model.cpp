// Whole-model checks on tiny models of each flavour: the backward pass against finite differences
// of the forward pass (one random direction per parameter tensor), the parameter table, that
// init is a pure function of (seed, parameter name), and the head's weight-gradient plan.
#include <gtest/gtest.h>

#include <functional>

#include <bit>
#include <cmath>

#include "lockstep/config/config.h"
#include "lockstep/core/hash.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/core/tree_sum.h"
#include "lockstep/model/gpt.h"
#include "model_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

ModelConfig tiny(const std::string& preset) { return testing::tiny_model(preset); }

struct Batch {
  std::vector<int32_t> tokens, targets;
};

Batch make_batch(int64_t n, int64_t V, uint64_t seed) {
  return {testing::random_ints(n, V, seed, "tokens"), testing::random_ints(n, V, seed, "targets")};
}

// For each parameter tensor p and a random unit direction d inside it, compares the analytic
// directional derivative <grad p, d> with the central difference (L(p + h d) - L(p - h d)) / 2h.
void check_gradients(const std::string& preset, bool add_qkv_bias = false,
                     const std::function<void(ModelConfig&)>& edit = {}) {
  ModelConfig m = tiny(preset);
  m.add_qkv_bias = add_qkv_bias;
  if (edit) edit(m);
  const int64_t B = 2;
  GPT model(m, B);
  ParamStore& ps = model.params();
  ps.init(7);
  const Batch batch = make_batch(B * m.seq_length, m.vocab_size, 3);
  ps.zero_grads();
  model.forward_backward(batch.tokens.data(), batch.targets.data(), 1.0f / static_cast<float>(B * m.seq_length));
  const std::vector<float> grad(ps.grads(), ps.grads() + ps.total());

  testing::for_each_directional_derivative(
      ps, grad, [&] { return model.evaluate(batch.tokens.data(), batch.targets.data()); },
      [&](const ParamSpec& p, double analytic, double numeric) {
        EXPECT_NEAR(analytic, numeric, 2e-3 * std::max(1.0, std::abs(numeric)) + 2e-4)
            << preset << " parameter " << p.name << " " << p.shape.to_string();
      });
}

TEST(ModelGradients, Gpt2FlavourMatchesFiniteDifferences) { check_gradients("gpt2"); }
TEST(ModelGradients, LlamaFlavourMatchesFiniteDifferences) { check_gradients("llama"); }
TEST(ModelGradients, LlamaWithQkvBiasMatchesFiniteDifferences) { check_gradients("llama", true); }
// Qwen3's attention: QK layernorm with a head size of its own (6, not hidden / heads = 4).
TEST(ModelGradients, QkLayernormWithItsOwnHeadSizeMatchesFiniteDifferences) {
  check_gradients("llama", false, [](ModelConfig& m) {
    m.qk_layernorm = true;
    m.kv_channels = 6;
  });
}
// Multi-head latent attention (model/mla.h) with and without query compression: 4 heads of query /
// key size 6 + 4 (RoPE) and value size 5, latents of rank 8 and 12.
TEST(ModelGradients, MultiLatentAttentionMatchesFiniteDifferences) {
  for (const int64_t q_lora : {0, 12})
    check_gradients("llama", false, [&](ModelConfig& m) {
      m.multi_latent_attention = true;
      m.num_query_groups = 0;
      m.q_lora_rank = q_lora;
      m.kv_lora_rank = 8;
      m.qk_head_dim = 6;
      m.qk_pos_emb_head_dim = 4;
      m.v_head_dim = 5;
    });
}

TEST(ModelGradients, SameWithTwoThreads) {
  const ModelConfig m = tiny("llama");
  std::vector<uint64_t> hashes;
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    ThreadPool::Bind bind(&pool);
    GPT model(m, 2);
    model.params().init(5);
    const Batch batch = make_batch(2 * m.seq_length, m.vocab_size, 9);
    model.params().zero_grads();
    model.forward_backward(batch.tokens.data(), batch.targets.data(), 0.1f);
    hashes.push_back(hash_floats(model.params().grads(), model.params().total()));
  }
  EXPECT_EQ(hashes[0], hashes[1]);
  EXPECT_EQ(hashes[0], hashes[2]);
}

TEST(ParamTable, FlavoursDeclareTheDocumentedParameters) {
  GPT gpt2(tiny("gpt2"), 1);
  EXPECT_GE(gpt2.params().find("embedding.position.weight"), 0);
  EXPECT_GE(gpt2.params().find("layers.1.attn.qkv.bias"), 0);
  EXPECT_GE(gpt2.params().find("final_norm.bias"), 0);
  EXPECT_LT(gpt2.params().find("output.weight"), 0);  // tied
  GPT llama(tiny("llama"), 1);
  const ParamStore& ps = llama.params();
  EXPECT_LT(ps.find("embedding.position.weight"), 0);
  EXPECT_LT(ps.find("layers.0.attn.qkv.bias"), 0);
  EXPECT_GE(ps.find("output.weight"), 0);
  const ParamSpec& qkv = ps.specs()[ps.find("layers.0.attn.qkv.weight")];
  EXPECT_EQ(qkv.shape, (Shape{(4 + 2 * 2) * 4, 16}));  // (NH + 2 NKV) * HS rows
  const ParamSpec& fc = ps.specs()[ps.find("layers.0.mlp.fc.weight")];
  EXPECT_EQ(fc.shape, (Shape{2 * 64, 16}));  // [gate | up], F = 8/3 * 16 rounded up to 64
  // model.add_qkv_bias (Qwen2): the QKV projection's bias only.
  ModelConfig qwen2 = tiny("llama");
  qwen2.add_qkv_bias = true;
  GPT with_bias(qwen2, 1);
  const ParamStore& qs = with_bias.params();
  ASSERT_GE(qs.find("layers.0.attn.qkv.bias"), 0);
  EXPECT_EQ(qs.specs()[qs.find("layers.0.attn.qkv.bias")].shape, (Shape{(4 + 2 * 2) * 4}));
  EXPECT_LT(qs.find("layers.0.attn.proj.bias"), 0);
  EXPECT_LT(qs.find("layers.0.mlp.fc.bias"), 0);
}

TEST(ParamTable, InitIsAPureFunctionOfSeedAndName) {
  ModelConfig a = tiny("gpt2");
  ModelConfig b = a;
  b.num_layers = 3;  // more parameters declared after layer 0's
  GPT ma(a, 1), mb(b, 1);
  ma.params().init(42);
  mb.params().init(42);
  const int ia = ma.params().find("layers.0.mlp.fc.weight"), ib = mb.params().find("layers.0.mlp.fc.weight");
  const int64_t n = ma.params().specs()[ia].shape.numel();
  EXPECT_TRUE(testing::bitwise_equal(ma.params().value(ia), mb.params().value(ib), n, "fc.weight"));
  GPT mc(a, 1);
  mc.params().init(43);
  EXPECT_NE(hash_floats(mc.params().value(ia), n), hash_floats(ma.params().value(ia), n));
}

}  // namespace
}  // namespace lockstep

namespace lockstep {
namespace {

// The head's weight-gradient plan with layout_token_segments (GPT::plan_head), over every row count,
// chunk size, segment count and piece size of a small range: the chunks tile the rows, each at most
// head_rows and ending on the last segment bound it holds; the steps tile each chunk; every segment
// is covered in order, either inside one block of 2^j whole segments of its piece, aligned (c a
// multiple of the count) and as large as the chunk allows, or in parts that accumulate from the
// second on; each piece's completed blocks tile its segments in order, the last one marked, a whole
// piece added in the product and never pushed; k_segments bounds exactly for the multi-segment and
// whole blocks.
TEST(HeadPlan, TilesTheRowsInAlignedBlocksOfEachPiecesSegments) {
  int64_t plans = 0;
  for (int64_t S : {1, 2, 4, 8, 16})
    for (int64_t per_piece = 1; per_piece <= S; per_piece *= 2)
      for (int64_t N = S; N <= 70; N += 3)
        for (int64_t head_rows = 1; head_rows <= N + 2; ++head_rows) {
          const std::vector<int64_t> wseg = canonical_segments(N, S);
          const auto at = [&](int64_t k) { return wseg[static_cast<size_t>(k)]; };
          const std::vector<GPT::HeadChunk> plan = GPT::plan_head(N, head_rows, wseg, per_piece);
          const std::string where = "N " + std::to_string(N) + " rows " + std::to_string(head_rows) + " S " +
                                    std::to_string(S) + " per piece " + std::to_string(per_piece);
          ++plans;
          int64_t r = 0, seg = 0, next_c = 0;  // rows planned, the segment being covered, its piece's next block
          for (size_t k = 0; k < plan.size(); ++k) {
            const GPT::HeadChunk& ch = plan[k];
            ASSERT_EQ(ch.r0, r) << where;
            ASSERT_GE(ch.rows, 1) << where;
            ASSERT_LE(ch.rows, head_rows) << where;
            const int64_t e = ch.r0 + ch.rows;
            if (k + 1 < plan.size()) {  // ends on the last bound in (r0, r0 + head_rows], if any
              int64_t last = -1;
              for (int64_t b : wseg)
                if (b > ch.r0 && b <= ch.r0 + head_rows) last = b;
              ASSERT_EQ(e, last > 0 ? last : ch.r0 + head_rows) << where;
            }
            int64_t b0 = ch.r0;
            for (const GPT::HeadStep& st : ch.steps) {
              ASSERT_EQ(st.b0, b0) << where;
              ASSERT_GT(st.end, st.b0) << where;
              ASSERT_LE(st.end, e) << where;
              ASSERT_LT(seg, S) << where;
              ASSERT_TRUE(b0 >= at(seg) && b0 < at(seg + 1)) << where << ": inside the segment being covered";
              ASSERT_EQ(st.piece, seg / per_piece) << where;
              ASSERT_EQ(st.c, seg % per_piece) << where;
              ASSERT_EQ(st.c, next_c) << where << ": blocks of a piece in order";
              const bool starts = b0 == at(seg);
              ASSERT_EQ(st.accumulate, !starts) << where;
              ASSERT_TRUE(std::has_single_bit(static_cast<uint64_t>(st.count))) << where;
              ASSERT_EQ(st.c % st.count, 0) << where << ": aligned";
              ASSERT_LE(st.c + st.count, per_piece) << where;
              if (starts && st.end == at(seg + st.count)) {
                // A block of whole segments, as large as the chunk allows.
                const int64_t twice = 2 * st.count;
                EXPECT_FALSE(st.c % twice == 0 && st.c + twice <= per_piece && at(seg + twice) <= e) << where;
              } else {
                ASSERT_EQ(st.count, 1) << where << ": a part of a segment";
                ASSERT_LE(st.end, at(seg + 1)) << where;
                ASSERT_TRUE(!starts || st.end < at(seg + 1)) << where;
                ASSERT_TRUE(st.end == at(seg + 1) || st.end == e) << where << ": a part runs to its chunk's end";
              }
              const bool done = st.end == at(seg + st.count);
              ASSERT_EQ(st.whole, starts && done && st.count == per_piece) << where;
              ASSERT_EQ(st.push, done && !st.whole) << where;
              ASSERT_EQ(st.last, st.c + st.count == per_piece) << where;
              if (st.whole || st.count > 1) {
                ASSERT_EQ(st.bounds.size(), static_cast<size_t>(st.count + 1)) << where;
                for (int64_t j = 0; j <= st.count; ++j)
                  ASSERT_EQ(st.bounds[static_cast<size_t>(j)], at(seg + j) - st.b0) << where;
              } else {
                ASSERT_TRUE(st.bounds.empty()) << where;
              }
              if (done) {
                next_c = (st.c + st.count) % per_piece;
                seg += st.count;
              }
              b0 = st.end;
            }
            ASSERT_EQ(b0, e) << where;
            r = e;
          }
          ASSERT_EQ(r, N) << where;
          ASSERT_EQ(seg, S) << where << ": every segment completed";
        }
  EXPECT_GT(plans, 1000);
}

}  // namespace
}  // namespace lockstep
