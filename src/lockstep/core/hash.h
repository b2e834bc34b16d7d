// 64-bit hashes (XXH3, from libxxhash) for fingerprints: of parameters, gradients, optimizer state,
// RNG state and module outputs. A hash covers the exact bytes, so it changes with any bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "lockstep/core/tensor.h"

namespace lockstep {

uint64_t hash_bytes(const void* data, size_t n, uint64_t seed = 0);
inline uint64_t hash_floats(const float* data, int64_t n) {
  return hash_bytes(data, static_cast<size_t>(n) * sizeof(float));
}
inline uint64_t hash_tensor(const TensorView& t) { return hash_bytes(t.data, t.nbytes()); }

// "0123456789abcdef": 16 lowercase hex digits, as fingerprints store hashes and float bits.
std::string hex64(uint64_t v);
std::string hex32(uint32_t v);

// Incremental hash over several buffers; equal to hash_bytes of their concatenation.
class Hasher {
 public:
  Hasher();
  ~Hasher();
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;
  void update(const void* data, size_t n);
  uint64_t digest() const;

 private:
  void* state_;
};

}  // namespace lockstep
