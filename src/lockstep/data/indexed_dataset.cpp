#include "lockstep/data/indexed_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>

#include "lockstep/core/error.h"

namespace lockstep {
namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
constexpr size_t kHeaderBytes = 9 + 8 + 1 + 8 + 8;

// Maps a whole file read-only; an empty file maps to nullptr with size 0.
void* map_file(const std::string& path, size_t& bytes, const std::string& what) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) user_error(what, " '", path, "': cannot open: ", std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    user_error(what, " '", path, "': cannot stat: ", std::strerror(e));
  }
  bytes = static_cast<size_t>(st.st_size);
  void* p = nullptr;
  if (bytes > 0) {
    p = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const int e = errno;
      ::close(fd);
      user_error(what, " '", path, "': cannot map: ", std::strerror(e));
    }
  }
  ::close(fd);
  return p;
}

template <typename T>
T load_at(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
void check_fits(const int32_t* t, int64_t n, TokenDtype dtype) {
  for (int64_t i = 0; i < n; ++i)
    if (t[i] < static_cast<int64_t>(std::numeric_limits<T>::min()) ||
        t[i] > static_cast<int64_t>(std::numeric_limits<T>::max()))
      user_error("token id ", t[i], " does not fit the dataset's element type ",
                 dtype_name(static_cast<uint8_t>(dtype)));
}

template <typename T>
void convert(uint8_t* out, const int32_t* t, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const T v = static_cast<T>(t[i]);
    std::memcpy(out + i * static_cast<int64_t>(sizeof(T)), &v, sizeof(T));
  }
}

}  // namespace

int64_t dtype_size(uint8_t code) {
  switch (code) {
    case 1:
    case 2:
      return 1;
    case 3:
    case 8:
      return 2;
    case 4:
    case 7:
      return 4;
    case 5:
    case 6:
      return 8;
    default:
      return 0;
  }
}

const char* dtype_name(uint8_t code) {
  static const char* const names[] = {"?", "uint8", "int8", "int16", "int32", "int64", "float64", "float32", "uint16"};
  return code >= 1 && code <= 8 ? names[code] : "unknown";
}

TokenDtype token_dtype_for_vocab(int64_t vocab_size) {
  return vocab_size < 65500 ? TokenDtype::uint16 : TokenDtype::int32;
}

// ---------------------------------------------------------------------------------------------
// Writer

IndexedDatasetWriter::IndexedDatasetWriter(const std::string& prefix, TokenDtype dtype)
    : prefix_(prefix), dtype_(dtype) {
  const uint8_t code = static_cast<uint8_t>(dtype);
  if (code == 6 || code == 7 || dtype_size(code) == 0)
    user_error("indexed dataset '", prefix, "': element type ", dtype_name(code), " cannot hold token ids");
  const std::string path = prefix + ".bin.tmp";
  bin_ = std::fopen(path.c_str(), "wb");
  if (!bin_) user_error("cannot create '", path, "': ", std::strerror(errno));
}

IndexedDatasetWriter::~IndexedDatasetWriter() {
  if (bin_) std::fclose(bin_);
  if (!finished_) {
    std::remove((prefix_ + ".bin.tmp").c_str());
    std::remove((prefix_ + ".idx.tmp").c_str());
  }
}

void IndexedDatasetWriter::add_document(const int32_t* tokens, int64_t n) {
  LOCKSTEP_CHECK(!finished_ && n >= 0 && n <= std::numeric_limits<int32_t>::max());
  const uint8_t code = static_cast<uint8_t>(dtype_);
  scratch_.resize(static_cast<size_t>(n * dtype_size(code)));
  switch (dtype_) {
    case TokenDtype::uint8:
      check_fits<uint8_t>(tokens, n, dtype_);
      convert<uint8_t>(scratch_.data(), tokens, n);
      break;
    case TokenDtype::int8:
      check_fits<int8_t>(tokens, n, dtype_);
      convert<int8_t>(scratch_.data(), tokens, n);
      break;
    case TokenDtype::int16:
      check_fits<int16_t>(tokens, n, dtype_);
      convert<int16_t>(scratch_.data(), tokens, n);
      break;
    case TokenDtype::uint16:
      check_fits<uint16_t>(tokens, n, dtype_);
      convert<uint16_t>(scratch_.data(), tokens, n);
      break;
    case TokenDtype::int32:
      convert<int32_t>(scratch_.data(), tokens, n);
      break;
    case TokenDtype::int64:
      convert<int64_t>(scratch_.data(), tokens, n);
      break;
    default:
      LOCKSTEP_CHECK(false, "float element type");
  }
  if (n > 0 && std::fwrite(scratch_.data(), 1, scratch_.size(), bin_) != scratch_.size())
    user_error("cannot write '", prefix_, ".bin.tmp': ", std::strerror(errno));
  lengths_.push_back(static_cast<int32_t>(n));
  doc_index_.push_back(static_cast<int64_t>(lengths_.size()));
  tokens_ += n;
}

void IndexedDatasetWriter::finish() {
  LOCKSTEP_CHECK(!finished_);
  if (std::fflush(bin_) != 0 || ::fsync(fileno(bin_)) != 0)
    user_error("cannot write '", prefix_, ".bin.tmp': ", std::strerror(errno));
  std::fclose(bin_);
  bin_ = nullptr;

  const uint8_t code = static_cast<uint8_t>(dtype_);
  const uint64_t S = lengths_.size(), D = doc_index_.size(), version = 1;
  std::vector<uint8_t> idx;
  idx.reserve(kHeaderBytes + S * 12 + D * 8);
  auto put = [&](const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    idx.insert(idx.end(), b, b + n);
  };
  put(kMagic, 9);
  put(&version, 8);
  put(&code, 1);
  put(&S, 8);
  put(&D, 8);
  put(lengths_.data(), S * 4);
  int64_t ptr = 0;
  for (int32_t len : lengths_) {
    put(&ptr, 8);
    ptr += static_cast<int64_t>(len) * dtype_size(code);
  }
  put(doc_index_.data(), D * 8);

  const std::string tmp = prefix_ + ".idx.tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) user_error("cannot create '", tmp, "': ", std::strerror(errno));
  const bool ok =
      std::fwrite(idx.data(), 1, idx.size(), f) == idx.size() && std::fflush(f) == 0 && ::fsync(fileno(f)) == 0;
  std::fclose(f);
  if (!ok) user_error("cannot write '", tmp, "': ", std::strerror(errno));
  for (const char* ext : {".bin", ".idx"})
    if (std::rename((prefix_ + ext + ".tmp").c_str(), (prefix_ + ext).c_str()) != 0)
      user_error("cannot rename '", prefix_, ext, ".tmp': ", std::strerror(errno));
  finished_ = true;
}

// ---------------------------------------------------------------------------------------------
// Reader

IndexedDataset::IndexedDataset(const std::string& prefix) : prefix_(prefix) {
  const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
  idx_map_ = map_file(idx_path, idx_bytes_, "indexed dataset index");
  try {
    const auto* p = static_cast<const uint8_t*>(idx_map_);
    auto bad = [&](const auto&... why) { user_error("indexed dataset index '", idx_path, "': ", why...); };
    if (idx_bytes_ < kHeaderBytes) bad("truncated header (", idx_bytes_, " bytes, need ", kHeaderBytes, ")");
    if (std::memcmp(p, kMagic, 9) != 0) bad("not a Megatron MMIDIDX index (bad magic)");
    if (const auto v = load_at<uint64_t>(p + 9); v != 1) bad("unsupported version ", v, " (expected 1)");
    dtype_ = p[17];
    elem_ = dtype_size(dtype_);
    if (elem_ == 0) bad("unknown dtype code ", int(dtype_));
    if (dtype_ == 6 || dtype_ == 7) bad("dtype ", dtype_name(dtype_), " holds no token ids");
    const auto S = load_at<uint64_t>(p + 18), D = load_at<uint64_t>(p + 26);
    const uint64_t want = kHeaderBytes + S * 12 + D * 8;
    if (S > (uint64_t(1) << 40) || D > (uint64_t(1) << 40) || want != idx_bytes_)
      bad(idx_bytes_, " bytes but ", S, " sequences and ", D, " document indices need ", want,
          " (truncated or not this format)");
    if (D < 1) bad("no document indices");
    S_ = static_cast<int64_t>(S);
    D_ = static_cast<int64_t>(D);
    lengths_ = p + kHeaderBytes;
    pointers_ = lengths_ + S * 4;
    doc_index_ = pointers_ + S * 8;
    int64_t ptr = 0;
    for (int64_t s = 0; s < S_; ++s) {
      const int32_t len = sequence_length(s);
      if (len < 0) bad("sequence ", s, " has negative length ", len);
      if (sequence_pointer(s) != ptr)
        bad("sequence ", s, " starts at byte ", sequence_pointer(s), ", expected ", ptr,
            " (sequences must be contiguous)");
      ptr += len * elem_;
    }
    tokens_ = ptr / elem_;
    if (document_index(0) != 0) bad("first document index is ", document_index(0), ", expected 0");
    for (int64_t d = 1; d < D_; ++d)
      if (document_index(d) < document_index(d - 1) || document_index(d) > S_)
        bad("document index ", d, " = ", document_index(d), " is out of order or past ", S_, " sequences");
    if (document_index(D_ - 1) != S_)
      bad("last document index is ", document_index(D_ - 1), ", expected the sequence count ", S_);

    bin_map_ = map_file(bin_path, bin_bytes_, "indexed dataset data");
    if (static_cast<int64_t>(bin_bytes_) != ptr)
      user_error("indexed dataset data '", bin_path, "': ", bin_bytes_, " bytes but its index '", idx_path,
                 "' describes ", ptr, " (truncated, or the .bin and .idx do not belong together)");
    bin_ = static_cast<const uint8_t*>(bin_map_);
  } catch (...) {
    if (idx_map_) ::munmap(idx_map_, idx_bytes_);
    if (bin_map_) ::munmap(bin_map_, bin_bytes_);
    throw;
  }
}

IndexedDataset::~IndexedDataset() {
  if (idx_map_) ::munmap(idx_map_, idx_bytes_);
  if (bin_map_) ::munmap(bin_map_, bin_bytes_);
}

int64_t IndexedDataset::document_begin(int64_t d) const {
  const int64_t s = document_index(d);
  return s < S_ ? sequence_pointer(s) / elem_ : tokens_;
}

namespace {
template <typename T>
void read_as_int32(int32_t* out, const uint8_t* src, int64_t n, int64_t vocab, const std::string& prefix,
                   int64_t first) {
  for (int64_t i = 0; i < n; ++i) {
    const T v = load_at<T>(src + i * static_cast<int64_t>(sizeof(T)));
    if (v < 0 || static_cast<int64_t>(v) >= vocab)
      user_error("indexed dataset data '", prefix, ".bin': token ", static_cast<int64_t>(v), " at element ", first + i,
                 " is outside the vocabulary [0, model.vocab_size = ", vocab, ")");
    out[i] = static_cast<int32_t>(v);
  }
}
}  // namespace

void IndexedDataset::read(int32_t* out, int64_t first, int64_t n, int64_t vocab_size) const {
  LOCKSTEP_CHECK(first >= 0 && n >= 0 && first + n <= tokens_, "elements ", first, "+", n, " of ", tokens_);
  const uint8_t* src = bin_ + first * elem_;
  switch (dtype_) {
    case 1:
      read_as_int32<uint8_t>(out, src, n, vocab_size, prefix_, first);
      break;
    case 2:
      read_as_int32<int8_t>(out, src, n, vocab_size, prefix_, first);
      break;
    case 3:
      read_as_int32<int16_t>(out, src, n, vocab_size, prefix_, first);
      break;
    case 4:
      read_as_int32<int32_t>(out, src, n, vocab_size, prefix_, first);
      break;
    case 5:
      read_as_int32<int64_t>(out, src, n, vocab_size, prefix_, first);
      break;
    case 8:
      read_as_int32<uint16_t>(out, src, n, vocab_size, prefix_, first);
      break;
    default:
      LOCKSTEP_CHECK(false, "dtype ", int(dtype_));
  }
}

}  // namespace lockstep
