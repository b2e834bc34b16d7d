// A piece of the training state that one rank holds, described so that checkpoints
// (train/checkpoint.h) can write it and read it back under any parallel layout.
//
// Megatron-style sharded tensor: the tensor `name` has `global_shape`; this rank holds the box at
// `box_offset` with shape `box_shape` (tensor / expert / pipeline parallelism cut boxes), and of
// that box's row-major flattening only the elements [flat_begin, flat_end) (the distributed
// optimizer's flat shards cut a box anywhere, also inside a row). `data` points at those
// flat_end - flat_begin elements, contiguous. A whole tensor is one box at offset 0 with the global
// shape and the full flat range (whole_tensor below).
//
// Writers: every distinct piece of a tensor is written by exactly one rank. State that ranks
// replicate (parameters across data-parallel ranks) is contributed with writer = true on one
// replica and false on the others; state a rank owns alone (its flat range of a sharded optimizer)
// has writer = true on every rank. Loading fills every shard, writer or not, from the checkpoint's
// pieces, whatever layout wrote them.
//
// Names are namespaced by kind: "param/<parameter name>" (the FP32 values; with bf16 weights these
// are the master weights, and the bf16 compute copy is derived from them, so it is not stored),
// "optim/exp_avg/<parameter name>", "optim/exp_avg_sq/<parameter name>", "buffer/<name>" (module
// state the optimizer does not own, e.g. the MoE routers' expert bias).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "lockstep/core/dtype.h"
#include "lockstep/core/tensor.h"

namespace lockstep {

struct StateShard {
  std::string name;
  DType dtype = DType::f32;
  Shape global_shape;
  std::vector<int64_t> box_offset;  // one entry per dimension of global_shape
  Shape box_shape;
  int64_t flat_begin = 0, flat_end = 0;  // elements of the box's row-major flattening held here
  void* data = nullptr;                  // (flat_end - flat_begin) elements of dtype
  bool writer = true;                    // this rank writes the piece (one replica does)

  int64_t numel() const { return flat_end - flat_begin; }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
};

// The whole tensor in one piece.
inline StateShard whole_tensor(std::string name, Shape shape, void* data, bool writer, DType dtype = DType::f32) {
  StateShard s;
  s.name = std::move(name);
  s.dtype = dtype;
  s.box_offset.assign(static_cast<size_t>(shape.rank()), 0);
  s.flat_end = shape.numel();
  s.box_shape = shape;
  s.global_shape = std::move(shape);
  s.data = data;
  s.writer = writer;
  return s;
}

// Elements [begin, end) of the whole tensor's flattening (a distributed optimizer's flat shard).
inline StateShard flat_range(std::string name, Shape shape, int64_t begin, int64_t end, void* data, bool writer,
                             DType dtype = DType::f32) {
  StateShard s = whole_tensor(std::move(name), std::move(shape), data, writer, dtype);
  s.flat_begin = begin;
  s.flat_end = end;
  return s;
}

}  // namespace lockstep
