// Megatron's indexed dataset: a token file PREFIX.bin and its index PREFIX.idx, read and written
// byte for byte as Megatron-LM's MMapIndexedDataset (megatron/core/datasets/indexed_dataset.py),
// so corpora preprocessed for Megatron train here unchanged and ours train there.
//
// PREFIX.idx, little-endian, no padding:
//   9 bytes   magic "MMIDIDX\0\0"
//   u64       version = 1
//   u8        dtype code of the .bin elements: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
//             6 float64, 7 float32, 8 uint16
//   u64       S = sequence count
//   u64       D = document-index count (documents + 1)
//   i32[S]    sequence lengths, in elements
//   i64[S]    sequence pointers: byte offset of each sequence in the .bin
//   i64[D]    document indices: 0, then the sequence count after each document (document d is
//             sequences [doc[d], doc[d+1]))
// PREFIX.bin: the sequences' elements back to back.
//
// `lockstep preprocess` writes one sequence per document (Megatron without --split-sentences).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace lockstep {

enum class TokenDtype : uint8_t {
  uint8 = 1,
  int8 = 2,
  int16 = 3,
  int32 = 4,
  int64 = 5,
  float64 = 6,
  float32 = 7,
  uint16 = 8
};

// Element size in bytes; 0 for a code outside Megatron's table.
int64_t dtype_size(uint8_t code);
const char* dtype_name(uint8_t code);
// Megatron's choice: uint16 when every id fits (vocabulary < 65500), otherwise int32.
TokenDtype token_dtype_for_vocab(int64_t vocab_size);

// Writes PREFIX.bin.tmp and PREFIX.idx.tmp, renamed to PREFIX.bin / PREFIX.idx by finish(), so
// an interrupted run leaves no half-written dataset under the final names. Destroying an
// unfinished writer removes the temporary files.
class IndexedDatasetWriter {
 public:
  IndexedDatasetWriter(const std::string& prefix, TokenDtype dtype);
  ~IndexedDatasetWriter();
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;

  // Appends one document made of one sequence. Throws UserError when an id does not fit dtype.
  void add_document(const int32_t* tokens, int64_t n);
  void finish();

  int64_t documents() const { return static_cast<int64_t>(doc_index_.size()) - 1; }
  int64_t tokens() const { return tokens_; }

 private:
  std::string prefix_;
  TokenDtype dtype_;
  std::FILE* bin_ = nullptr;
  std::vector<int32_t> lengths_;
  std::vector<int64_t> doc_index_{0};
  std::vector<uint8_t> scratch_;
  int64_t tokens_ = 0;
  bool finished_ = false;
};

// Memory-maps PREFIX.idx and PREFIX.bin. The constructor checks the whole index against the
// format and the .bin's size (bad magic or version, unknown dtype, an index shorter or longer than
// its counts say, pointers that do not follow from the lengths, a .bin whose size is not the sum
// of the lengths) and throws a one-line UserError naming the file.
class IndexedDataset {
 public:
  explicit IndexedDataset(const std::string& prefix);
  ~IndexedDataset();
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;

  const std::string& prefix() const { return prefix_; }
  uint8_t dtype_code() const { return dtype_; }
  int64_t sequences() const { return S_; }
  int64_t documents() const { return D_ - 1; }
  int64_t tokens() const { return tokens_; }
  // The index arrays start at byte 34 of the file, so they are unaligned: read them by memcpy.
  int32_t sequence_length(int64_t s) const { return load<int32_t>(lengths_, s); }
  int64_t sequence_pointer(int64_t s) const { return load<int64_t>(pointers_, s); }
  int64_t document_index(int64_t d) const { return load<int64_t>(doc_index_, d); }  // d in [0, documents()]
  // Tokens of document d (all its sequences, which are contiguous in the .bin) are the elements
  // [document_begin(d), document_begin(d + 1)).
  int64_t document_begin(int64_t d) const;

  // Copies elements [first, first + n) of the .bin (in element units) as int32. Throws
  // UserError naming the file and the value when an element is negative or >= vocab_size.
  void read(int32_t* out, int64_t first, int64_t n, int64_t vocab_size) const;

 private:
  std::string prefix_;
  uint8_t dtype_ = 0;
  int64_t elem_ = 0, S_ = 0, D_ = 0, tokens_ = 0;
  template <typename T>
  static T load(const uint8_t* base, int64_t i) {
    T v;
    std::memcpy(&v, base + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
    return v;
  }
  const uint8_t* lengths_ = nullptr;    // i32[S]
  const uint8_t* pointers_ = nullptr;   // i64[S]
  const uint8_t* doc_index_ = nullptr;  // i64[D]
  const uint8_t* bin_ = nullptr;
  void* idx_map_ = nullptr;
  size_t idx_bytes_ = 0;
  void* bin_map_ = nullptr;
  size_t bin_bytes_ = 0;
};

}  // namespace lockstep
