#include "lockstep/train/tensorboard.h"

#include <unistd.h>

#include <bit>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <string_view>

#include "lockstep/core/crc32c.h"
#include "lockstep/core/error.h"
#include "lockstep/train/run_dir.h"

namespace lockstep {

namespace {

namespace fs = std::filesystem;

// Protobuf's wire types.
enum Wire : uint32_t { kVarint = 0, kFixed64 = 1, kBytes = 2, kFixed32 = 5 };

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out += static_cast<char>((v >> (8 * i)) & 0xFF);
}

uint64_t get_le(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

void put_varint(std::string& out, uint64_t v) {
  for (; v >= 0x80; v >>= 7) out += static_cast<char>((v & 0x7F) | 0x80);
  out += static_cast<char>(v);
}

void put_key(std::string& out, uint32_t field, Wire wire) { put_varint(out, (field << 3) | wire); }

void put_bytes(std::string& out, uint32_t field, const std::string& bytes) {
  put_key(out, field, kBytes);
  put_varint(out, bytes.size());
  out += bytes;
}

// One field of a message: its number, wire type and value (the integer of a varint or fixed field,
// the bytes of a length-delimited one).
struct Field {
  uint32_t number = 0;
  Wire wire = kVarint;
  uint64_t integer = 0;
  std::string bytes;
};

// Reads a message's fields in order; UserError naming `what` when it is not well formed.
class FieldReader {
 public:
  FieldReader(const std::string& data, const char* what) : data_(data), what_(what) {}
  bool next(Field& f) {
    if (at_ == data_.size()) return false;
    const uint64_t key = varint();
    f.number = static_cast<uint32_t>(key >> 3);
    f.wire = static_cast<Wire>(key & 7);
    f.bytes.clear();
    switch (f.wire) {
      case kVarint:
        f.integer = varint();
        break;
      case kFixed64:
        f.integer = fixed(8);
        break;
      case kFixed32:
        f.integer = fixed(4);
        break;
      case kBytes: {
        const uint64_t n = varint();
        if (n > data_.size() - at_) fail("a field's length runs past the end");
        f.bytes = data_.substr(at_, n);
        at_ += n;
        break;
      }
      default:
        fail(str("wire type ", key & 7, " of field ", f.number, " is not one an Event uses"));
    }
    return true;
  }

 private:
  [[noreturn]] void fail(const std::string& why) const { user_error("malformed ", what_, " at byte ", at_, ": ", why); }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (at_ == data_.size()) fail("a varint runs past the end");
      const auto b = static_cast<unsigned char>(data_[at_++]);
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if (!(b & 0x80)) return v;
    }
    fail("a varint longer than 10 bytes");
  }
  uint64_t fixed(int bytes) {
    if (data_.size() - at_ < static_cast<size_t>(bytes)) fail("a fixed-size field runs past the end");
    const uint64_t v = get_le(data_.data() + at_, bytes);
    at_ += static_cast<size_t>(bytes);
    return v;
  }

  const std::string& data_;
  const char* what_;
  size_t at_ = 0;
};

std::string read_file(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) user_error("cannot open '", path, "': ", std::strerror(errno));
  std::string text;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, n);
  const bool failed = std::ferror(f);
  std::fclose(f);
  if (failed) user_error("cannot read '", path, "'");
  return text;
}

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0 || !name[0]) return "localhost";
  return name;
}

}  // namespace

uint32_t tfrecord_crc(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string tfrecord(const std::string& data) {
  std::string out;
  put_le(out, data.size(), 8);
  put_le(out, tfrecord_crc(out.data(), 8), 4);
  out += data;
  put_le(out, tfrecord_crc(data.data(), data.size()), 4);
  return out;
}

TfRecords read_tfrecords(const std::string& path) {
  const std::string text = read_file(path);
  TfRecords out;
  size_t at = 0;
  while (at < text.size()) {
    if (text.size() - at < 12) {
      out.error = str("byte ", at, ": a record's header is cut off (", text.size() - at, " of 12 bytes)");
      break;
    }
    const uint64_t length = get_le(text.data() + at, 8);
    if (get_le(text.data() + at + 8, 4) != tfrecord_crc(text.data() + at, 8)) {
      out.error = str("byte ", at, ": the CRC of the record's length does not match");
      break;
    }
    if (length > text.size() - at - 12 || text.size() - at - 12 - length < 4) {
      out.error = str("byte ", at, ": the record (", length, " bytes) is cut off");
      break;
    }
    const char* data = text.data() + at + 12;
    if (get_le(data + length, 4) != tfrecord_crc(data, length)) {
      out.error = str("byte ", at, ": the CRC of the record's data does not match");
      break;
    }
    out.records.emplace_back(data, length);
    at += 12 + length + 4;
  }
  return out;
}

std::string encode_event(const TensorBoardEvent& event) {
  // As protobuf serialises proto3: fields in number order, those at their default value left out.
  std::string out;
  if (event.wall_time != 0) {
    put_key(out, 1, kFixed64);
    put_le(out, std::bit_cast<uint64_t>(event.wall_time), 8);
  }
  if (event.step != 0) {
    put_key(out, 2, kVarint);
    put_varint(out, static_cast<uint64_t>(event.step));
  }
  if (!event.file_version.empty()) put_bytes(out, 3, event.file_version);
  if (!event.scalars.empty()) {
    std::string summary;
    for (const auto& [tag, value] : event.scalars) {
      std::string v;
      put_bytes(v, 1, tag);
      put_key(v, 2, kFixed32);
      put_le(v, std::bit_cast<uint32_t>(value), 4);
      put_bytes(summary, 1, v);
    }
    put_bytes(out, 5, summary);
  }
  return out;
}

TensorBoardEvent decode_event(const std::string& data) {
  TensorBoardEvent event;
  FieldReader reader(data, "Event");
  for (Field f; reader.next(f);) {
    if (f.number == 1 && f.wire == kFixed64) event.wall_time = std::bit_cast<double>(f.integer);
    if (f.number == 2 && f.wire == kVarint) event.step = static_cast<int64_t>(f.integer);
    if (f.number == 3 && f.wire == kBytes) event.file_version = f.bytes;
    if (f.number != 5 || f.wire != kBytes) continue;
    FieldReader summary(f.bytes, "Summary");
    for (Field v; summary.next(v);) {
      if (v.number != 1 || v.wire != kBytes) continue;
      FieldReader value(v.bytes, "Summary.Value");
      std::string tag;
      bool simple = false;
      float x = 0;
      for (Field g; value.next(g);) {
        if (g.number == 1 && g.wire == kBytes) tag = g.bytes;
        if (g.number == 2 && g.wire == kFixed32)
          simple = true, x = std::bit_cast<float>(static_cast<uint32_t>(g.integer));
      }
      if (simple) event.scalars.emplace_back(tag, x);
    }
  }
  return event;
}

std::string tensorboard_tag(const std::string& key) {
  static const std::pair<const char*, const char*> kNumbered[] = {{"moe", "layer"}, {"pp", "stage"}};
  const size_t dot = key.find('.'), dot2 = dot == std::string::npos ? dot : key.find('.', dot + 1);
  if (dot2 == std::string::npos) return key;
  const std::string group = key.substr(0, dot), number = key.substr(dot + 1, dot2 - dot - 1);
  for (const auto& [name, word] : kNumbered)
    if (group == name) return group + "/" + word + number + "/" + key.substr(dot2 + 1);
  return key;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) user_error("cannot create '", dir, "': ", ec.message());
  const double now = unix_seconds();
  const std::string base =
      dir + "/events.out.tfevents." + std::to_string(static_cast<int64_t>(now)) + "." + host_name();
  // A resumed run may start within the second the previous one started in: "x" never opens a file
  // that is there. The suffixed name sorts after the plain one, as TensorBoard orders the files.
  for (int n = 0; !f_; ++n) {
    path_ = n ? base + "." + std::to_string(n) : base;
    f_ = std::fopen(path_.c_str(), "wbx");
    if (!f_ && errno != EEXIST) user_error("cannot create '", path_, "': ", std::strerror(errno));
  }
  append({.wall_time = now, .step = 0, .file_version = "brain.Event:2", .scalars = {}});
}

TensorBoardWriter::~TensorBoardWriter() {
  if (f_) std::fclose(f_);
}

void TensorBoardWriter::write(const std::string& json_line) {
  const nlohmann::ordered_json line = nlohmann::ordered_json::parse(json_line, nullptr, false);
  LOCKSTEP_CHECK(line.is_object() && line.contains("step"), "not a metrics line: ", json_line);
  TensorBoardEvent event{
      .wall_time = unix_seconds(), .step = line.at("step").get<int64_t>(), .file_version = "", .scalars = {}};
  auto scalar = [&](const std::string& tag, const nlohmann::ordered_json& v) {
    if (v.is_number())
      event.scalars.emplace_back(tag, static_cast<float>(v.get<double>()));
    else if (v.is_null())
      event.scalars.emplace_back(tag, std::numeric_limits<float>::quiet_NaN());
  };
  for (const auto& [key, value] : line.items()) {
    if (key == "step") continue;
    if (!value.is_array()) {
      scalar(tensorboard_tag(key), value);
      continue;
    }
    constexpr std::string_view kRanks = "_ranks";
    const bool per_rank = key.size() > kRanks.size() && key.ends_with(kRanks);
    const std::string stem = per_rank ? key.substr(0, key.size() - kRanks.size()) + "/rank" : key + "/";
    for (size_t i = 0; i < value.size(); ++i) scalar(stem + std::to_string(i), value[i]);
  }
  append(event);
}

void TensorBoardWriter::append(const TensorBoardEvent& event) {
  const std::string record = tfrecord(encode_event(event));
  if (std::fwrite(record.data(), 1, record.size(), f_) != record.size() || std::fflush(f_) != 0)
    user_error("cannot write '", path_, "': ", std::strerror(errno));
}

void cut_tensorboard_after_step(const std::string& dir, int64_t step) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!e.is_regular_file(ec) || name.find("tfevents") == std::string::npos || name.ends_with(".tmp")) continue;
    const TfRecords file = read_tfrecords(e.path().string());
    std::string kept;
    size_t records = 0;
    for (const std::string& data : file.records) {
      int64_t event_step = 0;
      try {
        event_step = decode_event(data).step;
      } catch (const UserError&) {
        break;  // as a record that does not verify
      }
      if (event_step > step) continue;
      kept += tfrecord(data);
      ++records;
    }
    if (records < file.records.size() || !file.error.empty()) write_file_atomic(e.path().string(), kept);
  }
}

}  // namespace lockstep
