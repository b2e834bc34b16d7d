// Core utilities: Philox, RandomStream, bf16, hashing, the thread pool, errors, tensors.
#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <xxhash.h>

#include "lockstep/core/dtype.h"
#include "lockstep/core/error.h"
#include "lockstep/core/hash.h"
#include "lockstep/core/philox.h"
#include "lockstep/core/tensor.h"
#include "lockstep/core/thread_pool.h"
#include "testing.h"

namespace lockstep {
namespace {

using Words = std::array<uint32_t, 4>;

// Known-answer vectors published with Random123 (kat_vectors, philox4x32 with 10 rounds).
TEST(Philox, Random123KnownAnswers) {
  EXPECT_EQ(philox4x32_10({0, 0}, {0, 0, 0, 0}), (Words{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(philox4x32_10({0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}),
            (Words{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(philox4x32_10({0xa4093822, 0x299f31d0}, {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}),
            (Words{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

// bits(i) is lane i % 4 of the Philox block i / 4, keyed by the seed, with counter
// (block index, purpose), low words first.
TEST(RandomStream, BitsAreThePhiloxBlock) {
  const uint64_t seed = 0x0123456789abcdefull, purpose = 0xfedcba9876543210ull;
  const RandomStream rng(seed, purpose);
  const uint64_t block = 0x100000002ull;
  const Words w = philox4x32_10({0x89abcdef, 0x01234567}, {0x00000002, 0x1, 0x76543210, 0xfedcba98});
  for (uint64_t lane = 0; lane < 4; ++lane) EXPECT_EQ(rng.bits(block * 4 + lane), w[lane]);
}

// blocks8 (vector lanes) against block() one by one, across a carry of the block index's low word.
TEST(RandomStream, EightBlocksAtOnceAreTheBlocks) {
  const RandomStream rng(0x123456789abcdefULL, purpose_id("test/blocks8"));
  for (uint64_t first : {uint64_t{0}, uint64_t{5}, uint64_t{0xfffffffcULL}, uint64_t{0x1234567890ULL}}) {
    uint32_t out[32];
    rng.blocks8(first, out);
    for (uint64_t i = 0; i < 8; ++i)
      for (int j = 0; j < 4; ++j) ASSERT_EQ(out[4 * i + j], rng.block(first + i)[j]) << first << " " << i << " " << j;
  }
}

TEST(RandomStream, UniformInUnitInterval) {
  const RandomStream rng(1, purpose_id("uniform"));
  double sum = 0.0;
  const int n = 100000;
  for (int i = 0; i < n; ++i) {
    const float u = rng.uniform(i);
    ASSERT_GE(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    sum += u;
  }
  EXPECT_NEAR(sum / n, 0.5, 0.005);
}

TEST(RandomStream, NormalMeanAndVariance) {
  const int64_t n = 200000;
  std::vector<float> x(n);
  RandomStream(7, purpose_id("normal")).fill_normal(x.data(), n, 1.0f);
  double s = 0.0, s2 = 0.0, s4 = 0.0;
  for (float v : x) {
    s += v;
    s2 += double(v) * v;
    s4 += double(v) * v * v * v;
  }
  const double mean = s / n, var = s2 / n - mean * mean;
  EXPECT_NEAR(mean, 0.0, 0.01);   // standard error 0.0022
  EXPECT_NEAR(var, 1.0, 0.015);   // standard error 0.0032
  EXPECT_NEAR(s4 / n, 3.0, 0.1);  // kurtosis of a normal
}

// A value depends on (seed, purpose, index) only: not on the fill order, the offset of the fill,
// or the thread count.
TEST(RandomStream, NormalIsAPureFunctionOfTheIndex) {
  const RandomStream rng(42, purpose_id("purity"));
  const int64_t n = 1001;
  std::vector<float> serial(n);
  for (int64_t i = n - 1; i >= 0; --i) serial[i] = rng.normal(i) * 0.5f;
  for (int threads = 1; threads <= 3; ++threads) {
    ThreadPool pool(threads);
    ThreadPool::Bind bind(&pool);
    std::vector<float> filled(n);
    rng.fill_normal(filled.data(), n, 0.5f);
    EXPECT_TRUE(testing::bitwise_equal(filled, serial, "threads " + std::to_string(threads)));
    std::vector<float> tail(n - 300);
    rng.fill_normal(tail.data(), n - 300, 0.5f, 300);
    EXPECT_TRUE(testing::bitwise_equal(tail.data(), serial.data() + 300, n - 300, "offset fill"));
  }
  EXPECT_NE(RandomStream(43, rng.purpose()).normal(0), rng.normal(0));
  EXPECT_NE(RandomStream(42, purpose_id("other")).normal(0), rng.normal(0));
  EXPECT_NE(mix_purpose(rng.purpose(), 1), mix_purpose(rng.purpose(), 2));
}

uint16_t bf16_bits(uint32_t f32_bits) { return to_bf16(std::bit_cast<float>(f32_bits)).bits; }

TEST(BF16, RoundsToNearestEven) {
  EXPECT_EQ(bf16_bits(0x3f800000), 0x3f80);  // 1.0 exactly
  EXPECT_EQ(bf16_bits(0x3f807fff), 0x3f80);  // below the halfway point
  EXPECT_EQ(bf16_bits(0x3f808001), 0x3f81);  // above it
  EXPECT_EQ(bf16_bits(0x3f808000), 0x3f80);  // tie, even neighbour below
  EXPECT_EQ(bf16_bits(0x3f818000), 0x3f82);  // tie, even neighbour above
  EXPECT_EQ(bf16_bits(0xbf808000), 0xbf80);  // negative tie
  EXPECT_EQ(bf16_bits(0xbf818000), 0xbf82);
  EXPECT_EQ(bf16_bits(0x00000000), 0x0000);
  EXPECT_EQ(bf16_bits(0x80000000), 0x8000);  // -0 keeps its sign
  EXPECT_EQ(bf16_bits(0x00008000), 0x0000);  // subnormal tie to even zero
  EXPECT_EQ(bf16_bits(0x00018000), 0x0002);  // subnormal tie up to even
  EXPECT_EQ(bf16_bits(0x007fffff), 0x0080);  // largest subnormal rounds to the smallest normal
}

TEST(BF16, InfinityOverflowAndNaN) {
  EXPECT_EQ(bf16_bits(0x7f800000), 0x7f80);  // +inf
  EXPECT_EQ(bf16_bits(0xff800000), 0xff80);  // -inf
  EXPECT_EQ(bf16_bits(0x7f7fffff), 0x7f80);  // FLT_MAX rounds up to inf
  EXPECT_EQ(bf16_bits(0xff7fffff), 0xff80);
  EXPECT_EQ(bf16_bits(0x7f7f8000), 0x7f80);  // tie at the top, odd below: up to inf
  EXPECT_EQ(bf16_bits(0x7f7f7fff), 0x7f7f);  // largest value that stays finite
  // NaNs stay NaN, quiet, with their sign - even when only low mantissa bits are set, which
  // plain rounding would turn into infinity.
  for (uint32_t nan : {0x7fc00000u, 0x7f800001u, 0x7fa00000u, 0xff800001u, 0xffffffffu}) {
    const uint16_t b = bf16_bits(nan);
    EXPECT_TRUE(std::isnan(to_f32(bf16{b}))) << std::hex << nan;
    EXPECT_TRUE(b & 0x40) << std::hex << nan << " -> " << b << " is not quiet";
    EXPECT_EQ(b >> 15, nan >> 31) << std::hex << nan;
  }
}

TEST(BF16, EveryValueRoundTrips) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float f = to_f32(bf16{static_cast<uint16_t>(b)});
    EXPECT_EQ(std::bit_cast<uint32_t>(f), b << 16);
    if (!std::isnan(f)) {
      EXPECT_EQ(to_bf16(f).bits, b) << std::hex << b;
    }
  }
}

TEST(Hash, KnownValueAndHex) {
  EXPECT_EQ(hash_bytes(nullptr, 0), 0x2d06800538d394c2ull);  // XXH3-64 of empty input, seed 0
  EXPECT_EQ(hex64(0x2d06800538d394c2ull), "2d06800538d394c2");
  EXPECT_EQ(hex64(1), "0000000000000001");
  EXPECT_EQ(hex32(0xabcu), "00000abc");
  EXPECT_NE(hash_bytes("a", 1), hash_bytes("a", 1, 1));
}

// hash_bytes compiles XXH3 inline for this build's instruction set (core/hash.cpp); the values must
// be the library's (libxxhash, built for baseline x86-64) at every length class XXH3 treats apart
// (0, 1-3, 4-8, 9-16, 17-128, 129-240, longer: stripes, blocks, tails) and with a seed.
TEST(Hash, InlineXxh3EqualsTheLibrary) {
  std::vector<unsigned char> data(70000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 2654435761u >> 11);
  for (size_t n :
       {0u, 1u, 3u, 4u, 8u, 9u, 16u, 17u, 128u, 129u, 240u, 241u, 1023u, 1024u, 1025u, 4096u, 65536u, 70000u}) {
    EXPECT_EQ(hash_bytes(data.data(), n), XXH3_64bits(data.data(), n)) << n << " bytes";
    EXPECT_EQ(hash_bytes(data.data() + 1, n - (n > 0), 77), XXH3_64bits_withSeed(data.data() + 1, n - (n > 0), 77))
        << n << " bytes, seed";
  }
  Hasher h;
  h.update(data.data(), 1000);
  h.update(data.data() + 1000, data.size() - 1000);
  EXPECT_EQ(h.digest(), XXH3_64bits(data.data(), data.size()));
}

TEST(Hash, HasherOverPiecesEqualsHashOfConcatenation) {
  std::vector<unsigned char> data(1000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 7 + 3);
  {
    Hasher h;
    EXPECT_EQ(h.digest(), hash_bytes(nullptr, 0));
  }
  for (size_t cut1 : {0u, 1u, 240u, 500u}) {
    for (size_t cut2 : {500u, 777u, 1000u}) {
      Hasher h;
      h.update(data.data(), cut1);
      h.update(data.data() + cut1, cut2 - cut1);
      h.update(data.data() + cut2, data.size() - cut2);
      EXPECT_EQ(h.digest(), hash_bytes(data.data(), data.size())) << cut1 << " " << cut2;
    }
  }
  const std::vector<float> f = {1.0f, -2.0f, 3.5f};
  EXPECT_EQ(hash_floats(f.data(), 3), hash_bytes(f.data(), 12));
  data[999] ^= 1;
  Hasher h;
  h.update(data.data(), data.size());
  EXPECT_NE(h.digest(), hash_bytes(data.data(), 999) /* other length */);
}

// The parallel block hash: the digest is XXH3 over (block hash, length) of the canonical 1 MiB
// blocks, bitwise the same with 1, 2 and 3 threads, and it changes with any bit.
TEST(Hash, BlockHasherIsIndependentOfThreadsAndMatchesItsDefinition) {
  constexpr size_t kBlock = BlockHasher::kHashBlockBytes;
  std::vector<unsigned char> data(3 * kBlock + 12345);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 2654435761u >> 13);
  std::vector<uint64_t> blocks;
  for (size_t b = 0; b < data.size(); b += kBlock) {
    const size_t len = std::min(kBlock, data.size() - b);
    blocks.push_back(hash_bytes(data.data() + b, len));
    blocks.push_back(len);
  }
  const uint64_t want = hash_bytes(blocks.data(), blocks.size() * sizeof(uint64_t));
  for (int threads : {1, 2, 3})
    testing::with_threads(threads, [&] {
      EXPECT_EQ(hash_blocks(data.data(), data.size()), want) << threads << " threads";
      BlockHasher two;  // two buffers: their block lists in order
      two.update(data.data(), kBlock + 5);
      two.update(data.data() + kBlock + 5, data.size() - kBlock - 5);
      BlockHasher again;
      again.update(data.data(), kBlock + 5);
      again.update(data.data() + kBlock + 5, data.size() - kBlock - 5);
      EXPECT_EQ(two.digest(), again.digest());
      EXPECT_NE(two.digest(), want) << "the buffer boundaries are part of the hash";
    });
  EXPECT_EQ(hash_blocks(nullptr, 0), hash_bytes(nullptr, 0));
  data[2 * kBlock + 7] ^= 0x10;
  EXPECT_NE(hash_blocks(data.data(), data.size()), want);
}

// A part of a float array hashed on the array's own grid: elements [begin, end) cut at multiples
// of kHashBlockFloats from element 0, whatever begin is; block_hashes() are the (hash, length)
// pairs digest() combines.
TEST(Hash, BlockHasherCutsAPartOfAnArrayOnTheArraysOwnGrid) {
  constexpr int64_t kB = BlockHasher::kHashBlockFloats;
  std::vector<float> x(static_cast<size_t>(3 * kB + 100));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 977) * 0.5f;
  const int64_t begin = kB - 3, end = 3 * kB + 50;
  std::vector<uint64_t> want;
  for (const auto& [b, e] : {std::pair{begin, kB}, {kB, 2 * kB}, {2 * kB, 3 * kB}, {3 * kB, end}})
    want.insert(want.end(), {hash_floats(x.data() + b, e - b), static_cast<uint64_t>(e - b) * sizeof(float)});
  for (int threads : {1, 2})
    testing::with_threads(threads, [&] {
      BlockHasher h;
      h.update_elements(x.data() + begin, begin, end);
      EXPECT_EQ(h.block_hashes(), want) << threads << " threads";
      EXPECT_EQ(h.digest(), combine_block_hashes(want));
      BlockHasher whole, from_zero;  // from element 0 the grid is update()'s
      whole.update(x.data(), x.size() * sizeof(float));
      from_zero.update_elements(x.data(), 0, static_cast<int64_t>(x.size()));
      EXPECT_EQ(whole.digest(), from_zero.digest());
    });
  BlockHasher within;  // inside one block: one block
  within.update_elements(x.data() + 10, 10, 20);
  EXPECT_EQ(within.block_hashes().size(), 2u);
  EXPECT_EQ(hash_block_count(0), 0u);
  EXPECT_EQ(hash_block_count(BlockHasher::kHashBlockBytes + 1), 2u);
}

// For each thread count and n, parallel_for calls fn on the documented static split: chunk t is
// [n*t/T, n*(t+1)/T), empty chunks skipped, every index covered exactly once.
TEST(ThreadPool, ParallelForCoversEachIndexOnceOnTheStaticSplit) {
  for (int T = 1; T <= 4; ++T) {
    ThreadPool pool(T);
    EXPECT_EQ(pool.threads(), T);
    for (int64_t n : {0, 1, 2, 3, 5, 7, 100, 1001}) {
      SCOPED_TRACE(std::to_string(T) + " threads, n " + std::to_string(n));
      std::vector<std::atomic<int>> hits(n);
      std::vector<std::pair<int64_t, int64_t>> chunks(T, {-1, -1});
      std::atomic<int> calls{0};
      pool.parallel_for(n, [&](int64_t b, int64_t e) {
        ++calls;
        for (int64_t i = b; i < e; ++i) hits[i]++;
        for (int t = 0; t < T; ++t)
          if (chunk_begin(n, t, T) == b && chunk_begin(n, t + 1, T) == e) chunks[t] = {b, e};
      });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "index " << i;
      int expected_calls = 0;
      for (int t = 0; t < T; ++t) {
        const int64_t b = chunk_begin(n, t, T), e = chunk_begin(n, t + 1, T);
        if (b < e && T > 1 && n > 1) {
          ++expected_calls;
          EXPECT_EQ(chunks[t], std::make_pair(b, e)) << "chunk " << t;
        }
      }
      // One thread (or one element) runs the whole range as a single call.
      if (T == 1 || n == 1) expected_calls = n > 0 ? 1 : 0;
      EXPECT_EQ(calls.load(), expected_calls);
    }
  }
}

TEST(ThreadPool, RunOnAllCallsEachWorkerOnce) {
  ThreadPool pool(3);
  std::vector<std::atomic<int>> seen(3);
  std::vector<std::thread::id> ids(3);
  pool.run_on_all([&](int t) {
    seen[t]++;
    ids[t] = std::this_thread::get_id();
  });
  for (int t = 0; t < 3; ++t) EXPECT_EQ(seen[t].load(), 1);
  EXPECT_EQ(ids[0], std::this_thread::get_id());  // the caller runs part 0
  EXPECT_NE(ids[1], ids[2]);
}

// run_parts runs every part exactly once, in any pool of 1 to 4 threads, also when the caller is
// slow to finish its own part (the workers claim the rest); exceptions reach the caller.
TEST(ThreadPool, RunPartsRunsEachPartOnce) {
  for (int T = 1; T <= 4; ++T) {
    ThreadPool pool(T);
    for (int64_t parts : {0, 1, 2, 3, 7, 100}) {
      for (int round = 0; round < 20; ++round) {
        std::vector<std::atomic<int>> hits(static_cast<size_t>(parts));
        pool.run_parts(parts, [&](int64_t p) {
          if (p == 0 && round % 2) std::this_thread::sleep_for(std::chrono::microseconds(200));
          hits[static_cast<size_t>(p)]++;
        });
        for (int64_t p = 0; p < parts; ++p) ASSERT_EQ(hits[p].load(), 1) << T << " threads, part " << p;
      }
    }
    if (T > 1) {
      EXPECT_THROW(pool.run_parts(9,
                                  [](int64_t p) {
                                    if (p == 8) user_error("part ", p);
                                  }),
                   UserError);
      std::atomic<int64_t> sum{0};
      pool.run_parts(9, [&](int64_t p) { sum += p; });
      EXPECT_EQ(sum.load(), 36);
    }
  }
}

TEST(ThreadPool, ExceptionsPropagateToTheCaller) {
  ThreadPool pool(3);
  // Thrown on a worker (the last chunk), and on the caller (chunk 0).
  for (int64_t thrower : {99, 0}) {
    try {
      pool.parallel_for(100, [&](int64_t b, int64_t e) {
        if (b <= thrower && thrower < e) throw std::runtime_error("boom " + std::to_string(b));
      });
      ADD_FAILURE() << "no exception";
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(std::string(e.what()), "boom " + std::to_string(chunk_begin(100, thrower ? 2 : 0, 3)));
    }
  }
  EXPECT_THROW(pool.parallel_for(10, [](int64_t, int64_t) { user_error("bad"); }), UserError);
  // The pool still works afterwards, and the error does not resurface.
  std::atomic<int64_t> sum{0};
  pool.parallel_for(100, [&](int64_t b, int64_t e) { sum += e - b; });
  EXPECT_EQ(sum.load(), 100);
}

TEST(ThreadPool, NestedParallelForRunsInline) {
  ThreadPool pool(2);
  ThreadPool::Bind bind(&pool);
  EXPECT_EQ(ThreadPool::current(), &pool);
  EXPECT_EQ(current_threads(), 2);
  std::vector<int> inner_calls(2, 0);
  std::vector<std::pair<int64_t, int64_t>> inner_range(2);
  parallel_for(2, [&](int64_t b, int64_t e) {
    const auto outer = std::this_thread::get_id();
    parallel_for(50, [&](int64_t ib, int64_t ie) {
      EXPECT_EQ(std::this_thread::get_id(), outer);
      ++inner_calls[b];
      inner_range[b] = {ib, ie};
    });
  });
  for (int t = 0; t < 2; ++t) {
    EXPECT_EQ(inner_calls[t], 1);
    EXPECT_EQ(inner_range[t], std::make_pair(int64_t{0}, int64_t{50}));
  }
}

TEST(ThreadPool, WithoutABoundPoolRunsInline) {
  ASSERT_EQ(ThreadPool::current(), nullptr);
  EXPECT_EQ(current_threads(), 1);
  int calls = 0;
  parallel_for(10, [&](int64_t b, int64_t e) {
    ++calls;
    EXPECT_EQ(b, 0);
    EXPECT_EQ(e, 10);
  });
  parallel_for(0, [&](int64_t, int64_t) { ++calls; });
  EXPECT_EQ(calls, 1);
  {
    ThreadPool pool(2);
    ThreadPool::Bind bind(&pool);
    {
      ThreadPool inner(3);
      ThreadPool::Bind rebind(&inner);
      EXPECT_EQ(current_threads(), 3);
    }
    EXPECT_EQ(ThreadPool::current(), &pool);
  }
  EXPECT_EQ(ThreadPool::current(), nullptr);
}

TEST(Errors, CheckNamesFileLineAndCondition) {
  const int value = 3;
  const int line = __LINE__ + 2;
  try {
    LOCKSTEP_CHECK(value == 4, "value is ", value);
    ADD_FAILURE() << "check passed";
  } catch (const InternalError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("test_core.cpp:" + std::to_string(line)), std::string::npos) << msg;
    EXPECT_NE(msg.find("value == 4"), std::string::npos) << msg;
    EXPECT_NE(msg.find("value is 3"), std::string::npos) << msg;
  }
  EXPECT_NO_THROW(LOCKSTEP_CHECK(value == 3));
  EXPECT_THROW(LOCKSTEP_CHECK(false), InternalError);
}

TEST(Errors, UserErrorCarriesItsMessage) {
  try {
    user_error("model.num_layers must be positive, got ", -2);
    ADD_FAILURE() << "no exception";
  } catch (const UserError& e) {
    EXPECT_EQ(std::string(e.what()), "model.num_layers must be positive, got -2");
  }
  EXPECT_EQ(str("a", 1, '/', 2.5), "a1/2.5");
}

TEST(Tensor, ShapeAlignmentAndZeroing) {
  const Shape s{4, 3, 5};
  EXPECT_EQ(s.rank(), 3);
  EXPECT_EQ(s.numel(), 60);
  EXPECT_EQ(s.to_string(), "(4, 3, 5)");
  EXPECT_EQ(Shape{}.numel(), 1);
  Tensor t(Shape{7, 3}, DType::bf16);
  EXPECT_EQ(t.nbytes(), 42u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.view().data) % 64, 0u);
  const auto* bytes = static_cast<const unsigned char*>(t.view().data);
  EXPECT_TRUE(std::all_of(bytes, bytes + t.nbytes(), [](unsigned char b) { return b == 0; }));
  EXPECT_THROW(t.f32(), InternalError);
  FloatBuffer buf(33);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buf.data()) % 64, 0u);
  for (int64_t i = 0; i < buf.size(); ++i) EXPECT_EQ(buf[i], 0.0f);
}

}  // namespace
}  // namespace lockstep
