#include "lockstep/core/hash.h"

// XXH3 compiled here, inline, rather than called in libxxhash: Debian builds the library for
// baseline x86-64 (SSE2), where XXH3 runs at ~20 GB/s even on data in cache, about the speed of
// memory, so hashing the state was compute-bound. With this build's AVX2 (-march=x86-64-v3) the
// same function runs at ~49 GB/s in cache and is limited by memory (~23 GB/s on one core). The
// values do not depend on the vector width (XXH3 is one function; tests/test_core.cpp checks them
// against the library's).
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <cstdio>

#include "lockstep/core/thread_pool.h"

namespace lockstep {

uint64_t hash_bytes(const void* data, size_t n, uint64_t seed) { return XXH3_64bits_withSeed(data, n, seed); }

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string hex32(uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", v);
  return buf;
}

Hasher::Hasher() : state_(XXH3_createState()) {
  LOCKSTEP_CHECK(state_ != nullptr);
  XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_));
}
Hasher::~Hasher() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }
void Hasher::update(const void* data, size_t n) { XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, n); }
uint64_t Hasher::digest() const { return XXH3_64bits_digest(static_cast<XXH3_state_t*>(state_)); }

void BlockHasher::update(const void* data, size_t n) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (size_t begin = 0; begin < n; begin += kHashBlockBytes)
    blocks_.push_back({bytes + begin, std::min(kHashBlockBytes, n - begin)});
}

void BlockHasher::update_elements(const void* at_begin, int64_t begin, int64_t end, size_t size) {
  for (int64_t b = begin; b < end;) {
    const int64_t next = block_end(b, end);
    const auto* data = static_cast<const unsigned char*>(at_begin) + static_cast<size_t>(b - begin) * size;
    blocks_.push_back({data, static_cast<size_t>(next - b) * size});
    b = next;
  }
}

std::vector<uint64_t> BlockHasher::block_hashes() const {
  std::vector<uint64_t> hashes(2 * blocks_.size());  // per block: hash, length
  parallel_for(static_cast<int64_t>(blocks_.size()), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      hashes[2 * b] = XXH3_64bits(blocks_[b].data, blocks_[b].n);
      hashes[2 * b + 1] = blocks_[b].n;
    }
  });
  return hashes;
}

uint64_t BlockHasher::digest() const { return combine_block_hashes(block_hashes()); }

uint64_t combine_block_hashes(const std::vector<uint64_t>& hash_and_length) {
  return hash_bytes(hash_and_length.data(), hash_and_length.size() * sizeof(uint64_t));
}

uint64_t hash_blocks(const void* data, size_t n) {
  BlockHasher h;
  h.update(data, n);
  return h.digest();
}

}  // namespace lockstep
