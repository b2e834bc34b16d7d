#include "lockstep/core/philox.h"

#include <cmath>
#include <numbers>

#include "lockstep/core/hash.h"
#include "lockstep/core/thread_pool.h"

namespace lockstep {

namespace {
constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // multipliers
constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // Weyl key increments

inline void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}
}  // namespace

std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 2> key, std::array<uint32_t, 4> c) {
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo(kM0, c[0], hi0, lo0);
    mulhilo(kM1, c[2], hi1, lo1);
    c = {hi1 ^ c[1] ^ key[0], lo1, hi0 ^ c[3] ^ key[1], lo0};
    key[0] += kW0;
    key[1] += kW1;
  }
  return c;
}

uint64_t purpose_id(std::string_view name) { return hash_bytes(name.data(), name.size()); }

uint64_t mix_purpose(uint64_t purpose, uint64_t value) {
  return hash_bytes(&value, sizeof value, purpose);
}

std::array<uint32_t, 4> RandomStream::block(uint64_t block_index) const {
  return philox4x32_10({static_cast<uint32_t>(seed_), static_cast<uint32_t>(seed_ >> 32)},
                       {static_cast<uint32_t>(block_index), static_cast<uint32_t>(block_index >> 32),
                        static_cast<uint32_t>(purpose_), static_cast<uint32_t>(purpose_ >> 32)});
}

uint32_t RandomStream::bits(uint64_t index) const { return block(index >> 2)[index & 3]; }

float RandomStream::uniform(uint64_t index) const {
  return static_cast<float>(bits(index) >> 8) * 0x1p-24f;
}

float RandomStream::normal(uint64_t index) const {
  const auto w = block(index >> 1);
  const double u1 = (static_cast<double>(w[0]) + 0.5) * 0x1p-32;  // (0, 1): log is finite
  const double u2 = static_cast<double>(w[1]) * 0x1p-32;
  const double r = std::sqrt(-2.0 * std::log(u1));
  const double theta = 2.0 * std::numbers::pi * u2;
  return static_cast<float>((index & 1) ? r * std::sin(theta) : r * std::cos(theta));
}

void RandomStream::fill_normal(float* out, int64_t n, float stddev, uint64_t first) const {
  parallel_for(n, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) out[i] = normal(first + static_cast<uint64_t>(i)) * stddev;
  });
}

}  // namespace lockstep
