// The safetensors format (Hugging Face's weights file): an 8-byte little-endian header length N,
// N bytes of JSON {"NAME": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...,
// "__metadata__": {...}} padded with spaces to a multiple of 8, then the tensors' bytes (offsets
// relative to the end of the header), row-major, little-endian.
//
// lockstep writes full, unsharded FP32 model weights under the parameter table's names
// (tensor/param_table.h, listed in docs/checkpoints.md): `lockstep ckpt export` writes them and
// train.init_from reads them.
#pragma once

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

// Sets every parameter of ps (this rank's boxes of it under tensor parallelism) from the file at
// path (F32, or BF16 widened exactly). UserError naming
// the file and the tensor when one is missing, has another shape, is of an unsupported dtype, lies
// outside the file, or when the file has a tensor the model does not.
void load_safetensors(const std::string& path, ParamStore& ps);

}  // namespace lockstep
