// The flat parameter table: every parameter of the model declared once (name, shape, init, weight
// decay), laid out in declaration order in one contiguous fp32 buffer; gradients mirror it in a
// second buffer. The table drives allocation, init, the optimizer, fingerprints, and later
// checkpoints and data-parallel buckets.
//
// Init is a pure function of (seed, parameter name, element index): parameter p's element i is
// Philox(seed, purpose "init/<name>").normal(i) * std. Adding, removing or reordering other
// parameters changes nothing about p.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "lockstep/core/tensor.h"

namespace lockstep {

class Precision;

enum class Init : uint8_t { normal, zeros, ones };

struct ParamSpec {
  std::string name;   // "layers.0.attn.qkv.weight"
  Shape shape;
  Init init;
  float std;          // Init::normal only
  bool decay;         // weight decay applies (weight matrices, not biases or norms)
  int64_t offset;     // in floats, into the flat buffers
  bool expert;        // an MoE expert's: data parallelism reduces it over the expert data-parallel group
};

// Elements [begin, end) of parameter `param`, counted in the parameter's flattened (row-major)
// elements: a rank's share of a parameter under the distributed optimizer (Megatron's "flattened
// range").
struct ParamRange {
  int param;
  int64_t begin, end;
};

class ParamStore {
 public:
  // Declares a parameter; returns its index. Only before allocate().
  int add(std::string name, Shape shape, Init init, float std = 0.0f, bool decay = false, bool expert = false);
  // Allocates the value and gradient buffers (zeroed).
  void allocate();
  // Draws every parameter from its Philox stream (in parallel over the current thread pool).
  void init(uint64_t seed);
  void zero_grads();

  const std::vector<ParamSpec>& specs() const { return specs_; }
  int64_t total() const { return total_; }
  float* value(int i) const { return values_.data() + specs_[i].offset; }
  float* grad(int i) const { return grads_.data() + specs_[i].offset; }
  float* values() const { return values_.data(); }
  float* grads() const { return grads_.data(); }
  int find(const std::string& name) const;  // -1 when absent

  // Mixed precision (model/precision.h). With bf16 weights on, weight(i) is the bf16 rounding of
  // value(i), the copy forward and backward read, refreshed from the fp32 master values by
  // sync_weights() (parameters [first, end) of the table); otherwise weight(i) is value(i).
  void use_bf16_weights();
  void sync_weights(int first, int end);
  const float* weight(int i) const {
    return (weights_.size() ? weights_.data() : values_.data()) + specs_[i].offset;
  }
  // The numerics the modules compute in: the model's Precision (set by its owner, which outlives
  // this store), or plain fp32 when none is set.
  // Modules call its GEMMs through a const store: the scaling state they update is the model's.
  void set_precision(Precision* p) { precision_ = p; }
  Precision& precision() const;

 private:
  std::vector<ParamSpec> specs_;
  int64_t total_ = 0;
  FloatBuffer values_, grads_;
  FloatBuffer weights_;  // bf16 compute copy; empty without bf16 weights
  Precision* precision_ = nullptr;
};

}  // namespace lockstep
