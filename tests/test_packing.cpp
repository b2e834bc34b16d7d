// Packed variable-length samples (data.packing = "thd", data/packed_dataset.h): the sampler against
// the documents it packs (every token once, in order, whole documents unless longer than a sample,
// each padded to the multiple, targets inside documents only, a pure function of the sample index),
// the loss normalised over the global batch's tokens with a target whatever the layout, and the keys'
// bad values. Its layouts against one process are rows of test_parallel_layouts.cpp (thd_*), its
// determinism rows of test_determinism_matrix.cpp (thd_*).
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "lockstep/config/config.h"
#include "lockstep/data/indexed_dataset.h"
#include "lockstep/data/packed_dataset.h"
#include "lockstep/parallel/context_parallel.h"
#include "lockstep/train/trainer.h"
#include "model_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

constexpr int32_t kEod = 256;

// Byte documents of lengths 1..70 (some longer than the 32-token samples below), ended by EOD except
// every fifth, whose EOD the sampler appends.
std::vector<std::vector<int32_t>> write_docs(const std::string& prefix) {
  IndexedDatasetWriter w(prefix, TokenDtype::uint16);
  const std::vector<int32_t> lengths = testing::random_ints(120, 70, 11, "lengths");
  const std::vector<int32_t> bytes = testing::random_ints(120 * 71, 256, 11, "bytes");
  std::vector<std::vector<int32_t>> docs;
  for (size_t i = 0; i < lengths.size(); ++i) {
    std::vector<int32_t> doc(bytes.begin() + static_cast<int64_t>(i) * 71,
                             bytes.begin() + static_cast<int64_t>(i) * 71 + lengths[i] + 1);
    if (i % 5 != 0) doc.push_back(kEod);
    w.add_document(doc.data(), static_cast<int64_t>(doc.size()));
    if (i % 5 == 0) doc.push_back(kEod);  // what the sampler reads
    docs.push_back(doc);
  }
  w.finish();
  return docs;
}

TEST(Packing, SamplesHoldWholeDocumentsPaddedWithTargetsInsideThem) {
  testing::TempDir dir;
  const std::string prefix = dir.path("docs");
  const std::vector<std::vector<int32_t>> docs = write_docs(prefix);
  auto data = std::make_shared<const IndexedDataset>(prefix);
  const int64_t T = 32, pad = 4;
  const PackedSampler sampler(data, DocRange{0, data->documents()}, T, 259, kEod, pad, 5, "train");
  const std::shared_ptr<const PackedSampler::Epoch> ep = sampler.epoch(0);
  const auto rows = static_cast<int64_t>(ep->rows.size()) - 1;
  ASSERT_GT(rows, 0);
  // Every row: pieces back to back from position 0, each at a multiple of pad, then EOD padding.
  std::map<int64_t, std::map<int64_t, std::vector<int32_t>>> seen;  // per document, its pieces' tokens by offset
  int64_t padding = 0;
  for (int64_t row = 0; row < rows; ++row) {
    // The sample the epoch's order puts row `row` at.
    const auto j = static_cast<uint64_t>(std::find(ep->order.begin(), ep->order.end(), row) - ep->order.begin());
    std::vector<int32_t> tokens(T), targets(T);
    sampler.sample(tokens.data(), targets.data(), j);
    int64_t at = 0;
    for (int64_t k = ep->rows[static_cast<size_t>(row)]; k < ep->rows[static_cast<size_t>(row) + 1]; ++k) {
      const PackedSampler::Piece& p = ep->pieces[static_cast<size_t>(k)];
      const std::vector<int32_t>& doc = docs[static_cast<size_t>(p.doc)];
      ASSERT_EQ(p.doc_length, static_cast<int64_t>(doc.size()));
      ASSERT_EQ(at % pad, 0);
      ASSERT_EQ(p.padded % pad, 0);
      ASSERT_LE(p.length, T);
      for (int64_t i = 0; i < p.padded; ++i) {
        if (i < p.length) {
          ASSERT_EQ(tokens[at + i], doc[p.offset + i]) << "doc " << p.doc;
          const int64_t next = p.offset + i + 1;
          ASSERT_EQ(targets[at + i], next < p.doc_length ? doc[next] : -1) << "doc " << p.doc << " at " << i;
          seen[p.doc][p.offset].push_back(tokens[at + i]);
        } else {
          ASSERT_EQ(tokens[at + i], kEod);
          ASSERT_EQ(targets[at + i], -1);
          ++padding;
        }
      }
      at += p.padded;
    }
    for (; at < T; ++at, ++padding) ASSERT_EQ(targets[at], -1);
    // Pure function of the index: again, and from a fresh sampler.
    std::vector<int32_t> again(T), again_t(T);
    const PackedSampler fresh(data, DocRange{0, data->documents()}, T, 259, kEod, pad, 5, "train");
    fresh.sample(again.data(), again_t.data(), j);
    ASSERT_EQ(again, tokens);
    ASSERT_EQ(again_t, targets);
  }
  // Every document once, whole (a long one in pieces of T, which first fit may place in any order).
  ASSERT_EQ(seen.size(), docs.size());
  for (const auto& [d, pieces] : seen) {
    std::vector<int32_t> tokens;
    for (const auto& [offset, piece] : pieces) tokens.insert(tokens.end(), piece.begin(), piece.end());
    EXPECT_EQ(tokens, docs[static_cast<size_t>(d)]) << "doc " << d;
  }
  std::printf("[ debug ] %zu documents in %lld samples of %lld: %.1f%% padding\n", docs.size(),
              static_cast<long long>(rows), static_cast<long long>(T),
              100.0 * static_cast<double>(padding) / static_cast<double>(rows * T));
  // Samples past the first epoch come from the next epoch's packing.
  std::vector<int32_t> tokens(T), targets(T);
  sampler.sample(tokens.data(), targets.data(), static_cast<uint64_t>(rows) + 3);
  EXPECT_EQ(sampler.epoch(1)->index, 1u);
}

Config packed_job(const std::string& prefix, const std::string& out, const std::vector<std::string>& keys,
                  const std::string& config = "debug") {
  std::vector<std::string> all = {
      "data.source=indexed:" + prefix, "data.eod_token=256",  "data.packing=thd", "data.packing_pad_multiple=4",
      "model.vocab_size=260",          "model.seq_length=32", "train.steps=3",    "train.global_batch=4",
      "train.eval_interval=0",         "train.out_dir=" + out};
  all.insert(all.end(), keys.begin(), keys.end());  // the caller's keys last: they override
  return load_config(str(LOCKSTEP_SOURCE_DIR, "/configs/", config, ".toml"), all);
}

// The loss is the mean over the step's tokens with a target: one micro-batch of 4, four of 1, two
// data-parallel ranks and context parallelism, which cuts each document into its own chunks (CP 2 with
// each cp_comm_type but a2a+p2p), agree; each step reports its count. With documents padded to 8 (other
// samples), the one-process run against CP 4 with a2a+p2p (2, 2) and CP 2 x TP 2 x SP; the MoE model
// with the sequence aux loss and router jitter against CP 2.
TEST(Packing, LossIsTheMeanOverTheStepsTargetsInEveryLayout) {
  testing::TempDir dir;
  const std::string prefix = dir.path("docs");
  write_docs(prefix);
  struct Layout {
    const char* micro;
    int ranks;
    std::vector<std::string> keys;
    std::string config = "debug";
  };
  const std::vector<std::string> seq_aux = {"moe.router_load_balancing_type=seq_aux_loss", "moe.input_jitter_eps=0.01"};
  const std::vector<std::vector<Layout>> groups = {
      {{"4", 1, {}},
       {"1", 1, {}},
       {"2", 2, {}},
       {"1", 2, {"parallel.context=2", "parallel.cp_comm_type=p2p"}},
       {"1", 2, {"parallel.context=2"}},
       {"1", 2, {"parallel.context=2", "parallel.cp_comm_type=a2a"}}},
      {{"1", 1, {"data.packing_pad_multiple=8"}},
       {"1",
        4,
        {"parallel.context=4", "parallel.cp_comm_type=a2a+p2p", "parallel.hierarchical_context_parallel_sizes=2,2",
         "data.packing_pad_multiple=8"}},
       {"1",
        4,
        {"parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true",
         "data.packing_pad_multiple=8"}}}};
  int k = 0;
  for (const std::vector<Layout>& group : groups) {
    std::vector<std::vector<std::pair<double, double>>> runs;
    for (const Layout& l : group) {
      std::vector<std::string> keys = l.keys;
      keys.push_back(std::string("train.micro_batch=") + l.micro);
      const std::string out = dir.path(str("run", k++));
      testing::train_ranks(l.ranks, packed_job(prefix, out, keys, l.config));
      runs.push_back(testing::trajectory(out));
      EXPECT_NE(testing::read_file(out + "/metrics.jsonl").find("\"loss_tokens\""), std::string::npos);
    }
    for (size_t r = 1; r < runs.size(); ++r)
      for (size_t s = 0; s < runs[0].size(); ++s)
        EXPECT_NEAR(runs[r][s].first, runs[0][s].first, 1e-5 * runs[0][s].first) << "run " << k << ", " << r;
  }
}

// determinism = "layout": packed documents under TP 2 x SP, CP 2 (all-gather and all-to-all), PP 2,
// DP 2 and, for the MoE model, EP 2 give one process's losses and grad norms bit for bit (the same
// samples: data.packing_pad_multiple = 8 for all).
TEST(Packing, LayoutModeLayoutsMatchOneProcessBitwise) {
  testing::TempDir dir;
  const std::string prefix = dir.path("docs");
  write_docs(prefix);
  for (const char* model : {"debug", "moe-debug"}) {
    const std::vector<std::string> common = {"determinism=layout",  "layout_token_segments=true",
                                             "train.micro_batch=2", "data.packing_pad_multiple=8",
                                             "model.preset=llama",  "model.num_query_groups=2"};
    auto job = [&](const std::string& out, std::vector<std::string> keys) {
      keys.insert(keys.begin(), common.begin(), common.end());
      return packed_job(prefix, out, keys, model);
    };
    const std::string single = dir.path(str(model, "-single"));
    testing::train_ranks(1, job(single, {}));
    const auto expected = testing::trajectory(single);
    std::vector<std::pair<int, std::vector<std::string>>> rows = {
        {4, {"parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.context=2"}},
        {2, {"parallel.context=2", "parallel.cp_comm_type=a2a"}},
        {2, {"parallel.pipeline=2"}},
        {2, {}},
    };
    if (std::string(model) == "moe-debug") rows.push_back({2, {"parallel.expert=2", "moe.token_dispatcher=alltoall"}});
    int k = 0;
    for (const auto& [ranks, keys] : rows) {
      const std::string out = dir.path(str(model, "-", k++));
      testing::train_ranks(ranks, job(out, keys));
      EXPECT_EQ(testing::trajectory(out), expected) << model << " row " << k - 1;
    }
  }
}

// The per-document cut: units end where a document (with its padding) does; every rank holds an early
// and a late chunk of each, and its local rows map to those positions.
TEST(Packing, ContextParallelCutsEachDocumentIntoItsOwnChunks) {
  // T 32, padding 4: documents of 6 (+2 padding), 12, 3 (+1), then the tail (8), EOD = 9.
  std::vector<int32_t> tokens = {1, 2, 3, 4, 5, 9, 9, 9, 1, 2, 3, 4, 5, 6, 7, 8,
                                 1, 2, 3, 9, 1, 2, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9};
  ContextParallel cp;
  cp.size = 2;
  cp.rank = 1;
  cp.cut_documents();
  cp.set_documents(tokens.data(), 32, 9, 4);
  EXPECT_EQ(cp.units->bounds, (std::vector<int64_t>{0, 8, 20, 32}));
  EXPECT_EQ(cp.chunks(32), (QueryChunks{{2, 4}, {4, 6}, {11, 14}, {14, 17}, {23, 26}, {26, 29}}));
  EXPECT_EQ(cp.ring_chunks(32, 1, 0), (QueryChunks{{0, 4}, {4, 8}, {8, 14}, {14, 20}, {20, 26}, {26, 32}}));
  for (int64_t n = 0; n < 16; ++n) {
    int64_t k = n;
    int64_t want = -1;
    for (const auto& [begin, end] : cp.chunks(32)) {
      if (k < end - begin) {
        want = begin + k;
        break;
      }
      k -= end - begin;
    }
    EXPECT_EQ(cp.global_row(n, 32), want) << n;
    EXPECT_EQ(cp.global_row(16 + n, 32), 32 + want) << n;  // the next sample (same units)
  }
}

TEST(Packing, RefusesWhatItCannotPackByName) {
  auto error = [](std::vector<std::string> keys) {
    return testing::user_error_of([&] { load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/debug.toml", keys); });
  };
  EXPECT_EQ(error({"data.packing=thd"}).rfind("config: data.packing = \"thd\" needs documents", 0), 0u);
  EXPECT_NE(error({"data.packing=thd", "data.source=indexed:x", "model.vocab_size=259"}).find("data.eod_token"),
            std::string::npos);
  EXPECT_EQ(error({"data.packing=thd", "data.source=indexed:x", "model.vocab_size=259", "data.eod_token=256",
                   "model.seq_length=40", "data.packing_pad_multiple=16"}),
            "config: data.packing = \"thd\": model.seq_length = 40 is not a multiple of the documents' padding "
            "(data.packing_pad_multiple) = 16");
  EXPECT_EQ(error({"data.packing_pad_multiple=6", "parallel.context=2"}),
            "config: data.packing_pad_multiple = 6: must be 0 (automatic) or a multiple of 2 x parallel.context x "
            "parallel.tensor (with sequence parallelism) = 4");
  EXPECT_NE(error({"data.packing=bshd"}).find("data.packing"), std::string::npos);
  EXPECT_EQ(error({"data.packing=thd", "data.source=indexed:x", "model.vocab_size=259", "data.eod_token=256",
                   "parallel.context=2", "train.micro_batch=2"}),
            "config: data.packing = \"thd\" with parallel.context = 2: train.micro_batch = 2 must be 1 (each packed "
            "sample's documents are cut into their own context-parallel chunks)");
}

}  // namespace
}  // namespace lockstep
