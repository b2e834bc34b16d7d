// Philox4x32-10 counter-based random numbers (Salmon et al., SC'11).
//
// A random number is a pure function of (seed, purpose, index): the key is the 64-bit seed, the
// 128-bit counter is (index, purpose). Nothing depends on thread id, rank or call order, so any
// partition of the index space over threads or ranks draws the same numbers.
//
// `purpose` names what the numbers are for: purpose_id("init/" + param_name), or such a value
// mixed with a layer or step number via mix_purpose(). Use the *global* element index (the index
// in the unsharded tensor), so that a sharded tensor draws exactly what the unsharded one would.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

namespace lockstep {

std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 2> key, std::array<uint32_t, 4> ctr);

uint64_t purpose_id(std::string_view name);
uint64_t mix_purpose(uint64_t purpose, uint64_t value);

class RandomStream {
 public:
  RandomStream(uint64_t seed, uint64_t purpose) : seed_(seed), purpose_(purpose) {}

  // 32 random bits; index i is lane i%4 of block i/4.
  uint32_t bits(uint64_t index) const;
  // bits(4 * b + j) for j = 0..3: one Philox call, for kernels that draw for consecutive indices.
  std::array<uint32_t, 4> block(uint64_t block_index) const;
  // The blocks first_block .. first_block + 7 one after the other: out[4 i + j] =
  // block(first_block + i)[j], i.e. bits(4 first_block + k) for k = 0..31. Eight Philox calls in
  // vector lanes (AVX2), the same bits.
  void blocks8(uint64_t first_block, uint32_t* out) const;
  // Uniform in [0, 1) with 24 random bits (exactly representable in fp32).
  float uniform(uint64_t index) const;
  // Standard normal by Box-Muller on block index/2: even indices take the cosine branch, odd the
  // sine branch. Computed in double, rounded once to fp32.
  float normal(uint64_t index) const;

  // Fills out[i] = normal(first + i) * stddev, in parallel over the current thread pool.
  void fill_normal(float* out, int64_t n, float stddev, uint64_t first = 0) const;

  uint64_t seed() const { return seed_; }
  uint64_t purpose() const { return purpose_; }

 private:
  uint64_t seed_;
  uint64_t purpose_;
};

}  // namespace lockstep
