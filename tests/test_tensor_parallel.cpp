// Tensor and sequence parallelism (parallel/tensor_parallel.h): each rank's parameter shards are
// exactly the single-process weights at their boxes; a layout is bitwise deterministic run to run
// and across thread counts; the pairs of communication ops are each other's adjoints; the
// communication volume is the formula's; bad layouts are one clear error. The losses of every TP /
// SP / DP layout against one process: test_parallel_layouts.cpp.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "lockstep/comm/communicator.h"
#include "lockstep/comm/mesh.h"
#include "lockstep/comm/threads/thread_transport.h"
#include "lockstep/config/config.h"
#include "lockstep/core/thread_pool.h"
#include "lockstep/model/gpt.h"
#include "lockstep/parallel/tensor_parallel.h"
#include "lockstep/train/fingerprint.h"
#include "lockstep/train/trainer.h"
#include "model_testing.h"
#include "testing.h"

namespace lockstep {
namespace {

using testing::read_file;
using testing::TempDir;
using testing::train_ranks;

// The Llama flavour shrunk for tests, with 8 heads over 4 KV groups so that TP 4 splits both.
const std::vector<std::string> kLlama = {"model.num_layers=2", "model.hidden_size=64", "model.num_heads=8",
                                         "model.num_query_groups=4", "model.seq_length=32", "train.global_batch=8"};

Config job(const std::string& preset, const std::string& out_dir, std::vector<std::string> extra = {}) {
  std::vector<std::string> o = {"train.steps=3", "train.eval_interval=0", "train.threads=1", "train.micro_batch=2",
                                "data.synthetic_bytes=65536", "train.out_dir=" + out_dir};
  if (preset == "llama-tiny") o.insert(o.end(), kLlama.begin(), kLlama.end());
  o.insert(o.end(), extra.begin(), extra.end());
  return load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/" + preset + ".toml", o);
}


// A fingerprint field of every step on rank 0, as the exact double.
std::vector<double> field(const std::string& run_dir, const char* name) {
  std::vector<double> out;
  std::istringstream in(read_file(fingerprint_path(run_dir, 0)));
  for (std::string line; std::getline(in, line);)
    out.push_back(std::bit_cast<double>(std::stoull(nlohmann::json::parse(line)[name].get<std::string>(), nullptr, 16)));
  return out;
}

std::string fingerprints(const std::string& run_dir, int ranks) {
  std::string all;
  for (int r = 0; r < ranks; ++r) all += read_file(fingerprint_path(run_dir, r));
  return all;
}

// A parameter shard's element (local index i) in the global tensor, by its boxes.
int64_t global_index(const ParamSpec& p, int64_t i) {
  for (const ParamBox& b : p.boxes) {
    const int64_t n = b.shape.numel();
    if (i >= n) {
      i -= n;
      continue;
    }
    int64_t g = 0, rem = i, stride = n;
    for (int d = 0; d < b.shape.rank(); ++d) {
      stride /= b.shape[d];
      const int64_t k = rem / stride;
      rem %= stride;
      g = g * p.global_shape[d] + b.offset[static_cast<size_t>(d)] + k;
    }
    return g;
  }
  ADD_FAILURE() << p.name << ": element " << i << " outside its boxes";
  return 0;
}

// Every parameter of `part` holds exactly full's values at its boxes; covered[parameter of full]
// counts how often each global element was seen.
void expect_shards_of(const GPT& full, const GPT& part, std::vector<std::vector<int>>& covered, const std::string& where) {
  if (covered.empty()) {
    covered.resize(full.params().specs().size());
    for (size_t i = 0; i < covered.size(); ++i) covered[i].assign(static_cast<size_t>(full.params().specs()[i].shape.numel()), 0);
  }
  for (size_t i = 0; i < part.params().specs().size(); ++i) {
    const ParamSpec& p = part.params().specs()[i];
    const int whole = full.params().find(p.name);
    ASSERT_GE(whole, 0) << p.name;
    ASSERT_EQ(p.global_shape, full.params().specs()[whole].shape) << p.name;
    const float* v = part.params().value(static_cast<int>(i));
    const float* w = full.params().value(whole);
    for (int64_t k = 0; k < p.shape.numel(); ++k) {
      const int64_t gk = global_index(p, k);
      ASSERT_EQ(std::bit_cast<uint32_t>(v[k]), std::bit_cast<uint32_t>(w[gk])) << p.name << " " << where;
      covered[static_cast<size_t>(whole)][static_cast<size_t>(gk)] += 1;
    }
  }
}

// Every rank of TP 2 and 4 holds exactly the single-process values at its boxes (Philox by global
// index), and the shards of a tensor tile it once.
void shards_are_the_single_process_weights(const std::string& preset, std::vector<std::string> overrides) {
  overrides.push_back("model.preset=" + preset);
  const Config c = load_config("", overrides);
  GPT full(c.model, 1);
  full.params().init(7);
  for (int tp : {2, 4}) {
    std::vector<std::vector<int>> covered;
    for (int r = 0; r < tp; ++r) {
      TensorParallel g;
      g.rank = r;
      g.size = tp;
      GPT part(c.model, 1, MoeConfig{}, PrecisionConfig{}, g);
      part.params().init(7);
      expect_shards_of(full, part, covered, str("tp ", tp, " rank ", r));
    }
    for (size_t i = 0; i < covered.size(); ++i) {
      const ParamSpec& p = full.params().specs()[i];
      // Sharded tensors are tiled once; the others are replicated on every rank.
      const int expect = covered[i][0] == tp ? tp : 1;
      for (int n : covered[i]) ASSERT_EQ(n, expect) << p.name << " tp " << tp;
    }
  }
}

TEST(TensorParallel, ShardsAreTheSingleProcessWeightsGpt2) {
  shards_are_the_single_process_weights("gpt2", {"model.num_layers=1", "model.hidden_size=32", "model.num_heads=4",
                                                 "model.seq_length=16", "model.vocab_size=256"});
}
TEST(TensorParallel, ShardsAreTheSingleProcessWeightsLlamaGqaSwiglu) {
  shards_are_the_single_process_weights("llama", {"model.num_layers=1", "model.hidden_size=32", "model.num_heads=8",
                                                  "model.num_query_groups=4", "model.seq_length=16", "model.vocab_size=256"});
}

// Expert tensor parallelism (x expert parallelism): every rank holds exactly the single-process
// values at its boxes (each expert's fc rows of its hidden units, of the gate and up sections
// separately, and the proj columns of the same units), the boxes of the (etp x ep) ranks tile each
// expert tensor once, and the proj bias lives on etp rank 0 only.
TEST(ExpertTensorParallel, ShardsAreTheSingleProcessWeights) {
  for (const char* preset : {"gpt2", "llama"}) {
    const Config c = load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/moe-debug.toml", {str("model.preset=", preset)});
    GPT full(c.model, 1, c.moe);
    full.params().init(7);
    for (const auto& [etp, ep] : {std::pair{2, 1}, std::pair{2, 2}}) {
      const int world = etp * ep;
      std::vector<std::vector<std::vector<int>>> covered(static_cast<size_t>(world));  // per rank, per parameter
      run_threads(world, 30, [&](Communicator& comm) {
        const Mesh mesh(world, {1, 1, 1, ep, etp});
        Communicator etp_group = comm.split_groups(mesh.groups(MeshGroup::etp));
        Communicator ep_group = comm.split_groups(mesh.groups(MeshGroup::ep));
        GPT part(c.model, 1, c.moe, PrecisionConfig{}, TensorParallel{}, ep > 1 ? &ep_group : nullptr, &etp_group);
        part.params().init(7);
        expect_shards_of(full, part, covered[static_cast<size_t>(comm.rank())], str(preset, " etp ", etp, " ep ", ep, " rank ", comm.rank()));
      });
      for (size_t i = 0; i < full.params().specs().size(); ++i) {
        const ParamSpec& p = full.params().specs()[i];
        if (!p.expert) continue;
        for (int64_t k = 0; k < p.shape.numel(); ++k) {
          int n = 0;
          for (const auto& cover : covered) n += cover[i][static_cast<size_t>(k)];
          ASSERT_EQ(n, 1) << preset << " " << p.name << " element " << k << " etp " << etp << " ep " << ep;
        }
      }
    }
  }
}

// copy_to_tp / reduce_from_tp and gather_from_sp / scatter_to_sp are adjoint pairs: for random x
// and y, <forward(x), y> = <x, backward(y)> with each op's mirror as its backward.
TEST(TensorParallel, CommunicationPairsAreAdjoint) {
  constexpr int64_t rows = 3, C = 5;
  for (int P : {2, 4}) {
    std::vector<double> lhs(P), rhs(P);
    run_threads(P, 30, [&](Communicator& comm) {
      const TensorParallel tp(&comm, true);
      const int r = comm.rank();
      const std::vector<float> x = testing::randn(rows * C, 1, "x" + std::to_string(r));
      const std::vector<float> y = testing::randn(P * rows * C, 2, "y" + std::to_string(r));
      // gather_from_sp: x (rows) -> (P rows); its backward scatter_to_sp: y (P rows) -> (rows).
      std::vector<float> gx(static_cast<size_t>(P * rows * C)), sy(static_cast<size_t>(rows * C));
      gather_from_sp(tp, gx.data(), x.data(), rows, C);
      scatter_to_sp(tp, sy.data(), y.data(), rows, C);
      double a = 0, b = 0;
      for (size_t i = 0; i < gx.size(); ++i) a += static_cast<double>(gx[i]) * y[i];
      for (size_t i = 0; i < sy.size(); ++i) b += static_cast<double>(sy[i]) * x[i];
      // Summed over ranks, both sides are the same bilinear form.
      comm.all_reduce(&a, 1);
      comm.all_reduce(&b, 1);
      lhs[static_cast<size_t>(r)] = a;
      rhs[static_cast<size_t>(r)] = b;
      // reduce_from_tp: every rank ends with the rank-order sum; copy_to_tp leaves data alone.
      std::vector<float> s = x;
      reduce_from_tp(tp, s.data(), rows * C);
      float expect = 0;
      for (int q = 0; q < P; ++q) expect += testing::randn(rows * C, 1, "x" + std::to_string(q))[0];
      EXPECT_EQ(s[0], expect);
    });
    for (int r = 0; r < P; ++r) EXPECT_NEAR(lhs[static_cast<size_t>(r)], rhs[static_cast<size_t>(r)], 1e-5 * std::fabs(lhs[0]));
  }
}

// The bytes one rank sends in its tensor-parallel group for one micro-batch's forward + backward
// (Communicator::bytes_sent), against the analytic count (docs/parallelism.md): per layer two
// row-parallel outputs reduced in forward and two column-parallel input gradients reduced in
// backward, each an all-reduce of N x C floats (2 (P - 1) / P x N x C sent) or, with sequence
// parallelism, a reduce-scatter plus the mirrored all-gather ((P - 1) / P x N x C each); the
// embedding's and the head's the same once more; and the loss's all-gather of 3 floats per token
// ((P - 1) x 3N sent).
TEST(TensorParallel, CommunicationVolumeMatchesTheFormula) {
  for (const char* preset : {"gpt2", "llama"}) {
    const Config c = load_config("", {"model.preset=" + std::string(preset), "model.num_layers=2", "model.hidden_size=64",
                                      "model.num_heads=4", "model.seq_length=32", "model.vocab_size=256"});
    const int64_t B = 2, N = B * c.model.seq_length, C = c.model.hidden_size, L = c.model.num_layers;
    for (int P : {2, 4})
      for (bool sp : {false, true}) {
        std::vector<int64_t> sent(static_cast<size_t>(P));
        run_threads(P, 30, [&](Communicator& comm) {
          ThreadPool pool(1);
          ThreadPool::Bind bind(&pool);
          GPT model(c.model, B, MoeConfig{}, PrecisionConfig{}, TensorParallel(&comm, sp));
          model.params().init(1);
          const std::vector<int32_t> tokens = testing::random_ints(N, 256, 5, "tokens");
          const int64_t before = comm.bytes_sent();
          model.forward_backward(tokens.data(), tokens.data(), 1.0f / static_cast<float>(N));
          sent[static_cast<size_t>(comm.rank())] = comm.bytes_sent() - before;
        });
        const int64_t floats = (8 * L + 4) * (P - 1) * N * C / P + 3 * N * (P - 1);
        for (int r = 0; r < P; ++r)
          EXPECT_EQ(sent[static_cast<size_t>(r)], 4 * floats) << preset << " tp " << P << (sp ? " sp" : "") << " rank " << r;
        std::printf("[ %s ] tp %d%s: %lld bytes sent per rank per micro-batch (N = %lld, C = %lld, L = %lld)\n", preset, P,
                    sp ? " sp" : "   ", static_cast<long long>(sent[0]), static_cast<long long>(N),
                    static_cast<long long>(C), static_cast<long long>(L));
      }
  }
}

// Per optimizer step (metrics.jsonl's tp_bytes, rank 0): the micro-batches' volume above, plus,
// with sequence parallelism, the all-reduce of the norms' gradients, plus the gradient norm's
// all-gather of one double.
TEST(TensorParallel, CommunicationVolumePerStepMatchesTheFormula) {
  TempDir dir;
  const int64_t N = 2 * 64, C = 64, L = 2, accum = 2;  // debug.toml: micro-batches of 2 x 64 tokens, 8 per step over dp 2
  for (int P : {2, 4})
    for (bool sp : {false, true}) {
      const std::string out = dir.path(str("tp", P, sp));
      train_ranks(2 * P, job("debug", out, {str("parallel.tensor=", P), str("parallel.sequence_parallel=", sp ? "true" : "false")}));
      const int64_t micro = 4 * ((8 * L + 4) * (P - 1) * N * C / P + 3 * N * (P - 1));
      const int64_t norms = (4 * L + 2) * C;  // LayerNorm weight and bias: two per layer and the final one
      const int64_t expect = accum * micro + (sp ? 4 * 2 * (P - 1) * norms / P : 0) + 8 * (P - 1);
      std::istringstream in(read_file(out + "/metrics.jsonl"));
      int steps = 0;
      for (std::string line; std::getline(in, line); ++steps)
        EXPECT_EQ(nlohmann::json::parse(line)["tp_bytes"].get<int64_t>(), expect) << "tp " << P << " sp " << sp;
      EXPECT_EQ(steps, 3);
      std::printf("[ debug, dp 2 ] tp %d%s: %lld bytes sent per rank per step\n", P, sp ? " sp" : "   ", static_cast<long long>(expect));
    }
}

// TP 2 with sequence parallelism and DP 2 (world 4), distributed optimizer: identical fingerprints
// on every rank run to run and with 2 threads per rank instead of 1.
TEST(TensorParallel, BitwiseRunToRunAndAcrossThreads) {
  for (const char* preset : {"debug", "llama-tiny"}) {
    TempDir dir;
    const std::vector<std::string> o = {"parallel.tensor=2", "parallel.sequence_parallel=true", "optimizer.distributed=true"};
    train_ranks(4, job(preset, dir.path("a"), o));
    const std::string a = fingerprints(dir.path("a"), 4);
    ASSERT_NE(a.find("\"step\":3"), std::string::npos);
    EXPECT_NE(a.find("\"tp\":1"), std::string::npos);
    train_ranks(4, job(preset, dir.path("b"), o));
    EXPECT_EQ(fingerprints(dir.path("b"), 4), a) << preset << ": run to run";
    std::vector<std::string> two = o;
    two.push_back("train.threads=2");
    train_ranks(4, job(preset, dir.path("c"), two));
    EXPECT_EQ(fingerprints(dir.path("c"), 4), a) << preset << ": 1 vs 2 threads";
  }
}

TEST(TensorParallel, LayoutErrorsNameTheKeys) {
  auto error = [](std::vector<std::string> o) {
    return testing::user_error_of([&] { load_config(std::string(LOCKSTEP_SOURCE_DIR) + "/configs/debug.toml", o); });
  };
  EXPECT_EQ(error({"parallel.tensor=3"}), "config: model.num_heads = 4 is not divisible by parallel.tensor = 3");
  EXPECT_EQ(error({"model.preset=llama", "model.num_query_groups=2", "parallel.tensor=4"}),
            "config: model.num_query_groups = 2 is not divisible by parallel.tensor = 4");
  EXPECT_EQ(error({"model.vocab_size=258", "parallel.tensor=4"}), "config: model.vocab_size = 258 is not divisible by parallel.tensor = 4");
  EXPECT_EQ(error({"parallel.sequence_parallel=true"}), "config: parallel.sequence_parallel = true needs parallel.tensor > 1 (got 1)");
}

}  // namespace
}  // namespace lockstep
