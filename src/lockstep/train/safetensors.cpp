#include "lockstep/train/safetensors.h"

#include <bit>
#include <cstring>
#include <nlohmann/json.hpp>

#include "lockstep/core/error.h"
#include "lockstep/core/float_formats.h"
#include "lockstep/tensor/param_table.h"
#include "lockstep/train/checkpoint.h"
#include "lockstep/train/run_dir.h"

namespace lockstep {

using ojson = nlohmann::ordered_json;

namespace {

const char* safetensors_dtype(DType t) { return t == DType::f32 ? "F32" : "BF16"; }

// Bytes per element of the dtypes the format names; 0 for one it does not.
int64_t element_size(const std::string& dtype) {
  static const std::map<std::string, int64_t> sizes = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"I64", 8}, {"I32", 4},
      {"I16", 2}, {"I8", 1},  {"U8", 1},  {"BOOL", 1}, {"U16", 2},     {"U32", 4},     {"U64", 8}, {"F8_E8M0", 1}};
  const auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

// IEEE binary16 to fp32, exactly (subnormals, infinities and NaN included).
float half_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));
  const float mag = static_cast<float>(mant) * 0x1p-24f;  // subnormal or zero: exact in fp32
  return sign ? -mag : mag;
}

}  // namespace

void write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  ojson header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  int64_t at = 0;
  for (const SafetensorsTensor& t : tensors) {
    const int64_t bytes = t.shape.numel() * static_cast<int64_t>(dtype_size(t.dtype));
    header[t.name] = {
        {"dtype", safetensors_dtype(t.dtype)}, {"shape", t.shape.dims()}, {"data_offsets", {at, at + bytes}}};
    at += bytes;
  }
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  std::string content(8, '\0');
  const uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) content[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  content.reserve(8 + json.size() + static_cast<size_t>(at));
  content += json;
  for (const SafetensorsTensor& t : tensors)
    content.append(static_cast<const char*>(t.data), t.shape.numel() * dtype_size(t.dtype));
  write_file_atomic(path, content);
}

SafetensorsFile::SafetensorsFile(std::string path) : path_(std::move(path)), in_(path_, std::ios::binary) {
  if (!in_) user_error("cannot open '", path_, "'");
  in_.seekg(0, std::ios::end);
  const int64_t size = in_.tellg();
  in_.seekg(0);
  unsigned char len_bytes[8] = {};
  if (size < 8 || !in_.read(reinterpret_cast<char*>(len_bytes), 8))
    user_error("'", path_, "' is not a safetensors file (shorter than its 8-byte header length)");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(len_bytes[i]) << (8 * i);
  if (n > static_cast<uint64_t>(size - 8))
    user_error("'", path_, "' is not a safetensors file (header length ", n, " exceeds the file)");
  std::string text(n, '\0');
  in_.read(text.data(), static_cast<std::streamsize>(n));
  ojson header;
  try {
    header = ojson::parse(text);
  } catch (const std::exception&) {
    user_error("'", path_, "' is not a safetensors file (its header is not JSON)");
  }
  if (!header.is_object()) user_error("'", path_, "' is not a safetensors file (its header is not a JSON object)");
  data_start_ = 8 + static_cast<int64_t>(n);
  for (const auto& [name, t] : header.items()) {
    if (name == "__metadata__") {
      if (t.is_object())
        for (const auto& [k, v] : t.items())
          if (v.is_string()) metadata_[k] = v.get<std::string>();
      continue;
    }
    Entry e;
    try {
      e.dtype = t.at("dtype").get<std::string>();
      e.shape = Shape(t.at("shape").get<std::vector<int64_t>>());
      e.begin = t.at("data_offsets").at(0).get<int64_t>();
      e.end = t.at("data_offsets").at(1).get<int64_t>();
    } catch (const nlohmann::json::exception&) {
      user_error("'", path_, "': the header entry of tensor '", name, "' lacks dtype, shape or data_offsets");
    }
    const int64_t es = element_size(e.dtype);
    if (es == 0)
      user_error("'", path_, "': tensor '", name, "' has dtype '", e.dtype, "', which safetensors does not define");
    if (e.begin < 0 || e.end - e.begin != e.shape.numel() * es || data_start_ + e.end > size)
      user_error("'", path_, "': tensor '", name, "' has data offsets [", e.begin, ", ", e.end,
                 "] that do not fit its shape or the file");
    names_.push_back(name);
    entries_.emplace(name, std::move(e));
  }
}

const SafetensorsFile::Entry& SafetensorsFile::entry(const std::string& name) const {
  const auto it = entries_.find(name);
  if (it == entries_.end()) user_error("'", path_, "' has no tensor '", name, "'");
  return it->second;
}

std::vector<char> SafetensorsFile::bytes(const std::string& name) {
  const Entry& e = entry(name);
  std::vector<char> buf(static_cast<size_t>(e.end - e.begin));
  in_.clear();
  in_.seekg(data_start_ + e.begin);
  if (!in_.read(buf.data(), static_cast<std::streamsize>(buf.size()))) user_error("cannot read '", path_, "'");
  return buf;
}

std::vector<float> SafetensorsFile::floats(const std::string& name) {
  const Entry& e = entry(name);
  if (e.dtype != "F32" && e.dtype != "BF16" && e.dtype != "F16" && e.dtype != "F8_E4M3")
    user_error("'", path_, "': tensor '", name, "' is ", e.dtype, "; lockstep reads F32, BF16, F16 and F8_E4M3");
  const std::vector<char> buf = bytes(name);
  std::vector<float> out(static_cast<size_t>(e.shape.numel()));
  for (size_t k = 0; k < out.size(); ++k) {
    if (e.dtype == "F32") {
      std::memcpy(&out[k], buf.data() + 4 * k, 4);
    } else if (e.dtype == "F8_E4M3") {
      out[k] = decode(ElemFormat::e4m3, static_cast<uint8_t>(buf[k]));
    } else {
      uint16_t bits;
      std::memcpy(&bits, buf.data() + 2 * k, 2);
      out[k] = e.dtype == "BF16" ? to_f32(bf16{bits}) : half_to_f32(bits);
    }
  }
  return out;
}

void load_safetensors(const std::string& path, ParamStore& ps) {
  if (!std::ifstream(path)) user_error("train.init_from = \"", path, "\": cannot open the file");
  SafetensorsFile file(path);
  for (const std::string& name : file.names())
    if (ps.find(name) < 0)
      user_error("'", path, "' has tensor '", name,
                 "', which this model does not have (compare model.* with the exported model)");
  for (int i = 0; i < static_cast<int>(ps.specs().size()); ++i) {
    const ParamSpec& p = ps.specs()[i];
    if (!file.has(p.name))
      user_error("'", path, "' has no tensor '", p.name, "' (the model has it, shape ", p.shape.to_string(), ")");
    const SafetensorsFile::Entry& e = file.entry(p.name);
    if (e.shape != p.global_shape)
      user_error("'", path, "': tensor '", p.name, "' has shape ", e.shape.to_string(), ", the model's is ",
                 p.global_shape.to_string());
    if (e.dtype != "F32" && e.dtype != "BF16")
      user_error("'", path, "': tensor '", p.name, "' is ", e.dtype, "; lockstep reads F32 and BF16");
    std::vector<float> whole = file.floats(p.name);
    // This rank's boxes of the global tensor (all of it without tensor parallelism).
    set_param_from_whole(ps, i, whole.data());
  }
}

}  // namespace lockstep
