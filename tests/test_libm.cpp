// core/libm.h against this machine's glibc: the same bits as std::exp(float), std::log(float) and
// std::log(double).
//
// The fast tests sample every 256th fp32 bit pattern (2^24 inputs, every exponent and sign) plus
// the special cases and dense neighbourhoods of the thresholds. The exhaustive runs, disabled by
// default, take every one of the 2^32 fp32 inputs (and a few hundred million doubles for log):
//   build/lockstep_tests --gtest_also_run_disabled_tests --gtest_filter='LibmExhaustive.*'
#include "lockstep/core/libm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <thread>
#include <vector>

namespace lockstep {
namespace {

// glibc's functions behind an opaque pointer, so that the compiler calls them (no constant folding
// or builtin expansion on the reference side).
float (*volatile glibc_expf)(float) = [](float x) { return std::exp(x); };
float (*volatile glibc_logf)(float) = [](float x) { return std::log(x); };
double (*volatile glibc_log)(double) = [](double x) { return std::log(x); };

uint32_t bits(float x) { return std::bit_cast<uint32_t>(x); }
uint64_t bits(double x) { return std::bit_cast<uint64_t>(x); }

struct Mismatches {
  int64_t count = 0;
  uint64_t first = 0;  // the first mismatching input's bits
  void add(uint64_t input) {
    if (count++ == 0) first = input;
  }
};

// Compares expf and logf on the fp32 bit patterns u = begin, begin + step, ... < end.
void compare_f32(uint64_t begin, uint64_t end, uint64_t step, Mismatches& e, Mismatches& l) {
  const auto fe = glibc_expf;
  const auto fl = glibc_logf;
  for (uint64_t u = begin; u < end; u += step) {
    const float x = std::bit_cast<float>(static_cast<uint32_t>(u));
    if (bits(libm::expf(x)) != bits(fe(x))) e.add(u);
    if (bits(libm::logf(x)) != bits(fl(x))) l.add(u);
  }
}

// The fp32 inputs at and around the special cases and thresholds of expf and logf.
std::vector<float> special_floats() {
  std::vector<float> v;
  const auto around = [&](float x, int n) {
    float lo = x, hi = x;
    v.push_back(x);
    for (int i = 0; i < n; ++i) {
      lo = std::nextafter(lo, -std::numeric_limits<float>::infinity());
      hi = std::nextafter(hi, std::numeric_limits<float>::infinity());
      v.push_back(lo);
      v.push_back(hi);
    }
  };
  for (float s : {1.0f, -1.0f}) {
    around(s * 0.0f, 64);                               // zeros and the smallest subnormals
    around(s * std::numeric_limits<float>::min(), 64);  // the subnormal / normal boundary
    around(s * std::numeric_limits<float>::max(), 16);
    around(s * 1.0f, 4096);          // log near 1, exp(+-1)
    around(s * 88.0f, 256);          // expf's special-case entry
    around(s * 0x1.62e42ep6f, 256);  // expf overflow threshold
    around(s * 0x1.9fe368p6f, 256);  // expf underflow to 0
    around(s * 0x1.9d1d9ep6f, 256);  // expf "may underflow"
    around(s * 0x1.5d589ep6f, 64);   // expf result near FLT_MIN
    around(s * 0x1p-25f, 64);        // expf(x) rounds to 1
    v.push_back(s * std::numeric_limits<float>::infinity());
  }
  for (uint32_t nan : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fa00000u, 0x7fffffffu, 0xffffffffu,
                       0x7fc12345u, 0x7f812345u}) {
    v.push_back(std::bit_cast<float>(nan));
  }
  // Every float in [1 - 2^-7, 1 + 2^-7] (logf's smallest results).
  for (float x = 1.0f - 0x1p-7f; x <= 1.0f + 0x1p-7f; x = std::nextafter(x, 2.0f)) v.push_back(x);
  return v;
}

TEST(Libm, ExpfAndLogfMatchGlibcOnEvery256thInput) {
  Mismatches e, l;
  compare_f32(0, uint64_t{1} << 32, 256, e, l);
  compare_f32(0x7f, uint64_t{1} << 32, 256 * 257, e, l);  // other low bytes too
  EXPECT_EQ(e.count, 0) << "expf, first at 0x" << std::hex << e.first;
  EXPECT_EQ(l.count, 0) << "logf, first at 0x" << std::hex << l.first;
}

TEST(Libm, ExpfAndLogfMatchGlibcOnSpecialCases) {
  const std::vector<float> xs = special_floats();
  for (float x : xs) {
    ASSERT_EQ(bits(libm::expf(x)), bits(glibc_expf(x))) << "expf(" << std::hexfloat << x << ")";
    ASSERT_EQ(bits(libm::logf(x)), bits(glibc_logf(x))) << "logf(" << std::hexfloat << x << ")";
  }
  // The documented values.
  EXPECT_EQ(bits(libm::expf(-std::numeric_limits<float>::infinity())), 0u);
  EXPECT_EQ(libm::expf(std::numeric_limits<float>::infinity()), std::numeric_limits<float>::infinity());
  EXPECT_EQ(bits(libm::logf(1.0f)), 0u);
  EXPECT_EQ(libm::logf(0.0f), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(libm::logf(-0.0f), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(bits(libm::logf(-1.0f)), 0xffc00000u);
  EXPECT_EQ(bits(libm::logf(std::bit_cast<float>(0x7f812345u))), 0x7fc12345u);  // quietened, payload kept
  EXPECT_EQ(bits(libm::expf(std::bit_cast<float>(0xff812345u))), 0xffc12345u);
}

// Doubles for log: random bit patterns (every exponent, both signs, NaNs), the region near 1 that
// log handles with its own polynomial, the range of a log-sum-exp (1 to 2^40) and subnormals.
double random_double(std::mt19937_64& g, int kind) {
  const uint64_t r = g();
  switch (kind) {
    case 0:
      return std::bit_cast<double>(r);
    case 1:
      return std::bit_cast<double>(0x3fee000000000000ull + r % (0x3ff1090000000000ull - 0x3fee000000000000ull));
    case 2:
      return std::bit_cast<double>(((0x3ffull + r % 41) << 52) | (r >> 12));
    case 3:
      return std::bit_cast<double>((r >> 12) | ((r & 1) << 63));
  }
  return std::bit_cast<double>((0x3c0ull + r % 0x80) << 52 | (r >> 12));  // 2^-63 .. 2^64
}

int64_t compare_log(uint64_t seed, int64_t n, uint64_t& first) {
  std::mt19937_64 g(seed);
  const auto fl = glibc_log;
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double x = random_double(g, static_cast<int>(i % 5));
    if (bits(libm::log(x)) != bits(fl(x)) && bad++ == 0) first = bits(x);
  }
  return bad;
}

std::vector<double> special_doubles() {
  std::vector<double> v;
  const auto around = [&](double x, int n) {
    double lo = x, hi = x;
    v.push_back(x);
    for (int i = 0; i < n; ++i) {
      lo = std::nextafter(lo, -std::numeric_limits<double>::infinity());
      hi = std::nextafter(hi, std::numeric_limits<double>::infinity());
      v.push_back(lo);
      v.push_back(hi);
    }
  };
  for (double s : {1.0, -1.0}) {
    around(s * 0.0, 64);
    around(s * std::numeric_limits<double>::min(), 64);
    around(s * std::numeric_limits<double>::max(), 16);
    around(s * 1.0, 4096);
    around(s * (1.0 - 0x1p-4), 256);  // the near-1 region's bounds
    around(s * (1.0 + 0x1.09p-4), 256);
    around(s * 0x1.6p-1, 64);  // the table's reduction interval
    around(s * 2.0, 64);
    around(s * std::exp(1.0), 64);
    v.push_back(s * std::numeric_limits<double>::infinity());
  }
  for (uint64_t nan : {0x7ff8000000000000ull, 0xfff8000000000000ull, 0x7ff0000000000001ull, 0xfff0000000000001ull,
                       0x7fffffffffffffffull, 0x7ff4000000012345ull}) {
    v.push_back(std::bit_cast<double>(nan));
  }
  for (int e = -1074; e <= 1023; ++e) v.push_back(std::ldexp(1.0, e));
  return v;
}

TEST(Libm, LogMatchesGlibcOnRandomAndSpecialDoubles) {
  for (double x : special_doubles()) {
    ASSERT_EQ(bits(libm::log(x)), bits(glibc_log(x))) << "log(" << std::hexfloat << x << ")";
  }
  EXPECT_EQ(bits(libm::log(1.0)), 0u);
  EXPECT_EQ(bits(libm::log(-2.0)), 0xfff8000000000000ull);
  uint64_t first = 0;
  EXPECT_EQ(compare_log(1, 4'000'000, first), 0) << "first at 0x" << std::hex << first;
}

// ---- Exhaustive runs (disabled by default; see the top of this file).

int threads() { return std::max(1u, std::thread::hardware_concurrency()); }

TEST(LibmExhaustive, DISABLED_ExpfAndLogfEveryInput) {
  const auto start = std::chrono::steady_clock::now();
  const int T = threads();
  std::vector<Mismatches> e(T), l(T);
  std::vector<std::thread> pool;
  const uint64_t n = uint64_t{1} << 32, chunk = n / static_cast<uint64_t>(T);
  for (int t = 0; t < T; ++t) {
    const uint64_t b = chunk * t, end = t == T - 1 ? n : b + chunk;
    pool.emplace_back([&, t, b, end] { compare_f32(b, end, 1, e[t], l[t]); });
  }
  for (auto& th : pool) th.join();
  int64_t be = 0, bl = 0;
  for (int t = 0; t < T; ++t) {
    be += e[t].count;
    bl += l[t].count;
    EXPECT_EQ(e[t].count, 0) << "expf, first at 0x" << std::hex << e[t].first;
    EXPECT_EQ(l[t].count, 0) << "logf, first at 0x" << std::hex << l[t].first;
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("expf and logf over all 2^32 inputs on %d threads: %.1f s, %lld + %lld mismatches\n", T, s,
              static_cast<long long>(be), static_cast<long long>(bl));
}

TEST(LibmExhaustive, DISABLED_LogRandomDoubles) {
  const auto start = std::chrono::steady_clock::now();
  const int T = threads();
  constexpr int64_t kTotal = 400'000'000;
  std::vector<int64_t> bad(T);
  std::vector<uint64_t> first(T);
  std::vector<std::thread> pool;
  for (int t = 0; t < T; ++t) {
    pool.emplace_back([&, t] { bad[t] = compare_log(1000 + t, kTotal / T, first[t]); });
  }
  for (auto& th : pool) th.join();
  int64_t total = 0;
  for (int t = 0; t < T; ++t) {
    total += bad[t];
    EXPECT_EQ(bad[t], 0) << "log, first at 0x" << std::hex << first[t];
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("log over %lld random doubles on %d threads: %.1f s, %lld mismatches\n",
              static_cast<long long>(kTotal / T * T), T, s, static_cast<long long>(total));
}

}  // namespace
}  // namespace lockstep
