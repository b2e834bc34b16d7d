// GPT-style sampling from indexed datasets: samples follow the shuffled document stream across
// document boundaries, the stream is a pure function of the sample index (a restart anywhere
// continues it exactly), blends keep their weights, splits round like Megatron's, and a token
// outside the vocabulary is a one-line error naming the file.
#include <gtest/gtest.h>

#include <set>

#include "lockstep/config/config.h"
#include "lockstep/core/error.h"
#include "lockstep/data/dataset.h"
#include "lockstep/data/gpt_dataset.h"
#include "lockstep/data/indexed_dataset.h"
#include "testing.h"

namespace lockstep {
namespace {

using testing::TempDir;

constexpr auto error_of = testing::user_error_of;

// Document d holds tokens base + d*100 + 0, 1, ..., so every token names its document and place.
void write_docs(const std::string& prefix, int docs, int base) {
  IndexedDatasetWriter w(prefix, TokenDtype::uint16);
  for (int d = 0; d < docs; ++d) {
    std::vector<int32_t> t(static_cast<size_t>(3 + (d * 7) % 11));
    for (size_t i = 0; i < t.size(); ++i) t[i] = base + d * 100 + static_cast<int32_t>(i);
    w.add_document(t.data(), static_cast<int64_t>(t.size()));
  }
  w.finish();
}

TEST(DataSampling, SplitRoundsLikeMegatron) {
  auto ranges = [](const std::string& s, int64_t n) {
    std::vector<std::pair<int64_t, int64_t>> v;
    for (DocRange r : split_documents(s, n)) v.emplace_back(r.begin, r.end);
    return v;
  };
  EXPECT_EQ(ranges("98,2", 100), (std::vector<std::pair<int64_t, int64_t>>{{0, 98}, {98, 100}}));
  EXPECT_EQ(ranges("969,30,1", 1000), (std::vector<std::pair<int64_t, int64_t>>{{0, 969}, {969, 999}, {999, 1000}}));
  // 3.33 rounds to 3 each; the missing document shifts every boundary after the first.
  EXPECT_EQ(ranges("1,1,1", 10), (std::vector<std::pair<int64_t, int64_t>>{{0, 4}, {4, 7}, {7, 10}}));
  for (const char* bad : {"98", "a,b", "1,2,3,4", "0,0", "-1,2", "98;2"})
    EXPECT_NE(error_of([&] { split_documents(bad, 10); }).find("data.split"), std::string::npos) << bad;
}

TEST(DataSampling, SamplesFollowTheShuffledDocumentStream) {
  TempDir dir;
  write_docs(dir.path("a"), 40, 0);
  auto ds = std::make_shared<const IndexedDataset>(dir.path("a"));
  const int64_t T = 7;
  const GptSampler s(ds, {0, 38}, T, 65536, 5, "train");
  EXPECT_EQ(s.samples_per_epoch(), (s.tokens() - 1) / T);
  const auto S = static_cast<uint64_t>(s.samples_per_epoch());
  std::vector<int32_t> x(T + 1);
  std::set<int32_t> firsts;
  std::vector<int32_t> epoch0_first, epoch1_first;
  for (uint64_t j = 0; j < 2 * S; ++j) {
    s.sample(x.data(), j);
    for (int64_t t = 0; t < T; ++t) {
      // Next token: the next one of the same document, or the first of another document.
      const bool same_doc = x[t + 1] == x[t] + 1 && x[t + 1] / 100 == x[t] / 100;
      EXPECT_TRUE(same_doc || x[t + 1] % 100 == 0) << "sample " << j << " t " << t;
      EXPECT_LT(x[t] / 100, 38) << "a valid-split document in a train sample";
    }
    if (j < S) firsts.insert(x[0] * 1000 + x[1]);
    (j < S ? epoch0_first : epoch1_first).push_back(x[0]);
  }
  EXPECT_EQ(firsts.size(), S) << "an epoch visits each sample once";
  EXPECT_NE(epoch0_first, epoch1_first) << "each epoch has its own order";
  // A pure function of (seed, index): another sampler agrees, another seed does not.
  const GptSampler same(ds, {0, 38}, T, 65536, 5, "train"), other(ds, {0, 38}, T, 65536, 6, "train");
  std::vector<int32_t> y(T + 1), z(T + 1);
  int differ = 0;
  for (uint64_t j = 0; j < S; ++j) {
    s.sample(x.data(), j);
    same.sample(y.data(), j);
    other.sample(z.data(), j);
    EXPECT_EQ(x, y);
    differ += x != z;
  }
  EXPECT_GT(differ, 0);
}

TEST(DataSampling, BlendKeepsEveryPrefixWithinOneSampleOfTheWeights) {
  const BlendSchedule blend({0.7, 0.2, 0.1});
  std::vector<uint64_t> counts(3, 0);
  for (uint64_t i = 0; i < 5000; ++i) {
    uint64_t local = 0;
    const int d = blend.pick(i, &local);
    EXPECT_EQ(local, counts[d]) << "each dataset's samples are taken in order";
    ++counts[d];
    const double w[3] = {0.7, 0.2, 0.1};
    for (int k = 0; k < 3; ++k) EXPECT_LE(std::abs(static_cast<double>(counts[k]) - w[k] * (i + 1)), 1.0) << i;
  }
  // Seeking (backwards, across snapshots, and forwards) gives the same answers.
  const BlendSchedule fresh({0.7, 0.2, 0.1});
  for (uint64_t i : {4999ull, 3ull, 70000ull, 65535ull, 65536ull, 131073ull, 2ull}) {
    uint64_t a = 0, b = 0;
    const int da = blend.pick(i, &a), db = fresh.pick(i, &b);
    EXPECT_EQ(da, db) << i;
    EXPECT_EQ(a, b) << i;
  }
}

TEST(DataSampling, StreamContinuesIdenticallyAfterRestart) {
  TempDir dir;
  write_docs(dir.path("a"), 50, 0);
  write_docs(dir.path("b"), 30, 10000);
  DataConfig dc;
  dc.source = "indexed:" + dir.path("a") + ":0.7,indexed:" + dir.path("b") + ":0.3";
  dc.split = "90,10";
  const int64_t T = 9, B = 4, V = 20000;
  auto stream = [&](const Dataset& d, Split split, uint64_t first, int64_t n) {
    std::vector<int32_t> tok(static_cast<size_t>(n * T)), tgt(static_cast<size_t>(n * T));
    d.batch(tok.data(), tgt.data(), split, first, n);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t t = 0; t + 1 < T; ++t) EXPECT_EQ(tgt[i * T + t], tok[i * T + t + 1]);
    return std::make_pair(tok, tgt);
  };
  const auto whole = open_dataset(dc, T, V, 42);
  std::vector<int32_t> all_tok;
  int64_t from_b = 0;
  for (uint64_t step = 0; step < 60; ++step) {  // several epochs of the smaller dataset
    const auto [tok, tgt] = stream(*whole, Split::train, step * B, B);
    all_tok.insert(all_tok.end(), tok.begin(), tok.end());
    for (int64_t i = 0; i < B; ++i) from_b += tok[i * T] >= 10000;
  }
  EXPECT_NEAR(static_cast<double>(from_b) / (60 * B), 0.3, 0.01);
  // A fresh loader (a restarted run) at an arbitrary position continues the identical stream.
  for (uint64_t restart : {37ull, 1ull, 59ull}) {
    const auto resumed = open_dataset(dc, T, V, 42);
    for (uint64_t step = restart; step < 60; ++step) {
      const auto [tok, tgt] = stream(*resumed, Split::train, step * B, B);
      EXPECT_TRUE(std::equal(tok.begin(), tok.end(), all_tok.begin() + static_cast<int64_t>(step * B * T)))
          << "restart at " << restart << ", step " << step;
    }
  }
  // The valid split draws only from held-out documents (the last 10% of each dataset).
  const auto [vt, vg] = stream(*whole, Split::eval, 0, 16);
  for (int32_t t : vt) EXPECT_TRUE((t < 10000 && t / 100 >= 45) || (t >= 10000 && (t - 10000) / 100 >= 27)) << t;
}

TEST(DataSampling, BadSourcesAreOneLineErrors) {
  TempDir dir;
  write_docs(dir.path("a"), 20, 0);
  DataConfig dc;
  dc.split = "80,20";
  auto err = [&](const std::string& source, int64_t T, int64_t V) {
    dc.source = source;
    return error_of([&] {
      const auto d = open_dataset(dc, T, V, 1);
      std::vector<int32_t> tok(static_cast<size_t>(8 * T)), tgt(tok.size());
      d->batch(tok.data(), tgt.data(), Split::train, 0, 8);
    });
  };
  std::string m = err("indexed:" + dir.path("a"), 8, 1000);
  EXPECT_NE(m.find(dir.path("a") + ".bin"), std::string::npos) << m;
  EXPECT_NE(m.find("model.vocab_size = 1000"), std::string::npos) << m;
  m = err("indexed:" + dir.path("missing"), 8, 65536);
  EXPECT_NE(m.find(dir.path("missing") + ".idx"), std::string::npos) << m;
  m = err("indexed:" + dir.path("a"), 100000, 65536);
  EXPECT_NE(m.find("model.seq_length + 1"), std::string::npos) << m;
  dc.split = "98,2";  // 20 documents: none left for the valid split
  m = err("indexed:" + dir.path("a"), 8, 65536);
  EXPECT_NE(m.find("valid split (documents 20..20 of 20, see data.split) has 0 tokens"), std::string::npos) << m;
  dc.split = "80,20";
  m = err("indexed:" + dir.path("a") + ":zero", 8, 65536);
  EXPECT_NE(m.find("weight 'zero'"), std::string::npos) << m;
  m = err("indexed:" + dir.path("a") + ",text:x", 8, 65536);
  EXPECT_NE(m.find("entry 'text:x'"), std::string::npos) << m;
  dc.split = "1";
  m = err("indexed:" + dir.path("a"), 8, 65536);
  EXPECT_NE(m.find("data.split"), std::string::npos) << m;
}

}  // namespace
}  // namespace lockstep
