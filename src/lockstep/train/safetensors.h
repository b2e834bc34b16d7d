// The safetensors format (Hugging Face's weights file): an 8-byte little-endian header length N,
// N bytes of JSON {"NAME": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...,
// "__metadata__": {...}} padded with spaces to a multiple of 8, then the tensors' bytes (offsets
// relative to the end of the header), row-major, little-endian.
//
// lockstep writes full, unsharded FP32 model weights under the parameter table's names
// (tensor/param_table.h, listed in docs/checkpoints.md): `lockstep ckpt export` writes them and
// train.init_from reads them. Hugging Face model directories (train/hf_checkpoint.h) are read
// through SafetensorsFile too.
#pragma once

#include <cstdint>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "lockstep/core/tensor.h"

namespace lockstep {

class ParamStore;

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  const void* data = nullptr;  // shape.numel() elements of dtype
};

// Writes the file atomically (temporary name, fsync, rename); tensors in the given order.
void write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                       const std::map<std::string, std::string>& metadata);

// One file opened for reading: its header parsed and checked (every entry has a dtype, a shape and
// data offsets that fit the shape and the file), the data read tensor by tensor on demand. Every
// error is a UserError naming the file and the tensor.
class SafetensorsFile {
 public:
  struct Entry {
    std::string dtype;  // as the file spells it: F32, BF16, F16, F8_E4M3, F64, I32, ...
    Shape shape;
    int64_t begin = 0, end = 0;  // bytes, relative to the end of the header
  };

  explicit SafetensorsFile(std::string path);

  const std::string& path() const { return path_; }
  // The tensors in the header's order.
  const std::vector<std::string>& names() const { return names_; }
  bool has(const std::string& name) const { return entries_.count(name) > 0; }
  const Entry& entry(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // The tensor's values widened exactly to fp32: F32, BF16, F16 and F8_E4M3 (a UserError naming the
  // dtype for any other).
  std::vector<float> floats(const std::string& name);
  // The raw bytes of a tensor (any dtype).
  std::vector<char> bytes(const std::string& name);

 private:
  std::string path_;
  std::ifstream in_;
  int64_t data_start_ = 0;
  std::vector<std::string> names_;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

// Sets every parameter of ps (this rank's boxes of it under tensor parallelism) from the file at
// path (F32, or BF16 widened exactly). UserError naming
// the file and the tensor when one is missing, has another shape, is of an unsupported dtype, lies
// outside the file, or when the file has a tensor the model does not.
void load_safetensors(const std::string& path, ParamStore& ps);

}  // namespace lockstep
