// The optimizer's fingerprint hashes (train/optimizer.h: ShardHashes over Optimizer::update). The
// AdamW and sum-of-squares ops on every backend are tested by the op harness: tests/ops/optimizer.cpp.
#include <string>
#include <vector>

#include "lockstep/core/error.h"
#include "lockstep/core/hash.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/train/optimizer.h"
#include "testing.h"

namespace lockstep {
namespace {

using testing::bitwise_equal;
using testing::randn;
using testing::with_threads;

// A parameter table with one parameter of three 1 MiB hash blocks' worth (the last one short) and
// two small ones; grads random.
ParamStore hash_table() {
  ParamStore ps;
  ps.add("big", Shape{2 * 262144 + 1000}, Init::normal, 0.02f, true);
  ps.add("small", Shape{10}, Init::ones);
  ps.add("mid", Shape{5000}, Init::normal, 0.02f, true);
  ps.allocate();
  ps.init(5);
  const auto g = randn(ps.total(), 31, "grads");
  std::copy(g.begin(), g.end(), ps.grads());
  return ps;
}

// The fingerprint's shard hashes taken inside the update equal BlockHasher over the shard's
// gradients and (Optimizer::hash) moments after a plain update, each range on its parameter's own
// grid, which they leave bitwise alone; with 1, 2 and 3 threads; whether one update call covers
// the shard (replicated optimizer, shard ranges inside whole parameters, the parameters' values
// hashed too) or two calls do (the distributed optimizer's buckets).
TEST(ShardHashes, EqualBlockHashesAfterAPlainUpdateForAnyThreadsAndCalls) {
  const std::vector<ParamRange> shard = {{0, 1000, 2 * 262144 + 900}, {2, 100, 4000}, {1, 0, 10}};
  ParamStore plain = hash_table();
  Optimizer reference(plain, OptimizerConfig{});
  reference.update(plain, 1, 1e-2, 0.5f);
  BlockHasher grads, values;
  for (const ParamRange& r : shard) grads.update_elements(plain.grad(r.param) + r.begin, r.begin, r.end);
  for (int p = 0; p < 3; ++p)
    values.update(plain.value(p), static_cast<size_t>(plain.specs()[p].shape.numel()) * sizeof(float));
  const std::vector<float> params(plain.values(), plain.values() + plain.total());
  for (int threads = 1; threads <= 3; ++threads)
    with_threads(threads, [&] {
      ParamStore ps = hash_table();
      Optimizer opt(ps, OptimizerConfig{});
      ShardHashes h(shard, &ps);
      opt.update(ps, 1, 1e-2, 0.5f, opt.owned(), &h);
      EXPECT_TRUE(bitwise_equal(params, std::vector<float>(ps.values(), ps.values() + ps.total()), "params"));
      EXPECT_EQ(h.grads(), grads.digest()) << threads << " threads";
      EXPECT_EQ(h.moments(), reference.hash(shard)) << threads << " threads";
      EXPECT_EQ(h.params(), values.block_hashes()) << threads << " threads";
      // Owning the shard only, updated in two calls in another order.
      ParamStore ps2 = hash_table();
      Optimizer own(ps2, OptimizerConfig{}, shard);
      ShardHashes h2(shard);
      own.update(ps2, 1, 1e-2, 0.5f, {shard[2], shard[1]}, &h2);
      EXPECT_THROW(h2.grads(), InternalError) << "a range not updated yet";
      own.update(ps2, 1, 1e-2, 0.5f, {shard[0]}, &h2);
      EXPECT_EQ(h2.grads(), grads.digest());
      EXPECT_EQ(h2.moments(), reference.hash(shard));
      EXPECT_THROW(h2.params(), InternalError) << "made without the parameters";
    });
  // The grid is the parameter's: a range starting inside a block hashes that block's rest as one.
  EXPECT_NE(grads.digest(), [&] {
    BlockHasher from_range_start;
    for (const ParamRange& r : shard)
      from_range_start.update(plain.grad(r.param) + r.begin, static_cast<size_t>(r.end - r.begin) * sizeof(float));
    return from_range_start.digest();
  }());
  // A covered part split over two update calls cannot be hashed in one pass; with the parameters
  // covered, a parameter updated in part cannot either.
  ParamStore ps = hash_table();
  Optimizer opt(ps, OptimizerConfig{});
  ShardHashes h(shard);
  EXPECT_THROW(opt.update(ps, 1, 1e-2, 0.5f, {{0, 0, 5000}}, &h), InternalError);
  ShardHashes with_params(shard, &ps);
  EXPECT_THROW(opt.update(ps, 1, 1e-2, 0.5f, {{2, 0, 4500}}, &with_params), InternalError);
}

}  // namespace
}  // namespace lockstep
