// The optimizer's fingerprint hashes (train/optimizer.h: ShardHashes over Optimizer::update). The
// AdamW and sum-of-squares ops on every backend are tested by the op harness: tests/ops/optimizer.cpp.
#include <filesystem>
#include <string>
#include <vector>

#include "lockstep/core/error.h"
#include "lockstep/core/hash.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/train/checkpoint.h"
#include "lockstep/train/fingerprint.h"
#include "lockstep/train/optimizer.h"
#include "lockstep/train/trainer.h"
#include "model_testing.h"
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

// The precision-aware optimizer (optimizer.exp_avg_dtype / exp_avg_sq_dtype = "bf16"): the moments
// take half the bytes; the fingerprint's shard hashes of the bf16 moments equal BlockHasher over
// them (Optimizer::hash), with one update call or two, on 1 and 2 threads.
TEST(PrecisionAwareOptimizer, Bf16MomentsHashAsTheyAreStored) {
  const std::vector<ParamRange> shard = {{0, 1000, 2 * 262144 + 900}, {2, 100, 4000}, {1, 0, 10}};
  OptimizerConfig oc;
  oc.exp_avg_dtype = oc.exp_avg_sq_dtype = "bf16";
  std::vector<uint64_t> moments;
  for (int threads : {1, 2})
    for (bool split : {false, true}) {
      with_threads(threads, [&] {
        ParamStore ps = hash_table();
        Optimizer opt(ps, oc, shard);
        EXPECT_EQ(opt.state_bytes(), Optimizer(ps, OptimizerConfig{}, shard).state_bytes() / 2);
        ShardHashes h(shard);
        if (split) {
          opt.update(ps, 1, 1e-3, 1.0f, {shard[0]}, &h);
          opt.update(ps, 1, 1e-3, 1.0f, {shard[1], shard[2]}, &h);
        } else {
          opt.update(ps, 1, 1e-3, 1.0f, shard, &h);
        }
        EXPECT_EQ(h.moments(), opt.hash(shard));
        moments.push_back(h.moments());
        // The same update without hashes (the unhashed bf16 ranges' path) writes the same moments.
        ParamStore plain_ps = hash_table();
        Optimizer plain(plain_ps, oc, shard);
        plain.update(plain_ps, 1, 1e-3, 1.0f);
        EXPECT_EQ(plain.hash(shard), opt.hash(shard));
      });
    }
  for (uint64_t m : moments) EXPECT_EQ(m, moments[0]);
}

// Training with bf16 moments: fingerprints equal over 1 and 2 threads and for a resumed run; the
// checkpoint holds the moments in bf16, and resuming it with fp32 moments is refused by name; the
// loss stays near the fp32 moments' run; alloc_peak_mb falls.
TEST(PrecisionAwareOptimizer, Bf16MomentsTrainDeterministicallyAndResume) {
  testing::TempDir dir;
  auto job = [&](const std::string& out, std::vector<std::string> keys) {
    keys.insert(keys.end(), {"train.out_dir=" + dir.path(out), "train.eval_interval=0", "train.steps=6"});
    return load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/debug.toml", keys);
  };
  const std::vector<std::string> bf16 = {"optimizer.exp_avg_dtype=bf16", "optimizer.exp_avg_sq_dtype=bf16"};
  auto with = [&](std::vector<std::string> keys) {
    keys.insert(keys.end(), bf16.begin(), bf16.end());
    return keys;
  };
  testing::quiet_train(job("a", with({"train.threads=1", "train.save_interval=3"})));
  testing::quiet_train(job("b", with({"train.threads=2"})));
  testing::quiet_train(job("fp32", {}));
  const std::string a = testing::read_file(fingerprint_path(dir.path("a"), 0));
  EXPECT_EQ(a, testing::read_file(fingerprint_path(dir.path("b"), 0)));
  // Resumed from step 3: the same fingerprints from there on.
  std::filesystem::create_directories(dir.path("r"));
  std::filesystem::copy(dir.path("a/checkpoints"), dir.path("r/checkpoints"), std::filesystem::copy_options::recursive);
  std::filesystem::remove_all(dir.path("r/checkpoints/step-00000006"));
  testing::quiet_train(job("r", with({"train.resume=auto"})));
  const std::string r = testing::read_file(fingerprint_path(dir.path("r"), 0));
  EXPECT_NE(r, "");
  EXPECT_NE(a.find(r), std::string::npos) << "the resumed steps' fingerprints are not the uninterrupted run's";
  const CheckpointMetadata meta = read_checkpoint_metadata(dir.path("a/checkpoints/step-00000006"));
  int low = 0;
  for (const CheckpointTensor& t : meta.tensors) low += t.name.rfind("optim/exp_avg", 0) == 0 && t.dtype == DType::bf16;
  EXPECT_GT(low, 0);
  const std::string refused = testing::user_error_of([&] {
    testing::quiet_train(job("a", {"train.resume=auto", "train.steps=8"}));
  });
  EXPECT_NE(refused.find("is bf16"), std::string::npos) << refused;
  // Close to the fp32 moments' losses, and less memory.
  const auto ours = testing::trajectory(dir.path("b")), theirs = testing::trajectory(dir.path("fp32"));
  EXPECT_LT(testing::largest_loss_difference(ours, theirs, 6), 0.02);
  auto peak = [&](const std::string& run) {
    const std::string m = testing::read_file(dir.path(run + "/metrics.jsonl"));
    const size_t at = m.find("\"alloc_peak_mb\":");
    return std::stod(m.substr(at + 16));
  };
  EXPECT_LT(peak("b"), peak("fp32"));
}

}  // namespace
}  // namespace lockstep
