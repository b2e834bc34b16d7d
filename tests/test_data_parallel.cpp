// Data parallelism (parallel/data_parallel.h) through the trainer on the threads backend: the same
// global batch on 1, 2 and 4 data-parallel ranks gives the same losses (within rounding: the
// gradient sums over micro-batches and ranks associate differently); each layout is bitwise
// deterministic; the replicated and the distributed optimizer, overlap on and off, give the same
// bits; the distributed optimizer's state shrinks as 1 / DP.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "lockstep/comm/communicator.h"
#include "lockstep/comm/mesh.h"
#include "lockstep/comm/threads/thread_transport.h"
#include "lockstep/config/config.h"
#include "lockstep/core/philox.h"
#include "lockstep/core/tree_sum.h"
#include "lockstep/model/gpt.h"
#include "lockstep/parallel/data_parallel.h"
#include "lockstep/train/fingerprint.h"
#include "lockstep/train/optimizer.h"
#include "lockstep/train/trainer.h"
#include "model_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

using testing::read_file;
using testing::TempDir;
using testing::train_ranks;

Config job(const std::string& preset, const std::string& out_dir, std::vector<std::string> extra = {}) {
  std::vector<std::string> o = {"train.steps=4", "train.eval_interval=0", "train.threads=1",
                                "data.synthetic_bytes=65536", "train.out_dir=" + out_dir};
  o.insert(o.end(), extra.begin(), extra.end());
  return load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/" + preset + ".toml", o);
}

// The exact training loss of every step, from rank 0's fingerprints.
std::vector<double> losses(const std::string& run_dir) {
  std::vector<double> out;
  std::istringstream in(read_file(fingerprint_path(run_dir, 0)));
  for (std::string line; std::getline(in, line);)
    out.push_back(
        std::bit_cast<double>(std::stoull(nlohmann::json::parse(line)["loss"].get<std::string>(), nullptr, 16)));
  return out;
}

// Every rank's fingerprint file, concatenated.
std::string fingerprints(const std::string& run_dir, int ranks) {
  std::string all;
  for (int r = 0; r < ranks; ++r) all += read_file(fingerprint_path(run_dir, r));
  return all;
}

// Global batch 8 as 4 micro-batches of 2 on one rank, 2 on each of 2 ranks, 1 on each of 4.
void same_losses_on_1_2_4_ranks(const std::string& preset, std::vector<std::string> extra = {}) {
  TempDir dir;
  extra.push_back("train.micro_batch=2");
  std::vector<std::vector<double>> l;
  for (int ranks : {1, 2, 4}) {
    const std::string out = dir.path("dp" + std::to_string(ranks));
    train_ranks(ranks, job(preset, out, extra));
    l.push_back(losses(out));
    ASSERT_EQ(l.back().size(), 4u) << "dp " << ranks;
  }
  for (size_t s = 0; s < l[0].size(); ++s) {
    double worst = 0;
    for (size_t k = 1; k < l.size(); ++k) worst = std::max(worst, std::fabs(l[k][s] - l[0][s]));
    std::printf("[ %s ] step %zu: loss %.9f (dp 1), largest |difference| over dp 2, 4: %.3g\n", preset.c_str(), s + 1,
                l[0][s], worst);
    EXPECT_LT(worst, 1e-6 * std::fabs(l[0][s])) << preset << " step " << s + 1;
  }
}

TEST(DataParallel, DenseSameGlobalBatchSameLossesOnOneTwoFourRanks) { same_losses_on_1_2_4_ranks("debug"); }

// The MoE preset with the aux-loss-free expert bias too: the token counts of its update are summed
// over the data-parallel ranks.
TEST(DataParallel, MoeSameGlobalBatchSameLossesOnOneTwoFourRanks) {
  same_losses_on_1_2_4_ranks("moe-debug", {"moe.router_score_function=sigmoid", "moe.router_enable_expert_bias=true",
                                           "moe.router_bias_update_rate=0.01"});
}

// Each layout, run twice: identical fingerprints on every rank. Then the distributed optimizer, and
// overlap switched, leave every fingerprint as it was (several buckets per buffer).
void bitwise_run_to_run_and_across_optimizer_and_overlap(const std::string& preset) {
  for (int ranks : {2, 4}) {
    TempDir dir;
    const std::vector<std::string> base = {"train.micro_batch=2", "train.steps=2", "ddp.bucket_size=20000"};
    auto with = [&](std::vector<std::string> more) {
      more.insert(more.begin(), base.begin(), base.end());
      return more;
    };
    train_ranks(ranks, job(preset, dir.path("a"), with({})));
    const std::string a = fingerprints(dir.path("a"), ranks);
    ASSERT_NE(a.find("\"step\":2"), std::string::npos);
    train_ranks(ranks, job(preset, dir.path("b"), with({})));
    EXPECT_EQ(fingerprints(dir.path("b"), ranks), a) << preset << " dp " << ranks << ": run to run";
    train_ranks(ranks, job(preset, dir.path("c"), with({"optimizer.distributed=true"})));
    EXPECT_EQ(fingerprints(dir.path("c"), ranks), a) << preset << " dp " << ranks << ": distributed optimizer";
    train_ranks(
        ranks,
        job(preset, dir.path("d"),
            with({"optimizer.distributed=true", "ddp.overlap_grad_reduce=false", "ddp.overlap_param_gather=true"})));
    EXPECT_EQ(fingerprints(dir.path("d"), ranks), a) << preset << " dp " << ranks << ": overlap switched";
  }
}

TEST(DataParallel, DenseBitwiseRunToRunAndAcrossOptimizerAndOverlap) {
  bitwise_run_to_run_and_across_optimizer_and_overlap("debug");
}
TEST(DataParallel, MoeBitwiseRunToRunAndAcrossOptimizerAndOverlap) {
  bitwise_run_to_run_and_across_optimizer_and_overlap("moe-debug");
}

// The state hashes cut every parameter on its own 1 MiB grid (train/fingerprint.h, format 2): with
// a word embedding of 16000 x 64 floats (four blocks), whose shard on dp rank 1 starts inside one
// block and crosses the next bound (its gradient and moment hashes differ from format 1's: checked
// against a format 1 binary), the replicated optimizer (parameters hashed in the update) and the
// distributed one (parameters hashed after the all-gather) give the same fingerprints.
TEST(DataParallel, StateHashesOfAMultiBlockParameterAgreeAcrossOptimizers) {
  TempDir dir;
  const std::vector<std::string> base = {"model.vocab_size=16000", "train.micro_batch=2", "train.steps=2"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), base.begin(), base.end());
    return more;
  };
  train_ranks(2, job("debug", dir.path("a"), with({})));
  train_ranks(2, job("debug", dir.path("b"), with({"optimizer.distributed=true"})));
  const std::string a = fingerprints(dir.path("a"), 2);
  ASSERT_NE(a.find("\"step\":2"), std::string::npos);
  EXPECT_NE(a.find("\"format\":2"), std::string::npos);
  EXPECT_EQ(fingerprints(dir.path("b"), 2), a);
}

// Rank r's fingerprint names its coordinates; rank 0 alone writes the run's files.
TEST(DataParallel, RanksWriteTheirCoordinates) {
  TempDir dir;
  train_ranks(2, job("debug", dir.path("run"), {"train.steps=1"}));
  for (int r = 0; r < 2; ++r)
    EXPECT_NE(read_file(fingerprint_path(dir.path("run"), r)).find(str("\"rank\":", r, ",\"dp\":", r, ",")),
              std::string::npos);
  EXPECT_FALSE(read_file(dir.path("run") + "/metrics.jsonl").empty());
  EXPECT_FALSE(read_file(dir.path("run") + "/config.toml").empty());
}

TEST(DataParallel, GlobalBatchMustDivideByMicroBatchTimesDp) {
  TempDir dir;
  const Config c = job("debug", dir.path("run"));  // global 8, micro 4
  std::string message = "(no error)";
  try {
    train_ranks(3, c);
  } catch (const std::exception& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("train.global_batch = 8 is not divisible by train.micro_batch (4) x data-parallel size (3"),
            std::string::npos)
      << message;
  EXPECT_FALSE(std::filesystem::exists(dir.path("run"))) << "nothing is written";
}

// The distributed optimizer's Adam state: every element owned by exactly one rank of the group, at
// most a bucket's padding more than 1 / DP of the parameters each.
TEST(DataParallel, DistributedOptimizerStateShrinksAsOneOverDp) {
  const Config c = job("moe-debug", "unused", {"ddp.bucket_size=30000"});
  int64_t elements = 0;
  {
    GPT model(c.model, 1, c.moe);
    for (const ParamSpec& p : model.params().specs()) elements += p.shape.numel();
  }
  for (int ranks : {1, 2, 3, 4}) {
    std::vector<int64_t> bytes(static_cast<size_t>(ranks));
    std::vector<int64_t> buckets(static_cast<size_t>(ranks));
    run_threads(ranks, 60, [&](Communicator& comm) {
      GPT model(c.model, 1, c.moe);
      const Mesh mesh(comm.size(), {});
      Communicator dense = comm.split_groups(mesh.groups(MeshGroup::dp_cp));
      Communicator expert = comm.split_groups(mesh.groups(MeshGroup::edp));
      DataParallel dp(model.params(), dense, expert, c.ddp, /*distributed=*/true);
      const Optimizer opt(model.params(), c.optimizer, dp.optimizer_ranges());
      bytes[static_cast<size_t>(comm.rank())] = opt.state_bytes();
      buckets[static_cast<size_t>(comm.rank())] = dp.num_buckets();
    });
    int64_t sum = 0;
    for (int r = 0; r < ranks; ++r) {
      sum += bytes[static_cast<size_t>(r)];
      std::printf("[ state ] dp %d rank %d: %lld bytes of Adam state (%lld parameters, %lld buckets)\n", ranks, r,
                  (long long)bytes[static_cast<size_t>(r)], (long long)elements, (long long)buckets[0]);
      EXPECT_LE(bytes[static_cast<size_t>(r)], 8 * (elements / ranks + buckets[0])) << "dp " << ranks << " rank " << r;
    }
    EXPECT_EQ(sum, 8 * elements) << "dp " << ranks;
    EXPECT_GT(buckets[0], 2);  // dense and expert buckets
  }
}

// The overlap happens: on the last micro-batch backward itself posts every bucket's reduction, and
// with the gather in the background the next forward completes every bucket's gather.
TEST(DataParallel, BackwardPostsEveryBucketAndForwardCompletesEveryGather) {
  const Config c = job("moe-debug", "unused", {"ddp.bucket_size=20000", "ddp.overlap_param_gather=true"});
  const int64_t N = c.train.micro_batch * c.model.seq_length;
  const std::vector<int32_t> tokens = testing::random_ints(N, 256, 1, "tokens"),
                             targets = testing::random_ints(N, 256, 2, "targets");
  run_threads(2, 60, [&](Communicator& comm) {
    GPT model(c.model, c.train.micro_batch, c.moe);
    model.params().init(1);
    const Mesh mesh(comm.size(), {});
    Communicator dense = comm.split_groups(mesh.groups(MeshGroup::dp_cp));
    Communicator expert = comm.split_groups(mesh.groups(MeshGroup::edp));
    DataParallel dp(model.params(), dense, expert, c.ddp, /*distributed=*/true);
    Optimizer opt(model.params(), c.optimizer, dp.optimizer_ranges());
    model.set_grads_ready_hook([&](int first, int end) { dp.grads_ready(first, end); });
    model.set_params_needed_hook([&](int first, int end) { dp.params_needed(first, end); });
    ASSERT_GT(dp.num_buckets(), 3);
    model.params().zero_grads();
    model.begin_step(1, 1);
    dp.begin_last_micro();
    model.forward_backward(tokens.data(), targets.data(), 1.0f / static_cast<float>(N));
    EXPECT_EQ(dp.buckets_posted_in_backward(), dp.num_buckets());
    dp.finish_grad_sync();
    const float clip = opt.clip_scale(dp.grad_norm());
    dp.step([&](const std::vector<ParamRange>& ranges) { opt.update(model.params(), 1, 1e-3, clip, ranges); });
    EXPECT_EQ(dp.gathers_completed_in_forward(), 0);
    model.evaluate(tokens.data(), targets.data());
    EXPECT_EQ(dp.gathers_completed_in_forward(), dp.num_buckets());
  });
}

// determinism = "layout", driven without a model: micro-batch g's gradient is a fixed random leaf,
// the P ranks push their A each (rank r: g = r A .. r A + A - 1) and reduce. Every summed element
// (every one replicated, the shard distributed) is the canonical tree over the M = P A leaves, bit
// for bit, whether the blocks are subtrees (A = 2, 4: tree_sum) or go as pieces (A = 3, 5); and a
// rank with K pieces sends exactly K times the power-of-two layout's bytes in the distributed
// optimizer's reduce-scatter (the figure docs/design/reductions.md#canonical-pieces-blocks-that-are-not-subtrees
// quotes).
TEST(DataParallel, LayoutReducesAnyBlocksToTheTreeAtKTimesTheBytes) {
  const Config c = job("debug", "unused", {"ddp.bucket_size=20000"});
  auto leaf = [](int64_t g, int p, int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    RandomStream(100 + static_cast<uint64_t>(g), static_cast<uint64_t>(p)).fill_normal(v.data(), n, 1.0f);
    return v;
  };
  for (const bool distributed : {true, false})
    for (const int P : {2, 3}) {
      std::map<int64_t, std::vector<int64_t>> sent;  // per A, per rank
      for (const int64_t A : {2, 3, 4, 5}) {
        std::vector<int64_t>& bytes = sent[A];
        bytes.assign(static_cast<size_t>(P), 0);
        run_threads(P, 60, [&](Communicator& comm) {
          GPT model(c.model, 1, c.moe);
          ParamStore& ps = model.params();
          const Mesh mesh(comm.size(), {});
          Communicator dense = comm.split_groups(mesh.groups(MeshGroup::dp_cp));
          Communicator expert = comm.split_groups(mesh.groups(MeshGroup::edp));
          DataParallel dp(ps, dense, expert, c.ddp, distributed);
          dp.set_layout(A, &comm);
          ps.zero_grads();
          const int np = static_cast<int>(ps.specs().size()), r = comm.rank();
          const int64_t before = dense.bytes_sent() + expert.bytes_sent();  // (overlap posts in grads_ready)
          for (int64_t m = 0; m < A; ++m) {
            for (int p = 0; p < np; ++p) {
              const std::vector<float> x = leaf(r * A + m, p, ps.specs()[p].shape.numel());
              std::copy(x.begin(), x.end(), ps.grad(p));
            }
            dp.begin_micro(m);
            if (m == A - 1) dp.begin_last_micro();
            dp.grads_ready(0, np);
          }
          dp.finish_grad_sync();
          bytes[static_cast<size_t>(r)] = dense.bytes_sent() + expert.bytes_sent() - before;
          for (const ParamRange& x : dp.optimizer_ranges()) {
            std::vector<std::vector<float>> leaves;
            std::vector<const float*> at;
            for (int64_t g = 0; g < P * A; ++g) leaves.push_back(leaf(g, x.param, ps.specs()[x.param].shape.numel()));
            for (const auto& l : leaves) at.push_back(l.data());
            const int64_t n = ps.specs()[x.param].shape.numel();
            std::vector<float> want(static_cast<size_t>(n)), stack(static_cast<size_t>(tree_sum_stack(P * A) * n));
            tree_sum(want.data(), at.data(), P * A, n, stack.data());
            for (int64_t i = x.begin; i < x.end; ++i)
              ASSERT_EQ(std::bit_cast<uint32_t>(ps.grad(x.param)[i]),
                        std::bit_cast<uint32_t>(want[static_cast<size_t>(i)]))
                  << "P " << P << " A " << A << (distributed ? " distributed" : " replicated") << ": "
                  << ps.specs()[x.param].name << "[" << i << "] on rank " << r;
          }
        });
      }
      for (const int64_t A : {3, 5})
        for (int r = 0; r < P; ++r) {
          const int64_t K = static_cast<int64_t>(canonical_pieces(P * A, r * A, (r + 1) * A).size()) - 1;
          const int64_t got = sent[A][static_cast<size_t>(r)], pow2 = sent[2][static_cast<size_t>(r)];
          std::printf(
              "[ wire ] %s, dp %d, %lld micro-batches per rank: rank %d sends %lld bytes, %lld pieces x "
              "%lld (A = 2)\n",
              distributed ? "reduce-scatter" : "all-reduce", P, (long long)A, r, (long long)got, (long long)K,
              (long long)pow2);
          EXPECT_EQ(sent[4][static_cast<size_t>(r)], pow2) << "power-of-two blocks cost the same";
          if (distributed)
            EXPECT_EQ(got, K * pow2) << "P " << P << " A " << A << " rank " << r;
          else
            EXPECT_LT(got, K * pow2) << "the all-gather half is not repeated";
        }
    }
}

// determinism = "layout" under expert parallelism with pieces in both groups (EP 2 x EDP 2, 3 or 5
// micro-batches per rank): the experts' piece tables are other elements of the dense tree's piece
// buffers (the tree sums the dense parameters only), so they share them: a rank holds max(K - 1,
// K_expert - 1) extra gradient-sized buffers, not K - 1 + K_expert - 1.
TEST(DataParallel, LayoutExpertPiecesShareTheDenseTreesBuffers) {
  const Config c = job("moe-debug", "unused");
  for (const int64_t A : {3, 5})
    run_threads(4, 60, [&](Communicator& comm) {
      GPT model(c.model, 1, c.moe);
      const Mesh mesh(comm.size(), {1, 1, 1, 2, 1});
      Communicator dense = comm.split_groups(mesh.groups(MeshGroup::dp_cp));
      Communicator expert = comm.split_groups(mesh.groups(MeshGroup::edp));
      DataParallel dp(model.params(), dense, expert, c.ddp, /*distributed=*/true);
      dp.set_layout(A, &comm, /*experts_summed=*/true);
      const int64_t r = dense.rank(), g = expert.rank(), M = 4 * A;
      const int64_t K = static_cast<int64_t>(canonical_pieces(M, r * A, (r + 1) * A).size()) - 1;
      const int64_t Ke = static_cast<int64_t>(canonical_pieces(M, g * 2 * A, (g + 1) * 2 * A).size()) - 1;
      ASSERT_EQ(static_cast<int64_t>(dp.expert_pieces().size()), Ke - 1) << "A " << A << " rank " << r;
      EXPECT_EQ(dp.piece_buffers(), std::max(K, Ke) - 1)
          << "A " << A << " rank " << r << ": " << K << " dense, " << Ke << " expert pieces";
    });
}

}  // namespace
}  // namespace lockstep
