// Megatron's .bin/.idx format: the bytes we write checked field by field against the documented
// layout, a hand-built index read back, and every way a pair can be broken rejected in one line
// that names the file.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "lockstep/core/error.h"
#include "lockstep/data/indexed_dataset.h"
#include "testing.h"

namespace lockstep {
namespace {

using testing::read_file;
using testing::TempDir;

template <typename T>
void put(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof v);
}

// The documented layout, built by hand: magic, version, dtype, counts, lengths, pointers, doc index.
std::string expected_idx(uint8_t code, int64_t elem, const std::vector<int32_t>& lengths) {
  std::string s("MMIDIDX\0\0", 9);
  put<uint64_t>(s, 1);
  put<uint8_t>(s, code);
  put<uint64_t>(s, lengths.size());
  put<uint64_t>(s, lengths.size() + 1);
  for (int32_t l : lengths) put<int32_t>(s, l);
  int64_t p = 0;
  for (int32_t l : lengths) put<int64_t>(s, p), p += l * elem;
  for (size_t d = 0; d <= lengths.size(); ++d) put<int64_t>(s, static_cast<int64_t>(d));
  return s;
}

constexpr auto error_of = testing::user_error_of;

const std::vector<std::vector<int32_t>> kDocs = {{5, 6, 7}, {}, {65535, 0}, {9}};

void write_docs(const std::string& prefix, TokenDtype dtype) {
  IndexedDatasetWriter w(prefix, dtype);
  for (const auto& d : kDocs) w.add_document(d.data(), static_cast<int64_t>(d.size()));
  w.finish();
}

TEST(IndexedDataset, WriterMatchesMegatronLayoutByteForByte) {
  TempDir dir;
  const std::string prefix = dir.path("ds");
  write_docs(prefix, TokenDtype::uint16);
  EXPECT_EQ(read_file(prefix + ".idx"), expected_idx(8, 2, {3, 0, 2, 1}));
  std::string bin;
  for (const auto& d : kDocs)
    for (int32_t t : d) put<uint16_t>(bin, static_cast<uint16_t>(t));
  EXPECT_EQ(read_file(prefix + ".bin"), bin);
  EXPECT_FALSE(std::filesystem::exists(prefix + ".bin.tmp"));
  EXPECT_FALSE(std::filesystem::exists(prefix + ".idx.tmp"));
}

TEST(IndexedDataset, ReadsHandBuiltFilesOfEveryIntegerType) {
  TempDir dir;
  for (auto [code, elem] : std::vector<std::pair<uint8_t, int64_t>>{{1, 1}, {2, 1}, {3, 2}, {4, 4}, {5, 8}, {8, 2}}) {
    const std::string stem = std::string("t").append(std::to_string(code));  // not "t" + ...: g++ 12's -Wrestrict
    const std::string prefix = dir.path(stem);
    dir.write(stem + ".idx", expected_idx(code, elem, {2, 1}));
    std::string bin;
    for (int64_t v : {3, 1, 4})
      bin.append(reinterpret_cast<const char*>(&v), static_cast<size_t>(elem));  // little-endian
    dir.write(stem + ".bin", bin);
    const IndexedDataset ds(prefix);
    EXPECT_EQ(ds.dtype_code(), code);
    EXPECT_EQ(ds.documents(), 2);
    EXPECT_EQ(ds.tokens(), 3);
    EXPECT_EQ(ds.document_begin(1), 2);
    EXPECT_EQ(ds.document_begin(2), 3);
    std::vector<int32_t> out(3);
    ds.read(out.data(), 0, 3, 10);
    EXPECT_EQ(out, (std::vector<int32_t>{3, 1, 4}));
  }
}

TEST(IndexedDataset, RoundTripsAndChecksVocabulary) {
  TempDir dir;
  const std::string prefix = dir.path("ds");
  write_docs(prefix, TokenDtype::int32);
  const IndexedDataset ds(prefix);
  EXPECT_EQ(ds.documents(), 4);
  std::vector<int32_t> all(static_cast<size_t>(ds.tokens()));
  ds.read(all.data(), 0, ds.tokens(), 65536);
  EXPECT_EQ(all, (std::vector<int32_t>{5, 6, 7, 65535, 0, 9}));
  const std::string msg = error_of([&] { ds.read(all.data(), 0, ds.tokens(), 1000); });
  EXPECT_NE(msg.find(prefix + ".bin"), std::string::npos) << msg;
  EXPECT_NE(msg.find("token 65535"), std::string::npos) << msg;
  EXPECT_NE(msg.find("model.vocab_size = 1000"), std::string::npos) << msg;
  // uint8 cannot hold 65535: the writer refuses instead of wrapping.
  EXPECT_NE(error_of([&] { write_docs(dir.path("small"), TokenDtype::uint8); }).find("does not fit"),
            std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(dir.path("small.bin")));
  EXPECT_FALSE(std::filesystem::exists(dir.path("small.bin.tmp")));
}

TEST(IndexedDataset, BrokenPairsAreOneLineErrorsNamingTheFile) {
  TempDir dir;
  const std::string a = dir.path("a"), b = dir.path("b");
  write_docs(a, TokenDtype::uint16);
  {
    IndexedDatasetWriter w(b, TokenDtype::uint16);
    const int32_t t[5] = {1, 2, 3, 4, 5};
    w.add_document(t, 5);
    w.finish();
  }
  auto expect_error = [&](const std::string& prefix, const std::string& file, const std::string& what) {
    const std::string msg = error_of([&] { IndexedDataset ds(prefix); });
    EXPECT_NE(msg.find(file), std::string::npos) << msg;
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  };
  expect_error(dir.path("missing"), dir.path("missing.idx"), "cannot open");
  const std::string good_idx = read_file(a + ".idx"), good_bin = read_file(a + ".bin");
  dir.write("a.bin", good_bin.substr(0, good_bin.size() - 2));
  expect_error(a, a + ".bin", "truncated");
  dir.write("a.bin", read_file(b + ".bin"));  // a .bin from another dataset
  expect_error(a, a + ".bin", "do not belong together");
  dir.write("a.bin", good_bin);
  dir.write("a.idx", good_idx.substr(0, good_idx.size() - 8));
  expect_error(a, a + ".idx", "truncated");
  dir.write("a.idx", good_idx.substr(0, 20));
  expect_error(a, a + ".idx", "truncated header");
  std::string bad = good_idx;
  bad[0] = 'X';
  dir.write("a.idx", bad);
  expect_error(a, a + ".idx", "bad magic");
  bad = good_idx;
  bad[9] = 2;
  dir.write("a.idx", bad);
  expect_error(a, a + ".idx", "version 2");
  bad = good_idx;
  bad[17] = 7;
  dir.write("a.idx", bad);
  expect_error(a, a + ".idx", "float32");
  bad = good_idx;
  bad[17] = 42;
  dir.write("a.idx", bad);
  expect_error(a, a + ".idx", "dtype code 42");
}

}  // namespace
}  // namespace lockstep
