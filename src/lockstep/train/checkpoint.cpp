#include "lockstep/train/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <future>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <regex>

#include "lockstep/comm/communicator.h"
#include "lockstep/core/error.h"
#include "lockstep/core/hash.h"
#include "lockstep/tensor/param_table.h"

namespace lockstep {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

namespace {

// ---- the write-fault test hook ----

std::mutex fault_mutex;
int64_t fault_budget = -1;  // bytes still allowed; -1: no fault
int fault_errno = 0;

// Bytes of the next write that may go through before the injected fault (n when none).
size_t allowed_bytes(size_t n, int* error) {
  std::lock_guard<std::mutex> lock(fault_mutex);
  if (fault_budget < 0) return n;
  const size_t ok = std::min(n, static_cast<size_t>(fault_budget));
  fault_budget -= static_cast<int64_t>(ok);
  if (ok < n) *error = fault_errno;
  return ok;
}

// ---- files ----

// A file written with POSIX calls so that it can be fsynced; every failure is a UserError naming it.
class OutFile {
 public:
  explicit OutFile(std::string path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) fail(errno);
  }
  ~OutFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  OutFile(const OutFile&) = delete;
  OutFile& operator=(const OutFile&) = delete;

  void write(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      int injected = 0;
      const size_t chunk = allowed_bytes(std::min<size_t>(n, size_t{64} << 20), &injected);
      size_t done = 0;
      while (done < chunk) {
        const ssize_t w = ::write(fd_, p + done, chunk - done);
        if (w < 0) {
          if (errno == EINTR) continue;
          fail(errno);
        }
        done += static_cast<size_t>(w);
      }
      if (injected) fail(injected);
      p += chunk;
      n -= chunk;
    }
  }
  // fsync, then close.
  void commit() {
    if (::fsync(fd_) != 0) fail(errno);
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail(errno);
  }

 private:
  [[noreturn]] void fail(int err) { user_error("cannot write checkpoint file '", path_, "': ", std::strerror(err)); }
  std::string path_;
  int fd_ = -1;
};

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) user_error("cannot open directory '", dir, "' to sync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) user_error("cannot sync directory '", dir, "': ", std::strerror(err));
}

// A data file opened for reading pieces.
class InFile {
 public:
  InFile(const std::string& dir, const std::string& name, const std::string& tensor) : path_(dir + "/" + name) {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) {
      if (errno == ENOENT)
        user_error("checkpoint file '", path_, "' is missing (a shard of tensor '", tensor, "' is in it)");
      user_error("cannot read checkpoint file '", path_, "': ", std::strerror(errno));
    }
    struct stat st {};
    if (::fstat(fd_, &st) != 0) user_error("cannot read checkpoint file '", path_, "': ", std::strerror(errno));
    size_ = st.st_size;
  }
  ~InFile() { ::close(fd_); }
  InFile(const InFile&) = delete;
  InFile& operator=(const InFile&) = delete;

  int64_t size() const { return size_; }
  // The piece's bytes, checked against its size and xxh3.
  void read_piece(char* out, const CheckpointPiece& p, const std::string& tensor) const {
    if (p.byte_offset + p.bytes > size_)
      user_error("checkpoint file '", path_, "' is truncated: ", size_, " bytes, but tensor '", tensor,
                 "' has a shard at bytes ", p.byte_offset, "..", p.byte_offset + p.bytes);
    int64_t done = 0;
    while (done < p.bytes) {
      const ssize_t r = ::pread(fd_, out + done, static_cast<size_t>(p.bytes - done), p.byte_offset + done);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0)
        user_error("cannot read checkpoint file '", path_, "': ", r < 0 ? std::strerror(errno) : "unexpected end");
      done += r;
    }
    const uint64_t h = hash_bytes(out, static_cast<size_t>(p.bytes));
    if (h != p.xxh3)
      user_error("checkpoint file '", path_, "' is corrupt: the shard of tensor '", tensor, "' at bytes ",
                 p.byte_offset, "..", p.byte_offset + p.bytes, " has xxh3 ", hex64(h), ", metadata.json says ",
                 hex64(p.xxh3));
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;
};

// ---- metadata text ----

// metadata.json = {"xxh3":"<16 hex digits>","metadata":BODY}\n with the hash over BODY's exact text.
constexpr std::string_view kMetaHead = "{\"xxh3\":\"";
constexpr std::string_view kMetaMid = "\",\"metadata\":";
constexpr size_t kMetaPrefix = kMetaHead.size() + 16 + kMetaMid.size();

std::string wrap_metadata(const std::string& body) {
  return std::string(kMetaHead) + hex64(hash_bytes(body.data(), body.size())) + std::string(kMetaMid) + body + "}\n";
}

ojson shape_json(const std::vector<int64_t>& dims) { return ojson(dims); }

DType dtype_of(const std::string& s, const std::string& file, const std::string& tensor) {
  if (s == "f32") return DType::f32;
  if (s == "bf16") return DType::bf16;
  user_error("checkpoint file '", file, "': tensor '", tensor, "' has unknown dtype '", s, "'");
}

void add_info(ojson& j, const CheckpointInfo& info) {
  j["step"] = info.step;
  j["samples_consumed"] = info.samples_consumed;
  j["tokens_consumed"] = info.tokens_consumed;
  if (info.skipped_steps > 0) j["skipped_steps"] = info.skipped_steps;
  j["rng"] = {{"generator", "philox4x32-10"}, {"seed", info.seed}};
  j["lr_scheduler"] = {{"schedule", info.lr_schedule}, {"step", info.step}, {"last_lr", info.lr}};
  const CheckpointLayout& l = info.layout;
  j["layout"] = {{"world", l.world}, {"tp", l.tp}, {"cp", l.cp},   {"dp", l.dp},
                 {"pp", l.pp},       {"ep", l.ep}, {"etp", l.etp}, {"distributed_optimizer", l.distributed_optimizer}};
  j["config"] = info.config_toml;
}

uint64_t parse_hex64(const std::string& s, const std::string& file) {
  if (s.size() != 16 || s.find_first_not_of("0123456789abcdef") != std::string::npos)
    user_error("checkpoint file '", file, "': '", s, "' is not a 16-digit hex hash");
  return std::stoull(s, nullptr, 16);
}

// Typed reads of metadata.json fields: a missing field or one of another type is a user error
// naming the file and the field's path.
struct MetaFields {
  const std::string& file;

  [[noreturn]] void wrong(const std::string& path, const ojson& v, const char* want) const {
    std::string text = v.dump();
    if (text.size() > 40) text = text.substr(0, 37) + "...";
    user_error("checkpoint file '", file, "': field '", path, "' is ", text, ", not ", want);
  }
  const ojson& at(const ojson& obj, const char* key, const std::string& path) const {
    if (!obj.is_object())
      wrong(path.substr(0, path.rfind('.') == std::string::npos ? 0 : path.rfind('.')), obj, "an object");
    const auto it = obj.find(key);
    if (it == obj.end()) user_error("checkpoint file '", file, "' has no field '", path, "'");
    return *it;
  }
  int64_t integer(const ojson& obj, const char* key, const std::string& path) const {
    const ojson& v = at(obj, key, path);
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX)))
      wrong(path, v, "an integer");
    return v.get<int64_t>();
  }
  int int32(const ojson& obj, const char* key, const std::string& path) const {
    const ojson& v = at(obj, key, path);
    const int64_t i = integer(obj, key, path);
    if (i < INT32_MIN || i > INT32_MAX) wrong(path, v, "a 32-bit integer");
    return static_cast<int>(i);
  }
  uint64_t unsigned_integer(const ojson& obj, const char* key, const std::string& path) const {
    const ojson& v = at(obj, key, path);
    if (!v.is_number_unsigned()) wrong(path, v, "an unsigned integer");
    return v.get<uint64_t>();
  }
  double number(const ojson& obj, const char* key, const std::string& path) const {
    const ojson& v = at(obj, key, path);
    if (!v.is_number()) wrong(path, v, "a number");
    return v.get<double>();
  }
  bool boolean(const ojson& obj, const char* key, const std::string& path) const {
    const ojson& v = at(obj, key, path);
    if (!v.is_boolean()) wrong(path, v, "true or false");
    return v.get<bool>();
  }
  std::string string(const ojson& obj, const char* key, const std::string& path) const {
    const ojson& v = at(obj, key, path);
    if (!v.is_string()) wrong(path, v, "a string");
    return v.get<std::string>();
  }
  const ojson& array(const ojson& obj, const char* key, const std::string& path) const {
    const ojson& v = at(obj, key, path);
    if (!v.is_array()) wrong(path, v, "an array");
    return v;
  }
  std::vector<int64_t> integers(const ojson& obj, const char* key, const std::string& path) const {
    const ojson& v = array(obj, key, path);
    std::vector<int64_t> out;
    for (const ojson& e : v) {
      if (!e.is_number_integer() || (e.is_number_unsigned() && e.get<uint64_t>() > uint64_t(INT64_MAX)))
        wrong(path, v, "an array of integers");
      out.push_back(e.get<int64_t>());
    }
    return out;
  }
};

// Whether the boxes [ao, ao + as) and [bo, bo + bs) intersect.
bool boxes_intersect(const std::vector<int64_t>& ao, const Shape& as, const std::vector<int64_t>& bo, const Shape& bs) {
  for (size_t k = 0; k < ao.size(); ++k)
    if (std::max(ao[k], bo[k]) >= std::min(ao[k] + as.dims()[k], bo[k] + bs.dims()[k])) return false;
  return true;
}

// A stored piece whose bytes are at data, as a shard.
StateShard piece_view(const CheckpointTensor& t, const CheckpointPiece& p, char* data) {
  StateShard s;
  s.name = t.name;
  s.dtype = t.dtype;
  s.global_shape = t.global_shape;
  s.box_offset = p.box_offset;
  s.box_shape = p.box_shape;
  s.flat_begin = p.flat_begin;
  s.flat_end = p.flat_end;
  s.data = data;
  s.writer = false;
  return s;
}

void check_pieces(const CheckpointTensor& t, const std::string& file) {
  const int64_t numel = t.global_shape.numel();
  int64_t covered = 0;
  for (const CheckpointPiece& p : t.pieces) {
    bool ok =
        static_cast<int>(p.box_offset.size()) == t.global_shape.rank() && p.box_shape.rank() == t.global_shape.rank();
    for (int k = 0; ok && k < t.global_shape.rank(); ++k)
      ok = p.box_offset[k] >= 0 && p.box_shape[k] >= 0 && p.box_offset[k] + p.box_shape[k] <= t.global_shape[k];
    ok = ok && 0 <= p.flat_begin && p.flat_begin <= p.flat_end && p.flat_end <= p.box_shape.numel() &&
         p.bytes == (p.flat_end - p.flat_begin) * static_cast<int64_t>(dtype_size(t.dtype)) && p.byte_offset >= 0;
    if (!ok)
      user_error("checkpoint file '", file, "': tensor '", t.name, "' has a shard outside its shape ",
                 t.global_shape.to_string());
    covered += p.flat_end - p.flat_begin;
  }
  for (size_t i = 0; i < t.pieces.size(); ++i)
    for (size_t j = i + 1; j < t.pieces.size(); ++j) {
      const CheckpointPiece &a = t.pieces[i], &b = t.pieces[j];
      const bool same_box = a.box_offset == b.box_offset && a.box_shape == b.box_shape;
      const bool overlap = same_box ? std::max(a.flat_begin, b.flat_begin) < std::min(a.flat_end, b.flat_end)
                                    : a.flat_end > a.flat_begin && b.flat_end > b.flat_begin &&
                                          boxes_intersect(a.box_offset, a.box_shape, b.box_offset, b.box_shape);
      if (overlap) user_error("checkpoint file '", file, "': tensor '", t.name, "' has overlapping shards");
    }
  if (covered != numel)
    user_error("checkpoint file '", file, "': tensor '", t.name, "' is incomplete: its shards hold ", covered, " of ",
               numel, " elements (a shard is missing)");
}

}  // namespace

int64_t copy_overlap(const StateShard& dst, const StateShard& src) {
  const char* sp = static_cast<const char*>(src.data);
  const size_t es = dtype_size(dst.dtype);
  char* dp = static_cast<char*>(dst.data);
  if (!boxes_intersect(dst.box_offset, dst.box_shape, src.box_offset, src.box_shape)) return 0;
  // The same box (whole tensors, flat shards of one box): one flat intersection.
  if (dst.box_offset == src.box_offset && dst.box_shape == src.box_shape) {
    const int64_t a = std::max(dst.flat_begin, src.flat_begin), b = std::min(dst.flat_end, src.flat_end);
    if (a >= b) return 0;
    std::memcpy(dp + (a - dst.flat_begin) * es, sp + (a - src.flat_begin) * es, static_cast<size_t>(b - a) * es);
    return b - a;
  }
  const int R = dst.global_shape.rank();
  const std::vector<int64_t>& dd = dst.box_shape.dims();
  const std::vector<int64_t>& sd = src.box_shape.dims();
  const int64_t inner = dd[R - 1];
  std::vector<int64_t> g(static_cast<size_t>(R));
  int64_t copied = 0;
  for (int64_t f = dst.flat_begin; f < dst.flat_end;) {
    const int64_t row = f / inner, col = f % inner;
    const int64_t run_end = std::min(dst.flat_end, (row + 1) * inner);
    const int64_t len = run_end - f;
    // Global coordinates of the run's first element.
    int64_t r = row;
    bool inside = true;
    for (int k = R - 2; k >= 0; --k) {
      g[k] = dst.box_offset[k] + r % dd[k];
      r /= dd[k];
      if (g[k] < src.box_offset[k] || g[k] >= src.box_offset[k] + sd[k]) inside = false;
    }
    const int64_t g0 = dst.box_offset[R - 1] + col;
    const int64_t a = std::max(g0, src.box_offset[R - 1]), b = std::min(g0 + len, src.box_offset[R - 1] + sd[R - 1]);
    if (inside && a < b) {
      int64_t sf = 0;
      for (int k = 0; k < R - 1; ++k) sf = sf * sd[k] + (g[k] - src.box_offset[k]);
      sf = sf * sd[R - 1] + (a - src.box_offset[R - 1]);
      const int64_t sa = std::max(sf, src.flat_begin), sb = std::min(sf + (b - a), src.flat_end);
      if (sa < sb) {
        const int64_t df = f + (a - g0) + (sa - sf);
        std::memcpy(dp + (df - dst.flat_begin) * es, sp + (sa - src.flat_begin) * es,
                    static_cast<size_t>(sb - sa) * es);
        copied += sb - sa;
      }
    }
    f = run_end;
  }
  return copied;
}

namespace {

const std::regex& step_dir_pattern() {
  static const std::regex re("step-([0-9]{8})");
  return re;
}

}  // namespace

std::vector<std::pair<int64_t, std::string>> complete_checkpoints(const std::string& root) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const fs::directory_entry& e : fs::directory_iterator(root, ec)) {
    std::smatch m;
    const std::string name = e.path().filename().string();
    if (e.is_directory() && std::regex_match(name, m, step_dir_pattern()) && fs::exists(e.path() / "metadata.json"))
      out.emplace_back(std::stoll(m[1].str()), e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

namespace {

// Removes the step-NNNNNNNN.tmp directories under root: saves that a crash interrupted.
void remove_partial_checkpoints(const std::string& root, std::error_code& ec) {
  static const std::regex partial("step-[0-9]{8}\\.tmp");
  std::vector<fs::path> stale;
  for (const fs::directory_entry& e : fs::directory_iterator(root, ec))
    if (std::regex_match(e.path().filename().string(), partial) && e.is_directory()) stale.push_back(e.path());
  for (const fs::path& p : stale)
    if (!ec) fs::remove_all(p, ec);
}

}  // namespace

void inject_checkpoint_write_fault(int64_t bytes, int error) {
  std::lock_guard<std::mutex> lock(fault_mutex);
  fault_budget = bytes;
  fault_errno = error;
}

// ---- reading ----

const CheckpointTensor* CheckpointMetadata::find(const std::string& name) const {
  for (const CheckpointTensor& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

CheckpointMetadata read_checkpoint_metadata(const std::string& dir) {
  const std::string file = dir + "/metadata.json";
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) user_error("checkpoint '", dir, "' does not exist or is not a directory");
  if (!fs::exists(file, ec)) user_error("checkpoint '", dir, "' has no metadata.json: not a (complete) checkpoint");
  std::string text;
  {
    std::FILE* f = std::fopen(file.c_str(), "rb");
    if (!f) user_error("cannot read '", file, "': ", std::strerror(errno));
    char buf[1 << 16];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, n);
    std::fclose(f);
  }
  ojson wrapper;
  try {
    wrapper = ojson::parse(text);
  } catch (const std::exception&) {
    user_error("checkpoint file '", file, "' is corrupt or truncated: not valid JSON");
  }
  if (!wrapper.is_object() || !wrapper.contains("metadata") || !wrapper["metadata"].is_object())
    user_error("checkpoint file '", file, "' is not lockstep checkpoint metadata");
  const ojson& body = wrapper["metadata"];
  CheckpointMetadata meta;
  meta.dir = dir;
  try {
    const MetaFields m{file};
    meta.format_version = m.int32(body, "format_version", "format_version");
    // A different version may frame its metadata differently: say so before checking the frame.
    if (meta.format_version != kCheckpointFormatVersion)
      user_error("checkpoint file '", file, "' has format version ", meta.format_version,
                 "; this lockstep reads version ", kCheckpointFormatVersion);
    const bool framed = text.size() > kMetaPrefix + 2 && text.compare(0, kMetaHead.size(), kMetaHead) == 0 &&
                        text.compare(kMetaHead.size() + 16, kMetaMid.size(), kMetaMid) == 0 &&
                        text.compare(text.size() - 2, 2, "}\n") == 0;
    if (!framed) user_error("checkpoint file '", file, "' is corrupt: unexpected framing");
    const uint64_t want = parse_hex64(text.substr(kMetaHead.size(), 16), file);
    const uint64_t got = hash_bytes(text.data() + kMetaPrefix, text.size() - kMetaPrefix - 2);
    if (got != want)
      user_error("checkpoint file '", file, "' is corrupt: its xxh3 is ", hex64(got), ", its header says ",
                 hex64(want));
    // Every field read is checked for its exact type (nlohmann would turn true or 2.5 into an int),
    // naming the field: verify must not pass metadata that load or inspect would misread.
    CheckpointInfo& info = meta.info;
    info.step = m.integer(body, "step", "step");
    info.samples_consumed = m.integer(body, "samples_consumed", "samples_consumed");
    info.tokens_consumed = m.integer(body, "tokens_consumed", "tokens_consumed");
    if (body.contains("skipped_steps")) info.skipped_steps = m.integer(body, "skipped_steps", "skipped_steps");
    if (info.skipped_steps < 0 || info.skipped_steps > info.step)
      user_error("checkpoint file '", file, "': skipped_steps = ", info.skipped_steps, " is not in [0, step]");
    info.seed = m.unsigned_integer(m.at(body, "rng", "rng"), "seed", "rng.seed");
    const ojson& sched = m.at(body, "lr_scheduler", "lr_scheduler");
    info.lr_schedule = m.string(sched, "schedule", "lr_scheduler.schedule");
    info.lr = m.number(sched, "last_lr", "lr_scheduler.last_lr");
    info.config_toml = m.string(body, "config", "config");
    const ojson& l = m.at(body, "layout", "layout");
    auto layout_int = [&](const char* key) { return m.int32(l, key, str("layout.", key)); };
    info.layout = {layout_int("world"), layout_int("tp"),
                   layout_int("cp"),    layout_int("dp"),
                   layout_int("pp"),    layout_int("ep"),
                   layout_int("etp"),   m.boolean(l, "distributed_optimizer", "layout.distributed_optimizer")};
    const ojson& files = m.array(body, "files", "files");
    for (size_t i = 0; i < files.size(); ++i) {
      const std::string at = str("files[", i, "].");
      meta.files.push_back({m.string(files[i], "name", at + "name"), m.integer(files[i], "bytes", at + "bytes"),
                            parse_hex64(m.string(files[i], "xxh3", at + "xxh3"), file)});
    }
    const ojson& tensors = m.array(body, "tensors", "tensors");
    for (size_t i = 0; i < tensors.size(); ++i) {
      const ojson& t = tensors[i];
      const std::string at = str("tensors[", i, "].");
      CheckpointTensor ct;
      ct.name = m.string(t, "name", at + "name");
      ct.dtype = dtype_of(m.string(t, "dtype", at + "dtype"), file, ct.name);
      ct.global_shape = Shape(m.integers(t, "shape", at + "shape"));
      const ojson& shards = m.array(t, "shards", at + "shards");
      for (size_t k = 0; k < shards.size(); ++k) {
        const ojson& p = shards[k];
        const std::string sat = str(at, "shards[", k, "].");
        CheckpointPiece cp;
        cp.box_offset = m.integers(p, "offset", sat + "offset");
        cp.box_shape = Shape(m.integers(p, "shape", sat + "shape"));
        const std::vector<int64_t> flat = m.integers(p, "flat", sat + "flat");
        if (flat.size() != 2)
          user_error("checkpoint file '", file, "': field '", sat, "flat' has ", flat.size(), " entries, not 2");
        cp.flat_begin = flat[0];
        cp.flat_end = flat[1];
        cp.file = m.string(p, "file", sat + "file");
        cp.byte_offset = m.integer(p, "byte_offset", sat + "byte_offset");
        cp.bytes = m.integer(p, "bytes", sat + "bytes");
        cp.xxh3 = parse_hex64(m.string(p, "xxh3", sat + "xxh3"), file);
        ct.pieces.push_back(std::move(cp));
      }
      check_pieces(ct, file);
      meta.tensors.push_back(std::move(ct));
    }
  } catch (const nlohmann::json::exception& e) {
    user_error("checkpoint file '", file, "' is missing a field or has a wrong type: ", e.what());
  }
  return meta;
}

std::string checkpoint_dir(const std::string& checkpoints_root, int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(step));
  return (fs::path(checkpoints_root) / name).string();
}

std::string latest_checkpoint(const std::string& checkpoints_root) {
  const auto all = complete_checkpoints(checkpoints_root);
  return all.empty() ? "" : all.back().second;
}

std::string find_checkpoint(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) user_error("checkpoint '", path, "' does not exist or is not a directory");
  if (fs::exists(fs::path(path) / "metadata.json", ec)) return path;
  // A run directory: the newest of its checkpoints/.
  const fs::path run_checkpoints = fs::path(path) / "checkpoints";
  const std::string latest = latest_checkpoint(fs::is_directory(run_checkpoints, ec) ? run_checkpoints.string() : path);
  if (latest.empty())
    user_error("'", path, "' is not a checkpoint (no metadata.json) and holds no complete step-NNNNNNNN checkpoint",
               fs::is_directory(run_checkpoints, ec) ? " in checkpoints/" : "");
  return latest;
}

std::string resolve_resume(const std::string& resume, const std::string& checkpoints_root) {
  if (resume == "auto") return latest_checkpoint(checkpoints_root);
  try {
    return find_checkpoint(resume);
  } catch (const UserError& e) {
    user_error("train.resume = \"", resume, "\": ", e.what());
  }
}

CheckpointInfo load_checkpoint(const std::string& dir, const std::vector<StateShard>& state) {
  const CheckpointMetadata meta = read_checkpoint_metadata(dir);
  const std::string mfile = dir + "/metadata.json";
  // The shards wanted from each stored tensor.
  std::map<std::string, std::vector<const StateShard*>> wanted;
  for (const StateShard& s : state) {
    const CheckpointTensor* t = meta.find(s.name);
    if (!t)
      user_error("checkpoint file '", mfile, "' has no tensor '", s.name,
                 "', which this run has: it cannot be "
                 "resharded into this run (compare the config in metadata.json)");
    if (t->global_shape != s.global_shape || t->dtype != s.dtype)
      user_error("checkpoint file '", mfile, "': tensor '", s.name, "' is ", dtype_name(t->dtype), " ",
                 t->global_shape.to_string(), ", this run has ", dtype_name(s.dtype), " ", s.global_shape.to_string(),
                 ": it cannot be resharded into this run (compare the config in metadata.json)");
    wanted[s.name].push_back(&s);
  }
  std::map<std::string, std::unique_ptr<InFile>> files;
  std::map<const StateShard*, int64_t> filled;
  std::vector<char> buf;
  for (const CheckpointTensor& t : meta.tensors) {
    auto w = wanted.find(t.name);
    if (w == wanted.end()) continue;
    for (const CheckpointPiece& p : t.pieces) {
      bool needed = false;
      for (const StateShard* s : w->second)
        needed = needed || boxes_intersect(s->box_offset, s->box_shape, p.box_offset, p.box_shape);
      if (!needed || p.bytes == 0) continue;
      std::unique_ptr<InFile>& f = files[p.file];
      if (!f) f = std::make_unique<InFile>(dir, p.file, t.name);
      buf.resize(static_cast<size_t>(p.bytes));
      f->read_piece(buf.data(), p, t.name);
      const StateShard stored = piece_view(t, p, buf.data());
      for (const StateShard* s : w->second) filled[s] += copy_overlap(*s, stored);
    }
  }
  for (const StateShard& s : state)
    LOCKSTEP_CHECK(filled[&s] == s.numel(), "checkpoint '", dir, "': shard of '", s.name, "' filled ", filled[&s],
                   " of ", s.numel(), " elements");
  return meta.info;
}

std::vector<char> read_checkpoint_tensor(const CheckpointMetadata& meta, const CheckpointTensor& t) {
  std::vector<char> out(static_cast<size_t>(t.global_shape.numel()) * dtype_size(t.dtype));
  StateShard whole = whole_tensor(t.name, t.global_shape, out.data(), false, t.dtype);
  std::map<std::string, std::unique_ptr<InFile>> files;
  std::vector<char> buf;
  for (const CheckpointPiece& p : t.pieces) {
    if (p.bytes == 0) continue;
    std::unique_ptr<InFile>& f = files[p.file];
    if (!f) f = std::make_unique<InFile>(meta.dir, p.file, t.name);
    buf.resize(static_cast<size_t>(p.bytes));
    f->read_piece(buf.data(), p, t.name);
    copy_overlap(whole, piece_view(t, p, buf.data()));
  }
  return out;
}

void verify_checkpoint(const std::string& dir) {
  const CheckpointMetadata meta = read_checkpoint_metadata(dir);
  // Every piece, in file order, with its tensor's name for the messages.
  struct Ref {
    const CheckpointPiece* piece;
    const std::string* tensor;
  };
  std::map<std::string, std::vector<Ref>> by_file;
  for (const CheckpointTensor& t : meta.tensors)
    for (const CheckpointPiece& p : t.pieces) by_file[p.file].push_back({&p, &t.name});
  for (const auto& [name, refs] : by_file)
    if (std::none_of(meta.files.begin(), meta.files.end(), [&](const CheckpointFile& f) { return f.name == name; }))
      user_error("checkpoint file '", dir, "/metadata.json': tensor '", *refs[0].tensor, "' is in file '", name,
                 "', which the file list lacks");
  std::vector<char> buf;
  for (const CheckpointFile& f : meta.files) {
    std::vector<Ref>& refs = by_file[f.name];
    std::sort(refs.begin(), refs.end(),
              [](const Ref& a, const Ref& b) { return a.piece->byte_offset < b.piece->byte_offset; });
    const InFile in(dir, f.name, refs.empty() ? "(none)" : *refs[0].tensor);
    Hasher h;
    int64_t at = 0;
    for (const Ref& r : refs) {
      if (r.piece->byte_offset != at)
        user_error("checkpoint file '", dir, "/metadata.json': the shards in '", f.name,
                   "' do not follow each other (tensor '", *r.tensor, "')");
      buf.resize(static_cast<size_t>(r.piece->bytes));
      in.read_piece(buf.data(), *r.piece, *r.tensor);
      h.update(buf.data(), buf.size());
      at += r.piece->bytes;
    }
    if (in.size() != f.bytes || at != f.bytes)
      user_error("checkpoint file '", in.path(), "' has ", in.size(), " bytes, metadata.json says ", f.bytes);
    if (h.digest() != f.xxh3)
      user_error("checkpoint file '", in.path(), "' is corrupt: xxh3 ", hex64(h.digest()), ", metadata.json says ",
                 hex64(f.xxh3));
  }
}

// ---- writing ----

namespace {

// One piece this rank writes: where its bytes come from, and the record metadata.json keeps.
struct OutPiece {
  std::string name;
  DType dtype;
  Shape global_shape;
  std::vector<int64_t> box_offset;
  Shape box_shape;
  int64_t flat_begin, flat_end;
  const char* src;
  int64_t bytes;
  int64_t byte_offset = 0;
  uint64_t xxh3 = 0;
};

// Writes the pieces back to back into path, fsynced; fills their offsets and hashes. Returns the
// file's xxh3.
uint64_t write_pieces(const std::string& path, std::vector<OutPiece>& pieces) {
  OutFile out(path);
  Hasher file_hash;
  int64_t at = 0;
  for (OutPiece& p : pieces) {
    p.byte_offset = at;
    p.xxh3 = hash_bytes(p.src, static_cast<size_t>(p.bytes));
    out.write(p.src, static_cast<size_t>(p.bytes));
    file_hash.update(p.src, static_cast<size_t>(p.bytes));
    at += p.bytes;
  }
  out.commit();
  return file_hash.digest();
}

std::string rank_file_name(int rank) {
  char name[32];
  std::snprintf(name, sizeof name, "rank-%05d.bin", rank);
  return name;
}

}  // namespace

struct CheckpointSaver::Impl {
  std::string root;
  int64_t keep_last;
  bool async;
  Communicator& comm;

  // The save in flight.
  bool pending = false;
  CheckpointInfo info;
  std::string tmp_dir, final_dir;
  std::vector<OutPiece> pieces;
  std::vector<char> staging;       // async: a copy of the pieces, reused from save to save
  std::future<std::string> write;  // "" or the write's error message
  uint64_t file_hash = 0;

  Impl(std::string r, int64_t k, bool a, Communicator& c) : root(std::move(r)), keep_last(k), async(a), comm(c) {}

  // This rank's data file; returns "" or the error.
  std::string write_rank_file() {
    try {
      if (!pieces.empty()) file_hash = write_pieces(tmp_dir + "/" + rank_file_name(comm.rank()), pieces);
      return "";
    } catch (const UserError& e) {
      return e.what();
    }
  }

  // This rank's part of metadata.json, or its error.
  std::string rank_report(const std::string& error) const {
    ojson j;
    j["error"] = error;
    if (!pieces.empty()) {
      int64_t bytes = 0;
      for (const OutPiece& p : pieces) bytes += p.bytes;
      j["file"] = {{"name", rank_file_name(comm.rank())}, {"bytes", bytes}, {"xxh3", hex64(file_hash)}};
    }
    ojson ps = ojson::array();
    for (const OutPiece& p : pieces)
      ps.push_back({{"name", p.name},
                    {"dtype", dtype_name(p.dtype)},
                    {"shape", shape_json(p.global_shape.dims())},
                    {"offset", shape_json(p.box_offset)},
                    {"box", shape_json(p.box_shape.dims())},
                    {"flat", {p.flat_begin, p.flat_end}},
                    {"byte_offset", p.byte_offset},
                    {"bytes", p.bytes},
                    {"xxh3", hex64(p.xxh3)}});
    j["pieces"] = std::move(ps);
    return j.dump();
  }

  // Rank 0: metadata.json from every rank's report, then the atomic rename and pruning.
  void commit_on_leader(const std::vector<std::string>& reports) {
    ojson body;
    body["format"] = "lockstep-checkpoint";
    body["format_version"] = kCheckpointFormatVersion;
    add_info(body, info);
    ojson files = ojson::array();
    ojson tensors = ojson::array();
    std::map<std::string, size_t> index;
    for (const std::string& text : reports) {
      const ojson r = ojson::parse(text);
      if (r.contains("file")) files.push_back(r["file"]);
      const std::string file = r.contains("file") ? r["file"]["name"].get<std::string>() : "";
      for (const ojson& p : r["pieces"]) {
        const std::string name = p["name"].get<std::string>();
        auto it = index.find(name);
        if (it == index.end()) {
          it = index.emplace(name, tensors.size()).first;
          tensors.push_back({{"name", name}, {"dtype", p["dtype"]}, {"shape", p["shape"]}, {"shards", ojson::array()}});
        }
        ojson& t = tensors[it->second];
        LOCKSTEP_CHECK(t["shape"] == p["shape"] && t["dtype"] == p["dtype"], "ranks disagree on tensor '", name, "'");
        t["shards"].push_back({{"offset", p["offset"]},
                               {"shape", p["box"]},
                               {"flat", p["flat"]},
                               {"file", file},
                               {"byte_offset", p["byte_offset"]},
                               {"bytes", p["bytes"]},
                               {"xxh3", p["xxh3"]}});
      }
    }
    body["files"] = std::move(files);
    body["tensors"] = std::move(tensors);
    const std::string text = wrap_metadata(body.dump(1));
    {
      OutFile out(tmp_dir + "/metadata.json");
      out.write(text.data(), text.size());
      out.commit();
    }
    fsync_dir(tmp_dir);
    // An existing step directory (a run resumed from an older checkpoint reaches this step again)
    // is moved aside first: a directory cannot be renamed over a non-empty one.
    std::error_code ec;
    const std::string aside = final_dir + ".old";
    if (fs::exists(final_dir, ec)) {
      fs::remove_all(aside, ec);
      if (::rename(final_dir.c_str(), aside.c_str()) != 0)
        user_error("cannot move checkpoint '", final_dir, "' aside: ", std::strerror(errno));
    }
    if (::rename(tmp_dir.c_str(), final_dir.c_str()) != 0)
      user_error("cannot rename checkpoint '", tmp_dir, "' to '", final_dir, "': ", std::strerror(errno));
    fsync_dir(root);
    fs::remove_all(aside, ec);
    if (keep_last > 0) {
      auto all = complete_checkpoints(root);
      // The newest is the one just written (or a newer one): never pruned.
      for (size_t i = 0; i + static_cast<size_t>(keep_last) < all.size(); ++i) fs::remove_all(all[i].second, ec);
    }
  }

  void commit() {
    const std::string error = write.get();
    const std::vector<std::string> reports = all_gather_strings(comm, rank_report(error));
    std::string message;
    if (comm.rank() == 0) {
      for (const std::string& r : reports) {
        const std::string e = ojson::parse(r)["error"].get<std::string>();
        if (!e.empty() && message.empty()) message = e;
      }
      if (message.empty()) {
        try {
          commit_on_leader(reports);
        } catch (const UserError& e) {
          message = e.what();
        }
      }
      if (!message.empty()) {
        std::error_code ec;
        fs::remove_all(tmp_dir, ec);
        const std::string previous = latest_checkpoint(root);
        message =
            str("checkpoint at step ", info.step, " failed: ", message, "; ",
                previous.empty() ? "no earlier checkpoint exists" : "the latest complete checkpoint is " + previous);
      }
    }
    message = broadcast_string(comm, message);
    pending = false;
    pieces.clear();
    if (!message.empty()) user_error(message);
  }
};

CheckpointSaver::CheckpointSaver(std::string checkpoints_root, int64_t keep_last, bool async, Communicator& comm)
    : impl_(std::make_unique<Impl>(std::move(checkpoints_root), keep_last, async, comm)) {}

CheckpointSaver::~CheckpointSaver() {
  // An exception unwinding past a pending save: let the background write end before its buffers go.
  if (impl_->pending && impl_->write.valid()) impl_->write.wait();
}

bool CheckpointSaver::pending() const { return impl_->pending; }

void CheckpointSaver::save(const CheckpointInfo& info, const std::vector<StateShard>& state,
                           const std::function<void()>& after_write) {
  Impl& s = *impl_;
  if (s.pending) finish();
  Communicator& comm = s.comm;
  s.info = info;
  s.final_dir = checkpoint_dir(s.root, info.step);
  s.tmp_dir = s.final_dir + ".tmp";
  // Rank 0 prepares the directory, removing the partial ones of saves that a crash interrupted (no
  // save of this run is in flight: a pending one was finished above); the others wait.
  std::string message;
  if (comm.rank() == 0) {
    std::error_code ec;
    fs::create_directories(s.root, ec);
    if (!ec) remove_partial_checkpoints(s.root, ec);
    if (!ec) fs::create_directory(s.tmp_dir, ec);
    if (ec) message = str("checkpoint at step ", info.step, " failed: cannot create '", s.tmp_dir, "': ", ec.message());
  }
  message = broadcast_string(comm, message);
  if (!message.empty()) user_error(message);

  s.pieces.clear();
  int64_t total = 0;
  for (const StateShard& sh : state) {
    if (!sh.writer) continue;
    s.pieces.push_back({sh.name, sh.dtype, sh.global_shape, sh.box_offset, sh.box_shape, sh.flat_begin, sh.flat_end,
                        static_cast<const char*>(sh.data), static_cast<int64_t>(sh.nbytes())});
    total += static_cast<int64_t>(sh.nbytes());
  }
  s.pending = true;
  if (!s.async) {
    std::promise<std::string> done;
    done.set_value(s.write_rank_file());
    if (after_write) after_write();
    s.write = done.get_future();
    s.commit();
    return;
  }
  // Async: the step boundary pays for one copy; the background thread writes from the copy.
  s.staging.resize(static_cast<size_t>(total));
  int64_t at = 0;
  for (OutPiece& p : s.pieces) {
    std::memcpy(s.staging.data() + at, p.src, static_cast<size_t>(p.bytes));
    p.src = s.staging.data() + at;
    at += p.bytes;
  }
  s.write = std::async(std::launch::async, [&s, after_write] {
    std::string error = s.write_rank_file();
    if (after_write) after_write();
    return error;
  });
}

void CheckpointSaver::poll() {
  Impl& s = *impl_;
  if (!s.pending) return;
  // Every rank commits at the same step: when all of them are done.
  int32_t busy = s.write.wait_for(std::chrono::seconds(0)) == std::future_status::ready ? 0 : 1;
  s.comm.all_reduce(&busy, 1, ReduceOp::max);
  if (!busy) s.commit();
}

void CheckpointSaver::finish() {
  Impl& s = *impl_;
  if (s.pending) s.commit();
}

void set_param_from_whole(ParamStore& ps, int i, const float* whole) {
  const ParamSpec& p = ps.specs()[static_cast<size_t>(i)];
  std::vector<StateShard> mine;
  ps.shards_of(mine, i, p.name, 0, p.shape.numel(), ps.value(i), true, true, true);
  const StateShard src = whole_tensor(p.name, p.global_shape, const_cast<float*>(whole), false);
  for (const StateShard& s : mine) copy_overlap(s, src);
}

}  // namespace lockstep
