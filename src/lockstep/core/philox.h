// Philox4x32-10 counter-based random numbers (Salmon et al., SC'11).
//
// A random number is a pure function of (seed, purpose, index): the key is the 64-bit seed, the
// 128-bit counter is (index, purpose). Nothing depends on thread id, rank or call order, so any
// partition of the index space over threads or ranks draws the same numbers.
//
// `purpose` names what the numbers are for: purpose_id("init/" + param_name), or such a value
// mixed with a layer or step number via mix_purpose(). Use the *global* element index (the index
// in the unsharded tensor), so that a sharded tensor draws exactly what the unsharded one would.
//
// Host and device: philox4x32_10_rounds, RandomStream's constructor, bits(), block() and uniform()
// are LOCKSTEP_HD (core/hd.h): integer arithmetic only, the same bits on a GPU. normal() uses double
// log / sqrt / sin / cos from the host's libm (it initialises parameters, on the host): host only,
// like fill_normal(), blocks8() (AVX2) and purpose_id() / mix_purpose() (the name hash).
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

#include "lockstep/core/hd.h"

namespace lockstep {

namespace philox_detail {
inline constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // multipliers
inline constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // Weyl key increments
}  // namespace philox_detail

// The ten rounds on counter c (in place) under key (k0, k1).
LOCKSTEP_HD inline void philox4x32_10_rounds(uint32_t k0, uint32_t k1, uint32_t c[4]) {
  using namespace philox_detail;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * c[0];
    const uint64_t p1 = static_cast<uint64_t>(kM1) * c[2];
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    const uint32_t n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
    c[0] = n0;
    c[1] = lo1;
    c[2] = n2;
    c[3] = lo0;
    k0 += kW0;
    k1 += kW1;
  }
}

// Host-side convenience form of the same function (std::array is host-only to nvcc).
inline std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 2> key, std::array<uint32_t, 4> ctr) {
  uint32_t c[4] = {ctr[0], ctr[1], ctr[2], ctr[3]};
  philox4x32_10_rounds(key[0], key[1], c);
  return {c[0], c[1], c[2], c[3]};
}

uint64_t purpose_id(std::string_view name);
uint64_t mix_purpose(uint64_t purpose, uint64_t value);

class RandomStream {
 public:
  LOCKSTEP_HD RandomStream(uint64_t seed, uint64_t purpose) : seed_(seed), purpose_(purpose) {}

  // 32 random bits; index i is lane i%4 of block i/4.
  LOCKSTEP_HD uint32_t bits(uint64_t index) const {
    uint32_t w[4];
    block(index >> 2, w);
    return w[index & 3];
  }
  // bits(4 * b + j) for j = 0..3: one Philox call, for kernels that draw for consecutive indices.
  LOCKSTEP_HD void block(uint64_t block_index, uint32_t out[4]) const {
    out[0] = static_cast<uint32_t>(block_index);
    out[1] = static_cast<uint32_t>(block_index >> 32);
    out[2] = static_cast<uint32_t>(purpose_);
    out[3] = static_cast<uint32_t>(purpose_ >> 32);
    philox4x32_10_rounds(static_cast<uint32_t>(seed_), static_cast<uint32_t>(seed_ >> 32), out);
  }
  // The same four words as a std::array (host code).
  std::array<uint32_t, 4> block(uint64_t block_index) const {
    std::array<uint32_t, 4> w;
    block(block_index, w.data());
    return w;
  }
  // The blocks first_block .. first_block + 7 one after the other: out[4 i + j] =
  // block(first_block + i)[j], i.e. bits(4 first_block + k) for k = 0..31. Eight Philox calls in
  // vector lanes (AVX2), the same bits.
  void blocks8(uint64_t first_block, uint32_t* out) const;
  // Uniform in [0, 1) with 24 random bits (exactly representable in fp32).
  LOCKSTEP_HD float uniform(uint64_t index) const { return static_cast<float>(bits(index) >> 8) * 0x1p-24f; }
  // Standard normal by Box-Muller on block index/2: even indices take the cosine branch, odd the
  // sine branch. Computed in double, rounded once to fp32. Host only (the host's libm).
  float normal(uint64_t index) const;

  // Fills out[i] = normal(first + i) * stddev, in parallel over the current thread pool.
  void fill_normal(float* out, int64_t n, float stddev, uint64_t first = 0) const;

  LOCKSTEP_HD uint64_t seed() const { return seed_; }
  LOCKSTEP_HD uint64_t purpose() const { return purpose_; }

 private:
  uint64_t seed_;
  uint64_t purpose_;
};

}  // namespace lockstep
