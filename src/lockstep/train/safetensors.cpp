#include "lockstep/train/safetensors.h"

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "lockstep/core/error.h"
#include "lockstep/tensor/param_table.h"
#include "lockstep/train/checkpoint.h"
#include "lockstep/train/run_dir.h"

namespace lockstep {

using ojson = nlohmann::ordered_json;

namespace {

const char* safetensors_dtype(DType t) { return t == DType::f32 ? "F32" : "BF16"; }

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

void load_safetensors(const std::string& path, ParamStore& ps) {
  std::ifstream f(path, std::ios::binary);
  if (!f) user_error("train.init_from = \"", path, "\": cannot open the file");
  f.seekg(0, std::ios::end);
  const int64_t size = f.tellg();
  f.seekg(0);
  unsigned char len_bytes[8] = {};
  if (size < 8 || !f.read(reinterpret_cast<char*>(len_bytes), 8))
    user_error("'", path, "' is not a safetensors file (shorter than its 8-byte header length)");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(len_bytes[i]) << (8 * i);
  if (n > static_cast<uint64_t>(size - 8))
    user_error("'", path, "' is not a safetensors file (header length ", n, " exceeds the file)");
  std::string text(n, '\0');
  f.read(text.data(), static_cast<std::streamsize>(n));
  ojson header;
  try {
    header = ojson::parse(text);
  } catch (const std::exception&) {
    user_error("'", path, "' is not a safetensors file (its header is not JSON)");
  }
  const int64_t data_start = 8 + static_cast<int64_t>(n);
  for (const auto& [name, _] : header.items())
    if (name != "__metadata__" && ps.find(name) < 0)
      user_error("'", path, "' has tensor '", name,
                 "', which this model does not have (compare model.* with the exported model)");
  std::vector<char> buf;
  for (int i = 0; i < static_cast<int>(ps.specs().size()); ++i) {
    const ParamSpec& p = ps.specs()[i];
    if (!header.contains(p.name))
      user_error("'", path, "' has no tensor '", p.name, "' (the model has it, shape ", p.shape.to_string(), ")");
    const ojson& t = header[p.name];
    try {
      const std::string dtype = t.at("dtype").get<std::string>();
      const Shape shape(t.at("shape").get<std::vector<int64_t>>());
      const int64_t begin = t.at("data_offsets").at(0).get<int64_t>(), end = t.at("data_offsets").at(1).get<int64_t>();
      if (shape != p.global_shape)
        user_error("'", path, "': tensor '", p.name, "' has shape ", shape.to_string(), ", the model's is ",
                   p.global_shape.to_string());
      if (dtype != "F32" && dtype != "BF16")
        user_error("'", path, "': tensor '", p.name, "' is ", dtype, "; lockstep reads F32 and BF16");
      const int64_t es = dtype == "F32" ? 4 : 2;
      if (begin < 0 || end - begin != shape.numel() * es || data_start + end > size)
        user_error("'", path, "': tensor '", p.name, "' has data offsets [", begin, ", ", end,
                   "] that do not fit its shape or the file");
      buf.resize(static_cast<size_t>(end - begin));
      f.seekg(data_start + begin);
      if (!f.read(buf.data(), static_cast<std::streamsize>(buf.size()))) user_error("cannot read '", path, "'");
      std::vector<float> whole(static_cast<size_t>(shape.numel()));
      if (es == 4) {
        std::memcpy(whole.data(), buf.data(), buf.size());
      } else {
        for (int64_t k = 0; k < shape.numel(); ++k) {
          bf16 b;
          std::memcpy(&b.bits, buf.data() + 2 * k, 2);
          whole[static_cast<size_t>(k)] = to_f32(b);
        }
      }
      // This rank's boxes of the global tensor (all of it without tensor parallelism).
      std::vector<StateShard> mine;
      ps.shards_of(mine, i, p.name, 0, p.shape.numel(), ps.value(i), true, true, true);
      const StateShard file_tensor = whole_tensor(p.name, shape, whole.data(), false);
      for (const StateShard& s : mine) copy_overlap(s, file_tensor);
    } catch (const nlohmann::json::exception&) {
      user_error("'", path, "': the header entry of tensor '", p.name, "' lacks dtype, shape or data_offsets");
    }
  }
}

}  // namespace lockstep
