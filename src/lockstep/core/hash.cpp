#include "lockstep/core/hash.h"

#include <xxhash.h>

#include <cstdio>

namespace lockstep {

uint64_t hash_bytes(const void* data, size_t n, uint64_t seed) {
  return XXH3_64bits_withSeed(data, n, seed);
}

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
void Hasher::update(const void* data, size_t n) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, n);
}
uint64_t Hasher::digest() const { return XXH3_64bits_digest(static_cast<XXH3_state_t*>(state_)); }

}  // namespace lockstep
