// `lockstep preprocess` as a library call: output independent of the worker count, documents
// decoded back, and bad inputs as one-line errors naming file and line (or documented skips).
#include <gtest/gtest.h>

#include <filesystem>

#include "lockstep/core/error.h"
#include "lockstep/data/indexed_dataset.h"
#include "lockstep/data/preprocess.h"
#include "lockstep/data/tokenizer.h"
#include "testing.h"

namespace lockstep {
namespace {

using testing::read_file;
using testing::TempDir;

constexpr auto error_of = testing::user_error_of;

std::vector<std::string> documents_of(const std::string& prefix, const Tokenizer& tok, bool strip_eod) {
  const IndexedDataset ds(prefix);
  std::vector<std::string> docs;
  for (int64_t d = 0; d < ds.documents(); ++d) {
    const int64_t b = ds.document_begin(d), e = ds.document_begin(d + 1);
    std::vector<int32_t> ids(static_cast<size_t>(e - b));
    ds.read(ids.data(), b, e - b, tok.vocab_size());
    if (strip_eod) {
      EXPECT_EQ(ids.back(), tok.eod());
      ids.pop_back();
    }
    docs.push_back(tok.decode(ids));
  }
  return docs;
}

TEST(Preprocess, JsonlOutputIsTheSameForAnyWorkerCount) {
  TempDir dir;
  std::string jsonl;
  std::vector<std::string> texts;
  for (int i = 0; i < 300; ++i) {
    texts.push_back("doc " + std::to_string(i) + std::string(static_cast<size_t>(i % 37), 'x') + " naïve 🙂");
    jsonl += "{\"id\": " + std::to_string(i) + ", \"text\": \"" + texts.back() + "\"}\n";
    if (i % 50 == 0) jsonl += "\n";  // blank lines are skipped
  }
  const std::string in = dir.write("c.jsonl", jsonl);
  PreprocessOptions o;
  o.inputs = {in};
  o.append_eod = true;
  o.chunk_bytes = 700;  // many chunks
  std::string bin, idx;
  for (int workers : {1, 2, 3}) {
    o.workers = workers;
    o.output_prefix = dir.path(std::string("w").append(std::to_string(workers)).append("/ds"));  // g++ 12 -Wrestrict
    const PreprocessSummary s = preprocess(o);
    EXPECT_EQ(s.documents, 300);
    if (workers == 1) {
      bin = read_file(o.output_prefix + ".bin");
      idx = read_file(o.output_prefix + ".idx");
    } else {
      EXPECT_EQ(read_file(o.output_prefix + ".bin"), bin) << workers << " workers";
      EXPECT_EQ(read_file(o.output_prefix + ".idx"), idx) << workers << " workers";
    }
  }
  EXPECT_EQ(documents_of(dir.path("w1/ds"), *make_tokenizer("byte"), true), texts);
}

TEST(Preprocess, TextParagraphsAndDocumentedSkips) {
  TempDir dir;
  const std::string in = dir.write("c.txt", "first line\nsecond line\n\n \t\n  third\n\nbad \xFF byte\n\nlast");
  PreprocessOptions o;
  o.inputs = {in};
  o.output_prefix = dir.path("ds");
  const PreprocessSummary s = preprocess(o);
  EXPECT_EQ(documents_of(o.output_prefix, *make_tokenizer("byte"), false),
            (std::vector<std::string>{"first line\nsecond line", "  third", "last"}));
  EXPECT_EQ(s.skipped_invalid_utf8, 1);
  EXPECT_EQ(s.first_invalid_utf8, in + ":7");
  // Empty JSON texts are skipped and counted.
  o.inputs = {dir.write("e.jsonl", "{\"text\": \"\"}\n{\"text\": \"a\"}\n")};
  EXPECT_EQ(preprocess(o).skipped_empty, 1);
}

TEST(Preprocess, BadInputsAreOneLineErrorsAndWriteNothing) {
  TempDir dir;
  PreprocessOptions o;
  o.output_prefix = dir.path("ds");
  auto expect_error = [&](const std::vector<std::string>& inputs, const std::string& what) {
    o.inputs = inputs;
    const std::string msg = error_of([&] { preprocess(o); });
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    EXPECT_FALSE(std::filesystem::exists(o.output_prefix + ".bin"));
    EXPECT_FALSE(std::filesystem::exists(o.output_prefix + ".idx"));
    EXPECT_FALSE(std::filesystem::exists(o.output_prefix + ".bin.tmp"));
  };
  const std::string bad = dir.write("bad.jsonl", "{\"text\": \"ok\"}\n{\"text\": \"broken\n{\"text\": \"ok\"}\n");
  expect_error({bad}, bad + ":2: malformed JSON");
  const std::string nokey = dir.write("nokey.jsonl", "{\"text\": \"ok\"}\n\n{\"body\": \"x\"}\n");
  expect_error({nokey}, nokey + ":3: expected a JSON object with a string \"text\"");
  expect_error({dir.write("bytes.jsonl", "{\"text\": \"\xFF\"}\n")}, "bytes.jsonl:1: malformed JSON");
  expect_error({dir.path("absent.txt")}, "absent.txt");
  expect_error({dir.write("empty.txt", "")}, "no documents");
  expect_error({dir.write("blank.txt", "\n\n  \n")}, "no documents");
  expect_error({}, "no --input");
  o.tokenizer = "hf:" + dir.path("missing.json");
  expect_error({dir.write("ok.txt", "x")}, "missing.json");
}

}  // namespace
}  // namespace lockstep
