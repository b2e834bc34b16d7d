// 64-bit hashes (XXH3, from libxxhash) for fingerprints: of parameters, gradients, optimizer state,
// RNG state and module outputs. A hash covers the exact bytes, so it changes with any bit.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

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

// The hash of large state (parameters, gradients, optimizer moments) on the bound thread pool.
// Each buffer given to update() is cut into canonical blocks of kHashBlockBytes (its last one
// shorter); digest() hashes every block of every buffer with XXH3 in one parallel loop, each on
// whichever thread owns it, then returns XXH3 of the sequence of (block hash, block length) in
// update order. The blocks depend on the buffer sizes (and update_elements' bounds) only, never on
// the thread count, so neither does the digest (tested 1 vs 2 vs 3 threads). It is not hash_bytes
// of the concatenation: buffer boundaries are part of what is hashed. The buffers must stay alive
// until digest().
class BlockHasher {
 public:
  static constexpr size_t kHashBlockBytes = size_t{1} << 20;
  static constexpr int64_t kHashBlockFloats = static_cast<int64_t>(kHashBlockBytes / sizeof(float));
  void update(const void* data, size_t n);
  // Elements [begin, end) of a float array, `at_begin` pointing at element begin, cut where the
  // array's own grid of kHashBlockFloats elements from element 0 cuts (so the first and the last
  // block may be shorter): the blocks a part of a parameter has in the fingerprint's hashes,
  // whichever part of it a rank holds. update_elements(x, 0, n) is update(x, n * 4).
  void update_elements(const float* at_begin, int64_t begin, int64_t end) {
    update_elements(at_begin, begin, end, sizeof(float));
  }
  // The same over elements of `size` bytes (bf16: 2), on the same grid of elements.
  void update_elements(const void* at_begin, int64_t begin, int64_t end, size_t size);
  // Where the block of that grid holding element e ends, capped at end.
  static int64_t block_end(int64_t e, int64_t end) {
    return std::min(end, (e / kHashBlockFloats + 1) * kHashBlockFloats);
  }
  uint64_t digest() const;
  // Each block's (XXH3, length in bytes) in update order, hashed in one parallel loop: digest() is
  // combine_block_hashes of these.
  std::vector<uint64_t> block_hashes() const;

 private:
  struct Block {
    const unsigned char* data;
    size_t n;
  };
  std::vector<Block> blocks_;
};

// BlockHasher's last step: XXH3 of the sequence (block hash, block length in bytes), for code that
// hashes the same blocks elsewhere (the fingerprint's gradients, Adam moments and, with the
// replicated optimizer, parameters are hashed inside the AdamW pass, train/optimizer.h).
uint64_t combine_block_hashes(const std::vector<uint64_t>& hash_and_length);
// How many blocks BlockHasher::update cuts a buffer of n bytes into.
inline size_t hash_block_count(size_t n) {
  return (n + BlockHasher::kHashBlockBytes - 1) / BlockHasher::kHashBlockBytes;
}

// BlockHasher over one buffer.
uint64_t hash_blocks(const void* data, size_t n);
inline uint64_t hash_floats_blocks(const float* data, int64_t n) {
  return hash_blocks(data, static_cast<size_t>(n) * sizeof(float));
}

}  // namespace lockstep
