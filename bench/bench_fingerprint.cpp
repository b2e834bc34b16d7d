// The cost of the per-step fingerprint against the training step it fingerprints, side by side in
// one run.
//
//   build/bench_fingerprint [CONFIG.toml] [rounds]     default configs/gpt2-peer.toml, 10 rounds
//
// Each round times one training step (every micro-batch's forward and backward, then AdamW) on 2
// threads, then, five times over, interleaved, on 2 threads unless said:
//   - the fingerprint's hashes as separate passes over memory after the update: BlockHasher
//     (core/hash.h) over the gradients, the parameters + expert biases and both Adam moments, with
//     libxxhash's XXH3 (Debian's build: baseline x86-64, SSE2; what the trainer called first), and
//     with XXH3 compiled inline for AVX2 (core/hash.cpp) on 1 and 2 threads;
//   - what the trainer does: AdamW with ShardHashes (train/optimizer.h: gradients, moments and,
//     with the replicated optimizer, the parameters hashed inside the update, block by block while
//     in cache) minus the plain AdamW; with the distributed optimizer (gradients and moments in the
//     update) plus the parameters' BlockHasher pass after the all-gather.
// Reports the median of each, its share of the step, and the fastest time seen (on a shared
// machine the least disturbed sample); the trainer's rows as the median of the differences taken
// sample by sample.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include <xxhash.h>

#include "lockstep/config/config.h"
#include "lockstep/core/hash.h"
#include "lockstep/core/philox.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/kernels/cpu/gemm.h"
#include "lockstep/model/gpt.h"
#include "lockstep/train/optimizer.h"

using namespace lockstep;

namespace {

double seconds(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const std::string file = argc > 1 ? argv[1] : std::string(LOCKSTEP_SOURCE_DIR) + "/configs/gpt2-peer.toml";
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 10;
  const Config c = load_config(file, {});
  const TrainConfig& tc = c.train;
  GPT model(c.model, tc.micro_batch, c.moe);
  ParamStore& ps = model.params();
  ps.init(tc.seed);
  Optimizer opt(ps, c.optimizer);
  const int64_t N = tc.micro_batch * c.model.seq_length;
  std::vector<int32_t> tokens(static_cast<size_t>(N)), targets(static_cast<size_t>(N));
  const RandomStream rng(tc.seed, purpose_id("bench/tokens"));
  for (int64_t i = 0; i < N; ++i) {
    tokens[i] = static_cast<int32_t>(rng.bits(static_cast<uint64_t>(i)) % static_cast<uint64_t>(c.model.vocab_size));
    targets[i] =
        static_cast<int32_t>(rng.bits(static_cast<uint64_t>(N + i)) % static_cast<uint64_t>(c.model.vocab_size));
  }
  const int64_t n = ps.total();
  ThreadPool one(1), two(2);
  int64_t step = 0;
  auto train_step = [&] {
    ThreadPool::Bind bind(&two);
    ps.zero_grads();
    model.begin_step(tc.seed, ++step);
    for (int64_t m = 0; m < tc.accumulation_steps(); ++m)
      model.forward_backward(tokens.data(), targets.data(), 1.0f / static_cast<float>(N * tc.accumulation_steps()));
    opt.step(ps, step, tc.lr);
  };
  uint64_t sink = 0;
  auto separate_passes = [&] {
    BlockHasher g;
    for (const ParamRange& r : opt.owned())
      g.update(ps.grad(r.param) + r.begin, static_cast<size_t>(r.end - r.begin) * sizeof(float));
    sink ^= g.digest() ^ model.state_hash() ^ opt.hash();
  };
  // BlockHasher's blocks and combine with the library's XXH3, over gradients, parameters and two
  // more buffers of their size (the moments' bytes; hashing speed does not depend on the values).
  const std::vector<float> m_bytes(ps.values(), ps.values() + n), v_bytes(ps.grads(), ps.grads() + n);
  auto library_passes = [&] {
    for (const float* buf :
         std::initializer_list<const float*>{ps.grads(), ps.values(), m_bytes.data(), v_bytes.data()}) {
      const auto* bytes = reinterpret_cast<const unsigned char*>(buf);
      const size_t total = static_cast<size_t>(n) * sizeof(float), block = BlockHasher::kHashBlockBytes;
      const auto blocks = static_cast<int64_t>((total + block - 1) / block);
      std::vector<uint64_t> hashes(2 * static_cast<size_t>(blocks));
      parallel_for(blocks, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          const size_t len = std::min(block, total - static_cast<size_t>(b) * block);
          hashes[2 * b] = XXH3_64bits(bytes + static_cast<size_t>(b) * block, len);
          hashes[2 * b + 1] = len;
        }
      });
      sink ^= XXH3_64bits(hashes.data(), hashes.size() * sizeof(uint64_t));
    }
  };
  // The update alone and with the shard hashes (the same step number each time: only the time
  // matters here).
  auto plain_update = [&] { opt.update(ps, step, tc.lr, 1.0f); };
  auto hashed_update = [&] {  // the distributed optimizer's (on one rank: the whole table)
    ShardHashes h(opt.owned());
    opt.update(ps, step, tc.lr, 1.0f, opt.owned(), &h);
    sink ^= h.grads() ^ h.moments();
  };
  auto hashed_update_params = [&] {  // the replicated optimizer's
    ShardHashes h(opt.owned(), &ps);
    opt.update(ps, step, tc.lr, 1.0f, opt.owned(), &h);
    sink ^= h.grads() ^ h.moments() ^ model.state_hash(h.params());
  };
  auto params_pass = [&] { sink ^= model.state_hash(); };
  std::vector<double> t_step, t_library, t_separate1, t_separate2, t_plain, t_hashed, t_hashed_params, t_params;
  auto on = [](ThreadPool& pool, std::vector<double>& t, const std::function<void()>& fn) {
    ThreadPool::Bind bind(&pool);
    t.push_back(seconds(fn));
  };
  train_step();  // warm-up
  for (int r = 0; r < rounds; ++r) {
    t_step.push_back(seconds(train_step));
    for (int rep = 0; rep < 5; ++rep) {  // hashing is short: more samples, interleaved
      on(two, t_library, library_passes);
      on(one, t_separate1, separate_passes);
      on(two, t_separate2, separate_passes);
      on(two, t_plain, plain_update);
      on(two, t_hashed, hashed_update);
      on(two, t_hashed_params, hashed_update_params);
      on(two, t_params, params_pass);
    }
  }
  const double s = median(t_step);
  std::printf("%s: %.2fM parameters, %.1f MB hashed per fingerprint, %d rounds (checksum %016llx)\n", file.c_str(),
              static_cast<double>(n) / 1e6, 4.0 * static_cast<double>(n) * 4 / 1e6, rounds, (unsigned long long)sink);
  std::printf("%-48s %9.2f ms  (GEMM: %s)\n", "training step, 2 threads", 1e3 * s, gemm_kernel_name());
  auto row = [&](const char* name, double med, double fastest) {
    std::printf("%-48s %9.2f ms  %5.2f%% of the step  (fastest %.2f ms)\n", name, 1e3 * med, 100 * med / s,
                1e3 * fastest);
  };
  auto fastest = [](const std::vector<double>& t) { return *std::min_element(t.begin(), t.end()); };
  row("separate passes, libxxhash XXH3 (before)", median(t_library), fastest(t_library));
  row("separate passes, inline XXH3, 1 thread", median(t_separate1), fastest(t_separate1));
  row("separate passes, inline XXH3", median(t_separate2), fastest(t_separate2));
  row("AdamW (for reference)", median(t_plain), fastest(t_plain));
  row("AdamW with the shard hashes", median(t_hashed), fastest(t_hashed));
  row("AdamW with the shard and parameter hashes", median(t_hashed_params), fastest(t_hashed_params));
  row("parameters pass", median(t_params), fastest(t_params));
  // The trainer's cost, sample by sample (each sample's timings ran back to back), then their
  // median: robust to a disturbance that hits one of the updates.
  std::vector<double> replicated, distributed;
  for (size_t i = 0; i < t_plain.size(); ++i) {
    replicated.push_back(t_hashed_params[i] - t_plain[i]);
    distributed.push_back(t_hashed[i] - t_plain[i] + t_params[i]);
  }
  auto difference = [&](const char* name, const std::vector<double>& d) {
    std::printf("%-48s %9.2f ms  %5.2f%% of the step  (median of the differences)\n", name, 1e3 * median(d),
                100 * median(d) / s);
  };
  difference("trainer, replicated optimizer (in the update)", replicated);
  difference("trainer, distributed (update + params pass)", distributed);
  return 0;
}
