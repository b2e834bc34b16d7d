// Packed sequences with document boundaries (data/documents.h): the layout from the EOD token
// (Megatron's get_ltor_masks_and_position_ids), positions in the embedding and RoPE kernels, the
// whole model (two packed documents train like two separate sequences), eod_mask_loss and its
// normalisation by the step's unmasked tokens, and the config keys.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "lockstep/comm/communicator.h"
#include "lockstep/comm/threads/thread_transport.h"
#include "lockstep/config/config.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/data/documents.h"
#include "lockstep/data/indexed_dataset.h"
#include "lockstep/kernels/cpu/embedding.h"
#include "lockstep/kernels/cpu/rope.h"
#include "lockstep/model/gpt.h"
#include "lockstep/train/trainer.h"
#include "model_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

using testing::quiet_train;

constexpr int32_t kEod = 9;

TEST(Documents, LayoutRestartsAfterEachEod) {
  // Row 0: documents [0..2] (EOD at 2), [3], [4..5] (EOD at 3 and 5), then an unfinished one.
  // Row 1: no EOD at all. Row 2: EOD first and last.
  const std::vector<int32_t> tokens = {1,    2, kEod, kEod, 4, kEod, 5, 6,  //
                                       1,    2, 3,    4,    5, 6,    7, 8,  //
                                       kEod, 1, 2,    3,    4, 5,    6, kEod};
  std::vector<int32_t> pos(tokens.size()), ds(tokens.size());
  document_layout(pos.data(), ds.data(), tokens.data(), 3, 8, kEod);
  EXPECT_EQ(pos, (std::vector<int32_t>{0, 1, 2, 0, 0, 1, 0, 1,  //
                                       0, 1, 2, 3, 4, 5, 6, 7,  //
                                       0, 0, 1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(ds, (std::vector<int32_t>{0, 0, 0, 3, 4, 4, 6, 6,  //
                                      0, 0, 0, 0, 0, 0, 0, 0,  //
                                      0, 1, 1, 1, 1, 1, 1, 1}));
  std::vector<int32_t> targets(tokens.size(), 3);
  EXPECT_EQ(mask_eod_targets(targets.data(), tokens.data(), 24, kEod), 24 - 5);
  for (size_t i = 0; i < tokens.size(); ++i) EXPECT_EQ(targets[i], tokens[i] == kEod ? -1 : 3) << i;
}

TEST(Documents, EmbeddingWithPositions) {
  const int64_t B = 3, T = 11, C = 20, V = 13;
  const std::vector<int32_t> tokens = testing::random_ints(B * T, V, 1, "tokens");
  const std::vector<int32_t> positions = testing::random_ints(B * T, T, 1, "positions");
  const std::vector<float> wte = testing::randn(V * C, 1, "wte"), wpe = testing::randn(T * C, 1, "wpe");
  const std::vector<float> dout = testing::randn(B * T * C, 1, "dout");
  std::vector<float> out(B * T * C);
  embedding_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C, V, positions.data());
  std::vector<double> want(out.size()), want_dwpe(T * C, 0.0);
  for (int64_t n = 0; n < B * T; ++n)
    for (int64_t c = 0; c < C; ++c) {
      want[n * C + c] = wte[tokens[n] * C + c] + wpe[positions[n] * C + c];  // one float add
      want_dwpe[positions[n] * C + c] += dout[n * C + c];
    }
  EXPECT_TRUE(testing::all_close(out, want, 0, 0, "out"));
  std::vector<std::vector<float>> dwpe;
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    ThreadPool::Bind bind(&pool);
    std::vector<float> dwte(V * C, 0.0f), g(T * C, 0.0f);
    std::vector<int32_t> order(B * T);
    embedding_backward(dwte.data(), g.data(), order.data(), dout.data(), tokens.data(), B, T, C, positions.data());
    dwpe.push_back(g);
  }
  EXPECT_TRUE(testing::all_close(dwpe[0], want_dwpe, 1e-6, 1e-6, "dwpe"));
  EXPECT_TRUE(testing::bitwise_equal(dwpe[1], dwpe[0], "dwpe 2 threads"));
  EXPECT_TRUE(testing::bitwise_equal(dwpe[2], dwpe[0], "dwpe 3 threads"));
  // Positions t (what document_layout gives a row without EOD) reproduce the plain kernel.
  std::vector<int32_t> plain(B * T);
  for (int64_t n = 0; n < B * T; ++n) plain[n] = static_cast<int32_t>(n % T);
  std::vector<float> a(T * C, 0.0f), b(T * C, 0.0f), dwte(V * C, 0.0f);
  std::vector<int32_t> order(B * T);
  embedding_backward(dwte.data(), a.data(), order.data(), dout.data(), tokens.data(), B, T, C);
  embedding_backward(dwte.data(), b.data(), order.data(), dout.data(), tokens.data(), B, T, C, plain.data());
  EXPECT_TRUE(testing::bitwise_equal(b, a, "dwpe with positions t"));
}

TEST(Documents, RopeWithPositionsRotatesByTheGivenPosition) {
  const int64_t N = 10, T = 6, heads = 3, HS = 12, stride = 40, half = HS / 2;
  std::vector<float> cos(T * half), sin(T * half);
  rope_table(cos.data(), sin.data(), T, HS, 10000.0);
  const std::vector<int32_t> positions = testing::random_ints(N, T, 2, "positions");
  const std::vector<float> x = testing::randn(N * stride, 2, "x");
  for (bool backward : {false, true}) {
    std::vector<float> got = x, want = x;
    (backward ? rope_backward : rope_forward)(got.data(), cos.data(), sin.data(), N, T, heads, HS, stride,
                                              positions.data());
    // Row by row at position 0 of a table shifted to the row's position.
    for (int64_t n = 0; n < N; ++n)
      (backward ? rope_backward : rope_forward)(want.data() + n * stride, cos.data() + positions[n] * half,
                                                sin.data() + positions[n] * half, 1, 1, heads, HS, stride, nullptr);
    EXPECT_TRUE(testing::bitwise_equal(got, want, backward ? "backward" : "forward"));
  }
}

ModelConfig tiny(const std::string& preset, int64_t T) { return testing::tiny_model(preset, T); }

// Loss of each position alone: evaluate with every other target masked.
std::vector<double> per_token_losses(GPT& model, const std::vector<int32_t>& tokens,
                                     const std::vector<int32_t>& targets) {
  std::vector<double> out(targets.size(), 0.0);
  for (size_t i = 0; i < targets.size(); ++i) {
    if (targets[i] < 0) continue;
    std::vector<int32_t> one(targets.size(), -1);
    one[i] = targets[i];
    out[i] = model.evaluate(tokens.data(), one.data());
  }
  return out;
}

// Two documents packed into one sample with reset_attention_mask + reset_position_ids train like
// each document alone at the start of its own sample: same per-token losses, same gradients.
// The separate run pads each document with filler whose targets are masked (-1): causal
// attention keeps the filler out of the document's tokens, and masked targets give it no gradient.
void check_packed_equals_separate(const std::string& preset) {
  const int64_t T = 16, len_a = 7, len_b = T - len_a;
  const ModelConfig m = tiny(preset, T);
  const std::vector<int32_t> stream = testing::random_ints(T + 1, kEod, 4, "stream");  // no EOD in it
  std::vector<int32_t> tokens(stream.begin(), stream.begin() + T), targets(stream.begin() + 1, stream.end());
  tokens[len_a - 1] = kEod;  // document A = tokens 0..6, ended by its EOD
  targets[len_a - 2] = kEod;
  mask_eod_targets(targets.data(), tokens.data(), T, kEod);  // A's EOD does not predict B

  GPT packed(m, 1);
  packed.params().init(3);
  packed.set_documents(kEod, true, true);
  const float scale = 1.0f / static_cast<float>(count_targets(targets.data(), T));
  packed.params().zero_grads();
  packed.forward_backward(tokens.data(), targets.data(), scale);
  const std::vector<float> grad_packed(packed.params().grads(), packed.params().grads() + packed.params().total());
  const std::vector<double> loss_packed = per_token_losses(packed, tokens, targets);

  std::vector<int32_t> sep_tokens = testing::random_ints(2 * T, kEod, 5, "filler"), sep_targets(2 * T, -1);
  for (int64_t t = 0; t < len_a; ++t) sep_tokens[t] = tokens[t], sep_targets[t] = targets[t];
  for (int64_t t = 0; t < len_b; ++t) sep_tokens[T + t] = tokens[len_a + t], sep_targets[T + t] = targets[len_a + t];
  GPT separate(m, 2);
  separate.params().init(3);
  separate.params().zero_grads();
  separate.forward_backward(sep_tokens.data(), sep_targets.data(), scale);
  const std::vector<float> grad_sep(separate.params().grads(), separate.params().grads() + separate.params().total());
  const std::vector<double> loss_sep = per_token_losses(separate, sep_tokens, sep_targets);

  for (int64_t t = 0; t < T; ++t) {
    const double want = t < len_a ? loss_sep[t] : loss_sep[T + t - len_a];
    EXPECT_NEAR(loss_packed[t], want, 1e-5 * std::max(1.0, want)) << preset << " token " << t;
  }
  EXPECT_TRUE(testing::all_close(grad_packed, testing::to_double(grad_sep), 1e-4, 1e-6, preset + " grads"));

  // Without the document flags the packed sample is one sequence, and B's tokens see A's.
  GPT plain(m, 1);
  plain.params().init(3);
  const std::vector<double> loss_plain = per_token_losses(plain, tokens, targets);
  EXPECT_GT(std::abs(loss_plain[T - 1] - loss_packed[T - 1]), 1e-4) << preset;
}

TEST(Documents, ModelGradientsBitwiseAcrossThreadCounts) {
  const ModelConfig m = tiny("llama", 150);  // three attention blocks
  std::vector<int32_t> tokens = testing::random_ints(2 * 150, m.vocab_size, 13, "tokens");
  std::vector<int32_t> targets = testing::random_ints(2 * 150, m.vocab_size, 13, "targets");
  for (int64_t n : {5, 60, 70, 127, 128, 200, 299}) tokens[n] = kEod;
  const int64_t count = mask_eod_targets(targets.data(), tokens.data(), 2 * 150, kEod);
  std::vector<std::vector<float>> grads;
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    ThreadPool::Bind bind(&pool);
    GPT model(m, 2);
    model.params().init(5);
    model.set_documents(kEod, true, true);
    model.params().zero_grads();
    model.forward_backward(tokens.data(), targets.data(), 1.0f / static_cast<float>(count));
    grads.emplace_back(model.params().grads(), model.params().grads() + model.params().total());
  }
  EXPECT_TRUE(testing::bitwise_equal(grads[1], grads[0], "2 threads"));
  EXPECT_TRUE(testing::bitwise_equal(grads[2], grads[0], "3 threads"));
}

TEST(Documents, PackedDocumentsTrainLikeSeparateSequencesGpt2) { check_packed_equals_separate("gpt2"); }
TEST(Documents, PackedDocumentsTrainLikeSeparateSequencesLlama) { check_packed_equals_separate("llama"); }

// With masked targets the model's loss is the mean over the unmasked tokens, and forward_backward
// with grad_scale = 1 / their count gives that mean's gradient (finite differences).
TEST(Documents, MaskedLossIsTheMeanOverUnmaskedTokens) {
  const ModelConfig m = tiny("llama", 9);
  const int64_t B = 2, N = B * m.seq_length;
  GPT model(m, B);
  model.params().init(8);
  model.set_documents(kEod, true, true);
  std::vector<int32_t> tokens = testing::random_ints(N, m.vocab_size, 6, "tokens");
  std::vector<int32_t> targets = testing::random_ints(N, m.vocab_size, 6, "targets");
  for (int64_t n : {2, 3, 7, 12}) tokens[n] = kEod;
  const int64_t count = mask_eod_targets(targets.data(), tokens.data(), N, kEod);
  ASSERT_LT(count, N);
  const std::vector<double> each = per_token_losses(model, tokens, targets);
  double sum = 0;
  for (double x : each) sum += x;
  EXPECT_NEAR(model.evaluate(tokens.data(), targets.data()), sum / static_cast<double>(count), 1e-6);

  ParamStore& ps = model.params();
  ps.zero_grads();
  model.forward_backward(tokens.data(), targets.data(), 1.0f / static_cast<float>(count));
  for (const ParamSpec& p : ps.specs()) {
    const int64_t n = p.shape.numel();
    const std::vector<float> d = testing::randn(n, 12, "direction/" + p.name);
    double analytic = 0;
    for (int64_t i = 0; i < n; ++i) analytic += static_cast<double>(ps.grads()[p.offset + i]) * d[i];
    float* v = ps.values() + p.offset;
    const std::vector<float> saved(v, v + n);
    const double h = 1e-3;
    auto loss_at = [&](double s) {
      for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(saved[i] + s * d[i]);
      return model.evaluate(tokens.data(), targets.data());
    };
    const double numeric = (loss_at(h) - loss_at(-h)) / (2 * h);
    std::copy(saved.begin(), saved.end(), v);
    EXPECT_NEAR(analytic, numeric, 2e-3 * std::max(1.0, std::abs(numeric)) + 2e-4) << p.name;
  }
}

// Byte-tokenizer documents (EOD 256) of random lengths in an indexed dataset.
std::string write_documents(const testing::TempDir& dir) {
  const std::string prefix = dir.path("docs");
  IndexedDatasetWriter w(prefix, TokenDtype::uint16);
  const std::vector<int32_t> lengths = testing::random_ints(400, 40, 7, "lengths");
  const std::vector<int32_t> bytes = testing::random_ints(400 * 41, 256, 7, "bytes");
  for (size_t i = 0; i < lengths.size(); ++i) {
    std::vector<int32_t> doc(bytes.begin() + static_cast<int64_t>(i) * 41,
                             bytes.begin() + static_cast<int64_t>(i) * 41 + lengths[i] + 1);
    doc.push_back(256);
    w.add_document(doc.data(), static_cast<int64_t>(doc.size()));
  }
  w.finish();
  return prefix;
}

// The step's loss is the mean over its unmasked tokens, whatever the micro-batch split: one
// micro-batch of 4, four of 1 (each with its own count of EOD tokens), and the same global batch on
// 2 and 4 data-parallel ranks (the unmasked tokens are counted over the ranks), and context
// parallelism 2 (alone and with 2 data-parallel ranks: each rank's chunks hold a share of the
// documents, their positions and masks taken from the whole sequence) agree. A per-micro-batch or
// per-rank mean would not.
TEST(Documents, EodMaskLossNormalisesByTheStepsTokens) {
  testing::TempDir dir;
  const std::string prefix = write_documents(dir);
  std::vector<TrainSummary> runs;
  struct Layout {
    std::string micro;
    int ranks, cp;
  };
  for (const auto& [micro, ranks, cp] :
       {Layout{"4", 1, 1}, {"1", 1, 1}, {"2", 2, 1}, {"1", 4, 1}, {"4", 2, 2}, {"2", 4, 2}}) {
    const Config c = load_config(
        std::string(LOCKSTEP_SOURCE_DIR) + "/configs/debug.toml",
        {"data.source=indexed:" + prefix, "data.eod_token=256", "data.eod_mask_loss=true",
         "data.reset_position_ids=true", "data.reset_attention_mask=true", "model.vocab_size=259",
         "model.seq_length=32", "train.steps=3", "train.global_batch=4", std::string("train.micro_batch=") + micro,
         "train.eval_interval=0", ranks > 1 ? "train.threads=1" : "train.threads=2", str("parallel.context=", cp),
         "train.out_dir=" + dir.path(micro + std::to_string(ranks) + std::to_string(cp))});
    if (ranks == 1) {
      runs.push_back(quiet_train(c));
      continue;
    }
    std::FILE* sink = std::fopen("/dev/null", "w");
    run_threads(ranks, 60, [&](Communicator& comm) {
      const TrainSummary s = train(c, sink, comm);
      if (comm.rank() == 0) runs.push_back(s);
    });
    std::fclose(sink);
  }
  for (size_t k = 1; k < runs.size(); ++k) {
    EXPECT_NEAR(runs[0].first_loss, runs[k].first_loss, 1e-6 * runs[0].first_loss) << k;
    EXPECT_NEAR(runs[0].last_loss, runs[k].last_loss, 1e-5 * runs[0].last_loss) << k;
  }
}

TEST(Documents, FlagsNeedAnEndOfDocumentToken) {
  const std::string base = std::string(LOCKSTEP_SOURCE_DIR) + "/configs/debug.toml";
  for (const char* flag : {"data.reset_position_ids", "data.reset_attention_mask", "data.eod_mask_loss"}) {
    const std::string on = std::string(flag) + "=true";
    const std::string bytes = testing::user_error_of([&] { load_config(base, {on}); });
    EXPECT_NE(bytes.find(flag), std::string::npos) << bytes;
    EXPECT_NE(bytes.find("synthetic"), std::string::npos) << bytes;
    const std::string no_eod = testing::user_error_of([&] {
      load_config(base, {on, "data.source=indexed:x", "model.vocab_size=259"});
    });
    EXPECT_NE(no_eod.find(flag), std::string::npos) << no_eod;
    EXPECT_NE(no_eod.find("data.eod_token"), std::string::npos) << no_eod;
  }
  const std::string big = testing::user_error_of([&] {
    load_config(base, {"data.eod_token=256", "data.source=indexed:x", "model.vocab_size=256"});
  });
  EXPECT_NE(big.find("data.eod_token = 256"), std::string::npos) << big;
}

}  // namespace
}  // namespace lockstep
